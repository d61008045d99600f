"""KV checksums per writer, for SGLang's ``--disaggregation-enable-kv-checksum`` on CPU pools.

Owns the digest of one rank's KV of one request (a CRC-32 per global KV head over every
buffer of the pool, K of every layer then V, of the request's page rows in page order), its
packing in front of the aux payload a writer's ``TransferDone`` carries, and the comparison
on the decode. A digest is keyed by global head, not by rank, so it is the same wherever
the head lives: a prefill rank digests the heads it owns over the pages it sent; a decode
rank digests the heads it owns over the pages it received and compares, per writer, the
heads that writer wrote to it (each head of a decode rank has exactly one writer). That is
what makes it correct under any TP re-sharding, where SGLang's own digest (one Adler-32 over
a rank's whole rows, CUDA only) is comparable only between ranks of the same TP width.

Pools are read through their raw addresses: CPU memory only. Must not import torch or
SGLang, or know about the engine.
"""

from __future__ import annotations

import ctypes
import struct
import zlib
from collections.abc import Mapping, Sequence

import numpy as np

from sglang_kvxfer.geometry import Layout, RankPlacement

__all__ = ["head_digests", "attach", "detach", "mismatches"]

_MAGIC = b"KVXD"
_HEAD = struct.Struct("<4sHH")  # magic, version, number of digests
_ITEM = struct.Struct("<II")  # global head, CRC-32


def _buffer(ptr: int, nbytes: int) -> np.ndarray:
    return np.frombuffer(memoryview((ctypes.c_uint8 * nbytes).from_address(ptr)), dtype=np.uint8)


def head_digests(place: RankPlacement, ptrs: Sequence[int], pages) -> dict[int, int]:
    """CRC-32 of each head ``place`` owns over its rows of ``pages`` in every buffer.

    Args:
        place: the rank's placement (an NHD geometry: ``[num_pages * page_size,
            local_heads, dim]`` per buffer, K of every layer then V).
        ptrs: the address of each buffer (CPU memory), in that order.
        pages: the request's page ids on this rank, in request order (whole pages).

    Returns ``{global head: crc32}``.
    """
    g = place.geometry
    if g.layout is not Layout.NHD:
        raise ValueError(f"KV checksums read NHD pools; this pool is {g.layout}")
    if len(ptrs) != g.num_buffers:
        raise ValueError(f"{len(ptrs)} buffer addresses for a geometry of {g.num_buffers} buffers")
    pages = np.asarray(pages, dtype=np.int64).reshape(-1)
    if pages.size and (pages.min() < 0 or pages.max() >= g.num_pages):
        raise ValueError(f"page ids must lie in [0, {g.num_pages}), got {pages.min()}..{pages.max()}")
    rows = (pages[:, None] * g.page_size + np.arange(g.page_size)).reshape(-1)
    heads = list(place.heads)
    crc = [0] * len(heads)
    for b, ptr in enumerate(ptrs):
        shape = place.buffer_shape(b)
        dim_bytes = shape[2] * g.itemsize
        view = _buffer(ptr, shape[0] * shape[1] * dim_bytes).reshape(shape[0], shape[1], dim_bytes)
        picked = view[rows]  # [tokens, local heads, dim bytes], a copy
        for j in range(len(heads)):
            crc[j] = zlib.crc32(np.ascontiguousarray(picked[:, j, :]).reshape(-1).data, crc[j])
    return dict(zip(heads, crc))


def attach(aux: bytes, digests: Mapping[int, int]) -> bytes:
    """``aux`` with ``digests`` in front (what a writer puts in its ``TransferDone``)."""
    items = sorted(digests.items())
    return _HEAD.pack(_MAGIC, 1, len(items)) + b"".join(_ITEM.pack(h, c) for h, c in items) + bytes(aux)


def detach(payload: bytes) -> tuple[dict[int, int] | None, bytes]:
    """``(digests, aux)`` of a payload; ``(None, payload)`` when it carries none (the aux
    payload itself starts with its own magic, never with this one)."""
    if not payload.startswith(_MAGIC):
        return None, payload
    if len(payload) < _HEAD.size:
        raise ValueError(f"KV checksum section of {len(payload)} bytes is too short")
    _, version, count = _HEAD.unpack_from(payload)
    end = _HEAD.size + count * _ITEM.size
    if version != 1 or len(payload) < end:
        raise ValueError(
            f"KV checksum section: version {version} with {count} digests in {len(payload)} bytes "
            "(expected version 1; run the same sglang_kvxfer version on both sides)"
        )
    digests = dict(_ITEM.iter_unpack(payload[_HEAD.size : end]))
    return digests, payload[end:]


def mismatches(writers: Mapping[int, Mapping[int, int] | None], mine: Mapping[int, int]) -> list[tuple]:
    """``(prefill rank, head, prefill crc, decode crc)`` of every head of ``mine`` a writer
    digested differently. ``writers``: each writer's digests (None: it sent none); a writer
    digests all of its heads, and only those it shares with this rank are compared."""
    out = []
    for rank in sorted(writers):
        theirs = writers[rank]
        if theirs is None:
            continue
        for head in sorted(set(theirs) & set(mine)):
            if theirs[head] != mine[head]:
                out.append((rank, head, theirs[head], mine[head]))
    return out
