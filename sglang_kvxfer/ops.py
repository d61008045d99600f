"""Gather and scatter of KV head slices between paged KV pools and a contiguous staging buffer.

Owns the public ops ``gather_kv_heads`` (pool pages -> staging), ``scatter_kv_heads``
(staging -> pool pages) and ``copy_kv_heads`` (pool pages -> pool pages in one pass, the two
fused, for a destination pool mapped in this process), their pure-torch references, and
``staging_nbytes``. The staged
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
On CUDA a pool's layer pointer table is uploaded once and kept on the device, by device
and pointers (``_DeviceTables``); a call uploads only host page ids.
Must not: import at package import time (torch is heavy), or let a bad argument reach
native code: ``_ops_args`` validates everything first and raises ``ValueError``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import threading
from collections import OrderedDict

import numpy as np
import torch

from sglang_kvxfer import _native, envs
from sglang_kvxfer._ops_args import KVCall, parse_call, staging_bytes_view, staging_nbytes
from sglang_kvxfer.errors import KVXferError
from sglang_kvxfer.planning.kvslice import KVSlice

__all__ = [
    "gather_kv_heads",
    "scatter_kv_heads",
    "copy_kv_heads",
    "gather_kv_heads_reference",
    "scatter_kv_heads_reference",
    "copy_kv_heads_reference",
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
    k_dim=None,
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
        (page, head) tile is K ``[page_size, dim]`` then V ``[page_size, dim]``. NHD_KV: the
        per-layer K and V buffers ``[num_pages, page_size, pool_heads, k_dim + v_dim]`` (vLLM's
        GPU cache, token-major): each (token, head) row is K ``[k_dim]`` then V ``[v_dim]``.
    v_buffers : sequence of L torch.Tensor, or None
        Per-layer V buffers shaped like ``k_buffers`` but with ``v_dim`` last. None for MLA
        (one buffer per layer): the staging then has no V blocks. HND_KV, NHD_KV: None (or an
        empty sequence); V comes from ``k_buffers`` and the staging has V blocks.
    page_ids : list, numpy array or int32/int64 tensor, ``[num_page_ids]``; or a ``KVSlice``
        The request's pages, in token order. Each in ``[0, num_pages)``. A
        ``sglang_kvxfer.planning.KVSlice`` (what ``RequestPlan.gather_slice`` returns)
        carries the pages and every slice field below, which must then be left out.
    page_size : int
        Tokens per page of this pool (required unless ``page_ids`` is a ``KVSlice``).
    head_start, num_heads : int
        The pool heads to copy (required unless ``page_ids`` is a ``KVSlice``).
    layout : {"NHD", "HND", "HND_KV", "NHD_KV"}, default "NHD"
    token_offset : int, default 0
        Request token of staging token 0 (send a request in chunks with it).
    num_tokens : int, optional
        Tokens to copy; default ``len(page_ids) * page_size - token_offset``.
    out : torch.Tensor, optional
        Contiguous tensor on the pool's device with at least ``staging_nbytes(...)`` bytes.
    k_dim : int, optional
        NHD_KV only: the K part of a row (default: half of it, ``v_dim == k_dim``).

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
    call, staging = _gather_call(**locals())
    _dispatch(call, staging, gather=True)
    return staging


def _gather_call(k_buffers, v_buffers, page_ids, out=None, **slice_fields) -> tuple[KVCall, torch.Tensor]:
    """Validated arguments of a gather and its staging bytes (allocated when ``out`` is None)."""
    call = parse_call(k_buffers, v_buffers, page_ids, unique_pages=False, **slice_fields)
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
    k_dim=None,
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
    num_tokens, k_dim
        As in ``gather_kv_heads``, for the destination pool (``page_ids`` may again be a
        ``KVSlice``, e.g. ``RequestPlan.scatter_slice``). The pages must not repeat a page
        (two tokens would race for one slot).

    Raises
    ------
    ValueError
        Any bad argument; nothing is written.
    """
    _dispatch(*_scatter_call(**locals()), gather=False)


def _scatter_call(staging, k_buffers, v_buffers, page_ids, **slice_fields) -> tuple[KVCall, torch.Tensor]:
    """Validated arguments of a scatter and the staging's bytes."""
    call = parse_call(k_buffers, v_buffers, page_ids, unique_pages=True, **slice_fields)
    return call, staging_bytes_view(staging, "staging", call)


def _arguments_of(op, args, kwargs) -> dict:
    """``args`` and ``kwargs`` bound as the arguments of ``op`` (a TypeError as ``op`` would
    raise it where they do not fit), defaults applied."""
    bound = inspect.signature(op).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _takes_arguments_of(op):
    """Turns ``impl(arguments: dict)`` into a function with ``op``'s signature: a torch
    reference takes exactly what its op takes, bound the same way."""

    def wrap(impl):
        @functools.wraps(impl)
        def twin(*args, **kwargs):
            return impl(_arguments_of(op, args, kwargs))

        twin.__signature__ = inspect.signature(op)
        return twin

    return wrap


@_takes_arguments_of(gather_kv_heads)
def gather_kv_heads_reference(arguments: dict) -> torch.Tensor:
    """``gather_kv_heads`` in plain torch indexing (any device); the ground truth of tests."""
    call, staging = _gather_call(**arguments)
    _reference(call, staging, gather=True)
    return staging


@_takes_arguments_of(scatter_kv_heads)
def scatter_kv_heads_reference(arguments: dict) -> None:
    """``scatter_kv_heads`` in plain torch indexing (any device); the ground truth of tests."""
    _reference(*_scatter_call(**arguments), gather=False)


def copy_kv_heads(
    src_k_buffers,
    src_v_buffers,
    src_page_ids,
    dst_k_buffers,
    dst_v_buffers,
    dst_page_ids,
    *,
    num_heads=None,
    num_tokens=None,
    src_page_size=None,
    src_head_start=None,
    src_layout=None,
    src_token_offset=None,
    src_k_dim=None,
    dst_page_size=None,
    dst_head_start=None,
    dst_layout=None,
    dst_token_offset=None,
    dst_k_dim=None,
) -> None:
    """Copy heads of a request's tokens, in all layers, from one paged KV pool straight into
    another: what ``gather_kv_heads`` on the source then ``scatter_kv_heads`` on the
    destination do, in one pass and without a staging buffer.

    For a destination pool mapped in the caller's address space (shared memory on one host,
    CUDA IPC on one device): one read and one write of every byte instead of two of each.
    Layouts, page sizes, pool heads, head starts and token offsets may differ between the
    two sides (NHD <-> HND <-> HND_KV <-> NHD_KV, TP head slices); the dtype, layer count and
    head dims must agree.

    Parameters
    ----------
    src_k_buffers, src_v_buffers, src_page_ids
        The source pool and its request's pages, as ``k_buffers``, ``v_buffers`` and
        ``page_ids`` of ``gather_kv_heads`` (``src_page_ids`` may be a ``KVSlice``, e.g.
        ``StagedPlan.gather_slice()``; then no ``src_*`` slice keyword).
    dst_k_buffers, dst_v_buffers, dst_page_ids
        The destination pool, as in ``scatter_kv_heads`` (``dst_page_ids`` may be a
        ``KVSlice``, e.g. ``StagedPlan.scatter_slice()``). Its pages must not repeat.
    num_heads, num_tokens : int
        Heads and tokens to copy, the same on both sides (taken from the ``KVSlice`` when
        one is given; ``num_tokens`` defaults as in ``gather_kv_heads``, and both sides'
        defaults must then agree).
    src_page_size, src_head_start, src_layout, src_token_offset, src_k_dim
        The source side's slice fields (``page_size``, ``head_start``, ... of
        ``gather_kv_heads``): request token ``src_token_offset + i`` is copied into request
        token ``dst_token_offset + i`` of the destination.
    dst_page_size, dst_head_start, dst_layout, dst_token_offset, dst_k_dim
        The destination side's.

    Raises
    ------
    ValueError
        Any bad argument on either side (as gather/scatter), or a field the two sides must
        share that differs (named, with both values); nothing is copied.
    """
    src, dst = _copy_calls(locals())
    _dispatch_copy(src, dst)


@_takes_arguments_of(copy_kv_heads)
def copy_kv_heads_reference(arguments: dict) -> None:
    """``copy_kv_heads`` as the torch reference gather into a staging buffer, then the torch
    reference scatter of it (any device); the ground truth of tests."""
    _copy_reference(*_copy_calls(arguments))


def _copy_side(args: dict, side: str, unique: bool) -> KVCall:
    page_ids = args[f"{side}_page_ids"]
    fields = ("page_size", "head_start", "layout", "token_offset")
    if isinstance(page_ids, KVSlice):
        extra = [f"{side}_{f}" for f in fields if args[f"{side}_{f}"] is not None]
        if extra:
            raise ValueError(
                f"{side}_page_ids is a KVSlice, which holds the whole slice; do not also pass {', '.join(extra)}"
            )
        kw: dict = {}
    else:
        kw = {f: args[f"{side}_{f}"] for f in fields}
        kw.update(num_heads=args["num_heads"], num_tokens=args["num_tokens"])
        if kw["page_size"] is None or kw["head_start"] is None or kw["num_heads"] is None:
            missing = [n for n in (f"{side}_page_size", f"{side}_head_start") if args[n] is None]
            missing += ["num_heads"] if args["num_heads"] is None else []
            raise TypeError(f"missing required keyword argument(s): {', '.join(missing)} (or pass a KVSlice)")
    try:
        return parse_call(
            args[f"{side}_k_buffers"],
            args[f"{side}_v_buffers"],
            page_ids,
            unique_pages=unique,
            k_dim=args[f"{side}_k_dim"],
            **kw,
        )
    except ValueError as exc:
        raise ValueError(f"{side}: {exc}") from None


def _copy_calls(args: dict) -> tuple[KVCall, KVCall]:
    """Both sides of a pool -> pool copy, validated, and what they must share."""
    src = _copy_side(args, "src", unique=False)
    dst = _copy_side(args, "dst", unique=True)
    for name, want in (("num_heads", args["num_heads"]), ("num_tokens", args["num_tokens"])):
        for side, call in (("src", src), ("dst", dst)):
            if want is not None and getattr(call, name) != want:
                raise ValueError(f"{name}={want} but the {side} KVSlice moves {getattr(call, name)}")
    pairs = [
        ("device", src.device, dst.device),
        ("dtype", src.layers[0].dtype, dst.layers[0].dtype),
        ("num_layers", src.num_layers, dst.num_layers),
        ("num_kv (K and V, or MLA's one buffer)", src.num_kv, dst.num_kv),
        ("k_dim", src.k_dim, dst.k_dim),
        ("v_dim", src.v_dim, dst.v_dim),
        ("num_heads", src.num_heads, dst.num_heads),
        ("num_tokens", src.num_tokens, dst.num_tokens),
    ]
    for name, a, b in pairs:
        if a != b:
            hint = "; pass num_tokens" if name == "num_tokens" and args["num_tokens"] is None else ""
            raise ValueError(f"{name} differs: src {a}, dst {b}{hint}")
    return src, dst


def _copy_reference(src: KVCall, dst: KVCall) -> None:
    staging = torch.empty(src.staging_nbytes, dtype=torch.uint8, device=src.device)
    _reference(src, staging, gather=True)
    _reference(dst, staging, gather=False)


def _warn_fallback(kind: str, what: str) -> None:
    """Says once per device kind (unless native code is disabled on purpose) that the torch
    reference stands in for the native ``what``."""
    if kind not in _warned_fallback and not envs.KVXFER_DISABLE_NATIVE.get():
        _warned_fallback.add(kind)
        logger.warning(
            "no native %s %s (%s); using the torch reference",
            kind,
            what,
            _native.status().get(kind, "unsupported device"),
        )


def _dispatch_copy(src: KVCall, dst: KVCall) -> None:
    if src.num_tokens == 0:
        return
    kind = src.device.type
    lib = _library(kind)
    if lib is None:
        _warn_fallback(kind, "copy")
        _copy_reference(src, dst)
    elif kind == "cpu":
        _run_copy_cpu(lib, src, dst)
    else:
        with torch.cuda.device(src.device):
            _launch_copy_cuda(lib, src, dst, *_cuda_copy_table(src, dst))


def _run_copy_cpu(lib: _native.Library, src: KVCall, dst: KVCall, streaming_min_bytes: int = -1) -> None:
    src_pool, src_sl = _descs(src)
    dst_pool, dst_sl = _descs(dst)
    src_ptrs = np.array(src.layer_ptrs(), dtype=np.uint64)
    dst_ptrs = np.array(dst.layer_ptrs(), dtype=np.uint64)
    code = lib.handle.kvxfer_copy_cpu(
        src_pool,
        src_ptrs.ctypes.data,
        src.page_ids.ctypes.data,
        src_sl,
        dst_pool,
        dst_ptrs.ctypes.data,
        dst.page_ids.ctypes.data,
        dst_sl,
        _cpu_threads(src.staging_nbytes),
        streaming_min_bytes,
    )
    _native.check_status(lib, code, "kvxfer_copy_cpu")


class _DeviceTables:
    """Layer pointer tables kept on their device, by (device, pointers): a pool's table goes
    up once, not on every call. A table is made with a blocking copy (every stream sees it
    after), never written again, and marked in use by each stream that launches with it
    (``record_stream``), so dropping it from the cache (the oldest of ``MAX``) frees its
    memory only after those launches ran. The same pointers on the same device always give
    the same table, whoever owns the memory now, so an entry cannot go stale."""

    MAX = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tables: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def get(self, device: torch.device, ptrs: list[int]) -> torch.Tensor:
        key = (device.index, tuple(ptrs))
        with self._lock:
            table = self._tables.get(key)
            if table is not None:
                self._tables.move_to_end(key)
        if table is None:
            table = torch.from_numpy(np.asarray(ptrs, dtype=np.uint64).view(np.int64)).to(device)
            with self._lock:
                self._tables[key] = table
                while len(self._tables) > self.MAX:
                    self._tables.popitem(last=False)
        table.record_stream(torch.cuda.current_stream(device))
        return table


_device_tables = _DeviceTables()


def _alignment(ptrs: list[int]) -> int:
    """Largest power of two (<= 16) dividing every layer pointer: bounds the vector width."""
    align = 16
    for p in ptrs:
        align = math.gcd(align, p)
    return align


def _device_ids(calls: tuple[KVCall, ...]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Each call's page ids on its device: ids already there as they are, host ids in one
    pinned host -> device copy on the current stream (returned too, to keep it alive)."""
    host = [c.page_ids for c in calls if not isinstance(c.page_ids, torch.Tensor)]
    upload = None
    if host:
        upload = torch.from_numpy(np.concatenate(host)).pin_memory().to(calls[0].device, non_blocking=True)
    out, at = [], 0
    for call in calls:
        if isinstance(call.page_ids, torch.Tensor):
            out.append(call.page_ids)
        else:
            assert upload is not None
            out.append(upload[at : at + len(call.page_ids)])
            at += len(call.page_ids)
    return out, upload


def _cuda_copy_table(src: KVCall, dst: KVCall):
    """(alignment, page ids upload, src table, dst table, src ids, dst ids): both pointer
    tables from the device cache, any host page ids in one pinned copy on the current stream."""
    src_ptrs, dst_ptrs = src.layer_ptrs(), dst.layer_ptrs()
    (src_ids, dst_ids), upload = _device_ids((src, dst))
    src_table, dst_table = _device_tables.get(src.device, src_ptrs), _device_tables.get(dst.device, dst_ptrs)
    return _alignment(src_ptrs + dst_ptrs), upload, src_table, dst_table, src_ids, dst_ids


def _launch_copy_cuda(lib, src: KVCall, dst: KVCall, align, table, src_table, dst_table, src_ids, dst_ids) -> None:
    src_pool, src_sl = _descs(src)
    dst_pool, dst_sl = _descs(dst)
    code = lib.handle.kvxfer_copy_cuda(
        src_pool,
        src_table.data_ptr(),
        src_ids.data_ptr(),
        src_sl,
        dst_pool,
        dst_table.data_ptr(),
        dst_ids.data_ptr(),
        dst_sl,
        align,
        torch.cuda.current_stream(src.device).cuda_stream,
    )
    _native.check_status(lib, code, "kvxfer_copy_cuda")


def cuda_copy_launcher(*args, **kwargs):
    """``cuda_kernel_launcher`` for ``copy_kv_heads``: validate once, upload both tables and
    page ids once, return a callable that only launches the pool -> pool kernel on the
    current stream. Arguments are those of ``copy_kv_heads``."""
    src, dst = _copy_calls(_arguments_of(copy_kv_heads, args, kwargs))
    if src.device.type != "cuda":
        raise ValueError(f"cuda_copy_launcher needs CUDA buffers, got {src.device}")
    lib = _native.cuda_library()
    if lib is None:
        raise KVXferError(f"the native CUDA library is not loaded: {_native.unavailable_reason('cuda')}")
    with torch.cuda.device(src.device):
        uploaded = _cuda_copy_table(src, dst)
    return lambda: _launch_copy_cuda(lib, src, dst, *uploaded)


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
        _warn_fallback(kind, "gather/scatter")
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
    """(pointer alignment, device table, device page ids) of a call: the layer pointers from
    the device cache (uploaded once per pool), the page ids uploaded on the current stream
    when they come from the host. Pinned + non_blocking keeps the stream asynchronous;
    torch's allocators keep the upload alive until the stream has consumed it."""
    ptrs = call.layer_ptrs()
    (dev_ids,), _ = _device_ids((call,))
    return _alignment(ptrs), _device_tables.get(call.device, ptrs), dev_ids


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
    ids = call.page_ids
    if isinstance(ids, np.ndarray) and not ids.flags.writeable:
        ids = ids.copy()  # torch warns on a read-only array (a plan's slice); this path only reads it
    ids = torch.as_tensor(ids, dtype=torch.int64, device=dev)
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
            index: tuple[torch.Tensor | int | slice, ...]
            if call.layout == "HND_KV":  # [pages, heads, K|V, page_size, dim], one per layer
                buffer = call.layers[layer].view(int_type)
                index = (pages, heads, kv, slots)  # -> [T, n, dim]
            elif call.layout == "NHD_KV":  # [pages, page_size, heads, k_dim + v_dim], one per layer
                buffer = call.layers[layer].view(int_type)
                part = slice(0, call.k_dim) if kv == 0 else slice(call.k_dim, call.k_dim + call.v_dim)
                index = (pages, slots, heads, part)  # -> [T, n, dim]
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
