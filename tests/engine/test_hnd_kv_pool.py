"""KVPool for HND_KV (one K-and-V buffer per layer): allocate, wrap (vLLM's per-layer
``[num_blocks, heads, block_size, 2 * head_dim]`` tensors, or the 5-D view), from_pointers,
registration, and the rejections; the synthetic content lands in the tile rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_kvxfer.engine.pool import KVPool
from sglang_kvxfer.engine.synthetic import fill_request, row_bytes, verify_request
from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.transports import get_transport

G = KVGeometry(num_layers=3, total_kv_heads=4, head_dim=8, dtype="bf16", page_size=4, layout="HND_KV", num_pages=6)
PLACE = G.placement(2, 1)  # 2 local heads


def _vllm_caches():
    return [torch.zeros(6, 2, 4, 16, dtype=torch.bfloat16) for _ in range(G.num_layers)]


def test_allocate_gives_one_buffer_per_layer_in_one_region():
    pool = KVPool.allocate(PLACE)
    try:
        assert len(pool.buffers) == 3 and {tuple(b.shape) for b in pool.buffers} == {(6, 2, 2, 4, 8)}
        with get_transport("tcp") as t:
            assert len(pool.register(t)) == 1
            pool.close()
    finally:
        pool.close()


@pytest.mark.parametrize("transport", ["local", "tcp"])
def test_wrap_takes_vllm_shaped_layers_and_registers_each(transport):
    caches = _vllm_caches()
    pool = KVPool.wrap(PLACE, caches)
    try:
        assert [b.data_ptr() for b in pool.buffers] == [c.data_ptr() for c in caches]
        assert all(tuple(b.shape) == (6, 2, 2, 4, 8) for b in pool.buffers)
        pool.buffers[1][3, 1, 1, 2] = 5.0  # the V row of slot 2 in (page 3, local head 1)...
        # ...is elements [4 * 8 + 2 * 8, +8) of vLLM's 64-element tile: [b, h, n=3, :8], not [.., n=2, 8:]
        assert bool((caches[1][3, 1, 3, :8] == 5.0).all()) and not bool(caches[1][3, 1, 2].any())
        with get_transport(transport) as t:
            assert len(pool.register(t)) == 3 and [r.ptr for r in pool.regions] == [c.data_ptr() for c in caches]
            pool.close()
    finally:
        pool.close()
    five_d = KVPool.wrap(PLACE, [c.view(6, 2, 2, 4, 8) for c in caches])
    assert [b.data_ptr() for b in five_d.buffers] == [c.data_ptr() for c in caches]
    five_d.close()


def test_wrap_rejections_name_both_accepted_shapes():
    caches = _vllm_caches()
    with pytest.raises(ValueError, match=r"buffers has 6 tensor\(s\); the geometry needs 3 \(one K-and-V tensor"):
        KVPool.wrap(PLACE, caches + caches)
    bad = [torch.zeros(6, 2, 4, 8, dtype=torch.bfloat16)] + caches[1:]
    with pytest.raises(ValueError) as exc:
        KVPool.wrap(PLACE, bad)
    assert "buffers[0] is (6, 2, 4, 8) torch.bfloat16" in str(exc.value)
    assert "(6, 2, 2, 4, 8) or (6, 2, 4, 16) torch.bfloat16" in str(exc.value)
    with pytest.raises(ValueError, match=r"buffers\[2\] is \(6, 2, 4, 16\) torch.float32"):
        KVPool.wrap(PLACE, caches[:2] + [torch.zeros(6, 2, 4, 16)])


def test_from_pointers_takes_one_buffer_per_layer():
    caches = _vllm_caches()
    ptrs, lens = [c.data_ptr() for c in caches], [c.nbytes for c in caches]
    assert lens[0] == PLACE.buffer_nbytes(0) == PLACE.page_nbytes(0) * G.num_pages
    pool = KVPool.from_pointers(PLACE, ptrs, lens)
    try:
        assert [b.data_ptr() for b in pool.buffers] == ptrs
    finally:
        pool.close()
    with pytest.raises(ValueError, match=r"ptrs has 6 entries; the geometry needs 3 \(one K-and-V buffer per layer"):
        KVPool.from_pointers(PLACE, ptrs * 2, lens * 2)


def test_synthetic_content_lands_in_the_tile_rows():
    caches = _vllm_caches()
    pool = KVPool.wrap(PLACE, caches)
    pages = [5, 2]
    fill_request(PLACE, pool.buffers, 3, pages, 0, 7)
    assert verify_request(PLACE, pool.buffers, 3, pages, 7) == []
    assert verify_request(PLACE, pool.buffers, 4, pages, 7)  # another room's content differs
    # token 6: page 2, slot 2; layer 1's V row of global head 3 (local head 1)
    tile = caches[1][2, 1].view(torch.uint8).reshape(2, 4, 16)  # [K|V][slot][dim bytes]
    want = row_bytes(3, 1, 1, [2, 3], 0, 7, 16)[6, 1]
    assert np.array_equal(tile[1, 2].numpy(), want)
    pool.close()
