"""Request streams for the demo, the client and the benchmarks, and their summaries.

Owns ``make_requests`` (rooms, mixed lengths, chunk sizes), ``run_workload`` (keeps up to
``concurrency`` requests in flight on a prefill side and a decode side, with a deadline
per request, reporting each finished request to an optional ``progress`` object) and
``summarize`` (bytes, GB/s, latency percentiles of the transfer window and of each phase,
ops per request, data paths). The two sides are anything with ``submit(job) -> Future`` of
per-rank results: a ``RankGroup`` or a remote server client. Must not parse command-line
arguments or print: the progress line and the summary's rendering belong to ``cli/``.

A request's transfer time is the longest window among its decode ranks' records
(``metrics.py``: first byte ready on the prefill -> last notice processed), each measured
on that decode rank's own clock, so it is right across hosts too. Busy time and
``transfer_gbps`` use the union of the requests' windows, which assumes the decode ranks
share a clock (one host: the demo and the benchmark).
"""

from __future__ import annotations

import secrets
import statistics
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import numpy as np

from sglang_kvxfer.metrics import PHASES, RequestRecord

__all__ = ["make_requests", "run_workload", "summarize", "RequestResult"]


def make_requests(
    n: int,
    tokens: list[int],
    chunk_tokens: int,
    page_size: int,
    seed: int | None = 0,
    verify: bool = True,
    chunk_delay_s: float = 0.0,
) -> list[dict]:
    """``n`` jobs cycling through ``tokens``; chunks rounded down to whole prefill pages.

    Room ids come from ``seed``; with ``seed=None`` they are random 63-bit numbers (a
    client talking to long-running servers: two runs must never share a room)."""
    if n < 1:
        raise ValueError(f"--requests={n} must be >= 1")
    if chunk_tokens < 0:
        raise ValueError(f"--chunk-tokens={chunk_tokens} must be >= 0")
    chunk = max(page_size, (chunk_tokens // page_size) * page_size) if chunk_tokens else 0
    rooms: list[int] | np.ndarray
    if seed is None:
        rooms = list({secrets.randbits(63) or 1 for _ in range(n)})
        while len(rooms) < n:
            rooms = list({*rooms, secrets.randbits(63) or 1})
    else:
        rooms = np.random.default_rng(seed).choice(2**62, size=n, replace=False) + 1
    return [
        {
            "room": int(rooms[i]),
            "tokens": tokens[i % len(tokens)],
            "chunk_tokens": chunk,
            "aux": int(rooms[i] % 50000).to_bytes(4, "little"),
            "verify": verify,
            "chunk_delay_s": chunk_delay_s,
        }
        for i in range(n)
    ]


@dataclass
class RequestResult:
    room: int
    tokens: int
    ok: bool
    verified: bool
    reason: str
    bytes: int
    ops: int
    paths: dict
    transfer_s: float
    e2e_s: float
    prefill: list = field(repr=False, default_factory=list)
    decode: list = field(repr=False, default_factory=list)
    tail_s: float = float("nan")
    window: tuple = (float("nan"), float("nan"))  # (start, end) on the decode ranks' clock
    phases: dict = field(default_factory=dict)  # phase -> seconds, the largest among the ranks


def _records(results: list[dict]) -> list[RequestRecord]:
    return [RequestRecord.from_dict(r["record"]) for r in results if r.get("record")]


def _combine(job: dict, pre: list[dict], dec: list[dict], e2e: float) -> RequestResult:
    reasons = [
        f"{side} rank {r.get('rank')}: {r.get('reason')}"
        for side, rs in (("prefill", pre), ("decode", dec))
        for r in rs
        if not r.get("ok")
    ]
    problems = [p for r in dec for p in r.get("problems", [])]
    ok = not reasons
    nan = float("nan")
    pre_rec, dec_rec = _records(pre), _records(dec)
    timed = [r for r in dec_rec if r.transfer_s is not None]
    complete = ok and bool(timed) and len(timed) == len(dec)
    # A record in ``timed`` has first_byte_ready and last_notice (that is what transfer_s needs).
    transfers = [t for r in timed if (t := r.transfer_s) is not None]
    starts = [t for r in timed if (t := r.first_byte_ready) is not None]
    ends = [t for r in timed if (t := r.last_notice) is not None]
    transfer = max(transfers) if complete else nan
    tails = [t for r in timed if (t := r.tail_s) is not None]
    window = (min(starts), max(ends)) if complete else (nan, nan)
    phases = {p: max([r.phases.get(p, 0.0) for r in (dec_rec if p == "scatter" else pre_rec)] or [0.0]) for p in PHASES}
    paths: dict[str, int] = {}
    for r in pre:
        for k, v in (r.get("paths") or {}).items():
            paths[k] = paths.get(k, 0) + v
    return RequestResult(
        room=job["room"],
        tokens=job["tokens"],
        ok=ok,
        verified=ok and job["verify"] and all(r.get("verified") for r in dec),
        reason="; ".join(reasons + problems)[:2000],
        bytes=sum(r.get("bytes", 0) for r in dec),
        ops=sum(r.get("ops", 0) for r in pre),
        paths=paths,
        transfer_s=transfer,
        e2e_s=e2e,
        prefill=pre,
        decode=dec,
        tail_s=max(tails) if complete and tails else nan,
        window=window,
        phases=phases,
    )


def run_workload(
    prefill, decode, jobs: list[dict], concurrency: int, timeout_s: float, progress=None
) -> tuple[list[RequestResult], float]:
    """Run ``jobs`` with up to ``concurrency`` in flight; returns results (job order) and wall s.

    ``progress``: None (or False), or anything with ``update(RequestResult)``, called once
    per finished request under a lock (the commands pass ``cli.progress.Progress``).
    """
    if concurrency < 1:
        raise ValueError(f"--concurrency={concurrency} must be >= 1")
    if progress is True or (progress and not callable(getattr(progress, "update", None))):
        raise TypeError(f"progress={progress!r} must be None, False or an object with update(result)")
    results: list[RequestResult | None] = [None] * len(jobs)
    slots = threading.Semaphore(concurrency)
    bar = progress or None
    lock = threading.Lock()
    threads = []

    def one(i: int, job: dict) -> None:
        try:
            t0 = time.monotonic()
            fp, fd = prefill.submit(job), decode.submit(job)
            _abort_peer_on_failure(fp, decode, job["room"], "prefill")
            _abort_peer_on_failure(fd, prefill, job["room"], "decode")
            try:
                pre = fp.result(timeout_s)
                dec = fd.result(max(0.1, timeout_s - (time.monotonic() - t0)))
            except FutureTimeout:
                pre = [{"ok": False, "reason": f"no answer within {timeout_s:.0f} s", "rank": -1}]
                dec = []
            res = _combine(job, pre, dec, time.monotonic() - t0)
            with lock:
                results[i] = res
                if bar is not None:
                    bar.update(res)
        finally:
            slots.release()

    t_start = time.monotonic()
    for i, job in enumerate(jobs):
        slots.acquire()
        th = threading.Thread(target=one, args=(i, job), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(timeout_s + 5)
    wall = time.monotonic() - t_start
    return [r for r in results if r is not None], wall


def _abort_peer_on_failure(fut, peer, room: int, side: str) -> None:
    """When ``side`` fails a request, abort it on ``peer`` (a ``RankGroup`` or a remote
    server) so that the peer's ranks stop waiting for it now, not at their deadline."""
    abort = getattr(peer, "abort", None)
    if abort is None:
        return

    def done(f) -> None:
        failed = [r for r in f.result() if not r.get("ok")]
        if failed:
            abort(room, f"the {side} side failed: {failed[0].get('reason')}"[:500])

    fut.add_done_callback(done)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values), q))


def percentiles_ms(seconds: list[float]) -> dict:
    """p50/p90/p99 in milliseconds of the finite values (NaN when there are none)."""
    ms = [v * 1e3 for v in seconds if v == v]
    return {f"p{q}": round(_pct(ms, q), 3) for q in (50, 90, 99)}


def busy_seconds(windows: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (NaN ones skipped)."""
    total, cur_start = 0.0, 0.0
    cur_end: float | None = None  # None until the first interval
    for a, b in sorted(w for w in windows if w[0] == w[0] and w[1] == w[1]):
        if cur_end is None or a > cur_end:
            total += (cur_end - cur_start) if cur_end is not None else 0.0
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    return total + ((cur_end - cur_start) if cur_end is not None else 0.0)


def summarize(results: list[RequestResult], wall_s: float, **meta) -> dict:
    """Totals and percentiles of one workload. ``gbps`` is bytes over the wall time (it
    includes filling and verifying); ``transfer_gbps`` and ``descriptors_per_s`` are over
    the busy time (while at least one transfer window was open)."""
    ok = [r for r in results if r.ok]
    lat = [r.transfer_s * 1e3 for r in ok if r.transfer_s == r.transfer_s]
    e2e = [r.e2e_s * 1e3 for r in ok]
    total = sum(r.bytes for r in ok)
    ops = [r.ops for r in ok]
    busy = busy_seconds([r.window for r in ok])
    per_request = [r.bytes / r.transfer_s / 1e9 for r in ok if r.transfer_s == r.transfer_s and r.transfer_s > 0]
    paths: dict[str, int] = {}
    for r in ok:
        for k, v in r.paths.items():
            paths[k] = paths.get(k, 0) + v
    return {
        **meta,
        "requests": len(results),
        "succeeded_requests": len(ok),
        "verified_requests": sum(r.verified for r in results),
        "failed_requests": len(results) - len(ok),
        "bytes": total,
        "wall_s": round(wall_s, 4),
        "gbps": round(total / wall_s / 1e9, 4) if wall_s > 0 else 0.0,
        "p50_ms": round(_pct(lat, 50), 3),
        "p90_ms": round(_pct(lat, 90), 3),
        "p99_ms": round(_pct(lat, 99), 3),
        "e2e_p50_ms": round(_pct(e2e, 50), 3),
        "busy_s": round(busy, 6),
        "transfer_gbps": round(total / busy / 1e9, 4) if busy > 0 else 0.0,
        "request_gbps_p50": round(_pct(per_request, 50), 4),
        "descriptors_per_s": round(sum(ops) / busy, 1) if busy > 0 else 0.0,
        "tail_ms": percentiles_ms([r.tail_s for r in ok]),
        "phases_ms": {p: percentiles_ms([r.phases.get(p, 0.0) for r in ok]) for p in PHASES},
        "ops_per_request": {
            "min": min(ops) if ops else 0,
            "median": statistics.median(ops) if ops else 0,
            "max": max(ops) if ops else 0,
        },
        "ops_by_tokens": sorted({(r.tokens, r.ops) for r in ok}),
        "data_path": paths,
        "failures": [f"room {r.room}: {r.reason}" for r in results if not r.ok or (r.reason and not r.verified)][:10],
    }
