"""KVPool for the packed K-and-V layouts (one buffer per layer): NHD_KV (vLLM's GPU cache,
``[num_blocks, block_size, heads, head_dim + v_head_dim]`` per layer) and HND_KV (vLLM's CPU
cache, ``[num_blocks, heads, block_size, 2 * head_dim]`` per layer, or the 5-D view):
allocate, wrap, from_pointers, registration, the rejections; the synthetic content lands in
the K and V rows of each layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_kvxfer.engine.pool import KVPool
from sglang_kvxfer.engine.synthetic import fill_request, row_bytes, verify_request
from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.transports import get_transport

# layout -> (vLLM's per-layer cache shape, the pool's buffer shape), 2 local heads of 4
SHAPES = {"NHD_KV": ((6, 4, 2, 16), (6, 4, 2, 16)), "HND_KV": ((6, 2, 4, 16), (6, 2, 2, 4, 8))}
LAYOUTS = list(SHAPES)


def _geometry(layout):
    return KVGeometry(num_layers=3, total_kv_heads=4, head_dim=8, dtype="bf16", page_size=4, layout=layout, num_pages=6)


def _place(layout):
    return _geometry(layout).placement(2, 1)  # 2 local heads


def _vllm_caches(layout):
    return [torch.zeros(SHAPES[layout][0], dtype=torch.bfloat16) for _ in range(3)]


def _k_and_v_row_bytes(layout, cache, page, slot, head):
    """The K and V bytes of one (page, slot, local head) row in one layer's vLLM cache."""
    if layout == "NHD_KV":  # K and V halves of the row
        row = cache[page, slot, head].view(torch.uint8)
        return row[:16], row[16:]
    tile = cache[page, head].view(torch.uint8).reshape(2, 4, 16)  # [K|V][slot][dim bytes]
    return tile[0, slot], tile[1, slot]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_allocate_gives_one_buffer_per_layer_in_one_region(layout):
    place = _place(layout)
    pool = KVPool.allocate(place)
    try:
        assert len(pool.buffers) == 3 and {tuple(b.shape) for b in pool.buffers} == {SHAPES[layout][1]}
        assert place.page_nbytes(0) == 4 * 2 * 16 * 2
        with get_transport("tcp") as t:
            assert len(pool.register(t)) == 1
            pool.close()
    finally:
        pool.close()


@pytest.mark.parametrize("transport", ["local", "tcp"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_wrap_takes_vllm_shaped_layers_and_registers_each(layout, transport):
    place, caches = _place(layout), _vllm_caches(layout)
    pool = KVPool.wrap(place, caches)
    try:
        assert [b.data_ptr() for b in pool.buffers] == [c.data_ptr() for c in caches]
        assert all(tuple(b.shape) == SHAPES[layout][1] for b in pool.buffers)
        with get_transport(transport) as t:
            assert len(pool.register(t)) == 3 and [r.ptr for r in pool.regions] == [c.data_ptr() for c in caches]
            pool.close()
    finally:
        pool.close()


def test_hnd_kv_wrap_views_vllms_tile_and_takes_the_5d_view():
    place, caches = _place("HND_KV"), _vllm_caches("HND_KV")
    pool = KVPool.wrap(place, caches)
    pool.buffers[1][3, 1, 1, 2] = 5.0  # the V row of slot 2 in (page 3, local head 1)...
    # ...is elements [4 * 8 + 2 * 8, +8) of vLLM's 64-element tile: [b, h, n=3, :8], not [.., n=2, 8:]
    assert bool((caches[1][3, 1, 3, :8] == 5.0).all()) and not bool(caches[1][3, 1, 2].any())
    pool.close()
    five_d = KVPool.wrap(place, [c.view(6, 2, 2, 4, 8) for c in caches])
    assert [b.data_ptr() for b in five_d.buffers] == [c.data_ptr() for c in caches]
    five_d.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_from_pointers_takes_one_buffer_per_layer(layout):
    place, caches = _place(layout), _vllm_caches(layout)
    ptrs, lens = [c.data_ptr() for c in caches], [c.nbytes for c in caches]
    assert lens[0] == place.buffer_nbytes(0) == place.page_nbytes(0) * 6
    pool = KVPool.from_pointers(place, ptrs, lens)
    try:
        assert [b.data_ptr() for b in pool.buffers] == ptrs
    finally:
        pool.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_wrong_buffer_counts_are_refused_naming_the_layout(layout):
    place, caches = _place(layout), _vllm_caches(layout)
    with pytest.raises(
        ValueError,
        match=rf"buffers has 6 tensor\(s\); the geometry needs 3 \(one K-and-V tensor per layer for {layout}\)",
    ):
        KVPool.wrap(place, caches + caches)
    ptrs, lens = [c.data_ptr() for c in caches], [c.nbytes for c in caches]
    with pytest.raises(
        ValueError,
        match=rf"ptrs has 6 entries; the geometry needs 3 \(one K-and-V buffer per layer of 3 \({layout}\)\)",
    ):
        KVPool.from_pointers(place, ptrs * 2, lens * 2)


def test_nhd_kv_wrap_rejects_the_hnd_shape_and_vllms_logical_view():
    place, caches = _place("NHD_KV"), _vllm_caches("NHD_KV")
    with pytest.raises(ValueError) as exc:
        KVPool.wrap(place, [torch.zeros(6, 2, 4, 16, dtype=torch.bfloat16)] + caches[1:])
    assert "buffers[0] is (6, 2, 4, 16) torch.bfloat16" in str(exc.value) and "(6, 4, 2, 16)" in str(exc.value)
    with pytest.raises(ValueError, match=r"contiguous=False"):  # vLLM's logical view, not yet permuted
        KVPool.wrap(place, [c.permute(0, 2, 1, 3) for c in caches])


def test_hnd_kv_wrap_rejections_name_both_accepted_shapes():
    place, caches = _place("HND_KV"), _vllm_caches("HND_KV")
    with pytest.raises(ValueError) as exc:
        KVPool.wrap(place, [torch.zeros(6, 2, 4, 8, dtype=torch.bfloat16)] + caches[1:])
    assert "buffers[0] is (6, 2, 4, 8) torch.bfloat16" in str(exc.value)
    assert "(6, 2, 2, 4, 8) or (6, 2, 4, 16) torch.bfloat16" in str(exc.value)
    with pytest.raises(ValueError, match=r"buffers\[2\] is \(6, 2, 4, 16\) torch.float32"):
        KVPool.wrap(place, caches[:2] + [torch.zeros(6, 2, 4, 16)])


def test_unequal_k_and_v_dims_are_refused_by_the_pool_naming_both():
    g = KVGeometry(num_layers=1, total_kv_heads=2, head_dim=8, v_head_dim=4, page_size=4, layout="NHD_KV", num_pages=2)
    assert g.placement(1, 0).buffer_shape(0) == (2, 4, 2, 12)
    with pytest.raises(ValueError, match=r"v_head_dim=4 != head_dim=8"):
        KVPool.allocate(g.placement(1, 0))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_synthetic_content_lands_in_the_k_and_v_rows(layout):
    place, caches = _place(layout), _vllm_caches(layout)
    pool = KVPool.wrap(place, caches)
    pages = [5, 2]
    fill_request(place, pool.buffers, 3, pages, 0, 7)
    assert verify_request(place, pool.buffers, 3, pages, 7) == []
    assert verify_request(place, pool.buffers, 4, pages, 7)  # another room's content differs
    # token 6: page 2, slot 2; layer 1, local head 1 (global 3)
    k, v = _k_and_v_row_bytes(layout, caches[1], 2, 2, 1)
    assert np.array_equal(k.numpy(), row_bytes(3, 1, 0, [2, 3], 0, 7, 16)[6, 1])
    assert np.array_equal(v.numpy(), row_bytes(3, 1, 1, [2, 3], 0, 7, 16)[6, 1])
    pool.close()
