"""The planner under pipeline parallelism, against the brute-force oracle: the prefill's
layers split over PP stages (SGLang's even split, and uneven partitions), every stage
planned with its own layer count and applied into the decode pool's buffers of the stage's
layers (a decode of PP 1: one pool; of the prefill's PP size: one pool per stage), for MHA
and MLA and TP pairs that gather, split and replicate heads. Every decode buffer must equal
the oracle's full-model placement: a layer from the wrong stage, or a stage at the wrong
offset, is caught."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.integrations.sglang_args import pp_layer_split
from sglang_kvxfer.planning import plan_pair, plan_tp
from sglang_kvxfer.planning.executor import apply_plan

from .oracle import POISON, empty_pool, full_kv, place_tokens


def _stage_buffers(pool, geometry: KVGeometry, layers: range) -> list:
    """The buffers of ``layers`` of a full-model pool (K of every layer, then V): the same
    arrays, so writing them writes the pool."""
    n = geometry.num_layers
    return [pool[i] for i in layers] + ([] if geometry.mla else [pool[n + i] for i in layers])


@pytest.mark.parametrize(
    "h, p, d, mla, num_layers, pp, partition, decode_pp",
    [
        (4, 1, 1, False, 4, 2, None, 1),
        (4, 2, 1, False, 5, 2, None, 1),  # uneven: [0, 2), [2, 5)
        (4, 1, 2, False, 6, 3, "1,3,2", 1),
        (2, 1, 8, False, 4, 2, None, 1),  # decode replicas of a head (P < H < D)
        (8, 4, 2, False, 4, 4, None, 1),
        (1, 2, 4, True, 5, 2, None, 1),  # MLA: the latent everywhere
        (4, 2, 1, False, 4, 2, None, 2),  # decode PP = prefill PP: stage s into decode stage s
        (1, 1, 2, True, 6, 3, "2,1,3", 3),
    ],
)
def test_stages_reassemble_the_full_decode_kv(h, p, d, mla, num_layers, pp, partition, decode_pp):
    num_tokens, ps, pd = 9, 2, 4
    common = dict(num_layers=num_layers, total_kv_heads=h, head_dim=2, dtype="float32", mla=mla)
    common.update(v_head_dim=None if mla else 3)
    gp = KVGeometry(**common, page_size=ps, num_pages=8)
    gd = KVGeometry(**common, page_size=pd, num_pages=6)
    k_full, v_full = full_kv(num_layers, h, num_tokens, 2, gp.v_head_dim, seed=h * 100 + p * 10 + d)
    rng = np.random.default_rng(pp)
    src_pages = rng.permutation(gp.num_pages)[: -(-num_tokens // ps)]
    dst_pages = rng.permutation(gd.num_pages)[: -(-num_tokens // pd)]
    stages = pp_layer_split(num_layers, pp, partition)
    assert stages[0].start == 0 and stages[-1].stop == num_layers
    dec_full = {r: gd.placement(d, r) for r in range(d)}
    # decode PP 1: one full pool per rank; decode PP == pp: each stage's layers in a pool of its own
    if decode_pp == 1:
        pools = {r: empty_pool(pl) for r, pl in dec_full.items()}
        into = {(s, r): _stage_buffers(pools[r], gd, layers) for s, layers in enumerate(stages) for r in range(d)}
    else:
        into = {}
        for s, layers in enumerate(stages):
            for r in range(d):
                into[(s, r)] = empty_pool(dataclasses.replace(gd, num_layers=len(layers)).placement(d, r))
    for s, layers in enumerate(stages):
        sp = dataclasses.replace(gp, num_layers=len(layers))
        sd = dataclasses.replace(gd, num_layers=len(layers))
        # the stage's prefill pools hold only its layers
        kv = (k_full[layers.start : layers.stop], None if v_full is None else v_full[layers.start : layers.stop])
        src = {
            r: place_tokens(sp.placement(p, r), empty_pool(sp.placement(p, r), POISON), *kv, src_pages, num_tokens)
            for r in range(p)
        }
        for t in plan_tp(h, p, d, mla=mla, salt=s).transfers:
            pair = plan_pair(
                t,
                sp.placement(p, t.prefill_rank),
                sd.placement(d, t.decode_rank),
                src_pages,
                dst_pages,
                num_tokens=num_tokens,
            )
            apply_plan(pair, src[t.prefill_rank], into[(s, t.decode_rank)])
    for r, pl in dec_full.items():
        want = place_tokens(pl, empty_pool(pl), k_full, v_full, dst_pages, num_tokens)
        got = pools[r] if decode_pp == 1 else None
        for s, layers in enumerate(stages):
            mine = _stage_buffers(want, gd, layers)
            have = _stage_buffers(got, gd, layers) if got is not None else into[(s, r)]
            for i, (a, b) in enumerate(zip(have, mine)):
                assert np.array_equal(a, b), f"decode rank {r}, stage {s} layers {layers}: buffer {i} differs"
