"""``benchmarks/bench_transports.py`` runs against the current transports (tcp needs an
authorized writer; the script must grant one) and verifies every byte it moves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_transports.py"


def test_quick_tcp_and_local_runs_verify_every_byte():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--transport", "tcp,local", "--workload", "64KiB_x1024"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["targets"]["all_verified"] is True, report
    rows = report["results"] if "results" in report else report.get("rows", [])
    names = {r.get("variant") or r.get("transport") for r in rows}
    assert {"tcp", "local"} <= names, sorted(map(str, names))
    shm = [r for r in rows if r.get("variant") == "local"]
    # local into shared memory also copies into a memfd of the writer, verified, and says
    # how much of each destination is mapped with huge pages
    assert shm and all(r["baseline_shm"]["verified"] is True for r in shm), shm
    assert all(set(r["huge_page_bytes"]) == {"destination", "baseline"} for r in shm), shm
    assert report["machine"]["shmem_thp"] in ("never", "advise", "within_size", "always", "deny", "force", "unknown")
    assert report["machine"]["shm_hugetlb"] in ("auto", "0", "1") and report["machine"]["hugetlb_free_pages"] >= 0
