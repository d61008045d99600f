"""The ``tcp`` transport's ``bounce.Copier`` for CUDA devices, over torch.

Copies run on one side stream per device and are waited for on CUDA events, never by
synchronizing a stream the caller uses. A sender's device-to-host copies first wait for
the mark ``ready`` recorded on the caller's current stream at ``write()`` time, so they see
the KV written before the call. Imported only when a device region is registered on
``tcp``; it must not touch sockets, regions or tickets.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

__all__ = ["TorchCudaCopier"]


class _CudaArray:
    """Raw device memory described by ``__cuda_array_interface__`` (torch wraps it, no copy)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


class TorchCudaCopier:
    """``bounce.Copier`` over torch: ``uint8`` tensors as handles, events as ``done``."""

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            if index not in self._streams:
                self._streams[index] = torch.cuda.Stream(device=index)
            return self._streams[index]

    def device_memory(self, ptr: int, nbytes: int, device: str, tensor: object = None) -> torch.Tensor:
        if isinstance(tensor, torch.Tensor):
            flat = tensor.reshape(-1).view(torch.uint8)
        else:
            flat = torch.as_tensor(_CudaArray(ptr, nbytes), device=device)
        if flat.data_ptr() != ptr or flat.numel() != nbytes or flat.device != torch.device(device):
            raise ValueError(f"{nbytes} bytes at {ptr:#x} are not memory of {device}")
        return flat

    def pinned(self, nbytes: int) -> tuple[torch.Tensor, memoryview]:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return host, host.numpy().data

    def ready(self, dev: Any) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(dev.device))
        return event

    def to_host(self, dev, dev_offsets, host, host_offsets, sizes, after) -> torch.cuda.Event:
        return self._post(dev, dev_offsets, host, host_offsets, sizes, after, to_host=True)

    def to_device(self, host, host_offsets, dev, dev_offsets, sizes) -> torch.cuda.Event:
        return self._post(dev, dev_offsets, host, host_offsets, sizes, None, to_host=False)

    def _post(
        self,
        dev: torch.Tensor,
        dev_offsets: np.ndarray,
        host: torch.Tensor,
        host_offsets: np.ndarray,
        sizes: np.ndarray,
        after: torch.cuda.Event | None,
        *,
        to_host: bool,
    ) -> torch.cuda.Event:
        stream = self._stream(dev.device)
        with torch.cuda.device(dev.device), torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            for d, h, n in zip(dev_offsets.tolist(), host_offsets.tolist(), sizes.tolist()):
                if to_host:
                    host[h : h + n].copy_(dev[d : d + n], non_blocking=True)
                else:
                    dev[d : d + n].copy_(host[h : h + n], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def wait(self, done: Any) -> None:
        done.synchronize()
