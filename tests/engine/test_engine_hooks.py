"""The engine hooks an inference-server integration uses: a pool over memory known only by
address (``KVPool.from_pointers``), a chunk handed over before its KV is written
(``KVSender.send(ready=...)``), and the prefill group's status (``prefill_group_status``)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from sglang_kvxfer.engine import BootstrapServer, EngineConfig, KVManager, KVPoll, KVPool, KVReceiver, KVSender
from sglang_kvxfer.engine.synthetic import fill_request
from sglang_kvxfer.transports import get_transport

from .harness import FAST, Cluster, geometry, wait_terminal


def _server_pool(place):
    """Buffers as a server allocates them (private torch tensors), and their addresses."""
    bufs = [torch.zeros(place.buffer_shape(i), dtype=torch.bfloat16) for i in range(place.geometry.num_buffers)]
    return bufs, [t.data_ptr() for t in bufs], [t.nbytes for t in bufs]


def test_from_pointers_aliases_the_callers_memory_and_registers_it():
    place = geometry(num_pages=8).placement(2, 1)
    bufs, ptrs, lens = _server_pool(place)
    pool = KVPool.from_pointers(place, ptrs, [n + 512 for n in lens])  # longer buffers are fine
    try:
        assert [b.data_ptr() for b in pool.buffers] == ptrs
        assert [tuple(b.shape) for b in pool.buffers] == [place.buffer_shape(i) for i in range(len(bufs))]
        pool.buffers[3][5, 1, 2] = 7.0  # through the view...
        assert float(bufs[3][5, 1, 2]) == 7.0  # ...into the server's tensor
        with get_transport("local") as t:
            descriptors = pool.register(t)
            assert len(descriptors) == len(bufs) and [r.ptr for r in pool.regions] == ptrs
            pool.close()
    finally:
        pool.close()
    assert float(bufs[3][5, 1, 2]) == 7.0  # close() leaves the server's memory alone


def test_from_pointers_rejects_what_does_not_fit_the_geometry():
    place = geometry(num_pages=8).placement(1, 0)
    bufs, ptrs, lens = _server_pool(place)
    with pytest.raises(ValueError, match=r"ptrs has 3 entries; the geometry needs 4 \(K of 2 layers, then V\)"):
        KVPool.from_pointers(place, ptrs[:3], lens[:3])
    short = list(lens)
    short[2] -= 2
    with pytest.raises(
        ValueError, match=r"lens\[2\]=\d+ must be at least \d+ bytes: buffer 2 of the geometry is \(32, 8, 8\) bfloat16"
    ):
        KVPool.from_pointers(place, ptrs, short)
    with pytest.raises(ValueError, match=r"ptrs\[0\]=0 must be a non-null address"):
        KVPool.from_pointers(place, [0] + ptrs[1:], lens)
    with pytest.raises(ValueError, match=r"device='npu' must be 'cpu' or 'cuda\[:N\]'"):
        KVPool.from_pointers(place, ptrs, lens, device="npu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_from_pointers_aliases_cuda_memory():
    place = geometry(num_pages=8).placement(1, 0)
    bufs = [torch.zeros(place.buffer_shape(i), dtype=torch.bfloat16, device="cuda:0") for i in range(4)]
    pool = KVPool.from_pointers(place, [t.data_ptr() for t in bufs], [t.nbytes for t in bufs], "cuda:0")
    pool.buffers[1].fill_(3.0)
    torch.cuda.synchronize()
    assert [b.data_ptr() for b in pool.buffers] == [t.data_ptr() for t in bufs]
    assert float(bufs[1].float().mean()) == 3.0


class Gate:
    """``synchronize()`` blocks until ``open()``: a forward still writing the chunk."""

    def __init__(self):
        self._open = threading.Event()
        self.waited = False

    def open(self):
        self._open.set()

    def synchronize(self):
        self.waited = True
        if not self._open.wait(10):
            raise TimeoutError("gate never opened")


def test_a_chunk_handed_over_early_is_read_only_after_its_ready_event():
    with Cluster(1, 1, geometry(num_pages=32)) as c:
        pre, dec = c.pre[0], c.dec[0]
        src, dst = np.arange(1, 5), np.arange(10, 14)
        rx = KVReceiver(dec, 301)
        rx.send_metadata(dst, num_tokens=16)
        tx = KVSender(pre, 301)
        gate = Gate()
        deadline = time.monotonic() + 10
        while tx.poll() is KVPoll.Bootstrapping and time.monotonic() < deadline:
            time.sleep(0.005)
        tx.send(src[:2], ready=gate)
        time.sleep(0.1)  # the worker has the chunk and waits on the gate
        assert gate.waited and rx.poll() is not KVPoll.Success
        fill_request(pre.placement, pre.pool.buffers, 301, src, 0, 16)
        gate.open()
        tx.send(src[2:], last_chunk=True)
        assert wait_terminal([tx, rx]) == [KVPoll.Success] * 2
        assert c.verify(301, dst, 16) == []
        with pytest.raises(TypeError, match="ready must have a synchronize\\(\\) method, got int"):
            KVSender(pre, 302).send(src[:1], ready=5)


def test_prefill_group_status_reports_a_lookup_without_restarting_it():
    with BootstrapServer() as boot:
        cfg = EngineConfig("decode", geometry(), 1, 0, boot.address, "local", **{**FAST, "bootstrap_timeout_s": 0.5})
        with KVManager(cfg) as dec:
            addr = boot.address
            assert dec.prefill_group_status(addr)[0] == "resolving"
            deadline = time.monotonic() + 10
            while dec.prefill_group_status(addr)[0] == "resolving":
                assert time.monotonic() < deadline
                time.sleep(0.02)
            status, error, tp, geo = dec.prefill_group_status(addr)
            assert (status, tp, geo) == ("failed", 0, None)
            assert "prefill group not ready after" in error and "0 of ? prefill rank(s) registered" in error
            assert dec.prefill_group_status(addr)[0] == "failed"  # reported, not looked up again
