"""Batch validation, coalescing, tickets, descriptors and the registry (no processes)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from sglang_kvxfer.errors import PeerGoneError, TransferTimeoutError, TransportError, TransportUnavailableError
from sglang_kvxfer.transports import (
    available_transports,
    check_transport,
    get_transport,
    register_transport,
    registered_transports,
)
from sglang_kvxfer.transports._common import UseTable, pack_descriptor, unpack_descriptor
from sglang_kvxfer.transports.base import Entries, coalesce, parse_device, tensor_memory, validate_batch
from sglang_kvxfer.transports.ticket import Ticket, TicketState, wait_all


def _arr(*values):
    return np.array(values, dtype=np.int64)


# -- validate_batch -----------------------------------------------------------------------


def test_valid_batch_comes_back_as_int64():
    e = validate_batch(100, 200, np.array([0, 10], np.uint32), [5, 195], np.array([3, 5], np.int8))
    assert [a.dtype for a in (e.local_offsets, e.remote_offsets, e.sizes)] == [np.int64] * 3
    assert e.num_entries == 2 and e.total_bytes == 8


def test_entry_past_remote_end_names_index_offset_size_and_region():
    with pytest.raises(ValueError) as info:
        validate_batch(
            100, 64, _arr(0, 0, 0), _arr(0, 8, 60), _arr(8, 8, 5), remote_name="remote region 3 of peer 'd0'"
        )
    assert str(info.value) == (
        "entry 2: remote offset 60 + size 5 = 65 exceeds remote region 3 of peer 'd0' of 64 bytes"
    )


def test_entry_past_local_end_is_rejected():
    with pytest.raises(
        ValueError,
        match=r"entry 0: local offset 99 \+ size 2 = 101 exceeds "
        r"local region of 100 bytes",
    ):
        validate_batch(100, 100, _arr(99), _arr(0), _arr(2))


def test_huge_offset_does_not_overflow_into_range():
    big = np.iinfo(np.int64).max
    with pytest.raises(ValueError, match=f"entry 0: remote offset {big}"):
        validate_batch(100, 100, _arr(0), _arr(big), _arr(10))
    with pytest.raises(ValueError, match=f"entry 0: local offset 10 \\+ size {big}"):
        validate_batch(100, 100, _arr(10), _arr(0), _arr(big))


def test_zero_size_entry_at_region_end_is_allowed():
    e = validate_batch(100, 50, _arr(100), _arr(50), _arr(0))
    assert e.total_bytes == 0


@pytest.mark.parametrize("field", ["local_offsets", "remote_offsets", "sizes"])
def test_negative_value_names_the_array_and_index(field):
    arrays = {"local_offsets": _arr(0, 1), "remote_offsets": _arr(0, 1), "sizes": _arr(1, 1)}
    arrays[field] = _arr(0, -4)
    with pytest.raises(ValueError, match=f"{field}\\[1\\] = -4 is negative"):
        validate_batch(100, 100, arrays["local_offsets"], arrays["remote_offsets"], arrays["sizes"])


def test_length_mismatch_lists_all_three_lengths():
    with pytest.raises(ValueError, match="same length, got 2, 2 and 3"):
        validate_batch(100, 100, _arr(0, 1), _arr(0, 1), _arr(1, 1, 1))


def test_float_array_is_a_type_error():
    with pytest.raises(TypeError, match="sizes must be an integer array, got dtype float64"):
        validate_batch(100, 100, _arr(0), _arr(0), np.array([1.0]))


def test_two_dimensional_array_is_rejected():
    with pytest.raises(ValueError, match=r"local_offsets must be a 1-D array, got shape \(1, 2\)"):
        validate_batch(100, 100, np.zeros((1, 2), np.int64), _arr(0, 0), _arr(0, 0))


def test_uint64_beyond_int64_is_rejected():
    with pytest.raises(ValueError, match="remote_offsets\\[0\\] = 18446744073709551615 does not fit in int64"):
        validate_batch(100, 100, _arr(0), np.array([2**64 - 1], np.uint64), _arr(0))


def test_empty_lists_are_an_empty_batch():
    assert validate_batch(10, 10, [], [], []).num_entries == 0


# -- coalesce -----------------------------------------------------------------------------


def test_coalesce_merges_runs_contiguous_on_both_sides_in_any_order():
    e = coalesce(Entries(_arr(8, 0, 4, 100), _arr(58, 50, 54, 10), _arr(4, 4, 4, 2)))
    assert e.remote_offsets.tolist() == [10, 50]
    assert e.local_offsets.tolist() == [100, 0]
    assert e.sizes.tolist() == [2, 12]


def test_coalesce_keeps_entries_contiguous_on_one_side_only():
    e = coalesce(Entries(_arr(0, 100), _arr(0, 4), _arr(4, 4)))
    assert e.sizes.tolist() == [4, 4]


def test_coalesce_drops_zero_size_entries():
    e = coalesce(Entries(_arr(0, 4, 4), _arr(0, 4, 99), _arr(4, 4, 0)))
    assert (e.local_offsets.tolist(), e.remote_offsets.tolist(), e.sizes.tolist()) == ([0], [0], [8])


def test_coalesce_moves_the_same_bytes_as_the_batch():
    rng = np.random.default_rng(0)
    n, slot = 500, 64
    slots = rng.permutation(n)
    lo = np.where(rng.random(n) < 0.5, slots * slot, rng.permutation(n) * slot)
    e = Entries(lo.astype(np.int64), (slots * slot).astype(np.int64), rng.integers(0, slot + 1, n).astype(np.int64))
    src = rng.integers(0, 256, n * slot, dtype=np.uint8)
    want, got = np.zeros_like(src), np.zeros_like(src)
    for batch, out in ((e, want), (coalesce(e), got)):
        for l, r, s in zip(batch.local_offsets, batch.remote_offsets, batch.sizes):
            out[r : r + s] = src[l : l + s]
    np.testing.assert_array_equal(got, want)
    assert coalesce(e).num_entries < e.num_entries


# -- tickets ------------------------------------------------------------------------------


def test_ticket_parts_complete_it_only_when_all_are_done():
    t = Ticket("t", parts=2)
    t._part_done()
    assert t.poll() is TicketState.PENDING
    t._part_done()
    assert t.poll() is TicketState.DONE and t.error is None and t.reason is None


def test_failure_is_sticky_and_raised_by_wait():
    t = Ticket("t", parts=2)
    t._fail(PeerGoneError("peer 'd0' exited"))
    t._part_done()
    t._part_done()
    assert t.poll() is TicketState.FAILED
    assert t.reason == "peer 'd0' exited"
    with pytest.raises(PeerGoneError, match="peer 'd0' exited"):
        t.wait(1)


def test_done_ticket_cannot_fail_later():
    t = Ticket.completed("t")
    t._fail(TransportError("late"))
    assert t.poll() is TicketState.DONE


def test_wait_times_out_with_the_label():
    t = Ticket("write 1->d0:2")
    start = time.monotonic()
    with pytest.raises(TransferTimeoutError, match=r"write 1->d0:2: not complete after 0.05 s"):
        t.wait(0.05)
    assert time.monotonic() - start < 5  # bounded, not a hang


def test_wait_is_woken_by_completion_from_another_thread():
    t = Ticket("t")
    threading.Timer(0.02, t._part_done).start()
    t.wait(10)
    assert t.poll() is TicketState.DONE


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf")])
def test_wait_rejects_bad_timeouts(bad):
    with pytest.raises(ValueError, match="timeout_s must be finite and >= 0"):
        Ticket("t").wait(bad)


def test_wait_rejects_none_timeout():
    with pytest.raises(TypeError, match="timeout_s must be a number of seconds, got None"):
        wait_all([], None)


def test_progress_hook_completes_and_its_exception_fails_the_ticket():
    calls = []
    t = Ticket("cuda", progress=lambda: calls.append(1) or len(calls) >= 3)
    t.wait(5)
    assert len(calls) == 3
    bad = Ticket("cuda", progress=lambda: 1 / 0)
    assert bad.poll() is TicketState.FAILED
    assert "ZeroDivisionError" in bad.reason


def test_wait_all_failure_wins_over_pending():
    pending, failed = Ticket("a"), Ticket.failed("b", PeerGoneError("peer 'x' gone"))
    with pytest.raises(PeerGoneError, match="peer 'x' gone"):
        wait_all([pending, failed], 10)


def test_wait_all_sees_a_failure_that_arrives_while_waiting():
    slow, doomed = Ticket("slow"), Ticket("doomed")
    threading.Timer(0.02, doomed._fail, args=(TransportError("refused"),)).start()
    start = time.monotonic()
    with pytest.raises(TransportError, match="refused"):
        wait_all([slow, doomed], 10)
    assert time.monotonic() - start < 5


def test_wait_all_timeout_counts_pending():
    with pytest.raises(
        TransferTimeoutError,
        match=r"1 of 2 tickets not complete after 0.01 s "
        r"\(first: b\)",
    ):
        wait_all([Ticket.completed("a"), Ticket("b")], 0.01)


def test_wait_all_of_done_and_empty():
    wait_all([], 0)
    wait_all([Ticket.completed("a"), Ticket.completed("b")], 0)


# -- descriptors, devices, tensors ---------------------------------------------------------


def test_descriptor_round_trip_and_field_checks():
    blob = pack_descriptor("tcp", "region", agent="a", region=3, nbytes=10)
    assert unpack_descriptor(blob, "tcp", "region", {"region": int})["nbytes"] == 10
    with pytest.raises(ValueError, match="descriptor is for transport 'tcp'; transport 'local' cannot use it"):
        unpack_descriptor(blob, "local", "region", {})
    with pytest.raises(ValueError, match="expected a tcp agent descriptor, got 'region'"):
        unpack_descriptor(blob, "tcp", "agent", {})
    with pytest.raises(ValueError, match="field 'port' is None, expected int"):
        unpack_descriptor(blob, "tcp", "region", {"port": int})
    with pytest.raises(ValueError, match="field 'agent' is 'a', expected int"):
        unpack_descriptor(blob, "tcp", "region", {"agent": int})
    with pytest.raises(TypeError, match="region descriptor must be bytes, got str"):
        unpack_descriptor("x", "tcp", "region", {})
    with pytest.raises(ValueError, match="not a valid msgpack map"):
        unpack_descriptor(b"\xc1", "tcp", "region", {})
    old = pack_descriptor("tcp", "region")[:-1] + b"\x07"  # version field is last: 1 -> 7
    with pytest.raises(ValueError, match="has version 7, this build speaks 1"):
        unpack_descriptor(old, "tcp", "region", {})


def test_bool_is_not_an_int_field():
    blob = pack_descriptor("tcp", "agent", port=True)
    with pytest.raises(ValueError, match="field 'port' is True, expected int"):
        unpack_descriptor(blob, "tcp", "agent", {"port": int})


def test_parse_device():
    assert parse_device("cpu") == ("cpu", -1)
    assert parse_device("cuda") == ("cuda", 0)
    assert parse_device("cuda:3") == ("cuda", 3)
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu'"):
        parse_device("gpu")


def test_tensor_memory_reads_a_tensor_and_rejects_non_contiguous():
    torch = pytest.importorskip("torch")
    t = torch.zeros(4, 8, dtype=torch.float16)
    assert tensor_memory(t) == (t.data_ptr(), 64, "cpu")
    with pytest.raises(ValueError, match=r"contiguous, got shape \(8, 4\) with stride \(1, 8\)"):
        tensor_memory(t.t())
    with pytest.raises(TypeError, match="expected a torch.Tensor, got ndarray"):
        tensor_memory(np.zeros(3))


def test_use_table_remove_waits_for_users_and_times_out():
    table = UseTable()
    table.add("r", 1)
    lease = table.acquire("r")
    threading.Timer(0.02, table.release, args=(lease,)).start()
    assert table.remove("r", 10) == 1
    assert table.acquire("r") is None
    table.add("s", 2)
    held = table.acquire("s")
    stopped = []
    with pytest.raises(TransportError, match="'s' still has 1 transfer\\(s\\) in flight"):
        table.remove("s", 0.01, on_timeout=lambda: stopped.append(True))
    assert stopped == [True]
    table.release(held)


# -- registry -----------------------------------------------------------------------------


def test_builtin_transports_are_available():
    assert {"local", "tcp"} <= set(available_transports())


def test_unknown_transport_lists_registered_ones():
    with pytest.raises(ValueError, match="unknown transport 'rdma'; registered: .*local.*tcp"):
        get_transport("rdma")
    with pytest.raises(ValueError, match="unknown transport 'rdma'; registered: .*local.*tcp"):
        check_transport("rdma")  # what a launcher calls before it starts any rank


def test_missing_package_names_it():
    register_transport(
        "fake-nixl", "sglang_kvxfer.transports.nixl:NixlTransport", requires={"nixl_fake_module_xyz": "nixl-fake"}
    )
    try:
        assert "fake-nixl" in registered_transports()
        assert "fake-nixl" not in available_transports()
        with pytest.raises(TransportUnavailableError) as info:
            get_transport("fake-nixl")
        assert "'nixl-fake' (module 'nixl_fake_module_xyz')" in str(info.value)
        assert "pip install nixl-fake" in str(info.value)
        assert isinstance(info.value, ImportError)
        with pytest.raises(TransportUnavailableError) as checked:
            check_transport("fake-nixl")
        assert str(checked.value) == str(info.value)
    finally:
        from sglang_kvxfer import transports

        transports._REGISTRY.pop("fake-nixl")


def test_broken_module_is_unavailable_not_a_crash():
    register_transport("broken", "sglang_kvxfer.transports.no_such_module:X")
    try:
        with pytest.raises(
            TransportUnavailableError, match="could not be imported from sglang_kvxfer.transports.no_such"
        ):
            get_transport("broken")
    finally:
        from sglang_kvxfer import transports

        transports._REGISTRY.pop("broken")


def test_register_transport_checks_its_target():
    with pytest.raises(ValueError, match="'package.module:ClassName', got 'just.a.module'"):
        register_transport("x", "just.a.module")


def test_transport_options_reach_the_class_and_context_manager_closes():
    with get_transport("tcp", num_connections=2) as t:
        assert t._num_conns == 2
    with pytest.raises(TransportError, match="transport 'tcp' is closed"):
        t.register(1, 1)


def test_importing_transports_pulls_no_torch():
    import subprocess
    import sys

    code = "import sys, sglang_kvxfer.transports.local, sglang_kvxfer.transports.tcp;print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
