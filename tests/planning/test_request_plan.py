"""``RequestPlan``: built once, extended per chunk (checking only new pages), cut per token
range into the same slices and ops ``plan_pair`` gives for that range."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_kvxfer.errors import PlanError
from sglang_kvxfer.planning import DataPath, KVSlice, RequestPlan, plan_pair

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
