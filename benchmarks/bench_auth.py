"""What authentication costs: the same engine runs with a key and with ``KVXFER_AUTH=off``.

Measured in one run, rounds interleaved (on, off, on, off, ...) so drift hits both alike:

* ``throughput``: ``bench_e2e.py``'s workload (``tcp``, prefill TP 2 -> decode TP 1, 8 KV
  heads x 128, bf16, 32 layers, 2,048-token requests), GB/s per round.
* ``small``: the control cost alone: 16-token, 1-layer requests, prefill TP 2 -> decode TP 1
  (staged) over ``tcp``, p50 of the per-request transfer latency.
* ``frame_us``: sealing and opening one typical control frame (``RequestMeta`` of 128
  pages) in this process, microseconds each, against encoding/decoding it alone.

Prints one JSON object with medians and the ratios ``on / off``.

    python benchmarks/bench_auth.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import timeit


def engine_round(layers: int, tokens: int, requests: int, concurrency: int, auth_on: bool) -> dict:
    from sglang_kvxfer.cluster.group import make_spec, open_groups
    from sglang_kvxfer.cluster.workload import make_requests, run_workload, summarize
    from sglang_kvxfer.engine import BootstrapServer
    from sglang_kvxfer.geometry import KVGeometry

    os.environ["KVXFER_AUTH"] = "on" if auth_on else "off"  # inherited by the rank processes
    pages = -(-tokens // 16) * (concurrency + 2)
    g = KVGeometry(num_layers=layers, total_kv_heads=8, head_dim=128, dtype="bf16", page_size=16, num_pages=pages)
    with BootstrapServer() as boot:
        spec_p = make_spec("prefill", g, 2, boot.address, "tcp", concurrency=concurrency + 1)
        spec_d = make_spec("decode", g, 1, boot.address, "tcp", concurrency=concurrency + 1)
        pre, dec = open_groups(spec_p, spec_d)
        with pre, dec:
            warm = make_requests(2, [tokens], 0, 16, seed=None, verify=True)
            results, _ = run_workload(pre, dec, warm, concurrency, 300, progress=False)
            check = summarize(results, 1.0)
            if check["verified_requests"] != len(warm):
                raise SystemExit(f"bytes not verified with auth {'on' if auth_on else 'off'}: {check['failures']}")
            jobs = make_requests(requests, [tokens], 0, 16, seed=None, verify=False)
            results, wall = run_workload(pre, dec, jobs, concurrency, 600, progress=False)
    return summarize(results, wall)


def frame_costs(n: int = 20000) -> dict:
    import numpy as np

    from sglang_kvxfer.protocol import codec, envelope
    from sglang_kvxfer.protocol.messages import RequestMeta

    msg = RequestMeta(
        room=1,
        session="0123456789abcdef",
        tp_rank=0,
        tp_size=1,
        num_tokens=2048,
        dst_page_ids=np.arange(128, dtype=np.int32),
        aux_slot=-1,
        elected=True,
        staging_offset=0,
        staging_capacity_bytes=1 << 20,
        staging_region=b"\x00" * 64,
    )
    key = secrets.token_bytes(32)
    payload = codec.encode(msg)
    frame = envelope.seal(key, msg.session, 1, payload, "tcp://127.0.0.1:5555")
    us = lambda stmt: min(timeit.repeat(stmt, number=n, repeat=5)) / n * 1e6  # noqa: E731
    return {
        "codec_roundtrip_us": round(us(lambda: codec.decode(codec.encode(msg))), 2),
        "seal_us": round(us(lambda: envelope.seal(key, msg.session, 1, payload, "tcp://127.0.0.1:5555")), 2),
        "open_us": round(us(lambda: envelope.open_frame(key, frame, "tcp://127.0.0.1:5555")), 2),
        "frame_bytes": len(frame),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds per mode (interleaved)")
    ap.add_argument("--requests", type=int, default=8, help="requests per throughput round")
    ap.add_argument("--small-requests", type=int, default=100, help="requests per small-request round")
    args = ap.parse_args()
    os.environ["KVXFER_AUTH_KEY"] = secrets.token_hex(32)  # one key for this run
    big = {True: [], False: []}
    small = {True: [], False: []}
    for r in range(args.rounds):
        for on in (True, False):
            big[on].append(engine_round(32, 2048, args.requests, 2, on))
            small[on].append(engine_round(1, 16, args.small_requests, 1, on))
            print(
                f"  round {r + 1}/{args.rounds} auth {'on ' if on else 'off'}: {big[on][-1]['gbps']:.2f} GB/s, "
                f"small p50 {small[on][-1]['p50_ms']:.3f} ms",
                file=sys.stderr,
                flush=True,
            )
    os.environ.pop("KVXFER_AUTH", None)

    med = lambda xs: round(statistics.median(xs), 4)  # noqa: E731
    gb = {on: med([x["gbps"] for x in big[on]]) for on in (True, False)}
    p50 = {on: med([x["p50_ms"] for x in small[on]]) for on in (True, False)}
    print(
        json.dumps(
            {
                "benchmark": "auth",
                "config": {
                    "transport": "tcp",
                    "prefill_tp": 2,
                    "decode_tp": 1,
                    "rounds": args.rounds,
                    "throughput": {"layers": 32, "tokens": 2048, "requests": args.requests},
                    "small": {"layers": 1, "tokens": 16, "requests": args.small_requests},
                },
                "throughput_gbps": {
                    "on": gb[True],
                    "off": gb[False],
                    "on_rounds": [x["gbps"] for x in big[True]],
                    "off_rounds": [x["gbps"] for x in big[False]],
                },
                "throughput_ratio_on_vs_off": round(gb[True] / gb[False], 3),
                "small_p50_ms": {
                    "on": p50[True],
                    "off": p50[False],
                    "on_rounds": [x["p50_ms"] for x in small[True]],
                    "off_rounds": [x["p50_ms"] for x in small[False]],
                },
                "small_p50_added_ms": round(p50[True] - p50[False], 4),
                "frame": frame_costs(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
