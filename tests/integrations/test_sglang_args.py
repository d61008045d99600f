"""KVArgs / ServerArgs translation (no SGLang needed): geometry from SGLang-shaped
attribute bags, every refusal with its message, aux slots over real memory, NIC lists."""

from __future__ import annotations

import ctypes
import json
from types import SimpleNamespace

import numpy as np
import pytest

from sglang_kvxfer.errors import GeometryError, KVXferError
from sglang_kvxfer.integrations.sglang_args import (
    AuxLayout,
    kv_dtype,
    layout_from_kv_args,
    nic_list,
    plan_from_server_args,
)


def kv_args(layers=3, heads=2, head_dim=16, v_head_dim=8, page_size=4, rows=68, itemsize=2, mla=False, draft=0, **over):
    """A KVArgs-shaped bag over fake addresses (the translation never touches KV memory)."""
    dims = [head_dim] * layers + ([] if mla else [v_head_dim] * layers) + [head_dim] * draft
    h = 1 if mla else heads
    items = [page_size * h * d * itemsize for d in dims]
    aux = [np.zeros((8, 16), dtype=np.int32), np.zeros((8, 8), dtype=np.uint64)]
    bag = SimpleNamespace(
        engine_rank=1,
        kv_data_ptrs=[0x10000 * (i + 1) for i in range(len(dims))],
        kv_data_lens=[it * (rows // page_size) for it in items],
        kv_item_lens=items,
        kv_cache_dtype_str="bfloat16",
        kv_layout=None,
        state_types=[],
        is_hybrid_mla_backend=False,
        page_size=page_size,
        num_draft_entries=draft,
        ib_device=None,
        gpu_id=0,
        aux_data_ptrs=[a.ctypes.data for a in aux],
        aux_data_lens=[a.nbytes for a in aux],
        aux_item_lens=[a[0].nbytes for a in aux],
        _keep=aux,
    )
    if not mla:
        bag.kv_head_num, bag.total_kv_head_num = heads, heads * 2
    for k, v in over.items():
        if v is None:
            delattr(bag, k)
        else:
            setattr(bag, k, v)
    return bag


def test_mha_kv_args_become_the_full_geometry():
    lay = layout_from_kv_args(kv_args(), tp_size=2, mla=False, dtype="bfloat16")
    g = lay.geometry
    assert (g.num_layers, g.total_kv_heads, g.head_dim, g.v_head_dim, g.page_size, g.num_pages) == (3, 4, 16, 8, 4, 17)
    assert (g.dtype, str(g.layout), g.mla, lay.tp_size, lay.tp_rank) == ("bfloat16", "NHD", False, 2, 1)
    assert len(lay.kv_ptrs) == 6 and lay.num_draft_entries == 0 and lay.draft is None
    assert lay.aux.num_slots == 8


def test_draft_entries_become_a_geometry_of_their_own():
    # EAGLE-style: one draft layer (K and V entries after the model's), 8 KV heads of the draft
    # model's config on a TP-2 side, the same pages as the model's pool
    args = kv_args(draft=2)
    lay = layout_from_kv_args(args, tp_size=2, mla=False, dtype="bfloat16", draft_kv=lambda: (8, False))
    d = lay.draft
    assert d is not None and lay.num_draft_entries == 2
    assert (d.geometry.num_layers, d.geometry.total_kv_heads, d.geometry.head_dim, d.geometry.v_head_dim) == (
        1,
        8,
        8,
        8,
    )
    assert (d.geometry.page_size, d.geometry.num_pages, d.geometry.mla) == (4, 17, False)
    assert d.kv_ptrs == tuple(args.kv_data_ptrs[6:]) and len(lay.kv_ptrs) == 6
    assert lay.geometry.num_layers == 3  # the model's geometry is unchanged
    mla = layout_from_kv_args(
        kv_args(mla=True, head_dim=24, draft=1), tp_size=2, mla=True, dtype="bfloat16", draft_kv=lambda: (1, True)
    )
    assert mla.draft is not None and (mla.draft.geometry.mla, mla.draft.geometry.num_layers) == (True, 1)
    fp8 = layout_from_kv_args(
        args, tp_size=2, mla=False, dtype="bfloat16", draft_kv=lambda: (8, False), draft_dtype="float8_e4m3fn"
    )
    assert fp8.draft is not None and (fp8.draft.geometry.dtype, fp8.draft.geometry.head_dim) == ("float8_e4m3fn", 16)


def test_draft_entries_are_refused_with_the_reason():
    args = kv_args(draft=2)
    with pytest.raises(GeometryError, match=r"num_draft_entries=2: the draft model's KV head count is needed"):
        layout_from_kv_args(args, tp_size=2, mla=False, dtype="bfloat16")

    def broken():
        raise FileNotFoundError("draft/config.json")

    with pytest.raises(
        GeometryError,
        match=r"draft model's config \(--speculative-draft-model-path\) could not supply its KV head count "
        r"\(FileNotFoundError: draft/config.json\)",
    ):
        layout_from_kv_args(args, tp_size=2, mla=False, dtype="bfloat16", draft_kv=broken)
    with pytest.raises(GeometryError, match=r"num_draft_entries=3: the draft model has MHA attention.*even count"):
        layout_from_kv_args(kv_args(draft=3), tp_size=2, mla=False, dtype="bfloat16", draft_kv=lambda: (4, False))
    with pytest.raises(GeometryError, match=r"kv_item_lens\[6\]=256 \(draft K\) is not a whole number of heads"):
        layout_from_kv_args(args, tp_size=2, mla=False, dtype="bfloat16", draft_kv=lambda: (12, False))
    with pytest.raises(GeometryError, match=r"the draft model's KV heads on attention TP 2: .*3"):
        layout_from_kv_args(args, tp_size=2, mla=False, dtype="bfloat16", draft_kv=lambda: (3, False))


def test_mla_kv_args_need_no_head_counts():
    lay = layout_from_kv_args(kv_args(mla=True, head_dim=24), tp_size=4, mla=True, dtype="bfloat16")
    assert (lay.geometry.mla, lay.geometry.total_kv_heads, lay.geometry.head_dim, lay.geometry.v_head_dim) == (
        True,
        1,
        24,
        0,
    )


def test_replicated_heads_come_from_the_total_not_the_bytes():
    # H=2 on a TP-4 side: each rank holds one head; kv_head_num * tp would say 4
    args = kv_args(heads=1, total_kv_head_num=2, engine_rank=3)
    g = layout_from_kv_args(args, tp_size=4, mla=False, dtype="bfloat16").geometry
    assert g.total_kv_heads == 2 and g.head_dim == 16


def test_missing_total_heads_names_the_sglang_pr_and_version():
    with pytest.raises(GeometryError, match=r"total_kv_head_num is not set: SGLang added .* PR #19086 .*0\.5\.23"):
        layout_from_kv_args(kv_args(total_kv_head_num=None), tp_size=2, mla=False, dtype="bfloat16")


def test_missing_total_heads_falls_back_to_the_model_config():
    args = kv_args(total_kv_head_num=None, kv_head_num=None)
    g = layout_from_kv_args(args, tp_size=2, mla=False, dtype="bfloat16", total_kv_heads=lambda: 4).geometry
    assert g.total_kv_heads == 4 and g.head_dim == 16

    def broken():
        raise FileNotFoundError("config.json")

    with pytest.raises(
        GeometryError, match=r"model config could not supply it \(FileNotFoundError: config.json\).*PR #19086"
    ):
        layout_from_kv_args(args, tp_size=2, mla=False, dtype="bfloat16", total_kv_heads=broken)


def test_per_rank_head_count_must_match_ownership():
    with pytest.raises(
        GeometryError, match=r"kv_head_num=3 but rank 1 of an attention TP group of 2 owns 2 of total_kv_head_num=4"
    ):
        layout_from_kv_args(kv_args(kv_head_num=3), tp_size=2, mla=False, dtype="bfloat16")


def test_item_length_that_is_not_whole_heads_names_the_entry():
    args = kv_args()
    args.kv_item_lens[4] += 2
    with pytest.raises(GeometryError, match=r"kv_item_lens\[4\]=130 \(V\) is not a whole number of heads"):
        layout_from_kv_args(args, tp_size=2, mla=False, dtype="bfloat16")


def test_layers_with_different_head_dims_are_refused():
    args = kv_args()
    args.kv_item_lens[1] *= 2
    args.kv_data_lens[1] *= 2
    with pytest.raises(
        GeometryError, match=r"head_dim \(K\) differs between KV entries: entry 0 has 16, entry 1 has 32"
    ):
        layout_from_kv_args(args, tp_size=2, mla=False, dtype="bfloat16")


def test_buffers_of_different_page_counts_are_refused():
    args = kv_args()
    args.kv_data_lens[2] -= args.kv_item_lens[2]
    with pytest.raises(GeometryError, match=r"pages per buffer .* entry 0 has 17, entry 2 has 16"):
        layout_from_kv_args(args, tp_size=2, mla=False, dtype="bfloat16")


def test_an_odd_mha_entry_count_is_refused():
    args = kv_args()
    for name in ("kv_data_ptrs", "kv_data_lens", "kv_item_lens"):
        getattr(args, name).pop()
    with pytest.raises(GeometryError, match=r"5 main entries, expected K and V of every layer"):
        layout_from_kv_args(args, tp_size=2, mla=False, dtype="bfloat16")


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("state_types", ["dsv4_c128"], r"KVArgs.state_types\[0\]='dsv4_c128': the backend moves mamba, swa, dsa"),
        ("kv_layout", "v4,c4:v4,c128:v4", r"KVArgs.kv_layout='v4,c4:v4,c128:v4': a kv_layout pool that is not an MLA"),
    ],
)
def test_unsupported_pools_are_refused_by_name(field, value, message):
    with pytest.raises(KVXferError, match=message):
        layout_from_kv_args(kv_args(**{field: value}), tp_size=2, mla=False, dtype="bfloat16")


def test_a_hybrid_mla_pool_is_read_as_mla():
    """SGLang passes is_mla_backend=False for a HybridLinearKVPool over an MLA pool
    (Kimi-Linear) and sets KVArgs.is_hybrid_mla_backend: one latent buffer per layer."""
    hybrid = kv_args(mla=True, head_dim=24, is_hybrid_mla_backend=True)
    got = layout_from_kv_args(hybrid, tp_size=4, mla=False, dtype="bfloat16").geometry
    want = layout_from_kv_args(kv_args(mla=True, head_dim=24), tp_size=4, mla=True, dtype="bfloat16").geometry
    assert got == want and got.mla and got.num_layers == 3


def test_kv_dtype_strings():
    assert kv_dtype("bf16") == kv_dtype("bfloat16") == "bfloat16"
    assert kv_dtype("fp8_e4m3") == "float8_e4m3fn" and kv_dtype("fp8_e5m2") == "float8_e5m2"
    assert kv_dtype("mxfp8") == "float8_e4m3fn"  # its block scales move as the block_scale state
    assert kv_dtype("auto", "float16") == "float16"
    assert kv_dtype("auto", "auto") == kv_dtype(None) == "uint8"  # described in bytes
    for fp4 in ("nvfp4", "fp4_mx_block16"):  # SGLang registers their packed K and V without the scales
        with pytest.raises(
            KVXferError, match=rf"--kv-cache-dtype='{fp4}': SGLang 0.5.23's FP4 KV pools .* without its"
        ):
            kv_dtype(fp4)
    with pytest.raises(GeometryError, match=r"KVArgs.kv_cache_dtype_str='int3': dtype='int3' is not supported"):
        kv_dtype("int3")


def test_auto_dtype_counts_head_dim_in_bytes():
    args = kv_args(kv_cache_dtype_str="auto")
    g = layout_from_kv_args(args, tp_size=2, mla=False, dtype=kv_dtype("auto")).geometry
    assert (g.dtype, g.head_dim, g.v_head_dim) == ("uint8", 32, 16)


def server(**over):
    base = dict(
        tp_size=4,
        attn_dp_size=1,
        attn_cp_size=1,
        dp_size=1,
        pp_size=1,
        dcp_size=1,
        device="cuda",
        host="0.0.0.0",
        dist_init_addr=None,
        disaggregation_bootstrap_port=8998,
        disaggregation_ib_device="mlx5_0",
        disaggregation_decode_enable_radix_cache=False,
        disaggregation_decode_allocation_policy="early",
        enable_pd_role_switch=False,
        dtype="auto",
    )
    base.update(over)
    return SimpleNamespace(**base)


def test_server_plan():
    plan = plan_from_server_args(server(), "prefill")
    assert (plan.attn_tp_size, plan.bootstrap, plan.device, plan.ib_device) == (4, "127.0.0.1:8998", "cuda", "mlx5_0")
    assert plan_from_server_args(server(dist_init_addr="10.1.2.3:5000"), "decode").bootstrap == "10.1.2.3:8998"
    assert plan_from_server_args(server(device=None), "decode").device == "cuda"
    # The decode radix cache is served: the prefix length travels with the request.
    assert plan_from_server_args(server(disaggregation_decode_enable_radix_cache=True), "decode").role == "decode"


def test_attention_dp_plan():
    """--enable-dp-attention (before or after SGLang's resolution) gives DP groups of
    attn_tp = tp / dp ranks; a prefill rank's group is engine_rank // attn_tp (SGLang's
    derive_attention_ranks: (dp, tp) with tp fastest)."""
    for over in (dict(dp_size=2, enable_dp_attention=True), dict(attn_dp_size=2)):  # unresolved, resolved
        plan = plan_from_server_args(server(**over), "prefill")
        assert (plan.attn_tp_size, plan.attn_dp_size) == (2, 2)
        assert [plan.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    dec = plan_from_server_args(
        server(dp_size=4, enable_dp_attention=True, load_balance_method="round_robin"), "decode"
    )
    assert (dec.attn_tp_size, dec.attn_dp_size, dec.dp_rank(0)) == (1, 4, 0)  # decode routing is its own
    with pytest.raises(GeometryError, match="tp_size=4 is not a multiple of the attention-DP size 3"):
        plan_from_server_args(server(attn_dp_size=3), "prefill")


def test_system_dp_plan():
    """--dp-size without --enable-dp-attention: full TP replicas behind one bootstrap, each a
    DP group of tp_size ranks counted from 0; a prefill rank's group is its replica
    (KVArgs.system_dp_rank), whatever its engine_rank."""
    plan = plan_from_server_args(server(tp_size=2, dp_size=3), "prefill")
    assert (plan.attn_tp_size, plan.attn_dp_size, plan.system_dp_size, plan.dp_groups) == (2, 1, 3, 3)
    assert [plan.dp_rank(r, d) for d in range(3) for r in range(2)] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(GeometryError, match=r"KVArgs.system_dp_rank=3 names no replica of --dp-size=3"):
        plan.dp_rank(0, 3)
    attn = plan_from_server_args(server(dp_size=2, enable_dp_attention=True), "prefill")
    assert (attn.system_dp_size, attn.dp_groups) == (1, 2)
    dec = plan_from_server_args(server(tp_size=1, dp_size=2, load_balance_method="round_robin"), "decode")
    assert (dec.attn_tp_size, dec.system_dp_size, dec.dp_rank(0, 1)) == (1, 2, 0)  # decode routing is its own


def test_a_prefill_load_balancer_makes_the_groups_register_their_rooms(monkeypatch):
    """follow_bootstrap_room (and "auto", its prefill default) place a request by its room;
    any other --load-balance-method, or SGLang's force-query flag, makes each DP group register
    the rooms it got with the bootstrap (follows_room=False)."""
    for lb, follows in (("auto", True), ("follow_bootstrap_room", True), ("round_robin", False)):
        for over in (dict(attn_dp_size=2), dict(dp_size=2)):
            plan = plan_from_server_args(server(load_balance_method=lb, **over), "prefill")
            assert plan.follows_room is follows, (lb, over)
    monkeypatch.setenv("SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK", "1")
    assert plan_from_server_args(server(attn_dp_size=2), "prefill").follows_room is False


def test_pipeline_parallel_plan():
    """--pp-size is served on both sides (the stages' layers come from each rank's KVArgs)."""
    for role in ("prefill", "decode"):
        plan = plan_from_server_args(server(pp_size=4, tp_size=2), role)
        assert (plan.pp_size, plan.attn_tp_size) == (4, 2)
    assert plan_from_server_args(server(), "prefill").pp_size == 1
    # with prefill attention CP: each stage's CP ranks (SGLang polls them in its PP consensus)
    plan = plan_from_server_args(server(pp_size=2, tp_size=4, attn_cp_size=2), "prefill")
    assert (plan.pp_size, plan.attn_cp_size, plan.attn_tp_size) == (2, 2, 2)
    with pytest.raises(GeometryError, match=r"ServerArgs.pp_size='0' must be an integer >= 1"):
        plan_from_server_args(server(pp_size="0"), "prefill")


def test_kv_cache_sharding_on_a_prefill_has_every_shard_rank_send_the_pages_it_holds():
    """--enable-kv-cache-sharding: over attention CP (every CP rank sends, without
    SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER), or without CP over attention TP."""
    plan = plan_from_server_args(server(tp_size=4, attn_cp_size=2, enable_kv_cache_sharding=True), "prefill")
    assert (plan.kv_sharded, plan.cp_sharded, plan.attn_cp_size, plan.attn_tp_size) == (True, True, 2, 2)
    plan = plan_from_server_args(server(tp_size=2, enable_kv_cache_sharding=True), "prefill")
    assert (plan.kv_sharded, plan.cp_sharded, plan.attn_tp_size) == (True, False, 2)
    assert not plan_from_server_args(server(tp_size=2), "prefill").kv_sharded


@pytest.mark.parametrize(
    "over, role, flag",
    [
        (dict(dp_size=4, attn_dp_size=2), "decode", "--dp-size=4"),
        (dict(tp_size=2, attn_cp_size=2), "decode", "--attn-cp-size=2"),  # SGLang's decode asserts CP 1 too
        # CP ranks that hold different pages (sharded CP): every CP rank would send
        (dict(tp_size=4, attn_cp_size=2, enable_cp_tp_group_sharing=True), "prefill", "--enable-cp-tp-group-sharing"),
        (dict(tp_size=2, attn_cp_size=2, pp_size=2, enable_cp_tp_group_sharing=True), "prefill", "--pp-size=2"),
        (dict(tp_size=2, attn_cp_size=2, pp_size=2, enable_dsa_cache_layer_split=True), "prefill", "--pp-size=2"),
        (
            dict(tp_size=2, attn_cp_size=2, enable_dsa_cache_layer_split=True, enable_cp_tp_group_sharing=True),
            "prefill",
            "--enable-cp-tp-group-sharing=True: with --enable-dsa-cache-layer-split",
        ),
        # --enable-kv-cache-sharding: SGLang's own rules (kv_shard_hook), if they were bypassed
        (dict(tp_size=2, enable_kv_cache_sharding=True), "decode", "--enable-kv-cache-sharding=True: it is for a"),
        (dict(tp_size=1, enable_kv_cache_sharding=True), "prefill", "--enable-kv-cache-sharding=True: it shards"),
        (dict(tp_size=4, attn_cp_size=2, enable_kv_cache_sharding=True, dcp_size=2), "prefill", "--dcp-size=2"),
        (
            dict(tp_size=4, dp_size=2, enable_dp_attention=True, enable_kv_cache_sharding=True),
            "prefill",
            "--attn-dp-size=2: with --enable-kv-cache-sharding",
        ),
        (
            dict(tp_size=2, attn_cp_size=2, enable_kv_cache_sharding=True, enable_dsa_cache_layer_split=True),
            "prefill",
            "--enable-dsa-cache-layer-split=True: with --enable-kv-cache-sharding",
        ),
        (
            dict(disaggregation_decode_allocation_policy="whenever"),
            "decode",
            "--disaggregation-decode-allocation-policy='whenever'",
        ),
        # prefill_complete: SGLang's own rules (_validate_prefill_complete), if they were bypassed
        (dict(disaggregation_decode_allocation_policy="prefill_complete", tp_size=2), "prefill", "--tp-size=2"),
        (
            dict(disaggregation_decode_allocation_policy="prefill_complete", tp_size=1, pp_size=2),
            "prefill",
            "--pp-size=2",
        ),
        (
            dict(disaggregation_decode_allocation_policy="prefill_complete", tp_size=2, attn_cp_size=2),
            "prefill",
            "--attn-cp-size=2",
        ),
        (
            dict(
                disaggregation_decode_allocation_policy="prefill_complete",
                tp_size=1,
                disaggregation_decode_enable_radix_cache=True,
            ),
            "decode",
            "--disaggregation-decode-enable-radix-cache=True",
        ),
        (dict(device="npu"), "prefill", "--device='npu'"),
    ],
)
def test_unsupported_server_settings_name_the_flag(over, role, flag):
    with pytest.raises(KVXferError, match="does not support " + flag.replace("[", r"\[")):
        plan_from_server_args(server(**over), role)


def test_prefill_complete_is_served_with_attention_tp_1_also_under_attention_dp():
    """--disaggregation-decode-allocation-policy prefill_complete on either side: attention TP 1
    (DP attention groups of one rank each are fine), as SGLang requires it."""
    for role in ("prefill", "decode"):
        over = dict(tp_size=1, disaggregation_decode_allocation_policy="prefill_complete")
        assert plan_from_server_args(server(**over), role).prefill_complete
        over = dict(
            tp_size=2, dp_size=2, enable_dp_attention=True, disaggregation_decode_allocation_policy="prefill_complete"
        )
        assert plan_from_server_args(server(**over), role).prefill_complete
    assert not plan_from_server_args(server(), "decode").prefill_complete


def test_cp_tp_group_sharing_is_a_prefill_of_attention_tp_1_over_its_cp_ranks(monkeypatch):
    """--enable-cp-tp-group-sharing (--tp C --attn-cp-size C): attention TP 1, C CP ranks,
    not SGLang's all-CP-ranks transfer even with its variable set; a decode ignores the flag
    (SGLang refuses it there); the refusal for --tp 4 --attn-cp-size 2 names both sizes."""
    monkeypatch.setenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", "1")
    plan = plan_from_server_args(server(tp_size=2, attn_cp_size=2, enable_cp_tp_group_sharing=True), "prefill")
    assert (plan.attn_tp_size, plan.attn_cp_size, plan.cp_tp_sharing, plan.cp_sharded) == (1, 2, True, False)
    assert plan.cp_rank(1) == 1
    assert not plan_from_server_args(server(tp_size=2, enable_cp_tp_group_sharing=True), "prefill").cp_tp_sharing
    with pytest.raises(KVXferError, match=r"attn_cp_size=2, tp_size=4"):
        plan_from_server_args(server(tp_size=4, attn_cp_size=2, enable_cp_tp_group_sharing=True), "prefill")


def test_a_dsa_cache_layer_split_has_every_cp_rank_send_its_layers(monkeypatch):
    """--enable-dsa-cache-layer-split (prefill CP): each CP rank sends every page of its layers,
    not a share of the pages, even with SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER set."""
    monkeypatch.setenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", "1")
    plan = plan_from_server_args(server(tp_size=2, attn_cp_size=2, enable_dsa_cache_layer_split=True), "prefill")
    assert (plan.cp_layer_split, plan.cp_sharded, plan.attn_tp_size, plan.pp_size) == (True, False, 1, 1)
    assert not plan_from_server_args(server(tp_size=2, enable_dsa_cache_layer_split=True), "prefill").cp_layer_split


def test_a_dcp_size_must_divide_the_attention_tp_size():
    assert plan_from_server_args(server(tp_size=4, dcp_size=2), "decode").dcp_size == 2
    assert plan_from_server_args(server(tp_size=4, dcp_size=4), "decode").dcp_size == 4
    assert plan_from_server_args(server(tp_size=4, dcp_size=2), "prefill").dcp_size == 2
    with pytest.raises(GeometryError, match=r"ServerArgs.dcp_size=3 does not divide the attention TP size 4"):
        plan_from_server_args(server(tp_size=4, dcp_size=3), "decode")


def test_prefill_attention_cp_ranks_and_their_dp_groups_follow_sglangs_layout():
    """(dp, cp, tp) with tp fastest: tp_rank = (dp * cp_size + cp) * attn_tp + attn_tp_rank."""
    plan = plan_from_server_args(server(tp_size=8, dp_size=2, enable_dp_attention=True, attn_cp_size=2), "prefill")
    assert (plan.attn_tp_size, plan.attn_cp_size, plan.attn_dp_size) == (2, 2, 2)
    got = [(plan.dp_rank(r), plan.cp_rank(r), r % plan.attn_tp_size) for r in range(8)]
    assert got == [(dp, cp, tp) for dp in range(2) for cp in range(2) for tp in range(2)]
    decode = plan_from_server_args(server(tp_size=2), "decode")
    assert decode.cp_rank(1) == 0 and decode.attn_cp_size == 1


def test_enable_prefill_cp_is_served_as_attention_cp():
    """--enable-prefill-cp turns SGLang's prefill CP strategy on (zigzag or interleave); its
    transfer code never reads it: CP rank 0 sends every page (each CP rank holds the KV)."""
    plan = plan_from_server_args(server(tp_size=2, attn_cp_size=2, enable_prefill_cp=True), "prefill")
    assert (plan.attn_cp_size, plan.attn_tp_size, plan.cp_sharded) == (2, 1, False)


def test_all_cp_ranks_transfer_makes_every_cp_rank_a_sender(monkeypatch):
    assert not plan_from_server_args(server(tp_size=2, attn_cp_size=2), "prefill").cp_sharded
    monkeypatch.setenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", "1")
    assert plan_from_server_args(server(tp_size=2, attn_cp_size=2), "prefill").cp_sharded
    plan = plan_from_server_args(server(tp_size=2), "prefill")
    assert plan.attn_cp_size == 1 and not plan.cp_sharded  # without CP it does not matter
    assert not plan_from_server_args(server(tp_size=2), "decode").cp_sharded
    monkeypatch.setenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", "0")
    assert not plan_from_server_args(server(tp_size=2, attn_cp_size=2), "prefill").cp_sharded


def test_nic_lists(tmp_path):
    assert nic_list(None, 0) == [] and nic_list("", 3) == []
    assert nic_list("mlx5_0, mlx5_1", 5) == ["mlx5_0", "mlx5_1"]
    mapping = {"0": "mlx5_0,mlx5_1", "1": "mlx5_2"}
    assert nic_list(json.dumps(mapping), 1) == ["mlx5_2"]
    path = tmp_path / "nics.json"
    path.write_text(json.dumps(mapping))
    assert nic_list(str(path), 0) == ["mlx5_0", "mlx5_1"]
    with pytest.raises(ValueError, match="names no NIC for GPU 7"):
        nic_list(json.dumps(mapping), 7)
    with pytest.raises(ValueError, match="is not valid JSON"):
        nic_list("{mlx5_0", 0)
    with pytest.raises(ValueError, match="cannot read it"):
        nic_list(str(tmp_path / "missing.json"), 0)


def aux_over(arrays) -> AuxLayout:
    return AuxLayout(
        tuple(a.ctypes.data for a in arrays), tuple(a.nbytes for a in arrays), tuple(a[0].nbytes for a in arrays)
    )


def test_aux_slot_moves_between_layouts_byte_exact():
    rng = np.random.default_rng(0)
    src = [rng.integers(0, 255, (6, 64), dtype=np.uint8), rng.integers(0, 2**31, (6, 8), dtype=np.int64)]
    dst = [np.zeros((4, 64), dtype=np.uint8), np.zeros((4, 8), dtype=np.int64)]
    payload = aux_over(src).read(5)
    aux_over(dst).write(2, payload)
    assert np.array_equal(dst[0][2], src[0][5]) and np.array_equal(dst[1][2], src[1][5])
    assert not dst[0][[0, 1, 3]].any() and not dst[1][[0, 1, 3]].any()  # only slot 2 written


def test_aux_layout_mismatch_writes_nothing_and_says_which_buffer():
    src = [np.ones((4, 16), dtype=np.int32), np.ones((4, 8), dtype=np.int64)]
    dst = [np.zeros((4, 16), dtype=np.int32), np.zeros((4, 4), dtype=np.int64)]
    with pytest.raises(ValueError, match=r"aux buffer 1: prefill sent 64 bytes per slot, this decode rank holds 32"):
        aux_over(dst).write(0, aux_over(src).read(0))
    with pytest.raises(ValueError, match=r"carries 2 metadata buffers; this decode rank has 1"):
        aux_over(dst[:1]).write(0, aux_over(src).read(0))
    with pytest.raises(ValueError, match=r"magic"):
        aux_over(dst).write(0, b"\0" * 64)
    assert not dst[0].any() and not dst[1].any()


def test_aux_slot_bounds_and_layout_checks():
    buf = (ctypes.c_uint8 * 64)()
    aux = AuxLayout((ctypes.addressof(buf),), (64,), (16,))
    assert aux.num_slots == 4
    for bad in (-1, 4, 1.0, True, None):
        with pytest.raises(ValueError, match=r"aux_index=.* must be a slot in \[0, 4\)"):
            aux.read(bad)
    with pytest.raises(GeometryError, match=r"aux_data_ptrs/aux_data_lens/aux_item_lens have 1/2/1 entries"):
        AuxLayout((1,), (64, 64), (16,))
    with pytest.raises(GeometryError, match=r"aux_data_lens\[0\]=8 holds no item of aux_item_lens\[0\]=16"):
        AuxLayout((1,), (8,), (16,))
