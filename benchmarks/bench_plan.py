"""Time to plan one request, against a per-token plan like SGLang's, in the same run.

The headline case is one request of 32,768 tokens, 80 layers, page size 16, prefill TP 8
-> decode TP 2 (8 KV heads, head_dim 128, bf16) with scattered decode pages: the TP plan
plus the byte plan of every (writer, reader) pair. The baseline builds what SGLang's
connectors build for a strided head slice: one (src, dst, size) entry per token per layer
and K/V, vectorised with numpy (kinder to the baseline than a Python loop). Prints JSON.

    python benchmarks/bench_plan.py [--repeats 30] [--tokens 32768]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.planning import plan_pair, plan_tp


def plan_request(h, p, d, gp, gd, src_pages, dst_pages, tokens, path):
    plan = plan_tp(h, p, d, salt=0)
    ops = 0
    for t in plan.transfers:
        pair = plan_pair(
            t,
            gp.placement(p, t.prefill_rank),
            gd.placement(d, t.decode_rank),
            src_pages,
            dst_pages,
            num_tokens=tokens,
            path=path,
        )
        ops += pair.op_count
    return ops, {pair.path}


def per_token_plan(h, p, d, gp, src_pages, dst_pages, tokens):
    """One entry per token per layer and K/V for every (writer, reader) pair."""
    plan = plan_tp(h, p, d, salt=0)
    tok = np.arange(tokens, dtype=np.int64)
    size = gp.page_size
    entries = 0
    for t in plan.transfers:
        src_local = gp.placement(p, t.prefill_rank).num_local_heads
        dst_local = gp.placement(d, t.decode_rank).num_local_heads
        head_bytes = gp.head_dim * gp.itemsize
        src_rows = src_pages[tok // size] * size + tok % size
        dst_rows = dst_pages[tok // size] * size + tok % size
        src_off = src_rows * (src_local * head_bytes) + t.src_head_start * head_bytes
        dst_off = dst_rows * (dst_local * head_bytes) + t.dst_head_start * head_bytes
        nbytes = np.full(tokens, t.num_heads * head_bytes, dtype=np.int64)
        for _ in range(gp.num_layers * (2 if gp.has_v else 1)):  # one list per layer and K/V, as posted
            batch = np.stack([src_off, dst_off, nbytes], axis=1)
            entries += batch.shape[0]
    return entries


def timed(fn, repeats):
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        samples.append(time.perf_counter() - t0)
    return result, samples


def summary_ms(samples):
    return {
        "median_ms": round(statistics.median(samples) * 1e3, 4),
        "min_ms": round(min(samples) * 1e3, 4),
        "max_ms": round(max(samples) * 1e3, 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # the target is "on one core"

    h, tokens, size = 8, args.tokens, args.page_size
    npages = -(-tokens // size)
    rng = np.random.default_rng(0)
    src_pages = np.arange(npages, dtype=np.int64)
    dst_pages = np.sort(rng.choice(npages * 4, size=npages, replace=False))  # scattered
    records = []
    cases = [
        ("P8->D2 NHD (headline)", 8, 2, "NHD", "auto"),
        ("P8->D2 HND per-page direct", 8, 2, "HND", "direct"),
        ("P8->D2 HND_KV per-page direct", 8, 2, "HND_KV", "direct"),
        ("P2->D2 NHD page runs direct", 2, 2, "NHD", "direct"),
    ]
    baseline = None
    for name, p, d, layout, path in cases:
        common = dict(
            num_layers=args.layers, total_kv_heads=h, head_dim=128, dtype="bf16", page_size=size, layout=layout
        )
        gp = KVGeometry(**common, num_pages=npages)
        gd = KVGeometry(**common, num_pages=npages * 4)
        (ops, paths), ours = timed(
            lambda p=p, d=d, gp=gp, gd=gd, path=path: plan_request(h, p, d, gp, gd, src_pages, dst_pages, tokens, path),
            args.repeats,
        )
        entries, base = timed(
            lambda p=p, d=d, gp=gp: per_token_plan(h, p, d, gp, src_pages, dst_pages, tokens),
            max(3, args.repeats // 10),
        )
        rec = {
            "case": name,
            "prefill_tp": p,
            "decode_tp": d,
            "layout": layout,
            "path": sorted(paths)[0],
            "tokens": tokens,
            "layers": args.layers,
            "page_size": size,
            "total_kv_heads": h,
            "plan": summary_ms(ours),
            "plan_ops": ops,
            "per_token_plan": summary_ms(base),
            "per_token_entries": entries,
            "speedup_median": round(statistics.median(base) / statistics.median(ours), 1),
        }
        records.append(rec)
        if baseline is None:
            baseline = rec
    print(
        json.dumps(
            {
                "benchmark": "plan",
                "cpu_affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                "target_ms": 5.0,
                "headline_median_ms": baseline["plan"]["median_ms"],
                "headline_vs_per_token": baseline["speedup_median"],
                "records": records,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
