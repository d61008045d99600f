"""The fused path in planning: ``auto`` weighs one pool -> pool pass where the reader's pool
is mapped in the writer's process (``PoolMapping``), by the transport's cost or the fixed
rule; ``path='fused'`` falls back where it is not; every plan the engine builds says why
it is fused or not; a fused plan moves exactly the oracle's bytes (random layouts, page
sizes, TP pairs, chunks)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_kvxfer.errors import PlanError
from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.planning import DataPath, FusedPlan, PoolMapping, RequestPlan, plan_pair, plan_tp
from sglang_kvxfer.planning.executor import apply_plan
from sglang_kvxfer.planning.pathcost import PathCost

from .oracle import POISON, empty_pool, full_kv, place_tokens

LOCAL_CPU = PathCost(1e-6, 8e9, 8e9, source="local-like")
MAPPED = PoolMapping(True, "local maps its 1 KV region(s) on cpu")
NOT_MAPPED = PoolMapping(False, "transport 'tcp' does not map region 0 of the reader's KV pool")


def _pair(h=8, p=2, d=1, ps=4, pd=4, lp="NHD", ld="NHD", tokens=32, seed=0):
    common = dict(num_layers=3, total_kv_heads=h, head_dim=8, dtype="float32")
    gp = KVGeometry(**common, page_size=ps, layout=lp, num_pages=64)
    gd = KVGeometry(**common, page_size=pd, layout=ld, num_pages=48)
    t = plan_tp(h, p, d).transfers[0]
    rng = np.random.default_rng(seed)
    sp = rng.permutation(64)[: -(-tokens // ps)]
    dp = rng.permutation(48)[: -(-tokens // pd)]
    return t, gp.placement(p, t.prefill_rank), gd.placement(d, t.decode_rank), sp, dp, tokens


def _exact(plan, src, dst, sp, dp, tokens):
    g = src.geometry
    k_full, v_full = full_kv(g.num_layers, g.total_kv_heads, tokens, g.head_dim, g.v_head_dim, seed=tokens)
    src_pool = place_tokens(src, empty_pool(src, POISON), k_full, v_full, sp, tokens)
    got = empty_pool(dst)
    apply_plan(plan, src_pool, got)
    want = place_tokens(dst, empty_pool(dst), k_full, v_full, dp, tokens)
    return all(np.array_equal(a, b) for a, b in zip(got, want))


def test_a_strided_pair_is_fused_where_the_reader_pool_is_mapped_and_says_why():
    t, src, dst, sp, dp, tokens = _pair(p=1, d=2)  # half of an NHD prefill pool's heads: strided
    plan = plan_pair(t, src, dst, sp, dp, num_tokens=tokens, cost=LOCAL_CPU, mapping=MAPPED)
    assert isinstance(plan, FusedPlan) and plan.path == "fused" and plan.op_count == 1
    assert plan.reason.startswith("fused, the reader's pool is mapped here (local maps its 1 KV region(s) on cpu)")
    assert "fused 1 pass, 50 us + " in plan.reason and "< staged" in plan.reason and "strided" in plan.reason
    assert _exact(plan, src, dst, sp, dp, tokens)


def test_not_mapped_the_plan_says_so_and_keeps_its_path():
    t, src, dst, sp, dp, tokens = _pair(p=2, d=1)
    plan = plan_pair(t, src, dst, sp, dp, num_tokens=tokens, cost=LOCAL_CPU, mapping=NOT_MAPPED)
    assert plan.path == "staged"
    assert plan.reason.endswith("; not fused: transport 'tcp' does not map region 0 of the reader's KV pool")
    # the planner alone (kvxfer plan) does not know, and says nothing about it
    assert "fused" not in plan_pair(t, src, dst, sp, dp, num_tokens=tokens, cost=LOCAL_CPU).reason


def test_few_large_direct_ops_beat_one_fused_pass_by_cost():
    # equal TP, contiguous pages on both sides: 6 direct ops (3 layers x K, V)
    t, src, dst, _, _, tokens = _pair(p=1, d=1)
    pages = np.arange(8)
    plan = plan_pair(t, src, dst, pages, pages, num_tokens=tokens, cost=LOCAL_CPU, mapping=MAPPED)
    assert plan.path == "direct" and plan.direct_op_count == 6
    assert "; not fused: fused 1 pass, 50 us + " in plan.reason and ">= direct" in plan.reason


def test_many_small_direct_ops_lose_to_one_fused_pass():
    # equal TP on scattered 2-token pages: about one op per page, layer and K/V; direct
    # beats staging them (one op costs 1 us, staging 100 us and two copies) but not one pass
    t, src, dst, sp, dp, tokens = _pair(p=1, d=1, ps=2, pd=2, tokens=32)
    alone = plan_pair(t, src, dst, sp, dp, num_tokens=tokens, cost=LOCAL_CPU)
    assert alone.path == "direct" and alone.direct_op_count > 60
    plan = plan_pair(t, src, dst, sp, dp, num_tokens=tokens, cost=LOCAL_CPU, mapping=MAPPED)
    assert plan.path == "fused" and "< direct" in plan.reason and f"instead of direct: {alone.reason}" in plan.reason
    assert plan.direct_op_count == alone.direct_op_count  # still reported: why it was not direct
    assert _exact(plan, src, dst, sp, dp, tokens)


def test_the_fixed_rule_fuses_what_it_would_stage_and_keeps_direct_runs():
    t, src, dst, sp, dp, tokens = _pair(p=2, d=1)
    plan = plan_pair(t, src, dst, sp, dp, num_tokens=tokens, mapping=MAPPED)  # no cost: the fixed rule
    assert plan.path == "fused" and "one pass instead of gather + scatter (the fixed rule" in plan.reason
    t, src, dst, _, _, tokens = _pair(p=1, d=1)
    pages = np.arange(8)
    plan = plan_pair(t, src, dst, pages, pages, num_tokens=tokens, mapping=MAPPED)
    assert plan.path == "direct" and "not fused: direct page runs are one pass already" in plan.reason


def test_forcing_fused_where_the_pool_is_not_mapped_falls_back_with_the_reason():
    t, src, dst, sp, dp, tokens = _pair(p=2, d=1)
    plan = plan_pair(t, src, dst, sp, dp, num_tokens=tokens, path="fused", cost=LOCAL_CPU, mapping=NOT_MAPPED)
    assert plan.path == "staged"
    assert plan.reason.startswith("path='fused' but not fused (transport 'tcp' does not map region 0")
    unknown = plan_pair(t, src, dst, sp, dp, num_tokens=tokens, path="fused")
    assert unknown.path == "staged" and "not known to be mapped here" in unknown.reason
    forced = plan_pair(t, src, dst, sp, dp, num_tokens=tokens, path="fused", mapping=MAPPED)
    assert forced.path == "fused" and forced.reason.startswith("forced by path='fused'")


def test_forcing_staged_or_direct_over_a_mapped_pool_says_so():
    t, src, dst, sp, dp, tokens = _pair(p=2, d=1)
    plan = plan_pair(t, src, dst, sp, dp, num_tokens=tokens, path="staged", mapping=MAPPED)
    assert plan.path == "staged" and plan.reason.endswith("; not fused: forced by path='staged'")


def test_request_plan_resolves_fused_and_refuses_direct_ops():
    t, src, dst, sp, dp, tokens = _pair(p=2, d=1, ps=4, pd=8, ld="HND")
    plan = RequestPlan.build(t, src, dst, sp, dp, num_tokens=tokens, cost=LOCAL_CPU, mapping=MAPPED)
    assert plan.path is DataPath.FUSED and plan.fused and not plan.staged
    assert plan.nbytes() == 3 * tokens * t.num_heads * 16 * 4
    with pytest.raises(PlanError, match=r"is fused \(fused, the reader's pool is mapped here"):
        plan.direct(0, tokens)
    piece = plan.gather_slice(8, 24)
    assert (piece.token_offset, piece.num_tokens, piece.page_size) == (0, 16, 4)
    assert plan.scatter_slice(8, 24).layout == "HND"


def test_fused_is_a_data_path_name_with_the_others():
    assert DataPath.parse("fused") is DataPath.FUSED and f"{DataPath.FUSED}" == "fused"
    with pytest.raises(ValueError, match=r"must be one of auto, direct, staged, per_token, fused"):
        DataPath.parse("sideways")
    with pytest.raises(ValueError, match=r"PathCost.fused_fixed_s=-1.0 must be >= 0"):
        PathCost(1e-6, 1e9, 1e9, fused_fixed_s=-1.0)


TP = {1: [1, 2], 2: [1, 2, 4], 8: [1, 2, 8]}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(sorted(TP)),
    st.data(),
    st.sampled_from(["NHD", "HND", "HND_KV"]),
    st.sampled_from(["NHD", "HND", "HND_KV"]),
    st.integers(1, 5),
    st.integers(1, 5),
    st.integers(1, 30),
    st.integers(0, 2**16),
)
def test_random_fused_plans_move_exactly_the_oracles_bytes(h, data, lp, ld, ps, pd, tokens, seed):
    p, d = data.draw(st.sampled_from(TP[h])), data.draw(st.sampled_from(TP[h]))
    common = dict(num_layers=2, total_kv_heads=h, head_dim=2, dtype="float32")
    gp = KVGeometry(**common, page_size=ps, layout=lp, num_pages=32)
    gd = KVGeometry(**common, page_size=pd, layout=ld, num_pages=40)
    rng = np.random.default_rng(seed)
    sp, dp = rng.permutation(32)[: -(-tokens // ps)], rng.permutation(40)[: -(-tokens // pd)]
    k_full, v_full = full_kv(2, h, tokens, 2, 2, seed)
    pre = [gp.placement(p, r) for r in range(p)]
    dec = [gd.placement(d, r) for r in range(d)]
    src_pools = [place_tokens(pl, empty_pool(pl, POISON), k_full, v_full, sp, tokens) for pl in pre]
    dst_pools = [empty_pool(pl) for pl in dec]
    cut = data.draw(st.integers(0, tokens))
    for t in plan_tp(h, p, d, salt=seed).transfers:
        for a, b in ((0, cut), (cut, tokens)):  # two chunks, each fused on its own
            plan = plan_pair(
                t, pre[t.prefill_rank], dec[t.decode_rank], sp, dp, num_tokens=tokens, token_start=a, token_stop=b,
                path="fused", mapping=MAPPED,
            )  # fmt: skip
            assert isinstance(plan, FusedPlan)
            apply_plan(plan, src_pools[t.prefill_rank], dst_pools[t.decode_rank])
    for r, pl in enumerate(dec):
        want = place_tokens(pl, empty_pool(pl), k_full, v_full, dp, tokens)
        assert all(np.array_equal(a, b) for a, b in zip(dst_pools[r], want))
