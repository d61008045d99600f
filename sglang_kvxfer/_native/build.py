"""Compiler commands for the native libraries: the one place their flags live.

Owns: finding the sources (``csrc/`` of a checkout, or the copy a wheel carries in
``_native/csrc``), finding a C++ compiler and ``nvcc``, and building
``libkvxfer_cpu.so`` / ``libkvxfer_cuda.so`` atomically (compile to a temporary name, then
rename, so a failed or interrupted build never leaves a half-written library).
Used by ``setup.py`` at install time and by the loader for on-demand builds.
Must not: import torch or anything outside the standard library (setup.py imports it
before the package's dependencies exist), or decide *whether* to build.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from sglang_kvxfer.envs import parse_archs  # stdlib-only, like this module

__all__ = [
    "BuildError",
    "CPU_LIBRARY",
    "CUDA_LIBRARY",
    "SOURCES",
    "build_cpu",
    "build_cuda",
    "cpu_command",
    "cuda_command",
    "find_cxx",
    "find_nvcc",
    "find_sources",
    "parse_archs",
    "source_digest",
]

CPU_LIBRARY = "libkvxfer_cpu.so"
CUDA_LIBRARY = "libkvxfer_cuda.so"
SOURCES = ("kvxfer.h", "kvxfer_index.h", "kvxfer_cpu.cpp", "kvxfer_cuda.cu")
# Generous: a cold nvcc on a loaded 2-core machine takes ~5 s for these two archs.
BUILD_TIMEOUT_S = 300.0

_PACKAGE_DIR = Path(__file__).resolve().parent


class BuildError(RuntimeError):
    """A native build could not run or failed; the message holds the compiler's output."""


def find_sources() -> Path | None:
    """The directory holding every file of ``SOURCES``, or None (installed without them)."""
    for candidate in (_PACKAGE_DIR / "csrc", _PACKAGE_DIR.parents[1] / "csrc"):
        if all((candidate / name).is_file() for name in SOURCES):
            return candidate
    return None


def source_digest(src_dir: Path, *extra: str) -> str:
    """Short hash of the sources and build settings: names an on-demand build's cache."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update(name.encode() + b"\0" + (src_dir / name).read_bytes())
    for item in extra:
        h.update(b"\0" + item.encode())
    return h.hexdigest()[:16]


def find_cxx() -> str | None:
    """A C++ compiler: ``$CXX``, else ``c++``/``g++``/``clang++`` on PATH."""
    env = os.environ.get("CXX", "").strip()
    if env:
        return shutil.which(env.split()[0])
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    return None


def find_nvcc() -> str | None:
    """``nvcc`` on PATH, else under ``$CUDA_HOME``/``$CUDA_PATH``, else /usr/local/cuda."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    return None


def cpu_command(cxx: str, src_dir: Path, out: Path) -> list[str]:
    return [
        cxx,
        "-O3",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-fvisibility=hidden",
        "-pthread",
        "-Wall",
        "-Wextra",
        f"-I{src_dir}",
        str(src_dir / "kvxfer_cpu.cpp"),
        "-o",
        str(out),
    ]


def cuda_command(nvcc: str, src_dir: Path, out: Path, archs: list[str]) -> list[str]:
    """SASS for every arch, plus PTX of the newest so later GPUs can JIT it.

    The CUDA runtime is linked statically (nvcc's default): the library then needs only
    the driver, not a libcudart of the same version as the one torch was built with.
    """
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    # PTX of an arch-specific target (90a) does not run on later GPUs: use the plain number.
    newest = max(int(a.rstrip("af")) for a in archs)
    gencode.append(f"-gencode=arch=compute_{newest},code=compute_{newest}")
    return [
        nvcc,
        "-O3",
        "-std=c++17",
        "-shared",
        "-Xcompiler",
        "-fPIC,-fvisibility=hidden",
        *gencode,
        f"-I{src_dir}",
        str(src_dir / "kvxfer_cuda.cu"),
        "-o",
        str(out),
    ]


def _run_atomic(make_cmd, out: Path, timeout_s: float) -> Path:
    """Runs make_cmd(tmp_path) and renames tmp_path to out only when it succeeded."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    cmd = make_cmd(tmp_path)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout)[-4000:]
            raise BuildError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{tail}")
        os.replace(tmp_path, out)
    except subprocess.TimeoutExpired:
        raise BuildError(f"{' '.join(cmd)} did not finish within {timeout_s:.0f} s") from None
    except OSError as exc:
        raise BuildError(f"{' '.join(cmd)} could not run: {exc}") from None
    finally:
        tmp_path.unlink(missing_ok=True)
    return out


def build_cpu(out: Path, src_dir: Path | None = None, timeout_s: float = BUILD_TIMEOUT_S) -> Path:
    """Builds ``libkvxfer_cpu.so`` at ``out``; raises ``BuildError`` on any failure."""
    src_dir = src_dir or find_sources()
    if src_dir is None:
        raise BuildError("the csrc/ sources are not present")
    cxx = find_cxx()
    if cxx is None:
        raise BuildError("no C++ compiler found (set CXX or put c++/g++ on PATH)")
    return _run_atomic(lambda tmp: cpu_command(cxx, src_dir, tmp), Path(out), timeout_s)


def build_cuda(out: Path, archs: list[str], src_dir: Path | None = None, timeout_s: float = BUILD_TIMEOUT_S) -> Path:
    """Builds ``libkvxfer_cuda.so`` at ``out`` for ``archs``; raises ``BuildError``."""
    src_dir = src_dir or find_sources()
    if src_dir is None:
        raise BuildError("the csrc/ sources are not present")
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found (put it on PATH or set CUDA_HOME)")
    return _run_atomic(lambda tmp: cuda_command(nvcc, src_dir, tmp, archs), Path(out), timeout_s)
