"""CPU reference executor: applies byte plans to real buffers with numpy.

Owns ``apply_plan`` and the numpy reference of the staged path (``gather_np`` /
``scatter_np``). It is deliberately simple and slow-but-obvious: it is the yardstick the
planner's oracle tests, the kernels and the engine are compared against. It must not grow
performance tricks; the engine's data path lives in ``ops`` and ``transports``.

Buffers are numpy arrays, one per buffer index of a ``RankPlacement`` (K of every layer,
then V of every layer; HND_KV, NHD_KV: one K-and-V buffer per layer), C-contiguous with exactly
``placement.buffer_nbytes(i)`` bytes. They are handled as bytes, so any dtype works.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sglang_kvxfer.geometry import KVGeometry, Layout, RankPlacement
from sglang_kvxfer.planning.byteplan import DirectPlan, FusedPlan, PairPlan, StagedPlan

__all__ = ["apply_plan", "gather_np", "scatter_np"]


def _byte_views(place: RankPlacement, buffers: Sequence[np.ndarray], name: str) -> list[np.ndarray]:
    g = place.geometry
    if len(buffers) != g.num_buffers:
        raise ValueError(f"{name} has {len(buffers)} buffer(s); the geometry needs {g.num_buffers}")
    out = []
    for i, buf in enumerate(buffers):
        if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
            raise ValueError(f"{name}[{i}] must be a C-contiguous numpy array")
        if buf.nbytes != place.buffer_nbytes(i):
            raise ValueError(f"{name}[{i}] has {buf.nbytes} bytes; the geometry needs {place.buffer_nbytes(i)}")
        out.append(buf.reshape(-1).view(np.uint8))
    return out


def _shaped(place: RankPlacement, flat: np.ndarray, buffer_index: int) -> np.ndarray:
    """Byte view with the pool's shape, last dim in bytes: NHD ``[rows, heads, dim_bytes]``,
    HND ``[pages, heads, page_size, dim_bytes]``, HND_KV ``[pages, heads, 2, page_size,
    dim_bytes]``."""
    shape = list(place.buffer_shape(buffer_index))
    shape[-1] *= place.geometry.itemsize
    return flat.reshape(shape)


def _kinds(g: KVGeometry, layer: int) -> list[tuple[int, int]]:
    """(buffer index, K|V) of one layer's staging blocks, in staging order."""
    if g.packed_kv:
        return [(layer, 0), (layer, 1)]
    return [(layer, 0), (g.num_layers + layer, 1)][: 2 if g.has_v else 1]


def _rows(
    layout: Layout, kind: int, page_size: int, pg: np.ndarray, slot: np.ndarray, heads: np.ndarray, k_bytes: int = 0
) -> tuple:
    """Index of the (token, head) rows of one kind in a shaped buffer view (``k_bytes``: the
    K part of an NHD_KV row)."""
    if layout is Layout.NHD_KV:
        return (pg, slot, heads, slice(0, k_bytes) if kind == 0 else slice(k_bytes, None))
    if layout is Layout.NHD:
        return (pg * page_size + slot, heads)
    if layout is Layout.HND_KV:
        return (pg, heads, kind, slot)
    return (pg, heads, slot)


def _token_index(pages: np.ndarray, page_size: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    tok = np.arange(start, start + count, dtype=np.int64)
    return pages[tok // page_size], tok % page_size


def gather_np(
    place: RankPlacement,
    buffers: Sequence[np.ndarray],
    pages: np.ndarray,
    head_start: int,
    num_heads: int,
    token_start: int,
    num_tokens: int,
) -> np.ndarray:
    """Staging bytes ``[layer][K|V][token][num_heads][dim]`` of the given tokens and heads."""
    views = _byte_views(place, buffers, "buffers")
    g = place.geometry
    pg, slot = _token_index(pages, g.page_size, token_start, num_tokens)
    heads_idx = np.arange(head_start, head_start + num_heads)[None, :]
    pg2, slot2 = pg[:, None], slot[:, None]
    blocks: list[np.ndarray] = []
    for layer in range(g.num_layers):
        for b, kind in _kinds(g, layer):
            arr = _shaped(place, views[b], b)
            rows = _rows(g.layout, kind, g.page_size, pg2, slot2, heads_idx, g.head_dim * g.itemsize)
            blocks.append(arr[rows].reshape(-1))
    return np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.uint8)


def scatter_np(
    place: RankPlacement,
    buffers: Sequence[np.ndarray],
    staging: np.ndarray,
    pages: np.ndarray,
    head_start: int,
    num_heads: int,
    token_start: int,
    num_tokens: int,
) -> None:
    """Inverse of ``gather_np``: write staging bytes into the given tokens and heads."""
    views = _byte_views(place, buffers, "buffers")
    g = place.geometry
    pg, slot = _token_index(pages, g.page_size, token_start, num_tokens)
    heads_idx = np.arange(head_start, head_start + num_heads)[None, :]
    pg2, slot2 = pg[:, None], slot[:, None]
    staging = np.asarray(staging).reshape(-1).view(np.uint8)
    pos = 0
    for layer in range(g.num_layers):
        for b, kind in _kinds(g, layer):
            dim_bytes = (g.head_dim if kind == 0 else g.v_head_dim or 0) * g.itemsize
            size = num_tokens * num_heads * dim_bytes
            block = staging[pos : pos + size].reshape(num_tokens, num_heads, dim_bytes)
            pos += size
            arr = _shaped(place, views[b], b)
            arr[_rows(g.layout, kind, g.page_size, pg2, slot2, heads_idx, g.head_dim * g.itemsize)] = block
    if pos != staging.size:
        raise ValueError(f"staging has {staging.size} bytes; the plan needs {pos}")


def apply_plan(plan: PairPlan, src_buffers: Sequence[np.ndarray], dst_buffers: Sequence[np.ndarray]) -> None:
    """Move the bytes ``plan`` describes from the writer's buffers into the reader's."""
    if isinstance(plan, DirectPlan):
        src = _byte_views(plan.src, src_buffers, "src_buffers")
        dst = _byte_views(plan.dst, dst_buffers, "dst_buffers")
        for b in range(plan.src.geometry.num_buffers):
            for s, d, n in plan.buffer_ops(b):
                dst[b][d : d + n] = src[b][s : s + n]
        return
    if not isinstance(plan, (StagedPlan, FusedPlan)):
        raise TypeError(f"plan must be a DirectPlan, StagedPlan or FusedPlan, got {type(plan).__name__}")
    t = plan.transfer
    # A fused plan moves the same bytes as a staged one, without the staging buffer in between.
    staging = gather_np(
        plan.src, src_buffers, plan.src_pages, t.src_head_start, t.num_heads, plan.token_start, plan.num_tokens
    )
    if isinstance(plan, StagedPlan) and staging.size != plan.staging_nbytes:
        raise AssertionError(f"gather produced {staging.size} bytes, plan says {plan.staging_nbytes}")
    scatter_np(
        plan.dst, dst_buffers, staging, plan.dst_pages, t.dst_head_start, t.num_heads, plan.token_start, plan.num_tokens
    )
