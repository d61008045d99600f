"""Tickets: the completion of one posted batch, and waiting on several with a deadline.

A ``Ticket`` goes PENDING -> DONE or PENDING -> FAILED exactly once; a failure is sticky
and carries a ``KVXferError``. ``poll`` never raises; ``wait`` and ``wait_all`` always
take a timeout and raise ``TransferTimeoutError`` past it; in ``wait_all`` failure wins.
Transports complete tickets through the underscore methods. This module must not know
about any transport.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections.abc import Callable, Iterable

from sglang_kvxfer.errors import KVXferError, TransferTimeoutError, TransportError

__all__ = ["TicketState", "Ticket", "wait_all"]


class TicketState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class Ticket:
    """Completion of one posted batch.

    A ticket starts PENDING and ends DONE or FAILED exactly once; a failure is sticky and
    carries the error. ``parts`` > 1 means the batch travels in several pieces (e.g. over
    several connections): the ticket is DONE when every part is, FAILED as soon as one fails.
    ``progress`` is an optional callable polled by ``poll``/``wait`` that returns True when
    the work is complete (for completions nobody signals, such as a CUDA event).
    ``receipts``: where the transport has ``caps.receipts``, the ``(connection id, frame
    number)`` of each frame of the batch, which the reader's transport can check
    (``Transport.landed``); None otherwise.
    """

    __slots__ = ("label", "_lock", "_done_event", "_state", "_error", "_parts", "_progress", "_waiters", "receipts")

    _POLL_SLICE_S = 0.0005  # how often a progress-driven ticket is re-polled while waiting

    def __init__(self, label: str, parts: int = 1, progress: Callable[[], bool] | None = None):
        if parts < 1:
            raise ValueError(f"Ticket parts must be >= 1, got {parts}")
        self.label = label
        self._lock = threading.Lock()
        self._done_event = threading.Event()
        self._state = TicketState.PENDING
        self._error: KVXferError | None = None
        self._parts = parts
        self._progress = progress
        self._waiters: list[threading.Event] = []
        self.receipts: tuple[tuple[int, int], ...] | None = None

    @classmethod
    def completed(cls, label: str) -> Ticket:
        ticket = cls(label)
        ticket._part_done()
        return ticket

    @classmethod
    def failed(cls, label: str, error: KVXferError) -> Ticket:
        ticket = cls(label)
        ticket._fail(error)
        return ticket

    @property
    def error(self) -> KVXferError | None:
        """The error of a FAILED ticket, else None."""
        return self._error

    @property
    def reason(self) -> str | None:
        """Why the ticket failed, as text, else None."""
        return None if self._error is None else str(self._error)

    def poll(self) -> TicketState:
        """The current state; drives ``progress`` once. Never raises."""
        if self._state is TicketState.PENDING and self._progress is not None:
            try:
                finished = self._progress()
            except Exception as exc:  # a progress hook failure is the ticket's failure
                self._fail(TransportError(f"{self.label}: {type(exc).__name__}: {exc}"))
            else:
                if finished:
                    self._complete_all()
        return self._state

    def wait(self, timeout_s: float) -> None:
        """Block until DONE (return), FAILED (raise its error) or ``timeout_s`` passes.

        Raises ``TransferTimeoutError`` on timeout, the ticket's ``TransportError`` /
        ``PeerGoneError`` on failure, ``ValueError`` for a negative or non-finite timeout.
        """
        deadline = time.monotonic() + _check_timeout(timeout_s)
        while True:
            state = self.poll()
            if state is TicketState.DONE:
                return
            if state is TicketState.FAILED:
                raise self._failure().with_traceback(None)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferTimeoutError(f"{self.label}: not complete after {timeout_s} s")
            if self._progress is not None:
                remaining = min(remaining, self._POLL_SLICE_S)
            self._done_event.wait(remaining)

    def _failure(self) -> KVXferError:
        """The error of a FAILED ticket (``_fail`` sets it together with the state)."""
        if self._error is None:
            raise TransportError(f"{self.label}: ticket is not FAILED, it has no error")
        return self._error

    # -- used by transports -------------------------------------------------------------
    def _part_done(self) -> None:
        with self._lock:
            if self._state is not TicketState.PENDING:
                return
            self._parts -= 1
            if self._parts > 0:
                return
            self._state = TicketState.DONE
        self._wake()

    def _complete_all(self) -> None:
        with self._lock:
            if self._state is not TicketState.PENDING:
                return
            self._parts = 0
            self._state = TicketState.DONE
        self._wake()

    def _fail(self, error: KVXferError) -> None:
        with self._lock:
            if self._state is not TicketState.PENDING:
                return
            self._state = TicketState.FAILED
            self._error = error
        self._wake()

    def _wake(self) -> None:
        self._done_event.set()
        with self._lock:
            waiters, self._waiters = self._waiters, []
        for event in waiters:
            event.set()

    def _add_waiter(self, event: threading.Event) -> None:
        with self._lock:
            if self._state is TicketState.PENDING:
                self._waiters.append(event)
                return
        event.set()

    def __repr__(self) -> str:
        tail = f", reason={self.reason!r}" if self._error is not None else ""
        return f"Ticket({self.label!r}, {self._state.value}{tail})"


def pending_or_raise(tickets: list[Ticket]) -> list[Ticket]:
    """Poll every ticket once: raise the error of the first FAILED one (failure wins),
    else return those still PENDING."""
    pending = []
    for ticket in tickets:
        state = ticket.poll()
        if state is TicketState.FAILED:
            raise ticket._failure().with_traceback(None)
        if state is TicketState.PENDING:
            pending.append(ticket)
    return pending


def wait_all(tickets: Iterable[Ticket], timeout_s: float) -> None:
    """Wait until every ticket is DONE; failure wins.

    Returns when all are DONE. Raises the error of a FAILED ticket as soon as one is seen
    (even while others are still pending), or ``TransferTimeoutError`` naming how many are
    still pending after ``timeout_s``.
    """
    tickets = list(tickets)
    deadline = time.monotonic() + _check_timeout(timeout_s)
    wake = threading.Event()
    polled = any(t._progress is not None for t in tickets)
    while True:
        wake.clear()
        pending = pending_or_raise(tickets)
        if not pending:
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransferTimeoutError(
                f"{len(pending)} of {len(tickets)} tickets not complete after {timeout_s} s (first: {pending[0].label})"
            )
        for ticket in pending:
            ticket._add_waiter(wake)
        wake.wait(min(remaining, Ticket._POLL_SLICE_S) if polled else remaining)


def _check_timeout(timeout_s: float) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"timeout_s must be a number of seconds, got {timeout_s!r}")
    if not math.isfinite(timeout_s) or timeout_s < 0:
        raise ValueError(f"timeout_s must be finite and >= 0, got {timeout_s!r}")
    return float(timeout_s)
