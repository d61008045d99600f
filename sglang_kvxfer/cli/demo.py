"""``kvxfer demo``: the main job on the built-in defaults.

Starts a bootstrap, a prefill TP group and a decode TP group of rank processes on this host
(defaults: prefill TP 2 -> decode TP 1, CPU pools, the ``local`` transport), runs a stream
of requests of mixed lengths with chunked sends, verifies every byte on the decode side,
prints a summary and exits 0 only if every request verified. Every numeric flag is
range-checked first; SIGTERM stops the rank processes like Ctrl-C does.
"""

from __future__ import annotations

import argparse
import json
import secrets
import signal
import sys

from sglang_kvxfer.cli.common import (
    COMMON_RANGES,
    add_deadline_args,
    add_model_args,
    add_side_args,
    check_pool_fits,
    check_ranges,
    engine_options,
    parse_tokens,
    pool_pages,
    side_geometry,
    summary_shape,
)
from sglang_kvxfer.cli.progress import Progress
from sglang_kvxfer.cluster.workload import make_requests, run_workload, summarize
from sglang_kvxfer.geometry import check_compatible


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-tp", type=int, default=2, help="prefill TP size (default 2)")
    p.add_argument("--decode-tp", type=int, default=1, help="decode TP size (default 1)")
    p.add_argument("--transport", default="local", help="local (default), tcp, nixl or mori")
    p.add_argument("--requests", type=int, default=16, help="requests to run (default 16)")
    p.add_argument("--tokens", default="256,2048,512,1024", help="request lengths, cycled (default 256,2048,512,1024)")
    p.add_argument(
        "--chunk-tokens", type=int, default=512, help="prefill chunk size in tokens (default 512; 0: one chunk)"
    )
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight (default 2)")
    p.add_argument(
        "--chunk-delay-ms",
        type=float,
        default=0.0,
        help="pause before each chunk after the first, standing in for prefill compute (default 0)",
    )
    p.add_argument("--no-verify", action="store_true", help="skip filling and checking the bytes (speed runs)")
    p.add_argument("--seed", type=int, default=0, help="seed of room ids and page allocation")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--log-level", default="WARNING", help="log level of the rank processes")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus metrics: prefill rank r on PORT+r, decode rank r on PORT+prefill_tp+r "
        "(default 0: off; needs prometheus_client)",
    )
    add_model_args(p)
    add_side_args(p, both=True)
    add_deadline_args(p)


def run_demo(args: argparse.Namespace) -> dict:
    from sglang_kvxfer.cluster.group import make_spec, open_groups
    from sglang_kvxfer.engine.bootstrap import BootstrapServer

    check_ranges(args, {**COMMON_RANGES, "prefill_tp": (1, 1024), "decode_tp": (1, 1024)})
    tokens = parse_tokens(args.tokens)
    gp, gd = (
        side_geometry(
            args, side, pool_pages(max(tokens), getattr(args, f"{side}_page_size") or args.page_size, args.concurrency)
        )
        for side in ("prefill", "decode")
    )
    check_pool_fits(max(tokens), gp, "prefill")
    check_pool_fits(max(tokens), gd, "decode")

    check_compatible(gp, gd)
    gp.placement(args.prefill_tp, 0)
    gd.placement(args.decode_tp, 0)
    jobs = make_requests(
        args.requests, tokens, args.chunk_tokens, gp.page_size, args.seed, not args.no_verify, args.chunk_delay_ms / 1e3
    )
    # One key per run, handed to the rank processes over their pipes (never argv or env).
    opts = dict(engine_options(args), auth_key=secrets.token_bytes(32))
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    with BootstrapServer(key=opts["auth_key"]) as boot:
        say(
            f"kvxfer demo: bootstrap at {boot.address}; starting {args.prefill_tp} prefill + "
            f"{args.decode_tp} decode rank process(es), transport {args.transport}"
        )
        ports = (args.metrics_port, args.metrics_port + args.prefill_tp) if args.metrics_port else (0, 0)
        spec_p = make_spec(
            "prefill",
            gp,
            args.prefill_tp,
            boot.address,
            args.transport,
            options=opts,
            concurrency=args.concurrency + 1,
            log_level=args.log_level,
            metrics_port=ports[0],
        )
        spec_d = make_spec(
            "decode",
            gd,
            args.decode_tp,
            boot.address,
            args.transport,
            options=opts,
            concurrency=args.concurrency + 1,
            log_level=args.log_level,
            metrics_port=ports[1],
        )
        pre, dec = open_groups(spec_p, spec_d)
        with pre, dec:
            if args.metrics_port:
                say(
                    "kvxfer demo: metrics at "
                    + ", ".join(f"http://127.0.0.1:{p}/metrics" for p in pre.metrics_ports + dec.metrics_ports)
                )
            say(
                f"kvxfer demo: {len(jobs)} requests of {','.join(map(str, tokens))} tokens, "
                f"{args.chunk_tokens or 'one'}-token chunks, {args.concurrency} in flight"
            )
            timeout = args.bootstrap_timeout + args.waiting_timeout + args.transfer_timeout + 30
            results, wall = run_workload(
                pre, dec, jobs, args.concurrency, timeout, progress=Progress(len(jobs), not args.quiet)
            )
    return summarize(
        results,
        wall,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        transport=args.transport,
        **summary_shape(gp, gd),
        verify=not args.no_verify,
    )


def render(s: dict) -> str:
    lines = [
        f"prefill TP {s['prefill_tp']} -> decode TP {s['decode_tp']} over {s['transport']}: "
        f"{s['total_kv_heads']} KV heads x {s['head_dim']} ({s['dtype']}), {s['layers']} layers, "
        f"pages {s['prefill_page_size']}/{s['decode_page_size']}, layout {s['prefill_layout']}/{s['decode_layout']}"
        + (", MLA" if s["mla"] else ""),
        f"requests: {s['requests']}  succeeded: {s['succeeded_requests']}  verified: {s['verified_requests']}"
        + ("" if s["verify"] else " (verification off)"),
        f"bytes: {s['bytes'] / 1e6:.1f} MB in {s['wall_s']:.2f} s = {s['gbps']:.2f} GB/s",
        f"transfer latency per request: p50 {s['p50_ms']:.1f} ms, p90 {s['p90_ms']:.1f} ms, p99 {s['p99_ms']:.1f} ms",
        f"ops per request (bulk moves into a reader): {s['ops_per_request']} by tokens: "
        + ", ".join(f"{t}->{o}" for t, o in s["ops_by_tokens"]),
        f"data path (writer->reader pairs): {s['data_path']}",
    ]
    lines += [f"FAILED {f}" for f in s["failures"]]
    return "\n".join(lines)


def _interrupt(*_) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second one must not cut the unwinding short
    raise KeyboardInterrupt  # unwinds through the groups' close(): no rank outlives the demo


def run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    summary = run_demo(args)
    print(json.dumps(summary) if args.json else render(summary))
    want = summary["requests"] if summary["verify"] else 0
    good = summary["succeeded_requests"] == summary["requests"] and summary["verified_requests"] >= want
    return 0 if good else 1
