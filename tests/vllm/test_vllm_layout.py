"""``vllm_layout`` without vLLM: vLLM-shaped tensors -> the engine geometry, and the refusals."""

from __future__ import annotations

import pytest
import torch

from sglang_kvxfer.geometry import Layout
from sglang_kvxfer.integrations.vllm_layout import VllmLayout, layer_order


def caches(num_layers=3, shape=(8, 2, 32, 128), dtype=torch.float32):
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(shape, dtype=dtype) for i in reversed(range(num_layers))}


def test_layers_are_taken_in_model_order_not_name_order():
    names = [f"model.layers.{i}.self_attn.attn" for i in (10, 2, 0, 1)]
    assert layer_order(names) == [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2, 10)]


def test_cpu_cache_is_hnd_kv_with_the_rank_heads():
    lay = VllmLayout.from_kv_caches(caches(), total_kv_heads=4, mla=False, tp_size=2, tp_rank=1)
    g = lay.geometry
    assert (g.layout, g.num_layers, g.total_kv_heads, g.head_dim, g.page_size, g.num_pages, g.dtype) == (
        Layout.HND_KV,
        3,
        4,
        64,
        32,
        8,
        "float32",
    )
    assert lay.layer_names[0].startswith("model.layers.0.") and len(lay.tensors) == 3
    assert lay.heads_slice(0, 2) == slice(0, 0) and lay.heads_slice(2, 3) == slice(0, 1)


@pytest.mark.parametrize("shape", [(8, 32, 576), (8, 1, 32, 576)])  # GPU MLA backends; CPU_MLA
def test_mla_cache_is_one_latent_head_per_layer(shape):
    lay = VllmLayout.from_kv_caches(caches(shape=shape), total_kv_heads=1, mla=True, tp_size=2, tp_rank=0)
    g = lay.geometry
    assert g.mla and (g.head_dim, g.page_size, g.num_pages) == (576, 32, 8)
    assert lay.tensors[0].shape == (8 * 32, 1, 576)


def test_an_mla_cache_of_another_shape_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"MLA KV cache layer model.layers.0.self_attn.attn is \(8, 2, 32, 576\)"):
        VllmLayout.from_kv_caches(caches(shape=(8, 2, 32, 576)), total_kv_heads=1, mla=True, tp_size=1, tp_rank=0)


@pytest.mark.parametrize(
    "kwargs,kv,message",
    [
        ({"total_kv_heads": 4, "tp_size": 1}, caches(), "holds 2 head(s), but TP rank 0 of 1 owns 4"),
        ({"total_kv_heads": 4, "tp_size": 2}, caches(shape=(8, 2, 32, 127)), "expected vLLM's CPU layout"),
        ({"total_kv_heads": 4, "tp_size": 2}, {}, "no KV cache tensors"),
    ],
)
def test_refusals_name_the_problem(kwargs, kv, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        VllmLayout.from_kv_caches(kv, mla=False, tp_rank=0, **kwargs)


def test_layers_of_different_shapes_are_refused():
    kv = caches()
    kv["model.layers.0.self_attn.attn"] = torch.zeros((8, 2, 16, 128))
    with pytest.raises(ValueError, match="one shape for every layer"):
        VllmLayout.from_kv_caches(kv, total_kv_heads=4, mla=False, tp_size=2, tp_rank=0)


def gpu_caches(layout="LBNHC", num_layers=3, blocks=8, heads=2, block_size=16, row=256, device="meta"):
    """vLLM 0.32's per-layer logical ``[blocks, heads, block_size, row]`` views of one layout
    (``compute_layout_strides`` for one group; meta tensors stand in for GPU memory)."""
    page = heads * block_size * row
    strides = {
        "LBNHC": (page, row, heads * row, 1),
        "LBHNC": (page, block_size * row, row, 1),
        "BLNHC": (num_layers * page, row, heads * row, 1),  # every layer's page of a block together
        "LHBNC": (block_size * row, blocks * block_size * row, row, 1),
    }[layout]
    shape = (blocks, heads, block_size, row)
    return {
        f"model.layers.{i}.self_attn.attn": torch.empty_strided(shape, strides, dtype=torch.bfloat16, device=device)
        for i in range(num_layers)
    }


def test_gpu_cache_in_lbnhc_is_nhd_kv_over_the_same_memory():
    kv = gpu_caches()
    lay = VllmLayout.from_kv_caches(kv, total_kv_heads=4, mla=False, tp_size=2, tp_rank=0)
    g = lay.geometry
    assert (g.layout, g.num_layers, g.head_dim, g.v_head_dim, g.page_size, g.num_pages, g.dtype) == (
        Layout.NHD_KV,
        3,
        128,
        128,
        16,
        8,
        "bfloat16",
    )
    first = kv["model.layers.0.self_attn.attn"]
    assert lay.tensors[0].shape == (8, 16, 2, 256) and lay.tensors[0].is_contiguous()
    assert lay.tensors[0].data_ptr() == first.data_ptr()
    assert g.placement(2, 0).buffer_shape(0) == tuple(lay.tensors[0].shape)
    # head_size_v != head_size: the caller says where K ends
    other = VllmLayout.from_kv_caches(kv, total_kv_heads=4, mla=False, tp_size=2, tp_rank=1, head_dim=192)
    assert (other.geometry.head_dim, other.geometry.v_head_dim) == (192, 64)


def test_gpu_cache_with_one_local_head_is_accepted_either_way():
    """With one head per rank LBNHC and LBHNC are the same bytes."""
    for layout in ("LBNHC", "LBHNC"):
        lay = VllmLayout.from_kv_caches(gpu_caches(layout, heads=1), total_kv_heads=8, mla=False, tp_size=8, tp_rank=3)
        assert lay.geometry.layout is Layout.NHD_KV and lay.tensors[0].shape == (8, 16, 1, 256)


@pytest.mark.parametrize(
    "layout,words",
    [
        ("LBHNC", "head-major [K | V] rows (vLLM layout LBHNC"),
        ("BLNHC", "not dense token-major pages of one layer (LBNHC strides would be (8192, 256, 512, 1))"),
        ("LHBNC", "a cross-layer or padded layout"),
    ],
)
def test_gpu_layouts_the_engine_cannot_describe_are_refused_with_the_reason(layout, words):
    with pytest.raises(ValueError) as exc:
        VllmLayout.from_kv_caches(gpu_caches(layout), total_kv_heads=4, mla=False, tp_size=2, tp_rank=0)
    text = str(exc.value)
    assert "KV cache layer model.layers.0.self_attn.attn on meta is (8, 2, 16, 256) with strides" in text
    assert words in text and "VLLM_KV_CACHE_LAYOUT=LBNHC" in text


@pytest.mark.parametrize(
    "kwargs,make,message",
    [
        ({}, lambda: gpu_caches(row=255), "rows hold 255 elements, odd: pass head_dim"),
        ({"head_dim": 256}, lambda: gpu_caches(), "head_dim=256 must be in [1, 256)"),
        ({"tp_size": 1}, lambda: gpu_caches(), "holds 2 head(s), but TP rank 0 of 1 owns 4"),
        ({}, lambda: {"a.0.x": torch.empty(8, 16, 256, device="meta")}, "expected vLLM's logical [num_blocks"),
    ],
)
def test_gpu_refusals_name_the_problem(kwargs, make, message):
    args = {"total_kv_heads": 4, "tp_size": 2, **kwargs}
    with pytest.raises(ValueError) as exc:
        VllmLayout.from_kv_caches(make(), mla=False, tp_rank=0, **args)
    assert message in str(exc.value)
