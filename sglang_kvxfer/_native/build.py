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

import functools
import glob
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sglang_kvxfer.envs import parse_archs  # stdlib-only, like this module

__all__ = [
    "BuildError",
    "CPU_LIBRARY",
    "CUDA_LIBRARY",
    "SOURCES",
    "build_cpu",
    "build_cuda",
    "CudaToolchain",
    "cpu_command",
    "cuda_command",
    "cuda_toolchain",
    "find_cxx",
    "find_nvcc",
    "find_sources",
    "nvcc_version",
    "parse_archs",
    "source_digest",
    "torch_cuda_version",
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


def _nvcc_candidates() -> list[str]:
    """Every ``nvcc`` we can see, in order of preference: PATH, ``$CUDA_HOME``,
    ``$CUDA_PATH``, /usr/local/cuda, then /usr/local/cuda-X.Y (newest first)."""
    found = []
    on_path = shutil.which("nvcc")
    if on_path:
        found.append(on_path)
    versioned: list[str] = sorted(glob.glob("/usr/local/cuda-*"), key=_version_key, reverse=True)
    for root in [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda", *versioned]:
        path = os.path.join(root, "bin", "nvcc") if root else ""
        if root and os.access(path, os.X_OK) and path not in found:
            found.append(path)
    return found


def _version_key(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", os.path.basename(text))) or (0,)


def find_nvcc(cuda_version: str | None = None) -> str | None:
    """An ``nvcc``: with ``cuda_version`` (e.g. torch's ``"13.0"``) the first one of that
    major version, else the first one found (PATH, ``$CUDA_HOME``/``$CUDA_PATH``,
    /usr/local/cuda, /usr/local/cuda-X.Y)."""
    candidates = _nvcc_candidates()
    if cuda_version:
        major = cuda_version.split(".")[0]
        for nvcc in candidates:
            version = nvcc_version(nvcc)
            if version is not None and version.split(".")[0] == major:
                return nvcc
    return candidates[0] if candidates else None


@functools.cache
def nvcc_version(nvcc: str) -> str | None:
    """``"13.0"`` from ``nvcc --version``; None when it cannot run or says no release."""
    try:
        proc = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"release (\d+\.\d+)", proc.stdout)
    return match.group(1) if match else None


def torch_cuda_version() -> str | None:
    """The CUDA version the installed torch was built with (``torch.version.cuda``), read
    from ``torch/version.py`` without importing torch; None for no torch or a CPU build."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return None
    match = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([\d.]+)['\"]", text, re.M)
    return match.group(1) if match else None


@dataclass(frozen=True)
class CudaToolchain:
    """The ``nvcc`` a CUDA build uses and how it links the CUDA runtime.

    ``cudart`` is ``"shared"`` when nvcc's major version is torch's: the library then uses
    the libcudart torch already loaded, so it runs wherever torch's CUDA runs. Otherwise
    ``"static"``: the library carries nvcc's runtime, which needs a driver at least that new
    (CUDA 13 needs driver >= 580); a too-old driver shows in the loader's reason.
    """

    nvcc: str
    version: str | None
    torch_cuda: str | None
    cudart: str

    def describe(self) -> str:
        return (
            f"{self.nvcc} (CUDA {self.version or '?'}), torch built with CUDA {self.torch_cuda or 'none'}, "
            f"cudart {self.cudart}"
        )


def cuda_toolchain() -> CudaToolchain | None:
    """The nvcc matching torch's CUDA major version where one is installed, else the first
    nvcc found; None when there is none."""
    torch_cuda = torch_cuda_version()
    nvcc = find_nvcc(torch_cuda)
    if nvcc is None:
        return None
    version = nvcc_version(nvcc)
    same_major = bool(torch_cuda and version and torch_cuda.split(".")[0] == version.split(".")[0])
    return CudaToolchain(nvcc, version, torch_cuda, "shared" if same_major else "static")


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


def cuda_command(nvcc: str, src_dir: Path, out: Path, archs: list[str], cudart: str = "static") -> list[str]:
    """SASS for every arch, plus PTX of the newest so later GPUs can JIT it.

    ``cudart``: ``"shared"`` links libcudart.so of nvcc's major version (the one torch
    loaded, see ``CudaToolchain``); ``"static"`` carries nvcc's runtime in the library.
    """
    if cudart not in ("shared", "static"):
        raise ValueError(f"cudart={cudart!r} must be 'shared' or 'static'")
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
        f"-cudart={cudart}",
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


def build_cuda(
    out: Path,
    archs: list[str],
    src_dir: Path | None = None,
    timeout_s: float = BUILD_TIMEOUT_S,
    toolchain: CudaToolchain | None = None,
) -> Path:
    """Builds ``libkvxfer_cuda.so`` at ``out`` for ``archs`` with ``toolchain`` (default:
    ``cuda_toolchain()``); raises ``BuildError``."""
    src_dir = src_dir or find_sources()
    if src_dir is None:
        raise BuildError("the csrc/ sources are not present")
    tc = toolchain or cuda_toolchain()
    if tc is None:
        raise BuildError("nvcc not found (put it on PATH or set CUDA_HOME)")
    return _run_atomic(lambda tmp: cuda_command(tc.nvcc, src_dir, tmp, archs, tc.cudart), Path(out), timeout_s)
