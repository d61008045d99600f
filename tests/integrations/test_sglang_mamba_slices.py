"""Mamba state between attention TP sizes: the pools ``states_from_kv_args`` makes of SGLang's
mamba KVArgs (per-tensor dims, outer counts, GDN/Kimi conv sub-blocks, a replicated tensor)
and the head plan of each move the same bytes as SGLang's own
``compute_mamba_state_slice_byte_blocks`` (what mooncake and mori send).

Both are applied to real memory: every prefill rank's slot rows hold the oracle's shard
(``StateModel.mamba_row``: content a function of the un-sharded channel), our pools' plan is
executed with ``ctypes.memmove`` page by page (the pages ``state_pages`` gives a slot, the
heads ``plan_tp`` gives each writer), SGLang's blocks with the writers its backends pick; each
decode rank's slot must then hold, byte for byte, its own shard, and no other slot may change.
The engine itself moving these pools is ``test_sglang_state.py``.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

from sglang_kvxfer.integrations.sglang_state import state_pages, states_from_kv_args
from sglang_kvxfer.planning.tp import plan_tp
from tests.integrations.sglang_env import Model, import_sglang_base, load_utils_defs
from tests.integrations.sglang_state_env import StateModel, attach

_base, _reason = import_sglang_base()
pytestmark = pytest.mark.skipif(_base is None, reason=_reason)

ROOM = 0x3A3B_5EED
SRC_SLOT, DST_SLOT = 2, 5
NAMES = (
    "append_state_component",
    "compute_mamba_state_slice_blocks",
    "compute_mamba_state_slice_byte_blocks",
    "should_send_replicated_state",
)


def _side(state: StateModel, tp: int, defs):
    """Every rank of one server: (KVArgs, state buffers, our pools)."""
    model = Model(total_kv_heads=4, kv_cache_dtype_str="bfloat16", mla=False, state=state)
    out = []
    for rank in range(tp):
        args = SimpleNamespace()
        mem = attach(model, tp, rank, args, defs)
        pools = states_from_kv_args(args, tp_size=tp, rank=rank, mla=False, dtype="bfloat16", page_size=4)
        out.append((args, mem.buffers["mamba"], pools))
    return out


def _rows(buffers, slot: int) -> list[np.ndarray]:
    import torch

    return [b.view(torch.uint8).reshape(b.shape[0], -1)[slot].numpy().copy() for b in buffers]


def _fill(state: StateModel, tp: int, side) -> None:
    import torch

    for rank, (_, buffers, _) in enumerate(side):
        for e, b in enumerate(buffers):
            b.view(torch.uint8).reshape(b.shape[0], -1)[SRC_SLOT] = torch.from_numpy(state.mamba_row(ROOM, e, tp, rank))


def _move_ours(p: int, d: int, pre, dec) -> None:
    for k, pool in enumerate(pre[0][2]):
        g = pool.geometry
        for t in plan_tp(g.total_kv_heads, p, d, g.mla, salt=ROOM).transfers:
            src, dst = pre[t.prefill_rank][2][k], dec[t.decode_rank][2][k]
            assert (src.name, dst.name) == (pool.name, pool.name)
            src_pages = state_pages([src], [[np.asarray(SRC_SLOT)]])[0]
            dst_pages = state_pages([dst], [[np.asarray(DST_SLOT)]])[0]
            assert len(src_pages) == len(dst_pages)
            src_width = src.geometry.placement(p, t.prefill_rank).num_local_heads * g.head_dim
            dst_width = dst.geometry.placement(d, t.decode_rank).num_local_heads * g.head_dim
            for s_ptr, d_ptr in zip(src.ptrs, dst.ptrs):
                for sp, dp in zip(src_pages, dst_pages):
                    ctypes.memmove(
                        d_ptr + int(dp) * dst_width + t.dst_head_start * g.head_dim,
                        s_ptr + int(sp) * src_width + t.src_head_start * g.head_dim,
                        t.num_heads * g.head_dim,
                    )


def _writers(p: int, d: int, rank: int) -> list[int]:
    """The prefill ranks SGLang's backends send decode rank ``rank``'s mamba slot from."""
    if p > d:
        return [q for q in range(p) if q // (p // d) == rank]
    return [rank // (d // p)]


def _move_sglang(p: int, d: int, pre, dec, defs) -> None:
    for rank in range(d):
        dargs = dec[rank][0]
        for q in _writers(p, d, rank):
            pargs = pre[q][0]
            for e, (s_ptr, d_ptr) in enumerate(zip(pargs.state_data_ptrs[0], dargs.state_data_ptrs[0])):
                src_item, dst_item = pargs.state_item_lens[0][e], dargs.state_item_lens[0][e]
                groups = pargs.state_conv_shard_groups[0][e]
                for src_off, dst_off, n in defs.compute_mamba_state_slice_byte_blocks(
                    src_item_len=src_item,
                    dst_item_len=dst_item,
                    src_dim=pargs.state_dim_per_tensor[0][e],
                    dst_dim=dargs.state_dim_per_tensor[0][e],
                    outer_count=pargs.state_slice_outer_counts[0][e],
                    src_attn_tp_size=p,
                    dst_attn_tp_size=d,
                    dst_tp_rank_in_group=rank,
                    local_tp_rank_in_group=q,
                    conv_shard_groups=groups,
                ):
                    ctypes.memmove(d_ptr + DST_SLOT * dst_item + dst_off, s_ptr + SRC_SLOT * src_item + src_off, n)


GDN = dict(mamba_conv_dim=16, mamba_groups=(4, 4, 8))
KIMI = dict(mamba_conv_dim=12, mamba_groups=(4, 4, 4), mamba_kimi=True)


@pytest.mark.parametrize(
    "state", [{}, GDN, KIMI, {**GDN, "mamba_replicated": 10}], ids=["plain", "gdn", "kimi", "gdn+rep"]
)
@pytest.mark.parametrize("p, d", [(1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2)])
@pytest.mark.parametrize("mover", ["ours", "sglang"])
def test_our_mamba_pools_move_the_bytes_sglangs_byte_blocks_move(state, p, d, mover):
    state = StateModel(kinds=("mamba",), mamba_heads=8, **state)
    defs = load_utils_defs(NAMES)
    pre, dec = _side(state, p, defs), _side(state, d, defs)
    _fill(state, p, pre)
    before = [_rows(buffers, SRC_SLOT) for _, buffers, _ in dec]
    if mover == "ours":
        _move_ours(p, d, pre, dec)
    else:
        _move_sglang(p, d, pre, dec, defs)
    for rank, (_, buffers, _) in enumerate(dec):
        got = _rows(buffers, DST_SLOT)
        for e, row in enumerate(got):
            assert np.array_equal(row, state.mamba_row(ROOM, e, d, rank)), (mover, rank, e)
        assert all(np.array_equal(a, b) for a, b in zip(_rows(buffers, SRC_SLOT), before[rank]))  # no other slot


def test_each_sub_block_is_a_pool_of_its_own_and_a_slot_becomes_one_page_per_outer_row():
    state = StateModel(kinds=("mamba",), mamba_heads=8, **KIMI)  # conv [k - 1 = 3, 12 / 2 channels] bf16
    (_, _, pools) = _side(state, 2, load_utils_defs(NAMES))[1]
    assert [p.name for p in pools] == [f"state:mamba.{k}" for k in range(4)]
    conv = pools[:3]
    assert [(p.geometry.total_kv_heads, p.geometry.head_dim, p.geometry.num_layers) for p in conv] == [(4, 2, 2)] * 3
    assert [p.slot_pages for p in conv] == [(9, 3, 3)] * 3  # a slot: 3 rows of 3 sub-blocks of 2 channels
    assert [p.ptrs[0] - conv[0].ptrs[0] for p in conv] == [0, 4, 8]  # each starts at its sub-block
    assert list(state_pages(conv[:1], [[np.asarray(2)]])[0]) == [18, 21, 24]
    assert conv[1].label == (
        "mamba state (KVArgs.state_types[0]='mamba', entries 0..1: 3 rows of 12 channels of 2 bytes sliced over "
        "attention TP, conv sub-block 1 of [4, 4, 4])"
    )
    ssm = pools[3]
    assert (ssm.geometry.total_kv_heads, ssm.geometry.head_dim, ssm.slot_pages) == (8, 2 * 3 * 4, (1, 1, 1))
    assert not any(p.equal_tp_only for p in pools)
