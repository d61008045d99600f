"""Prefill CP-TP group sharing (``--enable-cp-tp-group-sharing``: ``--tp C --attn-cp-size C``,
the CP group is the TP group) through kvxfer, driven by the scripted scheduler
(``sglang_dp_sides``) in SGLang 0.5.23's call order. CP rank c holds every KV head (its
attention TP is 1) and its TP share of the linear-attention state, and registers as TP rank c
of a CP-1 prefill of TP C, as SGLang's own backends do; a decode is plain TP. kvxfer has each
CP rank send only the heads TP rank c of C owns (SGLang's mooncake sends a decode rank every
head it needs from each CP rank it pairs with). Here CP rank c's pool holds the oracle in
those heads and a poison of its own in the others, so every decode byte matching the oracle
shows each head came from its owner; the bytes each CP rank sent are its heads' share."""

from __future__ import annotations

import pytest

from sglang_kvxfer.errors import KVXferError
from sglang_kvxfer.geometry import owned_heads
from tests.integrations import sglang_dp_sides as dps
from tests.integrations import sglang_sides as sides
from tests.integrations.sglang_env import Model, import_sglang_base, load_utils_defs, rank_memory, server_args
from tests.ports import free_port

_base, _reason = import_sglang_base()
needs_sglang = pytest.mark.skipif(_base is None, reason=_reason)

R = dps.DpRequest
ROOMS = [R(0x0C7B_0000_F00D, 37), R(0x0C7B_0001_F00D, 9), R(0x0C7B_0002_CAFE, 41), R(0x0C7B_0003_BEEF, 3)]


def run_cp_tp(
    cp: int,
    decode_tp: int,
    model: Model,
    requests,
    timeout_s: float = 60.0,
    checksum: bool = False,
    corrupt_room: int | None = None,
    path: str = "auto",
):
    port = free_port()
    env = {**sides.ENV, "KVXFER_SGLANG_TRANSPORT": "local", "KVXFER_DATA_PATH": path}
    common = dict(timeout_s=timeout_s, kv_checksum=checksum)
    specs = [
        dps.DpSpec("prefill", model, 1, 1, port, requests, env, cp=cp, cp_tp=True, **common),
        dps.DpSpec("decode", model, decode_tp, 1, port, requests, env, corrupt_room=corrupt_room, **common),
    ]
    return sides.run_in_processes(dps.main, specs, timeout_s)


def kv_bytes_per_cp_rank(model: Model, cp: int, decode_tp: int, tokens: int) -> list[int]:
    """KV bytes each CP rank must send for a request (whole pages): the heads TP rank c of
    ``cp`` owns that each decode rank needs (one writer per head and decode rank; with more CP
    ranks than heads, the replicas of a head share its readers: the total only)."""
    h, rows = model.total_kv_heads, -(-tokens // model.page_size) * model.page_size
    per_head = rows * model.num_layers * (model.head_dim + model.v_head_dim) * 2  # bf16
    need = [len(owned_heads(h, decode_tp, j)) for j in range(decode_tp)]
    if cp <= h:
        out = [0] * cp
        for c in range(cp):
            mine = owned_heads(h, cp, c)
            for j in range(decode_tp):
                theirs = owned_heads(h, decode_tp, j)
                out[c] += len(range(max(mine.start, theirs.start), min(mine.stop, theirs.stop))) * per_head
        return out
    return [sum(need) * per_head]  # (the replicas' split rotates with the room: the total only)


@needs_sglang
@pytest.mark.slow
@pytest.mark.parametrize(
    "cp, decode_tp, heads",
    [
        (2, 1, 4),  # TP 2 (CP 2) -> TP 1: each CP rank sends its two heads
        (2, 2, 4),  # -> TP 2: CP rank r to decode rank r only
        (4, 2, 4),  # TP 4 -> TP 2: two CP ranks per decode rank, a head each
        (2, 4, 4),  # TP 2 -> TP 4: each CP rank to two decode ranks
        (4, 1, 2),  # more CP ranks than heads: replicas, one elected per head
    ],
    ids=["cp2-to-tp1", "cp2-to-tp2", "cp4-to-tp2", "cp2-to-tp4", "cp4-h2-to-tp1"],
)
def test_each_cp_rank_sends_the_heads_of_its_tp_rank(cp, decode_tp, heads):
    model = Model(total_kv_heads=heads, pool_tokens=192)
    pre, dec = run_cp_tp(cp, decode_tp, model, ROOMS)
    assert "error" not in pre and "error" not in dec, (pre.get("error"), dec.get("error"))
    assert dec["info"] == {"attn_tp_size": cp, "dp_size": 1}  # a prefill of TP cp, as SGLang registers it
    for q in ROOMS:
        assert dec[q.room]["status"] == "Success", dec[q.room]
        assert dec[q.room]["problems"] == [], dec[q.room]["problems"]
        sent = pre[(q.room, 0)]["bytes"]  # per CP rank
        want = kv_bytes_per_cp_rank(model, cp, decode_tp, q.tokens)
        assert (sent if len(want) == cp else [sum(sent)]) == want, (sent, want)
    assert dec["pool_problems"] == [], dec["pool_problems"]  # each head from its owner, every byte


@needs_sglang
@pytest.mark.slow
@pytest.mark.parametrize("path", ["staged", "fused", "direct", "per_token"])
def test_every_data_path_reads_the_owned_heads_at_their_places_in_the_pool(path):
    """Each data path (gather into staging, the one-copy kernel, direct writes of each head
    run, SGLang's per-token pattern) addresses a CP rank's heads in its pool of every head."""
    model = Model(total_kv_heads=4, pool_tokens=192)
    pre, dec = run_cp_tp(4, 2, model, ROOMS[:2], path=path)
    assert "error" not in pre and "error" not in dec, (pre.get("error"), dec.get("error"))
    for q in ROOMS[:2]:
        assert dec[q.room]["status"] == "Success", dec[q.room]
        assert pre[(q.room, 0)]["bytes"] == kv_bytes_per_cp_rank(model, 4, 2, q.tokens)
    assert dec["pool_problems"] == [], dec["pool_problems"]


@needs_sglang
@pytest.mark.slow
@pytest.mark.parametrize("cp, decode_tp", [(2, 1), (2, 2), (4, 2)], ids=["cp2-to-tp1", "cp2-to-tp2", "cp4-to-tp2"])
def test_a_hybrid_models_linear_attention_state_comes_from_every_cp_rank(cp, decode_tp):
    """Qwen-Next's pools (GDN: conv rows of q|k|v sub-blocks, SSM heads) under CP-TP group
    sharing: each CP rank holds its TP share of every state row, so every CP rank sends its
    channels of the request's slot, re-sliced for the decode's TP; every row each decode rank
    must hold matches (its channels), and no other slot is touched."""
    from tests.integrations.sglang_state_env import StateModel

    state = StateModel(kinds=("mamba",), mamba_conv_dim=24, mamba_groups=(8, 8, 8), mamba_heads=4)
    model = Model(total_kv_heads=4, pool_tokens=192, state=state)
    pre, dec = run_cp_tp(cp, decode_tp, model, ROOMS)
    assert "error" not in pre and "error" not in dec, (pre.get("error"), dec.get("error"))
    for q in ROOMS:
        assert dec[q.room]["status"] == "Success", dec[q.room]
        assert dec[q.room]["problems"] == [], dec[q.room]["problems"]  # every state row, each rank's channels
    assert dec["pool_problems"] == [], dec["pool_problems"]


@needs_sglang
@pytest.mark.slow
def test_the_kv_checksum_compares_each_head_with_its_owners_digest():
    """--disaggregation-enable-kv-checksum (CPU pools): a CP rank digests the heads it sends
    (not the whole pool), the decode compares each head with its writer's digest: all four
    heads of TP 1 are compared. A byte flipped in a landed page of one request fails that
    request naming the head, and the others succeed."""
    bad = ROOMS[0]
    model = Model(total_kv_heads=4, pool_tokens=192)
    pre, dec = run_cp_tp(2, 1, model, ROOMS, checksum=True, corrupt_room=bad.room)
    assert "error" not in pre and "error" not in dec, (pre.get("error"), dec.get("error"))
    for q in ROOMS[1:]:
        assert dec[q.room]["status"] == "Success", dec[q.room]
        assert dec[q.room]["checksum_parts"] == [{"": 4}], dec[q.room]
    assert dec[bad.room]["status"] == "Failed", dec[bad.room]
    (reason,) = set(dec[bad.room]["reasons"])
    assert "KV checksum mismatch (--disaggregation-enable-kv-checksum)" in reason and "KV head 0" in reason, reason


@needs_sglang
def test_a_cp_rank_registers_as_the_tp_rank_of_its_cp_rank_over_a_pool_of_every_head(monkeypatch):
    """In process: CP rank 1 of --tp 2 --attn-cp-size 2 with the flag is a sender (not a CP
    replica) of TP rank 1 of 2 whose pool holds all four heads (it sends heads 2 and 3), its
    state managers on its own TP share; a draft model's KV is refused naming the field."""
    from sglang_kvxfer.integrations import sglang as backend
    from tests.integrations.sglang_env import Draft
    from tests.integrations.sglang_state_env import StateModel

    for name, value in sides.ENV.items():
        monkeypatch.setenv(name, value)
    model = Model(total_kv_heads=4, state=StateModel(kinds=("mamba",), mamba_conv_dim=24, mamba_groups=(8, 8, 8)))
    mode = load_utils_defs().DisaggregationMode.PREFILL
    port = free_port()
    sa = server_args("m", "prefill", 2, port, attn_cp_size=2, enable_cp_tp_group_sharing=True)
    mem = rank_memory(model, 1, 0, "prefill", state_tp=(2, 1))
    mem.kv_args.engine_rank = 1  # CP rank 1 (attention TP 1)
    mgr = backend.KVXferKVManager(mem.kv_args, mode, sa, False)
    try:
        place = mgr.config.placement
        assert (mgr.cp_rank, mgr.cp_tp_sharing, mgr.is_dummy_cp_rank, mgr.cp_sharded) == (1, True, False, False)
        assert (place.tp_size, place.tp_rank, place.all_heads, place.heads, place.num_local_heads) == (
            2,
            1,
            True,
            range(2, 4),
            4,
        )
        assert (mgr.config.cp_rank, mgr.config.cp_size) == (0, 1)  # not SGLang's all-CP-ranks transfer
        assert mgr.engine is not None and len(mgr.state_engines) == 4  # conv q|k|v sub-blocks and SSM
        for _, eng in mgr.state_engines:  # each its TP share: TP rank 1 of 2, not a pool of every head
            assert (eng.placement.tp_size, eng.placement.tp_rank, eng.placement.all_heads) == (2, 1, False)
    finally:
        mgr.close()
    drafted = Model(total_kv_heads=4, draft=Draft(num_layers=1, total_kv_heads=2))
    mem = rank_memory(drafted, 1, 0, "prefill")
    with pytest.raises(KVXferError, match=r"does not support KVArgs.num_draft_entries=2: a draft model's KV with"):
        backend.KVXferKVManager(mem.kv_args, mode, sa, False)
