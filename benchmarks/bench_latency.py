"""Latency distribution of whole transfers (p50/p99/max of the transfer window) against
same-run baselines; prints one JSON object.

For every transport and prefill:decode TP pair given, one prefill group and one decode
group of rank processes (the ``kvxfer bench`` machinery, ``cluster/``) run ``--requests``
requests per round, ``--concurrency`` in flight, after ``--warmup`` requests at the same
concurrency (registration, first staging windows, connections). Rounds are interleaved
over the cases, so a burst of load on a shared machine hits every case alike. A request's
latency is its transfer window (``metrics.py``: first byte ready on the prefill -> last
notice processed on the decode). Per case: p50/p90/p99/max per round and their medians
over rounds, the p50 phases, the data path.

Baselines measured in the same run:

* ``direct``: the 1:1 pair of the same transport (the direct path where the bytes are
  contiguous), run as a case of its own: ``ratio_p50_vs_direct`` divides by its p50.
* ``control_rtt``: one authenticated control frame to another process and back over ZMQ
  (what the control channel uses), the floor of any request's notices:
  ``ratio_p50_vs_rtt`` divides by its p50.
* ``--data-paths`` (default ``auto``): with several, e.g. ``auto,staged,direct``, every
  transport and pair runs once per data path (``EngineConfig.data_path`` of its ranks), in
  the same interleaved rounds; ``ratio_p50_vs_paths`` divides a case's p50 by the p50 of
  the same transport and pair on each other path (the fused path against the staged and
  direct ones it replaces, measured side by side).

Presets (explicit flags win):

* ``--preset small`` (default): 16 tokens, 1 layer, local and tcp, pairs 1:1 and 2:1,
  200 requests one at a time, 3 rounds.
* ``--preset large``: 2,048 tokens, 32 layers (256 MiB a request: 8 KV heads x 128, bf16),
  local, pairs 1:1 and 2:1, 2 in flight, 20 requests, 3 rounds.

    python benchmarks/bench_latency.py                      # small requests
    python benchmarks/bench_latency.py --preset large       # 256 MiB requests, 2 in flight
    python benchmarks/bench_latency.py --preset large --data-paths auto,staged,direct
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import secrets
import statistics
import sys
import time

PRESETS = {
    "small": dict(
        transport="local,tcp", pairs="1:1,2:1", tokens=16, layers=1, concurrency=1, requests=200, rounds=3, warmup=20
    ),
    "large": dict(
        transport="local", pairs="1:1,2:1", tokens=2048, layers=32, concurrency=2, requests=20, rounds=3, warmup=6
    ),
}
PAGE_SIZE = 16
RTT_FRAMES = 2000


def _echo(endpoint_conn, key: bytes) -> None:
    """Child process: answer each control frame with one of its own (authenticated)."""
    import zmq

    from sglang_kvxfer.protocol import codec, envelope
    from sglang_kvxfer.protocol.messages import ChunkAck

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    port = inbox.bind_to_random_port("tcp://127.0.0.1")
    mine = f"tcp://127.0.0.1:{port}"
    endpoint_conn.send(mine)
    theirs = endpoint_conn.recv()
    out = ctx.socket(zmq.PUSH)
    out.connect(theirs)
    for seq in range(1, RTT_FRAMES + 2):
        frame = inbox.recv()
        envelope.open_frame(key, frame, mine)
        reply = codec.encode(ChunkAck(room=seq, tp_rank=0, staging_offset=0))
        out.send(envelope.seal(key, "echo", seq, reply, theirs))
    out.close(0)
    inbox.close(0)
    ctx.term()


def control_rtt_ms(key: bytes) -> list[float]:
    """Round trips of one authenticated control frame to a second process and back."""
    import zmq

    from sglang_kvxfer.protocol import codec, envelope
    from sglang_kvxfer.protocol.messages import ChunkAck

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    port = inbox.bind_to_random_port("tcp://127.0.0.1")
    mine = f"tcp://127.0.0.1:{port}"
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    proc = spawn.Process(target=_echo, args=(child, key), daemon=True)
    proc.start()
    theirs = parent.recv()
    parent.send(mine)
    out = ctx.socket(zmq.PUSH)
    out.connect(theirs)
    times = []
    try:
        for seq in range(1, RTT_FRAMES + 2):
            t0 = time.perf_counter()
            payload = codec.encode(ChunkAck(room=seq, tp_rank=0, staging_offset=0))
            out.send(envelope.seal(key, "bench", seq, payload, theirs))
            frame = inbox.recv()
            codec.decode(envelope.open_frame(key, frame, mine)[2])
            if seq > 1:  # the first one connects
                times.append((time.perf_counter() - t0) * 1e3)
    finally:
        out.close(0)
        inbox.close(0)
        ctx.term()
        proc.join(10)
    return times


def _proc_counters(pids: list[int]) -> tuple[float, int]:
    """(CPU seconds, context switches) used so far by the processes ``pids``, all threads."""
    tick = os.sysconf("SC_CLK_TCK")
    cpu, switches = 0.0, 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/status") as f:
                    for line in f:
                        if "ctxt_switches:" in line:  # voluntary and nonvoluntary
                            switches += int(line.split()[-1])
        except OSError:  # a rank restarted or a thread ended meanwhile
            continue
    return cpu, switches


def _pct(values: list[float], q: float) -> float:
    import numpy as np

    return round(float(np.percentile(np.asarray(values), q)), 3) if values else float("nan")


def _dist(ms: list[float]) -> dict:
    return {"p50": _pct(ms, 50), "p90": _pct(ms, 90), "p99": _pct(ms, 99), "max": round(max(ms), 3) if ms else None}


class Case:
    """One transport and TP pair: its two rank groups and the rounds measured on them."""

    def __init__(self, args, transport: str, p: int, d: int, key: bytes, boot, path: str = "auto"):
        from sglang_kvxfer.cluster.group import make_spec, open_groups
        from sglang_kvxfer.geometry import KVGeometry

        self.transport, self.p, self.d, self.args, self.path = transport, p, d, args, path
        pages = -(-args.tokens // PAGE_SIZE) * (args.concurrency + 1) + 8
        g = KVGeometry(
            num_layers=args.layers,
            total_kv_heads=8,
            head_dim=128,
            dtype="bf16",
            page_size=PAGE_SIZE,
            num_pages=pages,
        )
        options = {"auth_key": key, "data_path": path}
        common = dict(options=options, concurrency=args.concurrency + 1, log_level="ERROR")
        self.pre, self.dec = open_groups(
            make_spec("prefill", g, p, boot.address, transport, **common),
            make_spec("decode", g, d, boot.address, transport, **common),
        )
        self.rounds: list[dict] = []
        self.paths: dict[str, int] = {}
        self.phases: dict[str, list[float]] = {}
        self.failures: list[str] = []

    @property
    def label(self) -> str:
        return f"{self.transport} P{self.p}->D{self.d} {self.path}"

    def run(self, n: int, seed: int, keep: bool = True) -> None:
        from sglang_kvxfer.cluster.workload import make_requests, run_workload

        jobs = make_requests(n, [self.args.tokens], 0, PAGE_SIZE, seed, verify=False)
        pids = self.pre.pids + self.dec.pids
        cpu0, sw0 = _proc_counters(pids)
        results, _ = run_workload(self.pre, self.dec, jobs, self.args.concurrency, 120, progress=False)
        cpu1, sw1 = _proc_counters(pids)
        if not keep:
            return
        ok = [r for r in results if r.ok and r.transfer_s == r.transfer_s]
        self.failures += [f"room {r.room}: {r.reason}" for r in results if not r.ok][:5]
        ms = [r.transfer_s * 1e3 for r in ok]
        self.rounds.append(
            {
                **_dist(ms),
                "ok": len(ok),
                "requests": n,
                "rank_cpu_ms_per_request": round((cpu1 - cpu0) * 1e3 / n, 3),
                "rank_ctx_switches_per_request": round((sw1 - sw0) / n, 1),
            }
        )
        for r in ok:
            for k, v in r.paths.items():
                self.paths[k] = self.paths.get(k, 0) + v
            for k, v in r.phases.items():
                self.phases.setdefault(k, []).append(v * 1e3)

    def close(self) -> None:
        for group in (self.pre, self.dec):
            group.close()

    def record(self, direct_p50: float | None, rtt_p50: float, others: dict[str, float] | None = None) -> dict:
        med = lambda key: round(statistics.median(r[key] for r in self.rounds), 3)  # noqa: E731
        p50, p99 = med("p50"), med("p99")
        return {
            "transport": self.transport,
            "prefill_tp": self.p,
            "decode_tp": self.d,
            "tokens": self.args.tokens,
            "layers": self.args.layers,
            "request_bytes": self.args.layers * 2 * self.args.tokens * 8 * 128 * 2,
            "concurrency": self.args.concurrency,
            "forced_path": self.path,
            "data_path": self.paths,
            "p50_ms": p50,
            "p99_ms": p99,
            "max_ms": max(r["max"] for r in self.rounds if r["max"] is not None),
            "p99_over_p50": round(p99 / p50, 3) if p50 else None,
            "rank_cpu_ms_per_request": med("rank_cpu_ms_per_request"),
            "rank_ctx_switches_per_request": med("rank_ctx_switches_per_request"),
            "ratio_p50_vs_direct": round(p50 / direct_p50, 3) if direct_p50 else None,
            "ratio_p50_vs_rtt": round(p50 / rtt_p50, 3) if rtt_p50 else None,
            "ratio_p50_vs_paths": {k: round(p50 / v, 3) for k, v in (others or {}).items() if v and k != self.path},
            "phases_p50_ms": {k: _pct(v, 50) for k, v in sorted(self.phases.items())},
            "rounds": self.rounds,
            "failures": self.failures[:5],
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--transport", default=None, help="comma list of transports")
    ap.add_argument("--pairs", default=None, help="comma list of PREFILL_TP:DECODE_TP pairs, e.g. 1:1,2:1")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=None, help="requests in flight")
    ap.add_argument("--requests", type=int, default=None, help="requests per round and case")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None, help="requests before the first round, per case")
    ap.add_argument("--data-paths", default="auto", help="comma list of data paths, each a case per transport and pair")
    ap.add_argument("--output", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    for name, value in PRESETS[args.preset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("tokens", "layers", "concurrency", "requests", "rounds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1")
    pairs = []
    for item in args.pairs.split(","):
        p, _, d = item.partition(":")
        pairs.append((int(p), int(d)))
    transports = [t for t in args.transport.split(",") if t]
    paths = [p for p in args.data_paths.split(",") if p]
    bad = [p for p in paths if p not in ("auto", "direct", "staged", "fused", "per_token")]
    if bad or not paths:
        raise SystemExit(f"--data-paths: {bad or paths} must be among auto, direct, staged, fused, per_token")

    from sglang_kvxfer.engine.bootstrap import BootstrapServer

    t_start = time.monotonic()
    key = secrets.token_bytes(32)
    say = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    cases: list[Case] = []
    rtt: list[list[float]] = []
    boots: list[BootstrapServer] = []
    try:
        for t in transports:
            for p, d in pairs:
                for path in paths:
                    boots.append(BootstrapServer(key=key))  # a bootstrap keeps one prefill group's TP size
                    say(f"starting {t} P{p}->D{d} {path} ...")
                    case = Case(args, t, p, d, key, boots[-1], path)
                    cases.append(case)
                if args.warmup > 0:
                    case.run(args.warmup, seed=10_000 + len(cases), keep=False)
        for r in range(args.rounds):
            rtt.append(control_rtt_ms(key))
            for i, case in enumerate(cases):
                case.run(args.requests, seed=r * 100 + i)
                last = case.rounds[-1]
                say(f"round {r + 1}/{args.rounds} {case.label}: p50 {last['p50']} ms, p99 {last['p99']} ms")
    finally:
        for case in cases:
            case.close()
        for boot in boots:
            boot.close()
    rtt_p50 = statistics.median(_pct(x, 50) for x in rtt)
    p50 = {(c.transport, c.p, c.d, c.path): c.record(None, rtt_p50)["p50_ms"] for c in cases}
    direct = {t: v for (t, p, d, path), v in p50.items() if (p, d) == (1, 1) and path == paths[0]}

    def others(c: Case) -> dict[str, float]:
        return {path: v for (t, p, d, path), v in p50.items() if (t, p, d) == (c.transport, c.p, c.d)}

    out = {
        "benchmark": "latency",
        "argv": sys.argv[1:] if argv is None else argv,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
        },
        "definitions": {
            "latency": "transfer window per request: first byte ready on the prefill -> last notice processed "
            "on the decode (metrics.py); p50/p90/p99/max per round, *_ms fields are medians over rounds",
            "control_rtt": "one authenticated control frame (encode, seal, ZMQ PUSH over loopback TCP, open, "
            "decode) to a second process and one back; p50/p99 per round",
            "ratio_p50_vs_direct": "p50 / p50 of the 1:1 pair on the same transport (same run; its first data path)",
            "ratio_p50_vs_paths": "p50 / p50 of the same transport and pair on each other --data-paths entry "
            "(same run)",
            "ratio_p50_vs_rtt": "p50 / control_rtt p50 (same run)",
            "rank_cpu_ms_per_request": "CPU time (user + system) of the case's rank processes during a round, per "
            "request: the work a request costs, steadier than latency on a shared machine",
            "rank_ctx_switches_per_request": "context switches of every thread of those processes per request "
            "(wake-ups: thread hand-overs, sleeps, polls)",
        },
        "config": {
            k: getattr(args, k)
            for k in ("preset", "tokens", "layers", "concurrency", "requests", "rounds", "data_paths")
        },
        "baseline": {
            "control_rtt_ms": {
                "p50": rtt_p50,
                "p99": statistics.median(_pct(x, 99) for x in rtt),
                "rounds": [_dist(x) for x in rtt],
            },
        },
        "cases": [c.record(direct.get(c.transport), rtt_p50, others(c)) for c in cases],
        "elapsed_s": round(time.monotonic() - t_start, 1),
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    return 0 if all(not c.failures for c in cases) else 1


if __name__ == "__main__":  # rank processes are spawned: they must not re-run this
    sys.exit(main())
