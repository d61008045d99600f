"""Per-request byte plans for one (writer, reader) pair, as numpy arrays.

Owns ``plan_pair`` and the three plan shapes it returns:

* ``DirectPlan``: the bytes to move are contiguous on both sides (equal TP or MLA on NHD
  pools, or page-aligned head slices of HND pools, or of HND_KV pools, with equal page
  sizes). The plan holds ``(src_offset, dst_offset, nbytes)`` ops for one K buffer and one
  V buffer (HND_KV: for the one K-and-V buffer of a layer, where a page's head range is a
  single run of ``heads * 2 * page_size`` rows); the same ops apply to every layer's buffer
  of that kind. Contiguous runs are coalesced.
* ``StagedPlan``: the head slice is strided (NHD with a TP mismatch) or the two sides
  differ in page size/layout so that nothing lines up. The writer gathers the slice of all
  layers into a token-major staging buffer ``[layer][K|V][token][n][dim]``, moves it with
  one large write, and the reader scatters it. The plan holds what gather and scatter need.
* ``FusedPlan``: the reader's pool is mapped writable in the writer's process (``local``
  shared memory, CUDA IPC): one ``ops.copy_kv_heads`` reads the writer's pages and writes
  the reader's pages with both page tables, any layouts and page sizes. The same slices as
  ``StagedPlan``, one pass instead of gather + write + scatter.

All report the op count of direct and staged so callers (and ``kvxfer plan``) can show
why a path was chosen; which one ``auto`` takes is ``pathcost.py``'s rule. Page lists are
validated, never truncated. No I/O, no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, TypedDict

import numpy as np

from sglang_kvxfer.errors import PlanError
from sglang_kvxfer.geometry import Compatibility, KVGeometry, Layout, RankPlacement, check_compatible
from sglang_kvxfer.planning.kvslice import DataPath, KVSlice
from sglang_kvxfer.planning.pathcost import DIRECT_MIN_OP_BYTES, PathCost, PoolMapping, prefers_direct, prefers_fused
from sglang_kvxfer.planning.tp import HeadTransfer

__all__ = [
    "DIRECT_MIN_OP_BYTES",
    "PairPlan",
    "DirectPlan",
    "FusedPlan",
    "PathCost",
    "PoolMapping",
    "StagedPlan",
    "plan_pair",
    "coalesce",
    "MAX_WRITE_BYTES",
    "per_token_op_count",
    "per_token_possible",
    "contiguous_layout",
    "per_token_row_count",
    "staged_op_count",
]

# One staged write never exceeds this (MORI and most verbs stacks cap a WR below 4 GiB).
MAX_WRITE_BYTES = 1 << 30


@dataclass(frozen=True)
class PairPlan:
    """What one writer moves to one reader for tokens ``[token_start, token_start + num_tokens)``.

    ``nbytes`` is the payload (all layers, K and V). ``direct_op_count`` is ``None`` when
    the bytes are not contiguous on both sides; ``staged_op_count`` counts wire writes of
    the staged path (gather and scatter are one kernel launch each on top).
    """

    transfer: HeadTransfer
    src: RankPlacement
    dst: RankPlacement
    token_start: int
    num_tokens: int
    nbytes: int
    direct_op_count: int | None
    staged_op_count: int
    reason: str
    path: ClassVar[DataPath | None] = None

    @property
    def op_count(self) -> int:
        """Transport ops this plan posts."""
        if self.path is not DataPath.DIRECT:
            return self.staged_op_count
        if self.direct_op_count is None:
            raise PlanError("a direct plan must have a direct_op_count")
        return self.direct_op_count


@dataclass(frozen=True)
class DirectPlan(PairPlan):
    """Direct writes. ``k_ops``/``v_ops`` are ``int64 [N, 3]`` arrays of
    ``(src_offset, dst_offset, nbytes)`` relative to one K (V) buffer of each side; apply
    them to buffer ``l`` (K) and ``L + l`` (V) for every layer ``l``. HND_KV pairs have one
    buffer per layer: ``k_ops`` move its K and V bytes and ``v_ops`` is None."""

    k_ops: np.ndarray
    v_ops: np.ndarray | None = None
    path: ClassVar[DataPath] = DataPath.DIRECT

    def buffer_ops(self, buffer_index: int) -> np.ndarray:
        """``(src_offset, dst_offset, nbytes)`` rows for buffer ``buffer_index``."""
        g = self.src.geometry
        if not 0 <= buffer_index < g.num_buffers:
            raise ValueError(f"buffer_index={buffer_index} must be in [0, {g.num_buffers})")
        if buffer_index < g.num_layers:
            return self.k_ops
        if self.v_ops is None:
            raise PlanError(f"buffer_index={buffer_index} is a V buffer but the plan has no V ops")
        return self.v_ops


@dataclass(frozen=True)
class _SlicedPlan(PairPlan):
    """A plan the kernels carry out from both sides' page lists (staged or fused)."""

    src_pages: np.ndarray
    dst_pages: np.ndarray

    def gather_slice(self) -> KVSlice:
        """What ``ops.gather_kv_heads`` (or the source of ``ops.copy_kv_heads``) reads from
        the writer's pool."""
        return side_slice(
            self.src,
            self.src_pages,
            self.transfer.src_head_start,
            self.transfer.num_heads,
            self.token_start,
            self.token_start + self.num_tokens,
        )

    def scatter_slice(self) -> KVSlice:
        """What ``ops.scatter_kv_heads`` (or the destination of ``ops.copy_kv_heads``)
        writes into the reader's pool."""
        return side_slice(
            self.dst,
            self.dst_pages,
            self.transfer.dst_head_start,
            self.transfer.num_heads,
            self.token_start,
            self.token_start + self.num_tokens,
        )

    def gather_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``ops.gather_kv_heads`` on the writer's pool."""
        return self.gather_slice().op_kwargs()

    def scatter_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``ops.scatter_kv_heads`` on the reader's pool."""
        return self.scatter_slice().op_kwargs()


@dataclass(frozen=True)
class StagedPlan(_SlicedPlan):
    """Gather -> one write -> scatter. Staging layout: for each layer, K block
    ``[num_tokens, num_heads, head_dim]`` then V block ``[num_tokens, num_heads, v_head_dim]``."""

    staging_nbytes: int = 0
    path: ClassVar[DataPath] = DataPath.STAGED


@dataclass(frozen=True)
class FusedPlan(_SlicedPlan):
    """One ``ops.copy_kv_heads(src pool, gather_slice(), dst pool, scatter_slice())`` into
    the reader's pool, mapped in the writer's process: no staging, no wire write, no
    scatter on the reader. ``op_count`` is 1 (one copy call)."""

    path: ClassVar[DataPath] = DataPath.FUSED

    @property
    def op_count(self) -> int:
        return 1


def _v_head_dim(g: KVGeometry) -> int:
    """``g.v_head_dim`` as an int (``KVGeometry`` resolves ``None`` when it is built)."""
    v = g.v_head_dim
    if v is None:
        raise PlanError("KVGeometry.v_head_dim is unresolved (None); build geometries with KVGeometry(...)")
    return v


def side_slice(
    side: RankPlacement, pages: np.ndarray, head_start: int, num_heads: int, start: int, stop: int
) -> KVSlice:
    """Tokens ``[start, stop)`` of one side as a ``KVSlice`` over only the pages they touch
    (a view of ``pages``: O(1), and the kernels check O(pages in the slice))."""
    size = side.geometry.page_size
    first = start // size if stop > start else 0
    last = -(-stop // size) if stop > start else 0
    return KVSlice(
        pages=pages[first:last],
        page_size=size,
        head_start=head_start,
        num_heads=num_heads,
        layout=side.geometry.layout.value,
        token_offset=start - first * size if stop > start else 0,
        num_tokens=stop - start,
    )


def staged_op_count(nbytes: int) -> int:
    """Wire writes of a staged move of ``nbytes`` (split only above ``MAX_WRITE_BYTES``)."""
    return -(-nbytes // MAX_WRITE_BYTES)


def per_token_op_count(num_layers: int, num_tokens: int, has_v: bool = True) -> int:
    """Ops of the one-write-per-token-per-layer pattern SGLang's connectors use for a
    strided head slice (for comparison only)."""
    return num_layers * (2 if has_v else 1) * num_tokens


def coalesce(src: np.ndarray, dst: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Merge consecutive ops that are contiguous on both sides. Returns ``int64 [N, 3]``."""
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    size = np.asarray(size, dtype=np.int64)
    if src.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    brk = np.ones(src.size, dtype=bool)
    brk[1:] = (src[1:] != src[:-1] + size[:-1]) | (dst[1:] != dst[:-1] + size[:-1])
    starts = np.flatnonzero(brk)
    out = np.empty((starts.size, 3), dtype=np.int64)
    out[:, 0] = src[starts]
    out[:, 1] = dst[starts]
    out[:, 2] = np.add.reduceat(size, starts)
    out.setflags(write=False)
    return out


def _as_pages(name: str, pages: Any, num_pages: int, unique: bool) -> np.ndarray:
    # Called for every reader of every request: a few small-array numpy calls, not a dozen.
    arr = np.asarray(pages)
    if arr.ndim != 1:
        raise PlanError(f"{name} must be a 1-D list of page ids, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise PlanError(f"{name} must hold integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=True)
    if arr.size:
        if arr.min() < 0 or arr.max() >= num_pages:
            i = int(np.flatnonzero((arr < 0) | (arr >= num_pages))[0])
            raise PlanError(f"{name}[{i}]={int(arr[i])} is outside the pool's pages [0, {num_pages})")
        # a set sees a repeat in a short list faster than a sort does
        if unique and (len(set(arr.tolist())) != arr.size if arr.size <= 512 else _repeats(arr)):
            ordered = np.sort(arr)
            dup = int(ordered[1:][ordered[1:] == ordered[:-1]][0])
            raise PlanError(f"{name} repeats page id {dup}; a request's destination pages must be distinct")
    arr.setflags(write=False)
    return arr


def _repeats(arr: np.ndarray) -> bool:
    ordered = np.sort(arr)
    return bool((ordered[1:] == ordered[:-1]).any())


def _pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def plan_pair(
    transfer: HeadTransfer,
    src: RankPlacement,
    dst: RankPlacement,
    src_pages: Any,
    dst_pages: Any,
    *,
    num_tokens: int | None = None,
    token_start: int = 0,
    token_stop: int | None = None,
    path: DataPath | str | None = "auto",
    direct_min_op_bytes: int | None = None,
    cost: PathCost | None = None,
    mapping: PoolMapping | None = None,
) -> PairPlan:
    """Byte plan of one (writer, reader) pair for one request or one chunk of it.

    Args:
        transfer: the pair and head ranges, from ``TPPlan``.
        src, dst: the writer's and reader's placements.
        src_pages, dst_pages: the request's page ids on each side from token 0: at most
            ``ceil(num_tokens / page_size)`` pages, and at least enough to reach
            ``token_stop`` (a chunked sender's list grows chunk by chunk).
        num_tokens: tokens in the request. Defaults to ``len(src_pages) * page_size`` when
            both sides use the same page size; required otherwise.
        token_start, token_stop: the chunk of tokens to plan (default: all of them).
        path: ``"auto"``, ``"direct"``, ``"staged"``, ``"fused"`` or ``"per_token"`` (None:
            ``auto``; the engine passes ``EngineConfig.data_path``). ``direct`` falls back to
            staged where the bytes are not contiguous; ``fused`` to ``auto``'s choice of the
            other two where the reader's pool is not mapped (``mapping``). ``per_token`` is
            SGLang's pattern (one op per token, per head run, per buffer), kept only as a
            baseline for benchmarks.
        direct_min_op_bytes: ``auto``'s fixed rule (``KVXFER_DIRECT_MIN_OP_BYTES``): a
            contiguous pair whose direct ops average fewer bytes than this (and more than 4
            per buffer) is staged. Given, it wins over ``cost``; None: ``cost``, or
            ``DIRECT_MIN_OP_BYTES`` without one.
        cost: the cost rule: under ``auto``, a contiguous pair goes direct when
            ``cost.direct_s`` of its direct ops is at most ``cost.staged_s`` of staging it
            (``PathCost``, what the writer's transport declares: ``Transport.path_cost``).
        mapping: whether the reader's pool is mapped in the writer's process
            (``PoolMapping``; None: unknown, as for ``kvxfer plan``: never fused). Mapped,
            ``auto`` weighs the fused path too (``pathcost.prefers_fused``); known either way,
            the reason says why the pair is fused or not.

    Raises:
        PlanError: page lists that do not cover the tokens, out-of-range or repeated page
            ids, a transfer that does not belong to these placements, a bad token range.
        IncompatibleGeometryError: the two geometries cannot exchange KV.
    """
    compat = check_compatible(src.geometry, dst.geometry)
    transfer = _check_transfer(transfer, src, dst)
    gs, gd = src.geometry, dst.geometry
    src_arr = _as_pages("src_pages", src_pages, gs.num_pages, unique=False)
    dst_arr = _as_pages("dst_pages", dst_pages, gd.num_pages, unique=True)
    total = _resolve_num_tokens(num_tokens, src_arr, dst_arr, gs.page_size, gd.page_size)
    start, stop = _resolve_range(token_start, token_stop, total)
    _check_coverage(src_arr, dst_arr, gs.page_size, gd.page_size, stop)
    rule = cost if direct_min_op_bytes is None else direct_min_op_bytes
    return _plan_range(transfer, src, dst, src_arr, dst_arr, start, stop, _parse_path(path), rule, compat, mapping)


def _parse_path(path: DataPath | str | None) -> DataPath:
    try:
        return DataPath.parse(path)
    except ValueError as exc:
        raise PlanError(str(exc)) from None


class _PairFields(TypedDict):
    """The ``PairPlan`` fields ``_plan_range`` fills in for either plan shape."""

    transfer: HeadTransfer
    src: RankPlacement
    dst: RankPlacement
    token_start: int
    num_tokens: int
    nbytes: int
    direct_op_count: int | None
    staged_op_count: int


# K ops and V ops (None without a V buffer) of one K (V) buffer.
_KVOps = tuple[np.ndarray, np.ndarray | None]


def _op_count(num_layers: int, ops: _KVOps) -> int:
    """Ops of all layers' buffers for per-buffer ``ops``."""
    k_ops, v_ops = ops
    return num_layers * (len(k_ops) + (len(v_ops) if v_ops is not None else 0))


def _plan_range(
    transfer: HeadTransfer,
    src: RankPlacement,
    dst: RankPlacement,
    src_arr: np.ndarray,
    dst_arr: np.ndarray,
    start: int,
    stop: int,
    choice: DataPath,
    direct_min_op_bytes: int | PathCost | None,
    compat: Compatibility,
    mapping: PoolMapping | None = None,
) -> DirectPlan | StagedPlan | FusedPlan:
    """``plan_pair`` on page lists and a token range already checked. ``direct_min_op_bytes``
    is ``auto``'s rule: a ``PathCost`` (the cost rule), an int threshold (the fixed rule),
    or None (the fixed rule at ``DIRECT_MIN_OP_BYTES``); ``mapping``: as in ``plan_pair``."""
    gs = src.geometry
    count = stop - start
    n = transfer.num_heads
    nbytes = gs.num_layers * count * n * (gs.head_dim + _v_head_dim(gs)) * gs.itemsize
    staged_ops = staged_op_count(nbytes)

    rows = choice is DataPath.PER_TOKEN and per_token_possible(src, dst)
    direct = None if rows else _direct_ops(transfer, src, dst, src_arr, dst_arr, start, stop)
    direct_count = None if direct is None else _op_count(gs.num_layers, direct)

    common = _PairFields(
        transfer=transfer,
        src=src,
        dst=dst,
        token_start=start,
        num_tokens=count,
        nbytes=nbytes,
        direct_op_count=direct_count,
        staged_op_count=staged_ops,
    )
    if rows:
        k_ops, v_ops = _per_token_ops(transfer, src, dst, src_arr, dst_arr, start, stop)
        common["direct_op_count"] = _op_count(gs.num_layers, (k_ops, v_ops))
        return DirectPlan(
            **common, reason="one op per token (SGLang's pattern; benchmark baseline)", k_ops=k_ops, v_ops=v_ops
        )
    forced_fused = choice is DataPath.FUSED
    if forced_fused:
        if mapping is not None and mapping.mapped:
            reason = f"forced by path='fused' (the reader's pool is mapped here: {mapping.note})"
            return FusedPlan(**common, reason=reason, src_pages=src_arr, dst_pages=dst_arr)
        choice = DataPath.AUTO  # not mapped: what auto takes of the other two
    path = DataPath.STAGED
    if direct is not None and choice is not DataPath.STAGED:
        use_direct, reason = True, "contiguous on both sides"
        if choice is DataPath.AUTO:
            use_direct, reason = prefers_direct(
                _op_count(gs.num_layers, direct), nbytes, len(direct[0]), direct_min_op_bytes, staged_ops
            )
        if use_direct or count == 0:
            path = DataPath.DIRECT
    elif direct is None:
        reason = _why_strided(transfer, src, dst, compat)
        if choice is DataPath.PER_TOKEN:  # only reached when the two sides pack K and V differently
            reason = f"{_PER_TOKEN_PACKING} ({reason})"
    else:
        reason = "forced by path='staged'"
    if forced_fused:
        why_not = mapping.note if mapping is not None else "the reader's pool is not known to be mapped here"
        reason = f"path='fused' but not fused ({why_not}); {reason}"
    elif mapping is not None:  # the engine: say why the pair is fused or not
        if not mapping.mapped:
            reason = f"{reason}; not fused: {mapping.note}"
        elif choice is not DataPath.AUTO:
            reason = f"{reason}; not fused: forced by path='{choice}'"
        elif count:
            fused, terms = prefers_fused(path, nbytes, direct_count, staged_ops, direct_min_op_bytes)
            if fused:
                reason = (
                    f"fused, the reader's pool is mapped here ({mapping.note}): {terms}; instead of {path}: {reason}"
                )
                return FusedPlan(**common, reason=reason, src_pages=src_arr, dst_pages=dst_arr)
            reason = f"{reason}; not fused: {terms}"
    if path is DataPath.DIRECT and direct is not None:  # DIRECT is set only with direct ops
        return DirectPlan(**common, reason=reason, k_ops=direct[0], v_ops=direct[1])
    return StagedPlan(**common, reason=reason, src_pages=src_arr, dst_pages=dst_arr, staging_nbytes=nbytes)


_PER_TOKEN_PACKING = (
    "per_token needs the same buffers on both sides, but one packs K and V per layer (HND_KV, NHD_KV) "
    "and the other does not, or packs them another way; staged instead"
)


def per_token_row_count(t: HeadTransfer, src: RankPlacement, dst: RankPlacement, num_tokens: int) -> int:
    """Ops of all layers' buffers that the per-token pattern (``_per_token_ops``) posts for
    ``num_tokens`` tokens: per token and buffer kind, the head slice (NHD on both sides) or
    each head's row; NHD_KV: the token's K-and-V head slice."""
    g, gd = src.geometry, dst.geometry
    if g.layout is Layout.NHD_KV:
        return g.num_layers * num_tokens
    kinds = 2 if g.has_v else 1
    per_token = kinds if g.layout is Layout.NHD and gd.layout is Layout.NHD else kinds * t.num_heads
    return g.num_layers * num_tokens * per_token


def per_token_possible(src: RankPlacement, dst: RankPlacement) -> bool:
    """Whether the per-token baseline can address both sides with one op list per buffer kind
    (not between an HND_KV or NHD_KV pool and a pool with another packing)."""
    gs, gd = src.geometry, dst.geometry
    return gs.packed_kv == gd.packed_kv and (not gs.packed_kv or gs.layout == gd.layout)


def _why_strided(transfer: HeadTransfer, src: RankPlacement, dst: RankPlacement, compat: Compatibility) -> str:
    parts: list[str] = []
    if _layouts(src) == {Layout.NHD} and transfer.num_heads < src.num_local_heads:
        parts.append(f"head slice {transfer.num_heads}/{src.num_local_heads} is strided in the NHD source")
    if _layouts(dst) == {Layout.NHD} and transfer.num_heads < dst.num_local_heads:
        parts.append(f"head slice {transfer.num_heads}/{dst.num_local_heads} is strided in the NHD destination")
    if compat.layout_differs:
        parts.append(f"layouts differ ({src.geometry.layout} -> {dst.geometry.layout})")
    if compat.page_size_differs:
        parts.append(f"page sizes differ ({src.geometry.page_size} -> {dst.geometry.page_size})")
    return "; ".join(parts) or "not contiguous on both sides"


def _check_transfer(t: HeadTransfer, src: RankPlacement, dst: RankPlacement) -> HeadTransfer:
    """Check that ``t`` moves heads each side owns, and return it with its head starts as
    indices into each side's pool (``stored_heads``): the same as ``plan_tp``'s (indices into
    the owned heads) except for a rank whose pool holds every head (``all_heads``). Indices
    already into the pool are taken as they are, so a plan's own transfer checks again."""
    if t.prefill_rank != src.tp_rank or t.decode_rank != dst.tp_rank:
        raise PlanError(
            f"transfer is for prefill rank {t.prefill_rank} -> decode rank {t.decode_rank}, "
            f"but the placements are prefill rank {src.tp_rank} -> decode rank {dst.tp_rank}"
        )
    starts = []
    for side, place, start in (("src", src, t.src_head_start), ("dst", dst, t.dst_head_start)):
        owned, stored = place.heads, place.stored_heads
        if start < 0 or t.num_heads < 1 or start + t.num_heads > place.num_local_heads:
            raise PlanError(
                f"{side} heads [{start}, {start + t.num_heads}) are outside the "
                f"{place.num_local_heads} local head(s) of the {side} rank"
            )
        pool = t.global_head_start - stored.start
        if start not in (pool, t.global_head_start - owned.start):
            raise PlanError(
                f"{side} local head {start} is global head {stored.start + start}, but the "
                f"transfer starts at global head {t.global_head_start}: the plan was built for "
                f"another TP layout"
            )
        if not (owned.start <= t.global_head_start and t.global_head_start + t.num_heads <= owned.stop):
            raise PlanError(
                f"{side} heads [{t.global_head_start}, {t.global_head_start + t.num_heads}) (global) are not "
                f"owned by {side} rank {place.tp_rank} of {place.tp_size}, which owns heads [{owned.start}, "
                f"{owned.stop}): the plan was built for another TP layout"
            )
        starts.append(pool)
    if (starts[0], starts[1]) == (t.src_head_start, t.dst_head_start):
        return t
    return dataclasses.replace(t, src_head_start=starts[0], dst_head_start=starts[1])


def _resolve_num_tokens(num_tokens: int | None, src: np.ndarray, dst: np.ndarray, ps: int, pd: int) -> int:
    if num_tokens is None:
        if ps != pd:
            raise PlanError(
                f"num_tokens is required when page sizes differ (prefill page_size={ps}, decode page_size={pd})"
            )
        if len(src) != len(dst):
            raise PlanError(
                f"prefill page list has {len(src)} page(s) but decode page list has {len(dst)} "
                f"(page_size {ps} on both sides); they must cover the same tokens"
            )
        return len(src) * ps
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
        raise PlanError(f"num_tokens={num_tokens!r} must be a non-negative integer")
    num_tokens = int(num_tokens)
    for side, pages, size in (("prefill", src, ps), ("decode", dst, pd)):
        need = _pages_needed(num_tokens, size)
        if len(pages) > need:
            raise PlanError(
                f"{side} page list has {len(pages)} page(s) but {num_tokens} tokens at "
                f"page_size {size} need at most {need}"
            )
    return num_tokens


def _check_coverage(src: np.ndarray, dst: np.ndarray, ps: int, pd: int, stop: int) -> None:
    """Both lists must reach the last planned token (a chunked sender's list grows)."""
    for side, pages, size in (("prefill", src, ps), ("decode", dst, pd)):
        need = _pages_needed(stop, size)
        if len(pages) < need:
            raise PlanError(
                f"{side} page list has {len(pages)} page(s) but tokens [0, {stop}) at page_size {size} need {need}"
            )


def _resolve_range(start: int, stop: int | None, total: int) -> tuple[int, int]:
    stop = total if stop is None else stop
    for name, v in (("token_start", start), ("token_stop", stop)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise PlanError(f"{name}={v!r} must be an integer")
    if not 0 <= start <= stop <= total:
        raise PlanError(f"token range [{start}, {stop}) must lie within the request's {total} token(s)")
    return int(start), int(stop)


def _layouts(place: RankPlacement) -> set[Layout]:
    # With one local head, NHD [pages*S, 1, dim] and HND [pages, 1, S, dim] are the same
    # bytes, so such a side can be read either way (HND_KV and NHD_KV, K and V in one buffer, are not).
    layout = place.geometry.layout
    if place.num_local_heads == 1 and not place.geometry.packed_kv:
        return {Layout.NHD, Layout.HND}
    return {layout}


def contiguous_layout(t: HeadTransfer, src: RankPlacement, dst: RankPlacement) -> Layout | None:
    """The layout in which ``t``'s head slice is contiguous on both sides (each token's or
    page's slice one run, so direct writes can address it), or None: the pair is strided
    whatever its pages, and only staged or per-token writes move it."""
    both = _layouts(src) & _layouts(dst)
    n = t.num_heads
    same_pages = src.geometry.page_size == dst.geometry.page_size
    if Layout.NHD in both and n == src.num_local_heads == dst.num_local_heads:
        return Layout.NHD
    if Layout.HND in both and same_pages:
        return Layout.HND
    if Layout.HND_KV in both and same_pages:
        return Layout.HND_KV
    if Layout.NHD_KV in both and n == src.num_local_heads == dst.num_local_heads:
        return Layout.NHD_KV
    return None


def _direct_ops(
    t: HeadTransfer,
    src: RankPlacement,
    dst: RankPlacement,
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    start: int,
    stop: int,
) -> _KVOps | None:
    """Per-kind op arrays when the slice is contiguous on both sides, else ``None``."""
    layout = contiguous_layout(t, src, dst)
    if layout is None:
        return None
    n = t.num_heads
    g = src.geometry
    dims = [g.head_dim] + ([_v_head_dim(g)] if g.has_v else [])
    if layout is Layout.NHD:  # token runs are maximal: scaled to bytes they need no coalescing
        rows = _token_runs(src_pages, dst_pages, g.page_size, dst.geometry.page_size, start, stop)
        ops = [_scaled(rows, n * d * g.itemsize) for d in dims]
    elif layout is Layout.HND:
        ops = [_hnd_ops(t, src, dst, src_pages, dst_pages, start, stop, d) for d in dims]
    elif layout is Layout.HND_KV:
        ops = [_hnd_ops(t, src, dst, src_pages, dst_pages, start, stop, g.head_dim, kinds=2)]
    else:  # NHD_KV: a token's heads are one row of heads x (K + V): token runs, any page sizes
        rows = _token_runs(src_pages, dst_pages, g.page_size, dst.geometry.page_size, start, stop)
        ops = [_scaled(rows, n * sum(dims) * g.itemsize)]
    return ops[0], (ops[1] if len(ops) > 1 else None)


def _scaled(rows: np.ndarray, row_bytes: int) -> np.ndarray:
    """``_token_runs``' rows as read-only byte ops. The runs end only where a side's rows
    stop being consecutive, so the ops are already what ``coalesce`` would make of them."""
    ops = rows * row_bytes
    ops.setflags(write=False)
    return ops


def _per_token_ops(
    t: HeadTransfer,
    src: RankPlacement,
    dst: RankPlacement,
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    start: int,
    stop: int,
) -> _KVOps:
    """One op per token and head run (NHD: the token's head slice; HND: each head's slot).
    Both sides HND_KV: the K and the V row of each head's slot, all in one op list. Both sides
    NHD_KV: the token's head slice of K-and-V rows, one op."""
    g, gd = src.geometry, dst.geometry
    tok = np.arange(start, stop, dtype=np.int64)
    sp, ss = src_pages[tok // g.page_size], tok % g.page_size
    dp, ds = dst_pages[tok // gd.page_size], tok % gd.page_size
    if g.layout is Layout.NHD_KV:  # per_token_possible: both sides NHD_KV
        item = (g.head_dim + _v_head_dim(g)) * g.itemsize
        so = ((sp * g.page_size + ss) * src.num_local_heads + t.src_head_start) * item
        do = ((dp * gd.page_size + ds) * dst.num_local_heads + t.dst_head_start) * item
        ops = np.stack([so, do, np.full(tok.size, t.num_heads * item, dtype=np.int64)], axis=1)
        ops.setflags(write=False)
        return ops, None
    out: list[np.ndarray] = []
    kinds = [(g.head_dim, 0)] + ([(_v_head_dim(g), 1)] if g.has_v else [])
    for dim, kind in kinds:
        item = dim * g.itemsize
        if g.layout is Layout.NHD and gd.layout is Layout.NHD:
            ops = np.empty((tok.size, 3), dtype=np.int64)  # filled by column: fewer temporaries
            ops[:, 0] = ((sp * g.page_size + ss) * src.num_local_heads + t.src_head_start) * item
            ops[:, 1] = ((dp * gd.page_size + ds) * dst.num_local_heads + t.dst_head_start) * item
            ops[:, 2] = t.num_heads * item
        else:
            h = np.arange(t.num_heads, dtype=np.int64)[None, :]

            def off(
                place: RankPlacement,
                layout: Layout,
                pages: np.ndarray,
                slots: np.ndarray,
                size: int,
                head0: int,
                h: np.ndarray = h,
                item: int = item,
                kind: int = kind,
            ) -> np.ndarray:
                if layout is Layout.NHD:
                    return ((pages * size + slots)[:, None] * place.num_local_heads + head0 + h) * item
                if layout is Layout.HND_KV:  # tiles of K rows then V rows
                    tile = (pages[:, None] * place.num_local_heads + head0 + h) * 2 * size
                    return (tile + kind * size + slots[:, None]) * item
                return ((pages[:, None] * place.num_local_heads + head0 + h) * size + slots[:, None]) * item

            so = off(src, g.layout, sp, ss, g.page_size, t.src_head_start).reshape(-1)
            do = off(dst, gd.layout, dp, ds, gd.page_size, t.dst_head_start).reshape(-1)
            ops = np.stack([so, do, np.full(so.size, item, dtype=np.int64)], axis=1)
        ops.setflags(write=False)
        out.append(ops)
    if g.packed_kv and len(out) > 1:  # one buffer per layer: its K and V rows in one list
        both = np.concatenate(out)
        both.setflags(write=False)
        return both, None
    return out[0], (out[1] if len(out) > 1 else None)


def _token_runs(src_pages: np.ndarray, dst_pages: np.ndarray, ps: int, pd: int, start: int, stop: int) -> np.ndarray:
    """``[N, 3]`` rows of (src_row, dst_row, num_rows) covering tokens [start, stop) of NHD
    pools, split wherever either side's rows stop being consecutive."""
    if stop <= start:
        return np.zeros((0, 3), dtype=np.int64)
    # Rows can only stop being consecutive where a page ends on either side.
    cand = np.arange(-(-(start + 1) // ps) * ps, stop, ps, dtype=np.int64)
    if pd != ps:
        cand = np.union1d(cand, np.arange(-(-(start + 1) // pd) * pd, stop, pd, dtype=np.int64))
    cand = cand[(cand > start) & (cand < stop)]

    def rows(pages: np.ndarray, size: int, tok: np.ndarray) -> np.ndarray:
        return pages[tok // size] * size + tok % size

    if not cand.size:  # inside one page on both sides: one run
        return np.array(
            [[src_pages[start // ps] * ps + start % ps, dst_pages[start // pd] * pd + start % pd, stop - start]],
            dtype=np.int64,
        )
    keep = (rows(src_pages, ps, cand) != rows(src_pages, ps, cand - 1) + 1) | (
        rows(dst_pages, pd, cand) != rows(dst_pages, pd, cand - 1) + 1
    )
    starts = np.concatenate(([start], cand[keep])).astype(np.int64)
    stops = np.concatenate((starts[1:], [stop]))
    out = np.empty((starts.size, 3), dtype=np.int64)
    out[:, 0] = rows(src_pages, ps, starts)
    out[:, 1] = rows(dst_pages, pd, starts)
    out[:, 2] = stops - starts
    return out


def _hnd_ops(
    t: HeadTransfer,
    src: RankPlacement,
    dst: RankPlacement,
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    start: int,
    stop: int,
    dim: int,
    kinds: int = 1,
) -> np.ndarray:
    """Ops for HND pools with equal page size: a full page's head slice is contiguous
    (``num_heads * page_size * dim``); a partial page needs one op per head. ``kinds=2``:
    HND_KV pools, whose (page, head) tiles hold ``page_size`` K rows then ``page_size`` V
    rows, so a full page's head slice is ``num_heads * 2 * page_size`` rows and a partial
    page needs one op per head and kind."""
    if stop <= start:
        return np.zeros((0, 3), dtype=np.int64)
    size = src.geometry.page_size
    tile = kinds * size  # rows per (page, head) tile
    hs, hd = src.num_local_heads, dst.num_local_heads
    n = t.num_heads
    item = src.geometry.itemsize * dim
    first, last = start // size, (stop - 1) // size
    idx = np.arange(first, last + 1, dtype=np.int64)
    lo = np.maximum(start - idx * size, 0)
    hi = np.minimum(stop - idx * size, size)
    full = (lo == 0) & (hi == size)
    chunks = []
    # Full pages: one op each, [page][head_start .. head_start+n)[all tile rows][dim].
    fp = idx[full]
    chunks.append(
        (
            (src_pages[fp] * hs + t.src_head_start) * tile * item,
            (dst_pages[fp] * hd + t.dst_head_start) * tile * item,
            np.full(fp.size, n * tile * item, dtype=np.int64),
            fp,
        )
    )
    # Partial pages (at most the first and the last): one op per head (and kind).
    for i in np.flatnonzero(~full):
        p, a, b = int(idx[i]), int(lo[i]), int(hi[i])
        rows = (np.arange(n, dtype=np.int64)[:, None] * tile + np.arange(kinds, dtype=np.int64) * size).reshape(-1)
        chunks.append(
            (
                ((src_pages[p] * hs + t.src_head_start) * tile + rows + a) * item,
                ((dst_pages[p] * hd + t.dst_head_start) * tile + rows + a) * item,
                np.full(rows.size, (b - a) * item, dtype=np.int64),
                np.full(rows.size, p, dtype=np.int64),
            )
        )
    src_off = np.concatenate([c[0] for c in chunks])
    dst_off = np.concatenate([c[1] for c in chunks])
    sizes = np.concatenate([c[2] for c in chunks])
    order = np.argsort(np.concatenate([c[3] for c in chunks]), kind="stable")
    return coalesce(src_off[order], dst_off[order], sizes[order])
