"""One request's plan for one (writer, reader) pair, built once and sliced per chunk.

Owns ``RequestPlan``: the pair's head transfer, both placements, the request length, the
resolved data path, and both page lists, each page checked once (range; uniqueness on
the reader's side). The engine builds it when a reader's first chunk is known, extends it
as the writer hands over more pages (checking only the new ones), and cuts it by token
range (and layer range: ``nbytes``/``layer_buffers``) for every staging slot or direct write: a ``KVSlice`` costs a view of the page
list, a direct op list costs the pages of the range. ``plan_pair`` (``byteplan.py``) is
the one-shot form of the same planning.
Must not: do I/O, import torch, or re-check pages it already holds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from sglang_kvxfer.errors import PlanError
from sglang_kvxfer.geometry import RankPlacement, check_compatible
from sglang_kvxfer.planning.byteplan import (
    DIRECT_MIN_OP_BYTES,
    DirectPlan,
    PathCost,
    PoolMapping,
    _as_pages,
    _check_coverage,
    _check_transfer,
    _pages_needed,
    _parse_path,
    _plan_range,
    _resolve_num_tokens,
    _resolve_range,
    _v_head_dim,
    per_token_possible,
    per_token_row_count,
    side_slice,
    staged_op_count,
)
from sglang_kvxfer.planning.kvslice import DataPath, KVSlice
from sglang_kvxfer.planning.pathcost import prefers_rows
from sglang_kvxfer.planning.tp import HeadTransfer

__all__ = ["RequestPlan"]


@dataclass(frozen=True)
class RequestPlan:
    """What one writer moves to one reader for one whole request.

    ``path`` is resolved: ``DIRECT``, ``STAGED``, ``FUSED`` or ``PER_TOKEN`` (never ``AUTO``).
    ``src_pages`` may cover fewer tokens than ``num_tokens`` while the writer's chunks
    arrive (``extend``); ``dst_pages`` is the reader's whole list. Both are read-only
    ``int64`` arrays. ``token_nbytes`` is the payload of one token (all layers, K and V).
    """

    transfer: HeadTransfer
    src: RankPlacement
    dst: RankPlacement
    num_tokens: int
    path: DataPath
    reason: str
    src_pages: np.ndarray
    dst_pages: np.ndarray
    token_nbytes: int
    # the direct ops ``build`` made of the whole request while choosing its path (pages are
    # only appended, so they stay right): ``direct`` of that range hands them out again
    whole: DirectPlan | None = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def build(
        cls,
        transfer: HeadTransfer,
        src: RankPlacement,
        dst: RankPlacement,
        src_pages: Any,
        dst_pages: Any,
        *,
        num_tokens: int,
        path: DataPath | str | None = DataPath.AUTO,
        direct_min_op_bytes: int | None = None,
        cost: PathCost | None = None,
        mapping: PoolMapping | None = None,
    ) -> RequestPlan:
        """Check the pair and both page lists and resolve the path.

        ``auto`` applies ``plan_pair``'s rule to the tokens the page lists cover now (the
        engine's reader plans with the whole request): ``direct_min_op_bytes`` when given,
        else the transport's ``cost``, else the fixed rule at ``DIRECT_MIN_OP_BYTES``, and
        with ``mapping`` (the reader's pool mapped in the writer's process) the fused path
        too; ``direct`` falls back to staged where the bytes are not contiguous, ``fused``
        to ``auto``'s choice of direct and staged where the pool is not mapped, with the
        reason in ``reason``.

        Raises:
            PlanError, IncompatibleGeometryError: as ``plan_pair``.
        """
        compat = check_compatible(src.geometry, dst.geometry)
        transfer = _check_transfer(transfer, src, dst)
        gs, gd = src.geometry, dst.geometry
        src_arr = _as_pages("src_pages", src_pages, gs.num_pages, unique=False)
        dst_arr = _as_pages("dst_pages", dst_pages, gd.num_pages, unique=True)
        total = _resolve_num_tokens(num_tokens, src_arr, dst_arr, gs.page_size, gd.page_size)
        choice = _parse_path(path)
        whole = None
        if choice is DataPath.PER_TOKEN and per_token_possible(src, dst):
            resolved, reason = DataPath.PER_TOKEN, "one op per token (SGLang's pattern; benchmark baseline)"
        else:
            covered = min(total, len(src_arr) * gs.page_size, len(dst_arr) * gd.page_size)
            rule = cost if direct_min_op_bytes is None else direct_min_op_bytes
            pair = _plan_range(transfer, src, dst, src_arr, dst_arr, 0, covered, choice, rule, compat, mapping)
            resolved, reason = pair.path, pair.reason
            if resolved is DataPath.DIRECT and covered == total and isinstance(pair, DirectPlan):
                whole = pair
            if (
                choice is DataPath.AUTO
                and resolved is DataPath.STAGED
                and isinstance(rule, PathCost)
                and rule.row_writes
                and covered
                and per_token_possible(src, dst)
            ):
                rows = per_token_row_count(transfer, src, dst, covered)
                by_rows, terms = prefers_rows(rows, pair.nbytes, pair.staged_op_count, rule)
                if by_rows:
                    resolved, reason = DataPath.PER_TOKEN, f"{reason}; written row by row instead: {terms}"
        token_nbytes = gs.num_layers * transfer.num_heads * (gs.head_dim + _v_head_dim(gs)) * gs.itemsize
        return cls(
            transfer=transfer,
            src=src,
            dst=dst,
            num_tokens=total,
            path=resolved,
            reason=reason,
            src_pages=src_arr,
            dst_pages=dst_arr,
            token_nbytes=token_nbytes,
            whole=whole,
        )

    def extend(self, pages: Any) -> RequestPlan:
        """This plan with the writer's next ``pages`` appended (only they are checked)."""
        gs = self.src.geometry
        new = np.asarray(pages)
        if new.ndim != 1 or (new.size and not np.issubdtype(new.dtype, np.integer)):
            raise PlanError(f"src_pages must be a 1-D list of integer page ids, got {new.dtype} {new.shape}")
        new = new.astype(np.int64)
        bad = np.flatnonzero((new < 0) | (new >= gs.num_pages))
        if bad.size:
            i = int(bad[0])
            raise PlanError(
                f"src_pages[{len(self.src_pages) + i}]={int(new[i])} is outside the pool's pages [0, {gs.num_pages})"
            )
        need = _pages_needed(self.num_tokens, gs.page_size)
        if len(self.src_pages) + new.size > need:
            raise PlanError(
                f"prefill page list has {len(self.src_pages) + new.size} page(s) but "
                f"{self.num_tokens} tokens at page_size {gs.page_size} need at most {need}"
            )
        merged = np.concatenate([self.src_pages, new])
        merged.setflags(write=False)
        return dataclasses.replace(self, src_pages=merged)

    @property
    def staged(self) -> bool:
        return self.path is DataPath.STAGED

    @property
    def fused(self) -> bool:
        """One ``ops.copy_kv_heads`` per chunk from ``gather_slice`` into ``scatter_slice``
        of the reader's pool (mapped in the writer's process)."""
        return self.path is DataPath.FUSED

    def nbytes(self, start: int = 0, stop: int | None = None, layers: tuple[int, int] | None = None) -> int:
        """Payload bytes of tokens ``[start, stop)`` (default: the whole request), of layers
        ``[layers[0], layers[1])`` (default: every layer)."""
        stop = self.num_tokens if stop is None else stop
        n = self.token_nbytes * (stop - start)
        if layers is None:
            return n
        a, b = self.check_layers(layers)
        return n // self.src.geometry.num_layers * (b - a)

    def check_layers(self, layers: tuple[int, int]) -> tuple[int, int]:
        """``layers`` as ``(start, stop)`` inside ``[0, num_layers)``, non-empty.

        Raises:
            PlanError: naming the range and the model's layer count.
        """
        a, b = int(layers[0]), int(layers[1])
        num_layers = self.src.geometry.num_layers
        if not 0 <= a < b <= num_layers:
            raise PlanError(f"layers [{a}, {b}) must be a non-empty part of the model's layers [0, {num_layers})")
        return a, b

    def layer_buffers(self, buffers: Any, layers: tuple[int, int] | None, side: str = "src") -> tuple[Any, Any]:
        """``(k_buffers, v_buffers)`` of layers ``[layers[0], layers[1])`` (None: every
        layer) of a pool's ``buffers`` (K of every layer, then V; HND_KV: one per layer), as
        ``ops.gather_kv_heads`` / ``ops.scatter_kv_heads`` take them: a gather or scatter of
        fewer layers writes or reads a staging ``[layer][K|V][token][heads][dim]`` of those
        layers only. ``side`` picks the geometry (``"src"`` or ``"dst"``)."""
        g = (self.src if side == "src" else self.dst).geometry
        a, b = (0, g.num_layers) if layers is None else self.check_layers(layers)
        k = buffers[a:b]
        return k, (buffers[g.num_layers + a : g.num_layers + b] if g.has_v else None)

    @staticmethod
    def buffer_layer(geometry: Any, buffer_index: int) -> int:
        """The layer buffer ``buffer_index`` of a pool holds (K of every layer, then V)."""
        return buffer_index % geometry.num_layers

    @staticmethod
    def staged_op_count(nbytes: int) -> int:
        return staged_op_count(nbytes)

    def _range(self, start: int, stop: int) -> tuple[int, int]:
        start, stop = _resolve_range(start, stop, self.num_tokens)
        _check_coverage(self.src_pages, self.dst_pages, self.src.geometry.page_size, self.dst.geometry.page_size, stop)
        return start, stop

    def gather_slice(self, start: int, stop: int) -> KVSlice:
        """Tokens ``[start, stop)`` of the writer's pool, for ``ops.gather_kv_heads`` (or the
        source of ``ops.copy_kv_heads``)."""
        start, stop = self._range(start, stop)
        return side_slice(self.src, self.src_pages, self.transfer.src_head_start, self.transfer.num_heads, start, stop)

    def scatter_slice(self, start: int, stop: int) -> KVSlice:
        """Tokens ``[start, stop)`` of the reader's pool, for ``ops.scatter_kv_heads`` (or the
        destination of ``ops.copy_kv_heads``)."""
        start, stop = self._range(start, stop)
        return side_slice(self.dst, self.dst_pages, self.transfer.dst_head_start, self.transfer.num_heads, start, stop)

    def direct(self, start: int, stop: int) -> DirectPlan:
        """The direct (or per-token) ops of tokens ``[start, stop)``; the pages are not re-checked.

        Raises:
            PlanError: the plan is staged, or the range is outside the request or the pages.
        """
        if self.path in (DataPath.STAGED, DataPath.FUSED):
            raise PlanError(
                f"the plan of prefill rank {self.transfer.prefill_rank} -> decode rank "
                f"{self.transfer.decode_rank} is {self.path} ({self.reason}), not direct"
            )
        start, stop = self._range(start, stop)
        if self.whole is not None and start == 0 and stop == self.num_tokens:
            return self.whole
        compat = check_compatible(self.src.geometry, self.dst.geometry)
        plan = _plan_range(
            self.transfer,
            self.src,
            self.dst,
            self.src_pages,
            self.dst_pages,
            start,
            stop,
            self.path,
            DIRECT_MIN_OP_BYTES,
            compat,
        )
        if not isinstance(plan, DirectPlan):
            # Contiguity depends only on the two geometries, which `build` found contiguous.
            raise PlanError(
                f"tokens [{start}, {stop}) of prefill rank {self.transfer.prefill_rank} -> decode "
                f"rank {self.transfer.decode_rank} are not contiguous ({plan.reason})"
            )
        return plan
