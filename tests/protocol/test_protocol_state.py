"""The per-request state machine: the full table, terminal states, deadlines, monotonicity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_kvxfer.protocol import (
    DECODE_TRANSITIONS,
    PREFILL_TRANSITIONS,
    TRANSITIONS,
    Deadlines,
    Event,
    KVPoll,
    LocalProtocolError,
    RequestState,
    Side,
    describe_transitions,
)

B, W, T, S, F = (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success, KVPoll.Failed)
FAILURES = (Event.FAIL, Event.ABORT, Event.TIMEOUT)


def snapshot(st_: RequestState):
    return (st_.poll, st_.reason, st_.entered_at, st_.deadline, st_.writers_missing)


def in_state(side: Side, state: KVPoll, now: float = 0.0) -> RequestState:
    """A request driven along legal edges to ``state``."""
    req = RequestState(room=1, side=side, now=now)
    path = {
        B: [],
        W: [Event.BOOTSTRAPPED],
        T: [Event.BOOTSTRAPPED, Event.CHUNK_STARTED],
        S: [Event.BOOTSTRAPPED, Event.CHUNK_STARTED, Event.TRANSFER_DONE],
    }
    if state is F:
        req.fail("setup", now)
    for event in path.get(state, []):
        req.handle(event, now)
    assert req.poll is state
    return req


def test_kvpoll_has_sglangs_values():
    assert [(p.name, int(p)) for p in KVPoll] == [
        ("Failed", 0),
        ("Bootstrapping", 1),
        ("WaitingForInput", 2),
        ("Transferring", 3),
        ("Success", 4),
    ]


def test_the_tables_are_exactly_these_edges():
    failures = {(s, e): F for s in (B, W, T) for e in FAILURES}
    common = {
        (B, Event.BOOTSTRAPPED): W,
        (W, Event.CHUNK_STARTED): T,
        (T, Event.CHUNK_STARTED): T,
        (W, Event.TRANSFER_DONE): S,
        (T, Event.TRANSFER_DONE): S,
    }
    assert dict(PREFILL_TRANSITIONS) == {**common, **failures, (B, Event.PREFILL_COMPLETE): B}
    assert dict(DECODE_TRANSITIONS) == {
        **common,
        **failures,
        (W, Event.PREFILL_COMPLETE): W,
        (W, Event.WRITER_DONE): T,
        (T, Event.WRITER_DONE): T,
    }


@pytest.mark.parametrize("side", list(Side))
@pytest.mark.parametrize("state", list(KVPoll))
@pytest.mark.parametrize("event", list(Event))
def test_every_state_event_pair_follows_the_table_or_raises_unchanged(side, state, event):
    req = in_state(side, state, now=10.0)
    before = snapshot(req)
    reason = "why" if event in FAILURES else None
    expected = TRANSITIONS[side].get((state, event))
    if expected is None:
        with pytest.raises(LocalProtocolError) as info:
            req.handle(event, 20.0, reason)
        assert f"in state {state.name}" in str(info.value)
        assert f"cannot take event {event.name}" in str(info.value)
        assert snapshot(req) == before
    else:
        assert req.handle(event, 20.0, reason) is expected
        assert req.poll is expected
        assert req.reason == ("why" if expected is F else None)


@pytest.mark.parametrize("table", [PREFILL_TRANSITIONS, DECODE_TRANSITIONS])
def test_polls_never_go_down_except_to_failed(table):
    for (state, _), nxt in table.items():
        assert nxt is F or nxt >= state, (state, nxt)


@pytest.mark.parametrize("table", [PREFILL_TRANSITIONS, DECODE_TRANSITIONS])
def test_terminal_states_have_no_way_out_and_live_ones_can_always_fail(table):
    assert not [key for key in table if key[0] in (S, F)]
    for state in (B, W, T):
        for event in FAILURES:
            assert table[(state, event)] is F


def test_prefill_has_no_writer_done_event():
    req = in_state(Side.PREFILL, W)
    with pytest.raises(
        LocalProtocolError, match="prefill request in state WaitingForInput cannot take event WRITER_DONE"
    ):
        req.handle(Event.WRITER_DONE, 1.0)


def test_a_failed_request_says_why_it_failed_when_poked_again():
    req = in_state(Side.DECODE, T)
    req.abort("peer gone", 5.0)
    with pytest.raises(LocalProtocolError, match=r"state Failed \(peer gone\) cannot take event CHUNK_STARTED"):
        req.handle(Event.CHUNK_STARTED, 6.0)
    assert req.reason == "peer gone" and req.deadline is None


# -- reasons -------------------------------------------------------------------------------------
@pytest.mark.parametrize("event", FAILURES)
def test_failure_events_need_a_reason(event):
    req = in_state(Side.PREFILL, W)
    with pytest.raises(LocalProtocolError, match=f"{event.name} needs a reason"):
        req.handle(event, 1.0)
    with pytest.raises(LocalProtocolError, match=f"{event.name} reason='  ' is not a non-empty reason"):
        req.handle(event, 1.0, "  ")
    assert req.poll is W


def test_other_events_refuse_a_reason():
    req = in_state(Side.PREFILL, B)
    with pytest.raises(LocalProtocolError, match="BOOTSTRAPPED takes no reason, got 'x'"):
        req.handle(Event.BOOTSTRAPPED, 1.0, "x")
    assert req.poll is B


def test_a_long_reason_is_cut_so_that_failing_never_fails():
    req = in_state(Side.PREFILL, T)
    req.fail("x" * 10_000, 1.0)
    assert req.poll is F and len(req.reason) <= 4096 and "[cut " in req.reason


def test_a_non_event_is_refused():
    req = in_state(Side.PREFILL, B)
    with pytest.raises(LocalProtocolError, match="event must be an Event, got str 'bootstrapped'"):
        req.handle("bootstrapped", 1.0)  # type: ignore[arg-type]


# -- deadlines ---------------------------------------------------------------------------------------
def test_deadline_defaults_and_overrides():
    assert Deadlines() == Deadlines(60.0, 300.0, 120.0)
    d = Deadlines(bootstrapping=5, transferring=7.5)
    assert (d.bootstrapping, d.waiting_for_input, d.transferring) == (5.0, 300.0, 7.5)
    assert d.for_state(W) == 300.0
    with pytest.raises(ValueError, match="Success is terminal and has no deadline"):
        d.for_state(S)


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        (dict(bootstrapping=0), ValueError, "bootstrapping=0 must be a finite number > 0"),
        (dict(transferring=-1.0), ValueError, "transferring=-1.0 must be a finite number > 0"),
        (dict(waiting_for_input=float("inf")), ValueError, "waiting_for_input=inf must be a finite number > 0"),
        (dict(bootstrapping="60"), TypeError, "bootstrapping must be a number of seconds, got str '60'"),
        (dict(bootstrapping=True), TypeError, "bootstrapping must be a number of seconds, got bool True"),
    ],
)
def test_bad_deadlines_are_refused(kwargs, error, text):
    with pytest.raises(error, match=text):
        Deadlines(**kwargs)


@pytest.mark.parametrize("state, limit", [(B, 60.0), (W, 300.0), (T, 120.0)])
def test_each_live_state_times_out_at_its_deadline(state, limit):
    req = in_state(Side.DECODE, state, now=1000.0)
    assert req.deadline == 1000.0 + limit
    assert req.check_deadline(1000.0 + limit - 0.001) is False and req.poll is state
    assert req.check_deadline(1000.0 + limit) is True
    assert req.poll is F
    extra = " without progress" if state is T else ""
    assert req.reason == f"timed out after {limit:.1f} s in {state.name}{extra}"
    assert req.deadline is None and req.check_deadline(1e12) is False


def test_custom_deadlines_are_used():
    req = RequestState(3, "prefill", now=0.0, deadlines=Deadlines(bootstrapping=2.5))
    assert req.check_deadline(2.4) is False
    assert req.check_deadline(2.5) is True
    assert req.reason == "timed out after 2.5 s in Bootstrapping"


def test_a_finished_prefill_forward_restarts_the_wait_it_ends_on_both_sides():
    """prefill_complete: the prefill waits again for the decode's metadata (Bootstrapping), the
    decode again for its own allocation (WaitingForInput); neither state changes."""
    pre = in_state(Side.PREFILL, B, now=0.0)
    assert pre.deadline == 60.0
    assert pre.handle(Event.PREFILL_COMPLETE, 50.0) is B and pre.deadline == 110.0
    assert pre.check_deadline(100.0) is False and pre.poll is B
    dec = in_state(Side.DECODE, W, now=0.0)
    assert dec.handle(Event.PREFILL_COMPLETE, 250.0) is W and dec.deadline == 550.0
    assert dec.check_deadline(500.0) is False and dec.poll is W


def test_progress_restarts_the_transferring_deadline():
    req = in_state(Side.PREFILL, T, now=0.0)
    assert req.deadline == 120.0
    req.handle(Event.CHUNK_STARTED, 100.0)
    assert req.deadline == 220.0
    assert req.check_deadline(200.0) is False and req.poll is T


def test_entering_a_state_starts_its_own_deadline():
    req = RequestState(1, "decode", now=0.0)
    req.handle(Event.BOOTSTRAPPED, 50.0)
    assert (req.entered_at, req.deadline) == (50.0, 350.0)


def test_terminal_states_have_no_deadline():
    for state in (S, F):
        req = in_state(Side.PREFILL, state, now=1.0)
        assert req.deadline is None and req.is_terminal
        assert req.check_deadline(1e15) is False and req.poll is state


@pytest.mark.parametrize("now", [float("nan"), float("inf"), "1.0", None])
def test_bad_now_is_refused_and_changes_nothing(now):
    req = in_state(Side.PREFILL, W)
    before = snapshot(req)
    with pytest.raises((TypeError, ValueError), match="now"):
        req.handle(Event.CHUNK_STARTED, now)
    with pytest.raises((TypeError, ValueError), match="now"):
        req.check_deadline(now)
    assert snapshot(req) == before


# -- construction ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        (dict(room=-1), ValueError, r"room=-1 must be an integer in \[0, 2\*\*64\)"),
        (dict(room=2**64), ValueError, "room=18446744073709551616 must be"),
        (dict(room="1"), ValueError, "room='1' must be"),
        (dict(side="middle"), ValueError, "side='middle' must be 'prefill' or 'decode'"),
        (dict(deadlines={"bootstrapping": 1}), TypeError, "deadlines must be a Deadlines, got dict"),
    ],
)
def test_request_state_construction_is_validated(kwargs, error, text):
    args = dict(room=1, side="prefill", now=0.0)
    args.update(kwargs)
    with pytest.raises(error, match=text):
        RequestState(**args)


def test_repr_shows_room_state_and_reason():
    req = in_state(Side.DECODE, B)
    req.fail("no route", 0.0)
    assert repr(req) == "RequestState(room=1, side=decode, poll=Failed, reason='no route')"


def test_describe_transitions_lists_every_edge():
    text = describe_transitions("decode")
    assert text.count("\n") == 1 + len(DECODE_TRANSITIONS)
    assert "| WaitingForInput | WRITER_DONE | Transferring |" in text


# -- expected writers (decode) -----------------------------------------------------------------------------
def decode_waiting(writers=(0, 1, 2)) -> RequestState:
    req = in_state(Side.DECODE, W)
    req.expect_writers(writers)
    return req


def test_success_only_when_every_expected_writer_is_done():
    req = decode_waiting()
    assert req.writer_done(2, 1.0) is T
    assert req.writers_missing == (0, 1)
    assert req.writer_done(0, 2.0) is T
    assert req.writer_done(1, 3.0) is S
    assert req.writers_missing == () and req.is_terminal


def test_single_writer_goes_straight_to_success():
    assert decode_waiting([4]).writer_done(4, 1.0) is S


def test_writer_done_restarts_the_transferring_deadline():
    req = decode_waiting()
    req.writer_done(0, 10.0)
    assert req.deadline == 130.0
    req.writer_done(1, 100.0)
    assert req.deadline == 220.0


@pytest.mark.parametrize(
    "rank, text",
    [
        (5, r"prefill tp_rank=5 is not an expected writer \(expected \[0, 1, 2\]\)"),
        (True, "prefill tp_rank=True is not an expected writer"),
        ("1", "prefill tp_rank='1' is not an expected writer"),
    ],
)
def test_an_unexpected_writer_raises_and_changes_nothing(rank, text):
    req = decode_waiting()
    before = snapshot(req)
    with pytest.raises(LocalProtocolError, match=text):
        req.writer_done(rank, 1.0)
    assert snapshot(req) == before


def test_a_writer_reporting_twice_raises_and_changes_nothing():
    req = decode_waiting()
    req.writer_done(1, 1.0)
    before = snapshot(req)
    with pytest.raises(LocalProtocolError, match="prefill tp_rank=1 reported done twice"):
        req.writer_done(1, 2.0)
    assert snapshot(req) == before


def test_a_writer_done_after_failure_raises_and_is_not_counted():
    req = decode_waiting()
    req.abort("client went away", 1.0)
    with pytest.raises(LocalProtocolError, match="cannot take event WRITER_DONE"):
        req.writer_done(0, 2.0)
    assert req.writers_missing == (0, 1, 2)


def test_writer_done_before_bootstrap_is_illegal():
    req = RequestState(1, "decode", now=0.0)
    req.expect_writers([0])
    with pytest.raises(LocalProtocolError, match="state Bootstrapping .*cannot take event TRANSFER_DONE"):
        req.writer_done(0, 1.0)
    assert req.writers_missing == (0,)


def test_completion_cannot_bypass_the_writer_count():
    req = decode_waiting()
    for event in (Event.TRANSFER_DONE, Event.WRITER_DONE):
        with pytest.raises(LocalProtocolError, match=rf"{event.name} must come through writer_done"):
            req.handle(event, 1.0)
    assert req.poll is W


@pytest.mark.parametrize(
    "call, error, text",
    [
        (lambda r: r.writer_done(0, 1.0), LocalProtocolError, "writer_done before expect_writers"),
        (
            lambda r: (r.expect_writers([0]), r.expect_writers([1])),
            LocalProtocolError,
            r"expected writers already set to \[0\]",
        ),
        (lambda r: r.expect_writers([]), ValueError, r"tp_ranks=\[\] must be non-empty and distinct"),
        (lambda r: r.expect_writers([1, 1]), ValueError, r"tp_ranks=\[1, 1\] must be non-empty and distinct"),
        (lambda r: r.expect_writers([-1]), ValueError, r"writer tp_rank=-1 must be an integer in \[0, 1024\)"),
    ],
)
def test_writer_bookkeeping_misuse(call, error, text):
    with pytest.raises(error, match=text):
        call(in_state(Side.DECODE, W))


def test_expect_writers_is_decode_only_and_not_after_the_end():
    with pytest.raises(LocalProtocolError, match="expect_writers is for the decode side"):
        in_state(Side.PREFILL, W).expect_writers([0])
    with pytest.raises(LocalProtocolError, match="is already Failed"):
        in_state(Side.DECODE, F).expect_writers([0])


# -- random event sequences ------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.sampled_from(list(Side)), st.lists(st.tuples(st.sampled_from(list(Event)), st.floats(0, 1000)), max_size=12))
def test_random_event_sequences_keep_the_invariants(side, steps):
    req = RequestState(9, side, now=0.0)
    now = 0.0
    for event, dt in steps:
        now += dt
        before = snapshot(req)
        try:
            req.handle(event, now, "r" if event in FAILURES else None)
        except LocalProtocolError:
            assert snapshot(req) == before
            assert (before[0], event) not in TRANSITIONS[side]
            continue
        old, new = before[0], req.poll
        assert old not in (S, F), "a terminal state moved"
        assert new is F or new >= old
        assert (req.deadline is None) == req.is_terminal


def test_on_terminal_is_called_once_when_the_request_ends():
    calls = []
    ok = RequestState(7, "prefill", 0.0)
    ok.on_terminal(lambda: calls.append("ok"))
    ok.handle(Event.BOOTSTRAPPED, 0.1)
    ok.handle(Event.CHUNK_STARTED, 0.2)
    assert calls == []  # live states do not call it
    ok.handle(Event.TRANSFER_DONE, 0.3)
    assert calls == ["ok"]
    failed = RequestState(8, "decode", 0.0)
    failed.on_terminal(lambda: calls.append("failed"))
    failed.handle(Event.FAIL, 0.1, reason="peer gone")
    with pytest.raises(LocalProtocolError):
        failed.handle(Event.FAIL, 0.2, reason="again")  # terminal: refused, and not called again
    assert calls == ["ok", "failed"]
    failed.on_terminal(lambda: calls.append("late"))  # already ended: called at once
    assert calls == ["ok", "failed", "late"]
