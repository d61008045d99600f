"""Loads the native gather/scatter libraries with ctypes, lazily, once per process.

Owns: locating ``libkvxfer_cpu.so`` / ``libkvxfer_cuda.so`` (installed next to this file,
else built on first use into a cache directory), checking their ABI version, the ctypes
mirror of ``csrc/kvxfer.h``, and the one mapping from native status codes to exceptions.
A library that cannot be loaded is reported as unavailable, with the reason kept for
``status()``; ``sglang_kvxfer.ops`` then uses its torch reference.
Must not: import torch or numpy at import time, validate tensors (``ops`` does that before
anything reaches native code), or retry a failed load within a process.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from sglang_kvxfer import envs
from sglang_kvxfer._native import build
from sglang_kvxfer.errors import KVXferError

__all__ = [
    "ABI_VERSION",
    "Library",
    "PoolDesc",
    "SliceDesc",
    "cpu_library",
    "cuda_library",
    "status",
    "unavailable_reason",
    "check_status",
]

logger = logging.getLogger(__name__)

ABI_VERSION = 3  # KVXFER_ABI_VERSION in csrc/kvxfer.h
LAYOUT_CODES = {"NHD": 0, "HND": 1, "HND_KV": 2, "NHD_KV": 3}  # KVXFER_LAYOUT_* in csrc/kvxfer.h
STATUS_INVALID, STATUS_CUDA, STATUS_INTERNAL = 1, 2, 3

_PACKAGE_DIR = Path(__file__).resolve().parent
_LOCK_TIMEOUT_S = build.BUILD_TIMEOUT_S + 60.0


class PoolDesc(ctypes.Structure):
    """``kvxfer_pool_t``."""

    _fields_ = [
        ("num_layers", ctypes.c_int64),
        ("num_kv", ctypes.c_int64),
        ("num_pages", ctypes.c_int64),
        ("page_size", ctypes.c_int64),
        ("pool_heads", ctypes.c_int64),
        ("itemsize", ctypes.c_int64),
        ("k_row_bytes", ctypes.c_int64),
        ("v_row_bytes", ctypes.c_int64),
        ("layout", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
    ]


class SliceDesc(ctypes.Structure):
    """``kvxfer_slice_t``."""

    _fields_ = [
        ("head_start", ctypes.c_int64),
        ("num_heads", ctypes.c_int64),
        ("token_offset", ctypes.c_int64),
        ("num_tokens", ctypes.c_int64),
        ("num_page_ids", ctypes.c_int64),
    ]


_P = ctypes.POINTER
_VP, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
_SIGNATURES = {
    "cpu": {
        "kvxfer_cpu_abi_version": ([], ctypes.c_int),
        "kvxfer_cpu_last_error": ([], ctypes.c_char_p),
        "kvxfer_gather_cpu": ([_P(PoolDesc), _VP, _VP, _P(SliceDesc), _VP, _I64, _I32, _I64], ctypes.c_int),
        "kvxfer_scatter_cpu": ([_P(PoolDesc), _VP, _VP, _P(SliceDesc), _VP, _I64, _I32, _I64], ctypes.c_int),
        "kvxfer_emulate_cuda_cpu": ([_I32, _P(PoolDesc), _VP, _I64, _VP, _P(SliceDesc), _VP, _I64], ctypes.c_int),
        "kvxfer_copy_cpu": (
            [_P(PoolDesc), _VP, _VP, _P(SliceDesc), _P(PoolDesc), _VP, _VP, _P(SliceDesc), _I32, _I64],
            ctypes.c_int,
        ),
        "kvxfer_emulate_cuda_copy_cpu": (
            [_P(PoolDesc), _VP, _VP, _P(SliceDesc), _P(PoolDesc), _VP, _VP, _P(SliceDesc), _I64],
            ctypes.c_int,
        ),
    },
    "cuda": {
        "kvxfer_cuda_abi_version": ([], ctypes.c_int),
        "kvxfer_cuda_last_error": ([], ctypes.c_char_p),
        "kvxfer_cuda_probe": ([], ctypes.c_int),
        "kvxfer_gather_cuda": ([_P(PoolDesc), _VP, _I64, _VP, _P(SliceDesc), _VP, _I64, _VP], ctypes.c_int),
        "kvxfer_scatter_cuda": ([_P(PoolDesc), _VP, _I64, _VP, _P(SliceDesc), _VP, _I64, _VP], ctypes.c_int),
        "kvxfer_copy_cuda": (
            [_P(PoolDesc), _VP, _VP, _P(SliceDesc), _P(PoolDesc), _VP, _VP, _P(SliceDesc), _I64, _VP],
            ctypes.c_int,
        ),
    },
}
_FILENAMES = {"cpu": build.CPU_LIBRARY, "cuda": build.CUDA_LIBRARY}


@dataclass(frozen=True)
class Library:
    """A loaded native library: ``kind`` is ``"cpu"`` or ``"cuda"``."""

    kind: str
    path: Path
    handle: ctypes.CDLL

    def last_error(self) -> str:
        raw = getattr(self.handle, f"kvxfer_{self.kind}_last_error")()
        return raw.decode("utf-8", "replace") if raw else ""


_lock = threading.Lock()
_loaded: dict[str, Library | str] = {}  # kind -> Library, or why it is unavailable


def cpu_library() -> Library | None:
    """The CPU library, or None when it is disabled or cannot be loaded (see ``status``)."""
    return _get("cpu")


def cuda_library() -> Library | None:
    """The CUDA library, or None (no nvcc to build it, no device, disabled...)."""
    return _get("cuda")


def status() -> dict[str, str]:
    """``{"cpu": ..., "cuda": ...}``: the loaded path, or why the library is unavailable."""
    out = {}
    for kind in ("cpu", "cuda"):
        lib = _get(kind)
        out[kind] = f"loaded {lib.path}" if lib else f"unavailable: {_loaded.get(kind, '')}"
    return out


def unavailable_reason(kind: str) -> str:
    """Why the ``kind`` library is not loaded (it is loaded or loadable: ``""``)."""
    if envs.KVXFER_DISABLE_NATIVE.get():
        return "KVXFER_DISABLE_NATIVE=1"
    if _get(kind) is not None:
        return ""
    return str(_loaded.get(kind, "")) or "unknown"


def check_status(lib: Library, code: int, function: str) -> None:
    """Raises for a non-zero status of ``function``: the one native-to-Python error map."""
    if code == 0:
        return
    message = f"{function}: {lib.last_error() or 'no message'}"
    if code == STATUS_INVALID:
        raise ValueError(message)
    raise KVXferError(f"{message} (status {code})")


def _get(kind: str) -> Library | None:
    if envs.KVXFER_DISABLE_NATIVE.get():
        return None
    with _lock:
        if kind not in _loaded:
            try:
                _loaded[kind] = _load(kind)
            # AttributeError: a stale library without a symbol of this ABI.
            except (OSError, AttributeError, build.BuildError, KVXferError) as exc:
                _loaded[kind] = str(exc)
                logger.info("native %s library unavailable: %s", kind, exc)
        found = _loaded[kind]
    return found if isinstance(found, Library) else None


def _load(kind: str) -> Library:
    path = _PACKAGE_DIR / _FILENAMES[kind]
    if not path.is_file():
        path = _build_on_demand(kind)
    if kind == "cuda":
        _load_torch_cuda_runtime()
    handle = ctypes.CDLL(str(path))
    for name, (argtypes, restype) in _SIGNATURES[kind].items():
        fn = getattr(handle, name)
        fn.argtypes, fn.restype = argtypes, restype
    lib = Library(kind, path, handle)
    version = getattr(handle, f"kvxfer_{kind}_abi_version")()
    if version != ABI_VERSION:
        raise KVXferError(
            f"{path} has ABI version {version}, this package needs {ABI_VERSION}: rebuild it (pip install -e .)"
        )
    if kind == "cuda" and handle.kvxfer_cuda_probe() != 0:
        raise KVXferError(f"{path} cannot use CUDA: {lib.last_error()}")
    return lib


def _load_torch_cuda_runtime() -> None:
    """A library built with ``-cudart=shared`` needs libcudart.so.<major>: the one torch
    loads with its CUDA libraries (its pip wheels keep it outside the linker's path), so
    import torch first. Without torch the linker searches its usual path."""
    try:
        import torch  # noqa: F401
    except ImportError:
        pass


def _cache_dir() -> Path:
    configured = envs.KVXFER_CACHE_DIR.get()
    if configured:
        return Path(configured)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "sglang_kvxfer"


def _build_on_demand(kind: str) -> Path:
    """Builds the missing library into the cache, keyed by a hash of sources and settings."""
    src = build.find_sources()
    if src is None:
        raise build.BuildError(f"{_FILENAMES[kind]} is not installed and no csrc/ to build it")
    toolchain = None
    if kind == "cpu":
        tool, archs = build.find_cxx(), []
        settings = [tool or ""]
    else:
        toolchain, archs = build.cuda_toolchain(), envs.KVXFER_CUDA_ARCHS.get().split(",")
        tool = toolchain.nvcc if toolchain else None
        settings = [tool or "", toolchain.version or "", toolchain.cudart] if toolchain else []
    if tool is None:
        raise build.BuildError(
            f"{_FILENAMES[kind]} is not installed and no {'C++ compiler' if kind == 'cpu' else 'nvcc'} to build it"
        )
    out = _cache_dir() / f"{kind}-{build.source_digest(src, kind, *settings, *archs)}" / _FILENAMES[kind]
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(out.parent / ".lock", _LOCK_TIMEOUT_S):
        if not out.is_file():  # another process may have built it while we waited
            logger.warning("building %s into %s (first use)", _FILENAMES[kind], out.parent)
            if kind == "cpu":
                build.build_cpu(out, src)
            else:
                build.build_cuda(out, archs, src, toolchain=toolchain)
    return out


class _file_lock:
    """An exclusive flock with a deadline: processes building the same library take turns."""

    def __init__(self, path: Path, timeout_s: float):
        self.path, self.timeout_s, self.fd = path, timeout_s, -1

    def __enter__(self) -> _file_lock:
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise build.BuildError(
                        f"{self.path} stayed locked for {self.timeout_s:.0f} s "
                        "(another build hung?); remove it to retry"
                    ) from None
                time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
