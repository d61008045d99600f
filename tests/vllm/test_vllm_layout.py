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
