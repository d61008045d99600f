"""Every argument rejection of the ops: a ValueError whose message names the argument and
the value, raised before any byte moves. Also the native libraries' own checks (a second
line of defence behind ops' validation) and their status-to-exception mapping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_kvxfer import _native, ops
from sglang_kvxfer._ops_args import parse_call
from tests.ops.ops_cases import random_pool, same_bytes


def _pool(layout="NHD", pages=4, page_size=4, heads=8, dim=16, dtype=torch.bfloat16, layers=2):
    return random_pool(layout, pages, page_size, heads, dim, dtype, layers, torch.Generator().manual_seed(0))


K, V = _pool(), _pool()
GOOD = dict(page_size=4, head_start=0, num_heads=2)


def _gather(k=K, v=V, page_ids=(1, 2), **kw):
    return ops.gather_kv_heads(k, v, list(page_ids), **{**GOOD, **kw})


def _scatter(staging=None, k=None, v=None, page_ids=(1, 2), **kw):
    k = k if k is not None else [t.clone() for t in K]
    v = v if v is not None else [t.clone() for t in V]
    staging = staging if staging is not None else _gather()
    return ops.scatter_kv_heads(staging, k, v, list(page_ids), **{**GOOD, **kw})


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: _gather(layout="NDH"), r"layout='NDH' is not supported"),
        (lambda: _gather(k={"k": 1}), r"k_buffers must be a list of per-layer tensors, got dict"),
        (lambda: _gather(k=[]), r"k_buffers is empty"),
        (lambda: _gather(k=[K[0], "x"]), r"k_buffers\[1\] is a str, not a torch.Tensor"),
        (lambda: _gather(k=[t.double() for t in K], v=None), r"k_buffers\[0\] has dtype torch.float64 \(8 bytes\)"),
        (lambda: _gather(k=[t.to(torch.int64) for t in K], v=None), r"k_buffers\[0\] has dtype torch.int64"),
        (
            lambda: _gather(k=[t[None] for t in K], v=None),
            r"k_buffers\[0\] has shape \(1, 16, 8, 16\); layout NHD needs",
        ),
        (lambda: _gather(k=[K[0], K[1].float()], v=None), r"k_buffers\[1\] is torch.float32"),
        (lambda: _gather(k=[K[0], K[1][:8]], v=None), r"k_buffers\[1\] is .*\(8, 8, 16\)"),
        (
            lambda: _gather(k=[K[0], K[1].transpose(0, 1).contiguous().transpose(0, 1)], v=None),
            r"k_buffers\[1\] must be contiguous",
        ),
        (
            lambda: _gather(page_size=3),
            r"k_buffers\[0\] has 16 token rows, not a positive "
            r"multiple of page_size=3",
        ),
        (
            lambda: _gather(k=_pool("HND"), v=None, layout="HND", page_size=8),
            r"k_buffers\[0\] holds 4 tokens per page \(dim 2\) but page_size=8",
        ),
        (lambda: _gather(page_size=0), r"page_size=0 must be >= 1"),
        (lambda: _gather(page_size=4.0), r"page_size=4.0 must be an integer"),
        (lambda: _gather(page_size=True), r"page_size=True must be an integer"),
        (lambda: _gather(v=V[:1]), r"v_buffers has 1 layers but k_buffers has 2"),
        (
            lambda: _gather(v=[t.half() for t in V]),
            r"v_buffers are torch.float16 on cpu but "
            r"k_buffers are torch.bfloat16",
        ),
        (
            lambda: _gather(v=[t[:, :4].contiguous() for t in V]),
            r"v_buffers\[0\] has shape \(16, 4, 16\), which must match k_buffers\[0\]",
        ),
        (lambda: _gather(v=[t[:, :, :0].contiguous() for t in V]), r"v_buffers\[0\] has head_dim 0"),
        (
            lambda: _gather(head_start=7),
            r"heads \[head_start=7, head_start \+ num_heads=9\) are "
            r"outside the pool's 8 heads",
        ),
        (lambda: _gather(head_start=-1), r"head_start=-1 must be >= 0"),
        (lambda: _gather(num_heads=0), r"num_heads=0 must be >= 1"),
        (
            lambda: _gather(page_ids=(1, 4)),
            r"page_ids\[1\]=4 is outside \[0, 4\) \(the pool has "
            r"4 pages\)",
        ),
        (lambda: _gather(page_ids=(-1,)), r"page_ids\[0\]=-1 is outside \[0, 4\)"),
        (
            lambda: ops.gather_kv_heads(K, V, np.array([1.0, 2.0]), **GOOD),
            r"page_ids has dtype float64; page ids must be integers",
        ),
        (lambda: ops.gather_kv_heads(K, V, np.array([[1, 2]]), **GOOD), r"page_ids must be 1-D, got shape \(1, 2\)"),
        (
            lambda: ops.gather_kv_heads(K, V, torch.tensor([1.0]), **GOOD),
            r"page_ids has dtype torch.float32; use torch.int32 or torch.int64",
        ),
        (lambda: ops.gather_kv_heads(K, V, torch.tensor([[1]]), **GOOD), r"page_ids must be 1-D, got shape \(1, 1\)"),
        (lambda: ops.gather_kv_heads(K, V, [[1, 2], [3]], **GOOD), r"page_ids cannot be read"),
        (lambda: _gather(token_offset=-1), r"token_offset=-1 must be >= 0"),
        (
            lambda: _gather(token_offset=9),
            r"token_offset=9 is beyond the 8 tokens of 2 page ids "
            r"x page_size 4",
        ),
        (lambda: _gather(num_tokens=9), r"token_offset=0 \+ num_tokens=9 exceeds the 8 tokens"),
        (lambda: _gather(token_offset=2, num_tokens=7), r"token_offset=2 \+ num_tokens=7 exceeds the 8 tokens"),
        (lambda: _gather(num_tokens=-2), r"num_tokens=-2 must be >= 0"),
        (lambda: _gather(out=torch.empty(10, dtype=torch.uint8)), r"out holds 10 bytes but the slice needs 2048"),
        (lambda: _gather(out=torch.empty(2048, 2, dtype=torch.uint8).t()), r"out must be contiguous"),
        (lambda: _gather(out=bytearray(2048)), r"out must be a torch.Tensor, got bytearray"),
        (
            lambda: _gather(out=torch.empty(2048, dtype=torch.uint8, device="meta")),
            r"out is on meta but the KV buffers are on cpu",
        ),
        (lambda: _gather(k=[K[0], K[1].to("meta")], v=None), r"k_buffers\[1\] is .* on meta"),
        (
            lambda: _scatter(page_ids=(2, 2)),
            r"page_ids repeats page 2; a scatter would write it "
            r"twice",
        ),
        (
            lambda: _scatter(staging=torch.empty(100, dtype=torch.uint8)),
            r"staging holds 100 bytes but the slice needs 2048",
        ),
        (lambda: _scatter(staging=np.zeros(2048, dtype=np.uint8)), r"staging must be a torch.Tensor, got ndarray"),
    ],
)
def test_bad_argument_is_a_value_error_naming_it(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 1, 1, 1, 1, 2), r"num_layers=0 must be >= 1"),
        ((1, -1, 1, 1, 1, 2), r"num_tokens=-1 must be >= 0"),
        ((1, 1, 1, 0, 1, 2), r"k_dim=0 must be >= 1"),
        ((1, 1, 1, 1, -1, 2), r"v_dim=-1 must be >= 0"),
        ((1, 1, 1, 1, 1, 8), r"itemsize=8 must be 1, 2 or 4"),
        ((1, 1, 1, 1.5, 1, 2), r"k_dim=1.5 must be an integer"),
    ],
)
def test_staging_nbytes_rejects(args, match):
    with pytest.raises(ValueError, match=match):
        ops.staging_nbytes(*args)


def test_staging_nbytes_counts_k_and_v_blocks():
    assert ops.staging_nbytes(32, 8192, 2, 128, 128, 2) == 32 * 8192 * 2 * 256 * 2
    assert ops.staging_nbytes(3, 5, 1, 576, None, 1) == 3 * 5 * 576  # MLA: no V block
    assert ops.staging_nbytes(3, 5, 1, 576, 0, 1) == 3 * 5 * 576


def test_failed_scatter_writes_nothing():
    """A bad page id at the end of the list is caught before the first byte moves."""
    k, v = [t.clone() for t in K], [t.clone() for t in V]
    staging = torch.full((ops.staging_nbytes(2, 12, 2, 16, 16, 2),), 0x77, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"page_ids\[2\]=9 is outside"):
        ops.scatter_kv_heads(staging, k, v, [0, 1, 9], **GOOD)
    assert same_bytes(k, K) and same_bytes(v, V)


# ---- the native libraries' own checks ---------------------------------------------------


def _native_call(**overrides):
    lib = _native.cpu_library()
    if lib is None:
        pytest.skip(f"native CPU library unavailable: {_native.status()['cpu']}")
    call = parse_call(
        K,
        V,
        [1, 2],
        page_size=4,
        head_start=0,
        num_heads=2,
        layout="NHD",
        token_offset=0,
        num_tokens=None,
        unique_pages=False,
    )
    pool, sl = ops._descs(call)
    ids = np.array(overrides.pop("page_ids", [1, 2]), dtype=np.int64)
    nbytes = overrides.pop("staging_bytes", call.staging_nbytes)
    for key, value in overrides.items():
        setattr(pool if hasattr(pool, key) else sl, key, value)
    ptrs = np.array([t.data_ptr() for t in call.layers], dtype=np.uint64)
    staging = torch.empty(max(nbytes, 1), dtype=torch.uint8)
    code = lib.handle.kvxfer_gather_cpu(pool, ptrs.ctypes.data, ids.ctypes.data, sl, staging.data_ptr(), nbytes, 1, -1)
    _native.check_status(lib, code, "kvxfer_gather_cpu")


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(num_kv=3), r"kvxfer_gather_cpu: num_kv=3 must be 1 or 2"),
        (dict(itemsize=8), r"itemsize=8 must be 1, 2 or 4"),
        (dict(k_row_bytes=33), r"k_row_bytes=33 must be a positive multiple of itemsize=2"),
        (dict(layout=7), r"layout=7 must be 0 \(NHD\), 1 \(HND\) or 2 \(HND_KV\)"),
        (dict(reserved=1), r"reserved=1 must be 0"),
        (dict(head_start=7), r"heads \[7, 7 \+ 2\) are not inside the pool's 8 heads"),
        (dict(num_tokens=9), r"tokens \[0, 0 \+ 9\) exceed 2 page ids x page_size 4"),
        (dict(staging_bytes=100), r"staging_bytes=100 is smaller than the 2048 needed"),
        (dict(page_ids=[1, 4]), r"page_ids\[1\]=4 is outside \[0, 4\)"),
        (dict(num_pages=1, page_size=1 << 40, pool_heads=1 << 20), r"overflows int64"),
    ],
)
def test_native_library_rejects_bad_descriptors(overrides, match):
    with pytest.raises(ValueError, match=match):
        _native_call(**overrides)


def test_native_status_codes_map_to_exceptions():
    lib = _native.cpu_library()
    if lib is None:
        pytest.skip("native CPU library unavailable")
    _native.check_status(lib, 0, "f")  # OK: no exception
    from sglang_kvxfer.errors import KVXferError

    with pytest.raises(KVXferError, match=r"f: .*\(status 2\)"):
        _native.check_status(lib, 2, "f")


def test_a_kvslice_replaces_the_slice_keywords_and_excludes_them():
    from sglang_kvxfer.planning import KVSlice

    k = [torch.arange(8 * 2 * 4, dtype=torch.int16).reshape(8, 2, 4) for _ in range(2)]
    v = [x + 1000 for x in k]
    piece = KVSlice(
        pages=np.array([1, 0]), page_size=4, head_start=1, num_heads=1, layout="NHD", token_offset=2, num_tokens=5
    )
    want = ops.gather_kv_heads(k, v, [1, 0], page_size=4, head_start=1, num_heads=1, token_offset=2, num_tokens=5)
    assert torch.equal(ops.gather_kv_heads(k, v, piece), want)
    with pytest.raises(
        ValueError, match="page_ids is a KVSlice, which holds the whole slice; do not also pass page_size, num_tokens"
    ):
        ops.gather_kv_heads(k, v, piece, page_size=4, num_tokens=5)
    with pytest.raises(TypeError, match="missing required keyword argument\\(s\\): head_start, num_heads"):
        ops.scatter_kv_heads(want, k, v, [1, 0], page_size=4)
