"""Benchmark KV transfer between a prefill TP group and a decode TP group on this node; print JSON.

The same code as ``kvxfer bench`` (``sglang_kvxfer/cli/bench.py``), with ``--json`` on:
sweeps the comma-separated axes given (transport, TP sizes, context length, heads,
head_dim, page size and layout per side, MLA, concurrency, chunk size), verifies every
byte unless ``--no-verify``, and measures a plain baseline of the same bytes in the same
run (copy for ``local``, one socket per stream for ``tcp``, device-to-device copy on GPUs).

``--data-paths staged,direct,auto`` (this script only) runs the whole sweep once per data
path (``KVXFER_DATA_PATH`` for every rank), in that order, in one invocation, and between
them times one ``memcpy`` (``numpy.copyto``) of each configuration's request bytes in this
process; the JSON is then ``{"runs": {path: kvxfer bench's JSON}, "memcpy": ...}``, and
each record gains ``memcpy_ms`` (median of the memcpy timings taken around all the runs)
and ``window_vs_memcpy`` (``memcpy_ms`` / the transfer window p50: 1.0 is one memcpy).

    python benchmarks/bench_transfer.py --quick [--plot out.png]
    python benchmarks/bench_transfer.py --transport local --prefill-devices cuda:0,cuda:1 \\
        --decode-devices cuda:2,cuda:3 --prefill-tp 1,2 --decode-tp 1,2 --tokens 1024,4096,16384,65536
    python benchmarks/bench_transfer.py --data-paths staged,direct --transport local --tokens 2048 \\
        --layers 32 --concurrency 1 --prefill-tp 1,2 --decode-tp 1
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import sys
import time

from sglang_kvxfer.cli import main


def _memcpy_ms(nbytes: int, times: int = 5) -> list[float]:
    """``times`` timings (ms) of one ``numpy.copyto`` of ``nbytes`` between two resident buffers."""
    import numpy as np

    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)  # fault both in
    out = []
    for _ in range(times):
        t = time.perf_counter()
        np.copyto(dst, src)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def _by_paths(paths: list[str], argv: list[str]) -> int:
    runs, status, memcpy = {}, 0, {}

    def sample(records) -> None:
        for r in records:
            n = r.get("bytes_per_request") or 0
            if n:
                memcpy.setdefault(n, []).extend(_memcpy_ms(n))

    for path in paths:
        os.environ["KVXFER_DATA_PATH"] = path  # the spawned rank processes inherit it
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status = main(["bench", *argv]) or status
        runs[path] = json.loads(out.getvalue())
        sample(runs[path]["records"])  # after each run, so drift hits every path alike
    os.environ.pop("KVXFER_DATA_PATH", None)
    medians = {n: statistics.median(v) for n, v in memcpy.items()}
    for report in runs.values():
        for r in report["records"]:
            ms = medians.get(r.get("bytes_per_request") or 0)
            r["memcpy_ms"] = round(ms, 3) if ms else None
            p50 = r["latency_ms"]["p50"]
            r["window_vs_memcpy"] = round(ms / p50, 3) if ms and p50 else None
    memcpy_out = {
        str(n): {"median_ms": round(medians[n], 3), "ms": [round(x, 3) for x in v]} for n, v in memcpy.items()
    }
    json.dump({"data_paths": paths, "runs": runs, "memcpy": memcpy_out}, sys.stdout, indent=2)
    print()
    for path, report in runs.items():
        for r in report["records"]:
            print(
                f"{path:7s} {r['transport']} P{r['prefill_tp']} -> D{r['decode_tp']} {r['tokens']} tokens: window p50 "
                f"{r['latency_ms']['p50']:.1f} ms, memcpy {r['memcpy_ms']} ms, window_vs_memcpy {r['window_vs_memcpy']}",
                file=sys.stderr,
            )
    return status


if __name__ == "__main__":  # rank processes are spawned: they must not re-run this
    argv = sys.argv[1:]
    if "--data-paths" in argv:
        i = argv.index("--data-paths")
        paths = argv[i + 1].split(",")
        bad = [p for p in paths if p not in ("auto", "direct", "staged", "per_token")]
        if bad:
            sys.exit(f"--data-paths: {bad} must be among auto, direct, staged, per_token")
        rest = argv[:i] + argv[i + 2 :]
        sys.exit(_by_paths(paths, [*rest, *([] if "--json" in rest else ["--json"])]))
    sys.exit(main(["bench", *argv, *([] if "--json" in argv else ["--json"])]))
