"""The ops remember layer lists that passed their checks (``_ops_args._Checked``) and keep
CUDA pointer tables on the device (``ops._DeviceTables``): a list is checked again when a
tensor of it changed address or died, the memory the cache remembers is never kept alive by
it, and bytes stay exact across calls. The CUDA tests skip themselves without a GPU."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from sglang_kvxfer import _ops_args, ops
from tests.facts import needs_cuda

L, PAGE, HEADS, DIM = 4, 4, 2, 8


def _pool(device="cpu", pages=6):
    return [torch.randn(pages * PAGE, HEADS, DIM, device=device).to(torch.bfloat16) for _ in range(L)]


def _gather(k, v, ids=(1, 3)):
    return ops.gather_kv_heads(k, v, list(ids), page_size=PAGE, head_start=0, num_heads=HEADS)


def test_a_list_checked_before_is_checked_again_once_a_tensor_moved():
    k, v = _pool(), _pool()
    first = _gather(k, v)
    assert torch.equal(_gather(k, v), first)  # the remembered lists: same bytes
    k[2].set_(torch.zeros(5 * PAGE, HEADS, DIM, dtype=torch.bfloat16))  # another address, fewer pages
    with pytest.raises(ValueError, match=r"k_buffers\[2\] is torch.bfloat16 \(20, 2, 8\) .* but k_buffers\[0\]"):
        _gather(k, v)


def test_a_list_whose_tensor_died_is_not_taken_for_a_new_one():
    checked = _ops_args._Checked()
    layers = _pool()
    ptrs = tuple(t.data_ptr() for t in layers)
    key = ("NHD", tuple(map(id, layers)))
    checked.add(key, layers, ptrs)
    assert checked.hit(key, layers, ptrs)
    assert not checked.hit(key, layers, ptrs[:-1] + (ptrs[-1] + 64,))  # an address changed
    stand_in = list(layers)
    stand_in[1] = torch.zeros_like(layers[1])  # another tensor (same key only if ids collide)
    assert not checked.hit(key, stand_in, ptrs)


def test_the_cache_keeps_no_pool_alive():
    k, v = _pool(), _pool()
    _gather(k, v)
    refs = [weakref.ref(t) for t in k + v]
    del k, v
    gc.collect()
    assert all(r() is None for r in refs)


def test_the_cache_holds_a_bounded_number_of_lists():
    pools = [(_pool(pages=2), _pool(pages=2)) for _ in range(_ops_args._Checked.MAX + 8)]
    for k, v in pools:
        _gather(k, v, ids=(0, 1))
    assert len(_ops_args._checked._lists) <= _ops_args._Checked.MAX


@pytest.mark.gpu
@needs_cuda
def test_device_tables_are_uploaded_once_per_pool_and_bytes_stay_exact():
    tables = ops._device_tables
    k, v = _pool("cuda"), _pool("cuda")
    ids = np.array([4, 0, 2])
    out = [ops.gather_kv_heads(k, v, ids, page_size=PAGE, head_start=0, num_heads=HEADS) for _ in range(3)]
    ptrs = tuple(t.data_ptr() for t in k + v)
    assert sum(1 for key in tables._tables if key[1] == ptrs) == 1
    want = ops.gather_kv_heads_reference(k, v, ids, page_size=PAGE, head_start=0, num_heads=HEADS)
    for got in out:
        assert torch.equal(got, want)


@pytest.mark.gpu
@needs_cuda
def test_a_pool_freed_and_made_again_at_the_same_addresses_copies_exact_bytes():
    ids = np.array([5, 1])
    for _ in range(3):  # torch's allocator tends to hand the same blocks back
        k, v = _pool("cuda"), _pool("cuda")
        got = ops.gather_kv_heads(k, v, ids, page_size=PAGE, head_start=0, num_heads=HEADS)
        want = ops.gather_kv_heads_reference(k, v, ids, page_size=PAGE, head_start=0, num_heads=HEADS)
        assert torch.equal(got, want)
        del k, v, got
        torch.cuda.synchronize()


@pytest.mark.gpu
@needs_cuda
def test_evicted_tables_in_use_on_another_stream_stay_valid():
    """Tables made on the default stream, launched with on a side stream behind a long
    device sleep, then evicted and their memory handed out again on the default stream:
    the launches still read the right pointers (the cache marks each table in use by the
    stream that launches with it)."""
    side = torch.cuda.Stream()
    ids = np.array([0, 2, 1])
    n = ops._DeviceTables.MAX

    def gather(k, v):
        return ops.gather_kv_heads(k, v, ids, page_size=PAGE, head_start=0, num_heads=HEADS)

    first = [(_pool("cuda", pages=3), _pool("cuda", pages=3)) for _ in range(n)]
    for k, v in first:
        gather(k, v)  # their tables, made on the default stream
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        outs = [gather(k, v) for k, v in first]  # queued behind the sleep
    later = [(_pool("cuda", pages=3), _pool("cuda", pages=3)) for _ in range(n)]
    for k, v in later:
        gather(k, v)  # evicts every table of ``first``
    junk = [torch.full((256,), -1, dtype=torch.int64, device="cuda") for _ in range(4 * n)]
    side.synchronize()
    torch.cuda.synchronize()
    del junk
    for (k, v), got in zip(first, outs):
        assert torch.equal(got, ops.gather_kv_heads_reference(k, v, ids, page_size=PAGE, head_start=0, num_heads=HEADS))
