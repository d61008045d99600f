"""Device memory over ``tcp``: pinned host bounce buffers, chunked and double-buffered.

A WRITE frame's payload is the same bytes whatever memory they come from or go to, so the
wire does not change: only where a connection end takes the payload from (sender) or
puts it (receiver). For a device region the payload is cut into chunks of the bounce
buffer's size (``plan_chunks``), and each connection end holds two pinned host buffers:

* sender (``send_from_device``): the device-to-host copy of chunk k+1 runs while chunk k
  is on the wire; a buffer is refilled only after its bytes were handed to the socket.
* receiver (``recv_into_device``): chunk k+1 is read from the socket while chunk k is
  copied host-to-device; the ACK goes after the last copy has landed.

The copies go through a ``Copier`` (``tcp.cuda.TorchCudaCopier`` on CUDA devices), so
this logic is tested on CPU with a copier that moves the real bytes and records each
staging copy. This module must not open sockets (the callers pass ``send``/``recv``),
know about regions, grants or tickets, or import torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

__all__ = ["Copier", "Chunk", "DevicePayload", "BounceBuffers", "plan_chunks", "send_from_device", "recv_into_device"]

BOUNCE_SLOTS = 2  # one chunk on the wire while the next is copied


class Copier(Protocol):
    """Asynchronous copies between device memory and pinned host memory.

    Handles are the copier's own objects (for torch: ``uint8`` tensors). Copies posted by
    one call are ordered; ``wait(done)`` blocks until those of that call have landed.
    """

    def device_memory(self, ptr: int, nbytes: int, device: str, tensor: object = None) -> object:
        """A handle of ``nbytes`` of device memory at ``ptr`` (``tensor``: the one it lives in)."""
        ...

    def pinned(self, nbytes: int) -> tuple[object, memoryview]:
        """A pinned host buffer: its handle and a writable byte view of it."""
        ...

    def ready(self, dev: object) -> object:
        """A mark of the work queued so far on ``dev``'s device by the calling thread; a
        ``to_host`` given it as ``after`` reads the bytes that work produced."""
        ...

    def to_host(
        self, dev: object, dev_offsets: np.ndarray, host: object, host_offsets: np.ndarray, sizes: np.ndarray, after
    ) -> object:
        """Post ``host[h:h+n] = dev[d:d+n]`` per entry after ``after``; returns a ``done``."""
        ...

    def to_device(
        self, host: object, host_offsets: np.ndarray, dev: object, dev_offsets: np.ndarray, sizes: np.ndarray
    ) -> object:
        """Post ``dev[d:d+n] = host[h:h+n]`` per entry; returns a ``done``."""
        ...

    def wait(self, done: object) -> None:
        """Block until the copies of that post have landed."""
        ...


@dataclass(frozen=True)
class Chunk:
    """One bounce buffer's worth of a payload: ``sizes[i]`` bytes at device offset
    ``dev_offsets[i]`` are bytes ``host_offsets[i]`` of the chunk; ``nbytes`` in all."""

    dev_offsets: np.ndarray
    host_offsets: np.ndarray
    sizes: np.ndarray
    nbytes: int


@dataclass(frozen=True)
class DevicePayload:
    """A sender's frame payload in device memory: entries of ``dev`` (a copier handle),
    to be read after the mark ``ready`` (``Copier.ready`` at ``write()`` time)."""

    dev: object
    offsets: np.ndarray
    sizes: np.ndarray
    ready: object


class BounceBuffers:
    """``BOUNCE_SLOTS`` pinned host buffers of ``nbytes`` each, held by one connection end."""

    def __init__(self, copier: Copier, nbytes: int):
        self.copier, self.nbytes = copier, nbytes
        pairs = [copier.pinned(nbytes) for _ in range(BOUNCE_SLOTS)]
        self.handles = [h for h, _ in pairs]
        self.views = [v for _, v in pairs]


def plan_chunks(offsets: np.ndarray, sizes: np.ndarray, chunk_bytes: int) -> list[Chunk]:
    """Cut a payload (entries ``(offsets[i], sizes[i])`` back to back) into chunks of
    ``chunk_bytes`` (the last may be shorter), cutting entries at chunk boundaries."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    offsets = np.asarray(offsets, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    keep = sizes > 0
    offsets, sizes = offsets[keep], sizes[keep]
    if not sizes.size:
        return []
    ends = np.cumsum(sizes)
    begins = ends - sizes
    total = int(ends[-1])
    cuts = np.arange(chunk_bytes, total, chunk_bytes, dtype=np.int64)
    starts = np.union1d(begins, cuts)  # payload positions where a piece begins
    stops = np.append(starts[1:], total)
    owner = np.searchsorted(ends, starts, side="right")  # the entry each piece falls in
    dev = offsets[owner] + (starts - begins[owner])
    index = starts // chunk_bytes
    host = starts - index * chunk_bytes
    lengths = stops - starts
    num_chunks = (total + chunk_bytes - 1) // chunk_bytes
    bounds = np.searchsorted(index, np.arange(num_chunks + 1), side="left").tolist()
    return [
        Chunk(dev[a:b], host[a:b], lengths[a:b], min(chunk_bytes, total - k * chunk_bytes))
        for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))
    ]


def send_from_device(payload: DevicePayload, buffers: BounceBuffers, send: Callable[[list[memoryview]], None]) -> None:
    """Send ``payload``'s bytes through the bounce buffers: chunk k+1 is copied to the host
    while chunk k is sent. Returns once every byte was handed to ``send``; a copy still in
    flight when ``send`` raises is waited for before the buffers can be reused."""
    copier = buffers.copier
    chunks = plan_chunks(payload.offsets, payload.sizes, buffers.nbytes)
    pending: dict[int, object] = {}

    def post(k: int) -> None:
        c = chunks[k]
        handle = buffers.handles[k % BOUNCE_SLOTS]
        pending[k] = copier.to_host(payload.dev, c.dev_offsets, handle, c.host_offsets, c.sizes, payload.ready)

    try:
        for k in range(min(BOUNCE_SLOTS, len(chunks))):
            post(k)
        for k, chunk in enumerate(chunks):
            copier.wait(pending.pop(k))
            send([buffers.views[k % BOUNCE_SLOTS][: chunk.nbytes]])
            if k + BOUNCE_SLOTS < len(chunks):
                post(k + BOUNCE_SLOTS)  # into the buffer just sent from
    finally:
        for done in pending.values():
            copier.wait(done)


def recv_into_device(
    dev: object,
    offsets: np.ndarray,
    sizes: np.ndarray,
    buffers: BounceBuffers,
    recv: Callable[[list[memoryview]], object],
) -> str | None:
    """Receive a payload into device entries ``(offsets, sizes)`` of ``dev`` through the
    bounce buffers: chunk k+1 is read while chunk k is copied to the device. Returns None
    once every copy has landed, or why a copy failed (the rest of the payload is still
    read, so the connection stays in step and the caller can refuse the write)."""
    copier = buffers.copier
    pending: list[object | None] = [None] * BOUNCE_SLOTS
    failure: str | None = None
    try:
        for k, chunk in enumerate(plan_chunks(offsets, sizes, buffers.nbytes)):
            slot = k % BOUNCE_SLOTS
            if pending[slot] is not None:  # the copy out of this buffer must be done
                done, pending[slot] = pending[slot], None
                failure = failure or _attempt(copier.wait, done)
            recv([buffers.views[slot][: chunk.nbytes]])
            if failure is None:
                try:
                    pending[slot] = copier.to_device(
                        buffers.handles[slot], chunk.host_offsets, dev, chunk.dev_offsets, chunk.sizes
                    )
                except Exception as exc:  # a device error: keep the stream in step, refuse
                    failure = f"{type(exc).__name__}: {exc}"
    finally:
        for done in pending:
            if done is not None:
                failure = failure or _attempt(copier.wait, done)
    return None if failure is None else f"copying the bytes to the device failed: {failure}"


def _attempt(fn: Callable[[object], None], arg: object) -> str | None:
    try:
        fn(arg)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
