"""Shared helpers of the ops tests: the native CPU library (or the reason to skip), random
pools, byte comparison, a loop oracle, the CUDA-kernel emulator call, the calls of the
rejection tests, and the hypothesis strategy of gather/scatter cases.

Pools are filled with random *bits* (NaN payloads included for float dtypes), and every
comparison is of bytes, so "bit for bit" is what is checked.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import strategies as st

from sglang_kvxfer import _native, ops
from sglang_kvxfer._native import build
from sglang_kvxfer._ops_args import parse_call

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.float8_e4m3fn]


def require_native_cpu():
    """The native CPU library. Skips where it cannot exist (KVXFER_DISABLE_NATIVE, no C++
    compiler) and fails where a compiler exists but the library did not load: otherwise the
    tests would compare the torch reference with itself."""
    if os.environ.get("KVXFER_DISABLE_NATIVE"):
        pytest.skip("KVXFER_DISABLE_NATIVE is set")
    lib = _native.cpu_library()
    if lib is None:
        if build.find_cxx() is None:
            pytest.skip("no C++ compiler: the native CPU library cannot exist here")
        pytest.fail(f"a C++ compiler exists but the CPU library is unavailable: {_native.status()['cpu']}")
    return lib


def random_pool(layout, num_pages, page_size, heads, dim, dtype, layers, gen, device="cpu", vllm_shape=True):
    """``layers`` tensors of random bits, NHD ``[pages*page_size, heads, dim]``, HND, or
    HND_KV (K and V: vLLM's ``[pages, heads, page_size, 2*dim]``, else ``[pages, heads, 2,
    page_size, dim]``)."""
    if layout == "NHD":
        shape = (num_pages * page_size, heads, dim)
    elif layout == "HND_KV":
        shape = (num_pages, heads, page_size, 2 * dim) if vllm_shape else (num_pages, heads, 2, page_size, dim)
        dim = shape[-1]
    else:
        shape = (num_pages, heads, page_size, dim)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    out = []
    for _ in range(layers):
        raw = torch.randint(0, 256, (*shape[:-1], dim * itemsize), dtype=torch.uint8, generator=gen)
        out.append(raw.view(dtype).to(device))
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).cpu()


def same_bytes(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_bytes(x, y) for x, y in zip(a, b))
    return torch.equal(as_bytes(a), as_bytes(b))


def clone_all(buffers):
    return None if buffers is None else [t.clone() for t in buffers]


def loop_oracle_scatter(
    staging: torch.Tensor, k, v, page_ids, *, page_size, head_start, num_heads, layout, token_offset, num_tokens
):
    """Scatter written as plain loops over (layer, K|V, token, head): independent of both
    the vectorized reference and the kernels. Writes into k/v in place (HND_KV: K and V
    into the one tensor per layer in ``k``; a (page, head) tile is K rows then V rows)."""
    data = as_bytes(staging)
    itemsize = k[0].element_size()
    if layout == "HND_KV":
        parts = [(k, 0), (k, 1)]
    else:
        parts = [(k, 0)] if v is None else [(k, 0), (v, 1)]
    off = 0
    for layer in range(len(k)):
        for part, kind in parts:
            buf = part[layer]
            row = buf.shape[-1] * itemsize
            if layout == "HND_KV" and buf.dim() == 4:  # vLLM's [pages, heads, page_size, 2*dim]
                row //= 2
            flat = buf.view(torch.uint8).reshape(-1)
            heads = buf.shape[1]
            for i in range(num_tokens):
                t = token_offset + i
                page, slot = int(page_ids[t // page_size]), t % page_size
                for h in range(num_heads):
                    hh = head_start + h
                    if layout == "NHD":
                        at = ((page * page_size + slot) * heads + hh) * row
                    elif layout == "HND_KV":
                        at = (((page * heads + hh) * 2 + kind) * page_size + slot) * row
                    else:
                        at = ((page * heads + hh) * page_size + slot) * row
                    flat[at : at + row] = data[off : off + row]
                    off += row


def emulate_cuda(call_kwargs: dict, k, v, staging: torch.Tensor, gather: bool, ptr_align: int | None = None) -> None:
    """Runs the CUDA kernel's work decomposition on the host (kvxfer_emulate_cuda_cpu).
    ``call_kwargs`` are gather_kv_heads' keywords, ``page_ids`` included."""
    kw = dict(layout="NHD", token_offset=0, num_tokens=None)
    kw.update(call_kwargs)
    lib = _native.cpu_library()
    call = parse_call(k, v, kw.pop("page_ids"), unique_pages=not gather, **kw)
    pool, sl = ops._descs(call)
    ptrs = call.layer_ptrs()
    align = 16
    for p in ptrs:
        align = math.gcd(align, p)
    table = np.array(ptrs, dtype=np.uint64)
    code = lib.handle.kvxfer_emulate_cuda_cpu(
        1 if gather else 0,
        pool,
        table.ctypes.data,
        ptr_align or align,
        call.page_ids.ctypes.data,
        sl,
        staging.data_ptr(),
        staging.numel() * staging.element_size(),
    )
    _native.check_status(lib, code, "kvxfer_emulate_cuda_cpu")


def packed_gather_checked(k, page_ids, kw: dict) -> torch.Tensor:
    """gather_kv_heads of a packed pool (K and V in ``k``), checked byte for byte against the
    torch reference and the CUDA kernel's host emulator: the staging."""
    staging = ops.gather_kv_heads(k, None, page_ids, **kw)
    assert same_bytes(staging, ops.gather_kv_heads_reference(k, None, page_ids, **kw))
    emulated = torch.full_like(staging, 0xA5)
    emulate_cuda({**kw, "page_ids": page_ids}, k, None, emulated, gather=True)
    assert same_bytes(emulated, staging)
    return staging


def assert_packed_scatters_agree(staging, dst, page_ids, kw: dict, oracle) -> None:
    """Native, reference and emulated scatter of ``staging`` into copies of the packed pool
    ``dst`` equal ``oracle(copy)``'s, whole pools (every other byte unchanged), and moved
    something."""
    native, ref, expect, emu = (clone_all(dst) for _ in range(4))
    ops.scatter_kv_heads(staging, native, None, page_ids, **kw)
    ops.scatter_kv_heads_reference(staging, ref, None, page_ids, **kw)
    oracle(expect)
    emulate_cuda({**kw, "page_ids": page_ids}, emu, None, staging, gather=False)
    for got in (native, ref, emu):
        assert same_bytes(got, expect)
    assert not same_bytes(native, dst)


def assert_emulated_gather_is_the_reference(k, v, kw: dict, ptr_align: int) -> None:
    """The CUDA kernel's host emulator, its pointers taken as aligned to ``ptr_align`` bytes
    only, gathers what the torch reference gathers."""
    expect = ops.gather_kv_heads_reference(k, v, **kw)
    got = torch.zeros_like(expect)
    emulate_cuda(kw, k, v, got, gather=True, ptr_align=ptr_align)
    assert same_bytes(got, expect)


def native_gather_status(lib, pool, sl, call, ptrs, staging: torch.Tensor) -> int:
    """kvxfer_gather_cpu of a parsed call's page ids over the descriptors ``pool``, ``sl``
    and the layer pointer table ``ptrs`` (one thread), for the tests of what the C ABI
    refuses: the status code."""
    table = np.array(ptrs, dtype=np.uint64)
    args = (pool, table.ctypes.data, call.page_ids.ctypes.data, sl, staging.data_ptr(), staging.numel(), 1, -1)
    return lib.handle.kvxfer_gather_cpu(*args)


def assert_gather_rejected(words: str, k, v, **kw) -> None:
    """gather_kv_heads of page 0, head 0 (``kw`` on top) raises a ValueError saying ``words``."""
    args = dict(head_start=0, num_heads=1)
    args.update(kw)
    with pytest.raises(ValueError) as exc:
        ops.gather_kv_heads(k, v, [0], **args)
    assert words in str(exc.value)


@dataclass
class Case:
    dtype: torch.dtype
    num_layers: int
    mla: bool
    k_dim: int
    v_dim: int
    num_heads: int
    num_tokens: int
    default_num_tokens: bool
    # per side: layout, page_size, pool_heads, head_start, token_offset, num_pages, page_ids
    src: dict
    dst: dict

    def kwargs(self, side: dict) -> dict:
        return dict(
            page_size=side["page_size"],
            head_start=side["head_start"],
            num_heads=self.num_heads,
            layout=side["layout"],
            token_offset=side["token_offset"],
            num_tokens=self.num_tokens,
            page_ids=side["page_ids"],
        )

    def make_pools(self, side: dict, gen, device="cpu"):
        """(k, v) buffer lists of one side; HND_KV: (the K-and-V tensors, None)."""
        args = (side["layout"], side["num_pages"], side["page_size"], side["pool_heads"])
        vllm = side.get("vllm_shape", True)
        k = random_pool(*args, self.k_dim, self.dtype, self.num_layers, gen, device, vllm_shape=vllm)
        packed = side["layout"] == "HND_KV"
        v = None if self.mla or packed else random_pool(*args, self.v_dim, self.dtype, self.num_layers, gen, device)
        return k, v


@st.composite
def sides(draw, num_heads: int, num_tokens: int, mla: bool, packed_ok: bool = False) -> dict:
    layout = draw(st.sampled_from(["NHD", "HND", "HND_KV"] if packed_ok else ["NHD", "HND"]))
    page_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    pool_heads = 1 if mla else draw(st.integers(num_heads, num_heads + 3))
    head_start = draw(st.integers(0, pool_heads - num_heads))
    token_offset = draw(st.integers(0, 2 * page_size))
    needed = max(1, math.ceil((token_offset + num_tokens) / page_size))
    num_pages = needed + draw(st.integers(0, 3))
    perm = draw(st.permutations(range(num_pages)))
    return dict(
        layout=layout,
        page_size=page_size,
        pool_heads=pool_heads,
        head_start=head_start,
        token_offset=token_offset,
        num_pages=num_pages,
        page_ids=list(perm[:needed]),
        vllm_shape=draw(st.booleans()),
    )


@st.composite
def cases(draw, max_tokens: int = 40) -> Case:
    mla = draw(st.booleans())
    num_heads = 1 if mla else draw(st.integers(1, 4))
    num_tokens = draw(st.integers(0, max_tokens))
    k_dim = draw(st.sampled_from([1, 3, 8, 16, 24, 64, 72]))
    v_dim = 0 if mla else draw(st.sampled_from([k_dim, k_dim, 1, 5, 8, 32]))
    packed_ok = not mla and v_dim == k_dim  # HND_KV needs v_dim == k_dim
    src = draw(sides(num_heads, num_tokens, mla, packed_ok))
    dst = draw(sides(num_heads, num_tokens, mla, packed_ok))
    # num_tokens=None means "to the end of the page list": only when that is num_tokens.
    default_ok = len(src["page_ids"]) * src["page_size"] - src["token_offset"] == num_tokens
    return Case(
        dtype=draw(st.sampled_from(DTYPES)),
        num_layers=draw(st.integers(1, 3)),
        mla=mla,
        k_dim=k_dim,
        v_dim=v_dim,
        num_heads=num_heads,
        num_tokens=num_tokens,
        default_num_tokens=default_ok and draw(st.booleans()),
        src=src,
        dst=dst,
    )


def gather_kwargs(case: Case) -> dict:
    kw = case.kwargs(case.src)
    if case.default_num_tokens:
        kw["num_tokens"] = None
    return kw


def staging_size(case: Case) -> int:
    itemsize = torch.empty(0, dtype=case.dtype).element_size()
    return ops.staging_nbytes(
        case.num_layers, case.num_tokens, case.num_heads, case.k_dim, None if case.mla else case.v_dim, itemsize
    )
