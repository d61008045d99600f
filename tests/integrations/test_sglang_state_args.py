"""Extra per-request state (``KVArgs.state_types``) translated into engine pools (no SGLang
needed): the SWA sub-pool's head geometry, mamba's and DSA's one-row-per-index pools, each
refusal with the field it names, SGLang's ``state_indices`` shapes, and why two servers'
state pools cannot exchange a request."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_kvxfer.errors import GeometryError, KVXferError
from sglang_kvxfer.integrations.sglang_args import layout_from_kv_args
from sglang_kvxfer.integrations.sglang_state import state_pages, state_problem
from tests.integrations.test_sglang_args import kv_args

PS = 4  # page size of kv_args()


def swa(heads_local=1, head_dim=8, v_head_dim=4, layers=2, rows=40, itemsize=2):
    items = [PS * heads_local * d * itemsize for d in [head_dim] * layers + [v_head_dim] * layers]
    return dict(
        ptrs=[0x900000 + 0x1000 * i for i in range(len(items))],
        lens=[it * (rows // PS) for it in items],
        items=items,
    )


def rows(items, slots=7):
    return dict(ptrs=[0x700000 + 0x10000 * i for i in range(len(items))], lens=[i * slots for i in items], items=items)


def with_state(*components, layout="nhd", **over):
    """kv_args() with ``components`` [(type, dict(ptrs, lens, items))] as setup_state_kv_args
    appends them."""
    fields = dict(
        state_types=[t for t, _ in components],
        state_data_ptrs=[c["ptrs"] for _, c in components],
        state_data_lens=[c["lens"] for _, c in components],
        state_item_lens=[c["items"] for _, c in components],
    )
    if layout is not None:  # None: left unset (KVArgs declares it without a value)
        fields["swa_kv_cache_layout"] = layout
    return kv_args(**fields, **over)


def layout(args, tp_size=2, mla=False, swa_heads=2, index_head_dim=64):
    return layout_from_kv_args(
        args,
        tp_size=tp_size,
        mla=mla,
        dtype="bfloat16",
        swa_kv_heads=lambda: swa_heads,
        dsa_index_head_dim=lambda: index_head_dim,
    )


def test_the_swa_sub_pool_is_a_head_geometry_of_its_own():
    (pool,) = layout(with_state(("swa", swa()))).states  # engine_rank 1 of TP 2: 1 of 2 SWA heads
    g = pool.geometry
    assert (pool.name, pool.kind, pool.index) == ("state:swa", "swa", 0)
    assert (g.num_layers, g.total_kv_heads, g.head_dim, g.v_head_dim, g.page_size, g.num_pages) == (2, 2, 8, 4, 4, 10)
    assert (g.mla, str(g.layout), g.dtype, pool.equal_tp_only) == (False, "NHD", "bfloat16", "")
    assert len(pool.ptrs) == 4 and pool.label == "SWA state (KVArgs.state_types[0]='swa')"
    # one SWA head on TP 4: replicated, as the ownership rule gives it
    four = with_state(("swa", swa()), kv_head_num=1, total_kv_head_num=4)
    assert layout(four, tp_size=4, swa_heads=1).states[0].geometry.total_kv_heads == 1


def test_mamba_rows_without_per_tensor_dims_become_one_pool_per_run_of_one_row_size_equal_tp_only():
    conv, ssm = 2 * 24 * 3, 4 * 2 * 4 * 4  # per slot: [conv_dim/tp, k-1] bf16, [heads/tp, hd, state] fp32
    pools = layout(with_state(("mamba", rows([conv, conv, ssm, ssm])))).states
    assert [p.name for p in pools] == ["state:mamba.0", "state:mamba.1"]
    for p, item in zip(pools, (conv, ssm)):
        g = p.geometry
        assert (g.num_layers, g.head_dim, g.page_size, g.num_pages, g.dtype, g.mla) == (2, item, 1, 7, "uint8", True)
        assert "KVArgs.state_dim_per_tensor does not say how" in p.equal_tp_only
    assert pools[1].label == "mamba state (KVArgs.state_types[0]='mamba', entries 2..3: rows of 128 bytes)"


def test_sliced_mamba_rows_become_k_only_channel_geometries_any_tp():
    conv, ssm = 2 * 24 * 3, 4 * 2 * 4 * 4  # engine_rank 1 of TP 2: 24 of 48 conv channels, 2 of 4 SSM heads of 64 bytes
    args = with_state(("mamba", rows([conv, conv, ssm, ssm])), state_dim_per_tensor=[[24, 24, 2, 2]])
    pools = layout(args).states
    assert [p.name for p in pools] == ["state:mamba.0", "state:mamba.1"]
    shapes = [(p.geometry.total_kv_heads, p.geometry.head_dim, p.geometry.v_head_dim, p.geometry.mla) for p in pools]
    assert shapes == [(48, 2 * 3, 0, False), (4, 128 // 2, 0, False)]
    assert [p.geometry.placement(2, 1).heads for p in pools] == [range(24, 48), range(2, 4)]
    assert [(p.slot_pages, p.equal_tp_only) for p in pools] == [((1, 1, 1), "")] * 2
    assert list(state_pages(pools[:1], [[np.asarray(3)]])[0]) == [3]


@pytest.mark.parametrize(
    "over, words",
    [
        (
            {"state_dim_per_tensor": [[24, 24]]},
            r"KVArgs.state_dim_per_tensor\[0\] has 2 entries; KVArgs.state_item_lens\[0\] has 4",
        ),
        (
            {"state_dim_per_tensor": [[24, 24, 5, 5]]},
            r"state_item_lens\[0\]\[2\]=128 is not a whole number of channels: state_dim_per_tensor\[0\]\[2\]=5",
        ),
        (
            {"state_dim_per_tensor": [[24, 24, 2, 2]], "state_conv_shard_groups": [[[13, 13, 22], None, None, None]]},
            r"state_conv_shard_groups\[0\]\[0\]=\[13, 13, 22\]: sub-blocks \[13, 13\] are not divisible by attention TP size 2",
        ),
        (
            {"state_dim_per_tensor": [[24, 24, -1, 2]]},
            r"KVArgs.state_dim_per_tensor\[0\]\[2\]=-1 must be an integer >= 0",
        ),
    ],
)
def test_mamba_slicing_fields_that_do_not_describe_the_rows_are_refused_naming_them(over, words):
    conv, ssm = 2 * 24 * 3, 4 * 2 * 4 * 4
    with pytest.raises(GeometryError, match=words):
        layout(with_state(("mamba", rows([conv, conv, ssm, ssm])), **over))


def test_dsa_indexer_rows_skip_empty_layers_and_are_replicated_under_mla():
    dsa = rows([132 * PS, 0, 132 * PS], slots=17)
    dsa["ptrs"][1], dsa["lens"][1] = 0, 0  # a layer that reuses another's top-k has no buffer
    (pool,) = layout(with_state(("dsa", dsa), mla=True), mla=True).states
    assert (pool.name, pool.geometry.num_layers, pool.geometry.head_dim, pool.equal_tp_only) == (
        "state:dsa",
        2,
        528,
        "",
    )
    assert pool.ptrs == (dsa["ptrs"][0], dsa["ptrs"][2])
    (mha,) = layout(with_state(("dsa", dsa))).states  # not replicated on an MHA model: SGLang refuses a TP mismatch too
    assert "non-MLA DSA hybrid models" in mha.equal_tp_only


def test_dsa_tails_are_rows_of_one_ring_token_and_their_indices_the_live_tokens_in_order():
    """GLM-5-style kpool compression: per layer a K and a score ring of 5 tokens of
    index_head_dim 64 (bf16: 128 bytes a token) per request slot; an indexer-sharing layer has
    none. A request's six numbers become the rows of its live tokens, wrapping the ring."""
    token, ring = 2 * 64, 5
    tail = rows([ring * token, 0, ring * token, 0], slots=7)
    tail["ptrs"][1], tail["lens"][1], tail["ptrs"][3], tail["lens"][3] = 0, 0, 0, 0
    (pool,) = layout(with_state(("dsa_tail", tail), mla=True), mla=True).states
    g = pool.geometry
    assert (pool.name, pool.kind, pool.ring, g.num_layers, g.head_dim, g.num_pages) == (
        "state:dsa_tail", "dsa_tail", 5, 2, 128, 7 * 5
    )  # fmt: skip
    assert pool.ptrs == (tail["ptrs"][0], tail["ptrs"][2]) and pool.equal_tp_only == ""
    # slot 3, live tokens at ring positions 4, then 0 and 1 (get_dsa_tail_state_indices' wrap)
    (got,) = state_pages([pool], [[3, 4, 1, 0, 2, 5]])
    assert got.tolist() == [19, 15, 16]
    (empty,) = state_pages([pool], [[]])  # the request's pool is closed: nothing to move
    assert empty.size == 0
    with pytest.raises(ValueError, match=r"state_indices\[0\] \(dsa_tail\) names a ring of 6 tokens; .* hold 5"):
        state_pages([pool], [[3, 4, 1, 0, 2, 6]])
    with pytest.raises(ValueError, match=r"=\[3, 4, 2, 0, 0, 5\] is not a slot and two segments inside a ring of 5"):
        state_pages([pool], [[3, 4, 2, 0, 0, 5]])
    with pytest.raises(ValueError, match=r"must be SGLang's six numbers \(slot, offset, count, offset, count, ring"):
        state_pages([pool], [[3, 4, 1]])
    with pytest.raises(GeometryError, match=r"state_item_lens\[0\]\[0\]=640 \(dsa_tail\) is not a whole ring of tail "):
        layout(with_state(("dsa_tail", tail), mla=True), mla=True, index_head_dim=48)
    two = rows([ring * token, (ring + 1) * token], slots=7)
    with pytest.raises(GeometryError, match=r"holds rings of \[5, 6\] tokens"):
        layout(with_state(("dsa_tail", two), mla=True), mla=True)
    (mha,) = layout(with_state(("dsa_tail", rows([640])))).states
    assert "non-MLA DSA hybrid models" in mha.equal_tp_only


def test_minimax_index_keys_and_dense_kv_are_page_rows_moved_at_equal_tp_only():
    """MiniMaxSparseKVPool: two K-only sparse layers' index keys (one head of 8 bf16 values a
    token) and one dense layer's K then V (heads of 16 and 8 values): runs of one page row
    size each, between equal attention TP sizes only."""
    index, dense = rows([PS * 16, PS * 16], slots=25), rows([PS * 32, PS * 16], slots=25)
    pools = layout(with_state(("minimax_index_k", index), ("minimax_dense_kv", dense))).states
    assert [
        (p.name, p.kind, p.index, p.geometry.num_layers, p.geometry.head_dim, p.geometry.num_pages) for p in pools
    ] == [
        ("state:minimax_index_k", "minimax_index_k", 0, 2, 64, 25),
        ("state:minimax_dense_kv.0", "minimax_dense_kv", 1, 1, 128, 25),
        ("state:minimax_dense_kv.1", "minimax_dense_kv", 1, 1, 64, 25),
    ]
    assert all("MiniMax sparse PD requires matching attention TP sizes" in p.equal_tp_only for p in pools)
    (page_rows,) = state_pages(pools[:1], [np.array([3, 9], dtype=np.int32), None])
    assert page_rows.tolist() == [3, 9]
    assert state_problem([p.name for p in pools], pools, 2, 2) == ""
    assert "prefill attention TP size 2 and decode attention TP size 1 differ" in state_problem(
        [p.name for p in pools], pools, 2, 1
    )


def test_qsa_rings_and_compressed_keys_are_replicated_rows():
    """QSATokenToKVPool: two layers' pending key rings (ratio 4 x 64 bf16 values a request
    slot) and the RoPE ring (ratio 4 x 3 int64), then two layers' compressed keys (a page of 16
    tokens: 4 groups of 64 bf16 values): replicated over attention TP, one slot a request."""
    pending = rows([4 * 128, 4 * 128, 4 * 24], slots=9)
    compressed = rows([4 * 128, 4 * 128], slots=30)
    pools = layout(with_state(("qsa_pending", pending), ("qsa_compressed", compressed))).states
    assert [(p.name, p.geometry.num_layers, p.geometry.head_dim, p.equal_tp_only) for p in pools] == [
        ("state:qsa_pending.0", 2, 512, ""),
        ("state:qsa_pending.1", 1, 96, ""),
        ("state:qsa_compressed", 2, 512, ""),
    ]
    assert state_problem([p.name for p in pools], pools, 2, 1) == ""  # replicated: any TP pair
    got = state_pages(pools, [np.array([5], dtype=np.int32), np.array([3, 1])])  # one entry per state type
    assert [g.tolist() for g in got] == [[5], [5], [3, 1]]
    with pytest.raises(ValueError, match=r"state_indices\[0\] \(qsa_pending\) must be the request's one slot, got 2"):
        state_pages(pools, [np.array([5, 6]), np.array([3])])
    none = dict(ptrs=[], lens=[], items=[])  # a PP stage without a QSA layer: SGLang's components are empty
    with pytest.raises(GeometryError, match=r"state_data_ptrs\[0\] \(qsa_pending\) is empty: this PP stage holds no"):
        layout(with_state(("qsa_pending", none), ("qsa_compressed", none)))


def test_several_types_keep_state_types_order():
    args = with_state(("mamba", rows([64, 64])), ("swa", swa()), ("dsa", rows([16])))
    assert [(p.name, p.index) for p in layout(args).states] == [("state:mamba", 0), ("state:swa", 1), ("state:dsa", 2)]


@pytest.mark.parametrize(
    "args, message",
    [
        (with_state(("swa", swa()), ("dsv4_c128", rows([8]))), r"KVArgs.state_types\[1\]='dsv4_c128': the backend"),
        (with_state(("dsv4_c4_state", rows([8]))), r"transferring 'dsv4_c4_state' state is not implemented"),
        (with_state(("swa", swa()), layout="hnd"), r"KVArgs.swa_kv_cache_layout='hnd'"),
        (with_state(("swa", swa()), layout=None), r"KVArgs.swa_kv_cache_layout=None"),
    ],
)
def test_state_the_backend_does_not_move_is_refused_naming_the_field(args, message):
    with pytest.raises(KVXferError, match=message):
        layout(args)


def _bad(component, **change):
    c = {k: list(v) for k, v in component.items()}
    for key, (i, value) in change.items():
        c[key][i] = value
    return c


@pytest.mark.parametrize(
    "args, message",
    [
        (with_state(("swa", swa()), ("swa", swa())), r"KVArgs.state_types=\['swa', 'swa'\] names a type twice"),
        (with_state(("swa", _bad(swa(), items=(1, 100)))), r"state_item_lens\[0\]\[1\]=100 \(SWA K\) is not a whole"),
        (
            with_state(("swa", dict(swa(), ptrs=swa()["ptrs"][:3]))),
            r"state_data_ptrs\[0\]/state_data_lens\[0\]/state_item_lens\[0\] \(swa\) have 3/4/4 entries",
        ),
        (
            with_state(("swa", {k: v[:3] for k, v in swa().items()})),
            r"state_data_ptrs\[0\] \(swa\) has 3 entries; an MHA SWA sub-pool has K and V",
        ),
        (
            with_state(("mamba", _bad(rows([64, 64]), lens=(1, 32)))),
            r"state_data_lens\[0\]\[1\]=32 \(mamba\) holds no row",
        ),
        (with_state(("mamba", _bad(rows([64, 64]), lens=(1, 64 * 3)))), r"entries 0..1 hold \[3, 7\] rows"),
        (with_state(("dsa", rows([0, 0]))), r"KVArgs.state_item_lens\[0\] \(dsa\) has no non-empty entry"),
        (with_state(("mamba", _bad(rows([64]), ptrs=(0, 0)))), r"KVArgs.state_data_ptrs\[0\]\[0\]=0 must be"),
        (kv_args(state_types=["mamba"], state_data_ptrs=[]), r"KVArgs.state_data_ptrs is 0 components"),
    ],
)
def test_inconsistent_state_fields_are_refused_naming_the_field(args, message):
    with pytest.raises(GeometryError, match=message):
        layout(args)


def test_the_swa_head_count_comes_from_the_model_config_or_the_error_says_why():
    def broken():
        raise OSError("no config.json")

    with pytest.raises(GeometryError, match=r"could not supply the SWA layers' KV head count \(OSError: no config"):
        layout_from_kv_args(with_state(("swa", swa())), tp_size=2, mla=False, dtype="bfloat16", swa_kv_heads=broken)
    with pytest.raises(GeometryError, match=r"SWA layers' KV heads on attention TP 2: invalid TP layout"):
        layout(with_state(("swa", swa())), swa_heads=3)


def test_state_indices_in_sglangs_shapes():
    args = with_state(("mamba", rows([64, 128])), ("swa", swa()))
    pools = layout(args).states  # mamba.0, mamba.1, swa
    # _mamba_payload: [translate(...).cpu().numpy()], a 0-d array in a list; _swa_payload: int32 pages
    got = state_pages(pools, [[np.asarray(5)], np.array([3, 9], dtype=np.int32)])
    assert [g.tolist() for g in got] == [[5], [5], [3, 9]] and all(g.dtype == np.int64 for g in got)
    with pytest.raises(ValueError, match=r"state_indices\[1\] \(swa\) is missing \(state_indices has 1 entries\)"):
        state_pages(pools, [[np.asarray(5)]])
    with pytest.raises(ValueError, match=r"state_indices are missing: KVArgs.state_types \['mamba', 'swa'\]"):
        state_pages(pools, None)
    with pytest.raises(ValueError, match=r"state_indices\[0\] \(mamba\) must be the request's one slot, got 2"):
        state_pages(pools, [np.array([1, 2]), np.array([3])])
    with pytest.raises(ValueError, match=r"state_indices\[1\] \(swa\) must hold integer indices"):
        state_pages(pools, [[np.asarray(5)], np.array([0.5])])
    with pytest.raises(ValueError, match=r"this server keeps no per-request state"):
        state_pages((), [np.array([1])])
    assert state_pages((), []) == [] and state_pages((), None) == []


def test_why_two_servers_state_pools_cannot_exchange_a_request():
    pools = layout(with_state(("mamba", rows([64])), ("swa", swa()))).states
    assert state_problem(["state:swa"], pools[1:], 2, 1) == ""  # SWA re-shards its heads
    assert state_problem(["state:mamba", "state:swa"], pools, 2, 2) == ""
    one_side = state_problem([], pools, 2, 2)
    assert one_side.startswith(
        "extra per-request state (KVArgs.state_types): prefill pools [none] decode pools [state:mamba, state:swa]"
    )
    assert "--disable-hybrid-swa-memory on both or neither" in one_side
    tp = state_problem(["state:mamba", "state:swa"], pools, 2, 1)
    assert tp.startswith(
        "mamba state (KVArgs.state_types[0]='mamba', entries 0..0: rows of 64 bytes): prefill attention TP size 2 "
        "and decode attention TP size 1 differ; mamba conv/SSM state rows are sharded"
    ), tp


V4 = "v4,c4:v4,c128:v4"  # DeepSeekV4TokenToKVPool.pd_kv_layout() of the V4 layouts


def dsv4(layout=V4, **over):
    """A DeepSeek-V4 rank's KVArgs: get_contiguous_buf_infos' [C4 KV x2, C4 indexer x2, C128 KV]
    (one item a padded page of each pool), get_state_buf_infos' SWA KV of two layers and a C4
    compressor ring (one item an SWA page's), the C128 ring pages and a draft's request row."""
    kv = rows([4608, 4608, 528, 528, 1152], slots=20)
    return with_state(
        ("swa", rows([2048, 2048, 384])),
        ("c128_state", rows([1536], slots=16)),
        ("request_row", rows([8])),
        layout=None,
        kv_layout=layout,
        kv_data_ptrs=kv["ptrs"],
        kv_data_lens=kv["lens"],
        kv_item_lens=kv["items"],
        **over,
    )


def test_a_deepseek_v4_pool_moves_whole_compressed_pages_and_rows_of_state_replicated():
    lay = layout(dsv4(), mla=True)
    g = lay.geometry  # the first run (C4 KV): one row a page
    assert (g.num_layers, g.head_dim, g.page_size, g.dtype, g.mla, g.num_pages) == (2, 4608, 1, "uint8", True, 20)
    assert lay.kv_ptrs == (0x700000, 0x710000) and lay.kv_layout == V4
    names = [(p.name, p.kind, p.index, p.geometry.num_layers, p.geometry.head_dim, p.equal_tp_only) for p in lay.states]
    tag = names[0][0].split(".")[0]
    assert tag.startswith("state:kv_") and len(tag) == len("state:kv_") + 8, tag
    assert names == [
        (f"{tag}.1", "kv_pages", -1, 2, 528, ""),  # C4 indexer keys
        (f"{tag}.2", "kv_pages", -1, 1, 1152, ""),  # C128 KV
        ("state:swa.0", "swa", 0, 2, 2048, ""),
        ("state:swa.1", "swa", 0, 1, 384, ""),
        ("state:c128_state", "c128_state", 1, 1, 1536, ""),
        ("state:request_row", "request_row", 2, 1, 8, ""),
    ]
    # replicated (an MLA latent): any TP pair; the KV pools take the request's KV pages
    assert state_problem([p.name for p in lay.states], lay.states, 2, 1) == ""
    pages = np.array([7, 3])
    got = state_pages(lay.states, [np.array([4], np.int32), np.zeros(0, np.int32), np.array([5], np.int32)], pages)
    assert [x.tolist() for x in got] == [[7, 3], [7, 3], [4], [4], [], [5]]
    with pytest.raises(ValueError, match=r"state_indices\[2\] \(request_row\) must be the request's one slot, got 2"):
        state_pages(lay.states, [np.array([4]), np.zeros(0), np.array([5, 6])], pages)


def test_deepseek_v4_servers_of_different_kv_layouts_cannot_exchange_a_request():
    ours = layout(dsv4(), mla=True).states
    theirs = [p.name for p in layout(dsv4("v41,c4:v41,c128:v41"), mla=True).states]
    problem = state_problem(theirs, ours, 1, 1)
    assert "compressed KV pools (KVArgs.kv_layout, kv_item_lens): prefill [state:kv_" in problem, problem
    assert "SGLANG_DSV4_KV_LAYOUT" in problem and theirs[0] in problem and ours[0].name in problem


@pytest.mark.parametrize(
    "mla, over, message",
    [
        (False, {}, r"KVArgs.kv_layout='v4,c4:v4,c128:v4': a kv_layout pool that is not an MLA one"),
        (True, dict(dcp_size=2), r"--dcp-size=2: with a kv_layout pool"),
        (True, dict(cp_tp=2), r"--enable-cp-tp-group-sharing=2: with a kv_layout pool is not implemented"),
    ],
)
def test_deepseek_v4_pools_the_backend_does_not_map_are_refused_naming_the_field(mla, over, message):
    with pytest.raises(KVXferError, match=message):
        layout_from_kv_args(dsv4(), tp_size=2, mla=mla, dtype="bfloat16", **over)


def test_a_deepseek_v4_drafts_second_swa_component_gets_pools_of_its_own():
    """A NextN draft's SWA rows come as a second ``swa`` component (and its mark as a request
    row); only a kv_layout pool may name a type twice."""
    args = dsv4()
    args.state_types.insert(2, "swa")
    for name in ("ptrs", "lens", "items"):
        getattr(args, f"state_{'item_lens' if name == 'items' else 'data_' + name}").insert(2, rows([2048])[name])
    names = [(p.name, p.index) for p in layout(args, mla=True).states if p.kind == "swa"]
    assert names == [("state:swa.0", 0), ("state:swa.1", 0), ("state:swa_2", 2)]
    plain = with_state(("mamba", rows([64])), ("mamba", rows([64])))
    with pytest.raises(GeometryError, match=r"names a type twice"):
        layout(plain)
    twice = dsv4()  # two DSA components: no DeepSeek-V4 pool registers a type twice but its SWA rows
    for _ in range(2):
        twice.state_types.append("dsa")
        for name in ("ptrs", "lens", "items"):
            getattr(twice, f"state_{'item_lens' if name == 'items' else 'data_' + name}").append(rows([16])[name])
    with pytest.raises(GeometryError, match=r"names 'dsa' twice \(a DeepSeek-V4 draft adds swa rows\)"):
        layout(twice, mla=True)


def test_the_qsa_rope_ring_is_a_pool_every_pp_stage_holds_whole_even_beside_rings_of_its_size():
    """The RoPE ring is the entry SGLang gives QSA_ROPE_STATE_LAYER_ID: a pool of its own
    (``shared``: a decode of PP 1 takes it whole from each stage), even when its rows are as
    wide as the key rings'."""
    pending = rows([96, 96, 96], slots=9)  # two layers' key rings and the RoPE ring, rows of one size
    args = with_state(("qsa_pending", pending), state_layer_ids=[[4, 6, (1 << 32) - 2]])
    pools = layout(args).states
    assert [(p.name, p.geometry.num_layers, p.shared) for p in pools] == [
        ("state:qsa_pending.0", 2, False),
        ("state:qsa_pending.1", 1, True),
    ]
    assert pools[1].ptrs == (pending["ptrs"][2],)
