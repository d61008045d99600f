"""The native sources build warning-free, and the build machinery behaves: nvcc compiles
the CUDA kernels for sm_80 and sm_90 (runs wherever nvcc is on PATH, GPU or not), the C++
library compiles under -Werror, the C ABI header is plain C, builds are atomic, on-demand
builds land in the cache, and a stuck build lock times out instead of hanging."""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import pytest

from sglang_kvxfer import _native, envs
from sglang_kvxfer._native import build
from tests.facts import needs_cxx, needs_nvcc

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
NVCC = build.find_nvcc()
CXX = build.find_cxx()


def _run(cmd, timeout=240):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout}\n{proc.stderr}"
    return proc


@needs_nvcc
def test_nvcc_compiles_every_cu_file_for_sm80_and_sm90_without_warnings(tmp_path):
    for source in sorted(CSRC.glob("*.cu")):
        _run(
            [
                NVCC,
                "-c",
                "-std=c++17",
                "-O2",
                "-Werror",
                "all-warnings",
                "-Xcompiler",
                "-Wall,-Wextra,-Werror",
                "-gencode=arch=compute_80,code=sm_80",
                "-gencode=arch=compute_90,code=sm_90",
                f"-I{CSRC}",
                str(source),
                "-o",
                str(tmp_path / (source.stem + ".o")),
            ]
        )
        assert (tmp_path / (source.stem + ".o")).stat().st_size > 0


@needs_cxx
def test_cpu_library_compiles_without_warnings(tmp_path):
    _run(
        [
            CXX,
            "-std=c++17",
            "-O2",
            "-fsyntax-only",
            "-Wall",
            "-Wextra",
            "-Wpedantic",
            "-Wshadow",
            "-Werror",
            f"-I{CSRC}",
            str(CSRC / "kvxfer_cpu.cpp"),
        ]
    )


@needs_cxx
def test_c_abi_header_is_plain_c():
    cc = "gcc" if "g++" in CXX or CXX.endswith("c++") else "clang"
    _run([cc, "-x", "c", "-std=c99", "-fsyntax-only", "-Wall", "-Wpedantic", "-Werror", str(CSRC / "kvxfer.h")])


def test_cuda_command_targets_sm80_sm90_and_ptx():
    cmd = build.cuda_command("nvcc", CSRC, Path("out.so"), build.parse_archs("80,90"))
    joined = " ".join(cmd)
    assert "code=sm_80" in joined and "code=sm_90" in joined
    assert "arch=compute_90,code=compute_90" in joined  # PTX for later GPUs


@pytest.mark.parametrize("text, archs", [("80,90", ["80", "90"]), ("80;90a", ["80", "90a"]), (" 100 ", ["100"])])
def test_parse_archs(text, archs):
    assert build.parse_archs(text) == archs


def test_bad_cuda_archs_env_names_the_variable(monkeypatch):
    monkeypatch.setenv("KVXFER_CUDA_ARCHS", "sm_90")
    with pytest.raises(ValueError, match=r"KVXFER_CUDA_ARCHS='sm_90' is invalid: 'sm_90' is not"):
        envs.KVXFER_CUDA_ARCHS.get()


@needs_cxx
def test_failed_build_raises_and_leaves_no_library(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    out = tmp_path / build.CPU_LIBRARY
    with pytest.raises(build.BuildError, match=r"false .* exited with 1"):
        build.build_cpu(out)
    assert list(tmp_path.iterdir()) == []  # no library, no temporary file


@needs_cxx
def test_on_demand_build_goes_to_the_cache_and_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("KVXFER_CACHE_DIR", str(tmp_path))
    path = _native._build_on_demand("cpu")
    assert path.is_file() and tmp_path in path.parents
    lib = ctypes.CDLL(str(path))
    assert lib.kvxfer_cpu_abi_version() == _native.ABI_VERSION
    mtime = path.stat().st_mtime_ns
    assert _native._build_on_demand("cpu") == path and path.stat().st_mtime_ns == mtime


def test_build_lock_times_out_instead_of_hanging(tmp_path):
    import fcntl

    lock = tmp_path / ".lock"
    holder = os.open(lock, os.O_CREAT | os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        with pytest.raises(build.BuildError, match=r"stayed locked for 0 s"):
            with _native._file_lock(lock, 0.3):
                pass
    finally:
        os.close(holder)
    with _native._file_lock(lock, 0.3):  # free again: taken at once
        pass


def test_disable_native_env_var(monkeypatch):
    monkeypatch.setenv("KVXFER_DISABLE_NATIVE", "1")
    assert _native.cpu_library() is None and _native.cuda_library() is None
    monkeypatch.setenv("KVXFER_DISABLE_NATIVE", "maybe")
    with pytest.raises(ValueError, match="KVXFER_DISABLE_NATIVE='maybe'"):
        _native.cpu_library()


def _fake_nvcc(root: Path, release: str) -> str:
    """``root/bin/nvcc`` that prints ``release`` as ``nvcc --version`` does."""
    (root / "bin").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(0o755)
    return str(nvcc)


def _fake_torch(monkeypatch, tmp_path: Path, version_py: str) -> None:
    """``build`` sees a torch package whose version.py is ``version_py`` (never imported)."""
    import types

    pkg = tmp_path / "faketorch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('never imported')\n")
    (pkg / "version.py").write_text(version_py)
    spec = types.SimpleNamespace(origin=str(pkg / "__init__.py"))
    util = types.SimpleNamespace(find_spec=lambda name: spec if name == "torch" else None)
    monkeypatch.setattr(build, "importlib", types.SimpleNamespace(util=util))


def test_torch_cuda_version_is_read_without_importing_torch(monkeypatch, tmp_path):
    import torch

    assert build.torch_cuda_version() == torch.version.cuda  # this machine's torch, as torch says
    _fake_torch(monkeypatch, tmp_path, "__version__ = '2.11.0+cu130'\ncuda: Optional[str] = '13.0'\n")
    assert build.torch_cuda_version() == "13.0"


def test_cuda_build_takes_the_nvcc_of_torchs_cuda_and_links_its_runtime_shared(monkeypatch, tmp_path):
    on_path = _fake_nvcc(tmp_path / "cuda-13.0", "13.0")
    home = _fake_nvcc(tmp_path / "cuda-12.8", "12.8")
    monkeypatch.setenv("PATH", f"{Path(on_path).parent}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda-12.8"))
    assert build.find_nvcc() == on_path  # no preference: the first found
    assert build.find_nvcc("12.4") == home  # torch's major version wins over PATH order
    _fake_torch(monkeypatch, tmp_path, "cuda: Optional[str] = '12.4'\n")
    tc = build.cuda_toolchain()
    assert (tc.nvcc, tc.version, tc.torch_cuda, tc.cudart) == (home, "12.8", "12.4", "shared")
    assert "torch built with CUDA 12.4, cudart shared" in tc.describe()
    _fake_torch(monkeypatch, tmp_path / "b", "cuda: Optional[str] = '11.8'\n")  # no nvcc 11 here
    tc = build.cuda_toolchain()
    assert (tc.nvcc, tc.cudart) == (on_path, "static")
    _fake_torch(monkeypatch, tmp_path / "c", "cuda: Optional[str] = None\n")  # a CPU torch
    assert build.cuda_toolchain().cudart == "static"


def test_cuda_command_links_the_runtime_as_asked():
    assert "-cudart=static" in build.cuda_command("nvcc", CSRC, Path("o.so"), ["90"])
    assert "-cudart=shared" in build.cuda_command("nvcc", CSRC, Path("o.so"), ["90"], cudart="shared")
    with pytest.raises(ValueError, match="cudart='dynamic' must be 'shared' or 'static'"):
        build.cuda_command("nvcc", CSRC, Path("o.so"), ["90"], cudart="dynamic")


@needs_nvcc
def test_shared_cudart_build_needs_the_runtime_of_nvccs_major_version(tmp_path):
    tc = build.CudaToolchain(NVCC, build.nvcc_version(NVCC), None, "shared")
    out = build.build_cuda(tmp_path / build.CUDA_LIBRARY, ["90"], toolchain=tc)
    dynamic = subprocess.run(["readelf", "-d", str(out)], capture_output=True, text=True, timeout=60).stdout
    major = tc.version.split(".")[0]
    assert f"[libcudart.so.{major}]" in dynamic, dynamic
