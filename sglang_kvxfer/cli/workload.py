"""Request streams for the demo, the client and the benchmarks, and their summaries.

Owns ``make_requests`` (rooms, mixed lengths, chunk sizes), ``run_workload`` (keeps up to
``concurrency`` requests in flight on a prefill side and a decode side, with a deadline
per request and a progress line on stderr) and ``summarize`` (bytes, GB/s, latency
percentiles, ops per request, data paths). The two sides are anything with
``submit(job) -> Future`` of per-rank results: a ``RankGroup`` or a remote server client.
"""
from __future__ import annotations

import statistics
import sys
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import numpy as np

__all__ = ["make_requests", "run_workload", "summarize", "RequestResult", "parse_tokens"]


def parse_tokens(text: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--tokens={text!r} must be a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise ValueError(f"--tokens={text!r} must list positive token counts")
    return values


def make_requests(n: int, tokens: list[int], chunk_tokens: int, page_size: int, seed: int = 0,
                  verify: bool = True, chunk_delay_s: float = 0.0) -> list[dict]:
    """``n`` jobs cycling through ``tokens``; chunks rounded down to whole prefill pages."""
    if n < 1:
        raise ValueError(f"--requests={n} must be >= 1")
    chunk = max(page_size, (chunk_tokens // page_size) * page_size) if chunk_tokens else 0
    rng = np.random.default_rng(seed)
    rooms = rng.choice(2**62, size=n, replace=False) + 1
    return [{"room": int(rooms[i]), "tokens": tokens[i % len(tokens)], "chunk_tokens": chunk,
             "aux": int(rooms[i] % 50000).to_bytes(4, "little"), "verify": verify,
             "chunk_delay_s": chunk_delay_s} for i in range(n)]


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


def _combine(job: dict, pre: list[dict], dec: list[dict], e2e: float) -> RequestResult:
    reasons = [f"{side} rank {r.get('rank')}: {r.get('reason')}" for side, rs in (("prefill", pre), ("decode", dec))
               for r in rs if not r.get("ok")]
    problems = [p for r in dec for p in r.get("problems", [])]
    ok = not reasons
    starts = [r["t_start"] for r in pre if "t_start" in r]
    ends = [r["t_end"] for r in dec if "t_end" in r]
    transfer = (max(ends) - min(starts)) if (ok and starts and ends) else float("nan")
    paths: dict[str, int] = {}
    for r in pre:
        for k, v in (r.get("paths") or {}).items():
            paths[k] = paths.get(k, 0) + v
    return RequestResult(
        room=job["room"], tokens=job["tokens"], ok=ok,
        verified=ok and job["verify"] and all(r.get("verified") for r in dec),
        reason="; ".join(reasons + problems)[:2000], bytes=sum(r.get("bytes", 0) for r in dec),
        ops=sum(r.get("ops", 0) for r in pre), paths=paths, transfer_s=transfer, e2e_s=e2e,
        prefill=pre, decode=dec)


class _Progress:
    def __init__(self, total: int, enabled: bool, label: str = "requests"):
        self.total, self.enabled, self.label = total, enabled, label
        self.done = self.failed = self.bytes = 0
        self.t0 = time.monotonic()
        self._last = 0.0
        self._tty = sys.stderr.isatty()

    def update(self, res: RequestResult) -> None:
        self.done += 1
        self.failed += not res.ok
        self.bytes += res.bytes
        now = time.monotonic()
        if not self.enabled or (not self._tty and now - self._last < 2.0 and self.done < self.total):
            return
        self._last = now
        width = 24
        filled = int(width * self.done / self.total)
        rate = self.bytes / max(now - self.t0, 1e-9) / 1e9
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {self.label}, "
                f"{self.bytes / 1e9:.2f} GB, {rate:.2f} GB/s, {self.failed} failed")
        end = "\r" if self._tty and self.done < self.total else "\n"
        print(line, end=end, file=sys.stderr, flush=True)


def run_workload(prefill, decode, jobs: list[dict], concurrency: int, timeout_s: float,
                 progress: bool = True, label: str = "requests") -> tuple[list[RequestResult], float]:
    """Run ``jobs`` with up to ``concurrency`` in flight; returns results (job order) and wall s."""
    if concurrency < 1:
        raise ValueError(f"--concurrency={concurrency} must be >= 1")
    results: list[RequestResult | None] = [None] * len(jobs)
    slots = threading.Semaphore(concurrency)
    bar = _Progress(len(jobs), progress, label)
    lock = threading.Lock()
    threads = []

    def one(i: int, job: dict) -> None:
        try:
            t0 = time.monotonic()
            fp, fd = prefill.submit(job), decode.submit(job)
            try:
                pre = fp.result(timeout_s)
                dec = fd.result(max(0.1, timeout_s - (time.monotonic() - t0)))
            except FutureTimeout:
                pre = [{"ok": False, "reason": f"no answer within {timeout_s:.0f} s", "rank": -1}]
                dec = []
            res = _combine(job, pre, dec, time.monotonic() - t0)
            with lock:
                results[i] = res
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


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values), q))


def summarize(results: list[RequestResult], wall_s: float, **meta) -> dict:
    ok = [r for r in results if r.ok]
    lat = [r.transfer_s * 1e3 for r in ok if r.transfer_s == r.transfer_s]
    e2e = [r.e2e_s * 1e3 for r in ok]
    total = sum(r.bytes for r in ok)
    ops = [r.ops for r in ok]
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
        "ops_per_request": {"min": min(ops) if ops else 0, "median": statistics.median(ops) if ops else 0,
                            "max": max(ops) if ops else 0},
        "ops_by_tokens": sorted({(r.tokens, r.ops) for r in ok}),
        "data_path": paths,
        "failures": [f"room {r.room}: {r.reason}" for r in results if not r.ok or (r.reason and not r.verified)][:10],
    }
