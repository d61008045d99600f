"""The transport interface: value types, the ``Transport`` base class, batch validation.

This module owns the ``Transport`` contract every backend implements (register memory,
exchange opaque descriptors, post a batch of one-sided writes given as offset/size arrays
and get a ``Ticket``, report peer failures, close) and the checks that run before any
byte moves: batch validation against both region sizes and the coalescing of contiguous
entries. Tickets live in ``transports.ticket``. It must not open sockets, map memory or
import torch: transports do that.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, overload

import numpy as np

from sglang_kvxfer.errors import TransportError
from sglang_kvxfer.transports.ticket import Ticket, TicketState, wait_all

__all__ = [
    "Caps",
    "Region",
    "RemoteRegion",
    "PeerFailure",
    "Entries",
    "Transport",
    "Ticket",
    "TicketState",
    "wait_all",
    "validate_batch",
    "coalesce",
    "parse_device",
    "tensor_memory",
    "check_secret",
    "SECRET_BYTES",
]

MEM_KINDS = ("cpu", "cuda")
SECRET_BYTES = 32  # a peer secret: what the engine derives per (writer, reader) session pair


@overload
def check_secret(secret: object, *, optional: Literal[False] = False) -> bytes: ...


@overload
def check_secret(secret: object, *, optional: bool) -> bytes | None: ...


def check_secret(secret: object, *, optional: bool = False) -> bytes | None:
    """``secret`` as bytes after checking it is ``SECRET_BYTES`` long (or None if optional)."""
    if secret is None and optional:
        return None
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"secret must be {SECRET_BYTES} bytes, got {type(secret).__name__}")
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"secret must be {SECRET_BYTES} bytes, got {len(secret)}")
    return bytes(secret)


@dataclass(frozen=True)
class Caps:
    """What a transport can do; optional features default to "not supported".

    ``mem_kinds``: memory kinds it can register (``"cpu"``, ``"cuda"``).
    ``same_host_only``: peers must run on this host (same kernel boot).
    ``read_supported``: ``read()`` is implemented (one-sided pull).
    ``one_sided``: bytes land without a thread of the target process taking part.
    ``authenticates_peers``: the data plane itself refuses writers that did not prove the
    secret given to ``authorize_peer`` and confines them to their granted regions; where
    False, ``authorize_peer`` is recorded at most and the trust boundary is elsewhere
    (see docs/trust-model-transports.md).
    ``receipts``: a write's ``Ticket.receipts`` name its frames, and the reader's transport
    answers for them (``landed``/``wait_landed``) as soon as they are in its memory, before
    the writer's ticket completes: a writer may tell the reader "done" right after posting.
    """

    mem_kinds: frozenset
    same_host_only: bool
    read_supported: bool = False
    one_sided: bool = False
    authenticates_peers: bool = False
    receipts: bool = False


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


def validate_batch(
    local_nbytes: int,
    remote_nbytes: int,
    local_offsets,
    remote_offsets,
    sizes,
    *,
    local_name: str = "local region",
    remote_name: str = "remote region",
) -> Entries:
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
    arrays = [_as_index_array(n, v) for n, v in zip(_ARRAY_NAMES, (local_offsets, remote_offsets, sizes))]
    lengths = [a.shape[0] for a in arrays]
    if len(set(lengths)) != 1:
        raise ValueError(
            "local_offsets, remote_offsets and sizes must have the same length, got "
            f"{lengths[0]}, {lengths[1]} and {lengths[2]}"
        )
    lo, ro, sz = arrays
    for offs, limit, name, what in (
        (lo, local_nbytes, local_name, "local"),
        (ro, remote_nbytes, remote_name, "remote"),
    ):
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


def tensor_memory(tensor) -> tuple[int, int, str]:
    """``(data_ptr, nbytes, device)`` of a contiguous torch tensor, without importing torch."""
    if not hasattr(tensor, "data_ptr") or not hasattr(tensor, "is_contiguous"):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(
            f"the tensor must be contiguous, got shape {tuple(tensor.shape)} with stride {tuple(tensor.stride())}"
        )
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
    def add_peer(self, peer_id: str, descriptor: bytes, secret: bytes | None = None) -> None:
        """Make the peer whose ``agent_descriptor()`` is ``descriptor`` known as ``peer_id``.

        Writer side. ``secret`` (``SECRET_BYTES``) is what this writer proves to that peer,
        which was given the same bytes by ``authorize_peer``; transports without
        ``caps.authenticates_peers`` ignore it. Adding a ``peer_id`` that is already known
        replaces it: its connections and imported regions are dropped (its pending tickets
        fail), then the new record is installed, so a restarted peer is never refused.
        """

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

    # -- reader-side authorization (optional) -------------------------------------------
    def authorize_peer(self, peer_id: str, secret: bytes, regions: Sequence[Region]) -> None:
        """Reader side: let the writer ``peer_id`` that proves ``secret`` write into exactly
        ``regions`` (registered here) and nothing else; calling again replaces the grant.

        The default records nothing: this transport's own control plane decides who may
        write (``caps.authenticates_peers`` is False). Arguments are still checked.
        """
        self._check_grant_args(peer_id, secret, regions)

    def revoke_peer(self, peer_id: str) -> None:  # noqa: B027 - optional: a no-op where grants are not enforced
        """Reader side: drop ``peer_id``'s grant and close its inbound connections; an
        unknown ``peer_id`` is not an error. The default does nothing (see
        ``authorize_peer``)."""

    @staticmethod
    def _check_grant_args(peer_id, secret, regions) -> tuple[bytes, list[Region]]:
        if not isinstance(peer_id, str) or not peer_id:
            raise ValueError(f"peer_id must be a non-empty str, got {peer_id!r}")
        secret = check_secret(secret)
        if isinstance(regions, (str, bytes)) or not isinstance(regions, Sequence):
            raise TypeError(f"regions must be a sequence of Region, got {type(regions).__name__}")
        regions = list(regions)
        for r in regions:
            if not isinstance(r, Region):
                raise TypeError(f"regions must hold Region objects, got {type(r).__name__}")
        return secret, regions

    # -- provided -----------------------------------------------------------------------
    def write(self, local: Region, remote: RemoteRegion, local_offsets, remote_offsets, sizes) -> Ticket:
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
            local.nbytes,
            remote.nbytes,
            local_offsets,
            remote_offsets,
            sizes,
            local_name=f"local region {local.region_id}",
            remote_name=f"remote region {remote.region_id} of peer {remote.peer_id!r}",
        )
        return self._write(local, remote, coalesce(entries))

    # -- mapped peer memory (optional capability) ------------------------------------------
    def mapped_device(self, remote: RemoteRegion) -> str | None:
        """Optional capability: the device (``"cpu"``, ``"cuda:N"``) on which this process
        maps the peer's region ``remote`` writable, so that ``remote_view`` of it yields a
        tensor there; None where it is not mapped (the default: the bytes go through
        ``write()``, e.g. a socket, RDMA or ``process_vm_writev``). It does not change while
        the region stays imported, so a caller may ask once (the engine does at
        registration, to plan one fused copy from its pool into a peer's pool)."""
        self._check_open()
        if not isinstance(remote, RemoteRegion):
            raise TypeError(f"remote must be a RemoteRegion, got {type(remote).__name__}")
        return self._mapped_device(remote)

    def _mapped_device(self, remote: RemoteRegion) -> str | None:
        return None

    @contextlib.contextmanager
    def remote_view(self, remote: RemoteRegion, offset: int, nbytes: int):
        """Optional: a writable ``torch.uint8`` tensor over ``nbytes`` of a peer's region at
        ``offset``, on ``mapped_device(remote)``, for producers that can write there directly
        (a gather kernel filling the peer's staging slot, a fused copy filling its KV pool:
        one copy less than going through ``write()``). Yields ``None`` where the peer's
        memory is not mapped here (the default). The view is valid only inside the ``with``
        block; bytes written through it are the caller's to order and must have landed when
        the block ends. A transport that can see its peers exit refuses the view of a peer
        already gone, and raises ``PeerGoneError`` when the block ends if the peer exited
        meanwhile (the bytes went into memory nobody reads)."""
        self._check_open()
        if not isinstance(remote, RemoteRegion):
            raise TypeError(f"remote must be a RemoteRegion, got {type(remote).__name__}")
        if offset < 0 or nbytes < 0 or offset + nbytes > remote.nbytes:
            raise ValueError(
                f"remote_view [{offset}, {offset + nbytes}) is outside remote region "
                f"{remote.region_id} of peer {remote.peer_id!r} ({remote.nbytes} bytes)"
            )
        with self._remote_view(remote, offset, nbytes) as view:
            yield view

    @contextlib.contextmanager
    def _remote_view(self, remote: RemoteRegion, offset: int, nbytes: int):
        yield None  # not mapped: callers fall back to write()

    def path_cost(self, device: str = "cpu"):
        """What this transport's writes into ``device`` memory cost, for the planner's
        ``auto`` choice between direct page runs and staging: a
        ``sglang_kvxfer.planning.byteplan.PathCost`` (per-op seconds, bytes/s, and the
        gather/scatter copy rate in that memory), or None where the backend declares none
        (the planner then keeps its fixed rule, ``KVXFER_DIRECT_MIN_OP_BYTES``)."""
        parse_device(device)
        return None

    # -- landing receipts (optional capability) ------------------------------------------
    def landed(self, peer_id: str, receipts: Sequence[tuple[int, int]]) -> bool:
        """Reader side, where ``caps.receipts``: whether every frame that ``receipts`` (a
        writer's ``Ticket.receipts``, carried by the engine's own authenticated message)
        names has landed in this process's memory from the writer granted as ``peer_id``.
        False while any is still on its way. Raises ``TransportError`` saying why when one
        was refused, its connection ended before it, or a receipt names another writer's
        connection: its bytes will never land."""
        raise TransportError(f"transport {self.name!r} has no landing receipts (caps.receipts is False)")

    def wait_landed(self, peer_id: str, receipts: Sequence[tuple[int, int]], timeout_s: float) -> None:
        """``landed`` until True, bounded: raises ``TransferTimeoutError`` after
        ``timeout_s``, and ``TransportError`` as ``landed`` does."""
        raise TransportError(f"transport {self.name!r} has no landing receipts (caps.receipts is False)")

    def read(self, local: Region, remote: RemoteRegion, local_offsets, remote_offsets, sizes) -> Ticket:
        """One-sided pull; only where ``caps.read_supported``."""
        raise TransportError(f"transport {self.name!r} does not support read (caps.read_supported is False)")

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
