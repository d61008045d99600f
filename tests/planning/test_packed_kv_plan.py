"""Planning for the packed K-and-V pools (one buffer per layer): NHD_KV (vLLM's GPU cache:
each (token, head) row K then V) and HND_KV (vLLM's CPU cache: each (page, head) tile K rows
then V rows). The oracle over TP combinations, every other layout, page sizes, K/V dims and
every path; the shape of direct ops (NHD_KV: all heads of a token are one row run, any page
sizes; HND_KV: a page's head range is one run of ``heads * 2 * page_size`` rows); when a pair
must be staged; the numpy executor against the torch ops; ``kvxfer plan``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sglang_kvxfer import ops
from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.planning import DataPath, DirectPlan, RequestPlan, StagedPlan, plan_pair, plan_tp
from sglang_kvxfer.planning.executor import gather_np, scatter_np

from .test_tp_oracle import MHA_CASES, run_oracle

# packing -> the layouts it is checked against over MHA_CASES (the packing itself first)
KV_LAYOUTS = {"NHD_KV": ("NHD_KV", "NHD", "HND", "HND_KV"), "HND_KV": ("HND_KV", "NHD", "HND")}
OTHERS = [(packing, other) for packing, layouts in KV_LAYOUTS.items() for other in layouts[1:]]


def _pair(packing, h=8, p=2, d=1, ps=4, pd=4, lp=None, ld=None, dim=8, vdim=8):
    """A (transfer, prefill placement, decode placement) of 3 layers; both sides ``packing``
    unless ``lp``/``ld`` say otherwise."""
    common = dict(num_layers=3, total_kv_heads=h, head_dim=dim, v_head_dim=vdim, dtype="bf16")
    gp = KVGeometry(**common, page_size=ps, layout=lp or packing, num_pages=64)
    gd = KVGeometry(**common, page_size=pd, layout=ld or packing, num_pages=32)
    t = plan_tp(h, p, d).transfers[0]
    return t, gp.placement(p, t.prefill_rank), gd.placement(d, t.decode_rank)


@pytest.mark.parametrize("chunk", range(4))
@pytest.mark.parametrize("packing", KV_LAYOUTS)
def test_mha_configurations_with_a_packing_match_the_oracle(packing, chunk):
    paths = set()
    for i, (h, p, d) in enumerate(MHA_CASES[chunk::24]):
        for path in ("auto", "direct", "staged", "per_token"):
            paths |= run_oracle(h, p, d, path=path, variant=i, layouts=KV_LAYOUTS[packing], v_head_dim=2)
    assert paths == {"direct", "staged"}


@pytest.mark.parametrize(("packing", "other"), OTHERS)
@pytest.mark.parametrize("h,p,d", [(8, 2, 1), (8, 1, 2), (2, 2, 2), (1, 1, 1)])
def test_a_packing_to_and_from_other_layouts_matches_the_oracle_staged(h, p, d, packing, other):
    for layouts in ((packing, other), (other, packing)):
        for variant in range(4):  # decode layout is layouts[(variant + d) % 2]
            run_oracle(h, p, d, variant=variant, layouts=layouts, v_head_dim=2, pages=(4, 4))
            run_oracle(h, p, d, variant=variant, layouts=layouts, v_head_dim=2, pages=(2, 4), path="per_token")


# packing -> (v_head_dim, k_dim of the ops call, page bytes of one rank with all 4 heads)
EXECUTOR = {"NHD_KV": (2, 3, 4 * 4 * (3 + 2) * 4), "HND_KV": (None, None, 4 * 2 * 4 * 3 * 4)}


@pytest.mark.parametrize("packing", EXECUTOR)
def test_numpy_executor_and_torch_ops_read_the_same_rows(packing):
    v_head_dim, k_dim, page_nbytes = EXECUTOR[packing]
    g = KVGeometry(
        num_layers=2, total_kv_heads=4, head_dim=3, v_head_dim=v_head_dim, dtype="float32", page_size=4, layout=packing
    )
    place = g.placement(1, 0)
    assert g.num_buffers == 2 and place.page_nbytes(0) == page_nbytes
    if packing == "NHD_KV":
        assert place.buffer_shape(0) == (g.num_pages, 4, 4, 5)
    rng = np.random.default_rng(0)
    bufs = [rng.standard_normal(place.buffer_shape(i)).astype(np.float32) for i in range(g.num_buffers)]
    pages = np.array([9, 2, 100])
    staging = gather_np(place, bufs, pages, 1, 2, 1, 9)
    torch_bufs = [torch.from_numpy(b) for b in bufs]
    kw = dict(page_size=4, head_start=1, num_heads=2, layout=packing, token_offset=1, num_tokens=9, k_dim=k_dim)
    assert np.array_equal(staging, ops.gather_kv_heads_reference(torch_bufs, None, pages, **kw).numpy())
    out = [np.zeros_like(b) for b in bufs]
    scatter_np(place, out, staging, pages, 1, 2, 1, 9)
    back = ops.gather_kv_heads_reference([torch.from_numpy(b) for b in out], None, pages, **kw)
    assert np.array_equal(back.numpy(), staging)


# NHD_KV


@pytest.mark.parametrize("v_head_dim", [2, 5])
@pytest.mark.parametrize("pages", [(4, 4), (3, 3), (2, 4), (4, 1)])
@pytest.mark.parametrize("path", ["auto", "direct", "staged", "per_token"])
@pytest.mark.parametrize("h,p,d", [(8, 2, 1), (8, 1, 2), (2, 1, 8), (2, 8, 2), (4, 4, 4), (1, 1, 3)])
def test_nhd_kv_both_sides_match_the_oracle(h, p, d, path, pages, v_head_dim):
    paths = run_oracle(h, p, d, path=path, layouts=("NHD_KV",), v_head_dim=v_head_dim, pages=pages)
    if path == "per_token":
        assert paths == {"direct"}
    elif path == "staged":
        assert paths == {"staged"}
    elif path == "direct" and p == d:  # equal TP: all local heads on both sides, any page sizes
        assert paths == {"direct"}


def test_equal_tp_is_one_run_of_k_and_v_rows_per_page_run():
    t, src, dst = _pair("NHD_KV", p=2, d=2, ps=4, pd=8, vdim=4)  # 4 local heads, rows of (8 + 4) bf16
    plan = plan_pair(t, src, dst, [10, 11, 3, 4], [2, 0], num_tokens=16, path="direct")
    assert isinstance(plan, DirectPlan) and plan.v_ops is None
    token = 4 * (8 + 4) * 2
    # src pages 10, 11 are consecutive (tokens 0..7 -> dst page 2); 3, 4 (tokens 8..15 -> dst page 0)
    assert plan.k_ops.tolist() == [[10 * 4 * token, 2 * 8 * token, 8 * token], [3 * 4 * token, 0, 8 * token]]
    assert plan.direct_op_count == 3 * 2
    assert plan.nbytes == 3 * 16 * 4 * (8 + 4) * 2 == sum(int(plan.buffer_ops(i)[:, 2].sum()) for i in range(3))


def test_a_head_slice_is_strided_and_staged():
    t, src, dst = _pair("NHD_KV", p=1, d=2)
    plan = plan_pair(t, src, dst, [0, 1], [0, 1], path="direct")
    assert isinstance(plan, StagedPlan) and plan.gather_slice().layout == "NHD_KV"


def test_one_local_head_nhd_kv_is_not_nhd():
    """With one head per rank NHD and HND are the same bytes; NHD_KV is neither: stage."""
    t, src, dst = _pair("NHD_KV", h=2, p=2, d=2, lp="NHD_KV", ld="NHD")
    plan = plan_pair(t, src, dst, [0, 1], [0, 1], path="direct")
    assert isinstance(plan, StagedPlan) and "layouts differ (NHD_KV -> NHD)" in plan.reason


@pytest.mark.parametrize("lp,ld", [("NHD_KV", "HND_KV"), ("NHD", "NHD_KV"), ("NHD_KV", "HND")])
def test_per_token_between_different_packings_is_staged(lp, ld):
    t, src, dst = _pair("NHD_KV", lp=lp, ld=ld)
    plan = plan_pair(t, src, dst, [0, 1], [0, 1], path="per_token")
    assert isinstance(plan, StagedPlan) and "per_token needs the same buffers on both sides" in plan.reason
    same = RequestPlan.build(*_pair("NHD_KV"), [0, 1], [0, 1], num_tokens=8, path="per_token")
    assert same.path is DataPath.PER_TOKEN
    assert same.direct(0, 8).direct_op_count == 3 * 8  # layers x tokens: a token's K and V rows in one op


def test_kvxfer_plan_selects_nhd_kv_in_json_and_table(capsys):
    from sglang_kvxfer.cli import main

    base = ["plan", "--total-kv-heads", "8", "--prefill-tp", "2", "--decode-tp", "2", "--tokens", "64"]
    base += ["--layers", "2", "--pages", "contiguous", "--decode-page-size", "32"]
    assert main([*base, "--prefill-layout", "nhd_kv", "--decode-layout", "NHD_KV", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["request"]["prefill_layout"], out["request"]["decode_layout"]) == ("NHD_KV", "NHD_KV")
    # Equal TP: every token's heads are one row run, so contiguous pages coalesce to one op per layer.
    assert all(t["path"] == "direct" and t["ops_direct"] == 2 for t in out["transfers"])
    assert main([*base, "--prefill-layout", "NHD_KV", "--decode-layout", "HND"]) == 0
    text = capsys.readouterr().out
    assert "layout NHD_KV/HND" in text and "staged: layouts differ (NHD_KV -> HND)" in text


# HND_KV


@pytest.mark.parametrize("pages", [(4, 4), (3, 3), (2, 4), (4, 1)])
@pytest.mark.parametrize("path", ["auto", "direct", "staged", "per_token"])
@pytest.mark.parametrize("h,p,d", [(8, 2, 1), (8, 1, 2), (2, 1, 8), (2, 8, 2), (4, 4, 4), (1, 1, 3)])
def test_hnd_kv_both_sides_match_the_oracle(h, p, d, path, pages):
    paths = run_oracle(h, p, d, path=path, layouts=("HND_KV",), v_head_dim=2, pages=pages)
    if path == "per_token":  # one op per token row: any page sizes
        assert paths == {"direct"}
    elif path == "staged" or pages[0] != pages[1]:
        assert paths == {"staged"}
    elif path == "direct":
        assert paths == {"direct"}


def test_full_page_head_range_is_one_run_with_k_and_v():
    t, src, dst = _pair("HND_KV", p=1, d=2, ps=16, pd=16)  # prefill 8 heads -> decode rank 0, heads 0..3
    plan = plan_pair(t, src, dst, [5, 9], [2, 3], path="direct")
    assert isinstance(plan, DirectPlan) and plan.v_ops is None
    row = 8 * 2  # head_dim x bf16
    tile = 2 * 16 * row  # a (page, head) tile: 16 K rows then 16 V rows
    run = 4 * tile  # the decode rank's 4 heads of one page
    # src page 5 heads 0..3 -> dst page 2; src page 9 -> dst page 3 (contiguous on the decode side only)
    assert plan.k_ops.tolist() == [[5 * 8 * tile, 2 * 4 * tile, run], [9 * 8 * tile, 3 * 4 * tile, run]]
    assert plan.direct_op_count == 3 * 2  # one buffer per layer
    assert plan.nbytes == 3 * 32 * 4 * (8 + 8) * 2 == sum(int(plan.buffer_ops(i)[:, 2].sum()) for i in range(3))
    with pytest.raises(ValueError, match=r"buffer_index=3 must be in \[0, 3\)"):
        plan.buffer_ops(3)


def test_equal_tp_consecutive_pages_coalesce_to_one_op_per_layer():
    t, src, dst = _pair("HND_KV", p=2, d=2, ps=4, pd=4)
    plan = plan_pair(t, src, dst, list(range(10, 20)), list(range(0, 10)))
    assert plan.path == "direct" and plan.direct_op_count == 3
    run = 10 * 4 * 2 * 4 * 8 * 2  # 10 pages x 4 heads x (K + V) x 4 slots x row
    assert plan.k_ops.tolist() == [[10 * 4 * 2 * 4 * 8 * 2, 0, run]]


def test_partial_pages_need_one_op_per_head_and_kind():
    t, src, dst = _pair("HND_KV", p=1, d=2, ps=4, pd=4)
    plan = plan_pair(t, src, dst, [7, 1], [2, 0], num_tokens=6, token_start=1, token_stop=6, path="direct")
    row, tile = 16, 2 * 4 * 16
    ops_ = plan.k_ops.tolist()
    # page 0 of the request: tokens 1..3 (slots 1..3) of 4 heads, K then V of each head
    first = [[(7 * 8 + h) * tile + kind * 4 * row + row, (2 * 4 + h) * tile + kind * 4 * row + row, 3 * row]
             for h in range(4) for kind in (0, 1)]  # fmt: skip
    assert ops_[:8] == first
    # page 1: tokens 4..5 (slots 0..1)
    second = [[(1 * 8 + h) * tile + kind * 4 * row, (0 * 4 + h) * tile + kind * 4 * row, 2 * row]
              for h in range(4) for kind in (0, 1)]  # fmt: skip
    assert ops_[8:] == second


def test_one_local_head_hnd_kv_is_not_nhd():
    """With one head per rank NHD and HND are the same bytes; HND_KV is not: stage."""
    t, src, dst = _pair("HND_KV", h=2, p=2, d=2, lp="HND_KV", ld="NHD")
    plan = plan_pair(t, src, dst, [0, 1], [0, 1], path="direct")
    assert isinstance(plan, StagedPlan) and "layouts differ (HND_KV -> NHD)" in plan.reason
    assert plan.gather_slice().layout == "HND_KV" and plan.scatter_slice().layout == "NHD"


@pytest.mark.parametrize("lp,ld", [("HND_KV", "HND"), ("NHD", "HND_KV")])
def test_per_token_between_packed_and_separate_buffers_is_staged(lp, ld):
    t, src, dst = _pair("HND_KV", lp=lp, ld=ld)
    plan = plan_pair(t, src, dst, [0, 1], [0, 1], path="per_token")
    assert isinstance(plan, StagedPlan) and "per_token needs the same buffers on both sides" in plan.reason
    req = RequestPlan.build(t, src, dst, [0, 1], [0, 1], num_tokens=8, path="per_token")
    assert req.path is DataPath.STAGED and req.staged and "per_token" in req.reason
    same = RequestPlan.build(*_pair("HND_KV"), [0, 1], [0, 1], num_tokens=8, path="per_token")
    assert same.path is DataPath.PER_TOKEN
    assert same.direct(0, 8).direct_op_count == 3 * 8 * 4 * 2  # layers x tokens x heads x (K, V)


def test_request_plan_direct_chunks_of_hnd_kv():
    t, src, dst = _pair("HND_KV", p=1, d=2, ps=4, pd=4)
    req = RequestPlan.build(t, src, dst, [3, 1, 2], [7, 0, 4], num_tokens=12)
    assert req.path is DataPath.DIRECT and req.token_nbytes == 3 * 4 * (8 + 8) * 2
    whole = plan_pair(t, src, dst, [3, 1, 2], [7, 0, 4], num_tokens=12)
    assert np.array_equal(req.direct(0, 12).k_ops, whole.k_ops)
    assert req.gather_slice(0, 12).layout == "HND_KV"
