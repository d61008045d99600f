"""Argument checks of ``sglang_kvxfer.ops``: everything is validated here, before any copy.

Owns: turning the public arguments of ``gather_kv_heads`` / ``scatter_kv_heads`` (a
``KVSlice`` from a plan, or the same fields as keywords) into one frozen ``KVCall`` (the
layer list, geometry, slice, page ids and staging size), and
checking a staging tensor against it. Every rejection is a ``ValueError`` whose message
names the argument and the offending value(s); nothing is copied before all checks pass.
A list of layer tensors that passed the per-layer checks is remembered by the identity of
its tensors (weak references, a few dozen lists): the same tensors at the same addresses
skip those checks on the next call (an engine passes its pool's tensors on every call; on
32 layers the checks cost 0.1 ms a call on a 2-vCPU VM). Anything else is checked again.
Must not: copy KV bytes, call native code, or synchronize a GPU except to range-check page
ids that already live on it.
"""

from __future__ import annotations

import numbers
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sglang_kvxfer.geometry import Layout
from sglang_kvxfer.planning.kvslice import KVSlice

__all__ = ["KVCall", "parse_call", "slice_fields", "staging_bytes_view", "staging_nbytes"]

_ITEMSIZES = (1, 2, 4)
_HND_KV = Layout.HND_KV.value
_NHD_KV = Layout.NHD_KV.value
_FORMS = {
    "NHD": "[num_pages * page_size, heads, head_dim]",
    "HND": "[num_pages, heads, page_size, head_dim]",
    _HND_KV: "[num_pages, heads, page_size, 2 * head_dim] (vLLM's shape) or [num_pages, heads, 2, page_size, head_dim]",
    _NHD_KV: "[num_pages, page_size, heads, k_dim + v_dim]",
}


@dataclass(frozen=True)
class KVCall:
    """One validated gather or scatter. ``layers`` is K of every layer, then V of every layer
    (HND_KV: the L per-layer K-and-V tensors, viewed ``[num_pages, heads, 2, page_size, dim]``;
    NHD_KV: the L per-layer ``[num_pages, page_size, heads, k_dim + v_dim]`` tensors;
    ``layer_ptrs`` gives the kernels' K and V pointers of every layout)."""

    layers: tuple[torch.Tensor, ...]
    num_layers: int
    num_kv: int  # 2 (K and V) or 1 (MLA)
    layout: str  # "NHD", "HND", "HND_KV" or "NHD_KV"
    device: torch.device
    itemsize: int
    num_pages: int
    page_size: int
    pool_heads: int
    k_dim: int
    v_dim: int  # 0 when num_kv == 1
    head_start: int
    num_heads: int
    token_offset: int
    num_tokens: int
    page_ids: Any  # np.ndarray[int64] on the host, or an int64 tensor on the pool's GPU
    staging_nbytes: int
    ptrs: tuple[int, ...] = field(default=(), repr=False)  # data_ptr of each of ``layers``

    def layer_ptrs(self) -> list[int]:
        """The native kernels' pointer table: K of every layer, then V of every layer. An
        HND_KV layer's V pointer is its K pointer + ``page_size`` K rows, an NHD_KV layer's
        its K pointer + one K row (csrc/kvxfer.h)."""
        ptrs = list(self.ptrs) if self.ptrs else [t.data_ptr() for t in self.layers]
        if self.layout in (_HND_KV, _NHD_KV):
            rows = self.page_size if self.layout == _HND_KV else 1
            v_shift = rows * self.k_dim * self.itemsize
            ptrs += [p + v_shift for p in ptrs]
        return ptrs


def staging_nbytes(
    num_layers: int, num_tokens: int, num_heads: int, k_dim: int, v_dim: int | None, itemsize: int
) -> int:
    """Bytes of a staging buffer: ``num_layers * num_tokens * num_heads * (k_dim + v_dim) * itemsize``.

    ``v_dim`` is 0 or None for MLA (one buffer per layer, no V block).
    """
    _int("num_layers", num_layers, 1)
    _int("num_tokens", num_tokens, 0)
    _int("num_heads", num_heads, 1)
    _int("k_dim", k_dim, 1)
    v = 0 if v_dim is None else _int("v_dim", v_dim, 0)
    if itemsize not in _ITEMSIZES or isinstance(itemsize, bool):
        raise ValueError(f"itemsize={itemsize!r} must be 1, 2 or 4")
    return num_layers * num_tokens * num_heads * (k_dim + v) * itemsize


def slice_fields(
    page_ids, page_size=None, head_start=None, num_heads=None, layout=None, token_offset=None, num_tokens=None
) -> dict[str, Any]:
    """The slice keywords of one op call: a ``KVSlice``'s fields, or the keywords given.

    A ``KVSlice`` passed as ``page_ids`` carries the whole slice, so passing any slice
    keyword with it is a ``ValueError``; without one, ``page_size``, ``head_start`` and
    ``num_heads`` are required (``TypeError``, as for any missing argument).
    """
    given = {
        "page_size": page_size,
        "head_start": head_start,
        "num_heads": num_heads,
        "layout": layout,
        "token_offset": token_offset,
        "num_tokens": num_tokens,
    }
    if isinstance(page_ids, KVSlice):
        extra = [name for name, value in given.items() if value is not None]
        if extra:
            raise ValueError(f"page_ids is a KVSlice, which holds the whole slice; do not also pass {', '.join(extra)}")
        return page_ids.op_kwargs()
    missing = [name for name in ("page_size", "head_start", "num_heads") if given[name] is None]
    if missing:
        raise TypeError(f"missing required keyword argument(s): {', '.join(missing)} (or pass a KVSlice as page_ids)")
    given["page_ids"] = page_ids
    given["layout"] = "NHD" if layout is None else layout
    given["token_offset"] = 0 if token_offset is None else token_offset
    return given


def parse_call(
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
    unique_pages: bool,
    k_dim=None,
) -> KVCall:
    """Validates every argument of a gather/scatter and returns the resolved ``KVCall``.
    ``page_ids`` may be a ``KVSlice`` (then no other slice keyword). ``k_dim``: NHD_KV only,
    the K part of the last dim (default: half of it, ``v_dim == k_dim``)."""
    f = slice_fields(page_ids, page_size, head_start, num_heads, layout, token_offset, num_tokens)
    page_ids, page_size, head_start, num_heads = f["page_ids"], f["page_size"], f["head_start"], f["num_heads"]
    layout, token_offset, num_tokens = f["layout"], f["token_offset"], f["num_tokens"]
    lay = str(Layout.parse(layout))
    page_size = _int("page_size", page_size, 1)
    k_layers = _layer_list(k_buffers, "k_buffers")
    ref = k_layers[0]
    ptrs = _checked_layers(k_layers, "k_buffers", ref, lay)
    num_pages, pool_heads, last_dim = _pool_shape(ref, "k_buffers[0]", lay, page_size)
    layers, v_dim, k_dim_given = list(k_layers), 0, k_dim
    k_dim = last_dim
    if k_dim_given is not None and lay != _NHD_KV:
        raise ValueError(f"k_dim={k_dim_given!r} is only for layout NHD_KV (K and V share a row); layout is {lay}")
    if lay in (_HND_KV, _NHD_KV):
        # One buffer per layer holds K and V: no V list (an engine's ``buffers[L:]`` is empty).
        if v_buffers is not None and not (isinstance(v_buffers, (list, tuple)) and len(v_buffers) == 0):
            what = f"{len(v_buffers)} tensor(s)" if isinstance(v_buffers, (list, tuple)) else type(v_buffers).__name__
            raise ValueError(
                f"v_buffers is {what} but layout {lay} keeps V in the k_buffers tensors; pass v_buffers=None"
            )
        if lay == _HND_KV:
            layers = [t.view(num_pages, pool_heads, 2, page_size, k_dim) for t in k_layers]
            v_dim = k_dim
        else:
            k_dim, v_dim = _split_row(last_dim, k_dim_given)
    elif v_buffers is not None:
        v_layers = _layer_list(v_buffers, "v_buffers")
        if len(v_layers) != len(k_layers):
            raise ValueError(f"v_buffers has {len(v_layers)} layers but k_buffers has {len(k_layers)}")
        ptrs += _checked_layers(v_layers, "v_buffers", v_layers[0], lay)
        v0 = v_layers[0]
        if v0.dtype != ref.dtype or v0.device != ref.device:
            raise ValueError(f"v_buffers are {v0.dtype} on {v0.device} but k_buffers are {ref.dtype} on {ref.device}")
        if tuple(v0.shape[:-1]) != tuple(ref.shape[:-1]):
            raise ValueError(
                f"v_buffers[0] has shape {tuple(v0.shape)}, which must match "
                f"k_buffers[0] {tuple(ref.shape)} in all but the last (head_dim) "
                "dimension"
            )
        v_dim = int(v0.shape[-1])
        if v_dim < 1:
            raise ValueError(f"v_buffers[0] has head_dim {v_dim}; it must be >= 1")
        layers += v_layers
    head_start = _int("head_start", head_start, 0)
    num_heads = _int("num_heads", num_heads, 1)
    if head_start + num_heads > pool_heads:
        raise ValueError(
            f"heads [head_start={head_start}, head_start + num_heads="
            f"{head_start + num_heads}) are outside the pool's {pool_heads} heads"
        )
    ids = _page_ids(page_ids, ref.device, num_pages, unique_pages)
    capacity = int(ids.shape[0]) * page_size
    token_offset = _int("token_offset", token_offset, 0)
    if token_offset > capacity:
        raise ValueError(
            f"token_offset={token_offset} is beyond the {capacity} tokens of "
            f"{ids.shape[0]} page ids x page_size {page_size}"
        )
    if num_tokens is None:
        num_tokens = capacity - token_offset
    num_tokens = _int("num_tokens", num_tokens, 0)
    if token_offset + num_tokens > capacity:
        raise ValueError(
            f"token_offset={token_offset} + num_tokens={num_tokens} exceeds the "
            f"{capacity} tokens of {ids.shape[0]} page ids x page_size {page_size}"
        )
    num_layers = len(k_layers)
    return KVCall(
        layers=tuple(layers),
        num_layers=num_layers,
        num_kv=2 if v_dim else 1,
        layout=lay,
        device=ref.device,
        itemsize=ref.element_size(),
        num_pages=num_pages,
        page_size=page_size,
        pool_heads=pool_heads,
        k_dim=k_dim,
        v_dim=v_dim,
        head_start=head_start,
        num_heads=num_heads,
        token_offset=token_offset,
        num_tokens=num_tokens,
        page_ids=ids,
        staging_nbytes=staging_nbytes(num_layers, num_tokens, num_heads, k_dim, v_dim, ref.element_size()),
        ptrs=ptrs,  # a view of an HND_KV layer starts where its tensor does
    )


def _split_row(row: int, k_dim) -> tuple[int, int]:
    """(k_dim, v_dim) of an NHD_KV row of ``row`` elements."""
    if k_dim is None:
        if row % 2:
            raise ValueError(
                f"k_buffers[0] has a last dim of {row}, odd: layout NHD_KV rows are k_dim + v_dim; pass k_dim= "
                "when v_dim differs from k_dim"
            )
        return row // 2, row // 2
    k_dim = _int("k_dim", k_dim, 1)
    if k_dim >= row:
        raise ValueError(f"k_dim={k_dim} must be smaller than the NHD_KV row of {row} (k_dim + v_dim, v_dim >= 1)")
    return k_dim, row - k_dim


def staging_bytes_view(staging, name: str, call: KVCall) -> torch.Tensor:
    """The first ``call.staging_nbytes`` bytes of ``staging`` as a 1-D uint8 view."""
    if not isinstance(staging, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(staging).__name__}")
    if staging.device != call.device:
        raise ValueError(f"{name} is on {staging.device} but the KV buffers are on {call.device}")
    if not staging.is_contiguous():
        raise ValueError(f"{name} must be contiguous (shape {tuple(staging.shape)}, strides {staging.stride()})")
    nbytes = staging.numel() * staging.element_size()
    if nbytes < call.staging_nbytes:
        raise ValueError(f"{name} holds {nbytes} bytes but the slice needs {call.staging_nbytes} (see staging_nbytes)")
    return staging.reshape(-1).view(torch.uint8)[: call.staging_nbytes]


def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}={value!r} must be an integer")
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return int(value)


def _layer_list(buffers, name: str) -> list[torch.Tensor]:
    if isinstance(buffers, torch.Tensor):
        if buffers.dim() < 1:
            raise ValueError(f"{name} is a 0-d tensor; pass one tensor per layer")
        return list(buffers.unbind(0))  # a [num_layers, ...] stack
    if not isinstance(buffers, (list, tuple)):
        raise ValueError(f"{name} must be a list of per-layer tensors, got {type(buffers).__name__}")
    if not buffers:
        raise ValueError(f"{name} is empty; pass one tensor per layer")
    for i, t in enumerate(buffers):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}[{i}] is a {type(t).__name__}, not a torch.Tensor")
    return list(buffers)


class _Checked:
    """Layer lists that passed ``_check_layers``, by the identity of their tensors and the
    layout: weak references (a cached list keeps no pool alive) and the data pointers
    they had. A hit needs the very same tensor objects, alive, at the same addresses."""

    MAX = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lists: OrderedDict[tuple, tuple[tuple[weakref.ref, ...], tuple[int, ...]]] = OrderedDict()

    def hit(self, key: tuple, layers: list[torch.Tensor], ptrs: tuple[int, ...]) -> bool:
        with self._lock:
            entry = self._lists.get(key)
            if entry is not None:
                self._lists.move_to_end(key)
        if entry is None or entry[1] != ptrs:
            return False
        return all(r() is t for r, t in zip(entry[0], layers))

    def add(self, key: tuple, layers: list[torch.Tensor], ptrs: tuple[int, ...]) -> None:
        try:
            refs = tuple(weakref.ref(t) for t in layers)
        except TypeError:  # a tensor subclass without weak references: not remembered
            return
        with self._lock:
            self._lists[key] = (refs, ptrs)
            self._lists.move_to_end(key)
            while len(self._lists) > self.MAX:
                self._lists.popitem(last=False)


_checked = _Checked()


def _checked_layers(layers: list[torch.Tensor], name: str, ref: torch.Tensor, layout: str) -> tuple[int, ...]:
    """``_check_layers``, skipped for a list that passed it before (``_Checked``); returns
    the layers' data pointers. A tensor changed in place since (``set_``, a resize that
    moved it) has another address, so its list is checked again."""
    ptrs = tuple(t.data_ptr() for t in layers)
    key = (layout, tuple(map(id, layers)))
    if _checked.hit(key, layers, ptrs):
        return ptrs
    _check_layers(layers, name, ref, layout)
    _checked.add(key, layers, ptrs)
    return ptrs


def _check_layers(layers: list[torch.Tensor], name: str, ref: torch.Tensor, layout: str) -> None:
    if ref.element_size() not in _ITEMSIZES or ref.is_complex():
        raise ValueError(
            f"{name}[0] has dtype {ref.dtype} ({ref.element_size()} bytes); "
            "use a 1-, 2- or 4-byte dtype (fp8/uint8, fp16/bf16, fp32)"
        )
    want_dims = {"NHD": (3,), "HND": (4,), _HND_KV: (4, 5), _NHD_KV: (4,)}[layout]
    if ref.dim() not in want_dims:
        raise ValueError(f"{name}[0] has shape {tuple(ref.shape)}; layout {layout} needs {_FORMS[layout]}")
    for i, t in enumerate(layers):
        if t.dtype != ref.dtype or t.device != ref.device or t.shape != ref.shape:
            raise ValueError(
                f"{name}[{i}] is {t.dtype} {tuple(t.shape)} on {t.device} but "
                f"{name}[0] is {ref.dtype} {tuple(ref.shape)} on {ref.device}"
            )
        if not t.is_contiguous():
            raise ValueError(f"{name}[{i}] must be contiguous (strides {t.stride()})")


def _pool_shape(t: torch.Tensor, name: str, layout: str, page_size: int) -> tuple[int, int, int]:
    """(num_pages, pool_heads, head_dim) of one layer buffer (NHD_KV: k_dim + v_dim)."""
    if layout == _NHD_KV:
        num_pages, in_page, heads, dim = (int(x) for x in t.shape)
        if in_page != page_size:
            raise ValueError(f"{name} holds {in_page} tokens per page (dim 1) but page_size={page_size}")
    elif layout == "NHD":
        rows, heads, dim = (int(x) for x in t.shape)
        if rows < page_size or rows % page_size:
            raise ValueError(f"{name} has {rows} token rows, not a positive multiple of page_size={page_size}")
        num_pages = rows // page_size
    elif layout == _HND_KV:
        shape = tuple(int(x) for x in t.shape)
        if len(shape) == 4:  # vLLM's [blocks, heads, block_size, 2 * head_dim]
            num_pages, heads, in_page, both = shape
            dim = both // 2
            if both % 2:
                raise ValueError(
                    f"{name} has shape {shape}: its last dim {both} must be 2 * head_dim for layout HND_KV "
                    f"(needs {_FORMS[_HND_KV]})"
                )
        else:
            num_pages, heads, kinds, in_page, dim = shape
            if kinds != 2:
                raise ValueError(
                    f"{name} has shape {shape}: dim 2 is {kinds}, but layout HND_KV holds K and V there "
                    f"(needs {_FORMS[_HND_KV]})"
                )
        if in_page != page_size:
            raise ValueError(f"{name} holds {in_page} tokens per page (dim {len(shape) - 2}) but page_size={page_size}")
    else:
        num_pages, heads, in_page, dim = (int(x) for x in t.shape)
        if in_page != page_size:
            raise ValueError(f"{name} holds {in_page} tokens per page (dim 2) but page_size={page_size}")
    if num_pages < 1 or heads < 1 or dim < 1:
        raise ValueError(f"{name} has shape {tuple(t.shape)}: pages, heads and head_dim must all be >= 1")
    return num_pages, heads, dim


def _page_ids(page_ids, device: torch.device, num_pages: int, unique: bool):
    """Host int64 array (or the same ids as an int64 tensor when they live on the GPU)."""
    if isinstance(page_ids, torch.Tensor):
        if page_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"page_ids has dtype {page_ids.dtype}; use torch.int32 or torch.int64")
        if page_ids.dim() != 1:
            raise ValueError(f"page_ids must be 1-D, got shape {tuple(page_ids.shape)}")
        if page_ids.device.type != "cpu":
            if page_ids.device != device:
                raise ValueError(f"page_ids is on {page_ids.device} but the KV buffers are on {device}")
            return _device_page_ids(page_ids.to(torch.int64).contiguous(), num_pages, unique)
        arr = page_ids.numpy()
    else:
        try:
            arr = np.asarray(page_ids)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"page_ids cannot be read as integers: {exc}") from None
        if arr.size == 0 and arr.ndim == 1:
            arr = arr.astype(np.int64)
    if arr.ndim != 1:
        raise ValueError(f"page_ids must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"page_ids has dtype {arr.dtype}; page ids must be integers")
    bad = np.flatnonzero((arr < 0) | (arr >= num_pages))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"page_ids[{i}]={arr[i]} is outside [0, {num_pages}) (the pool has {num_pages} pages)")
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    if unique and arr.size > 1:
        ordered = np.sort(arr)
        repeated = ordered[1:][ordered[1:] == ordered[:-1]]
        if repeated.size:
            raise ValueError(f"page_ids repeats page {int(repeated[0])}; a scatter would write it twice")
    return arr


def _device_page_ids(ids: torch.Tensor, num_pages: int, unique: bool) -> torch.Tensor:
    # One host sync: the kernel must never index outside the pool.
    if ids.numel():
        lo, hi = (int(x) for x in torch.aminmax(ids))
        if lo < 0 or hi >= num_pages:
            i = int(torch.nonzero((ids < 0) | (ids >= num_pages))[0])
            raise ValueError(
                f"page_ids[{i}]={int(ids[i])} is outside [0, {num_pages}) (the pool has {num_pages} pages)"
            )
        if unique and torch.unique(ids).numel() != ids.numel():
            ordered = torch.sort(ids).values
            page = int(ordered[1:][ordered[1:] == ordered[:-1]][0])
            raise ValueError(f"page_ids repeats page {page}; a scatter would write it twice")
    return ids
