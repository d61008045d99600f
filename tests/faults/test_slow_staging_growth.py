"""A staging arena that grows slowly stalls nothing else.

A new staging segment is allocated, faulted in and registered (``MAP_POPULATE``: seconds
for a large one on a busy machine). Before, the decode grew its arena while lending windows
under the manager's lock, so its I/O thread (heartbeats, notices, ticks) waited for the
growth, and peers with a heartbeat timeout shorter than the growth declared it gone. Now the
arena grows outside its own lock and the decode plans and lends outside the manager's lock,
on a worker when the I/O thread starts it. Checked with the allocation held by the test:
the arena's other calls go on meanwhile, an arena closed meanwhile drops the new segment,
and a request whose decode grows its arena for three heartbeat timeouts moves every byte.
"""

from __future__ import annotations

import threading
import time

import pytest

from sglang_kvxfer.engine import KVPoll, KVReceiver, StagingArena
from sglang_kvxfer.engine import pool as pool_module
from sglang_kvxfer.engine.decode_rooms import GroupStatus
from sglang_kvxfer.errors import KVXferError
from tests.engine.harness import Cluster, geometry, wait_terminal


class HeldAlloc:
    """``pool._alloc_bytes`` that blocks every allocation of at least ``min_bytes`` until
    ``release`` (or ``hold_s``), counting the ones it held."""

    def __init__(self, monkeypatch, min_bytes: int, hold_s: float | None = None):
        self.real = pool_module._alloc_bytes
        self.min_bytes, self.hold_s = min_bytes, hold_s
        self.started = threading.Event()
        self.release = threading.Event()
        self.held = 0
        self.owners: list[object] = []
        monkeypatch.setattr(pool_module, "_alloc_bytes", self)

    def __call__(self, nbytes, device, shared):
        if nbytes >= self.min_bytes:
            self.held += 1
            self.started.set()
            if self.hold_s is None:
                assert self.release.wait(30), "the test never released the allocation"
            else:
                time.sleep(self.hold_s)
        tensor, owner = self.real(nbytes, device, shared)
        self.owners.append(owner)
        return tensor, owner


def run_in_thread(fn, timeout_s: float = 10.0):
    """``fn()`` in a thread: (whether it returned within ``timeout_s``, its result or error)."""
    out: list = []

    def target():
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    return (not t.is_alive()), (out[0] if out else None)


def test_the_arena_serves_its_segments_while_a_new_one_is_made(monkeypatch):
    arena = StagingArena(64 << 20, shared=True, min_segment_bytes=1 << 20)
    first = arena.alloc(512 << 10)  # the first segment, 1 MiB, not held
    held = HeldAlloc(monkeypatch, min_bytes=2 << 20)
    done, grown = [], []
    grower = threading.Thread(target=lambda: grown.append(arena.alloc(4 << 20)), daemon=True)
    grower.start()
    assert held.started.wait(10)
    try:
        # while the 4 MiB segment is being made: the first segment's windows come and go
        ok, second = run_in_thread(lambda: arena.alloc(256 << 10))
        assert ok and second == first + (512 << 10), second
        ok, _ = run_in_thread(lambda: (arena.free(first), arena.locate(second), done.append(1)))
        assert ok and done == [1]
        # the cap counts the segment being made: 1 + 4 MiB of 64 MiB leave room for 59 MiB
        ok, refused = run_in_thread(lambda: arena.alloc(60 << 20))
        assert ok and refused is None, refused
        assert arena.num_segments == 1 and not grown
    finally:
        held.release.set()
        grower.join(10)
    assert grown and arena.num_segments == 2 and arena.locate(grown[0]).base == 1 << 20
    arena.view(grown[0], 4 << 20).fill_(3)
    assert int(arena.view(grown[0], 4 << 20).sum()) == 3 * (4 << 20)
    arena.close()


def test_an_arena_closed_while_it_grows_drops_the_new_segment(monkeypatch):
    held = HeldAlloc(monkeypatch, min_bytes=1)
    arena = StagingArena(8 << 20, shared=True, min_segment_bytes=1 << 20)
    errors: list[BaseException] = []

    def grow():
        try:
            arena.alloc(1 << 20)
        except KVXferError as exc:
            errors.append(exc)

    grower = threading.Thread(target=grow, daemon=True)
    grower.start()
    assert held.started.wait(10)
    ok, _ = run_in_thread(arena.close)
    assert ok, "close() waited for the growth"
    held.release.set()
    grower.join(10)
    assert len(errors) == 1 and "closed while it grew" in str(errors[0]), errors
    assert arena.num_segments == 0
    assert held.owners[0].closed  # the segment's shared memory was released


OPTS = dict(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0, data_path="staged")


def group_ready(decode) -> None:
    """Let ``decode`` look the prefill group up and register with it (a receiver without
    metadata, aborted once the group is ready)."""
    rx = KVReceiver(decode, 99)
    deadline = time.monotonic() + 10
    while not any(g.status is GroupStatus.READY for g in decode._groups.values()):
        assert time.monotonic() < deadline, "the prefill group never became ready"
        time.sleep(0.02)
    rx.abort("the group is ready")


@pytest.mark.parametrize("group_first", [True, False], ids=["group-ready-first", "metadata-first"])
def test_a_decode_growing_its_staging_for_three_heartbeat_timeouts_stays_alive(monkeypatch, group_first):
    """The decode's first staged request grows its arena for 3 s (heartbeat timeout 1 s),
    either from the caller's ``send_metadata`` (group ready first) or from the I/O thread
    (metadata posted before the prefill group registered: the ``RegisterReply`` starts it).
    Both sides keep their heartbeats, the request succeeds and every byte is in place."""
    tokens = 16
    with Cluster(2, 1, geometry(h=4), prefill_opts=OPTS, decode_opts=OPTS) as c:
        decode = c.dec[0]
        if group_first:
            group_ready(decode)
        assert decode._live_staging.num_segments == 0
        held = HeldAlloc(monkeypatch, min_bytes=1, hold_s=3 * OPTS["heartbeat_timeout_s"])
        txs, rxs, dst = c.start(1, tokens)
        states = wait_terminal(txs + rxs, 30)
        reasons = [h.failure_reason for h in txs + rxs]
        assert states == [KVPoll.Success] * 3, reasons
        assert c.verify(1, dst, tokens) == []
        assert held.held >= 1 and decode._live_staging.num_segments >= 1
        # and the pair goes on serving
        txs, rxs, dst = c.start(2, tokens)
        assert wait_terminal(txs + rxs, 30) == [KVPoll.Success] * 3
        assert c.verify(2, dst, tokens) == []
