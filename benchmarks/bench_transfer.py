"""Benchmark KV transfer between a prefill TP group and a decode TP group on this node; print JSON.

The same code as ``kvxfer bench`` (``sglang_kvxfer/cli/bench.py``), with ``--json`` on:
sweeps the comma-separated axes given (transport, TP sizes, context length, heads,
head_dim, page size and layout per side, MLA, concurrency, chunk size), verifies every
byte unless ``--no-verify``, and measures a plain baseline of the same bytes in the same
run (copy for ``local``, one socket per stream for ``tcp``, device-to-device copy on GPUs).

``--data-paths staged,direct,fused,auto`` (this script only) runs the whole sweep once per
data path (``KVXFER_DATA_PATH`` for every rank), in that order, in one invocation, and
between them times one ``memcpy`` (``numpy.copyto``) of each configuration's request bytes
in this process; the JSON is then ``{"runs": {path: kvxfer bench's JSON}, "memcpy": ...,
"configs": [...]}``, each record gains ``memcpy_ms`` (median of the memcpy timings taken
around all the runs) and ``window_vs_memcpy`` (``memcpy_ms`` / the transfer window p50:
1.0 is one memcpy; ``memcpy_shm_ms`` / ``window_vs_memcpy_shm``: the same between two
shared-memory buffers, the kind of memory ``local`` pools live in), and ``configs`` lists
each configuration once with every path's window, ``window_vs_memcpy``, ``p99_over_p50``
and the path it took, and ``vs_<path>``: its window_vs_memcpy over that forced path's in
the same run (``fused`` against ``staged`` and ``direct``: the same-run baseline of the
fused path).

When ``--total-kv-heads`` lists several values, ``heads_comparison`` (every mode) sets each
configuration's GB/s beside the one with the most heads, e.g. H=2 against H=8 for P1 -> D8
(replicated heads: the same bytes per decode rank), with ``pool_read_bytes_per_request``:
on the staged path a replicated head slice is gathered once for all its readers (fan-out).

    python benchmarks/bench_transfer.py --quick [--plot out.png]
    python benchmarks/bench_transfer.py --transport local --prefill-devices cuda:0,cuda:1 \\
        --decode-devices cuda:2,cuda:3 --prefill-tp 1,2 --decode-tp 1,2 --tokens 1024,4096,16384,65536
    python benchmarks/bench_transfer.py --data-paths staged,direct,fused,auto --transport local --tokens 2048 \\
        --layers 32 --concurrency 1,2 --prefill-tp 1,2 --decode-tp 1
    python benchmarks/bench_transfer.py --transport local --prefill-tp 1 --decode-tp 8 --total-kv-heads 2,8 \\
        --tokens 2048 --layers 32
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


def _memcpy_ms(nbytes: int, times: int = 5, shared: bool = False) -> list[float]:
    """``times`` timings (ms) of one ``numpy.copyto`` of ``nbytes`` between two resident
    buffers: private memory (numpy asks for 2 MiB pages), or with ``shared`` two memfd
    mappings as the ``local`` pools are (``alloc_shared``; 4 KiB pages where the kernel's
    ``shmem_enabled`` gives shared memory no huge pages)."""
    import numpy as np

    keep = []
    if shared:
        from sglang_kvxfer.transports.local import alloc_shared

        keep = [alloc_shared(nbytes), alloc_shared(nbytes)]
        src, dst = keep[0].as_numpy(), keep[1].as_numpy()
        src.fill(1)
    else:
        src = np.ones(nbytes, np.uint8)
        dst = np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)  # fault both in
    out = []
    for _ in range(times):
        t = time.perf_counter()
        np.copyto(dst, src)
        out.append((time.perf_counter() - t) * 1e3)
    del src, dst
    for buf in keep:
        buf.close()
    return out


CONFIG = (
    "transport",
    "prefill_tp",
    "decode_tp",
    "total_kv_heads",
    "head_dim",
    "mla",
    "prefill_page_size",
    "decode_page_size",
    "prefill_layout",
    "decode_layout",
    "tokens",
    "concurrency",
    "chunk_tokens",
)


def _key(record: dict, drop: tuple[str, ...] = ()) -> tuple:
    return tuple((k, record[k]) for k in CONFIG if k not in drop)


def _configs(runs: dict) -> list[dict]:
    """Each configuration once, with every data path's numbers, and each path's
    window_vs_memcpy over every forced path's of the same run (``vs_staged``, ...)."""
    by_key: dict[tuple, dict] = {}
    for path, report in runs.items():
        for r in report["records"]:
            by_key.setdefault(_key(r), {})[path] = r
    out = []
    for key, by_path in by_key.items():
        entry: dict = {**dict(key), "paths": {}}
        for path, r in by_path.items():
            mine = r.get("window_vs_memcpy")
            entry["paths"][path] = {
                "taken": r["data_path"],
                "window_ms": r["latency_ms"],
                "p99_over_p50": r.get("p99_over_p50"),
                "window_vs_memcpy": mine,
                "window_vs_memcpy_shm": r.get("window_vs_memcpy_shm"),
                "gbps": r["gbps"],
                "pool_read_bytes_per_request": r.get("pool_read_bytes_per_request"),
                **{
                    f"vs_{other}": round(mine / theirs, 3)
                    for other, o in by_path.items()
                    if other in ("staged", "direct") and other != path
                    for theirs in [o.get("window_vs_memcpy")]
                    if mine and theirs
                },
            }
        out.append(entry)
    return out


def _heads(records: list[dict]) -> list[dict]:
    """Configurations that differ only in ``total_kv_heads``: each H's GB/s over the GB/s
    of the one with the most heads, with the bytes read from the prefill pools."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault(_key(r, drop=("total_kv_heads",)), []).append(r)
    out = []
    for key, rs in groups.items():
        if len(rs) < 2:
            continue
        ref = max(rs, key=lambda r: r["total_kv_heads"])
        out.append(
            {
                **dict(key),
                "reference_heads": ref["total_kv_heads"],
                "by_heads": {
                    str(r["total_kv_heads"]): {
                        "gbps": r["gbps"],
                        "gbps_vs_reference": round(r["gbps"] / ref["gbps"], 3) if ref["gbps"] else None,
                        "bytes_per_request": r["bytes_per_request"],
                        "pool_read_bytes_per_request": r.get("pool_read_bytes_per_request"),
                        "data_path": r["data_path"],
                    }
                    for r in rs
                },
            }
        )
    return out


def _plain(argv: list[str]) -> int:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["bench", *argv])
    text = out.getvalue()
    try:
        report = json.loads(text)
    except ValueError:  # an error message, not a report: pass it on as it is
        sys.stdout.write(text)
        return status
    report["heads_comparison"] = _heads(report["records"])
    print(json.dumps(report, allow_nan=False))
    return status


def _by_paths(paths: list[str], argv: list[str]) -> int:
    runs, status, memcpy, memcpy_shm = {}, 0, {}, {}

    def sample(records) -> None:
        for r in records:
            n = r.get("bytes_per_request") or 0
            if n:
                memcpy.setdefault(n, []).extend(_memcpy_ms(n))
                memcpy_shm.setdefault(n, []).extend(_memcpy_ms(n, shared=True))

    for path in paths:
        os.environ["KVXFER_DATA_PATH"] = path  # the spawned rank processes inherit it
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status = main(["bench", *argv]) or status
        runs[path] = json.loads(out.getvalue())
        sample(runs[path]["records"])  # after each run, so drift hits every path alike
    os.environ.pop("KVXFER_DATA_PATH", None)
    medians = {n: statistics.median(v) for n, v in memcpy.items()}
    shm_medians = {n: statistics.median(v) for n, v in memcpy_shm.items()}
    for report in runs.values():
        for r in report["records"]:
            n, p50 = r.get("bytes_per_request") or 0, r["latency_ms"]["p50"]
            for suffix, table in (("", medians), ("_shm", shm_medians)):
                ms = table.get(n)
                r[f"memcpy{suffix}_ms"] = round(ms, 3) if ms else None
                r[f"window_vs_memcpy{suffix}"] = round(ms / p50, 3) if ms and p50 else None
    memcpy_out = {
        str(n): {
            "median_ms": round(medians[n], 3),
            "ms": [round(x, 3) for x in v],
            "shm_median_ms": round(shm_medians[n], 3),
            "shm_ms": [round(x, 3) for x in memcpy_shm[n]],
        }
        for n, v in memcpy.items()
    }
    for report in runs.values():
        report["heads_comparison"] = _heads(report["records"])
    out = {"data_paths": paths, "runs": runs, "memcpy": memcpy_out, "configs": _configs(runs)}
    json.dump(out, sys.stdout, indent=2)
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
        bad = [p for p in paths if p not in ("auto", "direct", "staged", "per_token", "fused")]
        if bad:
            sys.exit(f"--data-paths: {bad} must be among auto, direct, staged, per_token, fused")
        rest = argv[:i] + argv[i + 2 :]
        sys.exit(_by_paths(paths, [*rest, *([] if "--json" in rest else ["--json"])]))
    sys.exit(_plain([*argv, *([] if "--json" in argv else ["--json"])]))
