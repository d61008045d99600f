"""A bootstrap that answers late (its process starved of CPU: an engine busy-polling on a
crowded host, its service thread waiting seconds for the GIL) is still waited for: the retry
loops of prefill registration and decode lookup widen their windows (0.5 s doubling to 4 s),
so ranks register, find each other and move bytes, where fixed 0.5 s windows never saw a
reply. A bootstrap that never answers still fails at the deadline, naming the address."""

from __future__ import annotations

import collections
import threading
import time

import pytest
import zmq

from sglang_kvxfer.engine import BootstrapServer, EngineConfig, KVManager, KVPoll, KVReceiver, KVSender
from sglang_kvxfer.engine import bootstrap as boot
from sglang_kvxfer.errors import TransferTimeoutError
from sglang_kvxfer.protocol.messages import BootstrapQuery

from .harness import FAST, Cluster, geometry, wait_terminal

LATE_S = 1.2  # longer than the first two windows (0.5 s, 1 s)


class DelayLine:
    """A bootstrap answering every request ``LATE_S`` after it was sent, as one in a starved
    process would: a ZMQ relay (a thread of its own, never stalled) in front of a real
    ``BootstrapServer`` holds each request for ``LATE_S`` and passes replies straight back.
    ``address``: where to ask; ``forwarded``: requests passed on."""

    def __init__(self):
        self.server = BootstrapServer()
        self._ctx = zmq.Context()
        self._front = self._ctx.socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        port = self._front.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"127.0.0.1:{port}"
        self.forwarded = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        held: collections.deque = collections.deque()  # (due, client identity, frame)
        backs: dict[bytes, zmq.Socket] = {}  # one socket per client: replies find their way back
        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(10):
                if sock is self._front:
                    ident, _, frame = self._front.recv_multipart()
                    held.append((time.monotonic() + LATE_S, ident, frame))
                else:
                    ident = next(i for i, b in backs.items() if b is sock)
                    self._front.send_multipart([ident, *sock.recv_multipart()])
            while held and held[0][0] <= time.monotonic():
                _, ident, frame = held.popleft()
                if ident not in backs:
                    back = backs[ident] = self._ctx.socket(zmq.DEALER)
                    back.setsockopt(zmq.LINGER, 0)
                    back.connect(f"tcp://{self.server.address}")
                    poller.register(back, zmq.POLLIN)
                backs[ident].send_multipart([b"", frame])
                self.forwarded += 1
        for back in backs.values():
            back.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._front.close(0)
        self._ctx.term()
        self.server.close()


def test_attempt_windows_double_to_a_cap_and_stop_at_the_deadline():
    far = time.monotonic() + 100
    assert [boot.attempt_timeout(n, far) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert boot.attempt_timeout(10**6, far) == 4.0
    assert boot.attempt_timeout(3, time.monotonic() + 1.0) <= 1.0  # never past the deadline
    assert boot.attempt_timeout(0, time.monotonic() - 5) == 0.1  # at least a short look
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="unanswered="):
            boot.attempt_timeout(bad, far)


def test_a_fixed_half_second_window_misses_a_late_bootstrap():
    """The control: one 0.5 s request to the same service gets no reply."""
    late = DelayLine()
    try:
        with pytest.raises(TransferTimeoutError, match="did not answer within 0.5 s"):
            boot.request(late.address, BootstrapQuery(session="d", tp_rank=0), timeout_s=0.5, key=None)
        reply = boot.request(late.address, BootstrapQuery(session="d", tp_rank=0), timeout_s=2 * LATE_S, key=None)
        assert not reply.ready and reply.ranks == ()  # the relay is transparent: the service's answer
    finally:
        late.close()


@pytest.mark.parametrize("transport", ["local", "tcp"])
def test_ranks_register_and_transfer_through_a_late_bootstrap(transport):
    late = DelayLine()
    try:
        with Cluster(2, 1, geometry(8), transport=transport, bootstrap=late) as c:
            txs, rxs, dst = c.start(41, 24, chunk=8)
            assert wait_terminal(txs + rxs, timeout_s=30) == [KVPoll.Success] * 3, [x.failure_reason for x in txs + rxs]
            assert c.verify(41, dst, 24) == []
            assert sorted(late.server.registered()) == [0, 1]
    finally:
        late.close()
    # two registrations and a lookup, each asked again after its first window had closed
    assert late.forwarded >= 6


def test_a_bootstrap_that_never_answers_fails_the_lookup_at_the_deadline_naming_it():
    """The room's timeout says what it waited for: the lookup's latest problem."""
    mute = BootstrapServer()
    mute.close()  # its port is now closed: nothing answers there
    cfg = EngineConfig("decode", geometry(8), 1, 0, mute.address, "local", **{**FAST, "bootstrap_timeout_s": 3.0})
    dec = KVManager(cfg)
    try:
        t0 = time.monotonic()
        rx = KVReceiver(dec, 7)
        rx.send_metadata(list(range(4)), num_tokens=16)
        assert wait_terminal([rx], timeout_s=20) == [KVPoll.Failed]
        waited = time.monotonic() - t0
        want = (
            f"timed out after 3.0 s in Bootstrapping (bootstrap {mute.address}: bootstrap {mute.address} did not answer"
        )
        assert rx.failure_reason.startswith(want), rx.failure_reason
        assert waited < 3.0 + 4.0, waited  # detected at the deadline (its tick), not a window later
    finally:
        dec.close()


def test_a_prefill_room_nobody_claims_times_out_saying_so():
    with Cluster(1, 1, geometry(8), prefill_opts={"bootstrap_timeout_s": 1.0}) as c:
        tx = KVSender(c.pre[0], 8)
        tx.send(list(range(2)), last_chunk=True)
        assert wait_terminal([tx], timeout_s=20) == [KVPoll.Failed]
        assert tx.failure_reason == "timed out after 1.0 s in Bootstrapping (no decode rank sent this room's metadata)"
