"""KV pools, staging arenas and page allocators of one rank.

Owns ``KVPool`` (a rank's KV buffers as torch tensors, either allocated here in one block
or wrapped around buffers someone else allocated, and their registration with a
transport), ``StagingArena`` (registered byte segments, allocated on first use and grown
on demand up to a cap, with a first-fit allocator, for the staged data path) and
``PageAllocator`` (page ids of a pool for the synthetic servers). It must not speak the
protocol or move bytes between processes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from sglang_kvxfer.errors import KVXferError, TransportError
from sglang_kvxfer.geometry import Layout, RankPlacement

if TYPE_CHECKING:
    from sglang_kvxfer.transports.base import Region, Transport

__all__ = ["BufferLoc", "KVPool", "StagingArena", "StagingLoc", "PageAllocator", "torch_dtype"]

log = logging.getLogger("sglang_kvxfer.pool")

_ALIGN = 256  # buffer and staging offsets: keeps 16-byte vector copies aligned
MIN_SEGMENT_BYTES = 1 << 20  # the smallest segment a staging arena adds


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


class _CudaArray:
    """The least object ``torch.as_tensor`` turns into a CUDA tensor over ``ptr`` without a
    copy (the ``__cuda_array_interface__`` protocol, version 2)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 2,
        }


def _tensor_at(ptr: int, nbytes: int, device: str):
    """A uint8 tensor aliasing ``nbytes`` at address ``ptr`` on ``device`` (no copy)."""
    import ctypes

    import torch

    if device == "cpu":
        t = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)
    elif str(device).startswith("cuda"):
        # Not verified on a GPU here. as_tensor places the tensor where the pointer lives;
        # the checks below refuse a copy or a pointer on another device.
        t = torch.as_tensor(_CudaArray(ptr, nbytes))
        want = torch.device(device)
        if t.device.type != "cuda" or (want.index is not None and t.device.index != want.index):
            raise ValueError(f"address {ptr:#x} is memory of {t.device}, not of {device}")
    else:
        raise ValueError(f"device={device!r} must be 'cpu' or 'cuda[:N]'")
    if t.data_ptr() != ptr:
        raise RuntimeError(f"the view of {ptr:#x} landed at {t.data_ptr():#x}: it was copied")
    return t


def _alloc_bytes(nbytes: int, device: str, shared: bool):
    """A uint8 tensor of ``nbytes``; host memory is a shared mapping when ``shared``."""
    import torch

    if device == "cpu" and shared:
        from sglang_kvxfer.transports._memory import alloc_shared

        owner = alloc_shared(max(nbytes, 1))
        return owner.as_tensor(torch.uint8, (nbytes,)), owner
    return torch.zeros(nbytes, dtype=torch.uint8, device=device), None


def _accepted_shapes(placement: RankPlacement, buffer_index: int) -> list[tuple[int, ...]]:
    """Shapes ``KVPool.wrap`` takes for a buffer: the placement's, and for HND_KV also vLLM's
    ``[num_blocks, heads, block_size, 2 * head_dim]`` view of the same bytes."""
    shape = placement.buffer_shape(buffer_index)
    if placement.geometry.layout is not Layout.HND_KV:
        return [shape]
    pages, heads, _, page_size, dim = shape
    return [shape, (pages, heads, page_size, 2 * dim)]


@dataclass(frozen=True)
class BufferLoc:
    """Where one KV buffer lives: registered region ``region`` at byte ``offset``."""

    region: int
    offset: int


class KVPool:
    """A rank's KV buffers (K of every layer, then V; MLA, HND_KV and NHD_KV: one per layer).

    ``buffers[i]`` is a tensor of ``placement.buffer_shape(i)`` and the geometry's dtype
    (HND_KV: ``[num_pages, local_heads, 2, page_size, head_dim]``, K and V of layer ``i``;
    NHD_KV: ``[num_pages, page_size, local_heads, head_dim + v_head_dim]``).
    ``KVPool.allocate`` puts every buffer in one block (one registered region, so a direct
    transfer of all layers is one transport call); ``KVPool.wrap`` takes buffers allocated
    elsewhere (one region each), as an inference server's pool is.
    """

    def __init__(
        self,
        placement: RankPlacement,
        buffers: Sequence,
        blocks: Sequence,
        locs: Sequence[BufferLoc],
        owners: Sequence = (),
    ):
        g = placement.geometry
        if g.layout is Layout.NHD_KV and g.v_head_dim != g.head_dim:
            # The engine's gather/scatter calls split an NHD_KV row in halves (ops' k_dim default).
            raise ValueError(
                f"layout NHD_KV with v_head_dim={g.v_head_dim} != head_dim={g.head_dim}: the engine's "
                "staged path does not pass k_dim to the ops yet; only equal K and V dims are supported"
            )
        self.placement = placement
        self.buffers = list(buffers)
        self._blocks = list(blocks)  # uint8 tensors registered as regions
        self.locs = list(locs)
        self._owners = list(owners)
        self.regions: list[Region] = []
        self._transport: Transport | None = None

    @classmethod
    def allocate(cls, placement: RankPlacement, device: str = "cpu", shared: bool = False) -> KVPool:
        g = placement.geometry
        offsets, total = [], 0
        for i in range(g.num_buffers):
            offsets.append(total)
            total = _align(total + placement.buffer_nbytes(i))
        block, owner = _alloc_bytes(total, device, shared)
        dtype = torch_dtype(g.dtype)
        buffers = [
            block[off : off + placement.buffer_nbytes(i)].view(dtype).view(placement.buffer_shape(i))
            for i, off in enumerate(offsets)
        ]
        return cls(
            placement, buffers, [block], [BufferLoc(0, off) for off in offsets], [owner] if owner is not None else []
        )

    @classmethod
    def wrap(cls, placement: RankPlacement, buffers: Sequence) -> KVPool:
        """Use existing tensors (one per buffer index, contiguous, matching the geometry).

        HND_KV takes one tensor per layer, shaped ``placement.buffer_shape(i)`` or as vLLM
        shapes its CPU cache, ``[num_pages, local_heads, page_size, 2 * head_dim]`` (the same
        bytes); ``buffers`` then holds the 5-D views of them. NHD_KV takes one
        ``[num_pages, page_size, local_heads, head_dim + v_head_dim]`` tensor per layer (vLLM's
        GPU cache after ``VllmLayout`` has turned its logical view into this contiguous one).
        """
        import torch

        g = placement.geometry
        if len(buffers) != g.num_buffers:
            what = f" (one K-and-V tensor per layer for {g.layout})" if g.packed_kv else ""
            raise ValueError(f"buffers has {len(buffers)} tensor(s); the geometry needs {g.num_buffers}{what}")
        dtype = torch_dtype(g.dtype)
        views = []
        for i, t in enumerate(buffers):
            shapes = _accepted_shapes(placement, i)
            if tuple(t.shape) not in shapes or t.dtype != dtype or not t.is_contiguous():
                need = " or ".join(str(s) for s in shapes)
                raise ValueError(
                    f"buffers[{i}] is {tuple(t.shape)} {t.dtype} (contiguous={t.is_contiguous()}); the "
                    f"geometry needs a contiguous {need} {dtype}"
                )
            views.append(t.view(placement.buffer_shape(i)))
        buffers = views
        blocks = [t.view(-1).view(torch.uint8) for t in buffers]
        return cls(placement, buffers, blocks, [BufferLoc(i, 0) for i in range(len(buffers))])

    @classmethod
    def from_pointers(
        cls, placement: RankPlacement, ptrs: Sequence[int], lens: Sequence[int], device: str = "cpu"
    ) -> KVPool:
        """Views over buffers known only by address, as an inference server hands them over.

        ``ptrs[i]``/``lens[i]`` are the address and byte length of buffer ``i`` (K of every
        layer, then V; HND_KV: the K-and-V buffer of every layer). Each view covers the first ``placement.buffer_nbytes(i)`` bytes; a
        longer buffer is fine, a shorter one is refused. No byte is copied: the views alias
        the caller's memory (checked), and the caller keeps it alive until ``close()``.
        """
        g = placement.geometry
        for name, seq in (("ptrs", ptrs), ("lens", lens)):
            if len(seq) != g.num_buffers:
                if g.packed_kv:
                    what = f"one K-and-V buffer per layer of {g.num_layers} ({g.layout})"
                else:
                    what = f"K of {g.num_layers} layers{', then V' if g.has_v else ''}"
                raise ValueError(f"{name} has {len(seq)} entries; the geometry needs {g.num_buffers} ({what})")
        dtype = torch_dtype(g.dtype)
        blocks, buffers = [], []
        for i, (ptr, nbytes) in enumerate(zip(ptrs, lens)):
            need = placement.buffer_nbytes(i)
            if isinstance(ptr, bool) or not isinstance(ptr, (int, np.integer)) or ptr <= 0:
                raise ValueError(f"ptrs[{i}]={ptr!r} must be a non-null address (int)")
            if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < need:
                raise ValueError(
                    f"lens[{i}]={nbytes!r} must be at least {need} bytes: buffer {i} of the "
                    f"geometry is {placement.buffer_shape(i)} {g.dtype}"
                )
            block = _tensor_at(int(ptr), need, device)
            blocks.append(block)
            buffers.append(block.view(dtype).view(placement.buffer_shape(i)))
        return cls(placement, buffers, blocks, [BufferLoc(i, 0) for i in range(len(buffers))])

    @property
    def device(self) -> str:
        return str(self.buffers[0].device)

    def register(self, transport: Transport) -> list[bytes]:
        """Register every block with ``transport``; returns the region descriptors."""
        if self._transport is not None:
            raise RuntimeError("KVPool is already registered")
        regions = []
        try:
            for block in self._blocks:
                # register_tensor, not register(ptr): CUDA IPC needs the tensor's allocation
                regions.append(transport.register_tensor(block))
        except BaseException:
            for r in regions:
                transport.deregister(r)
            raise
        self.regions, self._transport = regions, transport
        return [r.descriptor for r in regions]

    def deregister(self) -> bool:
        """Deregister every region (idempotent). False when one could not be, because
        transfers into it were still in flight: its memory must then not be freed."""
        clean = _deregister_all(self._transport, self.regions, "KV pool")
        self._transport, self.regions = None, []
        return clean

    def release(self, free: bool = True) -> None:
        """Drop the buffers and, with ``free``, release the memory this pool owns; without,
        keep it mapped for the life of the process (a writer may still touch it)."""
        self.buffers, self._blocks = [], []
        owners, self._owners = self._owners, []
        _release(owners, free)

    def close(self) -> bool:
        """``deregister``, then ``release`` unless a region still had transfers in flight
        (idempotent); returns whether the memory was released."""
        clean = self.deregister()
        self.release(free=clean)
        return clean


class StagingLoc(NamedTuple):
    """Where an arena offset lives: its segment's ``region`` (None when the arena has no
    transport), the offset inside that segment, and the segment's first arena offset."""

    region: Region | None
    offset: int
    base: int


class _Segment:
    """One allocation of an arena: a registered byte block with its own free list."""

    def __init__(self, base: int, tensor, owner, region: Region | None):
        self.base, self.nbytes = base, int(tensor.numel())
        self.tensor, self.owner, self.region = tensor, owner, region
        self.free: list[tuple[int, int]] = [(0, self.nbytes)]  # sorted (local offset, size)


class StagingArena:
    """Staging memory of one rank, allocated on first use and grown on demand up to a cap,
    with a thread-safe first-fit allocator.

    Used on both sides of the staged path: the writer gathers into it before a write; the
    reader lends windows of it to writers. A rank that never stages allocates nothing. The
    arena grows by segments, each at least as large as all earlier ones together (so a few
    segments reach ``cap_bytes``) and registered with ``transport`` as its own region.
    Offsets are arena-wide: segment k holds ``[base_k, base_k + size_k)``; an allocation
    never spans two segments. Segments live until ``close()``, so a region a peer imported
    stays valid.
    """

    def __init__(
        self,
        cap_bytes: int,
        device: str = "cpu",
        shared: bool = False,
        transport: Transport | None = None,
        min_segment_bytes: int | None = None,
    ):
        if cap_bytes < _ALIGN:
            raise ValueError(f"staging arena of {cap_bytes} bytes is too small (minimum {_ALIGN})")
        self.cap_bytes = _align(cap_bytes)
        self.device, self.shared = device, shared
        self._transport = transport
        self._min_segment = _align(max(min_segment_bytes or MIN_SEGMENT_BYTES, _ALIGN))
        self._segments: list[_Segment] = []
        self._used: dict[int, int] = {}  # arena offset -> size
        self._growing = 0  # bytes of segments being made (outside the lock)
        self._closed = False  # deregistered or released: it grows no more
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes allocated now (0 until the first ``alloc``; at most ``cap_bytes``)."""
        with self._lock:
            return sum(seg.nbytes for seg in self._segments)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._used.values())

    @property
    def num_segments(self) -> int:
        with self._lock:
            return len(self._segments)

    @property
    def regions(self) -> list[Region]:
        """The registered region of every segment, oldest first."""
        with self._lock:
            return [seg.region for seg in self._segments if seg.region is not None]

    def alloc(self, nbytes: int) -> int | None:
        """Arena offset of a free window of ``nbytes`` (aligned), growing the arena when no
        segment has room and the cap allows; None when none fits now.

        A new segment is allocated, faulted in and registered outside the arena's lock
        (that takes long for a large one: every page is touched), so ``free``, ``locate``
        and allocations that fit the existing segments go on meanwhile; its bytes count
        against the cap from the start.

        Raises:
            KVXferError: the memory of a new segment could not be allocated or registered.
        """
        size = _align(max(nbytes, 1))
        with self._lock:
            for seg in self._segments:
                off = self._take(seg, size)
                if off is not None:
                    return off
            grow = self._growth(size)
            if grow is None:
                return None
            self._growing += grow
            allocated = sum(seg.nbytes for seg in self._segments)
        try:
            tensor, owner, region, transport = self._new_segment(grow, allocated)
        finally:
            with self._lock:
                self._growing -= grow
        with self._lock:
            if not self._closed:
                seg = _Segment(sum(s.nbytes for s in self._segments), tensor, owner, region)
                self._segments.append(seg)
                return self._take(seg, size)
        # closed while this segment was made: nobody else knows it, drop it here
        clean = _deregister_all(transport, [region] if region is not None else [], "staging")
        _release([owner] if owner is not None else [], clean)
        raise KVXferError("the staging arena was closed while it grew")

    def _take(self, seg: _Segment, size: int) -> int | None:
        for i, (off, free) in enumerate(seg.free):
            if free >= size:
                if free == size:
                    seg.free.pop(i)
                else:
                    seg.free[i] = (off + size, free - size)
                self._used[seg.base + off] = size
                return seg.base + off
        return None

    def _growth(self, size: int) -> int | None:
        """Bytes of the next segment for a window of ``size`` (under the lock), None when
        the cap (counting segments being made) leaves no room for it."""
        total = sum(seg.nbytes for seg in self._segments) + self._growing
        room = self.cap_bytes - total
        if size > room:
            return None
        return min(room, _align(max(size, total, self._min_segment)))

    def _new_segment(self, nbytes: int, allocated: int):
        """(tensor, owner, region, transport) of a new segment's memory, registered with
        the arena's transport (None: no region); ``allocated``: the arena's bytes so far."""
        try:
            tensor, owner = _alloc_bytes(nbytes, self.device, self.shared)
        except (RuntimeError, OSError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            raise KVXferError(
                f"the staging arena cannot grow by {nbytes} B on {self.device} "
                f"({allocated} B allocated, cap {self.cap_bytes} B, KVXFER_STAGING_BYTES): {exc}"
            ) from None
        region = None
        transport = self._transport
        if transport is not None:
            try:
                region = transport.register_tensor(tensor)
            except BaseException:
                if owner is not None:
                    owner.close()
                raise
        return tensor, owner, region, transport

    def _segment(self, offset: int) -> _Segment:
        for seg in self._segments:
            if seg.base <= offset < seg.base + seg.nbytes:
                return seg
        raise ValueError(f"staging offset {offset} is outside the arena ({len(self._segments)} segment(s))")

    def free(self, offset: int) -> None:
        with self._lock:
            size = self._used.pop(offset, None)
            if size is None:
                raise ValueError(f"staging offset {offset} is not allocated")
            seg = self._segment(offset)
            seg.free.append((offset - seg.base, size))
            seg.free.sort()
            merged: list[tuple[int, int]] = []
            for off, sz in seg.free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + sz)
                else:
                    merged.append((off, sz))
            seg.free = merged

    def locate(self, offset: int) -> StagingLoc:
        """The segment region of arena ``offset`` and the offset inside it."""
        with self._lock:
            seg = self._segment(offset)
        return StagingLoc(seg.region, offset - seg.base, seg.base)

    def view(self, offset: int, nbytes: int):
        """A uint8 tensor over ``nbytes`` at arena ``offset`` (inside one segment)."""
        with self._lock:
            seg = self._segment(offset)
        local = offset - seg.base
        if local + nbytes > seg.nbytes:
            raise ValueError(f"staging [{offset}, {offset + nbytes}) crosses the end of its segment")
        return seg.tensor[local : local + nbytes]

    def deregister(self) -> bool:
        """Deregister every segment (see ``KVPool.deregister``)."""
        with self._lock:
            regions = [seg.region for seg in self._segments if seg.region is not None]
            for seg in self._segments:
                seg.region = None
            self._closed = True  # a segment still being made is dropped when it is done
        clean = _deregister_all(self._transport, regions, "staging")
        self._transport = None
        return clean

    def release(self, free: bool = True) -> None:
        """Drop the segments and, with ``free``, release their memory (see ``KVPool.release``)."""
        with self._lock:
            segments, self._segments = self._segments, []
            self._used = {}
            self._closed = True
        for seg in segments:
            seg.tensor = None
        _release([seg.owner for seg in segments if seg.owner is not None], free)

    def close(self) -> bool:
        """``deregister``, then ``release`` unless a segment still had transfers in flight."""
        clean = self.deregister()
        self.release(free=clean)
        return clean


class PageAllocator:
    """Free page ids of one pool. Pages come out scattered (a shuffled free list), as in a
    long-running server, so transfers exercise non-contiguous page runs."""

    def __init__(self, num_pages: int, seed: int = 0, reserve: int = 0):
        rng = np.random.default_rng(seed)
        self._free = list(rng.permutation(np.arange(reserve, num_pages)).tolist())
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    def alloc(self, n: int) -> np.ndarray | None:
        with self._lock:
            if n > len(self._free):
                return None
            out, self._free = self._free[:n], self._free[n:]
        return np.asarray(out, dtype=np.int64)

    def free(self, pages) -> None:
        with self._lock:
            self._free.extend(int(p) for p in pages)


# Memory a closing rank could not prove idle (a transfer into it was still in flight, or a
# worker was still running): kept mapped until the process exits, never freed under a writer.
_KEPT_MAPPED: list[Any] = []


def _deregister_all(transport: Transport | None, regions: list[Region], what: str) -> bool:
    """Deregister ``regions``; False if one still had transfers in flight. A region the
    transport no longer knows (it was closed, or never registered it) counts as released."""
    clean = True
    if transport is None:
        return clean
    for r in regions:
        try:
            transport.deregister(r)
        except ValueError:
            pass  # not registered there (any more)
        except TransportError as exc:
            if getattr(transport, "_closed", False):
                continue  # closed: its threads were stopped when it closed
            clean = False
            log.error("%s region %s: %s; its memory stays mapped until the process exits", what, r.region_id, exc)
    return clean


def _release(owners: list[Any], free: bool) -> None:
    """Close what owns the memory, or keep it mapped (``free`` False)."""
    if free:
        for owner in owners:
            owner.close()
    else:
        _KEPT_MAPPED.extend(owners)
