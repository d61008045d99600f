"""KVGeometry and RankPlacement: validation messages, serialisation, compatibility."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sglang_kvxfer.errors import GeometryError, IncompatibleGeometryError
from sglang_kvxfer.geometry import (
    KVGeometry,
    Layout,
    RankPlacement,
    check_compatible,
    normalize_dtype,
    owned_heads,
)

BASE = dict(num_layers=4, total_kv_heads=8, head_dim=128)


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("num_layers", 0, "num_layers=0 must be >= 1"),
        ("num_layers", "4", "num_layers='4' must be an integer"),
        ("total_kv_heads", 0, "total_kv_heads=0 must be >= 1"),
        ("head_dim", -1, "head_dim=-1 must be >= 1"),
        ("head_dim", 1.5, "head_dim=1.5 must be an integer"),
        ("v_head_dim", -1, "v_head_dim=-1 must be >= 0"),
        ("page_size", 0, "page_size=0 must be >= 1"),
        ("num_pages", 0, "num_pages=0 must be >= 1"),
        ("dtype", "int4", "dtype='int4' is not supported"),
        ("layout", "NDH", "layout='NDH' is not supported; use NHD, HND or HND_KV"),
        ("mla", "yes", "mla='yes' must be a bool"),
        ("num_layers", True, "num_layers=True must be an integer"),
    ],
)
def test_each_invalid_field_is_named_with_its_value(field, value, words):
    with pytest.raises(GeometryError) as exc:
        KVGeometry(**{**BASE, field: value})
    assert words in str(exc.value)


def test_k_only_sharded_heads():
    g = KVGeometry(**BASE, v_head_dim=0)
    assert not g.has_v and g.num_buffers == 4 and g.placement(2, 1).heads == range(4, 8)
    for layout in ("HND_KV", "NHD_KV"):
        with pytest.raises(GeometryError, match=f"v_head_dim=0 \\(K only\\) is not valid with layout={layout}"):
            KVGeometry(**BASE, v_head_dim=0, layout=layout)


def test_mla_rules():
    g = KVGeometry(num_layers=2, total_kv_heads=1, head_dim=576, mla=True)
    assert g.v_head_dim == 0 and not g.has_v and g.num_buffers == 2
    with pytest.raises(GeometryError, match="total_kv_heads=8 must be 1 for MLA"):
        KVGeometry(**BASE, mla=True)
    with pytest.raises(GeometryError, match="v_head_dim=64 must be 0 for MLA"):
        KVGeometry(num_layers=2, total_kv_heads=1, head_dim=576, mla=True, v_head_dim=64)


@pytest.mark.parametrize(
    "alias,name,size",
    [
        ("bf16", "bfloat16", 2),
        ("fp16", "float16", 2),
        ("torch.float32", "float32", 4),
        ("fp8", "float8_e4m3fn", 1),
        ("fp8_e5m2", "float8_e5m2", 1),
        ("uint8", "uint8", 1),
    ],
)
def test_dtype_aliases(alias, name, size):
    g = KVGeometry(**BASE, dtype=alias)
    assert (g.dtype, g.itemsize) == (name, size)
    assert normalize_dtype(name) == name


def test_shapes_and_sizes_come_from_the_geometry():
    g = KVGeometry(**BASE, v_head_dim=64, page_size=16, num_pages=10, dtype="bf16")
    p = g.placement(4, 3)
    assert p.heads == range(6, 8)
    assert p.buffer_shape(0) == (160, 2, 128) and p.buffer_shape(4) == (160, 2, 64)
    assert p.page_nbytes(0) == 16 * 2 * 128 * 2 and p.page_nbytes(5) == 16 * 2 * 64 * 2
    assert p.buffer_nbytes(0) == 160 * 2 * 128 * 2
    h = KVGeometry(**BASE, layout="HND", num_pages=10).placement(2, 0)
    assert h.buffer_shape(1) == (10, 4, 16, 128)
    with pytest.raises(GeometryError, match=r"buffer_index=8 must be in \[0, 8\)"):
        g.buffer_dim(8)


def test_placement_validation():
    g = KVGeometry(**BASE)
    with pytest.raises(GeometryError, match="tp_rank=4 must be < tp_size=4"):
        g.placement(4, 4)
    with pytest.raises(GeometryError, match="total_kv_heads=8 is not divisible by tp_size=3"):
        g.placement(3, 0)
    with pytest.raises(GeometryError, match="tp_size=12 is not a multiple of total_kv_heads=8"):
        g.placement(12, 0)
    with pytest.raises(GeometryError, match="geometry must be a KVGeometry"):
        RankPlacement({"num_layers": 1}, 1, 0)


def test_a_pool_of_every_head_owns_its_tp_ranks_heads():
    """``all_heads`` (CP-TP group sharing): the rank owns (sends) the heads of its TP rank,
    its buffers hold every head; the dict form carries it only when set."""
    g = KVGeometry(**BASE, v_head_dim=64, page_size=16, num_pages=10, dtype="bf16")
    p = g.placement(4, 3, all_heads=True)
    assert (p.heads, p.stored_heads, p.num_local_heads) == (range(6, 8), range(0, 8), 8)
    assert p.buffer_shape(0) == (160, 8, 128) and p.buffer_nbytes(4) == 160 * 8 * 64 * 2
    assert g.placement(4, 3).stored_heads == range(6, 8) and "all_heads" not in g.placement(4, 3).to_dict()
    back = RankPlacement.from_dict(msgpack.unpackb(msgpack.packb(p.to_dict())))
    assert back == p and back.all_heads
    assert KVGeometry(**{**BASE, "total_kv_heads": 1}, mla=True).placement(3, 2, True).stored_heads == range(0, 1)
    with pytest.raises(GeometryError, match="all_heads=1 must be a bool"):
        RankPlacement.from_dict({**p.to_dict(), "all_heads": 1})


def test_owned_heads_rule():
    assert [list(owned_heads(8, 4, r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [owned_heads(2, 8, r).start for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert owned_heads(1, 5, 3, mla=True) == range(0, 1)


def _geometry(layout, v_head_dim, **kw):
    # HND_KV needs v_head_dim == head_dim (None resolves to it).
    return KVGeometry(layout=layout, v_head_dim=None if layout is Layout.HND_KV else v_head_dim, **kw)


geometries = st.builds(
    _geometry,
    num_layers=st.integers(1, 200),
    total_kv_heads=st.sampled_from([1, 2, 4, 8, 64]),
    head_dim=st.integers(1, 1024),
    dtype=st.sampled_from(["bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2"]),
    page_size=st.integers(1, 256),
    layout=st.sampled_from(list(Layout)),
    v_head_dim=st.one_of(st.none(), st.integers(1, 1024)),
    num_pages=st.integers(1, 1 << 20),
)


@given(geometries, st.integers(0, 7))
def test_dict_round_trip_through_msgpack(g, rank):
    wire = msgpack.packb(g.to_dict())
    assert KVGeometry.from_dict(msgpack.unpackb(wire)) == g
    tp = g.total_kv_heads
    p = g.placement(tp, rank % tp)
    assert RankPlacement.from_dict(msgpack.unpackb(msgpack.packb(p.to_dict()))) == p


def test_from_dict_rejections():
    d = KVGeometry(**BASE).to_dict()
    with pytest.raises(GeometryError, match="schema=2 is not supported"):
        KVGeometry.from_dict({**d, "schema": 2})
    with pytest.raises(GeometryError, match="missing field\\(s\\): head_dim"):
        KVGeometry.from_dict({k: v for k, v in d.items() if k != "head_dim"})
    with pytest.raises(GeometryError, match="unknown field\\(s\\): colour"):
        KVGeometry.from_dict({**d, "colour": "red"})
    with pytest.raises(GeometryError, match="must be a dict, got list"):
        KVGeometry.from_dict([1, 2])
    with pytest.raises(GeometryError, match="head_dim='x' must be an integer"):
        KVGeometry.from_dict({**d, "head_dim": "x"})


@pytest.mark.parametrize(
    "field,p_value,d_value,hint",
    [
        ("total_kv_heads", 8, 4, "un-sharded KV head count"),
        ("head_dim", 128, 64, "same K head dim"),
        ("v_head_dim", 128, 64, "same V head dim"),
        ("dtype", "bfloat16", "float16", "same KV cache dtype"),
        ("num_layers", 4, 2, "same number of KV layers"),
    ],
)
def test_each_mismatch_names_field_both_values_and_a_fix(field, p_value, d_value, hint):
    pre = KVGeometry(**{**BASE, "v_head_dim": 128, field: p_value})
    dec = KVGeometry(**{**BASE, "v_head_dim": 128, field: d_value})
    with pytest.raises(IncompatibleGeometryError) as exc:
        check_compatible(pre, dec)
    msg = str(exc.value)
    assert f"{field}: prefill={p_value!r} decode={d_value!r}" in msg and hint in msg
    assert [m[0] for m in exc.value.mismatches] == [field]


def test_mla_vs_mha_mismatch_and_tolerated_differences():
    mla = KVGeometry(num_layers=4, total_kv_heads=1, head_dim=576, mla=True)
    mha = KVGeometry(num_layers=4, total_kv_heads=1, head_dim=576)
    with pytest.raises(IncompatibleGeometryError, match="mla: prefill=True decode=False"):
        check_compatible(mla, mha)
    c = check_compatible(KVGeometry(**BASE, page_size=16), KVGeometry(**BASE, page_size=64, layout="HND", num_pages=7))
    assert c.page_size_differs and c.layout_differs and c.reformat_needed
    assert not check_compatible(KVGeometry(**BASE), KVGeometry(**BASE, num_pages=3)).reformat_needed


# ---- HND_KV: vLLM's CPU cache, one K-and-V buffer per layer ----------------------------------


def test_hnd_kv_parses_and_lists_all_layouts():
    assert Layout.parse("hnd_kv") is Layout.HND_KV and str(Layout.HND_KV) == "HND_KV"
    with pytest.raises(GeometryError) as exc:
        Layout.parse("HNDKV")
    assert "layout='HNDKV' is not supported; use NHD, HND or HND_KV" in str(exc.value)


def test_hnd_kv_shapes_and_sizes():
    g = KVGeometry(**BASE, layout="HND_KV", page_size=16, num_pages=10, dtype="bf16")
    assert g.packed_kv and g.has_v and g.v_head_dim == 128
    assert g.num_buffers == 4  # one per layer, not K then V
    p = g.placement(4, 3)
    assert p.buffer_shape(0) == p.buffer_shape(3) == (10, 2, 2, 16, 128)
    assert p.buffer_nbytes(0) == 10 * 2 * 2 * 16 * 128 * 2
    assert p.page_nbytes(0) == 2 * 16 * 2 * 128 * 2  # K and V of one page
    assert p.page_nbytes(0) * g.num_pages == p.buffer_nbytes(0)
    assert [g.buffer_dim(i) for i in range(4)] == [128] * 4
    with pytest.raises(GeometryError, match=r"buffer_index=4 must be in \[0, 4\)"):
        g.buffer_dim(4)
    assert KVGeometry.from_dict(g.to_dict()) == g and g.to_dict()["layout"] == "HND_KV"


def test_hnd_kv_rules_name_the_fields_and_values():
    with pytest.raises(GeometryError) as exc:
        KVGeometry(**BASE, layout="HND_KV", v_head_dim=64)
    assert "v_head_dim=64 must equal head_dim=128 for layout=HND_KV" in str(exc.value)
    with pytest.raises(GeometryError) as exc:
        KVGeometry(num_layers=2, total_kv_heads=1, head_dim=576, mla=True, layout="HND_KV")
    assert "layout=HND_KV is not valid with mla=True" in str(exc.value)
    assert KVGeometry(**BASE, layout="HND_KV", v_head_dim=128).v_head_dim == 128


@pytest.mark.parametrize("other", ["NHD", "HND"])
def test_hnd_kv_is_compatible_with_the_other_layouts_both_ways(other):
    kv = KVGeometry(**BASE, layout="HND_KV", page_size=16)
    plain = KVGeometry(**BASE, layout=other, page_size=32)
    for pre, dec in ((kv, plain), (plain, kv)):
        c = check_compatible(pre, dec)
        assert c.layout_differs and c.page_size_differs and c.reformat_needed
    assert not check_compatible(kv, KVGeometry(**BASE, layout="HND_KV", page_size=16, num_pages=5)).reformat_needed
