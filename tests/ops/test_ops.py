"""CPU gather/scatter: native library == torch reference, bit for bit; poisoned buffers;
several writers into one pool; the CUDA kernel's work decomposition run on the host; the
reference fallback. Argument rejections are in test_ops_errors.py."""

from __future__ import annotations

import functools
import os
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_kvxfer import _native, ops
from sglang_kvxfer._ops_args import parse_call
from tests.ops.ops_cases import (
    as_bytes,
    assert_emulated_gather_is_the_reference,
    cases,
    clone_all,
    emulate_cuda,
    gather_kwargs,
    loop_oracle_scatter,
    random_pool,
    require_native_cpu,
    same_bytes,
    staging_size,
)

HYP = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


@pytest.fixture(scope="module", autouse=True)
def native_cpu():
    lib = require_native_cpu()
    assert ops.backend_for("cpu") == "native-cpu"
    return lib


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _streaming(on: bool):
    """Forces the CPU library's non-temporal store path on (or leaves the size rule)."""
    return mock.patch.object(ops, "_run_cpu", functools.partial(ops._run_cpu, streaming_min_bytes=0 if on else -1))


@HYP
@given(case=cases(), streaming=st.booleans())
def test_gather_native_equals_reference_and_writes_every_byte(case, streaming):
    gen = _gen()
    k, v = case.make_pools(case.src, gen)
    kw = gather_kwargs(case)
    page_ids = kw.pop("page_ids")
    expect = ops.gather_kv_heads_reference(k, v, page_ids, **kw)
    assert expect.numel() == staging_size(case)
    for sentinel in (0xA5, 0x5A):  # two poisons: a byte left unwritten shows in one of them
        out = torch.full((expect.numel() + 37,), sentinel, dtype=torch.uint8)
        with _streaming(streaming):
            got = ops.gather_kv_heads(k, v, page_ids, out=out, **kw)
        assert got.numel() == expect.numel()
        assert got.numel() == 0 or got.data_ptr() == out.data_ptr()  # a view of out
        assert same_bytes(got, expect)
        assert bool((out[expect.numel() :] == sentinel).all()), "gather wrote past the staging"


@HYP
@given(case=cases(), streaming=st.booleans())
def test_scatter_native_equals_reference_and_loop_oracle(case, streaming):
    gen = _gen(1)
    k, v = case.make_pools(case.src, gen)
    staging = ops.gather_kv_heads_reference(k, v, **gather_kwargs(case))
    dk, dv = case.make_pools(case.dst, gen)  # random bits: the "sentinel" of every other byte
    kw = case.kwargs(case.dst)
    page_ids = kw.pop("page_ids")
    native_k, native_v = clone_all(dk), clone_all(dv)
    with _streaming(streaming):
        ops.scatter_kv_heads(staging, native_k, native_v, page_ids, **kw)
    ref_k, ref_v = clone_all(dk), clone_all(dv)
    ops.scatter_kv_heads_reference(staging, ref_k, ref_v, page_ids, **kw)
    oracle_k, oracle_v = clone_all(dk), clone_all(dv)
    loop_oracle_scatter(staging, oracle_k, oracle_v, page_ids, **kw)
    # Whole pools compared: target rows hold the staging, every other byte is unchanged.
    assert same_bytes(ref_k, oracle_k) and (dv is None or same_bytes(ref_v, oracle_v))
    assert same_bytes(native_k, oracle_k) and (dv is None or same_bytes(native_v, oracle_v))
    # And the destination reads back as the same staging (page size / layout absorbed).
    back = ops.gather_kv_heads(native_k, native_v, page_ids, **kw)
    assert same_bytes(back, staging)


@HYP
@given(case=cases())
def test_cuda_work_decomposition_emulated_on_host_equals_reference(case):
    """kvxfer_emulate_cuda_cpu runs the kernel's tiling, per-token offsets and vector
    widths (kvxfer_index.h) serially: the GPU addressing, checked without a GPU."""
    gen = _gen(2)
    k, v = case.make_pools(case.src, gen)
    kw = case.kwargs(case.src)
    expect = ops.gather_kv_heads_reference(k, v, **kw)
    got = torch.full_like(expect, 0xA5)
    emulate_cuda(kw, k, v, got, gather=True)
    assert same_bytes(got, expect)

    dk, dv = case.make_pools(case.dst, gen)
    dkw = case.kwargs(case.dst)
    ref_k, ref_v = clone_all(dk), clone_all(dv)
    ops.scatter_kv_heads_reference(expect, ref_k, ref_v, **dkw)
    emulate_cuda(dkw, dk, dv, expect, gather=False)
    assert same_bytes(dk, ref_k) and (dv is None or same_bytes(dv, ref_v))


@pytest.mark.parametrize("ptr_align", [1, 2, 4, 8, 16])
def test_emulated_kernel_every_vector_width(ptr_align):
    gen = _gen(3)
    k = random_pool("NHD", 6, 4, 4, 64, torch.bfloat16, 2, gen)
    v = random_pool("NHD", 6, 4, 4, 64, torch.bfloat16, 2, gen)
    kw = dict(page_ids=[5, 0, 3], page_size=4, head_start=1, num_heads=2, layout="NHD")
    assert_emulated_gather_is_the_reference(k, v, kw, ptr_align)


def test_emulated_kernel_skips_out_of_range_page_ids_instead_of_leaving_the_pool():
    """The kernel does not trust page ids (ops checks them first): a bad one zero-fills its
    staging rows on gather and writes nothing on scatter."""
    gen = _gen(4)
    k = random_pool("NHD", 4, 2, 2, 8, torch.float32, 1, gen)  # 4 pages of 2 tokens
    lib = _native.cpu_library()
    call = parse_call(
        k,
        None,
        [1, 2],
        page_size=2,
        head_start=0,
        num_heads=2,
        layout="NHD",
        token_offset=0,
        num_tokens=None,
        unique_pages=False,
    )
    pool, sl = ops._descs(call)
    bad_ids = np.array([1, 1000], dtype=np.int64)  # page 1 valid, page 1000 not
    table = np.array([k[0].data_ptr()], dtype=np.uint64)

    def emulate(gather, staging):
        return lib.handle.kvxfer_emulate_cuda_cpu(
            gather, pool, table.ctypes.data, 16, bad_ids.ctypes.data, sl, staging.data_ptr(), staging.numel()
        )

    staging = torch.full((ops.staging_nbytes(1, 4, 2, 8, 0, 4),), 0xEE, dtype=torch.uint8)
    assert emulate(1, staging) == 0
    half = staging.numel() // 2
    expect = ops.gather_kv_heads_reference(k, None, [1], page_size=2, head_start=0, num_heads=2)
    assert same_bytes(staging[:half], expect)
    assert bool((staging[half:] == 0).all())

    before = k[0].clone()
    staging.fill_(0x11)
    assert emulate(0, staging) == 0
    page1 = torch.zeros(k[0].shape[0], dtype=torch.bool)
    page1[2:4] = True  # rows of page 1
    assert bool((as_bytes(k[0][page1]) == 0x11).all())
    assert same_bytes(k[0][~page1], before[~page1])


def test_prefill_tp2_to_decode_tp1_two_writers_fill_one_pool():
    """Two prefill ranks (2 of 4 heads each, NHD, page 16) scatter into one decode pool
    (4 heads, HND, page 4) at head offsets 0 and 2; every other byte stays as it was."""
    gen = _gen(5)
    layers, tokens, d = 3, 37, 64
    full_k = [torch.randn(tokens, 4, d, generator=gen).bfloat16() for _ in range(layers)]
    full_v = [torch.randn(tokens, 4, d, generator=gen).bfloat16() for _ in range(layers)]
    src_pages = [[2, 0, 3], [1, 3, 0]]  # each prefill rank has its own page ids
    dst_pages = [9, 4, 0, 7, 2, 5, 1, 8, 3, 6]
    dk = random_pool("HND", 12, 4, 4, d, torch.bfloat16, layers, gen)
    dv = random_pool("HND", 12, 4, 4, d, torch.bfloat16, layers, gen)
    before_k, before_v = clone_all(dk), clone_all(dv)
    for rank in range(2):
        heads = slice(2 * rank, 2 * rank + 2)
        pk = [torch.zeros(4 * 16, 2, d).bfloat16() for _ in range(layers)]
        pv = [torch.zeros(4 * 16, 2, d).bfloat16() for _ in range(layers)]
        for t in range(tokens):
            row = src_pages[rank][t // 16] * 16 + t % 16
            for layer in range(layers):
                pk[layer][row] = full_k[layer][t, heads]
                pv[layer][row] = full_v[layer][t, heads]
        staging = ops.gather_kv_heads(
            pk, pv, src_pages[rank], page_size=16, head_start=0, num_heads=2, num_tokens=tokens
        )
        ops.scatter_kv_heads(
            staging, dk, dv, dst_pages, page_size=4, head_start=2 * rank, num_heads=2, layout="HND", num_tokens=tokens
        )
    written = torch.zeros(12, 4, 4, dtype=torch.bool)
    for t in range(tokens):
        page, slot = dst_pages[t // 4], t % 4
        written[page, :, slot] = True
        for layer in range(layers):
            assert same_bytes(dk[layer][page, :, slot], full_k[layer][t])
            assert same_bytes(dv[layer][page, :, slot], full_v[layer][t])
    for layer in range(layers):
        assert same_bytes(dk[layer][~written], before_k[layer][~written])
        assert same_bytes(dv[layer][~written], before_v[layer][~written])


def test_request_sent_in_chunks_equals_one_shot():
    gen = _gen(6)
    k = random_pool("NHD", 8, 16, 8, 128, torch.bfloat16, 2, gen)
    v = random_pool("NHD", 8, 16, 8, 128, torch.bfloat16, 2, gen)
    pages = [6, 1, 4, 0, 7]
    kw = dict(page_size=16, head_start=4, num_heads=4)
    whole = ops.gather_kv_heads(k, v, pages, num_tokens=70, **kw)
    first = ops.gather_kv_heads(k, v, pages, num_tokens=33, **kw)
    second = ops.gather_kv_heads(k, v, pages, token_offset=33, num_tokens=37, **kw)
    per_layer = lambda s, n: s.view(2, 2, n, -1)  # noqa: E731 [layer][K|V][token][bytes]
    joined = torch.cat([per_layer(first, 33), per_layer(second, 37)], dim=2)
    assert same_bytes(joined, whole)


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("threads", ["1", "2", "3", "7"])
def test_streaming_stores_and_threads(threads, streaming):
    """Non-temporal stores (forced on, or off) with odd row sizes exercise their unaligned
    head and tail, an odd staging offset their alignment handling, and several threads the
    work split."""
    gen = _gen(7)
    k = random_pool("NHD", 24, 16, 5, 100, torch.float16, 3, gen)
    v = random_pool("NHD", 24, 16, 5, 36, torch.float16, 3, gen)
    pages = torch.randperm(24, generator=gen)
    kw = dict(page_size=16, head_start=1, num_heads=3)
    expect = ops.gather_kv_heads_reference(k, v, pages, **kw)
    buf = torch.full((expect.numel() + 1,), 0xA5, dtype=torch.uint8)
    run_cpu = functools.partial(ops._run_cpu, streaming_min_bytes=0 if streaming else 1 << 62)
    with mock.patch.dict(os.environ, {"KVXFER_CPU_THREADS": threads}), mock.patch.object(ops, "_run_cpu", run_cpu):
        got = ops.gather_kv_heads(k, v, pages, out=buf[1:], **kw)
        assert same_bytes(got, expect) and buf[0] == 0xA5
        dk, dv = [torch.zeros_like(t) for t in k], [torch.zeros_like(t) for t in v]
        ops.scatter_kv_heads(buf[1:], dk, dv, pages, **kw)
    rk, rv = [torch.zeros_like(t) for t in k], [torch.zeros_like(t) for t in v]
    ops.scatter_kv_heads_reference(expect, rk, rv, pages, **kw)
    assert same_bytes(dk, rk) and same_bytes(dv, rv)


def test_page_ids_as_list_numpy_int32_and_int64_tensors_agree():
    gen = _gen(8)
    k = random_pool("HND", 5, 8, 2, 16, torch.float32, 1, gen)
    forms = [
        [4, 2],
        np.array([4, 2], dtype=np.int32),
        torch.tensor([4, 2], dtype=torch.int32),
        torch.tensor([4, 2], dtype=torch.int64),
        np.array([4, 2], dtype=np.uint16),
    ]
    outs = [ops.gather_kv_heads(k, None, ids, page_size=8, head_start=1, num_heads=1, layout="HND") for ids in forms]
    assert all(same_bytes(o, outs[0]) for o in outs)


def test_stacked_layer_tensor_equals_layer_list():
    gen = _gen(9)
    k = random_pool("NHD", 4, 4, 2, 8, torch.bfloat16, 3, gen)
    stacked = torch.stack(k)
    a = ops.gather_kv_heads(k, None, [3, 1], page_size=4, head_start=0, num_heads=2)
    b = ops.gather_kv_heads(stacked, None, [3, 1], page_size=4, head_start=0, num_heads=2)
    assert same_bytes(a, b)


def test_zero_tokens_moves_nothing():
    gen = _gen(10)
    k = random_pool("NHD", 2, 4, 2, 8, torch.bfloat16, 1, gen)
    before = k[0].clone()
    out = ops.gather_kv_heads(k, None, [], page_size=4, head_start=0, num_heads=1)
    assert out.numel() == 0
    ops.scatter_kv_heads(
        torch.empty(0, dtype=torch.uint8), k, None, [1], page_size=4, head_start=0, num_heads=1, num_tokens=0
    )
    assert same_bytes(k[0], before)


def test_reference_used_and_correct_when_native_disabled(monkeypatch):
    gen = _gen(11)
    k = random_pool("NHD", 4, 4, 4, 32, torch.float16, 2, gen)
    v = random_pool("NHD", 4, 4, 4, 16, torch.float16, 2, gen)
    kw = dict(page_size=4, head_start=1, num_heads=2)
    native = ops.gather_kv_heads(k, v, [2, 0, 3], **kw)
    monkeypatch.setenv("KVXFER_DISABLE_NATIVE", "1")
    assert _native.cpu_library() is None and ops.backend_for("cpu") == "reference"
    with mock.patch.object(ops, "_run_cpu", side_effect=AssertionError("native called")):
        fallback = ops.gather_kv_heads(k, v, [2, 0, 3], **kw)
        dk, dv = [torch.zeros_like(t) for t in k], [torch.zeros_like(t) for t in v]
        ops.scatter_kv_heads(fallback, dk, dv, [1, 3, 0], **kw)
    assert same_bytes(fallback, native)
    assert same_bytes(ops.gather_kv_heads_reference(dk, dv, [1, 3, 0], **kw), native)


def test_reference_used_when_library_failed_to_load(monkeypatch):
    monkeypatch.setitem(_native._loaded, "cpu", "simulated: libkvxfer_cpu.so missing")
    assert ops.backend_for("cpu") == "reference"
    assert "simulated" in _native.status()["cpu"]
    gen = _gen(12)
    k = random_pool("NHD", 3, 2, 2, 8, torch.bfloat16, 1, gen)
    with mock.patch.object(ops, "_run_cpu", side_effect=AssertionError("native called")):
        out = ops.gather_kv_heads(k, None, [2, 0], page_size=2, head_start=1, num_heads=1)
    assert same_bytes(out, as_bytes(torch.stack([k[0][4, 1], k[0][5, 1], k[0][0, 1], k[0][1, 1]])))
