"""Prefill attention CP (``--attn-cp-size``) through kvxfer, driven by the scripted scheduler
(``sglang_dp_sides``) in SGLang 0.5.23's call order. SGLang materializes a request's KV on
every CP rank; CP rank 0 of each attention-TP rank sends it, and the other CP ranks are
dummy participants (WaitingForInput at once, Success at their last chunk) whose polls join
the MIN. The replicas' pools hold a poison of their own here, so every byte of every decode
buffer matching the oracle of CP rank 0's KV shows that nothing came from a replica; the
decode sees a prefill of the attention-TP size (the replicas never register)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from sglang_kvxfer.errors import KVXferError
from tests.integrations import sglang_dp_sides as dps
from tests.integrations import sglang_sides as sides
from tests.integrations.sglang_env import (
    Draft,
    Model,
    import_sglang_base,
    load_utils_defs,
    rank_memory,
    server_args,
)
from tests.ports import free_port

_base, _reason = import_sglang_base()
needs_sglang = pytest.mark.skipif(_base is None, reason=_reason)

R = dps.DpRequest
ROOMS = [R(0x0C90_0000_F00D, 37), R(0x0C90_0001_F00D, 9), R(0x0C91_0002_CAFE, 41)]


def run_cp(
    prefill: tuple,
    decode: tuple,
    model: Model,
    requests,
    timeout_s: float = 60.0,
    sharded: bool = False,
    checksum: bool = False,
    corrupt_room: int | None = None,
    dcp: int = 1,
):
    """``prefill``: ``(attn_tp, dp, cp)``; ``decode``: ``(attn_tp, dp)``; ``sharded``: the
    prefill runs with SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER (the decode without it);
    ``checksum``: both with --disaggregation-enable-kv-checksum; ``dcp``: the decode's
    --dcp-size."""
    port = free_port()
    env = {**sides.ENV, "KVXFER_SGLANG_TRANSPORT": "local"}
    prefill_env = {**env, "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": "1"} if sharded else env
    (ptp, pdp, pcp), (dtp, ddp) = prefill, decode
    common = dict(timeout_s=timeout_s, kv_checksum=checksum)
    specs = [
        dps.DpSpec(
            "prefill", model, ptp, pdp, port, requests, prefill_env, cp=pcp, cp_sharded=sharded, dcp=dcp, **common
        ),
        dps.DpSpec("decode", model, dtp, ddp, port, requests, env, corrupt_room=corrupt_room, dcp=dcp, **common),
    ]
    return sides.run_in_processes(dps.main, specs, timeout_s)


@needs_sglang
@pytest.mark.slow
@pytest.mark.parametrize(
    "prefill, decode, mla",
    [
        ((1, 1, 2), (1, 1), False),  # attn TP 1 x CP 2 -> TP 1
        ((2, 1, 2), (1, 1), False),  # attn TP 2 x CP 2 (--tp 4) -> TP 1: two writers, two replicas
        ((1, 2, 2), (2, 1), True),  # MLA (DeepSeek): DP 2 x CP 2 -> TP 2, the latent of the routed group
    ],
    ids=["tp1xcp2-to-tp1", "tp2xcp2-to-tp1", "mla-dp2xcp2-to-tp2"],
)
def test_cp_rank_0_sends_every_page_and_the_replicas_nothing(prefill, decode, mla):
    model = Model(mla=True, head_dim=24, pool_tokens=192) if mla else Model(total_kv_heads=4, pool_tokens=192)
    pre, dec = run_cp(prefill, decode, model, ROOMS)
    assert "error" not in pre and "error" not in dec, (pre.get("error"), dec.get("error"))
    assert dec["info"] == {"attn_tp_size": prefill[0], "dp_size": prefill[1]}  # replicas never registered
    for q in ROOMS:
        group = q.room % prefill[1]
        assert dec[q.room]["status"] == "Success", dec[q.room]
        assert dec[q.room]["problems"] == [], dec[q.room]["problems"]
        assert pre[(q.room, group)]["status"] == "Success", pre  # every CP rank's poll in the MIN
    assert dec["pool_problems"] == [], dec["pool_problems"]  # CP rank 0's bytes, every one


@needs_sglang
@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True], ids=["cp-rank-0-sends", "every-cp-rank-sends"])
def test_qsa_state_with_prefill_cp_comes_whole_from_cp_rank_0(sharded):
    """SGLang's QSA indexer all-gathers the raw keys under prefill CP, so every CP rank holds
    a request's whole pending rings and compressed keys (``qsa_indexer``: "every rank ends up
    with the complete compressed-K cache"): CP rank 0 sends them, beside the mamba slot, whether
    it sends every KV page or each CP rank its share. The CP replicas' state rows are zero here,
    so state from any other CP rank is caught; every state row and KV byte is compared."""
    from tests.integrations.sglang_state_env import StateModel

    state = StateModel(kinds=("mamba", "qsa_pending", "qsa_compressed"))
    model = Model(total_kv_heads=4, pool_tokens=192, kv_cache_dtype_str="bfloat16", state=state)
    rooms = SHARDED_ROOMS if sharded else ROOMS
    pre, dec = run_cp((1, 1, 2), (1, 1), model, rooms, sharded=sharded)
    assert "error" not in pre and "error" not in dec, (pre.get("error"), dec.get("error"))
    for q in rooms:
        assert dec[q.room]["status"] == "Success", dec[q.room]
        assert dec[q.room]["problems"] == [], dec[q.room]["problems"]
    assert dec["pool_problems"] == [], dec["pool_problems"]


@needs_sglang
def test_a_cp_replica_sender_moves_nothing_and_follows_sglangs_dummy_states(monkeypatch):
    """In-process: a CP rank 1 manager has no engine and registers nothing; its sender is
    WaitingForInput at once, Success at its last chunk; a failure elsewhere (the MIN) makes
    failure_exception name another rank; an abort fails it."""
    from sglang_kvxfer.integrations import sglang as backend
    from sglang_kvxfer.integrations.sglang_requests import CPReplicaSender

    for name, value in sides.ENV.items():
        monkeypatch.setenv(name, value)
    model = Model(total_kv_heads=4)
    mem = rank_memory(model, 1, 0, "prefill")
    mem.kv_args.engine_rank = 1  # --tp 2 --attn-cp-size 2: attention-TP rank 0, CP rank 1
    sa = server_args("m", "prefill", 2, free_port(), attn_cp_size=2)
    mgr = backend.KVXferKVManager(mem.kv_args, load_utils_defs().DisaggregationMode.PREFILL, sa, False)
    try:
        assert (mgr.cp_rank, mgr.is_dummy_cp_rank, mgr.engine) == (1, True, None)
        mgr.register_to_bootstrap()  # nothing to wait for: no bootstrap is even running
        # as SGLang's prefill creates it (create_sender: keywords)
        tx = backend.KVXferKVSender(
            mgr=mgr, bootstrap_addr=f"{sa.host}:8998", bootstrap_room=77, req_has_disagg_prefill_dp_rank=False
        )
        assert isinstance(tx, CPReplicaSender)
        assert tx.poll() == dps.WAITING and tx.pop_decode_prefix_len() == 0
        tx.init(3, 0)
        tx.send(np.array([4, 5], dtype=np.int32))
        assert tx.poll() == dps.WAITING
        tx.send(np.array([6], dtype=np.int32), [])
        assert tx.poll() == dps.SUCCESS and tx.get_transfer_metric().transfer_total_bytes == 0

        over = backend.KVXferKVSender(mgr, sa.host, 78)
        over.init(1, 0)
        over.send(np.array([1, 2], dtype=np.int32))
        assert over.poll() == dps.FAILED
        with pytest.raises(backend.KVXferTransferError, match=r"pages \[0, 2\) run past num_kv_indices=1"):
            over.failure_exception()

        other = backend.KVXferKVSender(mgr, sa.host, 79)
        with pytest.raises(backend.KVXferTransferError, match="unknown reason from another rank"):
            other.failure_exception()  # the MIN was Failed: CP rank 0 failed it
        aborted = backend.KVXferKVSender(mgr, sa.host, 80)
        aborted.abort()
        assert aborted.poll() == dps.FAILED
    finally:
        mgr.close()


# -- every CP rank sends its share (SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER) -----------------
SHARDED_ROOMS = ROOMS + [R(0x0C92_0003_BEEF, 3)]  # one page: the later CP ranks' shares are empty


@needs_sglang
@pytest.mark.slow
@pytest.mark.parametrize(
    "prefill, decode, mla",
    [
        ((1, 1, 2), (1, 1), False),  # attn TP 1 x CP 2 -> TP 1
        ((2, 1, 2), (1, 1), False),  # attn TP 2 x CP 2 -> TP 1: each share from two writers
        ((1, 1, 3), (2, 1), False),  # CP 3 -> TP 2 (heads split on the decode), uneven shares
        ((1, 2, 2), (2, 1), True),  # MLA (DeepSeek): DP 2 x CP 2 -> TP 2
    ],
    ids=["tp1xcp2-to-tp1", "tp2xcp2-to-tp1", "cp3-to-tp2", "mla-dp2xcp2-to-tp2"],
)
def test_every_cp_rank_sends_its_share_of_the_pages(prefill, decode, mla):
    """Each CP rank's pool holds the request's KV in its own share of the pages only (its
    poison elsewhere): every decode byte matching the oracle shows that each page came from
    the CP rank whose share it is (SGLang's split), the metadata slot from CP rank 0. The
    decode runs without the environment variable: it reads the prefill's registration."""
    model = Model(mla=True, head_dim=24, pool_tokens=192) if mla else Model(total_kv_heads=4, pool_tokens=192)
    pre, dec = run_cp(prefill, decode, model, SHARDED_ROOMS, sharded=True)
    assert "error" not in pre and "error" not in dec, (pre.get("error"), dec.get("error"))
    assert dec["info"] == {"attn_tp_size": prefill[0], "dp_size": prefill[1]}
    ptp, pdp, pcp = prefill
    for q in SHARDED_ROOMS:
        assert dec[q.room]["status"] == "Success", dec[q.room]
        assert dec[q.room]["problems"] == [], dec[q.room]["problems"]
        pages = -(-q.tokens // model.page_size)
        shares = [len(dps.cp_share(pages, c, pcp)) for c in range(pcp)]
        assert [c for c, _, ok in dec[q.room]["cp_ranks"] if ok] == [f"CP rank {c}/{pcp}" for c in range(pcp)]
        # the prefill's senders, CP rank by CP rank: bytes in proportion to each one's share
        sent = pre[(q.room, q.room % pdp)]["bytes"]
        per_cp = [sum(sent[c * ptp : (c + 1) * ptp]) for c in range(pcp)]
        assert all(b * pages == sum(per_cp) * n for b, n in zip(per_cp, shares)), (per_cp, shares)
        assert [b > 0 for _, b, _ in dec[q.room]["cp_ranks"]] == [n > 0 for n in shares]
    assert dec["pool_problems"] == [], dec["pool_problems"]  # each share's bytes, every one


@needs_sglang
@pytest.mark.slow
def test_every_cp_rank_sends_its_share_of_the_draft_models_kv_too():
    """Speculative decoding: the draft model's KV (the same pages of its own pool) comes
    share by share from the same CP ranks, each into its own engine request; every byte of
    both pools is compared."""
    model = Model(total_kv_heads=4, pool_tokens=192, draft=Draft(num_layers=1, total_kv_heads=2))
    pre, dec = run_cp((2, 1, 2), (1, 1), model, SHARDED_ROOMS, sharded=True)
    assert "error" not in pre and "error" not in dec, (pre.get("error"), dec.get("error"))
    for q in SHARDED_ROOMS:
        assert dec[q.room]["status"] == "Success", dec[q.room]
    assert dec["pool_problems"] == [], dec["pool_problems"]  # both pools, every byte


@needs_sglang
@pytest.mark.slow
def test_the_kv_checksum_covers_every_cp_ranks_share():
    """--disaggregation-enable-kv-checksum with every CP rank sending: each CP rank digests
    the pages of its share and the decode compares each share's heads apart; a byte flipped
    in the last page (CP rank 1's share) after landing fails that request naming the share,
    and the others still succeed."""
    bad = SHARDED_ROOMS[0]
    pre, dec = run_cp(
        (1, 1, 2),
        (1, 1),
        Model(total_kv_heads=4, pool_tokens=192),
        SHARDED_ROOMS,
        sharded=True,
        checksum=True,
        corrupt_room=bad.room,
    )
    assert "error" not in pre and "error" not in dec, (pre.get("error"), dec.get("error"))
    for q in SHARDED_ROOMS[1:]:
        assert dec[q.room]["status"] == "Success", dec[q.room]
        # every head (4) of each CP rank's share was compared (an empty share's digests too)
        assert dec[q.room]["checksum_parts"][0] == {"CP rank 0/2": 4, "CP rank 1/2": 4}, dec[q.room]
    assert dec[bad.room]["status"] == "Failed", dec[bad.room]
    (reason,) = {r for r in dec[bad.room]["reasons"]}
    assert "KV checksum mismatch (--disaggregation-enable-kv-checksum) in the CP rank 1/2: KV head 0" in reason, reason


DCP_ROOMS = SHARDED_ROOMS + [R(0x0C93_0004_D00D, 29)]  # 8 pages here, 4 decode pages of DCP 2


@needs_sglang
@pytest.mark.slow
@pytest.mark.parametrize(
    "prefill, decode, dcp, extra",
    [
        ((1, 1, 2), (2, 1), 2, {}),  # CP 2 -> TP 2 with DCP 2
        ((1, 1, 3), (2, 1), 2, {}),  # CP 3: uneven and empty shares of the decode's pages
        ((1, 2, 2), (4, 1), 2, {}),  # DP 2 x CP 2 -> TP 4 with DCP 2: ranks r and r + 2 hold the same tokens
        ((1, 1, 2), (2, 1), 2, {"draft": True}),  # and the draft model's KV, not split over DCP ranks
        ((1, 1, 2), (4, 1), 4, {"checksum": True}),  # DCP 4, KV checksum per token phase and share
        # Kimi-Linear's pools: a hybrid MLA prefill always has every CP rank send (SGLang's
        # cp_sharded_prefill); its mamba state, from CP rank 0, re-sliced by channel for TP 2
        ((1, 1, 2), (2, 1), 2, {"state": True}),
    ],
    ids=["cp2-to-dcp2", "cp3-to-dcp2", "dp2xcp2-to-tp4-dcp2", "draft", "dcp4-checksum", "hybrid-mla-mamba"],
)
def test_every_cp_rank_sends_its_share_to_a_decode_with_dcp(prefill, decode, dcp, extra):
    """A decode with ``--dcp-size N`` (MLA; each DCP rank holds every N-th token in pages of
    ``page_size * N`` tokens) does not know how many pages a request fills on the prefill, so
    the CP ranks split the decode's page list (SGLang's split of it) and each sends the
    tokens of its share, N of its pages per decode page. Each CP rank's pool holds the
    request's KV only in those pages (its poison elsewhere): every row each DCP rank must
    hold matches the oracle, every page no request was given holds its sentinel, the bytes
    per CP rank are in proportion to the shares; with the checksum, every share's digests
    of the rank's token phase are compared; a hybrid model's mamba state (written on CP rank
    0 only) lands in every decode rank's slot, each rank's channels, and nowhere else."""
    from tests.integrations.sglang_state_env import StateModel

    draft = Draft(num_layers=1, head_dim=8, mla=True) if extra.get("draft") else None
    kimi = dict(mamba_conv_dim=12, mamba_groups=(4, 4, 4), mamba_kimi=True)  # Kimi's conv: [k - 1, q|k|v]
    state = StateModel(kinds=("mamba",), **kimi) if extra.get("state") else None
    model = Model(mla=True, head_dim=24, pool_tokens=192, draft=draft, state=state)
    assert model.hybrid_mla == bool(state)
    checksum = bool(extra.get("checksum"))
    pre, dec = run_cp(prefill, decode, model, DCP_ROOMS, sharded=True, dcp=dcp, checksum=checksum)
    assert "error" not in pre and "error" not in dec, (pre.get("error"), dec.get("error"))
    ptp, pdp, pcp = prefill
    differs = 0  # requests whose shares are not SGLang's split of the pages here
    for q in DCP_ROOMS:
        assert dec[q.room]["status"] == "Success", dec[q.room]
        assert dec[q.room]["problems"] == [], dec[q.room]["problems"]
        pages = -(-q.tokens // model.page_size)
        shares = [len(dps.cp_share(pages, c, pcp, dcp)) for c in range(pcp)]
        assert sum(shares) == pages
        differs += shares != [len(dps.cp_share(pages, c, pcp)) for c in range(pcp)]
        labels = [f"CP rank {c}/{pcp}" for c in range(pcp)]
        assert [c for c, _, ok in dec[q.room]["cp_ranks"] if ok] == labels
        # the tokens a CP rank sends follow its share (the last one's up to the decode page's end)
        landed = [b for _, b, _ in dec[q.room]["cp_ranks"]]
        assert [b > 0 for b in landed] == [n > 0 for n in shares], (landed, shares)
        if checksum:  # the latent (one head) of each share on each decode rank
            assert dec[q.room]["checksum_parts"] == [dict.fromkeys(labels, 1)] * decode[0], dec[q.room]
    assert differs, "no request tells the decode's split from the prefill's"
    assert dec["pool_problems"] == [], "\n".join(dec["pool_problems"])


@needs_sglang
def test_cp_page_shares_are_sglangs():
    """Both sides split a request's pages with ``cp_page_share``: SGLang's own split, for
    every page count up to 40 and CP sizes 1-8 (a share may be empty)."""
    from sglang_kvxfer.integrations.sglang_args import cp_page_share

    for size in range(1, 9):
        for pages in range(41):
            ours = [cp_page_share(pages, c, size) for c in range(size)]
            assert [range(s.start, s.stop) for s in ours] == [dps.cp_share(pages, c, size) for c in range(size)]


@needs_sglang
def test_a_hybrid_mla_prefill_with_cp_has_every_cp_rank_send_its_share(monkeypatch):
    """SGLang's rule (cp_sharded_prefill): a hybrid MLA model (Kimi-Linear's pools) with
    attention CP has every CP rank send its share, without the environment variable. In
    process: CP rank 1's manager is a sender (not a dummy) registering as CP rank 1 of 2 and
    builds no state manager (the state comes from CP rank 0, whose manager has them);
    --dcp-size with every CP rank sending is refused by name."""
    from sglang_kvxfer.integrations import sglang as backend
    from tests.integrations.sglang_state_env import StateModel

    for name, value in sides.ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", raising=False)
    model = Model(mla=True, head_dim=24, kv_cache_dtype_str="bfloat16", state=StateModel(kinds=("mamba",)))
    mode = load_utils_defs().DisaggregationMode.PREFILL
    port = free_port()
    made = []
    try:
        for cp in range(2):
            mem = rank_memory(model, 1, 0, "prefill")
            mem.kv_args.engine_rank = cp  # --tp 2 --attn-cp-size 2: attention-TP rank 0, CP rank cp
            sa = server_args("m", "prefill", 2, port, attn_cp_size=2)
            made.append(backend.KVXferKVManager(mem.kv_args, mode, sa, model.is_mla_backend))
        zero, one = made
        assert (one.cp_sharded, one.is_dummy_cp_rank, one.config.cp_rank, one.config.cp_size) == (True, False, 1, 2)
        assert (zero.config.cp_rank, zero.config.cp_size, zero.enable_all_cp_ranks_for_transfer) == (0, 2, True)
        assert len(zero.state_engines) == 2 and one.state_engines == []  # mamba conv and SSM rows
        assert len(one.config.state_pools) == 2 and one.config.state_pools == zero.config.state_pools  # announced
        # (a hybrid model's state refuses DCP first; an MLA model with the variable set:)
        monkeypatch.setenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", "1")
        mla = Model(mla=True, head_dim=24)
        mem = rank_memory(mla, 1, 0, "prefill")
        sa = server_args("m", "prefill", 4, port, attn_cp_size=2, dcp_size=2)
        with pytest.raises(KVXferError, match=r"does not support --dcp-size=2: with --attn-cp-size=2 every"):
            backend.KVXferKVManager(mem.kv_args, mode, sa, mla.is_mla_backend)
    finally:
        for mgr in made:
            mgr.close()


@needs_sglang
def test_a_cp_share_sent_before_the_decodes_request_fails_the_request_saying_so(monkeypatch):
    """A CP rank's share depends on the decode's DCP size, which comes with the decode's
    request: a ``send()`` before it (SGLang's scheduler never does that: it sends after
    WaitingForInput) fails the request naming why, and nothing is sent."""
    from sglang_kvxfer.integrations import sglang as backend

    for name, value in sides.ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", "1")
    model = Model(mla=True, head_dim=24)
    mem = rank_memory(model, 1, 0, "prefill")
    mem.kv_args.engine_rank = 1  # --tp 2 --attn-cp-size 2: CP rank 1
    sa = server_args("m", "prefill", 2, free_port(), attn_cp_size=2)
    mgr = backend.KVXferKVManager(mem.kv_args, load_utils_defs().DisaggregationMode.PREFILL, sa, True)
    try:
        assert mgr.cp_sharded and not mgr.is_dummy_cp_rank
        sender = backend.KVXferKVSender(mgr, sa.host, 0xC9_05)
        sender.init(4, 0)
        sender.send(np.arange(1, 5, dtype=np.int32), [])
        assert sender.poll() == dps.FAILED
        want = "send(): send() came before the decode's request arrived (poll is not WaitingForInput)"
        with pytest.raises(backend.KVXferTransferError, match=re.escape(want)):
            sender.failure_exception()
        assert sender.get_transfer_metric().transfer_total_bytes == 0
    finally:
        mgr.close()


@needs_sglang
def test_a_decode_with_dcp_refuses_a_prefill_whose_cp_ranks_each_send_with_its_own_dcp(monkeypatch):
    """A decode of --dcp-size 2 facing a prefill that registered cp_size=2 and dcp_size=2 (our
    prefill refuses that itself; a defence against another build): every request routed
    there fails at init naming both settings (and tells the prefill's CP rank 0 why)."""
    from types import SimpleNamespace

    from sglang_kvxfer.integrations import sglang as backend
    from sglang_kvxfer.integrations.sglang_pp import PrefillTopology

    for name, value in sides.ENV.items():
        monkeypatch.setenv(name, value)
    model = Model(mla=True, head_dim=24)
    mem = rank_memory(model, 2, 0, "decode")
    sa = server_args("m", "decode", 2, free_port(), dcp_size=2)
    mgr = backend.KVXferKVManager(mem.kv_args, load_utils_defs().DisaggregationMode.DECODE, sa, True)
    try:
        addr, g = "127.0.0.1:9", mgr.layout.geometry
        topo = PrefillTopology(1, g, 1, (0,), None, 1, (range(g.num_layers),), cp_size=2, dcp_size=2)
        mgr._lookups[addr] = SimpleNamespace(result=topo, error="", close=lambda: None)  # as looked up
        assert mgr.try_ensure_parallel_info(addr)
        info = mgr.prefill_info_table[addr]
        want = (
            "--dcp-size=2: the prefill's 2 attention-CP ranks each send their share of a request's pages and it "
            "runs --dcp-size=2 itself"
        )
        assert want in info.problem and not info.routable, info
        rx = backend.KVXferKVReceiver(mgr, addr, 5)
        rx.init(0)
        assert rx.poll() == dps.FAILED and [p.label for p in rx._rxs] == ["PP stage 0"]
        with pytest.raises(backend.KVXferTransferError, match=want):
            rx.failure_exception()
    finally:
        mgr.close()


# -- --enable-dsa-cache-layer-split: each CP rank holds (and sends) a share of the layers -------
@needs_sglang
@pytest.mark.slow
@pytest.mark.parametrize(
    "prefill, decode, layers",
    [
        ((1, 1, 2), (1, 1), 3),  # CP 2 over 3 layers (SGLang's split: 2 + 1) -> TP 1
        ((1, 1, 3), (2, 1), 4),  # CP 3 over 4 layers (2 + 1 + 1) -> TP 2
        ((1, 2, 2), (2, 1), 4),  # DP 2 x CP 2 -> TP 2: each group's CP ranks their two layers
    ],
    ids=["cp2-to-tp1", "cp3-to-tp2", "dp2xcp2-to-tp2"],
)
def test_each_cp_rank_sends_its_layers_of_a_dsa_cache_layer_split(prefill, decode, layers):
    """DeepSeek-V3.2's pools (an MLA latent and a DSA indexer per layer, one layer without an
    indexer) with --enable-dsa-cache-layer-split: each CP rank's KVArgs list its contiguous
    share of the layers only (SGLang's split, from prefill_start_layer), latent and indexer,
    every page of them; it registers as a stage of those layers and sends them. Each CP rank's
    pools hold its own poison outside what it wrote, so every decode byte matching the oracle
    (latent and indexer rows, every layer) shows each layer came from its owner."""
    from tests.integrations.sglang_state_env import StateModel

    state = StateModel(kinds=("dsa",), dsa_layers=layers, dsa_skip=(1,))
    model = Model(mla=True, head_dim=24, num_layers=layers, pool_tokens=192, state=state)
    port = free_port()
    env = {**sides.ENV, "KVXFER_SGLANG_TRANSPORT": "local"}
    (ptp, pdp, pcp), (dtp, ddp) = prefill, decode
    specs = [
        dps.DpSpec("prefill", model, ptp, pdp, port, SHARDED_ROOMS, env, cp=pcp, cp_layer_split=True),
        dps.DpSpec("decode", model, dtp, ddp, port, SHARDED_ROOMS, env),
    ]
    pre, dec = sides.run_in_processes(dps.main, specs, 60.0)
    assert "error" not in pre and "error" not in dec, (pre.get("error"), dec.get("error"))
    for q in SHARDED_ROOMS:
        assert dec[q.room]["status"] == "Success", dec[q.room]
        assert dec[q.room]["problems"] == [], dec[q.room]["problems"]  # the indexer rows of every layer
        sent = pre[(q.room, q.room % pdp)]["bytes"]
        assert all(b > 0 for b in sent), sent  # every CP rank sent its layers
    assert dec["pool_problems"] == [], dec["pool_problems"]


@needs_sglang
def test_a_cp_rank_of_a_dsa_cache_layer_split_registers_as_a_stage_of_its_layers(monkeypatch):
    """In process: CP rank 1 of 2 over 3 layers (SGLang's split: [2, 3)) is a sender of the
    stage of its layers (PP stage 1 of 2 to the bootstrap, first layer 2) with no SGLang PP
    consensus, sending every page (no CP page share), its DSA indexer on its own layer;
    KVArgs without prefill_start_layer are refused naming the field."""
    from sglang_kvxfer.integrations import sglang as backend
    from tests.integrations.sglang_state_env import StateModel

    for name, value in sides.ENV.items():
        monkeypatch.setenv(name, value)
    model = Model(mla=True, head_dim=24, num_layers=3, state=StateModel(kinds=("dsa",), dsa_layers=3, dsa_skip=()))
    sub, start = dps.split_model(model, 2, 1)
    assert (start, sub.num_layers) == (2, 1)
    mode = load_utils_defs().DisaggregationMode.PREFILL
    sa = server_args("m", "prefill", 2, free_port(), attn_cp_size=2, enable_dsa_cache_layer_split=True)
    mem = rank_memory(sub, 1, 0, "prefill")
    mem.kv_args.engine_rank, mem.kv_args.prefill_start_layer = 1, 2
    mgr = backend.KVXferKVManager(mem.kv_args, mode, sa, sub.is_mla_backend)
    try:
        cfg = mgr.config
        assert (cfg.pp_rank, cfg.pp_size, cfg.layer_start, cfg.cp_rank, cfg.cp_size) == (1, 2, 2, 0, 1)
        assert (mgr.is_dummy_cp_rank, mgr.cp_sharded, mgr.stage_status) == (False, False, None)
        assert cfg.geometry.num_layers == 1 and [s.name for s, _ in mgr.state_engines] == ["state:dsa"]
    finally:
        mgr.close()
    mem = rank_memory(sub, 1, 0, "prefill")
    mem.kv_args.engine_rank, mem.kv_args.prefill_start_layer = 1, None
    with pytest.raises(KVXferError, match=r"KVArgs.prefill_start_layer=None must be an int >= 0 \(CP rank 1, DSA"):
        backend.KVXferKVManager(mem.kv_args, mode, sa, sub.is_mla_backend)
