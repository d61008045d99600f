"""Prefill attention CP (``--attn-cp-size``) with pipeline parallelism (``--pp-size``) through
kvxfer, driven by the scripted scheduler (``sglang_pp_sides``): every prefill PP stage in its
own process with all of its CP and attention-TP ranks. By default CP rank 0 of each stage
sends its layers and the CP replicas send nothing; with
``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER`` every CP rank of every stage sends its share
of each request's pages of its stage's layers, and the decode (of PP 1, or of the prefill's PP
size) receives one part per (stage, CP rank). Each prefill CP rank's pools hold the request's
KV only where it is that rank's to send and the rank's own poison elsewhere, so every decode
byte that matches the oracle came from the right stage and the right CP rank; every byte of
every decode buffer is compared."""

from __future__ import annotations

import pytest

from tests.integrations import sglang_pp_sides as pps
from tests.integrations.sglang_dp_sides import cp_share
from tests.integrations.sglang_env import Draft, Model, import_sglang_base
from tests.integrations.sglang_state_env import StateModel
from tests.ports import free_port

_base, _reason = import_sglang_base()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_base is None, reason=_reason)]

# Rooms of both parities, partial last pages, several chunks; 4 tokens: one page, so with CP 2
# or 3 the shares of the CP ranks after the first are empty.
ROOMS = [(0x5EED_0000_F00D, 37), (0x5EED_0001_F00D, 9), (0x7A11_0002_CAFE, 4)]


def _model(mla: bool = False, draft: bool = False, state: bool = False) -> Model:
    extra: dict = {}
    if draft:
        extra["draft"] = Draft(mla=True, head_dim=16) if mla else Draft(num_layers=2, total_kv_heads=2)
    if state:
        extra.update(
            kv_cache_dtype_str="bfloat16",
            state=StateModel(kinds=("mamba",), swa_layers=3, mamba_layers=3, dsa_layers=3, dsa_skip=()),
        )
    if mla:
        return Model(mla=True, head_dim=24, num_layers=5, pool_tokens=192, **extra)
    return Model(total_kv_heads=4, num_layers=4, pool_tokens=192, **extra)


def _run(tmp_path, model, prefill, decode, cp, sharded):
    specs = pps.deployment(model, prefill, decode, ROOMS, str(tmp_path), free_port(), prefill_cp=cp, cp_sharded=sharded)
    return pps.run_pp(specs, 90.0)


@pytest.mark.parametrize(
    "prefill, cp, sharded, decode, kind",
    [
        ((1, 1, 2), 2, False, (1, 1, 1), "mha"),  # CP rank 0 of each stage sends; the replicas nothing
        ((2, 1, 2), 2, True, (1, 1, 1), "mha"),  # every (stage, CP rank) its share into one pool
        ((1, 1, 2), 2, True, (2, 1, 2), "mha"),  # decode PP 2 x TP 2: its stage's CP ranks only
        ((1, 1, 2), 3, True, (2, 1, 1), "mla"),  # MLA, CP 3: uneven and empty shares, latent to both
        ((1, 2, 2), 2, True, (1, 1, 1), "mha"),  # attention DP 2: the routed group's stages and CP ranks
        ((2, 1, 2), 2, True, (1, 1, 1), "draft"),  # the last stage's draft KV, each CP rank its share
        ((1, 1, 2), 2, True, (1, 1, 1), "state"),  # each stage's mamba state from its CP rank 0
    ],
    ids=["cp2-replicas", "cp2xtp2-to-tp1", "cp2-to-pp2xtp2", "mla-cp3-to-tp2", "dp2xcp2", "draft", "mamba"],
)
def test_every_stage_and_cp_rank_sends_what_is_its_own(tmp_path, prefill, cp, sharded, decode, kind):
    model = _model(mla=kind == "mla", draft=kind == "draft", state=kind == "state")
    reports = _run(tmp_path, model, prefill, decode, cp, sharded)
    p_tp, p_dp, p_pp = prefill
    for s in range(decode[2]):
        dec = reports[f"decode pp{s}"]
        assert dec["info"]["pp_size"] == p_pp and dec["info"]["problem"] == "", dec["info"]
        for room, _ in ROOMS:
            assert dec[room]["status"] == "Success", dec[room]
            assert dec[room]["problems"] == [], dec[room]["problems"]
        assert dec["pool_problems"] == [], dec["pool_problems"]
    for s in range(p_pp):
        pre = reports[f"prefill pp{s}"]
        for room, tokens in ROOMS:
            assert pre[room]["status"] == "Success", (s, pre[room])
            sent = pre[room]["bytes"]  # per sender of the room's DP group, (CP rank, TP rank) order
            assert len(sent) == cp * p_tp, sent
            pages = -(-tokens // model.page_size)
            for i, nbytes in enumerate(sent):
                c = i // p_tp
                if not sharded:
                    assert (nbytes > 0) == (c == 0), (s, room, sent)
                else:  # a CP rank with pages in its share sent them; one with none only the aux rows
                    share = cp_share(pages, c, cp)
                    assert len(share) == 0 or nbytes > 0, (s, room, c, sent)


@pytest.mark.parametrize(
    "prefill, decode",
    [((2, 1, 2), (1, 1, 1)), ((1, 1, 2), (2, 1, 2))],
    ids=["tp2xcp2xpp2-to-tp1", "cp2xpp2-to-pp2xtp2"],
)
def test_kv_cache_sharding_over_cp_ranks_with_pp_stages(tmp_path, prefill, decode):
    """--enable-kv-cache-sharding with --pp-size (SGLang allows it for a GQA model): each CP
    rank of each stage holds the request's logical pages it owns at their local ids (its own
    poison elsewhere) and sends those of its stage's layers at their positions; a decode of
    PP 1 or of the prefill's PP size gets every byte, each shard's bytes in proportion to its
    pages."""
    model = _model()
    specs = pps.deployment(model, prefill, decode, ROOMS, str(tmp_path), free_port(), prefill_cp=2, kv_sharded=True)
    reports = pps.run_pp(specs, 90.0)
    pps.check_decoded(reports, decode[2], ROOMS)
    p_tp = prefill[0]
    for s in range(prefill[2]):
        for room, _ in ROOMS:
            pre = reports[f"prefill pp{s}"][room]
            assert pre["status"] == "Success", pre
            owned, sent = pre["shard_pages"], pre["bytes"]  # senders in (CP rank, TP rank) order
            per_cp = [sum(sent[c * p_tp : (c + 1) * p_tp]) for c in range(2)]
            assert all(b * sum(owned) == sum(per_cp) * n for b, n in zip(per_cp, owned)), (per_cp, owned)
