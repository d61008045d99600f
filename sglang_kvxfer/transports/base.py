"""The transport interface: value types, the ``Transport`` base class, tickets, validation.

This module owns what every transport shares: the ``Transport`` contract (register memory,
exchange opaque descriptors, post a batch of one-sided writes given as offset/size arrays,
poll or wait on a ``Ticket`` with a deadline, report peer failures, close), the batch
validation that runs before any byte moves, the coalescing of contiguous entries, and the
``Ticket`` state machine (PENDING -> DONE | FAILED, failure sticky, failure wins in
``wait_all``). It must not open sockets, map memory or import torch: transports do that.
"""
from __future__ import annotations

import abc
import enum
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from sglang_kvxfer.errors import KVXferError, TransferTimeoutError, TransportError

__all__ = [
    "Caps",
    "Region",
    "RemoteRegion",
    "PeerFailure",
    "Entries",
    "TicketState",
    "Ticket",
    "Transport",
    "wait_all",
    "validate_batch",
    "coalesce",
    "parse_device",
    "pack_descriptor",
    "unpack_descriptor",
    "UseTable",
    "tensor_memory",
]

MEM_KINDS = ("cpu", "cuda")


@dataclass(frozen=True)
class Caps:
    """What a transport can do; optional features default to "not supported".

    ``mem_kinds``: memory kinds it can register (``"cpu"``, ``"cuda"``).
    ``same_host_only``: peers must run on this host (same kernel boot).
    ``read_supported``: ``read()`` is implemented (one-sided pull).
    ``one_sided``: bytes land without a thread of the target process taking part.
    """

    mem_kinds: frozenset
    same_host_only: bool
    read_supported: bool = False
    one_sided: bool = False


@dataclass(frozen=True)
class Region:
    """A registered local memory region; ``descriptor`` is what a peer needs to import it."""

    region_id: int
    ptr: int
    nbytes: int
    device: str
    descriptor: bytes = field(repr=False)


@dataclass(frozen=True)
class RemoteRegion:
    """A peer's region as imported by ``Transport.import_region``."""

    peer_id: str
    region_id: int
    nbytes: int
    device: str


@dataclass(frozen=True)
class PeerFailure:
    """A peer observed to be gone (process exited, connection lost); ``reason`` says how."""

    peer_id: str
    reason: str


@dataclass(frozen=True)
class Entries:
    """One validated batch: three int64 arrays of equal length ``[num_entries]``."""

    local_offsets: np.ndarray
    remote_offsets: np.ndarray
    sizes: np.ndarray

    @property
    def num_entries(self) -> int:
        return int(self.sizes.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.sizes.sum())


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
    """

    __slots__ = ("label", "_lock", "_done_event", "_state", "_error", "_parts", "_progress",
                 "_waiters")

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

    @classmethod
    def completed(cls, label: str) -> "Ticket":
        ticket = cls(label)
        ticket._part_done()
        return ticket

    @classmethod
    def failed(cls, label: str, error: KVXferError) -> "Ticket":
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
                raise self._error.with_traceback(None)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferTimeoutError(f"{self.label}: not complete after {timeout_s} s")
            if self._progress is not None:
                remaining = min(remaining, self._POLL_SLICE_S)
            self._done_event.wait(remaining)

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
        pending = []
        for ticket in tickets:
            state = ticket.poll()
            if state is TicketState.FAILED:
                raise ticket._error.with_traceback(None)
            if state is TicketState.PENDING:
                pending.append(ticket)
        if not pending:
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransferTimeoutError(
                f"{len(pending)} of {len(tickets)} tickets not complete after {timeout_s} s "
                f"(first: {pending[0].label})"
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


# -- batch validation and coalescing ----------------------------------------------------

_ARRAY_NAMES = ("local_offsets", "remote_offsets", "sizes")


def _as_index_array(name: str, values) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        if arr.size == 0 and arr.dtype.kind == "f":  # np.asarray([]) is float64: an empty list
            return np.zeros(0, dtype=np.int64)
        raise TypeError(f"{name} must be an integer array, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        idx = int(np.argmax(arr > np.iinfo(np.int64).max))
        raise ValueError(f"{name}[{idx}] = {int(arr[idx])} does not fit in int64")
    out = np.ascontiguousarray(arr, dtype=np.int64)
    if out.size and int(out.min()) < 0:
        idx = int(np.argmax(out < 0))
        raise ValueError(f"{name}[{idx}] = {int(out[idx])} is negative")
    return out


def validate_batch(local_nbytes: int, remote_nbytes: int, local_offsets, remote_offsets,
                   sizes, *, local_name: str = "local region",
                   remote_name: str = "remote region") -> Entries:
    """Check a write batch against both region sizes; return it as int64 ``Entries``.

    Parameters
    ----------
    local_nbytes, remote_nbytes : sizes of the source and destination regions in bytes.
    local_offsets, remote_offsets, sizes : 1-D integer arrays ``[num_entries]``; entry i
        copies ``sizes[i]`` bytes from ``local_offsets[i]`` to ``remote_offsets[i]``.

    Raises ``TypeError`` (not integer) or ``ValueError`` (not 1-D, lengths differ, negative,
    or ``offset + size`` past a region end: the message names the entry index, offset, size
    and region size). Zero-size entries are allowed, also at ``offset == region size``.
    """
    arrays = [_as_index_array(n, v) for n, v in zip(_ARRAY_NAMES, (local_offsets,
                                                                   remote_offsets, sizes))]
    lengths = [a.shape[0] for a in arrays]
    if len(set(lengths)) != 1:
        raise ValueError(
            "local_offsets, remote_offsets and sizes must have the same length, got "
            f"{lengths[0]}, {lengths[1]} and {lengths[2]}"
        )
    lo, ro, sz = arrays
    for offs, limit, name, what in ((lo, local_nbytes, local_name, "local"),
                                    (ro, remote_nbytes, remote_name, "remote")):
        # Written as two comparisons so that offset + size cannot overflow int64.
        bad = (offs > limit) | (sz > limit - offs)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"entry {i}: {what} offset {int(offs[i])} + size {int(sz[i])} = "
                f"{int(offs[i]) + int(sz[i])} exceeds {name} of {limit} bytes"
            )
    return Entries(lo, ro, sz)


def coalesce(entries: Entries) -> Entries:
    """Drop zero-size entries, sort by remote offset, merge runs contiguous on both sides.

    The result moves the same bytes with fewer, larger entries. Where destination ranges of
    one batch overlap, which write lands last is unspecified (as with RDMA).
    """
    keep = entries.sizes > 0
    lo, ro, sz = entries.local_offsets[keep], entries.remote_offsets[keep], entries.sizes[keep]
    if sz.size <= 1:
        return Entries(lo, ro, sz)
    order = np.argsort(ro, kind="stable")
    lo, ro, sz = lo[order], ro[order], sz[order]
    ends_l, ends_r = lo[:-1] + sz[:-1], ro[:-1] + sz[:-1]
    starts = np.flatnonzero(np.concatenate(([True], (lo[1:] != ends_l) | (ro[1:] != ends_r))))
    if starts.size == sz.size:
        return Entries(lo, ro, sz)
    return Entries(lo[starts], ro[starts], np.add.reduceat(sz, starts))


def parse_device(device) -> tuple[str, int]:
    """``"cpu"`` -> ("cpu", -1); ``"cuda"``/``"cuda:N"`` (or a torch.device) -> ("cuda", N)."""
    text = str(device)
    kind, _, index = text.partition(":")
    if kind == "cpu" and not index:
        return "cpu", -1
    if kind == "cuda":
        if not index:
            return "cuda", 0
        if index.isdigit():
            return "cuda", int(index)
    raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


# -- descriptors ------------------------------------------------------------------------

DESCRIPTOR_VERSION = 1


def pack_descriptor(transport: str, what: str, **fields) -> bytes:
    """Encode an agent or region descriptor: a msgpack map, tagged with transport and version."""
    import msgpack

    return msgpack.packb({"transport": transport, "what": what, "version": DESCRIPTOR_VERSION,
                          **fields}, use_bin_type=True)


def unpack_descriptor(blob, transport: str, what: str, fields: dict) -> dict:
    """Decode a descriptor made by ``pack_descriptor`` and check its fields.

    ``fields`` maps each required field to its type (or tuple of types). Raises
    ``TypeError`` if ``blob`` is not bytes and ``ValueError`` naming the field otherwise.
    """
    import msgpack

    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"{what} descriptor must be bytes, got {type(blob).__name__}")
    try:
        obj = msgpack.unpackb(bytes(blob), raw=False)
    except Exception as exc:
        raise ValueError(f"{what} descriptor is not a valid msgpack map ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{what} descriptor must be a msgpack map, got {type(obj).__name__}")
    if obj.get("transport") != transport:
        raise ValueError(f"{what} descriptor is for transport {obj.get('transport')!r}; "
                         f"transport {transport!r} cannot use it")
    if obj.get("what") != what:
        raise ValueError(f"expected a {transport} {what} descriptor, got {obj.get('what')!r}")
    if obj.get("version") != DESCRIPTOR_VERSION:
        raise ValueError(f"{transport} {what} descriptor has version {obj.get('version')!r}, "
                         f"this build speaks {DESCRIPTOR_VERSION}")
    for name, types in fields.items():
        value = obj.get(name)
        if not isinstance(value, types) or isinstance(value, bool) and bool not in (
                types if isinstance(types, tuple) else (types,)):
            raise ValueError(f"{transport} {what} descriptor: field {name!r} is {value!r}, "
                             f"expected {getattr(types, '__name__', types)}")
    return obj


def tensor_memory(tensor) -> tuple[int, int, str]:
    """``(data_ptr, nbytes, device)`` of a contiguous torch tensor, without importing torch."""
    if not hasattr(tensor, "data_ptr") or not hasattr(tensor, "is_contiguous"):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"the tensor must be contiguous, got shape {tuple(tensor.shape)} with "
                         f"stride {tuple(tensor.stride())}")
    return tensor.data_ptr(), tensor.numel() * tensor.element_size(), str(tensor.device)


# -- the interface ----------------------------------------------------------------------


class Transport(abc.ABC):
    """Moves bytes from this process's registered memory into peers' registered memory.

    One instance per process (or device). The engine's bootstrap carries the opaque
    ``agent_descriptor()`` and ``Region.descriptor`` bytes to peers. Writes are one-sided
    pushes posted as offset/size arrays in one call; completion is observed on the writer's
    ``Ticket``, and telling the target "done" is the engine's own message. Close with
    ``close()`` or a ``with`` block; nothing blocks in ``__del__``.
    """

    name: str = "?"
    caps: Caps

    def __init__(self) -> None:
        self._closed = False

    # -- required core ------------------------------------------------------------------
    @abc.abstractmethod
    def agent_descriptor(self) -> bytes:
        """Opaque bytes a peer passes to ``add_peer`` to reach this transport."""

    @abc.abstractmethod
    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        """Make the peer whose ``agent_descriptor()`` is ``descriptor`` known as ``peer_id``."""

    @abc.abstractmethod
    def remove_peer(self, peer_id: str) -> None:
        """Forget a peer; its imported regions become invalid and its pending tickets fail."""

    @abc.abstractmethod
    def register(self, ptr: int, nbytes: int, device: str = "cpu") -> Region:
        """Register ``nbytes`` of memory at address ``ptr`` on ``device``."""

    @abc.abstractmethod
    def deregister(self, region: Region) -> None:
        """Stop using a region (waits, bounded, for writes that read or fill it)."""

    @abc.abstractmethod
    def import_region(self, peer_id: str, descriptor: bytes) -> RemoteRegion:
        """Turn a peer's ``Region.descriptor`` into a ``RemoteRegion`` writes can target."""

    @abc.abstractmethod
    def _write(self, local: Region, remote: RemoteRegion, entries: Entries) -> Ticket:
        """Post validated, coalesced ``entries``; an empty batch returns a DONE ticket.

        Must check that ``local`` is live here and ``remote`` is imported from a known peer
        before anything moves; transport failures go on the ticket, not raised.
        """

    @abc.abstractmethod
    def peer_failures(self) -> list[PeerFailure]:
        """Peer failures observed since the last call (drained)."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Release everything; bounded in time."""

    # -- provided -----------------------------------------------------------------------
    def write(self, local: Region, remote: RemoteRegion, local_offsets, remote_offsets,
              sizes) -> Ticket:
        """Post one batch of one-sided writes from ``local`` into ``remote``.

        Parameters
        ----------
        local : a Region registered on this transport (the source).
        remote : a RemoteRegion imported from a peer (the destination).
        local_offsets, remote_offsets, sizes : int64 arrays ``[num_entries]``; entry i
            copies ``sizes[i]`` bytes from ``local.ptr + local_offsets[i]`` to the remote
            region at ``remote_offsets[i]``.

        The whole batch is validated before any byte moves: an out-of-range entry raises
        ``ValueError`` naming it and nothing is written. Returns a ``Ticket``; peer and
        transport failures are reported on it.
        """
        self._check_open()
        if not isinstance(local, Region):
            raise TypeError(f"local must be a Region, got {type(local).__name__}")
        if not isinstance(remote, RemoteRegion):
            raise TypeError(f"remote must be a RemoteRegion, got {type(remote).__name__}")
        entries = validate_batch(
            local.nbytes, remote.nbytes, local_offsets, remote_offsets, sizes,
            local_name=f"local region {local.region_id}",
            remote_name=f"remote region {remote.region_id} of peer {remote.peer_id!r}",
        )
        return self._write(local, remote, coalesce(entries))

    def read(self, local: Region, remote: RemoteRegion, local_offsets, remote_offsets,
             sizes) -> Ticket:
        """One-sided pull; only where ``caps.read_supported``."""
        raise TransportError(f"transport {self.name!r} does not support read "
                             "(caps.read_supported is False)")

    def register_tensor(self, tensor) -> Region:
        """Register a contiguous torch tensor's bytes (``data_ptr``, ``nbytes``, ``device``)."""
        ptr, nbytes, device = tensor_memory(tensor)
        return self.register(ptr, nbytes, device)

    def close(self) -> None:
        """Release sockets, threads, mappings and regions. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"transport {self.name!r} is closed")

    @staticmethod
    def _check_register_args(ptr: int, nbytes: int) -> None:
        for arg, value in (("ptr", ptr), ("nbytes", nbytes)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{arg} must be an int, got {type(value).__name__}")
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        if ptr <= 0:
            raise ValueError(f"ptr must be a non-null address, got {ptr:#x}")


class UseTable:
    """Live objects by key, each with a count of in-flight users.

    Transports keep their regions and mappings here so that removing one (``deregister``,
    ``remove_peer``) stops new users at once and then waits, bounded, for the users already
    copying into or out of that memory before the memory may be freed or unmapped.
    """

    class Lease:
        __slots__ = ("key", "value", "uses")

        def __init__(self, key, value):
            self.key, self.value, self.uses = key, value, 0

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._live: dict = {}

    def add(self, key, value) -> None:
        with self._cond:
            if key in self._live:
                raise ValueError(f"{key!r} is already present")
            self._live[key] = UseTable.Lease(key, value)

    def get(self, key):
        """The value under ``key``, or None."""
        lease = self._live.get(key)
        return None if lease is None else lease.value

    def items(self) -> list:
        with self._cond:
            return [(k, lease.value) for k, lease in self._live.items()]

    def acquire(self, key) -> "UseTable.Lease | None":
        """Count one more user of ``key``; None when it is absent (or being removed)."""
        with self._cond:
            lease = self._live.get(key)
            if lease is not None:
                lease.uses += 1
            return lease

    def release(self, lease: "UseTable.Lease") -> None:
        with self._cond:
            lease.uses -= 1
            if lease.uses == 0:
                self._cond.notify_all()

    def remove(self, key, timeout_s: float, on_timeout: Callable[[], None] | None = None):
        """Remove ``key`` now; wait until its users are gone. Returns the value (None if absent).

        If users remain after ``timeout_s``, ``on_timeout`` (which should make them stop,
        e.g. by shutting their sockets down) is called and the wait repeats once. Raises
        ``TransportError`` when users still remain (the key stays removed).
        """
        with self._cond:
            lease = self._live.pop(key, None)
            if lease is None:
                return None
            idle = self._cond.wait_for(lambda: lease.uses == 0, timeout_s)
        if not idle and on_timeout is not None:
            on_timeout()
            with self._cond:
                idle = self._cond.wait_for(lambda: lease.uses == 0, timeout_s)
        if not idle:
            raise TransportError(
                f"{key!r} still has {lease.uses} transfer(s) in flight after {timeout_s} s")
        return lease.value

    def busy(self, key) -> bool:
        lease = self._live.get(key)
        return lease is not None and lease.uses > 0
