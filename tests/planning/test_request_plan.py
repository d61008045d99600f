"""``RequestPlan``: built once, extended per chunk (checking only new pages), cut per token
range into the same slices and ops ``plan_pair`` gives for that range."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_kvxfer.errors import PlanError
from sglang_kvxfer.planning import DataPath, KVSlice, RequestPlan, plan_pair
from sglang_kvxfer.planning.byteplan import coalesce

from .test_byteplan import _pair


def _staged_ranges():
    return [(0, 5), (5, 13), (13, 32), (31, 32), (8, 16)]


@pytest.mark.parametrize("a, b", _staged_ranges())
def test_slices_cover_the_same_tokens_as_plan_pair(a, b):
    t, src, dst = _pair(p=2, d=1)
    sp, dp = np.arange(8)[::-1].copy(), np.arange(8, 16)
    plan = RequestPlan.build(t, src, dst, sp, dp, num_tokens=32, path="staged")
    one = plan_pair(t, src, dst, sp, dp, num_tokens=32, token_start=a, token_stop=b, path="staged")
    for mine, theirs in (
        (plan.gather_slice(a, b), one.gather_slice()),
        (plan.scatter_slice(a, b), one.scatter_slice()),
    ):
        assert isinstance(mine, KVSlice) and mine.num_tokens == b - a
        ps = mine.page_size
        tokens = np.arange(a, b)
        # token t of the request lands on the same page and slot either way
        got = mine.pages[(tokens - a + mine.token_offset) // ps]
        want = theirs.pages[(tokens - a + theirs.token_offset) // ps]
        assert got.tolist() == want.tolist()
        assert len(mine.pages) <= -(-(b - a) // ps) + 1  # only the pages of the range
    assert plan.nbytes(a, b) == one.staging_nbytes


def test_direct_chunks_match_plan_pair_and_extend_checks_only_new_pages():
    t, src, dst = _pair(p=2, d=2)
    sp, dp = np.arange(10, 20), np.arange(0, 10)
    plan = RequestPlan.build(t, src, dst, sp[:4], dp, num_tokens=40, path="direct")
    assert plan.path is DataPath.DIRECT and plan.path == "direct"
    plan = plan.extend(sp[4:])
    for a, b in ((0, 16), (16, 40)):
        one = plan_pair(t, src, dst, sp, dp, num_tokens=40, token_start=a, token_stop=b, path="direct")
        assert plan.direct(a, b).k_ops.tolist() == one.k_ops.tolist()
    with pytest.raises(PlanError, match=r"src_pages\[10\]=.* outside|need at most"):
        plan.extend([10_000])


def test_slices_need_the_pages_and_the_range():
    t, src, dst = _pair(p=2, d=1)
    plan = RequestPlan.build(t, src, dst, [0, 1], list(range(8)), num_tokens=32, path="staged")
    with pytest.raises(PlanError, match=r"prefill page list has 2 page\(s\) but tokens \[0, 12\)"):
        plan.gather_slice(4, 12)
    with pytest.raises(PlanError, match=r"token range \[4, 40\) must lie within the request's 32"):
        plan.gather_slice(4, 40)
    with pytest.raises(PlanError, match="is staged"):
        plan.direct(0, 4)
    with pytest.raises(PlanError, match=r"dst_pages repeats page id 1"):
        RequestPlan.build(t, src, dst, [0], [1, 1], num_tokens=32)
    with pytest.raises(PlanError, match=r"path='sideways' must be one of auto, direct, staged, per_token"):
        RequestPlan.build(t, src, dst, [0], [1], num_tokens=32, path="sideways")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ps=st.sampled_from([1, 2, 4, 8]),
    pd=st.sampled_from([1, 2, 4, 8]),
    seed=st.integers(0, 2**16),
    tokens=st.integers(1, 32),  # the decode pool of _pair has 32 pages
    cut=st.integers(0, 32),
    layout=st.sampled_from(["NHD", "NHD_KV"]),
)
def test_direct_token_runs_are_the_coalesced_per_token_ops(ps, pd, seed, tokens, cut, layout):
    # The direct ops of contiguous NHD pairs are token runs scaled to bytes, uncoalesced: each
    # must be exactly what coalescing one op per token gives, for any page lists and sizes
    # (runs inside one page, runs across pages that happen to follow each other).
    t, src, dst = _pair(p=2, d=2, ps=ps, pd=pd, lp=layout, ld=layout)
    rng = np.random.default_rng(seed)
    sp = rng.permutation(64)[: -(-tokens // ps)]
    if rng.random() < 0.5:  # consecutive pages: runs that continue over page ends
        sp = np.arange(len(sp)) + int(rng.integers(0, 64 - len(sp) + 1))
    dp = rng.permutation(32)[: -(-tokens // pd)]
    a = min(cut, tokens - 1)
    plan = RequestPlan.build(t, src, dst, sp, dp, num_tokens=tokens, path="direct")
    rows = plan_pair(t, src, dst, sp, dp, num_tokens=tokens, token_start=a, path="per_token")
    got = plan.direct(a, tokens)
    assert got.k_ops.tolist() == coalesce(*rows.k_ops.T).tolist()
    if rows.v_ops is not None:
        assert got.v_ops is not None and got.v_ops.tolist() == coalesce(*rows.v_ops.T).tolist()
    assert not got.k_ops.flags.writeable


def test_the_whole_requests_direct_ops_are_built_once_and_survive_extend():
    t, src, dst = _pair(p=2, d=2)
    sp, dp = np.arange(10, 20), np.arange(0, 10)
    plan = RequestPlan.build(t, src, dst, sp, dp, num_tokens=40)
    assert plan.path is DataPath.DIRECT and plan.whole is not None
    assert plan.direct(0, 40) is plan.whole  # the ops auto weighed, not planned again
    fresh = plan_pair(t, src, dst, sp, dp, num_tokens=40, path="direct")
    assert plan.whole.k_ops.tolist() == fresh.k_ops.tolist()
    assert plan.direct(0, 16) is not plan.whole
    # a plan built before the writer's pages all came covers part of the request: nothing kept
    part = RequestPlan.build(t, src, dst, sp[:4], dp, num_tokens=40)
    assert part.whole is None
    assert part.extend(sp[4:]).direct(0, 40).k_ops.tolist() == fresh.k_ops.tolist()
