"""Extra per-request state (``KVArgs.state_types``: SWA, mamba, DSA, MXFP8 block scales,
MiniMax, QSA) through our SGLang classes, driven by the scripted scheduler in SGLang's call
order (``sglang_sides``: prefill and decode in separate processes, SGLang's real base
classes, the KVArgs state fields filled by SGLang's own ``append_state_component``,
``state_indices`` in the shapes its schedulers' payloads have).

Every byte of every state row a decode rank must hold is compared with an oracle
(``sglang_state_env``): the SWA window's pages of every SWA head the rank owns (TP 1 -> 1,
2 -> 1, 1 -> 2, and one SWA head replicated on two decode ranks), the rank's own channels of
every mamba conv sub-block and SSM row (any TP pair, GDN's and Kimi's conv layouts, a
replicated tensor), every DSA indexer row of the request's pages (equal TP and, replicated
under MLA, across TP sizes), every MXFP8 block-scale and MiniMax row of the request's pages
(rank to rank), every QSA ring and compressed-key row (replicated, across TP sizes), and no
state row any request was not given may change. A state geometry that differs between the
servers fails at registration naming the field and both values; state pools on one side
only, or state that cannot be re-sliced between TP sizes, fail naming both sides.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from tests.integrations import sglang_sides as sides
from tests.integrations.sglang_env import Model, import_sglang_base
from tests.integrations.sglang_state_env import StateModel
from tests.ports import free_port

_base, _reason = import_sglang_base()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_base is None, reason=_reason)]

# (room, prompt tokens): a window inside a prompt of several chunks; a prompt shorter than the window
REQUESTS = [(0x5A7E_0001_F00D, 37), (0x5A7E_0002_CAFE, 9)]


def run(
    p,
    d,
    prefill_model,
    decode_model=None,
    *,
    transport="local",
    timeout_s=60.0,
    kv_checksum=False,
    corrupt="",
    requests=REQUESTS,
):
    """``kv_checksum`` goes to both sides, ``corrupt`` to the decode only."""
    port = free_port()
    env = {**sides.ENV, "KVXFER_SGLANG_TRANSPORT": transport}
    prefill = sides.Spec("prefill", prefill_model, p, port, requests, env, timeout_s, kv_checksum=kv_checksum)
    decode = sides.Spec(
        "decode", decode_model or prefill_model, d, port, requests, env, timeout_s, kv_checksum=kv_checksum
    )
    decode = dataclasses.replace(decode, corrupt=corrupt)
    return sides.run_in_processes(sides.main, [prefill, decode], timeout_s)


def model(*kinds, mla=False, **state) -> Model:
    return Model(total_kv_heads=4, kv_cache_dtype_str="bfloat16", mla=mla, state=StateModel(kinds=kinds, **state))


def succeeded(prefill, decode, requests=REQUESTS):
    for room, *_ in requests:
        assert decode[room]["status"] == "Success", decode[room]
        # sglang_sides checks every byte of the KV, the metadata slot and the state rows
        assert decode[room]["problems"] == [], decode[room]["problems"]
        assert prefill[room]["status"] == "Success", prefill[room]


ANOTHER_RANK = "KVXferTransferError: Failed due to an unknown reason from another rank [from another rank]"


def failed_on_both_sides(prefill, decode, *wanted):
    """Every decode rank and one or more prefill ranks name the reason. A prefill rank may
    instead see SGLang's all-reduced poll fail before its own engine heard the decode (the
    scheduler then reports it from another rank), never with another reason."""
    for room, _ in REQUESTS:
        for side, report in (("decode", decode[room]), ("prefill", prefill[room])):
            assert report["status"] == "Failed", (side, report)
            named = [r for r in report["reasons"] if r != ANOTHER_RANK or side == "decode"]
            assert named, (side, report["reasons"])
            for reason in named:
                for want in wanted:
                    assert want in reason, (side, want, reason)


@pytest.mark.parametrize(
    "p, d, swa_heads, transport",
    [
        (1, 1, 2, "local"),
        (2, 1, 2, "tcp"),  # a decode rank gathers the SWA heads of two writers
        (1, 2, 2, "local"),  # a prefill rank's SWA heads split over two decode ranks
        (1, 2, 1, "local"),  # one SWA head, replicated on both decode ranks
        (2, 2, 2, "local"),
    ],
)
def test_swa_window_pages_land_byte_exact_with_heads_resharded(p, d, swa_heads, transport):
    m = model("swa", swa_heads=swa_heads)
    succeeded(*run(p, d, m, transport=transport))


@pytest.mark.parametrize("p, d", [(1, 1), (2, 2), (2, 1), (1, 2)])
def test_dsa_indexer_rows_land_byte_exact_replicated_under_mla(p, d):
    succeeded(*run(p, d, model("dsa", mla=True)))


@pytest.mark.parametrize("p, d", [(1, 1), (2, 2)])
def test_mamba_slot_rows_land_byte_exact_each_rank_its_own_shard(p, d):
    succeeded(*run(p, d, model("mamba")))


GDN = dict(mamba_conv_dim=16, mamba_groups=(4, 4, 8))  # conv [q|k|v], v twice q, as Qwen3-Next's
KIMI = dict(mamba_conv_dim=12, mamba_groups=(4, 4, 4), mamba_kimi=True)  # conv [k - 1, q|k|v]


@pytest.mark.parametrize(
    "p, d, state, transport",
    [
        (2, 1, {}, "local"),  # conv and SSM channels of two writers into one row
        (1, 2, {}, "tcp"),  # one writer's row split over two readers
        (2, 1, GDN, "tcp"),  # each conv sub-block gathered on its own: [q0 q1 | k0 k1 | v0 v1]
        (1, 2, GDN, "local"),
        (2, 2, GDN, "local"),
        (1, 2, KIMI, "local"),  # sub-blocks of every one of the k - 1 outer rows
        (2, 1, {**KIMI, "mamba_replicated": 24}, "tcp"),  # and a replicated tensor beside them
    ],
    ids=["plain-2to1", "plain-1to2", "gdn-2to1", "gdn-1to2", "gdn-2to2", "kimi-1to2", "kimi+replicated-2to1"],
)
def test_mamba_state_is_resliced_by_channel_between_tp_sizes(p, d, state, transport):
    succeeded(*run(p, d, model("mamba", **state), transport=transport))


@pytest.mark.parametrize(
    "p, d, transport", [(1, 1, "local"), (2, 1, "tcp"), (1, 2, "local")], ids=["1to1", "2to1", "1to2"]
)
def test_a_hybrid_mla_model_moves_its_latent_and_its_mamba_state(p, d, transport):
    """Kimi-Linear's pools: SGLang's HybridLinearKVPool over an MLA pool, for which it passes
    is_mla_backend=False and sets KVArgs.is_hybrid_mla_backend. The latent is replicated on
    every rank, the conv and SSM channels are re-sliced between TP sizes; every byte of both
    is compared."""
    m = model("mamba", mla=True, **KIMI)
    assert m.hybrid_mla and not m.is_mla_backend
    succeeded(*run(p, d, m, transport=transport))


TAIL = dict(dsa_layers=3, dsa_skip=(1,), tail_pool=8)  # 37 tokens: 5 live in the open pool, 9 tokens: 1


@pytest.mark.parametrize(
    "p, d, prefill_extra, decode_extra, transport",
    [
        (1, 1, 1, 1, "local"),  # rings of 9: the 37-token request's 5 live tokens wrap (positions 5..8, 0)
        (2, 1, 1, 3, "tcp"),  # rings of 9 -> 11 (more speculative slots on the decode): re-mapped token by token
        (1, 2, 3, 0, "local"),  # rings of 11 -> 8 (no extra slot), replicated on both decode ranks
    ],
    ids=["ring9-1to1", "ring9to11-2to1", "ring11to8-1to2"],
)
def test_dsa_indexer_tails_land_token_by_token_between_rings_of_any_size(p, d, prefill_extra, decode_extra, transport):
    """GLM-5-style DSA with kpool compression: beside the indexer rows, each request's open
    pool's tail tokens (K and score rings per layer, a layer sharing another's indexer has
    none) land at the decode's own ring positions (SGLang's get_dsa_tail_state_indices on each
    side) in order, every byte compared."""
    pm = model("dsa", "dsa_tail", mla=True, tail_extra=prefill_extra, **TAIL)
    dm = model("dsa", "dsa_tail", mla=True, tail_extra=decode_extra, **TAIL)
    succeeded(*run(p, d, pm, dm, transport=transport))


def test_a_closed_tail_pool_moves_no_tail_and_a_tail_width_mismatch_fails_at_registration():
    """A prompt that fills its last pool has no open tail (SGLang's index is empty): its KV
    and indexer rows land; tails of another index_head_dim fail both sides naming the field."""
    closed = dict(TAIL, tail_pool=37)  # the 37-token request: no live token; the 9-token one: 9
    succeeded(*run(1, 1, model("dsa", "dsa_tail", mla=True, **closed)))
    pm = model("dsa_tail", mla=True, tail_dim=4, **TAIL)
    dm = model("dsa_tail", mla=True, tail_dim=8, **TAIL)
    prefill, decode = run(1, 1, pm, dm, timeout_s=30.0)
    failed_on_both_sides(
        prefill, decode, "DSA indexer tails (KVArgs.state_types[0]='dsa_tail'", "head_dim: prefill=8 decode=16"
    )


def mxfp8(*kinds) -> Model:
    """``--kv-cache-dtype mxfp8``: FP8 E4M3 KV (SGLang's MHATokenToKVPoolMXFP8) and its block
    scales as state (``block_scale``; a hybrid SWA model's SWA sub-pool's as ``block_scale_swa``)."""
    return Model(total_kv_heads=4, dtype="float8_e4m3fn", kv_cache_dtype_str="mxfp8", state=StateModel(kinds=kinds))


@pytest.mark.parametrize(
    "p, d, kinds, transport",
    [
        (1, 1, ("block_scale",), "local"),
        (2, 2, ("block_scale",), "tcp"),  # each rank's scales (of its own heads) to the same rank
        (2, 2, ("swa", "block_scale", "block_scale_swa"), "local"),  # SWAKVPool, both sub-pools MXFP8
    ],
    ids=["1to1", "2to2", "swa-2to2"],
)
def test_mxfp8_block_scales_land_byte_exact_beside_the_fp8_kv(p, d, kinds, transport):
    """Every page's scale rows (a function of room, entry, rank and position) land on the
    decode rank of the same TP rank, the SWA sub-pool's for the window's pages; the FP8 KV
    and the SWA window are compared byte for byte as always."""
    succeeded(*run(p, d, mxfp8(*kinds), transport=transport))


def test_mxfp8_block_scales_between_tp_sizes_are_refused_as_sglang_refuses_them():
    prefill, decode = run(2, 1, mxfp8("block_scale"), timeout_s=30.0)
    failed_on_both_sides(
        prefill,
        decode,
        "MXFP8 KV block scales (KVArgs.state_types[0]='block_scale', entries 0..3: rows of 32 bytes)",
        "prefill attention TP size 2 and decode attention TP size 1 differ",
        "BLOCK_SCALE",
    )


def test_state_the_backend_cannot_move_whole_is_refused_at_manager_construction(monkeypatch):
    """MXFP8 KV without its scales in KVArgs, an MXFP8 draft pool (SGLang registers no scales
    of it), an SWA sub-pool's block scales and MiniMax state over PP stages are refused naming
    the flag or field."""
    from sglang_kvxfer.integrations import sglang as backend
    from tests.integrations.sglang_env import Draft, rank_memory, server_args

    _, defs = sides.setup(sides.Spec("prefill", mxfp8("block_scale"), 1, free_port(), []))
    mode = defs.DisaggregationMode.PREFILL

    def manager(m: Model, **extra):
        sa = server_args(sides.MODEL_PATH, "prefill", 1, free_port(), **extra)
        return backend.KVXferKVManager(rank_memory(m, 1, 0, "prefill").kv_args, mode, sa, False)

    no_scales = Model(total_kv_heads=4, dtype="float8_e4m3fn", kv_cache_dtype_str="mxfp8")
    with pytest.raises(Exception, match=r"KVArgs.kv_cache_dtype_str='mxfp8': an MXFP8 KV pool whose block scales"):
        manager(no_scales)
    drafted = dataclasses.replace(mxfp8("block_scale"), draft=Draft())
    monkeypatch.setattr(backend, "_draft_model_kv", sides._draft_heads(drafted))
    with pytest.raises(Exception, match=r"--speculative-draft-kv-cache-dtype='auto': an MXFP8 draft KV pool"):
        manager(drafted)
    swa_scales = mxfp8("swa", "block_scale", "block_scale_swa")  # (the full-attention scales move stage to stage)
    monkeypatch.setattr(backend, "_model_swa_kv_heads", lambda server_args: swa_scales.state.swa_heads)
    with pytest.raises(Exception, match=r"--pp-size=2: with MXFP8 SWA KV block scales \(state:block_scale_swa, "):
        manager(swa_scales, pp_size=2, disable_overlap_schedule=True)
    monkeypatch.setattr(backend, "_model_total_kv_heads", sides._model_heads(minimax("minimax_index_k")))
    with pytest.raises(Exception, match=r"--pp-size=2: with MiniMax sparse state \(state:minimax_index_k, "):
        manager(minimax("minimax_index_k"), pp_size=2, disable_overlap_schedule=True)


def minimax(*kinds, **state) -> Model:
    """A MiniMax sparse-attention pool (``MiniMaxSparseKVPool``): layer 0 dense, layers 1 and 2
    sparse with K-only index keys (``minimax_index_k``), the dense layer's KV as
    ``minimax_dense_kv``."""
    return Model(num_layers=3, total_kv_heads=4, kv_cache_dtype_str="bfloat16", state=StateModel(kinds=kinds, **state))


# a decode radix-cache hit of 16 tokens (4 pages) on the long prompt, none on the short one
PREFIXED = [(REQUESTS[0][0], 37, 16), REQUESTS[1]]


@pytest.mark.parametrize(
    "p, d, alias, requests, transport",
    [
        (1, 1, True, REQUESTS, "local"),
        (2, 2, True, PREFIXED, "tcp"),  # rank to rank; the index keys after the decode's prefix only
        (2, 2, False, PREFIXED, "local"),  # a hisparse pool's dense_pool: buffers of their own
    ],
    ids=["1to1", "2to2-prefix-tcp", "2to2-prefix-dense-pool"],
)
def test_minimax_sparse_index_keys_and_dense_kv_land_byte_exact(p, d, alias, requests, transport):
    """Every index-key row of the request's pages after the decode's prefix (SGLang's own
    minimax_index_transfer_pages on both sides) lands on the decode rank of the same TP rank
    and the prefix's rows stay the decode's; the dense layer's K and V pages from the first
    token land (the main KV pool's own buffers, their KV compared byte for byte prefix
    included, or, in a hisparse pool, a pool of their own, each page a function of the rank)."""
    m = minimax("minimax_index_k", "minimax_dense_kv", minimax_alias=alias)
    succeeded(*run(p, d, m, transport=transport, requests=requests), requests=requests)


def test_minimax_sparse_state_between_tp_sizes_is_refused_as_sglang_refuses_it():
    prefill, decode = run(2, 1, minimax("minimax_index_k"), timeout_s=30.0)
    failed_on_both_sides(
        prefill,
        decode,
        "MiniMax sparse index keys (KVArgs.state_types[0]='minimax_index_k', entries 0..1: rows of 64 bytes)",
        "prefill attention TP size 2 and decode attention TP size 1 differ",
        "MiniMax sparse PD requires matching attention TP sizes",
    )


@pytest.mark.parametrize(
    "p, d, requests, transport",
    [(1, 1, REQUESTS, "local"), (2, 1, PREFIXED, "tcp"), (1, 2, PREFIXED, "local")],
    ids=["1to1", "2to1-prefix-tcp", "1to2-prefix"],
)
def test_qsa_rings_and_compressed_keys_land_byte_exact_replicated(p, d, requests, transport):
    """A Qwen4-Exp-style hybrid (QSATokenToKVPool: mamba state beside a QSA indexer of one index
    head): every byte of the request row's pending key and RoPE rings (SGLang's own
    get_qsa_pending_state_indices on each side, rows of their own beside the mamba slot) and of
    the compressed keys of every KV page from the first token lands on every decode rank, from
    one writer each, between TP sizes too; the mamba channels are re-sliced as always."""
    m = model("mamba", "qsa_pending", "qsa_compressed")
    succeeded(*run(p, d, m, transport=transport, requests=requests), requests=requests)


def test_every_state_pool_of_a_request_lands_beside_its_kv():
    succeeded(*run(2, 2, model("mamba", "swa", "dsa"), transport="tcp"))


@pytest.mark.parametrize(
    "state, why",
    [
        ({"mamba_dims": False}, "KVArgs.state_dim_per_tensor does not say how"),
        (
            {"mamba_conv_dim": 24, "mamba_groups": (4, 4, 16)},
            "the conv sub-blocks [4, 4, 16] (KVArgs.state_conv_shard_groups[0][0]) do not each divide the row",
        ),
    ],
    ids=["no-dims", "sub-blocks-not-dividing-the-row"],
)
def test_mamba_state_that_cannot_be_resliced_is_refused_between_tp_sizes_naming_both(state, why):
    prefill, decode = run(2, 1, model("mamba", **state), timeout_s=30.0)
    failed_on_both_sides(
        prefill,
        decode,
        "mamba state (KVArgs.state_types[0]='mamba', entries 0..1",
        "prefill attention TP size 2 and decode attention TP size 1 differ;",
        why,
    )


def test_dsa_of_a_non_mla_model_between_tp_sizes_is_refused_as_sglang_refuses_it():
    prefill, decode = run(1, 2, model("dsa"), timeout_s=30.0)
    failed_on_both_sides(prefill, decode, "prefill attention TP size 1 and decode attention TP size 2 differ")


@pytest.mark.parametrize(
    "kinds, prefill_state, decode_state, field",
    [
        (("swa",), dict(swa_head_dim=8), dict(swa_head_dim=16), "head_dim: prefill=8 decode=16"),
        (("swa",), dict(swa_v_head_dim=4), dict(swa_v_head_dim=8), "v_head_dim: prefill=4 decode=8"),
        (("mamba",), dict(mamba_state=3), dict(mamba_state=5), "head_dim: prefill=24 decode=40"),  # bytes per SSM head
    ],
)
def test_a_state_geometry_mismatch_fails_at_registration_naming_the_field_and_both_values(
    kinds, prefill_state, decode_state, field
):
    prefill, decode = run(1, 1, model(*kinds, **prefill_state), model(*kinds, **decode_state), timeout_s=30.0)
    label = "SWA state (KVArgs.state_types[0]='swa')" if kinds == ("swa",) else "mamba state ("
    failed_on_both_sides(prefill, decode, label, field)


@pytest.mark.parametrize("side_with_state", ["prefill", "decode"])
def test_state_on_one_side_only_fails_the_request_naming_both_sides(side_with_state):
    with_state, without = model("swa"), Model(total_kv_heads=4, kv_cache_dtype_str="bfloat16")
    pm, dm = (with_state, without) if side_with_state == "prefill" else (without, with_state)
    prefill, decode = run(1, 1, pm, dm, timeout_s=30.0)
    pools = ("[state:swa]", "[none]") if side_with_state == "prefill" else ("[none]", "[state:swa]")
    failed_on_both_sides(
        prefill,
        decode,
        f"extra per-request state (KVArgs.state_types): prefill pools {pools[0]} decode pools {pools[1]}",
    )


def test_a_state_type_the_backend_does_not_move_is_refused_at_manager_construction():
    from tests.integrations.sglang_env import rank_memory, server_args

    m = model("swa", "dsv4_c4_state")  # (an Ascend NPU type, AscendStateType.DSV4_C4_STATE)
    backend, defs = sides.setup(sides.Spec("prefill", m, 1, free_port(), []))
    sa = server_args(sides.MODEL_PATH, "prefill", 1, free_port())
    with pytest.raises(Exception, match=r"KVArgs.state_types\[1\]='dsv4_c4_state': the backend moves mamba, swa"):
        backend.KVXferKVManager(rank_memory(m, 1, 0, "prefill").kv_args, defs.DisaggregationMode.PREFILL, sa, False)


def test_swa_index_lists_of_different_lengths_fail_the_request_instead_of_truncating():
    # the decode's window is longer: its SWA page list for the long prompt has 6 pages, the
    # prefill's 4 (SGLang's mooncake would truncate the longer list); the short prompt lies
    # inside both windows and lands
    prefill, decode = run(1, 1, model("swa", window=10), model("swa", window=20), timeout_s=30.0)
    (long_room, _), (short_room, _) = REQUESTS
    want = "SWA state (KVArgs.state_types[0]='swa'): "
    for side, report in (("prefill", prefill[long_room]), ("decode", decode[long_room])):
        assert report["status"] == "Failed", (side, report)
        (reason,) = report["reasons"]
        assert want in reason and "last chunk leaves 4 pages for a 24-token request (page_size 4 needs 6)" in reason
    assert decode[short_room]["status"] == "Success" and decode[short_room]["problems"] == [], decode[short_room]


@pytest.mark.parametrize(
    "p, d, kinds",
    [
        (2, 1, ("swa",)),  # SWA heads of two writers, each digested by its writer
        (2, 2, ("swa", "mamba", "dsa")),  # every kind, rank to rank
        (2, 1, ("mamba",)),  # mamba channels of two writers, each digested per channel by its writer
        (2, 2, ("block_scale",)),  # MXFP8 block scales beside FP8 KV
        (2, 1, ("qsa_pending", "qsa_compressed")),  # replicated QSA rows, one writer per decode rank
    ],
)
def test_kv_checksum_covers_every_state_pool_per_writer(p, d, kinds):
    m = mxfp8(*kinds) if "block_scale" in kinds else model(*kinds)
    prefill, decode = run(p, d, m, kv_checksum=True)
    succeeded(prefill, decode)
    for room, _ in REQUESTS:
        for parts in decode[room]["parts"]:  # every decode rank compared every pool's digests
            state = {label: n for label, n in parts.items() if label}
            assert "" in parts and parts[""] > 0, parts
            assert len(state) >= len(kinds) and all(n > 0 for n in state.values()), parts
            for kind in kinds:
                assert any(kind in label.lower() for label in state), (kind, parts)
    _, plain = run(p, d, m)  # without the flag nothing is digested
    assert all(parts == {} for room, _ in REQUESTS for parts in plain[room]["parts"]), plain


@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_a_state_byte_flipped_after_landing_fails_the_request_naming_the_pool(kind):
    prefill, decode = run(1, 1, model("swa", "mamba"), kv_checksum=True, corrupt=f"state:{kind}")
    (bad, _), (good, _) = REQUESTS
    assert decode[good]["status"] == "Success" and decode[good]["problems"] == [], decode[good]
    assert decode[bad]["status"] == "Failed", decode[bad]
    (reason,) = decode[bad]["reasons"]
    pattern = (
        r"KV checksum mismatch \(--disaggregation-enable-kv-checksum\) in the [^\n]*" + kind + r"[^\n]*?: "
        r"KV head \d+ written by prefill rank 0: prefill crc32=0x[0-9a-f]{8}, decode crc32=0x[0-9a-f]{8}"
    )
    assert re.search(pattern, reason, re.I), reason
    assert prefill[bad]["status"] == "Success", prefill[bad]  # the prefill sent what it digested
