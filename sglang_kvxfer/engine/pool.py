"""KV pools, staging arenas and page allocators of one rank.

Owns ``KVPool`` (a rank's KV buffers as torch tensors, either allocated here in one block
or wrapped around buffers someone else allocated, and their registration with a
transport), ``StagingArena`` (a registered byte region with a first-fit allocator, for the
staged data path) and ``PageAllocator`` (page ids of a pool for the synthetic servers). It
must not speak the protocol or move bytes between processes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from sglang_kvxfer.geometry import RankPlacement

if TYPE_CHECKING:
    from sglang_kvxfer.transports.base import Region, Transport

__all__ = ["BufferLoc", "KVPool", "StagingArena", "PageAllocator", "torch_dtype"]

_ALIGN = 256  # buffer and staging offsets: keeps 16-byte vector copies aligned


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


@dataclass(frozen=True)
class BufferLoc:
    """Where one KV buffer lives: registered region ``region`` at byte ``offset``."""

    region: int
    offset: int


class KVPool:
    """A rank's KV buffers (K of every layer, then V; MLA: one per layer).

    ``buffers[i]`` is a tensor of ``placement.buffer_shape(i)`` and the geometry's dtype.
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
        """Use existing tensors (one per buffer index, contiguous, matching the geometry)."""
        import torch

        g = placement.geometry
        if len(buffers) != g.num_buffers:
            raise ValueError(f"buffers has {len(buffers)} tensor(s); the geometry needs {g.num_buffers}")
        dtype = torch_dtype(g.dtype)
        for i, t in enumerate(buffers):
            if tuple(t.shape) != placement.buffer_shape(i) or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(
                    f"buffers[{i}] is {tuple(t.shape)} {t.dtype} (contiguous={t.is_contiguous()}); the "
                    f"geometry needs a contiguous {placement.buffer_shape(i)} {dtype}"
                )
        blocks = [t.view(-1).view(torch.uint8) for t in buffers]
        return cls(placement, buffers, blocks, [BufferLoc(i, 0) for i in range(len(buffers))])

    @classmethod
    def from_pointers(
        cls, placement: RankPlacement, ptrs: Sequence[int], lens: Sequence[int], device: str = "cpu"
    ) -> KVPool:
        """Views over buffers known only by address, as an inference server hands them over.

        ``ptrs[i]``/``lens[i]`` are the address and byte length of buffer ``i`` (K of every
        layer, then V). Each view covers the first ``placement.buffer_nbytes(i)`` bytes; a
        longer buffer is fine, a shorter one is refused. No byte is copied: the views alias
        the caller's memory (checked), and the caller keeps it alive until ``close()``.
        """
        g = placement.geometry
        for name, seq in (("ptrs", ptrs), ("lens", lens)):
            if len(seq) != g.num_buffers:
                raise ValueError(
                    f"{name} has {len(seq)} entries; the geometry needs {g.num_buffers} "
                    f"(K of {g.num_layers} layers{', then V' if g.has_v else ''})"
                )
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

    def close(self) -> None:
        """Deregister and release the memory (idempotent)."""
        if self._transport is not None:
            for r in self.regions:
                try:
                    self._transport.deregister(r)
                except Exception:  # the transport may already be closed
                    pass
            self._transport, self.regions = None, []
        self.buffers, self._blocks = [], []
        for owner in self._owners:
            owner.close()
        self._owners = []


class StagingArena:
    """A registered byte region with a thread-safe first-fit allocator.

    Used on both sides of the staged path: the writer gathers into it before a write; the
    reader lends windows of it to writers.
    """

    def __init__(self, nbytes: int, device: str = "cpu", shared: bool = False):
        if nbytes < _ALIGN:
            raise ValueError(f"staging arena of {nbytes} bytes is too small (minimum {_ALIGN})")
        self.nbytes = _align(nbytes)
        self.tensor, owner = _alloc_bytes(self.nbytes, device, shared)
        self._owners = [owner] if owner is not None else []
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]  # sorted (offset, size)
        self._used: dict[int, int] = {}
        self._lock = threading.Lock()
        self.region: Region | None = None
        self._transport: Transport | None = None

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._used.values())

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free window of ``nbytes`` (aligned), or None when none fits now."""
        size = _align(max(nbytes, 1))
        with self._lock:
            for i, (off, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        self._free.pop(i)
                    else:
                        self._free[i] = (off + size, free - size)
                    self._used[off] = size
                    return off
        return None

    def free(self, offset: int) -> None:
        with self._lock:
            size = self._used.pop(offset, None)
            if size is None:
                raise ValueError(f"staging offset {offset} is not allocated")
            self._free.append((offset, size))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for off, sz in self._free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + sz)
                else:
                    merged.append((off, sz))
            self._free = merged

    def view(self, offset: int, nbytes: int):
        return self.tensor[offset : offset + nbytes]

    def register(self, transport: Transport) -> bytes:
        region = transport.register_tensor(self.tensor)
        self.region, self._transport = region, transport
        return region.descriptor

    def close(self) -> None:
        if self._transport is not None and self.region is not None:
            try:
                self._transport.deregister(self.region)
            except Exception:
                pass
        self._transport, self.region = None, None
        self.tensor = None
        for owner in self._owners:
            owner.close()
        self._owners = []


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
