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

Toward a decode with ``--dcp-size N`` (each DCP rank holds every N-th token of a request in
its own pages, ``token_phase`` its first), whole pages are not the same bytes on both sides:
the writer digests the request's token rows instead (``token_digests``), one set per phase,
and says how many tokens it covered (version 2 of the section); each DCP rank compares the
digests of its phase over its own rows of those tokens. The draft model's KV, which DCP does
not split, is digested by tokens too (stride 1), since its pages differ in size there.

Pools are read through their raw addresses: CPU memory only. Must not import torch or
SGLang, or know about the engine.
"""

from __future__ import annotations

import ctypes
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from sglang_kvxfer.geometry import Layout, RankPlacement

__all__ = [
    "head_digests",
    "token_digests",
    "phase_digests",
    "token_rows",
    "TokenDigests",
    "attach",
    "attach_tokens",
    "detach",
    "mismatches",
]

_MAGIC = b"KVXD"
_HEAD = struct.Struct("<4sHH")  # magic, version, number of digests
_ITEM = struct.Struct("<II")  # global head, CRC-32
_TOKENS = struct.Struct("<QI")  # version 2: tokens digested, token stride
_ITEM2 = struct.Struct("<III")  # version 2: token phase, global head, CRC-32


@dataclass(frozen=True)
class TokenDigests:
    """A writer's digests of a request's first ``tokens`` tokens: ``crcs[(phase, head)]`` over
    the tokens ``phase, phase + stride, ...`` below ``tokens``, in token order."""

    tokens: int
    stride: int
    crcs: Mapping[tuple[int, int], int]

    def of_phase(self, phase: int) -> dict[int, int]:
        """``{global head: crc32}`` of the tokens of ``phase``."""
        return {h: c for (p, h), c in self.crcs.items() if p == phase}


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
    pages = _pages(place, pages)
    return _row_digests(place, ptrs, (pages[:, None] * g.page_size + np.arange(g.page_size)).reshape(-1))


def token_rows(place: RankPlacement, pages, tokens) -> np.ndarray:
    """The pool rows of a request's ``tokens`` (indices into the request's tokens on this
    rank: the i-th lies in row ``i % page_size`` of ``pages[i // page_size]``)."""
    pages = _pages(place, pages)
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    ps = place.geometry.page_size
    if tokens.size and (tokens.min() < 0 or tokens.max() >= pages.size * ps):
        raise ValueError(f"token {int(tokens.max())} lies past the {pages.size} page(s) of {ps} tokens given")
    return pages[tokens // ps] * ps + tokens % ps


def token_digests(place: RankPlacement, ptrs: Sequence[int], pages, tokens: int, stride: int) -> TokenDigests:
    """A writer's digests of the first ``tokens`` tokens of a request in ``pages``, one set per
    phase of ``stride`` (what each DCP rank of a decode with ``--dcp-size stride`` holds)."""
    if stride < 1 or tokens < 0:
        raise ValueError(f"stride={stride} must be >= 1 and tokens={tokens} >= 0")
    crcs = {}
    for phase in range(stride):
        rows = token_rows(place, pages, np.arange(phase, tokens, stride))
        crcs.update({(phase, h): c for h, c in _row_digests(place, ptrs, rows).items()})
    return TokenDigests(tokens, stride, crcs)


def phase_digests(place: RankPlacement, ptrs: Sequence[int], pages, theirs: TokenDigests, phase: int) -> dict[int, int]:
    """A reader's digests of its tokens of a writer's ``theirs``: the tokens of ``phase``
    below ``theirs.tokens``, which this rank holds one after another in ``pages``."""
    count = len(range(phase, theirs.tokens, theirs.stride))
    return _row_digests(place, ptrs, token_rows(place, pages, np.arange(count)))


def _pages(place: RankPlacement, pages) -> np.ndarray:
    g = place.geometry
    pages = np.asarray(pages, dtype=np.int64).reshape(-1)
    if pages.size and (pages.min() < 0 or pages.max() >= g.num_pages):
        raise ValueError(f"page ids must lie in [0, {g.num_pages}), got {pages.min()}..{pages.max()}")
    return pages


def _row_digests(place: RankPlacement, ptrs: Sequence[int], rows: np.ndarray) -> dict[int, int]:
    """CRC-32 of each head ``place`` owns over ``rows`` (in that order) of every buffer."""
    g = place.geometry
    if g.layout is not Layout.NHD:
        raise ValueError(f"KV checksums read NHD pools; this pool is {g.layout}")
    if len(ptrs) != g.num_buffers:
        raise ValueError(f"{len(ptrs)} buffer addresses for a geometry of {g.num_buffers} buffers")
    heads = list(place.heads)  # (a pool of every head, all_heads: the owned ones, at their places in it)
    first = place.heads.start - place.stored_heads.start
    crc = [0] * len(heads)
    for b, ptr in enumerate(ptrs):
        shape = place.buffer_shape(b)
        dim_bytes = shape[2] * g.itemsize
        view = _buffer(ptr, shape[0] * shape[1] * dim_bytes).reshape(shape[0], shape[1], dim_bytes)
        picked = view[rows]  # [tokens, local heads, dim bytes], a copy
        for j in range(len(heads)):
            crc[j] = zlib.crc32(np.ascontiguousarray(picked[:, first + j, :]).reshape(-1).data, crc[j])
    return dict(zip(heads, crc))


def attach(aux: bytes, digests: Mapping[int, int]) -> bytes:
    """``aux`` with ``digests`` in front (what a writer puts in its ``TransferDone``)."""
    items = sorted(digests.items())
    return _HEAD.pack(_MAGIC, 1, len(items)) + b"".join(_ITEM.pack(h, c) for h, c in items) + bytes(aux)


def attach_tokens(aux: bytes, digests: TokenDigests) -> bytes:
    """``aux`` with a writer's token digests in front (version 2 of the section)."""
    items = sorted(digests.crcs.items())
    return (
        _HEAD.pack(_MAGIC, 2, len(items))
        + _TOKENS.pack(digests.tokens, digests.stride)
        + b"".join(_ITEM2.pack(p, h, c) for (p, h), c in items)
        + bytes(aux)
    )


def detach(payload: bytes) -> tuple[dict[int, int] | TokenDigests | None, bytes]:
    """``(digests, aux)`` of a payload: per head (version 1) or per token phase and head
    (version 2, ``TokenDigests``); ``(None, payload)`` when it carries none (the aux payload
    itself starts with its own magic, never with this one)."""
    if not payload.startswith(_MAGIC):
        return None, payload
    if len(payload) < _HEAD.size:
        raise ValueError(f"KV checksum section of {len(payload)} bytes is too short")
    _, version, count = _HEAD.unpack_from(payload)
    start = _HEAD.size + (_TOKENS.size if version == 2 else 0)
    end = start + count * (_ITEM2.size if version == 2 else _ITEM.size)
    if version not in (1, 2) or len(payload) < end:
        raise ValueError(
            f"KV checksum section: version {version} with {count} digests in {len(payload)} bytes "
            "(expected version 1 or 2; run the same sglang_kvxfer version on both sides)"
        )
    if version == 1:
        return dict(_ITEM.iter_unpack(payload[start:end])), payload[end:]
    tokens, stride = _TOKENS.unpack_from(payload, _HEAD.size)
    crcs = {(p, h): c for p, h, c in _ITEM2.iter_unpack(payload[start:end])}
    return TokenDigests(tokens, stride, crcs), payload[end:]


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
