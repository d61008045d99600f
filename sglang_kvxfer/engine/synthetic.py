"""Deterministic KV content for servers without a model, and its verification.

Owns ``fill_request`` (a prefill rank writes the content of its owned heads into a
request's pages) and ``verify_request`` (a decode rank checks every byte of its owned heads
in the request's pages). The content of one (room, layer, K/V, global head, token) row is
a 64-bit hash of those five numbers tiled across the row and mixed with the byte position,
so a row landing in the wrong token, head, layer, K/V buffer or request is detected, and so
is a byte moved inside a row. Must not know about transports or the protocol.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sglang_kvxfer.geometry import Layout, RankPlacement

__all__ = ["row_bytes", "fill_request", "verify_request"]

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, vectorised (uint64 arithmetic wraps)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def row_bytes(
    room: int, layer: int, kind: int, heads: Sequence[int], token_start: int, num_tokens: int, dim_bytes: int
) -> np.ndarray:
    """Content of tokens ``[token_start, token_start+num_tokens)`` x ``heads`` of one buffer:
    ``uint8 [num_tokens, len(heads), dim_bytes]``."""
    with np.errstate(over="ignore"):
        tok = np.arange(token_start, token_start + num_tokens, dtype=np.uint64)[:, None]
        head = np.asarray(list(heads), dtype=np.uint64)[None, :]
        seed = _mix(np.uint64(room & 0xFFFFFFFFFFFFFFFF) ^ _mix(np.uint64(layer * 2 + kind + 1)))
        h = _mix(seed ^ _mix(head + np.uint64(0x9E3779B97F4A7C15)) ^ (tok * np.uint64(0xD6E8FEB86659FD93)))
    raw = np.ascontiguousarray(h).view(np.uint8).reshape(num_tokens, len(heads), 8)
    reps = -(-dim_bytes // 8)
    tiled = np.tile(raw, (1, 1, reps))[:, :, :dim_bytes]
    pattern = (np.arange(dim_bytes, dtype=np.uint32) * 151 + 7).astype(np.uint8)
    return tiled ^ pattern


def _token_rows(place: RankPlacement, pages: np.ndarray, token_start: int, num_tokens: int):
    g = place.geometry
    tok = np.arange(token_start, token_start + num_tokens, dtype=np.int64)
    return pages[tok // g.page_size], tok % g.page_size


def _byte_view(place: RankPlacement, buffer, index: int):
    """A uint8 view of one pool buffer with the last dim in bytes (torch tensor)."""
    import torch

    shape = list(place.buffer_shape(index))
    shape[-1] *= place.geometry.itemsize
    return buffer.view(torch.uint8).reshape(shape)


def _kinds(place: RankPlacement) -> list[tuple[int, int, int]]:
    """(buffer index, layer, K|V) of every kind of row: K of every layer, then V (HND_KV,
    NHD_KV: both in buffer ``layer``)."""
    g = place.geometry
    if g.packed_kv:
        return [(layer, layer, kind) for layer in range(g.num_layers) for kind in (0, 1)]
    return [(b, b % g.num_layers, b // g.num_layers) for b in range(g.num_buffers)]


def _rows_index(place: RankPlacement, kind: int, pg: np.ndarray, slot: np.ndarray, device) -> tuple:
    """Index of the ``[tokens, local heads, dim_bytes]`` rows of one kind in a byte view."""
    import torch

    g = place.geometry
    if g.layout is Layout.NHD:
        return (torch.from_numpy(pg * g.page_size + slot).to(device),)
    pages, slots = torch.from_numpy(pg).to(device), torch.from_numpy(slot).to(device)
    if g.layout is Layout.HND_KV:
        heads = torch.arange(place.num_local_heads, device=device)[None, :]
        return (pages[:, None], heads, kind, slots[:, None])
    if g.layout is Layout.NHD_KV:  # [pages, page_size, heads, K bytes | V bytes]
        heads = torch.arange(place.num_local_heads, device=device)[None, :]
        k_bytes = g.head_dim * g.itemsize
        part = slice(0, k_bytes) if kind == 0 else slice(k_bytes, None)
        return (pages[:, None], slots[:, None], heads, part)
    return (pages, slice(None), slots)


def _kind_bytes(place: RankPlacement, kind: int) -> int:
    """Bytes of one row of kind ``kind`` (0: K, 1: V)."""
    g = place.geometry
    return (g.head_dim if kind == 0 else g.v_head_dim or 0) * g.itemsize


def fill_request(
    place: RankPlacement, buffers: Sequence, room: int, pages, token_start: int, num_tokens: int, layer_start: int = 0
) -> None:
    """Write the content of the heads this rank's pool holds for tokens ``[token_start, +num_tokens)``
    into ``pages`` of ``buffers`` (torch tensors, K of every layer then V; HND_KV, NHD_KV: one
    per layer). ``layer_start``: the model layer of the pool's first layer (a pool of some
    of the model's layers holds their content)."""
    import torch

    pages = np.asarray(pages, dtype=np.int64)
    pg, slot = _token_rows(place, pages, token_start, num_tokens)
    heads = list(place.stored_heads)
    for b, layer, kind in _kinds(place):
        data = row_bytes(room, layer_start + layer, kind, heads, token_start, num_tokens, _kind_bytes(place, kind))
        dst = _byte_view(place, buffers[b], b)
        dst[_rows_index(place, kind, pg, slot, dst.device)] = torch.from_numpy(data).to(dst.device)


def verify_request(
    place: RankPlacement, buffers: Sequence, room: int, pages, num_tokens: int, layer_start: int = 0
) -> list[str]:
    """Compare every byte of the heads this rank's pool holds for tokens ``[0, num_tokens)`` in
    ``pages`` with the expected content (``layer_start`` as ``fill_request``'s). Returns a
    list of problems (empty when exact)."""
    pages = np.asarray(pages, dtype=np.int64)
    pg, slot = _token_rows(place, pages, 0, num_tokens)
    heads = list(place.stored_heads)
    problems = []
    for b, layer, kind in _kinds(place):
        want = row_bytes(room, layer_start + layer, kind, heads, 0, num_tokens, _kind_bytes(place, kind))
        src = _byte_view(place, buffers[b], b)
        got = src[_rows_index(place, kind, pg, slot, src.device)].cpu().numpy()
        if not np.array_equal(got, want):
            bad = np.argwhere(got != want)[0]
            t, h = int(bad[0]), int(bad[1])
            problems.append(
                f"buffer {b} ({'K' if kind == 0 else 'V'} of layer {layer_start + layer}): token {t} head "
                f"{heads[h]} byte {int(bad[2])} is {int(got[tuple(bad)])}, expected {int(want[tuple(bad)])}"
            )
    return problems
