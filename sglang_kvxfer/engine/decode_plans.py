"""How a decode rank plans a request's writers: their paths and staging windows.

Owns ``DecodePlanning``, the part of ``DecodeManager`` that builds one ``RequestPlan`` per
elected writer (the pair's path: direct, staged, or fused where that writer maps this
rank's pool, by the transport's cost; the prefill follows the choice) and lends each
staged writer its window of two staging slots. A fused or direct writer gets no window and
sends no chunks: its ``TransferDone`` counts bytes only. A sparse room (the writers pick the
pages) is never staged: the reader could not scatter pages it does not know of.
Must not: send messages or move bytes (``decode.py`` does), or decide what a writer maps
(its ``RegisterReply`` says so: ``PrefillGroup.mappings``).
"""

from __future__ import annotations

import numpy as np

from sglang_kvxfer.engine.decode_rooms import DecodeRoom, PrefillGroup
from sglang_kvxfer.engine.manager import RankBase
from sglang_kvxfer.errors import PlanError, TransferFailedError
from sglang_kvxfer.geometry import RankPlacement
from sglang_kvxfer.planning import DataPath, HeadTransfer, PoolMapping, RequestPlan, TokenSelection
from sglang_kvxfer.planning.byteplan import contiguous_layout, per_token_possible
from sglang_kvxfer.planning.pathcost import PathCost
from sglang_kvxfer.protocol.fields import STAGING_SLOTS

__all__ = ["DecodePlanning"]

UNMAPPED = PoolMapping(False, "the prefill rank did not say it maps this rank's pool")


class DecodePlanning(RankBase[DecodeRoom]):
    """Writer plans and staging windows of ``DecodeManager`` (a mixin over ``RankBase``)."""

    _path_cost: tuple[PathCost | None] | None  # set by DecodeManager.__init__: (cost,) once asked

    def _plan_writers(
        self, rec: DecodeRoom, writers: dict[int, HeadTransfer], group: PrefillGroup
    ) -> dict[int, RequestPlan]:
        """One ``RequestPlan`` per writer, built once per request: it picks the pair's path
        and cuts every staged chunk's scatter slice."""
        plans: dict[int, RequestPlan] = {}
        for p, t in writers.items():
            src = group.placements[p]
            n_src = -(-rec.request_tokens // src.geometry.page_size)
            if n_src > src.geometry.num_pages:
                raise TransferFailedError(
                    f"a {rec.request_tokens}-token request needs {n_src} prefill pages; "
                    f"prefill pools hold {src.geometry.num_pages}",
                    rec.room,
                )
            if not rec.selection.every:  # the writer reads this rank's tokens as one-token pages
                try:
                    src = TokenSelection.row_view(src)
                except PlanError as exc:
                    raise TransferFailedError(f"prefill rank {p}: {exc}", rec.room) from None
                n_src = rec.num_tokens
            # Path choice with the real decode pages, assuming prefill pages are contiguous
            # (decode cannot know them); prefill follows this choice.
            plans[p] = RequestPlan.build(
                t,
                src,
                self.placement,
                np.arange(n_src),
                rec.pages,
                num_tokens=rec.num_tokens,
                path=self.config.data_path,
                direct_min_op_bytes=self.config.direct_min_op_bytes,
                cost=self._transport_cost(),
                mapping=group.mappings.get(p, UNMAPPED),
            )
            if rec.sparse and plans[p].staged:  # a writer picks the pages: no window to scatter
                plans[p] = self._sparse_plan(rec, t, src, plans[p])
        return plans

    def _sparse_plan(self, rec: DecodeRoom, t: HeadTransfer, src: RankPlacement, staged: RequestPlan) -> RequestPlan:
        """The plan of a sparse room's writer whose pair ``auto`` staged: direct, or row by
        row where the bytes are not contiguous (the writer chooses the same)."""
        rows = contiguous_layout(t, src, self.placement) is None and per_token_possible(src, self.placement)
        plan = RequestPlan.build(
            t,
            src,
            self.placement,
            np.arange(len(staged.src_pages)),
            rec.pages,
            num_tokens=rec.num_tokens,
            path=DataPath.PER_TOKEN if rows else DataPath.DIRECT,
        )
        if plan.staged:
            raise TransferFailedError(
                f"prefill rank {t.prefill_rank}: a sparse request is written directly, but this pair's "
                f"bytes are not contiguous and cannot go row by row ({staged.reason})",
                rec.room,
            )
        return plan

    def _transport_cost(self) -> PathCost | None:
        """What a write into this rank's pool costs over its transport (``auto``'s cost rule;
        ``local`` measures it once per process), asked once. None with a fixed rule
        (``KVXFER_DIRECT_MIN_OP_BYTES``) or where the transport declares none."""
        if self._path_cost is None:
            cost = None
            if self.config.direct_min_op_bytes is None:
                cost = self._live_transport.path_cost(self.config.device)
            self._path_cost = (cost,)
        return self._path_cost[0]

    def _lend_windows(self, rec: DecodeRoom, plans: dict[int, RequestPlan]) -> dict[int, tuple[int, int]] | None:
        """Staging windows for the writers whose pair is staged; None if space is short now."""
        lent: dict[int, tuple[int, int]] = {}
        for p, plan in plans.items():
            nbytes = plan.nbytes()
            if not plan.staged or nbytes == 0:
                continue
            per_token = nbytes // rec.num_tokens
            slot = max(per_token, min(self.config.staging_slot_bytes, nbytes))
            staging = self._live_staging
            offset = staging.alloc(STAGING_SLOTS * slot)
            if offset is None:
                for off, _ in lent.values():
                    staging.free(off)
                if STAGING_SLOTS * slot > staging.cap_bytes:
                    raise TransferFailedError(
                        f"one token of this pair needs {slot} B of staging; the arena "
                        f"may hold {staging.cap_bytes} B (KVXFER_STAGING_BYTES)",
                        rec.room,
                    )
                return None
            lent[p] = (offset, STAGING_SLOTS * slot)
        return lent
