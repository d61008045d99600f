"""SGLang's ``--enable-kv-cache-sharding`` through kvxfer, driven by the scripted scheduler
(``sglang_dp_sides``) in SGLang 0.5.23's call order. A prefill's logical page ``l`` lives on
shard rank ``l % N`` as its local page ``l // N``: the shard group is the attention-CP group
(a GQA model with ``--attn-cp-size N``) or, for an MLA model without CP, the attention-TP
group. Every shard rank gets the request's logical page lists from the scheduler and sends
the pages it holds, each at its position of the decode's page list (protocol 14's sparse
writes); the decode checks that the shards' pages cover its list once each.

Each shard rank's pool holds the request's KV only at the local ids of the pages it owns and
its own poison elsewhere; the logical ids are drawn at random, so owners are in no cycle. So
every decode byte matching the oracle shows each page came from its owner, read at its local
id, and landed at its position."""

from __future__ import annotations

import types

import numpy as np
import pytest

from sglang_kvxfer.errors import KVXferError
from tests.integrations import sglang_dp_sides as dps
from tests.integrations import sglang_sides as sides
from tests.integrations.sglang_env import Model, import_sglang_base, load_utils_defs, rank_memory, server_args
from tests.ports import free_port

_base, _reason = import_sglang_base()
needs_sglang = pytest.mark.skipif(_base is None, reason=_reason)

R = dps.DpRequest
# 37 tokens: 10 pages, the last partial; 3 tokens: one page, so every other shard has none
ROOMS = [R(0x5A4D_0000_F00D, 37), R(0x5A4D_0001_F00D, 9), R(0x5A4D_0002_CAFE, 41), R(0x5A4D_0003_BEEF, 3)]


def run_sharded(
    prefill: tuple, decode: tuple, model: Model, requests=ROOMS, checksum=False, corrupt_room=None, dp: int = 1
):
    """``prefill``: ``(attn_tp, cp)`` with --enable-kv-cache-sharding (and ``dp`` attention-DP
    groups); ``decode``: its TP."""
    port = free_port()
    env = {**sides.ENV, "KVXFER_SGLANG_TRANSPORT": "local"}
    (ptp, pcp), dtp = prefill, decode
    common = dict(timeout_s=60.0, kv_checksum=checksum)
    specs = [
        dps.DpSpec("prefill", model, ptp, dp, port, requests, env, cp=pcp, kv_sharded=True, **common),
        dps.DpSpec("decode", model, dtp, 1, port, requests, env, corrupt_room=corrupt_room, **common),
    ]
    return sides.run_in_processes(dps.main, specs, 60.0)


GQA = Model(total_kv_heads=4, pool_tokens=192)
MLA = Model(mla=True, head_dim=24, pool_tokens=192)


@needs_sglang
@pytest.mark.slow
@pytest.mark.parametrize(
    "prefill, decode, model, dp",
    [
        ((1, 2), 1, GQA, 1),  # attn TP 1 x CP 2 -> TP 1: two shards
        ((2, 2), 1, GQA, 1),  # attn TP 2 x CP 2 -> TP 1: each shard's pages from two writers (their heads)
        ((1, 3), 2, GQA, 1),  # CP 3 -> TP 2: three shards, the heads split on the decode
        ((1, 2), 2, GQA, 2),  # attention DP 2 x CP 2 -> TP 2: the shards of the routed DP group
        ((2, 1), 2, MLA, 1),  # MLA, attn TP 2 sharded over attention TP -> TP 2 (SGLang's pairing)
        ((4, 1), 2, MLA, 1),  # MLA over attention TP 4 -> TP 2: every decode rank reads all four shards
    ],
    ids=["cp2-to-tp1", "tp2xcp2-to-tp1", "cp3-to-tp2", "dp2xcp2-to-tp2", "mla-tp2-to-tp2", "mla-tp4-to-tp2"],
)
def test_each_shard_rank_sends_the_pages_it_holds_and_every_decode_byte_is_exact(prefill, decode, model, dp):
    pre, dec = run_sharded(prefill, decode, model, dp=dp)
    assert "error" not in pre and "error" not in dec, (pre.get("error"), dec.get("error"))
    (ptp, pcp), shards = prefill, prefill[1] if prefill[1] > 1 else prefill[0]
    # the decode sees one prefill rank group per shard: TP ranks of a CP rank, or TP 1 (MLA)
    assert dec["info"] == {"attn_tp_size": ptp if pcp > 1 else 1, "dp_size": dp}
    for q in ROOMS:
        assert dec[q.room]["status"] == "Success", dec[q.room]
        assert dec[q.room]["problems"] == [], dec[q.room]["problems"]
        assert [c for c, _, ok in dec[q.room]["cp_ranks"] if ok] == [f"CP rank {c}/{shards}" for c in range(shards)]
        done = pre[(q.room, q.room % dp)]
        assert done["status"] == "Success", done
        owned = done["shard_pages"]
        assert sum(owned) == -(-q.tokens // model.page_size)
        # each shard rank's writers moved the pages it holds (whole pages), no more
        sent = done["bytes"]  # sender order: CP rank, then TP rank
        per_shard = [sum(sent[k * ptp : (k + 1) * ptp]) for k in range(pcp)] if pcp > 1 else sent
        assert all(b * sum(owned) == sum(per_shard) * n for b, n in zip(per_shard, owned)), (per_shard, owned)
        landed = [b for _, b, _ in dec[q.room]["cp_ranks"]]
        assert [b > 0 for b in landed] == [n > 0 for n in owned], (landed, owned)
    assert dec["pool_problems"] == [], "\n".join(dec["pool_problems"])


@needs_sglang
@pytest.mark.slow
@pytest.mark.parametrize(
    "prefill, decode, draft",
    [((1, 2), 1, False), ((1, 2), 2, False), ((2, 3), 2, False), ((1, 2), 1, True)],
    ids=["cp2-to-tp1", "cp2-to-tp2", "tp2xcp3-to-tp2", "cp2-to-tp1-with-mtp-draft"],
)
def test_a_dsa_models_indexer_pages_come_from_the_shard_that_holds_them(prefill, decode, draft):
    """A DSA model (GLM-5 / DeepSeek-V3.2 style: SGLang shards its KV over interleaved CP):
    the indexer's pages are sharded like the latent, so each shard rank sends its pages of
    every indexer layer (a layer without one has no buffer) at their positions, the
    decode's coverage check covers them too, and every latent and indexer row is compared;
    no other state row changes. With an MTP draft model (SGLang allows GLM DSA's NextN with
    sharding; its pool shares the target's logical pages) the draft's pages come the same
    way, every byte compared."""
    from tests.integrations.sglang_env import Draft
    from tests.integrations.sglang_state_env import StateModel

    extra = dict(draft=Draft(mla=True, head_dim=16)) if draft else {}
    state = StateModel(kinds=("dsa",), dsa_layers=3)
    model = Model(mla=True, head_dim=24, num_layers=3, pool_tokens=192, state=state, **extra)
    pre, dec = run_sharded(prefill, decode, model)
    assert "error" not in pre and "error" not in dec, (pre.get("error"), dec.get("error"))
    for q in ROOMS:
        assert dec[q.room]["status"] == "Success", dec[q.room]
        assert dec[q.room]["problems"] == [], dec[q.room]["problems"]  # every indexer row of the request
    assert dec["pool_problems"] == [], "\n".join(dec["pool_problems"])  # every latent byte; no other state row


@needs_sglang
@pytest.mark.slow
def test_the_kv_checksum_covers_each_shards_pages():
    """--disaggregation-enable-kv-checksum: each shard rank digests the pages it sent, the
    decode the same pages (those its writers named); a byte flipped after landing in the
    request's last page fails that request naming the shard that wrote it, and the others
    still succeed."""
    bad = ROOMS[0]
    pre, dec = run_sharded((1, 2), 1, GQA, checksum=True, corrupt_room=bad.room)
    assert "error" not in pre and "error" not in dec, (pre.get("error"), dec.get("error"))
    for q in ROOMS[1:]:
        assert dec[q.room]["status"] == "Success", dec[q.room]
        assert dec[q.room]["checksum_parts"][0] == {"CP rank 0/2": 4, "CP rank 1/2": 4}, dec[q.room]
    assert dec[bad.room]["status"] == "Failed", dec[bad.room]
    (reason,) = set(dec[bad.room]["reasons"])
    assert "KV checksum mismatch (--disaggregation-enable-kv-checksum) in the CP rank" in reason, reason


@needs_sglang
def test_shard_ranks_register_as_cp_ranks_and_what_kvxfer_does_not_shard_is_refused(monkeypatch):
    """In process: over attention CP each CP rank registers as CP rank c of the CP size; an
    MLA model's attention-TP rank t (no CP) as CP rank t of a prefill of TP 1, so every decode
    rank reads the latent of each shard from it. A GQA model without CP (SGLang shards it over
    CP only) and a model with extra per-request state are refused by name."""
    from sglang_kvxfer.integrations import sglang as backend
    from tests.integrations.sglang_state_env import StateModel

    for name, value in sides.ENV.items():
        monkeypatch.setenv(name, value)
    mode = load_utils_defs().DisaggregationMode.PREFILL
    port = free_port()
    made = []
    try:
        mem = rank_memory(GQA, 2, 1, "prefill")
        mem.kv_args.engine_rank = 3  # --tp 4 --attn-cp-size 2: attention-TP rank 1, CP rank 1
        sa = server_args("m", "prefill", 4, port, attn_cp_size=2, enable_kv_cache_sharding=True)
        made.append(backend.KVXferKVManager(mem.kv_args, mode, sa, False))
        cfg = made[-1].config
        assert (cfg.tp_size, cfg.tp_rank, cfg.cp_rank, cfg.cp_size, cfg.kv_sharded) == (2, 1, 1, 2, True)
        assert made[-1].kv_shard == (1, 2) and not made[-1].is_dummy_cp_rank
        mla = Model(mla=True, head_dim=24)
        mem = rank_memory(mla, 2, 1, "prefill")
        mem.kv_args.engine_rank = 1
        sa = server_args("m", "prefill", 2, port, enable_kv_cache_sharding=True)
        made.append(backend.KVXferKVManager(mem.kv_args, mode, sa, True))
        cfg = made[-1].config
        assert (cfg.tp_size, cfg.tp_rank, cfg.cp_rank, cfg.cp_size, cfg.kv_sharded) == (1, 0, 1, 2, True)
        assert made[-1].kv_shard == (1, 2)
        mem = rank_memory(GQA, 2, 0, "prefill")
        with pytest.raises(
            KVXferError, match=r"does not support --enable-kv-cache-sharding=True: without attention CP"
        ):
            backend.KVXferKVManager(mem.kv_args, mode, sa, False)
        swa = Model(total_kv_heads=4, state=StateModel(kinds=("swa",)))  # (a DSA indexer is sharded: below)
        mem = rank_memory(swa, 1, 0, "prefill")
        mem.kv_args.engine_rank = 1
        sa = server_args("m", "prefill", 2, port, attn_cp_size=2, enable_kv_cache_sharding=True)
        monkeypatch.setattr(backend, "_model_swa_kv_heads", lambda _: 2, raising=False)
        with pytest.raises(
            KVXferError, match=r"--enable-kv-cache-sharding=True: with extra per-request state other than a DSA indexer"
        ):
            backend.KVXferKVManager(mem.kv_args, mode, sa, False)
    finally:
        for mgr in made:
            mgr.close()


def test_pages_no_shard_named_or_two_shards_named_fail_the_request_naming_them():
    """The decode's check once every shard's writers are done: the positions they named
    must cover its page list once each (a shard rank that skipped a page, or two that
    claim the same one, would leave stale or doubly written KV)."""
    from sglang_kvxfer.integrations.sglang_requests import KVXferKVReceiver, _Rx

    def part(c, positions, draft=False):
        rx = types.SimpleNamespace(positions=None if positions is None else np.asarray(positions))
        return _Rx(f"CP rank {c}/2", rx, None, (), c == 0, draft=draft, cp=(c, 2), sparse=True)

    recv = KVXferKVReceiver.__new__(KVXferKVReceiver)
    recv._pages = np.array([11, 12, 13, 14, 15])
    dsa = types.SimpleNamespace(name="state:dsa", label="DSA indexer state")
    recv.kv_mgr = types.SimpleNamespace(layout=types.SimpleNamespace(states=(dsa,)))
    recv._state_rows = {"state:dsa": np.array([11, 12, 13, 14, 15])}
    indexer = [(dsa, f"{dsa.label}, CP rank {c}/2", part(c, at).rx) for c, at in ((0, [0, 3]), (1, [1, 2, 4]))]
    recv._states, recv._sparse_states = indexer, {label for _, label, _ in indexer}
    recv._rxs = [part(0, [0, 3]), part(1, [1, 2, 4])]
    assert recv._sharded_coverage() == ""
    recv._states[1][2].positions = np.array([1, 2])  # a shard's indexer pages short of one
    problem = recv._sharded_coverage()
    assert "named 4 of this rank's 5 pages of the DSA indexer state" in problem, problem
    assert "positions [4] came from no shard" in problem
    recv._states = []
    recv._rxs = [part(0, [0, 3]), part(1, [1, 4])]
    problem = recv._sharded_coverage()
    assert "named 4 of this rank's 5 pages of the model KV (CP rank 0/2: 2, CP rank 1/2: 2)" in problem, problem
    assert "positions [2] came from no shard, [] from more than one" in problem
    recv._rxs = [part(0, [0, 1, 3]), part(1, [1, 2, 4]), part(0, [0, 1, 2, 3, 4], draft=True), part(1, [], True)]
    problem = recv._sharded_coverage()
    assert "positions [] came from no shard, [1] from more than one" in problem, problem
    recv._rxs = [part(0, [0, 1, 2, 3, 4]), part(1, None), part(0, [0, 2], draft=True), part(1, [1, 3], draft=True)]
    problem = recv._sharded_coverage()
    assert "of this rank's 5 pages of the draft-model KV" in problem and "positions [4] came from no shard" in problem
