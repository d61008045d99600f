"""The per-request state machine (SGLang's ``KVPoll``), written as transition tables.

Rule 1 (h11): everything that decides a request's state lives in this file; the engine
only feeds events in (with the time) and reads ``poll``.
Rule 2: no clocks, threads or I/O. ``now`` is always passed in (seconds on the caller's
monotonic clock), so a test can drive years of deadlines in microseconds.

Lifecycle, one ``RequestState`` per room per side::

    Bootstrapping -> WaitingForInput -> Transferring -> Success
          \\________________\\________________\\______-> Failed (reason)

Success and Failed are terminal. FAIL / ABORT / TIMEOUT lead to Failed from every other
state and carry a reason. An event the table does not list for the current state raises
``LocalProtocolError`` naming both, and leaves the state as it was. Poll values only grow,
except on the way to Failed (SGLang's ``update_status`` invariant).

Every live state has a deadline (``Deadlines``); ``check_deadline(now)`` fails an expired
request. Transferring's deadline restarts on each sign of progress (a chunk, a writer
done), so it bounds time *without progress*, not the length of a long prompt's transfer.
"""

from __future__ import annotations

import enum
import math
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from sglang_kvxfer.errors import LocalProtocolError
from sglang_kvxfer.protocol.fields import MAX_REASON_CHARS, MAX_TP_SIZE, UINT64_MAX, Side, Text

__all__ = [
    "KVPoll",
    "Event",
    "Deadlines",
    "RequestState",
    "PREFILL_TRANSITIONS",
    "DECODE_TRANSITIONS",
    "TRANSITIONS",
    "describe_transitions",
]


class KVPoll(enum.IntEnum):
    """Request status, with SGLang's values (so polls can be all-reduced with MIN)."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class Event(enum.Enum):
    """What can happen to a request. Which side sees which is in the tables below."""

    BOOTSTRAPPED = "bootstrapped"  # peers known; registration and RequestMeta exchanged
    CHUNK_STARTED = "chunk_started"  # prefill: a chunk went to the transport; decode: ChunkReady came
    WRITER_DONE = "writer_done"  # decode: one prefill writer finished, others still due
    TRANSFER_DONE = "transfer_done"  # prefill: all writes done, notices sent; decode: last writer done
    FAIL = "fail"  # an error on this side
    ABORT = "abort"  # either side gave up on the room
    TIMEOUT = "timeout"  # the current state's deadline passed
    # the prefill's forward of the room finished, with a decode that allocates only then
    # (prefill: restarts the wait for the decode's metadata; decode: its wait for allocation)
    PREFILL_COMPLETE = "prefill_complete"


_B, _W, _T = KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring
_S, _F = KVPoll.Success, KVPoll.Failed
LIVE_STATES = (_B, _W, _T)
TERMINAL_STATES = (_S, _F)
FAILURE_EVENTS = (Event.FAIL, Event.ABORT, Event.TIMEOUT)

Table = Mapping[tuple[KVPoll, Event], KVPoll]


def _table(*edges: tuple[tuple[KVPoll, Event], KVPoll]) -> Table:
    table = dict(edges)
    for state in LIVE_STATES:
        for event in FAILURE_EVENTS:
            table[(state, event)] = _F
    return types.MappingProxyType(table)


PREFILL_TRANSITIONS: Table = _table(
    ((_B, Event.BOOTSTRAPPED), _W),  # every expected decode rank sent its RequestMeta
    ((_B, Event.PREFILL_COMPLETE), _B),  # the decode allocates now: its metadata's deadline starts
    ((_W, Event.CHUNK_STARTED), _T),
    ((_T, Event.CHUNK_STARTED), _T),  # later chunks: progress
    ((_W, Event.TRANSFER_DONE), _S),  # this rank was elected for no decode rank: nothing to write
    ((_T, Event.TRANSFER_DONE), _S),
)

DECODE_TRANSITIONS: Table = _table(
    ((_B, Event.BOOTSTRAPPED), _W),  # registered with the prefill ranks, RequestMeta sent
    ((_W, Event.PREFILL_COMPLETE), _W),  # every watched prefill rank is ready: the allocation's deadline
    ((_W, Event.CHUNK_STARTED), _T),
    ((_T, Event.CHUNK_STARTED), _T),
    ((_W, Event.WRITER_DONE), _T),  # direct path: a writer's TransferDone is the first news
    ((_T, Event.WRITER_DONE), _T),
    ((_W, Event.TRANSFER_DONE), _S),  # direct path, single writer
    ((_T, Event.TRANSFER_DONE), _S),
)

TRANSITIONS: Mapping[Side, Table] = types.MappingProxyType(
    {Side.PREFILL: PREFILL_TRANSITIONS, Side.DECODE: DECODE_TRANSITIONS}
)

_REASON = Text(MAX_REASON_CHARS, r"(?s).*\S.*", "a non-empty reason", cut=True)


def describe_transitions(side: Side | str) -> str:
    """The ``side``'s table as Markdown rows ``| state | event | next |`` (for docs)."""
    table = TRANSITIONS[Side(side)]
    rows = ["| state | event | next state |", "|---|---|---|"]
    rows += [f"| {s.name} | {e.name} | {n.name} |" for (s, e), n in table.items()]
    return "\n".join(rows)


def _check_seconds(name: str, value: object, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name}={value!r} must be a finite number" + (" > 0" if positive else ""))
    return float(value)


@dataclass(frozen=True, slots=True)
class Deadlines:
    """Seconds a request may stay in each live state (Transferring: without progress)."""

    bootstrapping: float = 60.0
    waiting_for_input: float = 300.0
    transferring: float = 120.0

    def __post_init__(self) -> None:
        for name in ("bootstrapping", "waiting_for_input", "transferring"):
            object.__setattr__(self, name, _check_seconds(name, getattr(self, name), True))

    def for_state(self, state: KVPoll) -> float:
        if state is _B:
            return self.bootstrapping
        if state is _W:
            return self.waiting_for_input
        if state is _T:
            return self.transferring
        raise ValueError(f"{KVPoll(state).name} is terminal and has no deadline")


class RequestState:
    """One room on one side: its ``poll``, failure ``reason`` and current ``deadline``.

    Args:
        room: the request id (unsigned 64-bit).
        side: ``Side.PREFILL`` or ``Side.DECODE`` (picks the transition table).
        now: the caller's monotonic time; the request starts in Bootstrapping.
        deadlines: per-state limits.
    """

    __slots__ = (
        "room",
        "side",
        "deadlines",
        "poll",
        "reason",
        "entered_at",
        "deadline",
        "_table",
        "_writers",
        "_writers_done",
        "_on_terminal",
    )

    def __init__(self, room: int, side: Side | str, now: float, deadlines: Deadlines | None = None):
        if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room <= UINT64_MAX:
            raise ValueError(f"room={room!r} must be an integer in [0, 2**64)")
        if not isinstance(side, (Side, str)) or side not in ("prefill", "decode"):
            raise ValueError(f"side={side!r} must be 'prefill' or 'decode'")
        if deadlines is not None and not isinstance(deadlines, Deadlines):
            raise TypeError(f"deadlines must be a Deadlines, got {type(deadlines).__name__}")
        self.room = room
        self.side = Side(side)
        self.deadlines = deadlines or Deadlines()
        self._table = TRANSITIONS[self.side]
        self._writers: frozenset[int] | None = None
        self._writers_done: set[int] = set()
        self._on_terminal: Callable[[], None] | None = None
        self.poll = _B
        self.reason: str | None = None
        self._enter(_B, _check_seconds("now", now, False))

    # -- reading -----------------------------------------------------------------------------
    @property
    def is_terminal(self) -> bool:
        return self.poll in TERMINAL_STATES

    @property
    def writers_missing(self) -> tuple[int, ...]:
        """Decode: expected writer ranks that have not reported done yet (sorted)."""
        if self._writers is None:
            return ()
        return tuple(sorted(self._writers - self._writers_done))

    def __repr__(self) -> str:
        why = f", reason={self.reason!r}" if self.reason else ""
        return f"RequestState(room={self.room}, side={self.side}, poll={self.poll.name}{why})"

    def on_terminal(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once when the request enters Success or Failed (at once if it
        is there already): the I/O layer wakes whoever waits for the request. It must not
        raise. One callback per request; a second replaces the first."""
        if self.is_terminal:
            callback()
        else:
            self._on_terminal = callback

    # -- events ------------------------------------------------------------------------------
    def handle(self, event: Event, now: float, reason: str | None = None) -> KVPoll:
        """Apply ``event`` at time ``now``; returns the new poll.

        ``reason`` is required for FAIL / ABORT / TIMEOUT and refused for the others.
        Raises ``LocalProtocolError`` (state unchanged) when the table has no entry for
        (current state, event). On decode, once ``expect_writers`` was called, completion
        goes through ``writer_done`` only, so the writer count cannot be bypassed.
        """
        if self._writers is not None and event in (Event.WRITER_DONE, Event.TRANSFER_DONE):
            raise LocalProtocolError(
                f"room {self.room}: {event.name} must come through writer_done(tp_rank, now) "
                f"once expected writers are set (missing: {list(self.writers_missing)})"
            )
        return self._apply(event, now, reason)

    def fail(self, reason: str, now: float) -> KVPoll:
        return self.handle(Event.FAIL, now, reason)

    def abort(self, reason: str, now: float) -> KVPoll:
        return self.handle(Event.ABORT, now, reason)

    def check_deadline(self, now: float, detail: Callable[[KVPoll], str] | None = None) -> bool:
        """Fail the request if its current state's deadline has passed; True if it did.
        ``detail(state)``: what the request was waiting for, appended to the reason."""
        now = _check_seconds("now", now, False)
        deadline = self.deadline  # None exactly when terminal
        if self.is_terminal or deadline is None or now < deadline:
            return False
        limit = self.deadlines.for_state(self.poll)
        extra = " without progress" if self.poll is _T else ""
        why = detail(self.poll) if detail is not None else ""
        extra += f" ({why})" if why else ""
        self._apply(Event.TIMEOUT, now, f"timed out after {limit:.1f} s in {self.poll.name}{extra}")
        return True

    def expect_writers(self, tp_ranks: Iterable[int]) -> None:
        """Decode: the prefill ranks that will write this room (one ``TransferDone`` each).

        Call once, before the first ``writer_done``; Success then needs all of them.
        """
        if self.side is not Side.DECODE:
            raise LocalProtocolError(f"room {self.room}: expect_writers is for the decode side")
        if self._writers is not None:
            raise LocalProtocolError(f"room {self.room}: expected writers already set to {sorted(self._writers)}")
        if self.is_terminal:
            raise LocalProtocolError(f"room {self.room}: is already {self.poll.name}")
        ranks = list(tp_ranks)
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < MAX_TP_SIZE:
                raise ValueError(f"writer tp_rank={r!r} must be an integer in [0, {MAX_TP_SIZE})")
        if not ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"tp_ranks={ranks} must be non-empty and distinct")
        self._writers = frozenset(ranks)

    def writer_done(self, tp_rank: int, now: float) -> KVPoll:
        """Decode: prefill rank ``tp_rank`` reported ``TransferDone``.

        Moves to Success when it is the last expected writer, else to Transferring. An
        unexpected or repeated rank raises ``LocalProtocolError`` and changes nothing.
        """
        if self._writers is None:
            raise LocalProtocolError(f"room {self.room}: writer_done before expect_writers (side {self.side})")
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or tp_rank not in self._writers:
            raise LocalProtocolError(
                f"room {self.room}: prefill tp_rank={tp_rank!r} is not an expected writer "
                f"(expected {sorted(self._writers)})"
            )
        if tp_rank in self._writers_done:
            raise LocalProtocolError(f"room {self.room}: prefill tp_rank={tp_rank} reported done twice")
        last = len(self._writers_done) + 1 == len(self._writers)
        poll = self._apply(Event.TRANSFER_DONE if last else Event.WRITER_DONE, now, None)
        self._writers_done.add(tp_rank)  # after _apply: an illegal event changes nothing
        return poll

    # -- the one place state changes ------------------------------------------------------------
    def _apply(self, event: Event, now: float, reason: str | None) -> KVPoll:
        if not isinstance(event, Event):
            raise LocalProtocolError(f"event must be an Event, got {type(event).__name__} {event!r}")
        now = _check_seconds("now", now, False)
        nxt = self._table.get((self.poll, event))
        if nxt is None:
            why = f" ({self.reason})" if self.reason else ""
            raise LocalProtocolError(
                f"room {self.room}: {self.side} request in state {self.poll.name}{why} cannot take event {event.name}"
            )
        if event in FAILURE_EVENTS:
            if reason is None:
                raise LocalProtocolError(f"room {self.room}: {event.name} needs a reason")
            reason = _REASON.check(reason, f"{event.name} reason")
        elif reason is not None:
            raise LocalProtocolError(f"room {self.room}: {event.name} takes no reason, got {reason!r}")
        if nxt is _F:
            self.reason = reason
        self._enter(nxt, now)
        return nxt

    def _enter(self, state: KVPoll, now: float) -> None:
        self.poll = state
        self.entered_at = now
        self.deadline = None if state in TERMINAL_STATES else now + self.deadlines.for_state(state)
        if state in TERMINAL_STATES and self._on_terminal is not None:
            notify, self._on_terminal = self._on_terminal, None
            notify()
