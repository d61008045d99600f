"""The engine's copy stream: on CUDA a copy runs on a side stream, ordered after the
producer's event on the device and waited for on an event of its own, never on a stream;
on the CPU it runs inline after ``ready.synchronize()``. The CUDA half runs here against a
fake ``torch.cuda`` that records every call; tests/ops/test_ops_gpu.py runs it on a GPU."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from sglang_kvxfer.engine import KVPoll, KVReceiver, KVSender, copystream
from sglang_kvxfer.engine.copystream import CopyStream
from sglang_kvxfer.engine.synthetic import fill_request

from .harness import Cluster, geometry, wait_terminal


class FakeCuda:
    """The slice of ``torch.cuda`` CopyStream uses; ``log`` records calls in order."""

    def __init__(self):
        self.log: list[tuple] = []
        self.current = "default"
        cuda = self

        class Event:
            def __init__(self):
                self.recorded_on = None

            def record(self, stream):
                self.recorded_on = stream.name
                cuda.log.append(("record", stream.name))

            def synchronize(self):
                cuda.log.append(("event.synchronize", self.recorded_on))

        class Stream:
            def __init__(self, device):
                self.name = f"side:{device}"
                cuda.log.append(("new stream", device))

            def wait_event(self, event):
                cuda.log.append(("wait_event", self.name, event))

            def synchronize(self):
                cuda.log.append(("stream.synchronize", self.name))

        self.Event, self.Stream = Event, Stream

    @contextlib.contextmanager
    def stream(self, s):
        before, self.current = self.current, s.name
        try:
            yield
        finally:
            self.current = before


class HostReady:
    """A ``ready`` that is not a CUDA event: only ``synchronize()``."""

    def __init__(self, log):
        self.log = log

    def synchronize(self):
        self.log.append(("ready.synchronize",))


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(copystream, "_torch_cuda", lambda: fake)
    return fake


def test_cuda_copy_runs_on_the_side_stream_after_ready_and_waits_on_an_event(fake_cuda):
    cs = CopyStream("cuda:1")
    ready = fake_cuda.Event()
    seen = []
    result = cs.run(lambda: seen.append(fake_cuda.current) or "copied", ready)
    assert result == "copied" and seen == ["side:cuda:1"]  # the copy ran on the side stream
    assert fake_cuda.log == [
        ("new stream", "cuda:1"),
        ("wait_event", "side:cuda:1", ready),  # ordered after the producer, on the device
        ("record", "side:cuda:1"),  # behind the copy
        ("event.synchronize", "side:cuda:1"),  # the host waits for that event only
    ]
    assert fake_cuda.current == "default"  # the caller's stream is current again


def test_cuda_copy_without_ready_waits_for_nothing_before_it(fake_cuda):
    cs = CopyStream("cuda:0")
    cs.run(lambda: None)
    cs.run(lambda: None)
    kinds = [entry[0] for entry in fake_cuda.log]
    assert kinds == ["new stream", "record", "event.synchronize", "record", "event.synchronize"]  # one stream
    assert "stream.synchronize" not in kinds and "wait_event" not in kinds


def test_a_ready_that_is_not_a_cuda_event_is_synchronized_on_the_host_first(fake_cuda):
    cs = CopyStream("cuda:0")
    cs.run(lambda: fake_cuda.log.append(("copy",)), HostReady(fake_cuda.log))
    assert [e[0] for e in fake_cuda.log] == [
        "ready.synchronize",
        "new stream",
        "copy",
        "record",
        "event.synchronize",
    ]


def test_cpu_copy_runs_inline_after_ready(fake_cuda):
    log: list[tuple] = []
    cs = CopyStream("cpu")
    assert cs.stream is None
    assert cs.run(lambda: log.append(("copy",)) or 7, HostReady(log)) == 7
    assert log == [("ready.synchronize",), ("copy",)]
    assert fake_cuda.log == []  # no CUDA call at all on the CPU


def test_staged_gathers_and_scatters_go_through_the_copy_stream_with_ready():
    # 8 heads, prefill TP 2 -> decode TP 1, NHD: strided head slices, so the pair is staged
    # (forced: over shared memory auto fuses it, below)
    with Cluster(2, 1, geometry(8, page_size=4), decode_opts={"data_path": "staged"}) as c:
        calls: dict[str, list] = {"prefill": [], "decode": []}
        for side, mgrs in (("prefill", c.pre), ("decode", c.dec)):
            for m in mgrs:
                run = m.copy_stream.run

                def recording(copy, ready=None, _run=run, _side=side):
                    calls[_side].append(ready)
                    return _run(copy, ready)

                m.copy_stream.run = recording
        log: list[tuple] = []
        tokens = 24
        src = np.arange(1, 7)
        dst = np.arange(20, 26)
        rx = KVReceiver(c.dec[0], 41)
        rx.send_metadata(dst, num_tokens=tokens)
        txs = []
        for m in c.pre:
            fill_request(m.placement, m.pool.buffers, 41, src, 0, tokens)
            tx = KVSender(m, 41)
            tx.send(src, last_chunk=True, ready=HostReady(log))
            txs.append(tx)
        assert wait_terminal(txs + [rx]) == [KVPoll.Success] * 3, [h.failure_reason for h in txs + [rx]]
        assert c.verify(41, dst, tokens) == []
        assert all(tx.paths == {"staged": 1} for tx in txs)
        assert calls["prefill"] and all(isinstance(r, HostReady) for r in calls["prefill"])
        assert calls["decode"] and all(r is None for r in calls["decode"])
        assert len(log) == len(calls["prefill"])  # each gather waited for the chunk's ready


def test_a_direct_reader_waits_for_ready_before_the_transport_reads_the_pool():
    # equal TP, HND: contiguous bytes, so the pair is direct and no copy stream runs
    with Cluster(1, 1, geometry(8, page_size=4, layout="HND"), decode_opts={"data_path": "direct"}) as c:
        m = c.pre[0]
        gathers = []
        run = m.copy_stream.run
        m.copy_stream.run = lambda copy, ready=None: gathers.append(ready) or run(copy, ready)
        log: list[tuple] = []
        src, dst = np.arange(1, 5), np.arange(30, 34)
        rx = KVReceiver(c.dec[0], 42)
        rx.send_metadata(dst, num_tokens=16)
        fill_request(m.placement, m.pool.buffers, 42, src, 0, 16)
        tx = KVSender(m, 42)
        tx.send(src, last_chunk=True, ready=HostReady(log))
        assert wait_terminal([tx, rx]) == [KVPoll.Success] * 2, [tx.failure_reason, rx.failure_reason]
        assert c.verify(42, dst, 16) == []
        assert tx.paths == {"direct": 1} and gathers == [] and log == [("ready.synchronize",)]
