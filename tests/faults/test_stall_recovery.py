"""A rank stalls past the heartbeat timeout (SIGSTOP ... SIGCONT) while requests arrive.

Real rank processes (``RankGroup``), short heartbeats. While one rank is stopped its peers
declare it dead and requests in the window fail within their deadlines; once it runs again,
the two sides re-register (the stale records replaced on both layers) and requests move and
verify every byte again, with no restart of anything.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from sglang_kvxfer.cluster.group import make_spec, open_groups
from sglang_kvxfer.engine import BootstrapServer
from tests.engine.harness import geometry

OPTS = dict(
    bootstrap_timeout_s=8.0,
    waiting_timeout_s=8.0,
    transfer_timeout_s=8.0,
    heartbeat_interval_s=0.2,
    heartbeat_timeout_s=1.0,
    staging_bytes=1 << 20,
    staging_slot_bytes=64 << 10,
)
STALL_S = 3.0  # three heartbeat timeouts


def job(room: int, tokens: int = 24) -> dict:
    return {
        "room": room,
        "tokens": tokens,
        "chunk_tokens": 8,
        "aux": b"aux-%d" % room,
        "verify": True,
        "chunk_delay_s": 0.0,
    }


def run(pre, dec, room: int, timeout_s: float = 30.0) -> tuple[list, list]:
    fp, fd = pre.submit(job(room)), dec.submit(job(room))
    return fp.result(timeout_s), fd.result(timeout_s)


def ok(results) -> bool:
    rp, rd = results
    return all(r["ok"] for r in rp) and all(r["ok"] and r["verified"] for r in rd)


@pytest.mark.parametrize("stalled", ["decode", "prefill"])
@pytest.mark.parametrize("transport", ["local", "tcp"])
def test_a_rank_stalled_past_the_heartbeat_timeout_recovers_without_restart(stalled, transport):
    with BootstrapServer() as boot:
        g = geometry(h=4, num_pages=64)
        # Prefill TP 2 -> decode TP 1: the decode rank registers with both prefill ranks, so
        # when one of them stalls the other still holds the decode session's record.
        spec_p = make_spec("prefill", g, 2, boot.address, transport, options=OPTS, concurrency=4)
        spec_d = make_spec("decode", g, 1, boot.address, transport, options=OPTS, concurrency=4)
        pre, dec = open_groups(spec_p, spec_d)
        with pre, dec:
            assert ok(run(pre, dec, 1)), "the first request must work"
            victim = pre.pids[1] if stalled == "prefill" else dec.pids[0]
            os.kill(victim, signal.SIGSTOP)
            during = []
            try:  # new requests keep arriving while the rank is stopped
                stop_at = time.monotonic() + STALL_S
                room = 1000
                while time.monotonic() < stop_at:
                    room += 1
                    during.append((pre.submit(job(room)), dec.submit(job(room))))
                    time.sleep(0.25)
            finally:
                os.kill(victim, signal.SIGCONT)
            resumed = time.monotonic()
            # The requests caught in the stall end within their deadlines, either way.
            for fp, fd in during:
                in_stall = (fp.result(30), fd.result(30))
                if not ok(in_stall):
                    reasons = [r.get("reason", "") for side in in_stall for r in side if not r["ok"]]
                    assert all(reasons), f"a failure without a reason: {in_stall}"
            # Recovery: a request succeeds soon after the rank runs again, then every one does.
            room, recovered = 10, None
            while recovered is None and time.monotonic() - resumed < 20:
                room += 1
                if ok(run(pre, dec, room)):
                    recovered = time.monotonic() - resumed
            assert recovered is not None, "no request succeeded within 20 s of SIGCONT (permanent outage)"
            for r in range(100, 104):
                results = run(pre, dec, r)
                assert ok(results), f"request {r} after recovery failed: {results}"
            assert victim in pre.pids + dec.pids  # recovered, not restarted
