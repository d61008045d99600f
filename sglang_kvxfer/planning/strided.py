"""A reader that holds every ``stride``-th token of a request (decode context parallel).

Owns ``TokenSelection``: which tokens of a request one reader holds (``t % stride ==
phase``, counted from the first token sent), how many of a prefix of the request that is,
and the writer's side of such a pair seen token by token: the source pool as a page-size-1
view (``row_view``) and the selected tokens' rows as its page list (``rows``). A pair's
``RequestPlan`` built over that view moves the selected tokens, packed in order, into the
reader's pages; nothing else in planning or the kernels knows about strides.
Must not: do I/O or import torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from sglang_kvxfer.errors import PlanError
from sglang_kvxfer.geometry import Layout, RankPlacement

__all__ = ["TokenSelection", "EVERY_TOKEN"]


@dataclass(frozen=True)
class TokenSelection:
    """Tokens ``t`` with ``t % stride == phase`` of a request (``stride`` 1: all of them)."""

    stride: int = 1
    phase: int = 0

    def __post_init__(self) -> None:
        if self.stride < 1 or not 0 <= self.phase < self.stride:
            raise PlanError(f"token selection stride={self.stride}, phase={self.phase}: need 0 <= phase < stride")

    @property
    def every(self) -> bool:
        return self.stride == 1

    def count(self, tokens: int) -> int:
        """How many of the request's first ``tokens`` tokens are selected."""
        if self.every:
            return tokens
        return max(0, (tokens - self.phase + self.stride - 1) // self.stride)

    def rows(self, pages: np.ndarray, page_size: int, start: int, stop: int) -> np.ndarray:
        """Pool rows (page-size-1 ids) of the selected tokens ``[start, stop)`` (counted among
        the selected ones) of a request held in ``pages`` of ``page_size`` tokens."""
        t = self.phase + self.stride * np.arange(start, stop, dtype=np.int64)
        out = pages[t // page_size] * page_size + t % page_size
        out.setflags(write=False)
        return out

    @staticmethod
    def row_view(placement: RankPlacement) -> RankPlacement:
        """``placement`` as a pool of one-token pages (the same bytes: NHD only, whose rows
        are token-major), so any token can be addressed as a page of its own.

        Raises:
            PlanError: the layout does not store a token's heads as one row.
        """
        g = placement.geometry
        if g.layout is not Layout.NHD:
            raise PlanError(
                "a reader that holds every n-th token (decode context parallel) is written token by token, "
                f"which needs a token-major (NHD) pool; this pool's layout is {g.layout.value}"
            )
        if g.page_size == 1:
            return placement
        view = dataclasses.replace(g, page_size=1, num_pages=g.num_pages * g.page_size)
        return RankPlacement(view, placement.tp_size, placement.tp_rank, placement.all_heads)


EVERY_TOKEN = TokenSelection()
