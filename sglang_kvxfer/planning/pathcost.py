"""Which path ``auto`` takes for one (writer, reader) pair, and why, with the numbers.

Owns ``PathCost`` (what a transport declares its writes cost in one kind of memory),
``PoolMapping`` (whether the reader's KV pool is mapped writable in the writer's process,
the fused path's precondition, and where or why not) and the two rules: ``prefers_direct``
(direct page runs against staging, for a pair whose bytes are contiguous on both sides) and
``prefers_fused`` (one pool -> pool pass against what the first rule chose, where the
reader's pool is mapped). Both return the clause that goes into the plan's ``reason``.
Must not: look at page lists (``byteplan.py`` counts the ops) or do I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sglang_kvxfer.planning.kvslice import DataPath

__all__ = ["DIRECT_MIN_OP_BYTES", "PathCost", "PoolMapping", "prefers_direct", "prefers_fused"]

DIRECT_MIN_OP_BYTES = 64 * 1024  # the fixed rule's threshold, where no transport cost is given


@dataclass(frozen=True)
class PathCost:
    """What ``auto`` weighs to pick a pair's path: one transport's costs in one kind of
    memory (a transport declares them: ``Transport.path_cost(device)``).

    ``per_op_s``: seconds to post one write op (a direct page run, or one staged slot);
    ``bytes_per_s``: the transport's bandwidth for those writes; ``copy_bytes_per_s``: a
    gather or a scatter, the two extra copies of the staged path, and the fused copy's one
    pass; ``stage_fixed_s``: what staging adds once whatever the bytes (the gather and scatter
    launches and the reader's ChunkReady/ChunkAck hop); ``fused_fixed_s``: what one fused
    copy adds whatever the bytes (its argument checks and launch, and mapping the reader's
    pool regions); ``source``: where the numbers come from, quoted in plan reasons;
    ``row_writes``: the transport moves the many small entries of one write cheaply (``tcp``
    with ``writev``/``readv``), so ``auto`` also weighs a strided pair's token rows
    (``prefers_rows``) where only staging would otherwise do. The
    estimates::

        direct = ops x per_op_s + bytes / bytes_per_s
        staged = 2 x bytes / copy_bytes_per_s + slots x per_op_s + stage_fixed_s + bytes / bytes_per_s
        fused  = fused_fixed_s + bytes / copy_bytes_per_s     (where the reader's pool is mapped)
    """

    per_op_s: float
    bytes_per_s: float
    copy_bytes_per_s: float
    stage_fixed_s: float = 100e-6
    source: str = "declared"
    fused_fixed_s: float = 50e-6
    row_writes: bool = False  # entries of a write move as iovecs: auto may write a strided pair row by row

    def __post_init__(self) -> None:
        for name in ("per_op_s", "bytes_per_s", "copy_bytes_per_s", "stage_fixed_s", "fused_fixed_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"PathCost.{name}={value!r} must be a finite number")
            rate = name.endswith("bytes_per_s")
            if value < 0 or (value == 0 and rate):
                raise ValueError(f"PathCost.{name}={value!r} must be {'> 0' if rate else '>= 0'}")

    def direct_s(self, ops: int, nbytes: int) -> float:
        """Estimated seconds of ``ops`` direct writes moving ``nbytes``."""
        return ops * self.per_op_s + nbytes / self.bytes_per_s

    def staged_s(self, slots: int, nbytes: int) -> float:
        """Estimated seconds of gather + ``slots`` writes + scatter of ``nbytes``."""
        return (
            2 * nbytes / self.copy_bytes_per_s + slots * self.per_op_s + self.stage_fixed_s + nbytes / self.bytes_per_s
        )

    def fused_s(self, nbytes: int) -> float:
        """Estimated seconds of one fused pool -> pool copy of ``nbytes``."""
        return self.fused_fixed_s + nbytes / self.copy_bytes_per_s


@dataclass(frozen=True)
class PoolMapping:
    """Whether the reader's KV pool is mapped writable in the writer's process, on the
    device of the writer's pool (so one ``ops.copy_kv_heads`` can write it), and ``note``:
    where (``"local shared memory, cpu"``) or why not, quoted in plan reasons. The writer
    finds it out when it imports the reader's regions at registration."""

    mapped: bool
    note: str


def prefers_direct(
    direct_count: int,
    nbytes: int,
    ops_per_buffer: int,
    rule: int | PathCost | None,
    staged_ops: int = 1,
) -> tuple[bool, str]:
    """``auto``'s choice between direct and staged for a contiguous pair, and why."""
    avg = nbytes / max(direct_count, 1)
    if isinstance(rule, PathCost):
        cost = rule
        direct_s, staged_s = cost.direct_s(direct_count, nbytes), cost.staged_s(staged_ops, nbytes)
        terms = (
            f"direct {direct_count} op(s) x {cost.per_op_s * 1e6:.3g} us + {nbytes} B / "
            f"{cost.bytes_per_s / 1e9:.3g} GB/s = {direct_s * 1e3:.3g} ms "
            f"{'<=' if direct_s <= staged_s else '>'} staged 2 x {nbytes} B / "
            f"{cost.copy_bytes_per_s / 1e9:.3g} GB/s + {staged_ops} slot(s) x "
            f"{cost.per_op_s * 1e6:.3g} us + {cost.stage_fixed_s * 1e6:.3g} us + {nbytes} B / "
            f"{cost.bytes_per_s / 1e9:.3g} GB/s = {staged_s * 1e3:.3g} ms ({cost.source})"
        )
        if direct_s <= staged_s:
            return True, f"contiguous on both sides, {avg:.0f} B per op: {terms}"
        return False, f"contiguous but fragmented, {avg:.0f} B per op: {terms}; staging is cheaper"
    rule = DIRECT_MIN_OP_BYTES if rule is None else rule
    if ops_per_buffer <= 4 or avg >= rule:
        return True, (
            f"contiguous on both sides ({ops_per_buffer} op(s) per buffer, {avg:.0f} B per op; "
            f"the fixed rule, direct_min_op_bytes={rule}, KVXFER_DIRECT_MIN_OP_BYTES)"
        )
    return False, (
        f"contiguous but fragmented ({ops_per_buffer} ops per buffer of {avg:.0f} B "
        f"< direct_min_op_bytes={rule}, the fixed rule, KVXFER_DIRECT_MIN_OP_BYTES); staging is fewer, larger writes"
    )


def prefers_fused(
    current: DataPath, nbytes: int, direct_count: int | None, staged_ops: int, rule: int | PathCost | None
) -> tuple[bool, str]:
    """Whether ``auto`` takes the fused path over ``current`` (``DIRECT`` or ``STAGED``,
    what ``prefers_direct`` or the layouts chose) for a pair whose reader pool is mapped,
    and the comparison for the reason. The cost rule weighs one pass against ``current``'s
    estimate (ties go to ``current``); the fixed rule, which weighs no cost, replaces a
    staged pair's two copies by one pass and keeps direct page runs (one pass already)."""
    if isinstance(rule, PathCost):
        fused_s = rule.fused_s(nbytes)
        if current is DataPath.DIRECT and direct_count is not None:
            other_s = rule.direct_s(direct_count, nbytes)
        else:
            other_s = rule.staged_s(staged_ops, nbytes)
        terms = (
            f"fused 1 pass, {rule.fused_fixed_s * 1e6:.3g} us + {nbytes} B / {rule.copy_bytes_per_s / 1e9:.3g} GB/s "
            f"= {fused_s * 1e3:.3g} ms {'<' if fused_s < other_s else '>='} {current} {other_s * 1e3:.3g} ms "
            f"({rule.source})"
        )
        return fused_s < other_s, terms
    if current is DataPath.STAGED:
        return True, "one pass instead of gather + scatter (the fixed rule, which weighs no cost)"
    return False, "direct page runs are one pass already (the fixed rule, which weighs no cost)"


def prefers_rows(rows: int, nbytes: int, staged_ops: int, cost: PathCost) -> tuple[bool, str]:
    """Whether ``auto`` writes a strided pair row by row (one op per token row, as a
    transport that moves many small entries cheaply, ``tcp`` with ``writev``, can) instead of
    staging it, and the comparison for the reason (ties go to staging)."""
    rows_s, staged_s = cost.direct_s(rows, nbytes), cost.staged_s(staged_ops, nbytes)
    terms = (
        f"{rows} row(s) x {cost.per_op_s * 1e6:.3g} us + {nbytes} B / {cost.bytes_per_s / 1e9:.3g} GB/s "
        f"= {rows_s * 1e3:.3g} ms {'<' if rows_s < staged_s else '>='} staged {staged_s * 1e3:.3g} ms ({cost.source})"
    )
    return rows_s < staged_s, terms
