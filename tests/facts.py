"""What this machine can run, probed once, and the skip marks computed from it.

GPU, RDMA and optional-library tests skip themselves from facts (a device count, an
importable library, a probe's verdict), never from a flag someone must remember. Every
such condition lives here: a test file writes ``@needs_cuda`` (or lists it in
``pytestmark``) instead of its own ``skipif``. Probes run on first use and are cached:
importing this module probes nothing, and ``from tests.facts import needs_cuda`` probes
only CUDA (when the importing test module is collected).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest

__all__ = [
    "cuda_available",
    "cuda_device_count",
    "nixl_available",
    "mori_hw_missing",
    "sglang_installed",
    "needs_cuda",
    "needs_nixl",
    "needs_mori_hw",
    "needs_sglang_installed",
    "needs_root",
    "needs_cxx",
    "needs_nvcc",
]


@functools.cache
def cuda_device_count() -> int:
    """CUDA (or ROCm-as-``cuda``) devices torch sees; 0 without torch."""
    if importlib.util.find_spec("torch") is None:
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_available() -> bool:
    return cuda_device_count() > 0


@functools.cache
def nixl_available() -> bool:
    from sglang_kvxfer.transports import available_transports

    return "nixl" in available_transports()


@functools.cache
def mori_hw_missing() -> str | None:
    """Why real MORI-IO cannot run here (None when it can): the package, then the probe
    (run in a child, so a host without an AMD GPU or an ACTIVE RDMA port cannot kill pytest)."""
    if importlib.util.find_spec("mori") is None:
        return "mori (pip package amd-mori) is not installed"
    from sglang_kvxfer.errors import TransportUnavailableError
    from sglang_kvxfer.transports.mori import probe as _mori_probe

    try:
        _mori_probe.check()
    except TransportUnavailableError as exc:
        return str(exc)
    return None


def sglang_installed() -> bool:
    return importlib.util.find_spec("sglang") is not None


@functools.cache
def _native_build():
    from sglang_kvxfer._native import build

    return build


# mark name -> (skip condition, reason), both evaluated on first use of the mark
_MARKS = {
    "needs_cuda": (lambda: not cuda_available(), lambda: "torch sees no CUDA device"),
    "needs_nixl": (lambda: not nixl_available(), lambda: "nixl-cu12 is not installed"),
    "needs_mori_hw": (lambda: mori_hw_missing() is not None, lambda: mori_hw_missing() or ""),
    "needs_sglang_installed": (lambda: not sglang_installed(), lambda: "SGLang is not installed"),
    "needs_root": (lambda: os.geteuid() != 0, lambda: "needs root to switch to another user"),
    "needs_cxx": (lambda: _native_build().find_cxx() is None, lambda: "no C++ compiler"),
    "needs_nvcc": (lambda: _native_build().find_nvcc() is None, lambda: "nvcc not on PATH"),
}


@functools.cache
def __getattr__(name: str):
    if name not in _MARKS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    condition, reason = _MARKS[name]
    return pytest.mark.skipif(condition(), reason=reason())
