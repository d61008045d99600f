"""The transport contract, run for every transport between two real processes.

Every test writes from this process into a spawned peer's region and compares the peer's
bytes with a numpy model of what the batch must have done.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from sglang_kvxfer.errors import PeerGoneError, TransferTimeoutError, TransportError
from sglang_kvxfer.transports import RemoteRegion, TicketState, wait_all
from tests.transports.conftest import REGION_BYTES, Writer, apply
from tests.transports.transport_peer import WRITER_SECRET, wait_until

TIMEOUT_S = 10.0


def random_batch(rng, n: int, slot: int, src_bytes: int = REGION_BYTES, dst_lo: int = 0, dst_hi: int = REGION_BYTES):
    """n entries into distinct ``slot``-sized destination slots of [dst_lo, dst_hi)."""
    slots = rng.choice((dst_hi - dst_lo) // slot, size=n, replace=False)
    sz = rng.integers(0, slot + 1, size=n)
    ro = dst_lo + slots * slot + rng.integers(0, slot - sz + 1)
    lo = rng.integers(0, src_bytes - sz + 1)
    return lo, ro, sz


def test_random_batches_land_byte_exact(writer, peer):
    model = peer.fill(1)
    rng = np.random.default_rng(7)
    for n, slot in ((1, 1 << 20), (17, 4096), (300, 8192), (1000, 4096), (8, 512 << 10)):
        lo, ro, sz = random_batch(rng, n, slot)
        writer.write(lo, ro, sz).wait(TIMEOUT_S)
        apply(model, writer.src, lo, ro, sz)
        np.testing.assert_array_equal(peer.read(), model)


def test_contiguous_entries_are_merged_and_land(writer, peer):
    model = peer.fill(2)
    # 64 back-to-back 4 KiB entries given in shuffled order: one run after coalescing
    order = np.random.default_rng(3).permutation(64)
    lo, ro, sz = 100 + order * 4096, 8192 + order * 4096, np.full(64, 4096)
    writer.write(lo, ro, sz).wait(TIMEOUT_S)
    apply(model, writer.src, lo, ro, sz)
    np.testing.assert_array_equal(peer.read(), model)


def test_empty_batch_is_done_at_once_and_moves_nothing(writer, peer):
    model = peer.fill(3)
    ticket = writer.write([], [], [])
    assert ticket.poll() is TicketState.DONE
    ticket.wait(0)
    np.testing.assert_array_equal(peer.read(), model)


def test_zero_size_entries_move_nothing(writer, peer):
    model = peer.fill(4)
    n = REGION_BYTES
    lo = [0, 10, n, 500, 7]
    ro = [n, 20, 0, 1000, n - 1]
    sz = [0, 64, 0, 0, 1]
    writer.write(lo, ro, sz).wait(TIMEOUT_S)
    apply(model, writer.src, lo, ro, sz)
    np.testing.assert_array_equal(peer.read(), model)


def test_out_of_range_remote_entry_rejects_the_whole_batch(writer, peer):
    model = peer.fill(5)
    n = REGION_BYTES
    with pytest.raises(ValueError) as info:
        writer.write([0, 0, 0, 0], [0, 4096, 8192, n - 100], [64, 64, 64, 101])
    msg = str(info.value)
    assert "entry 3" in msg and f"remote offset {n - 100}" in msg and "size 101" in msg
    assert f"of {n} bytes" in msg and "remote region" in msg
    np.testing.assert_array_equal(peer.read(), model)  # entries 0-2 did not land either


def test_out_of_range_local_entry_rejects_the_whole_batch(writer, peer):
    model = peer.fill(6)
    with pytest.raises(
        ValueError,
        match=r"entry 1: local offset 4194304 \+ size 1 = 4194305 "
        r"exceeds local region",
    ):
        writer.write([0, REGION_BYTES], [0, 64], [64, 1])
    np.testing.assert_array_equal(peer.read(), model)


def test_unknown_remote_region_id_is_refused(writer, peer):
    model = peer.fill(7)
    bogus = RemoteRegion("peer", 9999, REGION_BYTES, "cpu")
    with pytest.raises(ValueError, match="remote region 9999 of peer 'peer' is not imported"):
        writer.transport.write(writer.local, bogus, np.array([0]), np.array([0]), np.array([8]))
    other = RemoteRegion("stranger", writer.remote.region_id, REGION_BYTES, "cpu")
    with pytest.raises(ValueError, match="unknown peer 'stranger'"):
        writer.transport.write(writer.local, other, np.array([0]), np.array([0]), np.array([8]))
    np.testing.assert_array_equal(peer.read(), model)


def test_deregistered_local_region_is_refused(writer, peer):
    writer.transport.deregister(writer.local)
    with pytest.raises(ValueError, match=f"local region {writer.local.region_id} is not registered"):
        writer.write([0], [0], [8])


def test_import_region_checks_the_peer(writer, peer):
    with pytest.raises(ValueError, match="unknown peer 'nobody'"):
        writer.transport.import_region("nobody", peer.region)
    with pytest.raises(ValueError, match="already imported"):
        writer.transport.import_region("peer", peer.region)
    with pytest.raises(ValueError, match="not a valid msgpack map|must be a msgpack map"):
        writer.transport.import_region("peer", b"\xc1garbage")


def test_removed_peer_cannot_be_written(writer, peer):
    writer.transport.remove_peer("peer")
    with pytest.raises(ValueError, match="unknown peer 'peer'"):
        writer.write([0], [0], [8])
    writer.transport.add_peer("peer", peer.agent, secret=WRITER_SECRET)  # and it can come back
    with pytest.raises(ValueError, match="not imported"):
        writer.write([0], [0], [8])
    writer.remote = writer.transport.import_region("peer", peer.region)
    model = peer.fill(8)
    writer.write([0], [0], [8]).wait(TIMEOUT_S)
    apply(model, writer.src, [0], [0], [8])
    np.testing.assert_array_equal(peer.read(), model)


def test_add_peer_again_replaces_the_peer(writer, peer):
    # a peer that restarts or re-registers is never refused as "already added"
    writer.transport.add_peer("peer", peer.agent, secret=WRITER_SECRET)
    with pytest.raises(ValueError, match="not imported"):  # the old record's imports are gone
        writer.write([0], [0], [8])
    writer.remote = writer.transport.import_region("peer", peer.region)
    model = peer.fill(10)
    writer.write([16], [32], [64]).wait(TIMEOUT_S)
    apply(model, writer.src, [16], [32], [64])
    np.testing.assert_array_equal(peer.read(), model)


def test_many_concurrent_batches_from_several_threads(writer, peer):
    model = peer.fill(9)
    threads, batches_per_thread = 4, 8
    quarter = REGION_BYTES // threads
    plans, errors = [], []
    for t in range(threads):
        rng = np.random.default_rng(100 + t)
        span = quarter // batches_per_thread  # each batch owns a disjoint destination span
        plans.append(
            [
                random_batch(rng, 40, 1024, dst_lo=t * quarter + b * span, dst_hi=t * quarter + (b + 1) * span)
                for b in range(batches_per_thread)
            ]
        )

    def run(batches):
        try:
            wait_all([writer.write(*batch) for batch in batches], TIMEOUT_S)
        except Exception as exc:  # reported below, a thread cannot fail the test itself
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(p,)) for p in plans]
    for w in workers:
        w.start()
    for w in workers:
        w.join(TIMEOUT_S * 2)
    assert not any(w.is_alive() for w in workers), "a writer thread hung"
    assert errors == []
    for batches in plans:
        for lo, ro, sz in batches:
            apply(model, writer.src, lo, ro, sz)
    np.testing.assert_array_equal(peer.read(), model)


def test_peer_that_dies_mid_batch_fails_tickets_without_hanging(case, fresh_peer):
    writer = Writer(case, fresh_peer)
    try:
        writer.write([0], [0], [4096]).wait(TIMEOUT_S)  # connected and working
        fresh_peer.stop()  # a tcp receiver now stops reading: the batches below stall
        big = np.arange(16) * (256 << 10)
        tickets = [writer.write(big, big, np.full(16, 256 << 10)) for _ in range(16)]
        fresh_peer.kill()
        for ticket in tickets:  # each ends, one way or the other, well within the timeout
            with _any_end():
                ticket.wait(TIMEOUT_S)
        if not writer.transport.caps.one_sided:  # nothing could be acknowledged
            assert all(t.poll() is TicketState.FAILED for t in tickets)
            assert "peer 'peer'" in tickets[-1].reason
        after = writer.write([0], [0], [4096])
        with pytest.raises(PeerGoneError, match="peer 'peer'"):
            after.wait(TIMEOUT_S)
        assert after.poll() is TicketState.FAILED and "peer 'peer'" in after.reason
        failures = []
        assert wait_until(lambda: failures.extend(writer.transport.peer_failures()) or failures, TIMEOUT_S)
        assert failures[0].peer_id == "peer" and failures[0].reason
        assert writer.transport.peer_failures() == []  # drained
    finally:
        writer.close()


class _any_end:
    """Context manager: the wait may return (DONE) or raise PeerGoneError/TransportError,
    but must not time out."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            return False
        if issubclass(exc_type, TransferTimeoutError):
            raise AssertionError("a ticket was still pending after its peer died") from exc
        return issubclass(exc_type, TransportError)


def test_wait_times_out_with_a_clear_error_while_peer_is_stopped(case, fresh_peer):
    writer = Writer(case, fresh_peer)
    try:
        if writer.transport.caps.one_sided:
            pytest.skip("one-sided writes complete without the peer running")
        writer.write([0], [0], [64]).wait(TIMEOUT_S)
        fresh_peer.stop()
        ticket = writer.write(np.arange(64) * 65536, np.arange(64) * 65536, np.full(64, 65536))
        with pytest.raises(TransferTimeoutError, match="not complete after 0.2 s"):
            ticket.wait(0.2)
        assert ticket.poll() is TicketState.PENDING
    finally:
        fresh_peer.kill()
        writer.close()
