"""CUDA IPC for the ``local`` transport: export/import device memory, post async copies.

Owns the three CUDA steps of a same-host GPU write, all through torch's own IPC machinery
(the path ``torch.multiprocessing`` uses, so handles, offsets inside caching-allocator
blocks and producer ref-counts are handled by torch): ``export_tensor`` turns a
contiguous CUDA tensor into a plain msgpack-able dict, ``import_tensor`` opens it in the
peer as a ``uint8`` tensor, and ``CudaCopier.post`` enqueues one device copy per entry on
a side stream and returns a poll function backed by a CUDA event.

GPUs are named by identity, never by index: processes may see different
``CUDA_VISIBLE_DEVICES``, so the exporter's ``cuda:0`` can be the importer's ``cuda:3`` or
not visible there at all. ``export_tensor`` records the GPU's UUID (PCI bus id where torch
has no UUID), and the importer finds its own index for it with ``local_index``. The probes
(``visible_gpus``) are module functions so that tests can stand in for them.

It must not touch host memory, sockets or tickets. Imported only when a CUDA region is
used.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import torch

__all__ = ["flat_bytes", "gpu_identity", "visible_gpus", "local_index", "export_tensor", "import_tensor", "CudaCopier"]


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as ``uint8[nbytes]`` (shares storage)."""
    return tensor.reshape(-1).view(torch.uint8)


def gpu_identity(index: int) -> str:
    """A name of GPU ``index`` (this process's numbering) that every process on the host
    agrees on: ``GPU-<uuid>``, else ``pci:<domain>:<bus>:<device>``."""
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None and str(uuid).strip("0-"):
        return f"GPU-{uuid}"
    domain, bus, dev = (getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device"))
    if isinstance(domain, int) and isinstance(bus, int) and isinstance(dev, int):
        return f"pci:{domain:04x}:{bus:02x}:{dev:02x}"
    raise RuntimeError(f"torch reports neither a UUID nor a PCI bus id for cuda:{index} ({props.name})")


@functools.cache
def visible_gpus() -> tuple[str, ...]:
    """``gpu_identity`` of each device this process sees, by its index here (fixed once
    CUDA is initialized, hence cached)."""
    return tuple(gpu_identity(i) for i in range(torch.cuda.device_count()))


def local_index(identity: str) -> int | None:
    """This process's index of the GPU named ``identity``, or None where it is not visible."""
    gpus = visible_gpus()
    return gpus.index(identity) if identity in gpus else None


def current_device() -> int:
    return torch.cuda.current_device()


def export_tensor(tensor: torch.Tensor) -> dict:
    """The IPC description of a contiguous CUDA tensor's bytes (only ints, bools, bytes and
    the GPU's identity string)."""
    storage = tensor.untyped_storage()
    (device, handle, storage_bytes, storage_offset, ref_handle, ref_offset, event_handle, event_sync) = (
        storage._share_cuda_()
    )
    return {
        "gpu": visible_gpus()[int(device)],
        "device": int(device),
        "handle": bytes(handle),
        "storage_bytes": int(storage_bytes),
        "storage_offset": int(storage_offset),
        "ref_handle": bytes(ref_handle),
        "ref_offset": int(ref_offset),
        "event_handle": bytes(event_handle) if event_handle else b"",
        "event_sync": bool(event_sync),
        "byte_offset": tensor.storage_offset() * tensor.element_size(),
        "nbytes": tensor.numel() * tensor.element_size(),
    }


IPC_FIELDS = {
    "gpu": str,
    "device": int,
    "handle": bytes,
    "storage_bytes": int,
    "storage_offset": int,
    "ref_handle": bytes,
    "ref_offset": int,
    "event_handle": bytes,
    "event_sync": bool,
    "byte_offset": int,
    "nbytes": int,
}


def check_ipc(desc: object) -> dict:
    """``desc`` after checking every field's type (it comes from another process)."""
    if not isinstance(desc, dict):
        raise ValueError(f"local CUDA region descriptor: ipc is {type(desc).__name__}, expected a map")
    for name, kind in IPC_FIELDS.items():
        if not isinstance(desc.get(name), kind):
            raise ValueError(
                f"local CUDA region descriptor: ipc field {name!r} is {desc.get(name)!r}, expected {kind.__name__}"
            )
    return desc


def import_tensor(desc: dict, device: int) -> torch.Tensor:
    """Open a peer's exported tensor as ``uint8[nbytes]`` (cross-process only), mapped in
    the context of ``device`` (this process's index): the exporter's GPU where it is
    visible here, else the device whose peer access reaches it."""
    check_ipc(desc)
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        device,
        desc["handle"],
        desc["storage_bytes"],
        desc["storage_offset"],
        desc["ref_handle"],
        desc["ref_offset"],
        desc["event_handle"],
        desc["event_sync"],
    )
    out = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
    out.set_(storage, desc["byte_offset"], (desc["nbytes"],), (1,))
    return out


class CudaCopier:
    """One side stream per source device; copies are ordered after the caller's current stream."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def _stream(self, device: int) -> torch.cuda.Stream:
        with self._lock:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device=device)
            return self._streams[device]

    def post(
        self, src: torch.Tensor, dst: torch.Tensor, src_offsets: np.ndarray, dst_offsets: np.ndarray, sizes: np.ndarray
    ):
        """Enqueue ``dst[d:d+n] = src[s:s+n]`` per entry; return a callable, True once landed.

        ``src`` and ``dst`` are ``uint8`` CUDA tensors; the side stream first waits for the
        current stream of ``src``'s device, so the copy sees KV written before the call.
        """
        device = src.device.index
        stream = self._stream(device)
        with torch.cuda.device(device):
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for s, d, n in zip(src_offsets.tolist(), dst_offsets.tolist(), sizes.tolist()):
                    dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
        return event.query

    def synchronize(self) -> None:
        """Wait for every copy posted so far (used before memory is released)."""
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.synchronize()
