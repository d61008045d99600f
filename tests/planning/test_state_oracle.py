"""The planner over the geometries of SGLang's extra per-request state (``sglang_state``),
against the brute-force oracle: the geometry each rank's translation gives its state pool is
planned and applied, and every decode state buffer must equal what the oracle says.

- SWA: the sliding-window sub-pool's heads (their own count, not the model's) re-sharded
  between every valid pair of TP sizes, window pages scattered on both sides.
- Rows (mamba, DSA): one row per index. Mamba's rows are each rank's own shard: at equal TP
  every plan (any room) is rank to rank, so each decode rank holds exactly its prefill peer's
  rows. DSA's rows are replicated: between any TP sizes every decode rank holds them, from one
  writer.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from sglang_kvxfer.integrations.sglang_state import states_from_kv_args
from sglang_kvxfer.planning import plan_pair, plan_tp
from sglang_kvxfer.planning.executor import apply_plan

from .oracle import POISON, empty_pool, full_kv, place_tokens

PS, SWA_LAYERS, HEAD_DIM, V_DIM, ROWS = 2, 2, 2, 3, 24  # SWA sub-pool: page size, layers, dims, token rows


def _valid(h, t):
    return (t <= h and h % t == 0) or (t > h and t % h == 0)


SWA_CASES = [
    (h, p, d) for h in (1, 2, 4, 8) for p in (1, 2, 4, 8) for d in (1, 2, 4, 8) if _valid(h, p) and _valid(h, d)
]


def _bag(kind: str, items: list[int], lens: list[int]) -> SimpleNamespace:
    """KVArgs' state fields of one component, as setup_state_kv_args fills them."""
    return SimpleNamespace(
        state_types=[kind],
        state_data_ptrs=[[0x1000 * (i + 1) for i in range(len(items))]],
        state_data_lens=[lens],
        state_item_lens=[items],
        swa_kv_cache_layout="nhd",
    )


def swa_geometry(h: int, tp: int, rank: int):
    local = max(1, h // tp)  # the SWA sub-pool's heads on the rank (SGLang's swa_head_num)
    items = [PS * local * d * 4 for d in [HEAD_DIM] * SWA_LAYERS + [V_DIM] * SWA_LAYERS]  # float32
    bag = _bag("swa", items, [it * (ROWS // PS) for it in items])
    (pool,) = states_from_kv_args(
        bag, tp_size=tp, rank=rank, mla=False, dtype="float32", page_size=PS, swa_kv_heads=lambda: h
    )
    return pool.geometry


@pytest.mark.parametrize("h, p, d", SWA_CASES)
def test_swa_heads_reshard_between_every_tp_pair(h, p, d):
    window = 7  # window tokens (the last window of a longer prompt)
    pre = {r: swa_geometry(h, p, r).placement(p, r) for r in range(p)}
    dec = {r: swa_geometry(h, d, r).placement(d, r) for r in range(d)}
    g = pre[0].geometry
    assert (g.total_kv_heads, g.head_dim, g.v_head_dim, g.num_layers) == (h, HEAD_DIM, V_DIM, SWA_LAYERS)
    k_full, v_full = full_kv(SWA_LAYERS, h, window, HEAD_DIM, V_DIM, seed=h * 100 + p * 10 + d)
    rng = np.random.default_rng(h + p + d)
    src_pages = rng.permutation(g.num_pages)[: -(-window // PS)]
    dst_pages = rng.permutation(g.num_pages)[: -(-window // PS)]
    src = {r: place_tokens(pl, empty_pool(pl, POISON), k_full, v_full, src_pages, window) for r, pl in pre.items()}
    dst = {r: empty_pool(pl) for r, pl in dec.items()}
    for t in plan_tp(h, p, d, salt=h * d).transfers:
        pair = plan_pair(t, pre[t.prefill_rank], dec[t.decode_rank], src_pages, dst_pages, num_tokens=window)
        apply_plan(pair, src[t.prefill_rank], dst[t.decode_rank])
    for r, pl in dec.items():
        want = place_tokens(pl, empty_pool(pl), k_full, v_full, dst_pages, window)
        for i, (got, exp) in enumerate(zip(dst[r], want)):
            assert np.array_equal(got, exp), f"H_swa={h} P={p} D={d}: decode rank {r} SWA buffer {i} differs"


def row_geometry(kind: str, items: list[int], slots: int, tp: int, rank: int, mla: bool = False):
    pools = states_from_kv_args(
        _bag(kind, items, [i * slots for i in items]), tp_size=tp, rank=rank, mla=mla, dtype="bfloat16", page_size=4
    )
    return [pool.geometry.placement(tp, rank) for pool in pools]


def _rows(place, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 255, place.buffer_shape(b), dtype=np.uint8) for b in range(place.geometry.num_buffers)]


def _zeros(place) -> list[np.ndarray]:
    return [np.zeros(place.buffer_shape(b), dtype=np.uint8) for b in range(place.geometry.num_buffers)]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("salt", [0, 1, 7])
def test_mamba_rows_go_rank_to_rank_at_equal_tp(tp, salt):
    items, slots = [48, 48, 96, 96], 5  # conv rows of two layers, then SSM rows
    src_slot, dst_slot = np.array([3]), np.array([1])
    for pool in range(2):  # mamba.0 (conv), mamba.1 (SSM)
        pre = [row_geometry("mamba", items, slots, tp, r)[pool] for r in range(tp)]
        dec = [row_geometry("mamba", items, slots, tp, r)[pool] for r in range(tp)]
        src = [_rows(pl, seed=100 * r + pool) for r, pl in enumerate(pre)]  # each rank its own shard
        dst = [_zeros(pl) for pl in dec]
        plan = plan_tp(1, tp, tp, mla=True, salt=salt)
        assert [(t.prefill_rank, t.decode_rank) for t in plan.transfers] == [(r, r) for r in range(tp)]
        for t in plan.transfers:
            pair = plan_pair(t, pre[t.prefill_rank], dec[t.decode_rank], src_slot, dst_slot, num_tokens=1)
            apply_plan(pair, src[t.prefill_rank], dst[t.decode_rank])
        for r in range(tp):
            for b, (got, mine) in enumerate(zip(dst[r], src[r])):
                assert np.array_equal(got[dst_slot], mine[src_slot]), f"rank {r} entry {b}: another rank's row"
                others = np.setdiff1d(np.arange(slots), dst_slot)
                assert not got[others].any(), f"rank {r} entry {b}: a row no request was given changed"


@pytest.mark.parametrize("p, d", [(1, 1), (2, 1), (1, 2), (4, 2), (2, 8)])
def test_replicated_dsa_rows_reach_every_decode_rank_from_one_writer(p, d):
    items, pages = [40, 0, 40], 9  # the middle layer has no indexer buffer
    src_pages, dst_pages = np.array([5, 2, 7]), np.array([1, 8, 3])
    (g,) = row_geometry("dsa", items, pages, p, 0, mla=True)
    assert g.geometry.num_layers == 2
    rows = _rows(g, seed=p * 10 + d)  # the same on every prefill rank (replicated)
    src = {r: [x.copy() for x in rows] for r in range(p)}
    dec = {r: row_geometry("dsa", items, pages, d, r, mla=True)[0] for r in range(d)}
    dst = {r: _zeros(pl) for r, pl in dec.items()}
    plan = plan_tp(1, p, d, mla=True, salt=p + d)
    assert sorted(t.decode_rank for t in plan.transfers) == list(range(d))  # one writer each
    for t in plan.transfers:
        pre = row_geometry("dsa", items, pages, p, t.prefill_rank, mla=True)[0]
        pair = plan_pair(t, pre, dec[t.decode_rank], src_pages, dst_pages, num_tokens=len(src_pages))
        apply_plan(pair, src[t.prefill_rank], dst[t.decode_rank])
    for r in range(d):
        for b, got in enumerate(dst[r]):
            assert np.array_equal(got[dst_pages], rows[b][src_pages]), f"decode rank {r} entry {b} differs"
