"""TP slice plans: which KV heads go from which prefill rank to which decode rank.

Owns ``HeadTransfer`` and ``TPPlan`` and the pure function ``plan_tp``. Plans are built by
intersecting owned-head sets (``geometry.owned_heads``), never by closed-form offset
formulas, so every valid (H, P, D) is handled the same way, replication included.

Writer election: when several prefill ranks hold the same head (P > H, or MLA), exactly
one of them writes it to a given decode rank. The choice rotates with ``salt`` (the
engine passes the request's room id) and with the decode rank, so the replicas share the
load. Candidate pairs (prefill rank, decode rank) are the pairs that *could* be elected for
some salt; the engine exchanges per-request metadata along exactly those pairs.

No I/O, no numpy, no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

from sglang_kvxfer.geometry import owned_heads, validate_tp

__all__ = ["HeadTransfer", "TPPlan", "plan_tp", "candidate_prefill_ranks", "candidate_decode_ranks"]


@dataclass(frozen=True)
class HeadTransfer:
    """One (writer, reader) pair and the heads it moves.

    ``src_head_start`` and ``dst_head_start`` are *local* head indices on the prefill and
    decode rank; ``global_head_start`` is the model's head index of the first one.
    """

    prefill_rank: int
    decode_rank: int
    src_head_start: int
    dst_head_start: int
    num_heads: int
    global_head_start: int

    def to_dict(self) -> dict[str, int]:
        return {
            "prefill_rank": self.prefill_rank,
            "decode_rank": self.decode_rank,
            "src_head_start": self.src_head_start,
            "dst_head_start": self.dst_head_start,
            "num_heads": self.num_heads,
        }


@dataclass(frozen=True)
class TPPlan:
    """Who writes which heads to whom, for one request (one ``salt``).

    ``transfers`` is sorted by (decode rank, destination head). Every decode head slot has
    exactly one writer, and every transfer moves heads its reader owns.
    """

    total_kv_heads: int
    prefill_tp: int
    decode_tp: int
    mla: bool
    salt: int
    transfers: tuple[HeadTransfer, ...]
    # Indexes built by __post_init__ (not constructor arguments).
    _by_decode: dict[int, tuple[HeadTransfer, ...]] = field(init=False, repr=False, compare=False)
    _by_prefill: dict[int, tuple[HeadTransfer, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_d: dict[int, list[HeadTransfer]] = {d: [] for d in range(self.decode_tp)}
        by_p: dict[int, list[HeadTransfer]] = {p: [] for p in range(self.prefill_tp)}
        for t in self.transfers:
            by_d[t.decode_rank].append(t)
            by_p[t.prefill_rank].append(t)
        object.__setattr__(self, "_by_decode", {k: tuple(v) for k, v in by_d.items()})
        object.__setattr__(self, "_by_prefill", {k: tuple(v) for k, v in by_p.items()})

    def writers_of(self, decode_rank: int) -> tuple[HeadTransfer, ...]:
        """Transfers a decode rank receives (one per writer)."""
        return self._by_decode[self._check(decode_rank, self.decode_tp, "decode_rank")]

    def readers_of(self, prefill_rank: int) -> tuple[HeadTransfer, ...]:
        """Transfers a prefill rank performs (one per reader); empty when it is not elected."""
        return self._by_prefill[self._check(prefill_rank, self.prefill_tp, "prefill_rank")]

    def num_writers(self, decode_rank: int) -> int:
        """How many prefill ranks a decode rank must hear from before it is complete."""
        return len(self.writers_of(decode_rank))

    def decode_targets(self, prefill_rank: int) -> tuple[int, ...]:
        """Decode ranks this prefill rank writes to for this request."""
        return tuple(t.decode_rank for t in self.readers_of(prefill_rank))

    @staticmethod
    def _check(rank: int, size: int, name: str) -> int:
        if not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"{name}={rank!r} must be in [0, {size})")
        return rank

    def to_dict(self) -> dict[str, Any]:
        return {
            "total_kv_heads": self.total_kv_heads,
            "prefill_tp": self.prefill_tp,
            "decode_tp": self.decode_tp,
            "mla": self.mla,
            "transfers": [t.to_dict() for t in self.transfers],
        }


def candidate_prefill_ranks(
    total_kv_heads: int, prefill_tp: int, decode_tp: int, decode_rank: int, mla: bool = False
) -> tuple[int, ...]:
    """Prefill ranks that may write to ``decode_rank`` for some request (election candidates)."""
    validate_tp(total_kv_heads, prefill_tp, mla, "prefill")
    mine = owned_heads(total_kv_heads, decode_tp, decode_rank, mla)
    if mla:
        return _mla_candidates(prefill_tp, decode_tp, decode_rank)
    return tuple(p for p in range(prefill_tp) if _overlap(owned_heads(total_kv_heads, prefill_tp, p), mine))


def candidate_decode_ranks(
    total_kv_heads: int, prefill_tp: int, decode_tp: int, prefill_rank: int, mla: bool = False
) -> tuple[int, ...]:
    """Decode ranks ``prefill_rank`` may write to for some request."""
    validate_tp(total_kv_heads, decode_tp, mla, "decode")
    owned_heads(total_kv_heads, prefill_tp, prefill_rank, mla)  # validates rank and size
    return tuple(
        d
        for d in range(decode_tp)
        if prefill_rank in candidate_prefill_ranks(total_kv_heads, prefill_tp, decode_tp, d, mla)
    )


def _mla_candidates(prefill_tp: int, decode_tp: int, decode_rank: int) -> tuple[int, ...]:
    # Every prefill rank holds the latent. Restrict each decode rank to a disjoint share of
    # the prefill ranks so per-request metadata fans out to max(P, D) pairs, not P * D.
    if decode_tp >= prefill_tp:
        return (decode_rank % prefill_tp,)
    return tuple(range(decode_rank, prefill_tp, decode_tp))


def _overlap(a: range, b: range) -> bool:
    return max(a.start, b.start) < min(a.stop, b.stop)


def plan_tp(total_kv_heads: int, prefill_tp: int, decode_tp: int, mla: bool = False, salt: int = 0) -> TPPlan:
    """Build the TP slice plan for one request.

    Args:
        total_kv_heads: the model's un-sharded KV head count H (1 for MLA).
        prefill_tp, decode_tp: TP sizes P and D of the two sides.
        mla: MLA latent cache (one head replicated on every rank).
        salt: rotates writer election among replicas (the engine uses the room id).

    Raises:
        GeometryError: an (H, T) pair is invalid (the message names H and T).
    """
    validate_tp(total_kv_heads, prefill_tp, mla, "prefill")
    validate_tp(total_kv_heads, decode_tp, mla, "decode")
    if isinstance(salt, bool) or not isinstance(salt, int) or salt < 0:
        raise ValueError(f"salt={salt!r} must be a non-negative integer")
    transfers: list[HeadTransfer] = []
    for d in range(decode_tp):
        if mla:
            cands = _mla_candidates(prefill_tp, decode_tp, d)
            p = cands[salt % len(cands)]
            transfers.append(HeadTransfer(p, d, 0, 0, 1, 0))
            continue
        transfers.extend(_mha_writers(total_kv_heads, prefill_tp, decode_tp, d, salt))
    return TPPlan(total_kv_heads, prefill_tp, decode_tp, mla, salt, tuple(transfers))


def _elect(total_kv_heads: int, prefill_tp: int, decode_tp: int, decode_rank: int, head: int, salt: int) -> int:
    """The prefill rank that writes global ``head`` to ``decode_rank``."""
    if prefill_tp <= total_kv_heads:
        return head // (total_kv_heads // prefill_tp)
    replicas = prefill_tp // total_kv_heads
    # Index of this decode rank among those needing `head`: consecutive readers of one head
    # take consecutive replicas, and the salt shifts the whole assignment per request.
    if decode_tp > total_kv_heads:
        k = decode_rank - head * (decode_tp // total_kv_heads)
    else:
        k = 0
    return head * replicas + (k + salt) % replicas


def _mha_writers(
    total_kv_heads: int, prefill_tp: int, decode_tp: int, decode_rank: int, salt: int
) -> list[HeadTransfer]:
    mine = owned_heads(total_kv_heads, decode_tp, decode_rank)
    out: list[HeadTransfer] = []
    # One transfer per run of consecutive heads elected to the same writer.
    runs = groupby(mine, key=lambda h: _elect(total_kv_heads, prefill_tp, decode_tp, decode_rank, h, salt))
    for writer, heads in runs:
        run = list(heads)
        run_start, stop = run[0], run[-1] + 1
        src = owned_heads(total_kv_heads, prefill_tp, writer)
        out.append(
            HeadTransfer(
                prefill_rank=writer,
                decode_rank=decode_rank,
                src_head_start=run_start - src.start,
                dst_head_start=run_start - mine.start,
                num_heads=stop - run_start,
                global_head_start=run_start,
            )
        )
    return out
