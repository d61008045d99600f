"""Gather and scatter of KV head slices between paged KV pools and a contiguous staging buffer.

Owns the public ops ``gather_kv_heads`` (pool pages -> staging) and ``scatter_kv_heads``
(staging -> pool pages), their pure-torch references, and ``staging_nbytes``. The staged
data path uses them when a head slice is strided inside each token (NHD pools, different TP
on the two sides): one gather on the sender, one large write, one scatter on the receiver.

Staging layout (a flat byte buffer, token-major, so it is the same bytes whatever the two
sides' page sizes and layouts are), for each layer ``l`` in order::

    K block  [num_tokens, num_heads, k_dim]
    V block  [num_tokens, num_heads, v_dim]     (absent for MLA: v_buffers=None)

Staging token ``i`` is request token ``t = token_offset + i``, stored at page
``page_ids[t // page_size]``, slot ``t % page_size``.

Backends: the compiled libraries of ``csrc/`` (``sglang_kvxfer._native``, loaded lazily and
cached) for CPU and CUDA tensors; the torch reference when a library is unavailable or
``KVXFER_DISABLE_NATIVE=1``. Both copy bits, so any 1-, 2- or 4-byte dtype works.
Must not: import at package import time (torch is heavy), or let a bad argument reach
native code: ``_ops_args`` validates everything first and raises ``ValueError``.
"""

from __future__ import annotations

import logging
import math
import os

import numpy as np
import torch

from sglang_kvxfer import _native, envs
from sglang_kvxfer._ops_args import KVCall, parse_call, staging_bytes_view, staging_nbytes
from sglang_kvxfer.errors import KVXferError

__all__ = [
    "gather_kv_heads",
    "scatter_kv_heads",
    "gather_kv_heads_reference",
    "scatter_kv_heads_reference",
    "staging_nbytes",
    "backend_for",
    "check_native_backend",
    "cuda_kernel_launcher",
]

logger = logging.getLogger(__name__)

# Below this many bytes per thread, starting a thread costs more than it saves.
_MIN_BYTES_PER_THREAD = 1 << 20
_MAX_THREADS = 64
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_warned_fallback: set[str] = set()


def gather_kv_heads(
    k_buffers,
    v_buffers,
    page_ids,
    *,
    page_size=None,
    head_start=None,
    num_heads=None,
    layout=None,
    token_offset=None,
    num_tokens=None,
    out=None,
) -> torch.Tensor:
    """Copy heads ``[head_start, head_start + num_heads)`` of a request's tokens, in all layers,
    from a paged KV pool into one contiguous staging buffer.

    Parameters
    ----------
    k_buffers : sequence of L torch.Tensor (or one ``[L, ...]`` tensor)
        Per-layer K buffers, all the same dtype (1, 2 or 4 bytes per element), device and
        shape, contiguous. NHD: ``[num_pages * page_size, pool_heads, k_dim]``;
        HND: ``[num_pages, pool_heads, page_size, k_dim]``. HND_KV: the per-layer K *and* V
        buffers, ``[num_pages, pool_heads, page_size, 2 * dim]`` (vLLM's CPU cache as vLLM
        shapes it) or ``[num_pages, pool_heads, 2, page_size, dim]`` (the same bytes): each
        (page, head) tile is K ``[page_size, dim]`` then V ``[page_size, dim]``.
    v_buffers : sequence of L torch.Tensor, or None
        Per-layer V buffers shaped like ``k_buffers`` but with ``v_dim`` last. None for MLA
        (one buffer per layer): the staging then has no V blocks. HND_KV: None (or an
        empty sequence); V comes from ``k_buffers`` and the staging has V blocks.
    page_ids : list, numpy array or int32/int64 tensor, ``[num_page_ids]``; or a ``KVSlice``
        The request's pages, in token order. Each in ``[0, num_pages)``. A
        ``sglang_kvxfer.planning.KVSlice`` (what ``RequestPlan.gather_slice`` returns)
        carries the pages and every slice field below, which must then be left out.
    page_size : int
        Tokens per page of this pool (required unless ``page_ids`` is a ``KVSlice``).
    head_start, num_heads : int
        The pool heads to copy (required unless ``page_ids`` is a ``KVSlice``).
    layout : {"NHD", "HND", "HND_KV"}, default "NHD"
    token_offset : int, default 0
        Request token of staging token 0 (send a request in chunks with it).
    num_tokens : int, optional
        Tokens to copy; default ``len(page_ids) * page_size - token_offset``.
    out : torch.Tensor, optional
        Contiguous tensor on the pool's device with at least ``staging_nbytes(...)`` bytes.

    Returns
    -------
    torch.Tensor
        1-D ``torch.uint8``, ``[L * num_tokens * num_heads * (k_dim + v_dim) * itemsize]``,
        laid out ``[layer][K|V][token][head][dim]`` (a view of ``out`` when given). Every
        byte of it is written.

    Raises
    ------
    ValueError
        Any bad argument (dtype, shapes, contiguity, devices, page id range, head range,
        token range, staging size); the message names the argument. Nothing is copied.
    TypeError
        ``page_size``, ``head_start`` or ``num_heads`` missing (and ``page_ids`` no ``KVSlice``).

    Examples
    --------
    >>> k = [torch.randn(64, 8, 128).bfloat16() for _ in range(2)]       # 4 pages of 16
    >>> v = [torch.randn(64, 8, 128).bfloat16() for _ in range(2)]
    >>> staging = gather_kv_heads(k, v, [3, 1], page_size=16, head_start=2, num_heads=2)
    >>> staging.numel() == staging_nbytes(2, 32, 2, 128, 128, 2)
    True
    """
    call, staging = _gather_call(
        k_buffers, v_buffers, page_ids, page_size, head_start, num_heads, layout, token_offset, num_tokens, out
    )
    _dispatch(call, staging, gather=True)
    return staging


def _gather_call(
    k_buffers, v_buffers, page_ids, page_size, head_start, num_heads, layout, token_offset, num_tokens, out
):
    """Validated arguments of a gather and its staging bytes (allocated when ``out`` is None)."""
    call = parse_call(
        k_buffers,
        v_buffers,
        page_ids,
        page_size=page_size,
        head_start=head_start,
        num_heads=num_heads,
        layout=layout,
        token_offset=token_offset,
        num_tokens=num_tokens,
        unique_pages=False,
    )
    if out is None:
        out = torch.empty(call.staging_nbytes, dtype=torch.uint8, device=call.device)
    return call, staging_bytes_view(out, "out", call)


def scatter_kv_heads(
    staging,
    k_buffers,
    v_buffers,
    page_ids,
    *,
    page_size=None,
    head_start=None,
    num_heads=None,
    layout=None,
    token_offset=None,
    num_tokens=None,
) -> None:
    """Copy a staging buffer (as written by ``gather_kv_heads``) into heads
    ``[head_start, head_start + num_heads)`` of a request's tokens in a paged KV pool.

    The pool may have another page size and layout than the gathering side: the staging is
    token-major. Only the target rows (the given tokens x the given heads x all layers, K
    and V) are written, so several writers can scatter disjoint head ranges into one pool.

    Parameters
    ----------
    staging : torch.Tensor
        Contiguous, on the pool's device, at least ``staging_nbytes(...)`` bytes, laid out
        ``[layer][K|V][token][head][dim]``.
    k_buffers, v_buffers, page_ids, page_size, head_start, num_heads, layout, token_offset,
    num_tokens
        As in ``gather_kv_heads``, for the destination pool (``page_ids`` may again be a
        ``KVSlice``, e.g. ``RequestPlan.scatter_slice``). The pages must not repeat a page
        (two tokens would race for one slot).

    Raises
    ------
    ValueError
        Any bad argument; nothing is written.
    """
    call = parse_call(
        k_buffers,
        v_buffers,
        page_ids,
        page_size=page_size,
        head_start=head_start,
        num_heads=num_heads,
        layout=layout,
        token_offset=token_offset,
        num_tokens=num_tokens,
        unique_pages=True,
    )
    _dispatch(call, staging_bytes_view(staging, "staging", call), gather=False)


def gather_kv_heads_reference(
    k_buffers,
    v_buffers,
    page_ids,
    *,
    page_size=None,
    head_start=None,
    num_heads=None,
    layout=None,
    token_offset=None,
    num_tokens=None,
    out=None,
) -> torch.Tensor:
    """``gather_kv_heads`` in plain torch indexing (any device); the ground truth of tests."""
    call, staging = _gather_call(
        k_buffers, v_buffers, page_ids, page_size, head_start, num_heads, layout, token_offset, num_tokens, out
    )
    _reference(call, staging, gather=True)
    return staging


def scatter_kv_heads_reference(
    staging,
    k_buffers,
    v_buffers,
    page_ids,
    *,
    page_size=None,
    head_start=None,
    num_heads=None,
    layout=None,
    token_offset=None,
    num_tokens=None,
) -> None:
    """``scatter_kv_heads`` in plain torch indexing (any device); the ground truth of tests."""
    call = parse_call(
        k_buffers,
        v_buffers,
        page_ids,
        page_size=page_size,
        head_start=head_start,
        num_heads=num_heads,
        layout=layout,
        token_offset=token_offset,
        num_tokens=num_tokens,
        unique_pages=True,
    )
    _reference(call, staging_bytes_view(staging, "staging", call), gather=False)


def backend_for(device) -> str:
    """``"native-cpu"``, ``"native-cuda"`` or ``"reference"``: what ops use on ``device``."""
    kind = torch.device(device).type
    lib = _library(kind)
    return f"native-{kind}" if lib is not None else "reference"


def check_native_backend(device) -> None:
    """What an engine calls at start for its KV pools' ``device``: on CUDA, the native
    library must be loaded, since the torch reference is far slower there.

    A missing library raises ``KVXferError`` when ``KVXFER_REQUIRE_NATIVE=1``, else is
    logged at ERROR once per process with the loader's reason. CPU devices pass: the
    CPU reference is a tolerable fallback and the library builds on first use.
    """
    kind = torch.device(device).type
    if kind != "cuda":
        return
    reason = _native.unavailable_reason("cuda")
    if not reason:
        return
    text = (
        f"KV pools on {device} but the native CUDA gather/scatter library is not loaded: {reason}. "
        "Staged transfers would use the much slower torch reference"
    )
    if envs.KVXFER_REQUIRE_NATIVE.get():
        raise KVXferError(f"{text}; refusing to start (KVXFER_REQUIRE_NATIVE=1)")
    if "cuda-engine" not in _warned_fallback:
        _warned_fallback.add("cuda-engine")
        logger.error("%s (set KVXFER_REQUIRE_NATIVE=1 to refuse to start instead)", text)


# ---- dispatch ----------------------------------------------------------------------------


def _library(kind: str):
    if kind == "cpu":
        return _native.cpu_library()
    if kind == "cuda":
        return _native.cuda_library()
    return None


def _dispatch(call: KVCall, staging: torch.Tensor, gather: bool) -> None:
    if call.num_tokens == 0:
        return
    kind = call.device.type
    lib = _library(kind)
    if lib is None:
        if kind not in _warned_fallback and not envs.KVXFER_DISABLE_NATIVE.get():
            _warned_fallback.add(kind)
            logger.warning(
                "no native %s gather/scatter (%s); using the torch reference",
                kind,
                _native.status().get(kind, "unsupported device"),
            )
        _reference(call, staging, gather)
    elif kind == "cpu":
        _run_cpu(lib, call, staging, gather)
    else:
        _run_cuda(lib, call, staging, gather)


def _descs(call: KVCall) -> tuple[_native.PoolDesc, _native.SliceDesc]:
    pool = _native.PoolDesc(
        num_layers=call.num_layers,
        num_kv=call.num_kv,
        num_pages=call.num_pages,
        page_size=call.page_size,
        pool_heads=call.pool_heads,
        itemsize=call.itemsize,
        k_row_bytes=call.k_dim * call.itemsize,
        v_row_bytes=call.v_dim * call.itemsize,
        layout=_native.LAYOUT_CODES[call.layout],
        reserved=0,
    )
    sl = _native.SliceDesc(
        head_start=call.head_start,
        num_heads=call.num_heads,
        token_offset=call.token_offset,
        num_tokens=call.num_tokens,
        num_page_ids=int(call.page_ids.shape[0]),
    )
    return pool, sl


def _cpu_threads(nbytes: int) -> int:
    configured = envs.KVXFER_CPU_THREADS.get()
    if configured:
        return min(configured, _MAX_THREADS)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, nbytes // _MIN_BYTES_PER_THREAD, _MAX_THREADS))


def _run_cpu(
    lib: _native.Library, call: KVCall, staging: torch.Tensor, gather: bool, streaming_min_bytes: int = -1
) -> None:
    pool, sl = _descs(call)
    ptrs = np.array(call.layer_ptrs(), dtype=np.uint64)
    name = "kvxfer_gather_cpu" if gather else "kvxfer_scatter_cpu"
    code = getattr(lib.handle, name)(
        pool,
        ptrs.ctypes.data,
        call.page_ids.ctypes.data,
        sl,
        staging.data_ptr(),
        staging.numel(),
        _cpu_threads(call.staging_nbytes),
        streaming_min_bytes,
    )
    _native.check_status(lib, code, name)


def _cuda_table(call: KVCall) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(pointer alignment, device table, device page ids) of a call, uploaded on the current
    stream: one host->device copy of the layer pointers, plus the page ids when they come
    from the host. Pinned + non_blocking keeps the stream asynchronous; torch's allocators
    keep both buffers alive until the stream has consumed them."""
    ptrs = call.layer_ptrs()
    # Largest power of two (<= 16) dividing every layer pointer: bounds the vector width.
    align = 16
    for p in ptrs:
        align = math.gcd(align, p)
    host_ids = None if isinstance(call.page_ids, torch.Tensor) else call.page_ids
    packed = np.asarray(ptrs, dtype=np.uint64).view(np.int64)
    if host_ids is not None:
        packed = np.concatenate([packed, host_ids])
    table = torch.from_numpy(packed).pin_memory().to(call.device, non_blocking=True)
    dev_ids = call.page_ids if host_ids is None else table[len(ptrs) :]
    return align, table, dev_ids


def _launch_cuda(
    lib, call: KVCall, staging: torch.Tensor, gather: bool, align: int, table, dev_ids, descs=None
) -> None:
    pool, sl = descs or _descs(call)
    name = "kvxfer_gather_cuda" if gather else "kvxfer_scatter_cuda"
    with torch.cuda.device(call.device):
        code = getattr(lib.handle, name)(
            pool,
            table.data_ptr(),
            align,
            dev_ids.data_ptr(),
            sl,
            staging.data_ptr(),
            staging.numel(),
            torch.cuda.current_stream(call.device).cuda_stream,
        )
    _native.check_status(lib, code, name)


def _run_cuda(lib: _native.Library, call: KVCall, staging: torch.Tensor, gather: bool) -> None:
    with torch.cuda.device(call.device):
        align, table, dev_ids = _cuda_table(call)
        _launch_cuda(lib, call, staging, gather, align, table, dev_ids)


def cuda_kernel_launcher(staging, k_buffers, v_buffers, page_ids, *, gather: bool, **slice_fields):
    """A benchmark's view of the CUDA kernel alone: validate once, upload the pointer table
    and the page ids once, and return a callable that only launches the gather (``gather``)
    or scatter kernel on the current stream (no checks, no host sort, no upload, no sync).

    Arguments are those of ``gather_kv_heads`` (``staging`` as its ``out``) or
    ``scatter_kv_heads``; the callable holds the table and the buffers. Raises
    ``KVXferError`` where the native CUDA library is not loaded (``KVXferError`` names why).
    """
    call = parse_call(k_buffers, v_buffers, page_ids, unique_pages=not gather, **slice_fields)
    if call.device.type != "cuda":
        raise ValueError(f"cuda_kernel_launcher needs CUDA buffers, got {call.device}")
    lib = _native.cuda_library()
    if lib is None:
        raise KVXferError(f"the native CUDA library is not loaded: {_native.unavailable_reason('cuda')}")
    view = staging_bytes_view(staging, "out" if gather else "staging", call)
    with torch.cuda.device(call.device):
        align, table, dev_ids = _cuda_table(call)
    descs = _descs(call)
    return lambda: _launch_cuda(lib, call, view, gather, align, table, dev_ids, descs)


# ---- reference ---------------------------------------------------------------------------


def _reference(call: KVCall, staging: torch.Tensor, gather: bool) -> None:
    """Bitwise copies through integer views, so NaN payloads and fp8 survive unchanged."""
    if call.num_tokens == 0:
        return
    if staging.storage_offset() % call.itemsize:
        # Integer views need itemsize-aligned offsets: work on an aligned copy.
        aligned = staging.clone()
        _reference(call, aligned, gather)
        if gather:
            staging.copy_(aligned)
        return
    dev = call.device
    ids = torch.as_tensor(call.page_ids, dtype=torch.int64, device=dev)
    tokens = torch.arange(call.token_offset, call.token_offset + call.num_tokens, device=dev)
    pages = ids[tokens // call.page_size][:, None]  # [T, 1]
    slots = (tokens % call.page_size)[:, None]  # [T, 1]
    heads = torch.arange(call.head_start, call.head_start + call.num_heads, device=dev)[None, :]
    int_type = _INT_OF_SIZE[call.itemsize]
    offset = 0
    for layer in range(call.num_layers):
        for kv in range(call.num_kv):
            dim = call.k_dim if kv == 0 else call.v_dim
            nbytes = call.num_tokens * call.num_heads * dim * call.itemsize
            block = staging[offset : offset + nbytes].view(int_type).view(call.num_tokens, call.num_heads, dim)
            index: tuple[torch.Tensor | int, ...]
            if call.layout == "HND_KV":  # [pages, heads, K|V, page_size, dim], one per layer
                buffer = call.layers[layer].view(int_type)
                index = (pages, heads, kv, slots)  # -> [T, n, dim]
            else:
                buffer = call.layers[kv * call.num_layers + layer].view(int_type)
                if call.layout == "NHD":
                    index = (pages * call.page_size + slots, heads)  # -> [T, n, dim]
                else:
                    index = (pages, heads, slots)  # -> [T, n, dim]
            if gather:
                block.copy_(buffer[index])
            else:
                buffer[index] = block
            offset += nbytes
