"""``kvxfer bench``: sweep prefill/decode configurations on this node; measure each against
a plain mover of the same bytes in the same run.

Owns the sweep (comma lists -> their cartesian product; invalid (H, T) pairs, MLA with
H != 1 and other impossible points are skipped with a note), running it (one pair of
rank groups per group shape, reused across context lengths, concurrency and chunk sizes;
one warm-up request; ``--repeats`` runs of ``--requests`` requests, each run followed by
the baseline on the bytes it moved) and the records: one JSON object per configuration.

The numbers come from the ranks' ``RequestRecord``s (``metrics.py``): a request's
transfer window runs from its first byte being ready on the prefill to the last notice
processed on the decode. ``gbps`` is bytes over busy time (while any window was open),
median over repeats; ``ratio`` divides it by the baseline's median (``cluster/baseline.py``).
``benchmarks/bench_transfer.py`` runs the same code.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import secrets
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from sglang_kvxfer import envs
from sglang_kvxfer.cli.common import (
    COMMON_RANGES,
    add_deadline_args,
    add_model_args,
    add_side_args,
    check_ranges,
    engine_options,
    int_list,
    pool_pages,
    side_geometry,
    str_list,
)
from sglang_kvxfer.errors import KVXferError

__all__ = ["add_arguments", "run", "run_bench", "Shape"]

# What --quick and a plain run sweep when the flag is not given.
QUICK = {
    "transport": ["local", "tcp"],
    "prefill_tp": [1, 2],
    "decode_tp": [1, 2],
    "tokens": [256, 1024, 4096],
    "concurrency": [2],
    "chunk_tokens": [0],
    "requests": 4,
    "repeats": 2,
    "layers": 8,
}
PLAIN = {
    "transport": ["local"],
    "prefill_tp": [1],
    "decode_tp": [1],
    "tokens": [1024, 4096, 16384],
    "concurrency": [2],
    "chunk_tokens": [0],
    "requests": 8,
    "repeats": 3,
    "layers": 16,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small sweep (local and tcp, TP 1-2 each side, 256-4096 tokens, 8 layers): "
        "about a minute on 2 cores; explicit flags still win",
    )
    g = p.add_argument_group("sweep (comma lists; every combination runs)")
    g.add_argument("--transport", type=str_list, default=None, help="transports (default local)")
    g.add_argument("--prefill-tp", type=int_list, default=None, help="prefill TP sizes (default 1)")
    g.add_argument("--decode-tp", type=int_list, default=None, help="decode TP sizes (default 1)")
    g.add_argument("--tokens", type=int_list, default=None, help="context lengths (default 1024,4096,16384)")
    g.add_argument("--concurrency", type=int_list, default=None, help="requests in flight (default 2)")
    g.add_argument(
        "--chunk-tokens", type=int_list, default=None, help="prefill chunk sizes in tokens, 0 = one chunk (default 0)"
    )
    p.add_argument(
        "--prefill-devices",
        type=str_list,
        default=None,
        help="device of each prefill rank, e.g. cuda:0,cuda:1 (default cpu); as many as the largest TP",
    )
    p.add_argument("--decode-devices", type=str_list, default=None, help="device of each decode rank (default cpu)")
    p.add_argument("--requests", type=int, default=None, help="requests per repeat (default 8)")
    p.add_argument("--repeats", type=int, default=None, help="repeats per configuration; medians reported (default 3)")
    p.add_argument(
        "--chunk-delay-ms",
        type=float,
        default=0.0,
        help="pause before each chunk after the first, standing in for prefill compute (default 0)",
    )
    p.add_argument("--no-verify", action="store_true", help="skip filling and checking the bytes (pure speed runs)")
    p.add_argument("--one-process", action="store_true", help="run each TP group's ranks in one process")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--output", default=None, help="also write the JSON to this file")
    p.add_argument("--plot", default=None, help="write a PNG of GB/s and latency against context length")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus metrics during the run: prefill rank r on PORT+r, decode rank r on "
        "PORT+prefill_tp+r (default 0: off)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of room ids and page allocation")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--log-level", default="ERROR", help="log level of the rank processes (default ERROR)")
    add_model_args(p, sweep=True)
    add_side_args(p, both=True, sweep=True)
    add_deadline_args(p)
    p.set_defaults(layers=None)


@dataclass(frozen=True)
class Shape:
    """What one pair of rank groups is started for."""

    transport: str
    prefill_tp: int
    decode_tp: int
    total_kv_heads: int
    head_dim: int
    mla: bool
    prefill_page_size: int
    decode_page_size: int
    prefill_layout: str
    decode_layout: str

    @property
    def label(self) -> str:
        return (
            f"{self.transport} P{self.prefill_tp}->D{self.decode_tp} H{self.total_kv_heads} d{self.head_dim}"
            f"{' MLA' if self.mla else ''} pages {self.prefill_page_size}/{self.decode_page_size} "
            f"{self.prefill_layout}/{self.decode_layout}"
        )


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill unset sweep flags from --quick or the plain defaults; validate the scalars."""
    base = QUICK if args.quick else PLAIN
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("requests", "repeats", "layers"):
        if getattr(args, key) < 1:
            raise ValueError(f"--{key}={getattr(args, key)} must be >= 1")
    for key in ("prefill_tp", "decode_tp", "tokens", "concurrency"):
        bad = [v for v in getattr(args, key) if v < 1]
        if bad:
            raise ValueError(f"--{key.replace('_', '-')} values must be >= 1, got {bad}")
    if min(args.chunk_tokens) < 0:
        raise ValueError(f"--chunk-tokens values must be >= 0, got {args.chunk_tokens}")
    if not 0 <= args.metrics_port < 65536:
        raise ValueError(f"--metrics-port={args.metrics_port} must be 0 (off) or a port")
    check_ranges(args, {**COMMON_RANGES, "prefill_tp": (1, 1024), "decode_tp": (1, 1024)})  # the rest
    from sglang_kvxfer.transports import available_transports, registered_transports

    for name in args.transport:
        if name not in registered_transports():
            raise ValueError(f"--transport {name!r} is unknown; registered: {', '.join(registered_transports())}")
        if name not in available_transports():
            raise ValueError(
                f"--transport {name!r} cannot be used here: a package it needs is not installed "
                f"(pip install 'sglang_kvxfer[{name}]')"
            )
    for side in ("prefill", "decode"):
        devices = getattr(args, f"{side}_devices")
        need = max(getattr(args, f"{side}_tp"))
        if devices is not None and len(devices) < need:
            raise ValueError(
                f"--{side}-devices lists {len(devices)} device(s) ({','.join(devices)}); "
                f"--{side}-tp {need} needs {need}"
            )
        bad = [d for d in devices or [] if d != "cpu" and not d.startswith("cuda")]
        if bad:
            raise ValueError(f"--{side}-devices: {bad} must be cpu or cuda[:N]")
    return args


def sweep(args: argparse.Namespace) -> tuple[list[Shape], list[tuple], list[str]]:
    """(valid group shapes, points per shape, notes on skipped shapes)."""
    from sglang_kvxfer.geometry import check_compatible

    shapes, notes = [], []
    for t, p, d, h, dim, mla, pps, dps, pl, dl in itertools.product(
        args.transport,
        args.prefill_tp,
        args.decode_tp,
        args.total_kv_heads or [None],
        args.head_dim,
        args.mla,
        args.prefill_page_size or [args.page_size],
        args.decode_page_size or [args.page_size],
        args.prefill_layout or [args.layout],
        args.decode_layout or [args.layout],
    ):
        shape = Shape(t, p, d, h if h is not None else (1 if mla else 8), dim, mla, pps, dps, pl.upper(), dl.upper())
        try:
            gp, gd = geometries(args, shape)
            check_compatible(gp, gd)
            gp.placement(p, 0)
            gd.placement(d, 0)
        except (ValueError, KVXferError) as exc:
            notes.append(f"skipped {shape.label}: {exc}")
            continue
        shapes.append(shape)
    points = list(itertools.product(args.tokens, args.concurrency, args.chunk_tokens))
    return shapes, points, notes


def geometries(args: argparse.Namespace, shape: Shape):
    """Both sides' geometries, pools sized for the largest request times the concurrency."""
    one = argparse.Namespace(
        layers=args.layers,
        total_kv_heads=shape.total_kv_heads,
        head_dim=shape.head_dim,
        v_head_dim=args.v_head_dim,
        dtype=args.dtype,
        mla=shape.mla,
        page_size=args.page_size,
        layout=args.layout,
        num_pages=args.num_pages,
        prefill_page_size=shape.prefill_page_size,
        decode_page_size=shape.decode_page_size,
        prefill_layout=shape.prefill_layout,
        decode_layout=shape.decode_layout,
    )
    max_c = max(args.concurrency)
    return (
        side_geometry(one, "prefill", pool_pages(max(args.tokens), shape.prefill_page_size, max_c)),
        side_geometry(one, "decode", pool_pages(max(args.tokens), shape.decode_page_size, max_c)),
    )


def _baseline_plan(args, shape: Shape, concurrency: int) -> tuple[str, int]:
    """Method and number of parallel plain movers: as many as the engine can have moving
    bytes at once (prefill ranks x busy workers), at most the CPU count."""
    devices = (args.prefill_devices or []) + (args.decode_devices or [])
    method = "d2d" if any(d.startswith("cuda") for d in devices) else ("socket" if shape.transport == "tcp" else "copy")
    workers = min(concurrency, envs.KVXFER_WORKERS.get())
    return method, max(1, min(os.cpu_count() or 1, shape.prefill_tp * workers))


def _median(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return round(statistics.median(values), 4) if values else float("nan")


def run_shape(args, shape: Shape, points: list[tuple], bar, next_seed) -> list[dict]:
    """Start the two groups of ``shape`` (with a bootstrap of their own: a bootstrap keeps
    a prefill group's TP size), run every point on them, return the records."""
    from sglang_kvxfer.engine.bootstrap import BootstrapServer

    key = secrets.token_bytes(32)  # one key per shape's run, handed to its ranks over pipes
    with BootstrapServer(key=key) as boot:
        return _run_points(args, shape, points, boot, bar, next_seed, key)


def _run_points(args, shape: Shape, points: list[tuple], boot, bar, next_seed, key: bytes) -> list[dict]:
    from sglang_kvxfer.cluster.baseline import measure_baseline
    from sglang_kvxfer.cluster.group import make_spec, open_groups
    from sglang_kvxfer.cluster.workload import make_requests, run_workload, summarize

    gp, gd = geometries(args, shape)
    opts = dict(engine_options(args), auth_key=key)
    port = args.metrics_port
    dev_p = (args.prefill_devices or ["cpu"] * shape.prefill_tp)[: shape.prefill_tp]
    dev_d = (args.decode_devices or ["cpu"] * shape.decode_tp)[: shape.decode_tp]
    common = dict(options=opts, concurrency=max(args.concurrency) + 1, log_level=args.log_level)
    pre, dec = open_groups(
        make_spec(
            "prefill", gp, shape.prefill_tp, boot.address, shape.transport, devices=dev_p, metrics_port=port, **common
        ),
        make_spec(
            "decode",
            gd,
            shape.decode_tp,
            boot.address,
            shape.transport,
            devices=dev_d,
            metrics_port=port + shape.prefill_tp if port else 0,
            **common,
        ),
        one_process=args.one_process,
    )
    timeout = args.bootstrap_timeout + args.waiting_timeout + args.transfer_timeout + 30
    verify = not args.no_verify
    records = []
    with pre, dec:
        warm = make_requests(1, [min(args.tokens)], 0, gp.page_size, next_seed(), verify)
        (first,), _ = run_workload(pre, dec, warm, 1, timeout, progress=False)  # registration, page faults
        if not first.ok:
            raise KVXferError(f"{shape.label}: the warm-up request failed: {first.reason}")
        for tokens, concurrency, chunk in points:
            bar.note = f"{shape.transport} P{shape.prefill_tp}->D{shape.decode_tp} {tokens} tok c{concurrency}"
            method, streams = _baseline_plan(args, shape, concurrency)
            runs, engine, base, wall = [], [], [], []
            for _ in range(args.repeats):
                jobs = make_requests(
                    args.requests, [tokens], chunk, gp.page_size, next_seed(), verify, args.chunk_delay_ms / 1e3
                )
                results, seconds = run_workload(pre, dec, jobs, concurrency, timeout, progress=bar)
                runs += results
                s = summarize(results, seconds)
                engine.append(s["transfer_gbps"])
                wall.append(s["gbps"])
                items = [r["record"]["bytes"] for res in results if res.ok for r in res.prefill if r.get("record")]
                if sum(items):
                    base.append(measure_baseline(method, items, streams, timeout, dev_p, dev_d))
            record = _record(
                args,
                shape,
                (tokens, concurrency, chunk),
                summarize(runs, sum(wall)),
                engine,
                wall,
                base,
                method,
                streams,
                dev_p,
                dev_d,
            )
            reads = [
                sum(r["record"].get("pool_read_bytes", 0) for r in res.prefill if r.get("record"))
                for res in runs
                if res.ok
            ]
            record["pool_read_bytes_per_request"] = int(statistics.median(reads)) if reads else 0
            records.append(record)
    return records


def _record(args, shape: Shape, point: tuple, s: dict, engine, wall, base, method, streams, dev_p, dev_d) -> dict:
    tokens, concurrency, chunk = point
    gbps, base_gbps = _median(engine), _median(base)
    ok_requests = s["succeeded_requests"]
    return {
        **asdict(shape),
        "prefill_devices": dev_p,
        "decode_devices": dev_d,
        "layers": args.layers,
        "v_head_dim": args.v_head_dim or (0 if shape.mla else shape.head_dim),
        "dtype": args.dtype,
        "tokens": tokens,
        "concurrency": concurrency,
        "chunk_tokens": chunk,
        "requests": args.requests,
        "repeats": args.repeats,
        "verify": not args.no_verify,
        "succeeded_requests": ok_requests,
        "verified_requests": s["verified_requests"],
        "failed_requests": s["failed_requests"],
        "bytes": s["bytes"],
        "bytes_per_request": s["bytes"] // ok_requests if ok_requests else 0,
        "gbps": gbps,
        "gbps_repeats": engine,
        "wall_gbps": _median(wall),
        "request_gbps_p50": s["request_gbps_p50"],
        "baseline": {
            "method": method,
            "streams": streams,
            "gbps": base_gbps,
            "gbps_repeats": [round(b, 4) for b in base],
        },
        "ratio": round(gbps / base_gbps, 4) if base_gbps and base_gbps == base_gbps else float("nan"),
        "ops_per_request": s["ops_per_request"]["median"],
        "descriptors_per_s": s["descriptors_per_s"],
        "latency_ms": {"p50": s["p50_ms"], "p90": s["p90_ms"], "p99": s["p99_ms"]},
        "p99_over_p50": round(s["p99_ms"] / s["p50_ms"], 3) if s["p50_ms"] and s["p50_ms"] == s["p50_ms"] else None,
        "tail_ms": s["tail_ms"],
        "phases_ms": s["phases_ms"],
        "data_path": s["data_path"],
        "failures": s["failures"],
    }


DEFINITIONS = {
    "gbps": "KV bytes received by the decode ranks / busy time (time while at least one request's transfer window "
    "was open), median over repeats; decimal GB",
    "wall_gbps": "bytes / wall time of a repeat, including filling and verifying the bytes",
    "transfer window": "first byte ready on the prefill (first chunk handed over and destinations known) -> "
    "last TransferDone processed on the decode (every byte scattered)",
    "latency_ms": "transfer window per request, percentiles over every request of every repeat",
    "tail_ms": "last chunk ready -> last notice: what the transfer adds after the prefill's last chunk",
    "phases_ms": "busy time per phase per request (largest among its ranks); phases overlap",
    "ops_per_request": "transport descriptors (writes; a fused pool -> pool copy counts one) per request, all ranks",
    "p99_over_p50": "latency_ms p99 / p50: the tail against the typical request",
    "pool_read_bytes_per_request": "bytes read from the prefill ranks' KV pools per request (median): below bytes "
    "where staged readers of a replicated head share one gather (fan-out); a fused or direct reader reads its own",
    "descriptors_per_s": "descriptors / busy time",
    "baseline": "the same bytes, in the same pieces, moved by plain movers in the same run: copy (numpy copyto), "
    "socket (loopback TCP sendall/recv_into) or d2d (torch copy between devices); streams = prefill "
    "ranks x busy workers, at most the CPU count",
    "ratio": "gbps / baseline gbps",
}


def run_bench(args: argparse.Namespace) -> dict:
    from sglang_kvxfer.cli.progress import Progress

    t0 = time.monotonic()
    _resolve(args)
    shapes, points, notes = sweep(args)
    if not shapes:
        raise ValueError("no valid configuration to run: " + "; ".join(notes))
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    for note in notes:
        say(f"kvxfer bench: {note}")
    bar = Progress(len(shapes) * len(points) * args.repeats * args.requests, not args.quiet)
    seeds = itertools.count(args.seed * 1_000_003 + 1)
    records = []
    for shape in shapes:
        bar.note = f"starting {shape.label}"
        records += run_shape(args, shape, points, bar, lambda: next(seeds))
    out = json_safe(
        {
            "benchmark": "kvxfer bench",
            "argv": sys.argv[1:],
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "processor": platform.processor() or platform.machine(),
            },
            "definitions": DEFINITIONS,
            "records": records,
            "skipped": notes,
            "elapsed_s": round(time.monotonic() - t0, 1),
        }
    )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(out, f, indent=1, allow_nan=False)
    if args.plot:
        from sglang_kvxfer.cluster.plot import plot_records

        title = (
            f"kvxfer bench{' --quick' if args.quick else ''} ({os.cpu_count()} CPUs, "
            f"{'unverified' if args.no_verify else 'verified'})"
        )
        plot_records(records, args.plot, title=title)
    return out


def json_safe(obj):
    """``obj`` with every NaN/inf float replaced by None (strict JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def render(out: dict) -> str:
    head = "transport  P->D  tokens  conc  GB/s    base GB/s  ratio  p50 ms   p99 ms   tail p50  ops/req  desc/s    ok"
    lines = [head, "-" * len(head)]
    for r in out["records"]:
        lines.append(
            f"{r['transport']:<9}  {r['prefill_tp']}->{r['decode_tp']:<2} {r['tokens']:>6}  {r['concurrency']:>4}  "
            f"{r['gbps']:<6.3f}  {r['baseline']['gbps']:<9.3f}  {r['ratio']:<5.3f}  {r['latency_ms']['p50']:<7.1f}  "
            f"{r['latency_ms']['p99']:<7.1f}  {r['tail_ms']['p50']:<8.1f}  {r['ops_per_request']:<7}  "
            f"{r['descriptors_per_s']:<8.0f}  {r['verified_requests'] if r['verify'] else r['succeeded_requests']}"
            f"/{r['requests'] * r['repeats']}"
        )
    lines += [f"note: {n}" for n in out["skipped"]]
    lines += [f"FAILED {f}" for r in out["records"] for f in r["failures"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    out = run_bench(args)
    print(json.dumps(out, allow_nan=False) if args.json else render(out))
    want = lambda r: r["requests"] * r["repeats"]  # noqa: E731
    good = all(
        r["succeeded_requests"] == want(r) and (not r["verify"] or r["verified_requests"] == want(r))
        for r in out["records"]
    )
    return 0 if good else 1
