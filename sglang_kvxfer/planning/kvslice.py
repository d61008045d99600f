"""The small value types planning hands to the engine and the kernels.

Owns ``DataPath`` (how one (writer, reader) pair moves its bytes) and ``KVSlice`` (the
tokens x heads of one paged pool that one gather or scatter touches). Both are plain
values: no I/O, no torch, no validation against a pool (``_ops_args`` does that at the
kernel boundary; ``RequestPlan`` checks page lists once when it builds them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DataPath", "KVSlice"]


class DataPath(str, enum.Enum):
    """How a (writer, reader) pair moves its bytes. A ``str`` enum, so ``path == "direct"``
    and ``f"{path}"`` keep reading as the plain names (config, env, JSON, logs)."""

    AUTO = "auto"  # choose per pair by cost: direct, staged, or fused where the reader pool is mapped
    DIRECT = "direct"  # page runs, contiguous on both sides
    STAGED = "staged"  # gather -> one write -> scatter through staging slots
    PER_TOKEN = "per_token"  # one write per token and head run (SGLang's pattern; a baseline)
    FUSED = "fused"  # one pool -> pool copy into the reader's pool, mapped in the writer's process

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: Any) -> DataPath:
        """``DataPath`` from a name (None: ``auto``); a bad name is a ``ValueError`` listing them."""
        if isinstance(value, DataPath):
            return value
        try:
            return cls(str(value or "auto").lower())
        except ValueError:
            raise ValueError(f"path={value!r} must be one of {', '.join(p.value for p in cls)}") from None


@dataclass(frozen=True)
class KVSlice:
    """Tokens ``[token_offset, token_offset + num_tokens)`` of ``pages`` (request order,
    ``page_size`` tokens each), heads ``[head_start, head_start + num_heads)`` of a pool in
    ``layout``: what one ``ops.gather_kv_heads`` / ``ops.scatter_kv_heads`` call copies.

    ``pages`` is an ``int64 [num_page_ids]`` array (typically a read-only view of a plan's
    page list, cut to the pages the tokens touch).
    """

    pages: np.ndarray
    page_size: int
    head_start: int
    num_heads: int
    layout: str
    token_offset: int
    num_tokens: int

    def op_kwargs(self) -> dict[str, Any]:
        """The keyword form of the ops (``page_ids=...``, ``page_size=...``, ...)."""
        return {
            "page_ids": self.pages,
            "page_size": self.page_size,
            "head_start": self.head_start,
            "num_heads": self.num_heads,
            "layout": self.layout,
            "token_offset": self.token_offset,
            "num_tokens": self.num_tokens,
        }
