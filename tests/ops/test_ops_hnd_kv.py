"""Gather/scatter of HND_KV pools (vLLM's CPU cache: one tensor per layer, each (page, head)
tile K rows then V rows): against a hand-written index of a vLLM-shaped ``torch.arange``
tensor, the torch reference, the native CPU library and the CUDA kernel's host emulator;
conversions to and from NHD and HND; the rejections."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_kvxfer import _native, ops
from sglang_kvxfer._ops_args import parse_call
from tests.ops.ops_cases import (
    assert_emulated_gather_is_the_reference,
    assert_gather_rejected,
    assert_packed_scatters_agree,
    loop_oracle_scatter,
    native_gather_status,
    packed_gather_checked,
    random_pool,
    require_native_cpu,
    same_bytes,
)

P, H, N, D, L = 6, 4, 4, 8, 3  # pages, heads, page_size, head_dim, layers


@pytest.fixture(scope="module")
def native_cpu():
    return require_native_cpu()


def vllm_cache():
    """vLLM's CPU cache of L layers, ``[num_blocks, heads, block_size, 2 * head_dim]``, every
    element its own (layer-offset) position."""
    n = P * H * N * 2 * D
    return [(torch.arange(n, dtype=torch.int32) + layer * n).view(P, H, N, 2 * D) for layer in range(L)]


def hand_rows(cache, layer, kind, page, head, slot):
    """Token ``slot``'s K (kind 0) or V (kind 1) row of a (page, head) tile, by hand: the
    tile is ``2 * N * D`` elements, K rows ``[N, D]`` first, then V rows ``[N, D]``."""
    tile = cache[layer][page, head].reshape(-1)
    start = kind * N * D + slot * D
    return tile[start : start + D]


PAGES = [4, 0, 5, 2]
KW = dict(page_size=N, head_start=1, num_heads=2, layout="HND_KV", token_offset=3, num_tokens=11)


def _staging_blocks(staging, num_tokens, num_heads):
    """``[layer][K|V][token][head][dim]`` view of an int32 staging."""
    return staging.view(torch.int32).view(L, 2, num_tokens, num_heads, D)


def test_gather_moves_tile_rows_not_the_naive_hnd_reading(native_cpu):
    cache = vllm_cache()
    staging = ops.gather_kv_heads(cache, None, PAGES, **KW)
    blocks = _staging_blocks(staging, 11, 2)
    naive_hits = 0
    for layer in range(L):
        for i in range(11):
            t = 3 + i
            page, slot = PAGES[t // N], t % N
            for h in range(2):
                for kind in (0, 1):
                    want = hand_rows(cache, layer, kind, page, 1 + h, slot)
                    assert torch.equal(blocks[layer, kind, i, h], want), (layer, kind, t, h)
                # A naive HND reading of vLLM's shape takes [b, h, n, :D] as token n's key.
                naive_k = cache[layer][page, 1 + h, slot, :D]
                naive_hits += int(torch.equal(blocks[layer, 0, i, h], naive_k))
    # Only slot 0 of a tile coincides (K row 0 is the tile's first D elements).
    assert naive_hits == sum(1 for t in range(3, 14) if t % N == 0) * L * 2
    assert same_bytes(staging, ops.gather_kv_heads_reference(cache, None, PAGES, **KW))


def test_both_accepted_shapes_are_the_same_pool(native_cpu):
    cache = vllm_cache()
    five_d = [t.view(P, H, 2, N, D) for t in cache]
    a = ops.gather_kv_heads(cache, None, PAGES, **KW)
    b = ops.gather_kv_heads(five_d, [], PAGES, **KW)  # [] is what an engine's buffers[L:] is
    c = ops.gather_kv_heads(torch.stack(cache), None, PAGES, **KW)  # one [L, ...] tensor
    assert same_bytes(a, b) and same_bytes(a, c)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_scatter_native_reference_loop_oracle_and_emulator_agree(native_cpu, dtype, page_size):
    gen = torch.Generator().manual_seed(page_size)
    tokens = 2 * page_size + 1
    src = random_pool("HND_KV", 5, page_size, 3, 24, dtype, 2, gen)
    kw = dict(page_size=page_size, head_start=1, num_heads=2, layout="HND_KV", num_tokens=tokens)
    pages = [4, 1, 3]
    staging = packed_gather_checked(src, pages, kw)
    dst = random_pool("HND_KV", 6, page_size, 4, 24, dtype, 2, gen, vllm_shape=False)
    dst_pages = [5, 0, 2]
    dkw = {**kw, "head_start": 2}
    assert_packed_scatters_agree(
        staging,
        dst,
        dst_pages,
        dkw,
        lambda oracle: loop_oracle_scatter(staging, oracle, None, dst_pages, **dkw, token_offset=0),
    )


@pytest.mark.parametrize("ptr_align", [1, 2, 4, 8, 16])
def test_emulated_kernel_every_vector_width(native_cpu, ptr_align):
    gen = torch.Generator().manual_seed(3)
    k = random_pool("HND_KV", 6, 4, 4, 64, torch.bfloat16, 2, gen)
    kw = dict(page_ids=[5, 0, 3], page_size=4, head_start=1, num_heads=2, layout="HND_KV")
    assert_emulated_gather_is_the_reference(k, None, kw, ptr_align)


@pytest.mark.parametrize("other", ["NHD", "HND"])
def test_conversion_to_and_from_the_other_layouts(native_cpu, other):
    """HND_KV page 4 -> NHD/HND page 3 -> HND_KV page 2: the staging is the same bytes."""
    gen = torch.Generator().manual_seed(4)
    tokens = 10
    src = random_pool("HND_KV", 4, 4, 2, 16, torch.float16, 2, gen)
    mid_k = random_pool(other, 5, 3, 2, 16, torch.float16, 2, gen)
    mid_v = random_pool(other, 5, 3, 2, 16, torch.float16, 2, gen)
    head = dict(head_start=0, num_heads=2, num_tokens=tokens)
    piece = ops.gather_kv_heads(src, None, [3, 0, 2], page_size=4, layout="HND_KV", **head)
    ops.scatter_kv_heads(piece, mid_k, mid_v, [4, 1, 0, 2], page_size=3, layout=other, **head)
    back = ops.gather_kv_heads(mid_k, mid_v, [4, 1, 0, 2], page_size=3, layout=other, **head)
    assert same_bytes(back, piece)
    out = random_pool("HND_KV", 7, 2, 2, 16, torch.float16, 2, gen)
    ops.scatter_kv_heads(back, out, None, [6, 0, 5, 1, 3], page_size=2, layout="HND_KV", **head)
    again = ops.gather_kv_heads(out, None, [6, 0, 5, 1, 3], page_size=2, layout="HND_KV", **head)
    assert same_bytes(again, piece)
    # Token 5 is source page 0, slot 1: K row 1 and V row 1 of that page's tiles. In the
    # middle pool it is page 1, slot 2 (NHD row 1 * 3 + 2).
    for layer in range(2):
        tile = src[layer][0].reshape(2, 2, 4, 16)  # [head][K|V][slot][dim]
        if other == "NHD":
            assert same_bytes(mid_k[layer][5], tile[:, 0, 1])
            assert same_bytes(mid_v[layer][5], tile[:, 1, 1])
        else:
            assert same_bytes(mid_k[layer][1, :, 2], tile[:, 0, 1])
            assert same_bytes(mid_v[layer][1, :, 2], tile[:, 1, 1])


@pytest.mark.parametrize(
    "make,kw,words",
    [
        (lambda c: (c, c), {}, "v_buffers is 3 tensor(s) but layout HND_KV keeps V in the k_buffers tensors"),
        (lambda c: ([t[..., :-1].contiguous() for t in c], None), {}, "last dim 15 must be 2 * head_dim"),
        (lambda c: ([t.view(P, H, N, 2, D) for t in c], None), {}, "dim 2 is 4, but layout HND_KV holds K and V"),
        (lambda c: (c, None), {"page_size": 2}, "k_buffers[0] holds 4 tokens per page (dim 2) but page_size=2"),
        (
            lambda c: ([t.view(P, H, 2, N, D) for t in c], None),
            {"page_size": 2},
            "holds 4 tokens per page (dim 3) but page_size=2",
        ),
        (lambda c: ([t.view(P * H, N, 2 * D) for t in c], None), {}, "layout HND_KV needs [num_pages, heads"),
        (lambda c: (c, None), {"layout": "HNDKV"}, "layout='HNDKV' is not supported; use NHD, HND or HND_KV"),
        (lambda c: ([t.transpose(1, 2) for t in c], None), {"page_size": H}, "must be contiguous"),
    ],
)
def test_rejections_name_the_argument_and_value(make, kw, words):
    assert_gather_rejected(words, *make(vllm_cache()), **{"page_size": N, "layout": "HND_KV", **kw})


def test_native_library_refuses_a_v_pointer_off_its_tile(native_cpu):
    """The C ABI describes an HND_KV layer as a K and a V pointer: V must sit page_size K
    rows after K, or the library refuses before touching memory (CPU and emulator)."""
    cache = vllm_cache()
    call = parse_call(cache, None, [1, 2], unique_pages=False, **{**KW, "token_offset": 0, "num_tokens": None})
    pool, sl = ops._descs(call)
    good = call.layer_ptrs()
    assert good[L:] == [p + N * D * 4 for p in good[:L]]
    bad = np.array(good[:L] + [p + 4 for p in good[:L]], dtype=np.uint64)
    staging = torch.zeros(call.staging_nbytes, dtype=torch.uint8)
    assert native_gather_status(native_cpu, pool, sl, call, bad, staging) == _native.STATUS_INVALID
    assert "V pointer of layer 0 must be its K pointer + page_size * k_row_bytes" in native_cpu.last_error()
    code = native_cpu.handle.kvxfer_emulate_cuda_cpu(
        1, pool, bad.ctypes.data, 4, call.page_ids.ctypes.data, sl, staging.data_ptr(), staging.numel()
    )
    assert code == _native.STATUS_INVALID and "V pointer of layer 0" in native_cpu.last_error()
    assert bool((staging == 0).all())
    pool.v_row_bytes = pool.k_row_bytes + 4
    assert native_gather_status(native_cpu, pool, sl, call, good, staging) == _native.STATUS_INVALID
    assert "layout HND_KV needs num_kv=2 and v_row_bytes == k_row_bytes" in native_cpu.last_error()
