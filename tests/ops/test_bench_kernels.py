"""``benchmarks/bench_kernels.py``: the CPU mode prints its JSON with the copy baseline of
the same run, and ``--device cuda`` without a GPU says so instead of failing later."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.facts import cuda_available

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kernels.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=240)


def test_cpu_mode_reports_gather_scatter_and_copy_of_the_same_bytes():
    out = _run("--device", "cpu", "--quick", "--staging-mib", "2", "--repeats", "1", "--layers", "1")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["device"] == "cpu" and doc["baseline"] == "torch copy_ host memory"
    assert [(r["layout"], r["num_heads"]) for r in doc["results"]] == [("NHD", 1), ("NHD", 8)]
    for r in doc["results"]:
        assert r["staging_bytes"] > 1 << 20 and min(r["gather_gbps"], r["scatter_gbps"], r["copy_gbps"]) > 0
        assert r["gather_ratio"] == pytest.approx(r["gather_gbps"] / r["copy_gbps"], rel=0.01)
        assert "gather_kernel_gbps" not in r  # the kernel-alone figures exist on CUDA only
    summary = doc["summary_page16_dim128"]
    assert summary["min_gather_ratio"] == min(r["gather_ratio"] for r in doc["results"])
    assert summary["min_gather_kernel_ratio"] is None


@pytest.mark.skipif(cuda_available(), reason="this machine has a CUDA device")
def test_cuda_mode_without_a_device_exits_with_a_reason():
    out = _run("--device", "cuda", "--quick")
    assert out.returncode == 2
    assert json.loads(out.stdout) == {"error": "--device cuda but torch sees no CUDA device"}


def test_fused_mode_reports_the_copy_against_gather_scatter_and_a_memmove_of_the_same_bytes():
    out = _run(
        "--device", "cpu", "--fused", "--fused-tokens", "64", "--fused-layers", "2", "--fused-page-sizes", "16",
        "--fused-pairs", "NHD:NHD,NHD_KV:HND", "--repeats", "1",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [(r["src_layout"], r["dst_layout"], r["tp"]) for r in doc["results"]] == [
        ("NHD", "NHD", "2 -> 1"),
        ("NHD", "NHD", "1 -> 2"),
        ("NHD_KV", "HND", "2 -> 1"),
        ("NHD_KV", "HND", "1 -> 2"),
    ]
    for r in doc["results"]:
        assert r["bytes_moved"] == 2 * 64 * 4 * (128 + 128) * 2  # layers x tokens x heads x (K + V) x bf16
        assert set(r["median_ms"]) == {"memmove", "fused", "gather_scatter"}
        ms = r["median_ms"]
        assert r["fused_vs_memmove"] == pytest.approx(ms["memmove"] / ms["fused"], rel=0.02)
    assert doc["summary"]["min_fused_vs_memmove"] == min(r["fused_vs_memmove"] for r in doc["results"])
