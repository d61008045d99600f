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
