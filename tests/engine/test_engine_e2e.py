"""Multi-process end to end: prefill and decode TP groups as separate processes, over the
``local`` and ``tcp`` transports, moving verified bytes; peer death and restart; a geometry
mismatch that fails fast on both sides while the prefill keeps serving others."""

from __future__ import annotations

import time

import pytest

from sglang_kvxfer.cluster.group import RankGroup, make_spec
from sglang_kvxfer.cluster.workload import make_requests, run_workload
from sglang_kvxfer.engine import BootstrapServer

from .harness import FAST, geometry

CASES = [(8, 1, 1), (8, 2, 1), (8, 1, 2), (8, 4, 2), (8, 2, 4), (2, 1, 8), (2, 8, 2), (4, 2, 8)]
# (prefill page, prefill layout, decode page, decode layout): sides may differ
FORMATS = [(4, "NHD", 4, "NHD"), (4, "NHD", 8, "HND"), (8, "HND", 4, "NHD")]


def groups(boot, gp, gd, p, d, transport, one_process=True, opts=None):
    opts = {**FAST, **(opts or {})}
    opts.pop("num_workers")
    pre = RankGroup(make_spec("prefill", gp, p, boot.address, transport, options=opts), one_process=one_process)
    try:
        dec = RankGroup(make_spec("decode", gd, d, boot.address, transport, options=opts), one_process=True)
    except BaseException:
        pre.close()
        raise
    return pre, dec


def run(pre, dec, tokens, chunk, n=3, concurrency=2, seed=0, delay=0.0, page=4):
    jobs = make_requests(n, tokens, chunk, page, seed=seed, chunk_delay_s=delay)
    results, _ = run_workload(pre, dec, jobs, concurrency, timeout_s=60, progress=False)
    return results


@pytest.mark.parametrize("transport", ["local", "tcp"])
@pytest.mark.parametrize("case", range(len(CASES) + 2))
def test_tp_combinations_move_verified_bytes(transport, case):
    if case < len(CASES):
        (h, p, d), mla = CASES[case], False
    else:
        (h, p, d), mla = [(1, 2, 1), (1, 1, 3)][case - len(CASES)], True
    ps, lp, pd, ld = FORMATS[case % len(FORMATS)]
    gp = geometry(h, mla=mla, page_size=ps, layout=lp, num_pages=96, head_dim=24 if mla else 16)
    gd = geometry(h, mla=mla, page_size=pd, layout=ld, num_pages=96, head_dim=24 if mla else 16)
    with BootstrapServer() as boot:
        pre, dec = groups(boot, gp, gd, p, d, transport)
        with pre, dec:
            results = run(pre, dec, [37, 128, 9], chunk=16, page=ps)
    assert len(results) == 3
    for r in results:
        assert r.ok and r.verified, r.reason
        # every decode rank receives its local heads (replicas included): max(H, D) head rows
        assert r.bytes == 2 * r.tokens * max(h, d) * ((24 if mla else 16) + (0 if mla else 8)) * 2


def test_killed_prefill_fails_decode_within_the_deadline_and_a_restart_serves_again():
    gp = geometry(8, page_size=4, num_pages=128)
    opts = {"heartbeat_timeout_s": 1.5, "transfer_timeout_s": 30.0}
    with BootstrapServer() as boot:
        pre, dec = groups(boot, gp, gp, 2, 1, "local", one_process=False, opts=opts)
        try:
            jobs = make_requests(1, [256], 16, 4, seed=1, chunk_delay_s=0.25)  # ~4 s of chunks
            fut_p, fut_d = pre.submit(jobs[0]), dec.submit(jobs[0])
            time.sleep(1.0)
            pre.kill_rank(1)
            t_kill = time.monotonic()
            decoded = fut_d.result(20)
            waited = time.monotonic() - t_kill
            assert not decoded[0]["ok"]
            assert "sent nothing for" in decoded[0]["reason"] or "is gone" in decoded[0]["reason"], decoded[0]["reason"]
            assert waited < 1.5 + 10.0  # heartbeat timeout plus scheduling slack, far below any request deadline
            fut_p.result(20)
        finally:
            pre.close()
        with RankGroup(
            make_spec(
                "prefill",
                gp,
                2,
                boot.address,
                "local",
                options={k: v for k, v in {**FAST, **opts}.items() if k != "num_workers"},
            )
        ) as pre2:
            with dec:
                results = run(pre2, dec, [100, 33], chunk=32, n=2, seed=2)
    assert all(r.ok and r.verified for r in results), [r.reason for r in results]


def test_geometry_mismatch_fails_both_sides_and_prefill_keeps_serving():
    gp = geometry(8, head_dim=16)
    with BootstrapServer() as boot:
        opts = {k: v for k, v in FAST.items() if k != "num_workers"}
        with RankGroup(make_spec("prefill", gp, 2, boot.address, "tcp", options=opts), one_process=True) as pre:
            with RankGroup(
                make_spec("decode", geometry(8, head_dim=8), 1, boot.address, "tcp", options=opts), one_process=True
            ) as bad:
                t0 = time.monotonic()
                (r,) = run(pre, bad, [20], chunk=0, n=1, concurrency=1)
                assert time.monotonic() - t0 < FAST["bootstrap_timeout_s"]  # failed fast, not by deadline
            assert not r.ok
            for side in r.prefill + r.decode:
                assert "head_dim: prefill=16 decode=8" in side["reason"], side["reason"]
            with RankGroup(make_spec("decode", gp, 1, boot.address, "tcp", options=opts), one_process=True) as good:
                results = run(pre, good, [20, 50], chunk=8, n=2, seed=3)
    assert all(r.ok and r.verified for r in results), [r.reason for r in results]


@pytest.mark.parametrize("case", [(8, 2, 1), (2, 1, 4)])
def test_nixl_moves_verified_bytes(case):
    from sglang_kvxfer.transports import available_transports

    if "nixl" not in available_transports():
        pytest.skip("nixl-cu12 is not installed (pip install --no-deps nixl-cu12)")
    h, p, d = case
    gp = geometry(h, page_size=4, num_pages=96)
    gd = geometry(h, page_size=8, layout="HND", num_pages=96)
    with BootstrapServer() as boot:
        pre, dec = groups(boot, gp, gd, p, d, "nixl")
        with pre, dec:
            results = run(pre, dec, [37, 128], chunk=16, n=2)
    assert all(r.ok and r.verified for r in results), [r.reason for r in results]
