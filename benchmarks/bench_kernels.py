"""Gather/scatter kernel bandwidth against a plain copy of the same bytes, in the same run.

Prints one JSON document on stdout. For each (layout, head_dim, page_size, num_heads) it
times ``gather_kv_heads`` (pool pages -> staging), ``scatter_kv_heads`` (staging -> pool
pages) and the baseline: ``torch`` ``copy_`` of a staging-sized buffer on CPU, a
device-to-device ``copy_`` on GPU. Bandwidth counts bytes read + bytes written
(2 x staging bytes for all three), so ``ratio = kernel GB/s / copy GB/s`` compares equal
work. Each figure is the median of ``--repeats`` runs, and the runs are interleaved per
repeat so machine noise hits them alike.

On CUDA each op is timed twice: the full call (argument checks, the host sort of the page
ids, the pinned upload of the pointer table, the launch) as ``gather_gbps``, and the kernel
alone as ``gather_kernel_gbps`` (table and page ids uploaded once before timing; CUDA events
around the launch only, queued behind a short device sleep so host work cannot show). Both
get a ratio against the device-to-device copy of the same bytes measured in the same run.

Pools hold ``--pool-heads`` heads; a config moves heads ``[0, num_heads)`` of every token
of a request whose pages are a random permutation of the pool (as after a busy scheduler).

``--fused`` times the pool -> pool ``copy_kv_heads`` instead: for each page size, layout
pair and TP head slice (a TP 2 prefill rank into a TP 1 decode pool, a TP 1 prefill rank
into a TP 2 decode pool), the fused copy, ``gather_kv_heads`` + ``scatter_kv_heads`` of the
same bytes (what the staged path does today), and one plain copy (memmove) of the same
bytes, in the same run. Default size: 2048 tokens x 32 layers x 8 heads x 128 x bf16, K and
V (256 MiB of KV, half of it moved per TP slice).

    python benchmarks/bench_kernels.py --quick               # CPU, a few configs
    python benchmarks/bench_kernels.py --device cuda         # full sweep on the GPU
    python benchmarks/bench_kernels.py --fused               # fused copy vs gather + scatter
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# torch's OpenMP workers spin for a while after each parallel op (libgomp's ACTIVE wait);
# right after the copy_ baseline they would hold the second core while the kernel under
# test starts its threads. PASSIVE makes them sleep at once, which costs the baseline
# nothing measurable on multi-MiB copies. Must be set before torch loads libgomp.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from sglang_kvxfer import ops  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.uint8}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--quick", action="store_true", help="few configs, small buffers")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--layouts", default="NHD,HND", help="comma list of NHD, HND, HND_KV, NHD_KV (default NHD,HND)")
    p.add_argument("--head-dims", default="64,128,576")
    p.add_argument("--page-sizes", default="1,16,64")
    p.add_argument("--heads", default="1,2,4,8", help="num_heads moved per config")
    p.add_argument("--pool-heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument(
        "--staging-mib",
        type=float,
        default=None,
        help="staging bytes per call (default 128 on CPU, 512 on GPU; quick: 64/128); "
        "keep it well above the last-level cache so both sides hit DRAM",
    )
    p.add_argument("--repeats", type=int, default=None, help="default 7 (quick: 5)")
    p.add_argument("--fused", action="store_true", help="time copy_kv_heads against gather + scatter and a copy")
    p.add_argument("--fused-tokens", type=int, default=2048)
    p.add_argument("--fused-layers", type=int, default=32)
    p.add_argument("--fused-heads", type=int, default=8, help="total KV heads of the model")
    p.add_argument("--fused-head-dim", type=int, default=128)
    p.add_argument("--fused-page-sizes", default="16,64")
    p.add_argument("--fused-pairs", default="NHD:NHD,HND:NHD", help="comma list of SRC:DST layouts")
    p.add_argument("--fused-tp", default="2to1,1to2", help="comma list of head slices: 2to1, 1to2")
    return p.parse_args(argv)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


# A device sleep queued before the start event: the host work of the timed call (ctypes,
# argument packing) happens while the GPU sleeps, so the events see the kernel alone.
_LEAD_CYCLES = 2_000_000


class Timer:
    """Wall time on CPU; CUDA events on GPU (the ops are asynchronous there)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, device_only: bool = False) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if device_only:
                torch.cuda._sleep(_LEAD_CYCLES)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def _median_times(runs: dict, device_only: set, repeats: int, timer) -> dict[str, float]:
    """Median seconds of each named run over ``repeats`` rounds (the runs interleaved), after
    one warm-up call of each (page faults, library load, caches)."""
    for fn in runs.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            times[name].append(timer(fn, device_only=name in device_only))
    return {name: statistics.median(ts) for name, ts in times.items()}


def _machine(device, dtype: str) -> dict:
    """What a report says about where it ran."""
    gpu = device.type == "cuda"
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if gpu else os.uname().machine,
        "backend": ops.backend_for(device),
        "dtype": dtype,
        "torch": torch.__version__,
    }


def bench_config(device, dtype, layout, head_dim, page_size, num_heads, args, staging_bytes, repeats, timer) -> dict:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    per_token = args.layers * 2 * num_heads * head_dim * itemsize
    num_pages = max(1, staging_bytes // (per_token * page_size))
    num_tokens = num_pages * page_size
    layout = layout.upper()
    shapes = {
        "NHD": (num_pages * page_size, args.pool_heads, head_dim),
        "HND": (num_pages, args.pool_heads, page_size, head_dim),
        "HND_KV": (num_pages, args.pool_heads, page_size, 2 * head_dim),  # vLLM's CPU cache: K and V
        "NHD_KV": (num_pages, page_size, args.pool_heads, 2 * head_dim),  # vLLM's GPU cache: K and V
    }
    if layout not in shapes:
        raise SystemExit(f"--layouts: layout={layout!r} is not supported; use NHD, HND, HND_KV or NHD_KV")
    shape = shapes[layout]
    gen = torch.Generator().manual_seed(0)

    def pool():
        # Contents do not matter for bandwidth; ones() touches every page up front.
        return [torch.ones(shape, dtype=dtype, device=device) for _ in range(args.layers)]

    k = pool()
    v = None if layout in ("HND_KV", "NHD_KV") else pool()  # one K-and-V tensor per layer
    page_ids = torch.randperm(num_pages, generator=gen)
    kw = dict(page_size=page_size, head_start=0, num_heads=num_heads, layout=layout)
    nbytes = ops.staging_nbytes(args.layers, num_tokens, num_heads, head_dim, head_dim, itemsize)
    staging = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    runs = {
        "copy": lambda: dst.copy_(src),
        "gather": lambda: ops.gather_kv_heads(k, v, page_ids, out=staging, **kw),
        "scatter": lambda: ops.scatter_kv_heads(staging, k, v, page_ids, **kw),
    }
    device_only = {"copy"}
    if device.type == "cuda" and ops.backend_for(device) == "native-cuda":
        runs["gather_kernel"] = ops.cuda_kernel_launcher(staging, k, v, page_ids, gather=True, **kw)
        runs["scatter_kernel"] = ops.cuda_kernel_launcher(staging, k, v, page_ids, gather=False, **kw)
        device_only |= {"gather_kernel", "scatter_kernel"}
    med = _median_times(runs, device_only, repeats, timer)
    del runs  # free the pools before the next config (the closures held them)
    k = v = staging = src = dst = None
    if device.type == "cuda":
        torch.cuda.empty_cache()  # pools of the next config differ in size
    gbps = {name: 2 * nbytes / t / 1e9 for name, t in med.items()}
    kernel = {}
    for op in ("gather", "scatter"):
        if f"{op}_kernel" in gbps:
            kernel[f"{op}_kernel_gbps"] = round(gbps[f"{op}_kernel"], 2)
            kernel[f"{op}_kernel_ratio"] = round(gbps[f"{op}_kernel"] / gbps["copy"], 3)
    return {
        "layout": layout,
        "head_dim": head_dim,
        "page_size": page_size,
        "num_heads": num_heads,
        "pool_heads": args.pool_heads,
        "layers": args.layers,
        "num_tokens": num_tokens,
        "staging_bytes": nbytes,
        "gather_gbps": round(gbps["gather"], 2),
        "scatter_gbps": round(gbps["scatter"], 2),
        "copy_gbps": round(gbps["copy"], 2),
        "gather_ratio": round(gbps["gather"] / gbps["copy"], 3),
        "scatter_ratio": round(gbps["scatter"] / gbps["copy"], 3),
        **kernel,
        "median_s": {name: round(t, 6) for name, t in med.items()},
    }


def _fused_pool(layout, num_pages, page_size, heads, head_dim, layers, dtype, device):
    """(k_buffers, v_buffers) of one side; packed layouts: one K-and-V tensor per layer."""
    shapes = {
        "NHD": (num_pages * page_size, heads, head_dim),
        "HND": (num_pages, heads, page_size, head_dim),
        "HND_KV": (num_pages, heads, page_size, 2 * head_dim),
        "NHD_KV": (num_pages, page_size, heads, 2 * head_dim),
    }
    if layout not in shapes:
        raise SystemExit(f"--fused-pairs: layout={layout!r} is not supported; use NHD, HND, HND_KV or NHD_KV")
    k = [torch.ones(shapes[layout], dtype=dtype, device=device) for _ in range(layers)]
    v = None if layout in ("HND_KV", "NHD_KV") else [torch.ones_like(t) for t in k]
    return k, v


def bench_fused(device, dtype, src_layout, dst_layout, page_size, tp, args, repeats, timer) -> dict:
    """One fused-copy config: copy_kv_heads vs gather + scatter vs a memmove of the same bytes."""
    heads, dim, layers, tokens = args.fused_heads, args.fused_head_dim, args.fused_layers, args.fused_tokens
    half = heads // 2
    # 2to1: a TP 2 rank's heads fill half of a TP 1 pool; 1to2: a TP 2 rank takes half of a TP 1 pool.
    src_heads, src_start, dst_heads, dst_start = (half, 0, heads, half) if tp == "2to1" else (heads, half, half, 0)
    num_pages = -(-tokens // page_size)
    gen = torch.Generator().manual_seed(page_size)
    src_ids = torch.randperm(num_pages, generator=gen)
    dst_ids = torch.randperm(num_pages, generator=gen)
    sk, sv = _fused_pool(src_layout, num_pages, page_size, src_heads, dim, layers, dtype, device)
    dk, dv = _fused_pool(dst_layout, num_pages, page_size, dst_heads, dim, layers, dtype, device)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = ops.staging_nbytes(layers, tokens, half, dim, dim, itemsize)
    staging = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    g_kw = dict(page_size=page_size, head_start=src_start, num_heads=half, layout=src_layout, num_tokens=tokens)
    s_kw = dict(page_size=page_size, head_start=dst_start, num_heads=half, layout=dst_layout, num_tokens=tokens)
    c_kw = dict(num_heads=half, num_tokens=tokens)
    c_kw.update({f"src_{k}": v for k, v in g_kw.items() if k not in ("num_heads", "num_tokens")})
    c_kw.update({f"dst_{k}": v for k, v in s_kw.items() if k not in ("num_heads", "num_tokens")})

    def gather_scatter():
        ops.gather_kv_heads(sk, sv, src_ids, out=staging, **g_kw)
        ops.scatter_kv_heads(staging, dk, dv, dst_ids, **s_kw)

    runs = {
        "memmove": lambda: dst.copy_(src),
        "fused": lambda: ops.copy_kv_heads(sk, sv, src_ids, dk, dv, dst_ids, **c_kw),
        "gather_scatter": gather_scatter,
    }
    device_only = {"memmove"}
    if device.type == "cuda" and ops.backend_for(device) == "native-cuda":
        runs["fused_kernel"] = ops.cuda_copy_launcher(sk, sv, src_ids, dk, dv, dst_ids, **c_kw)
        gk = ops.cuda_kernel_launcher(staging, sk, sv, src_ids, gather=True, **g_kw)
        sc = ops.cuda_kernel_launcher(staging, dk, dv, dst_ids, gather=False, **s_kw)
        runs["gather_scatter_kernel"] = lambda: (gk(), sc())
        device_only |= {"fused_kernel", "gather_scatter_kernel"}
    med = _median_times(runs, device_only, repeats, timer)
    del runs, gather_scatter
    sk = sv = dk = dv = staging = src = dst = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    out = {
        "src_layout": src_layout,
        "dst_layout": dst_layout,
        "page_size": page_size,
        "tp": tp.replace("to", " -> "),
        "num_heads": half,
        "layers": layers,
        "num_tokens": tokens,
        "bytes_moved": nbytes,
        "median_ms": {name: round(t * 1e3, 3) for name, t in med.items()},
        "fused_gbps": round(2 * nbytes / med["fused"] / 1e9, 2),
        "memmove_gbps": round(2 * nbytes / med["memmove"] / 1e9, 2),
        "fused_speedup_vs_gather_scatter": round(med["gather_scatter"] / med["fused"], 3),
        "fused_vs_memmove": round(med["memmove"] / med["fused"], 3),
    }
    if "fused_kernel" in med:
        out["fused_kernel_speedup_vs_gather_scatter_kernel"] = round(
            med["gather_scatter_kernel"] / med["fused_kernel"], 3
        )
        out["fused_kernel_vs_memmove"] = round(med["memmove"] / med["fused_kernel"], 3)
    return out


def main_fused(args, device, timer, repeats) -> int:
    results = []
    for page_size in ints(args.fused_page_sizes):
        for pair in args.fused_pairs.split(","):
            src_layout, dst_layout = (x.strip().upper() for x in pair.split(":"))
            for tp in args.fused_tp.split(","):
                if tp not in ("2to1", "1to2"):
                    raise SystemExit(f"--fused-tp: {tp!r} must be 2to1 or 1to2")
                r = bench_fused(device, DTYPES[args.dtype], src_layout, dst_layout, page_size, tp, args, repeats, timer)
                results.append(r)
                print(
                    f"# fused {src_layout}->{dst_layout} ps={page_size} TP {r['tp']}: "
                    f"x{r['fused_speedup_vs_gather_scatter']} vs gather+scatter, x{r['fused_vs_memmove']} of a memmove",
                    file=sys.stderr,
                    flush=True,
                )
    doc = {
        **_machine(device, args.dtype),
        "kvxfer_cpu_threads": os.environ.get("KVXFER_CPU_THREADS", "0 (auto)"),
        "repeats": repeats,
        "timed": (
            "fused: copy_kv_heads (full call); gather_scatter: gather_kv_heads into a staging buffer then "
            "scatter_kv_heads of it (full calls); memmove: torch copy_ of bytes_moved; *_kernel: launches alone"
        ),
        "gbps_counts": "read + written (2 x bytes_moved)",
        "results": results,
        "summary": {
            "min_fused_speedup_vs_gather_scatter": min(r["fused_speedup_vs_gather_scatter"] for r in results),
            "max_fused_speedup_vs_gather_scatter": max(r["fused_speedup_vs_gather_scatter"] for r in results),
            "min_fused_vs_memmove": min(r["fused_vs_memmove"] for r in results),
        },
    }
    print(json.dumps(doc, indent=2))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"error": "--device cuda but torch sees no CUDA device"}))
        return 2
    gpu = device.type == "cuda"
    if args.fused:
        return main_fused(args, device, Timer(device), args.repeats or (3 if args.quick else 7))
    if args.quick:
        layouts, dims, pages, heads = ["NHD"], [128], [16], [1, 8]
        if args.layouts != "NHD,HND":
            layouts = args.layouts.split(",")
    else:
        layouts, dims = args.layouts.split(","), ints(args.head_dims)
        pages, heads = ints(args.page_sizes), ints(args.heads)
    mib = args.staging_mib or ((128 if gpu else 64) if args.quick else (512 if gpu else 128))
    repeats = args.repeats or (5 if args.quick else 7)
    timer = Timer(device)
    results = []
    for layout in layouts:
        for head_dim in dims:
            for page_size in pages:
                for num_heads in heads:
                    if num_heads > args.pool_heads:
                        continue
                    results.append(
                        bench_config(
                            device,
                            DTYPES[args.dtype],
                            layout,
                            head_dim,
                            page_size,
                            num_heads,
                            args,
                            int(mib * 2**20),
                            repeats,
                            timer,
                        )
                    )
                    r = results[-1]
                    alone = (
                        f" (kernel alone: gather x{r['gather_kernel_ratio']} scatter x{r['scatter_kernel_ratio']})"
                        if "gather_kernel_ratio" in r
                        else ""
                    )
                    print(
                        f"# {r['layout']} d={head_dim} ps={page_size} n={num_heads}: gather "
                        f"x{r['gather_ratio']} scatter x{r['scatter_ratio']}{alone}",
                        file=sys.stderr,
                        flush=True,
                    )
    target = [r for r in results if r["page_size"] == 16 and r["head_dim"] == 128]
    doc = {
        **_machine(device, args.dtype),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "kvxfer_cpu_threads": os.environ.get("KVXFER_CPU_THREADS", "0 (auto)"),
        "repeats": repeats,
        "bytes_counted": "read + written (2 x staging bytes) for gather, scatter and copy",
        "baseline": "torch copy_ device-to-device" if gpu else "torch copy_ host memory",
        "timed": (
            "gather/scatter: the full call (checks, page-id sort, table upload, launch); "
            "*_kernel: the launch alone (table and ids uploaded once), CUDA events behind a device sleep"
            if gpu
            else "wall time of the full call"
        ),
        "results": results,
        "summary_page16_dim128": {
            "min_gather_ratio": min((r["gather_ratio"] for r in target), default=None),
            "min_scatter_ratio": min((r["scatter_ratio"] for r in target), default=None),
            "min_gather_kernel_ratio": min(
                (r["gather_kernel_ratio"] for r in target if "gather_kernel_ratio" in r), default=None
            ),
            "min_scatter_kernel_ratio": min(
                (r["scatter_kernel_ratio"] for r in target if "scatter_kernel_ratio" in r), default=None
            ),
            "target_ratio": 0.9 if gpu else 0.7,
        },
    }
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
