"""Gather/scatter of NHD_KV pools (vLLM's GPU cache in its default LBNHC layout: one tensor
per layer, ``[num_pages, page_size, heads, k_dim + v_dim]``, each (token, head) row K then V):
against a hand-written index of a ``torch.arange`` tensor, a loop oracle, the torch reference,
the native CPU library and the CUDA kernel's host emulator (the CUDA path is checked through
the emulator here: no GPU); conversions to and from every other layout; the rejections."""

from __future__ import annotations

import pytest
import torch

from sglang_kvxfer import _native, ops
from sglang_kvxfer._ops_args import parse_call
from tests.ops.ops_cases import (
    assert_emulated_gather_is_the_reference,
    assert_gather_rejected,
    assert_packed_scatters_agree,
    native_gather_status,
    packed_gather_checked,
    random_pool,
    require_native_cpu,
    same_bytes,
)

P, N, H, DK, DV, L = 6, 4, 4, 8, 6, 3  # pages, page_size, heads, k_dim, v_dim, layers


@pytest.fixture(scope="module")
def native_cpu():
    return require_native_cpu()


def nhd_kv_pool(pages, page_size, heads, k_dim, v_dim, dtype, layers, gen):
    """``layers`` tensors ``[pages, page_size, heads, k_dim + v_dim]`` of random bits."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    shape = (pages, page_size, heads, (k_dim + v_dim) * itemsize)
    return [torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(dtype) for _ in range(layers)]


def arange_cache():
    n = P * N * H * (DK + DV)
    return [(torch.arange(n, dtype=torch.int32) + layer * n).view(P, N, H, DK + DV) for layer in range(L)]


def loop_scatter(staging, k, page_ids, *, page_size, head_start, num_heads, token_offset, num_tokens, k_dim):
    """Scatter as plain loops over (layer, K|V, token, head) into NHD_KV byte rows."""
    data = staging.reshape(-1).view(torch.uint8)
    off = 0
    for layer in range(len(k)):
        flat = k[layer].view(torch.uint8).reshape(-1)
        itemsize = k[layer].element_size()
        heads, row = k[layer].shape[2], k[layer].shape[3] * itemsize
        kb = k_dim * itemsize
        for lo, hi in ((0, kb), (kb, row)):  # K part, then V part
            for i in range(num_tokens):
                t = token_offset + i
                page, slot = int(page_ids[t // page_size]), t % page_size
                for h in range(num_heads):
                    at = ((page * page_size + slot) * heads + head_start + h) * row + lo
                    flat[at : at + hi - lo] = data[off : off + hi - lo]
                    off += hi - lo


PAGES = [4, 0, 5, 2]
KW = dict(page_size=N, head_start=1, num_heads=2, layout="NHD_KV", token_offset=3, num_tokens=11, k_dim=DK)


def test_gather_takes_k_then_v_of_each_token_and_head(native_cpu):
    cache = arange_cache()
    staging = ops.gather_kv_heads(cache, None, PAGES, **KW)
    per_layer = 11 * 2 * (DK + DV)
    flat = staging.view(torch.int32)
    for layer in range(L):
        k_block = flat[layer * per_layer : layer * per_layer + 11 * 2 * DK].view(11, 2, DK)
        v_block = flat[layer * per_layer + 11 * 2 * DK : (layer + 1) * per_layer].view(11, 2, DV)
        for i in range(11):
            t = 3 + i
            page, slot = PAGES[t // N], t % N
            for h in range(2):
                row = cache[layer][page, slot, 1 + h]
                assert torch.equal(k_block[i, h], row[:DK]) and torch.equal(v_block[i, h], row[DK:]), (layer, t, h)
    assert same_bytes(staging, ops.gather_kv_heads_reference(cache, None, PAGES, **KW))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("dims", [(24, 24), (16, 8)])
def test_scatter_native_reference_loop_oracle_and_emulator_agree(native_cpu, dtype, page_size, dims):
    gen = torch.Generator().manual_seed(page_size)
    kd, vd = dims
    tokens = 2 * page_size + 1
    src = nhd_kv_pool(5, page_size, 3, kd, vd, dtype, 2, gen)
    kw = dict(page_size=page_size, head_start=1, num_heads=2, layout="NHD_KV", num_tokens=tokens, k_dim=kd)
    pages = [4, 1, 3]
    staging = packed_gather_checked(src, pages, kw)
    dst = nhd_kv_pool(6, page_size, 4, kd, vd, dtype, 2, gen)
    dst_pages = [5, 0, 2]
    dkw = {**kw, "head_start": 2}
    loop_kw = {k: v for k, v in dkw.items() if k != "layout"}
    assert_packed_scatters_agree(
        staging, dst, dst_pages, dkw, lambda oracle: loop_scatter(staging, oracle, dst_pages, **loop_kw, token_offset=0)
    )


@pytest.mark.parametrize("ptr_align", [1, 2, 4, 8, 16])
def test_emulated_kernel_every_vector_width(native_cpu, ptr_align):
    gen = torch.Generator().manual_seed(3)
    k = nhd_kv_pool(6, 4, 4, 64, 32, torch.bfloat16, 2, gen)
    kw = dict(page_ids=[5, 0, 3], page_size=4, head_start=1, num_heads=2, layout="NHD_KV", k_dim=64)
    assert_emulated_gather_is_the_reference(k, None, kw, ptr_align)


@pytest.mark.parametrize("other", ["NHD", "HND", "HND_KV"])
def test_conversion_to_and_from_the_other_layouts(native_cpu, other):
    """NHD_KV page 4 -> other page 3 -> NHD_KV page 2: the staging is the same bytes, and
    token 5's K and V rows land where the other layout keeps them."""
    gen = torch.Generator().manual_seed(4)
    head = dict(head_start=0, num_heads=2, num_tokens=10)
    src = nhd_kv_pool(4, 4, 2, 16, 16, torch.float16, 2, gen)
    piece = ops.gather_kv_heads(src, None, [3, 0, 2], page_size=4, layout="NHD_KV", **head)
    mid_k = random_pool(other, 5, 3, 2, 16, torch.float16, 2, gen)
    mid_v = None if other == "HND_KV" else random_pool(other, 5, 3, 2, 16, torch.float16, 2, gen)
    ops.scatter_kv_heads(piece, mid_k, mid_v, [4, 1, 0, 2], page_size=3, layout=other, **head)
    back = ops.gather_kv_heads(mid_k, mid_v, [4, 1, 0, 2], page_size=3, layout=other, **head)
    assert same_bytes(back, piece)
    out = nhd_kv_pool(7, 2, 2, 16, 16, torch.float16, 2, gen)
    ops.scatter_kv_heads(back, out, None, [6, 0, 5, 1, 3], page_size=2, layout="NHD_KV", **head)
    assert same_bytes(ops.gather_kv_heads(out, None, [6, 0, 5, 1, 3], page_size=2, layout="NHD_KV", **head), piece)
    # Token 5: source page 0, slot 1; middle page 1, slot 2; out page 5, slot 1.
    for layer in range(2):
        k_rows, v_rows = src[layer][0, 1, :, :16], src[layer][0, 1, :, 16:]
        if other == "NHD":
            assert same_bytes(mid_k[layer][5], k_rows) and same_bytes(mid_v[layer][5], v_rows)
        elif other == "HND":
            assert same_bytes(mid_k[layer][1, :, 2], k_rows) and same_bytes(mid_v[layer][1, :, 2], v_rows)
        else:  # vLLM's [pages, heads, page_size, 2 * dim] over tiles [heads][K|V][slot][dim]
            tile = mid_k[layer][1].reshape(2, 2, 3, 16)
            assert same_bytes(tile[:, 0, 2], k_rows) and same_bytes(tile[:, 1, 2], v_rows)
        assert same_bytes(out[layer][5, 1], src[layer][0, 1])


@pytest.mark.parametrize(
    "make,kw,words",
    [
        (lambda c: (c, c), {}, "v_buffers is 3 tensor(s) but layout NHD_KV keeps V in the k_buffers tensors"),
        (lambda c: ([t[..., :-1].contiguous() for t in c], None), {}, "last dim of 13, odd"),
        (lambda c: (c, None), {"k_dim": 14}, "k_dim=14 must be smaller than the NHD_KV row of 14"),
        (lambda c: (c, None), {"page_size": 2}, "k_buffers[0] holds 4 tokens per page (dim 1) but page_size=2"),
        (lambda c: ([t.view(P * N, H, DK + DV) for t in c], None), {}, "layout NHD_KV needs [num_pages, page_size"),
        (lambda c: ([t.transpose(1, 2) for t in c], None), {"page_size": H}, "must be contiguous"),
        (
            lambda c: ([t.view(P * N, H, DK + DV) for t in c], [t.view(P * N, H, DK + DV) for t in c]),
            {"layout": "NHD", "k_dim": 4},
            "k_dim=4 is only for layout NHD_KV",
        ),
    ],
)
def test_rejections_name_the_argument_and_value(make, kw, words):
    assert_gather_rejected(words, *make(arange_cache()), **{"page_size": N, "layout": "NHD_KV", **kw})


def test_native_library_refuses_a_v_pointer_off_the_row(native_cpu):
    """An NHD_KV layer is a K and a V pointer to the C ABI: V must sit one K row after K."""
    cache = arange_cache()
    call = parse_call(
        cache, None, [1, 2], unique_pages=False, page_size=N, head_start=0, num_heads=1, layout="NHD_KV", k_dim=DK
    )
    pool, sl = ops._descs(call)
    good = call.layer_ptrs()
    assert good[L:] == [p + DK * 4 for p in good[:L]]
    bad = good[:L] + [p + 4 for p in good[:L]]
    staging = torch.zeros(call.staging_nbytes, dtype=torch.uint8)
    assert native_gather_status(native_cpu, pool, sl, call, bad, staging) == _native.STATUS_INVALID
    assert "layout NHD_KV: V pointer of layer 0 must be its K pointer + k_row_bytes" in native_cpu.last_error()
    assert bool((staging == 0).all())
    pool.num_kv = 1
    assert native_gather_status(native_cpu, pool, sl, call, good, staging) == _native.STATUS_INVALID
    assert "layout NHD_KV needs num_kv=2" in native_cpu.last_error()
