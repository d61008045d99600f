"""The engine's own CUDA stream for gathers and scatters, one per rank and device.

Owns ``CopyStream``: it runs a copy (``ops.gather_kv_heads`` / ``ops.scatter_kv_heads``) on
a side stream instead of the caller's current stream, orders it after the producer's
``ready`` event (the forward that wrote the pages), and waits for that copy alone, on an
event recorded behind it, never on a whole stream: the model's work on its own streams goes
on. On the CPU it runs the copy inline (``ready.synchronize()`` first), as before.
Must not: allocate memory, know the protocol, or wait on any stream.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["CopyStream"]


def _torch_cuda() -> Any:
    """``torch.cuda``, imported on first use (tests substitute a fake here)."""
    import torch

    return torch.cuda


class CopyStream:
    """Runs copies for one device: inline on the CPU, on a side stream on CUDA.

    The side stream is created on first use (creating one initializes CUDA). Several worker
    threads may share it: each waits only for the event recorded after its own copy.
    """

    def __init__(self, device: str):
        self.device = str(device)
        self.is_cuda = self.device.startswith("cuda")
        self._stream: Any = None
        self._lock = threading.Lock()

    @property
    def stream(self) -> Any:
        """The side stream (None on the CPU)."""
        if not self.is_cuda:
            return None
        with self._lock:
            if self._stream is None:
                self._stream = _torch_cuda().Stream(device=self.device)
            return self._stream

    def run(self, copy: Callable[[], Any], ready: Any = None) -> Any:
        """Run ``copy()`` and return its result once its bytes are in place.

        ``ready``: the producer's ``torch.cuda.Event`` (the side stream waits for it on the
        device, the host does not), or any object with ``synchronize()`` (called first).
        """
        cuda = _torch_cuda() if self.is_cuda else None
        if ready is not None and (cuda is None or not isinstance(ready, cuda.Event)):
            ready.synchronize()
            ready = None
        if cuda is None:
            return copy()
        stream = self.stream
        with cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            result = copy()
            done = cuda.Event()
            done.record(stream)
        done.synchronize()
        return result
