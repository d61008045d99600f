"""Byte plans: property tests over random geometries, page lists, layouts and chunks, with
real bytes moved and compared against the oracle; and every rejection path's message."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_kvxfer.errors import IncompatibleGeometryError, PlanError
from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.planning import DirectPlan, StagedPlan, plan_pair, plan_tp
from sglang_kvxfer.planning.byteplan import PathCost, coalesce, contiguous_layout, per_token_op_count
from sglang_kvxfer.planning.executor import apply_plan

from .oracle import POISON, empty_pool, full_kv, place_tokens

TP_SIZES = {1: [1, 2, 4], 2: [1, 2, 4], 4: [1, 2, 4, 8], 6: [1, 2, 3, 6], 8: [1, 2, 4, 8]}
# What the transports declare (see tests/engine/test_direct_rule.py for the real ones):
# local on a 2-vCPU VM (about 1 us per memmove call, 8 GB/s), and tcp (1 us per entry, 4 GB/s).
LOCAL_CPU = PathCost(1e-6, 8e9, 8e9, source="local-like")
TCP_CPU = PathCost(1e-6, 4e9, 10e9, source="tcp-like")


@st.composite
def scenarios(draw):
    mla = draw(st.booleans())
    h = 1 if mla else draw(st.sampled_from(sorted(TP_SIZES)))
    p = draw(st.sampled_from(TP_SIZES[h] if not mla else [1, 2, 3, 4]))
    d = draw(st.sampled_from(TP_SIZES[h] if not mla else [1, 2, 3, 4]))
    ps, pd = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    layouts = ["NHD", "HND"] if mla else ["NHD", "HND", "HND_KV"]  # HND_KV: not for MLA
    lp, ld = draw(st.sampled_from(layouts)), draw(st.sampled_from(layouts))
    num_tokens = draw(st.integers(1, 20))
    cuts = sorted(draw(st.lists(st.integers(0, num_tokens), max_size=3)))
    head_dim = draw(st.integers(1, 4))
    # HND_KV needs v_head_dim == head_dim (None resolves to it).
    v_head_dim = None if mla or "HND_KV" in (lp, ld) else draw(st.integers(1, 4))
    path = draw(st.sampled_from(["auto", "direct", "staged", "per_token"]))
    seed = draw(st.integers(0, 2**16))
    all_heads = draw(st.booleans())  # prefill pools of every head (CP-TP group sharing)
    return mla, h, p, d, ps, pd, lp, ld, num_tokens, cuts, head_dim, v_head_dim, path, seed, all_heads


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_plans_move_exactly_the_right_bytes(s):
    mla, h, p, d, ps, pd, lp, ld, num_tokens, cuts, head_dim, v_head_dim, path, seed, all_heads = s
    common = dict(num_layers=2, total_kv_heads=h, head_dim=head_dim, v_head_dim=v_head_dim, dtype="float32", mla=mla)
    gp = KVGeometry(**common, page_size=ps, layout=lp, num_pages=25)
    gd = KVGeometry(**common, page_size=pd, layout=ld, num_pages=22)
    rng = np.random.default_rng(seed)
    src_pages = rng.permutation(gp.num_pages)[: -(-num_tokens // ps)]
    dst_pages = rng.permutation(gd.num_pages)[: -(-num_tokens // pd)]
    k_full, v_full = full_kv(2, h, num_tokens, head_dim, gp.v_head_dim, seed)
    pre = [gp.placement(p, r, all_heads) for r in range(p)]
    dec = [gd.placement(d, r) for r in range(d)]
    src_pools = [place_tokens(pl, empty_pool(pl, POISON), k_full, v_full, src_pages, num_tokens) for pl in pre]
    dst_pools = [empty_pool(pl) for pl in dec]
    bounds = [0] + cuts + [num_tokens]
    plan = plan_tp(h, p, d, mla=mla, salt=seed)
    for t in plan.transfers:
        for a, b in zip(bounds, bounds[1:]):  # chunked sends: each chunk planned on its own
            pair = plan_pair(
                t,
                pre[t.prefill_rank],
                dec[t.decode_rank],
                src_pages,
                dst_pages,
                num_tokens=num_tokens,
                token_start=a,
                token_stop=b,
                path=path,
            )
            assert pair.num_tokens == b - a
            assert pair.nbytes == 2 * (b - a) * t.num_heads * (gp.head_dim + gp.v_head_dim) * 4
            if path == "staged":
                assert isinstance(pair, StagedPlan)
            if path == "direct":  # the writer's up-front test agrees with what the plan found
                contiguous = contiguous_layout(t, pre[t.prefill_rank], dec[t.decode_rank]) is not None
                assert isinstance(pair, DirectPlan) == contiguous, (pair.reason, contiguous)
            if isinstance(pair, DirectPlan):
                moved = sum(int(pair.buffer_ops(i)[:, 2].sum()) for i in range(gp.num_buffers))
                assert moved == pair.nbytes
                assert pair.op_count == pair.direct_op_count
            apply_plan(pair, src_pools[t.prefill_rank], dst_pools[t.decode_rank])
    for r, pl in enumerate(dec):
        want = place_tokens(pl, empty_pool(pl), k_full, v_full, dst_pages, num_tokens)
        for got, exp in zip(dst_pools[r], want):
            assert np.array_equal(got, exp)


def _pair(h=8, p=2, d=1, ps=4, pd=4, lp="NHD", ld="NHD", mla=False, **kw):
    common = dict(num_layers=3, total_kv_heads=h, head_dim=8, dtype="bf16", mla=mla)
    gp = KVGeometry(**common, page_size=ps, layout=lp, num_pages=64)
    gd = KVGeometry(**common, page_size=pd, layout=ld, num_pages=32)
    t = plan_tp(h, p, d, mla=mla).transfers[0]
    return t, gp.placement(p, t.prefill_rank), gd.placement(d, t.decode_rank)


def test_equal_tp_contiguous_pages_coalesce_into_one_op_per_buffer():
    t, src, dst = _pair(p=2, d=2)
    plan = plan_pair(t, src, dst, list(range(10, 20)), list(range(0, 10)))
    assert plan.path == "direct" and plan.direct_op_count == 6  # 3 layers x (K, V)
    assert plan.k_ops.tolist() == [[10 * 4 * 4 * 8 * 2, 0, 10 * 4 * 4 * 8 * 2]]


def test_strided_nhd_slice_is_staged_with_one_write():
    t, src, dst = _pair(p=2, d=1)
    plan = plan_pair(t, src, dst, list(range(8)), list(range(8)))
    assert plan.path == "staged" and plan.direct_op_count is None and plan.staged_op_count == 1
    assert "strided" in plan.reason
    assert plan.staging_nbytes == 3 * 32 * 4 * (8 + 8) * 2
    assert plan.gather_kwargs()["head_start"] == t.src_head_start
    assert plan.scatter_kwargs()["head_start"] == t.dst_head_start
    assert per_token_op_count(3, 32) == 192
    assert plan_pair(t, src, dst, list(range(8)), list(range(8)), path="per_token").direct_op_count == 192


def test_hnd_slices_are_direct_per_page_when_pages_are_large():
    t, src, dst = _pair(p=1, d=2, lp="HND", ld="HND", ps=64, pd=64)
    plan = plan_pair(t, src, dst, [3, 9], [1, 2], path="auto")
    assert plan.path == "direct"
    assert len(plan.k_ops) == 2  # one op per page: the head slice of a full HND page is contiguous


def test_fragmented_direct_plans_go_staged_under_auto():
    t, src, dst = _pair(p=2, d=2, ps=1, pd=1)
    pages = np.arange(0, 64, 2)  # every other page: no two consecutive
    plan = plan_pair(t, src, dst, pages, np.arange(32))
    assert plan.path == "staged" and "fragmented" in plan.reason
    assert plan.direct_op_count == 3 * 2 * 32
    forced = plan_pair(t, src, dst, pages, np.arange(32), path="direct")
    assert forced.path == "direct"


def test_path_argument_forces_staging_and_the_engine_takes_it_from_the_env_var(monkeypatch):
    from sglang_kvxfer.engine.config import EngineConfig

    t, src, dst = _pair(p=2, d=2)
    assert plan_pair(t, src, dst, [0, 1], [0, 1]).path == "direct"
    assert plan_pair(t, src, dst, [0, 1], [0, 1], path="staged").path == "staged"
    monkeypatch.setenv("KVXFER_DATA_PATH", "staged")
    assert plan_pair(t, src, dst, [0, 1], [0, 1]).path == "direct"  # planning reads no environment
    cfg = EngineConfig("decode", src.geometry, 2, 0, "127.0.0.1:1", auth_key="off")
    assert cfg.data_path == "staged"


def test_coalesce_merges_only_runs_contiguous_on_both_sides():
    ops = coalesce([0, 10, 20, 50], [100, 110, 125, 135], [10, 10, 10, 10])
    assert ops.tolist() == [[0, 100, 20], [20, 125, 10], [50, 135, 10]]
    assert coalesce([], [], []).shape == (0, 3)


# --- rejections ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "src_pages,dst_pages,kw,words",
    [
        ([0, 1, 2], [0, 1], {}, ["prefill page list has 3", "decode page list has 2"]),
        ([0, 64], [0, 1], {}, ["src_pages[1]=64", "[0, 64)"]),
        ([0, 1], [-1, 1], {}, ["dst_pages[0]=-1"]),
        ([0, 1], [3, 3], {}, ["dst_pages repeats page id 3"]),
        ([[0, 1]], [0, 1], {}, ["src_pages must be a 1-D", "(1, 2)"]),
        ([0.5, 1.0], [0, 1], {}, ["src_pages must hold integers", "float64"]),
        (
            [0, 1],
            [0, 1],
            {"num_tokens": 9},
            ["prefill page list has 2 page(s) but tokens [0, 9) at page_size 4 need 3"],
        ),
        (
            [0, 1, 2],
            [0, 1],
            {"num_tokens": 5},
            ["prefill page list has 3 page(s) but 5 tokens at page_size 4 need at most 2"],
        ),
        (
            [0, 1],
            [0],
            {"num_tokens": 9, "token_stop": 8},
            ["decode page list has 1 page(s) but tokens [0, 8) at page_size 4 need 2"],
        ),
        ([0, 1], [0, 1], {"num_tokens": -1}, ["num_tokens=-1"]),
        ([0, 1], [0, 1], {"token_start": 3, "token_stop": 2}, ["token range [3, 2)", "8 token(s)"]),
        ([0, 1], [0, 1], {"token_stop": 9}, ["token range [0, 9)"]),
        ([0, 1], [0, 1], {"token_start": 1.5}, ["token_start=1.5"]),
        ([0, 1], [0, 1], {"path": "sideways"}, ["path='sideways'", "auto, direct, staged, per_token"]),
    ],
)
def test_bad_page_lists_and_ranges_are_rejected(src_pages, dst_pages, kw, words):
    t, src, dst = _pair(p=2, d=2)
    with pytest.raises(PlanError) as exc:
        plan_pair(t, src, dst, src_pages, dst_pages, **kw)
    for w in words:
        assert w in str(exc.value)


def test_num_tokens_is_required_when_page_sizes_differ():
    t, src, dst = _pair(p=2, d=2, ps=4, pd=8)
    with pytest.raises(
        PlanError, match=r"num_tokens is required when page sizes differ \(prefill page_size=4, decode page_size=8\)"
    ):
        plan_pair(t, src, dst, [0, 1], [0])
    assert plan_pair(t, src, dst, [0, 1], [0], num_tokens=8).num_tokens == 8


def test_transfer_must_belong_to_the_placements():
    t, src, dst = _pair(p=2, d=1)
    other = src.geometry.placement(2, 1)
    with pytest.raises(
        PlanError, match="transfer is for prefill rank 0 -> decode rank 0, but the placements are prefill rank 1"
    ):
        plan_pair(t, other, dst, [0], [0])
    wrong_tp = src.geometry.placement(4, 0)
    with pytest.raises(PlanError, match="outside the 2 local head"):
        plan_pair(t, wrong_tp, dst, [0], [0])


def test_transfer_built_for_another_layout_is_rejected():
    t = plan_tp(8, 2, 1).transfers[1]  # prefill rank 1 holds global heads 4..7
    g = KVGeometry(num_layers=1, total_kv_heads=8, head_dim=8)
    shifted = type(t)(t.prefill_rank, t.decode_rank, t.src_head_start, 0, t.num_heads, t.global_head_start)
    with pytest.raises(PlanError, match="dst local head 0 is global head 0, but the transfer starts at global head 4"):
        plan_pair(shifted, g.placement(2, 1), g.placement(1, 0), [0], [0])


def test_a_pool_of_every_head_is_read_at_the_owned_heads_places():
    """From a prefill rank whose pool holds every head (``all_heads``), the plan's heads are
    rebased into the pool (rank 1 of 2 owns heads 4..7: pool heads 4..7); a transfer of heads
    the rank does not own is refused, though its pool holds them; the plan's own (rebased)
    transfer plans again unchanged."""
    g = KVGeometry(num_layers=1, total_kv_heads=8, head_dim=8)
    t = plan_tp(8, 2, 1).transfers[1]
    assert (t.src_head_start, t.global_head_start) == (0, 4)
    pair = plan_pair(t, g.placement(2, 1, all_heads=True), g.placement(1, 0), [0], [0], path="staged")
    assert (pair.transfer.src_head_start, pair.transfer.dst_head_start) == (4, 4)
    assert plan_pair(pair.transfer, pair.src, pair.dst, [0], [0], path="staged").transfer == pair.transfer
    stolen = type(t)(1, 0, 0, 0, 4, 0)  # heads 0..3 (prefill rank 0's) from rank 1
    with pytest.raises(PlanError, match=r"src heads \[0, 4\) \(global\) are not owned by src rank 1 of 2"):
        plan_pair(stolen, g.placement(2, 1, all_heads=True), g.placement(1, 0), [0], [0])


def test_incompatible_geometries_are_rejected_before_planning():
    t, src, _ = _pair(p=2, d=1)
    other = KVGeometry(num_layers=3, total_kv_heads=8, head_dim=4, dtype="bf16").placement(1, 0)
    with pytest.raises(IncompatibleGeometryError, match="head_dim: prefill=8 decode=4"):
        plan_pair(t, src, other, [0], [0])


def _p1_d1_32k(page_tokens=16, head_dim=64, layers=4, tokens=16 * 40, seed=3):
    """P1 -> D1, NHD both sides, 8 heads of float32: 32 KiB per page and buffer at
    ``page_tokens=16, head_dim=64``; scattered pages on both sides."""
    g = KVGeometry(
        num_layers=layers, total_kv_heads=8, head_dim=head_dim, dtype="float32", page_size=page_tokens, num_pages=128
    )
    t = plan_tp(8, 1, 1).transfers[0]
    rng = np.random.default_rng(seed)
    n = -(-tokens // page_tokens)
    return t, g.placement(1, 0), g.placement(1, 0), rng.permutation(128)[:n], rng.permutation(128)[:n], tokens


def _moves_like_the_oracle(plan, src, dst, src_pages, dst_pages, tokens):
    g = src.geometry
    k_full, v_full = full_kv(g.num_layers, 8, tokens, g.head_dim, g.v_head_dim, seed=tokens)
    src_pool = place_tokens(src, empty_pool(src, POISON), k_full, v_full, src_pages, tokens)
    got = empty_pool(dst)
    apply_plan(plan, src_pool, got)
    want = place_tokens(dst, empty_pool(dst), k_full, v_full, dst_pages, tokens)
    return all(np.array_equal(a, b) for a, b in zip(got, want))


def test_cost_rule_sends_32k_pages_direct_over_local_and_says_why():
    t, src, dst, sp, dp, tokens = _p1_d1_32k()
    plan = plan_pair(t, src, dst, sp, dp, num_tokens=tokens, cost=LOCAL_CPU)
    assert plan.path == "direct", plan.reason
    ops = plan.direct_op_count
    assert int(np.mean([r[2] for r in plan.k_ops])) >= 32 << 10  # page runs of at least one page
    # the reason carries both estimates, with their terms, and names the cost's source
    assert f"direct {ops} op(s) x 1 us" in plan.reason and "<= staged 2 x" in plan.reason
    assert "GB/s" in plan.reason and "local-like" in plan.reason
    assert plan.reason.endswith("ms (local-like)")
    assert LOCAL_CPU.direct_s(ops, plan.nbytes) <= LOCAL_CPU.staged_s(plan.staged_op_count, plan.nbytes)
    assert _moves_like_the_oracle(plan, src, dst, sp, dp, tokens)


def test_cost_rule_stages_tiny_scattered_ops_over_tcp():
    # 1-token pages of 8 heads x 8 float32: 256 B per op, no two pages adjacent
    t, src, dst, sp, dp, tokens = _p1_d1_32k(page_tokens=1, head_dim=8, tokens=100)
    plan = plan_pair(t, src, dst, sp, dp, num_tokens=tokens, cost=TCP_CPU)
    assert plan.path == "staged" and plan.direct_op_count == 4 * 2 * 100
    assert "contiguous but fragmented, 256 B per op" in plan.reason and "> staged" in plan.reason
    assert "tcp-like" in plan.reason
    assert _moves_like_the_oracle(plan, src, dst, sp, dp, tokens)
    # the same pair, 32 KiB pages: tcp's per-entry cost is small next to two copies of them
    t, src, dst, sp, dp, tokens = _p1_d1_32k()
    assert plan_pair(t, src, dst, sp, dp, num_tokens=tokens, cost=TCP_CPU).path == "direct"


def test_a_costly_op_stages_what_a_cheap_one_sends_direct():
    """The choice follows the declared numbers: a GPU-like cost (10 us per copy call, copies
    at device-memory speed) stages the 32 KiB pages that local CPU memory sends direct."""
    t, src, dst, sp, dp, tokens = _p1_d1_32k()
    gpu = PathCost(10e-6, 100e9, 500e9, source="gpu-like")
    plan = plan_pair(t, src, dst, sp, dp, num_tokens=tokens, cost=gpu)
    assert plan.path == "staged" and "gpu-like" in plan.reason
    assert _moves_like_the_oracle(plan, src, dst, sp, dp, tokens)


def test_overrides_win_over_the_cost_rule():
    t, src, dst, sp, dp, tokens = _p1_d1_32k()
    # an explicit KVXFER_DIRECT_MIN_OP_BYTES (the old rule): 32 KiB ops < 64 KiB -> staged
    plan = plan_pair(t, src, dst, sp, dp, num_tokens=tokens, cost=LOCAL_CPU, direct_min_op_bytes=64 << 10)
    assert plan.path == "staged"
    assert "< direct_min_op_bytes=65536, the fixed rule, KVXFER_DIRECT_MIN_OP_BYTES" in plan.reason
    low = plan_pair(t, src, dst, sp, dp, num_tokens=tokens, cost=TCP_CPU, direct_min_op_bytes=4096)
    assert low.path == "direct" and "the fixed rule, direct_min_op_bytes=4096" in low.reason
    # the data path (KVXFER_DATA_PATH) wins over both
    assert plan_pair(t, src, dst, sp, dp, num_tokens=tokens, cost=LOCAL_CPU, path="staged").path == "staged"
    t2, src2, dst2, sp2, dp2, tokens2 = _p1_d1_32k(page_tokens=1, head_dim=8, tokens=100)
    forced = plan_pair(t2, src2, dst2, sp2, dp2, num_tokens=tokens2, cost=TCP_CPU, path="direct")
    assert forced.path == "direct" and forced.reason == "contiguous on both sides"
    assert _moves_like_the_oracle(forced, src2, dst2, sp2, dp2, tokens2)


def test_without_a_cost_the_fixed_rule_decides():
    """No cost (a transport that declares none): the fixed 64 KiB rule, as before."""
    t, src, dst, sp, dp, tokens = _p1_d1_32k()
    plan = plan_pair(t, src, dst, sp, dp, num_tokens=tokens)
    assert plan.path == "staged"
    assert "< direct_min_op_bytes=65536, the fixed rule, KVXFER_DIRECT_MIN_OP_BYTES" in plan.reason
    big = _p1_d1_32k(page_tokens=32)  # 64 KiB pages
    assert plan_pair(*big[:5], num_tokens=big[5]).path == "direct"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(per_op_s=-1.0), "PathCost.per_op_s=-1.0 must be >= 0"),
        (dict(bytes_per_s=0.0), "PathCost.bytes_per_s=0.0 must be > 0"),
        (dict(copy_bytes_per_s=float("inf")), "PathCost.copy_bytes_per_s=inf must be a finite number"),
        (dict(stage_fixed_s="1"), "PathCost.stage_fixed_s='1' must be a finite number"),
    ],
)
def test_path_cost_rejects_bad_numbers(kwargs, message):
    args = {**dict(per_op_s=1e-6, bytes_per_s=1e9, copy_bytes_per_s=1e9), **kwargs}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PathCost(**args)
