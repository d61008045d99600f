"""``kvxfer plan``'s extra per-request state: the pools of SGLang's ``KVArgs.state_types``
(``integrations/sglang_state``) planned for the example request, each with its own geometry.

- ``--swa-layers`` (hybrid sliding-window attention): the SWA sub-pool, its own KV heads and
  head dim (``--swa-kv-heads``, ``--swa-head-dim``), holds the request's last window
  (``--swa-window`` tokens from a page-aligned start) and is re-sharded between TP sizes like
  the model's KV: its own TP plan, one row per (writer, reader).
- ``--mamba-layers`` with ``--mamba-row-bytes`` (one row size per state tensor, on one rank:
  conv, SSM...): a pool per tensor, one row (the request's slot) per layer, rank to rank;
  between TP sizes it is refused, as the backend refuses it.
- ``--dsa-layers`` with ``--dsa-row-bytes`` (one row per KV page, replicated like the MLA
  latent): one writer per decode rank, every page of the request.

With ``--prefill-pp`` each pool's layers are split over the stages as SGLang splits layers
(even, the last stages one more; a real model's stages hold the pool's layers that fall in
their own) and each stage's writers send its entries: one transfer list per stage.

Pure planning: no servers, no torch.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from sglang_kvxfer import envs
from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.integrations.sglang_args import pp_layer_split
from sglang_kvxfer.planning import plan_pair, plan_tp

__all__ = ["add_arguments", "build", "render"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--swa-layers", type=int, default=0, help="sliding-window layers in a SWA sub-pool (default 0)")
    p.add_argument("--swa-kv-heads", type=int, default=None, help="SWA layers' KV heads (default --total-kv-heads)")
    p.add_argument("--swa-head-dim", type=int, default=None, help="SWA layers' head dim (default --head-dim)")
    p.add_argument("--swa-window", type=int, default=4096, help="sliding window in tokens (default 4096)")
    p.add_argument("--mamba-layers", type=int, default=0, help="mamba layers with per-request state (default 0)")
    p.add_argument(
        "--mamba-row-bytes",
        default="",
        help="bytes of one slot's row of each mamba state tensor on one rank, e.g. 24576,262144 (conv, SSM)",
    )
    p.add_argument("--dsa-layers", type=int, default=0, help="layers with a DSA indexer buffer (default 0)")
    p.add_argument("--dsa-row-bytes", type=int, default=0, help="bytes of one KV page's DSA indexer row")


def _rows(text: str) -> list[int]:
    try:
        rows = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--mamba-row-bytes={text!r} must be a comma list of integers") from None
    if not rows or min(rows) < 1:
        raise ValueError(f"--mamba-row-bytes={text!r} must give at least one row size >= 1")
    return rows


def _pools(args: argparse.Namespace, ps: int) -> list[tuple[str, str, KVGeometry, int]]:
    """``(name, kind, geometry, indices of the example request)`` of every state pool."""
    out = []
    if args.swa_layers:
        start = max(0, args.tokens - args.swa_window) // ps * ps  # SGLang's _swa_payload
        g = KVGeometry(
            num_layers=args.swa_layers,
            total_kv_heads=args.swa_kv_heads or args.total_kv_heads,
            head_dim=args.swa_head_dim or args.head_dim,
            dtype=args.dtype,
            page_size=ps,
            num_pages=-(-(args.tokens - start) // ps) * 2,
        )
        out.append(("state:swa", "swa", g, args.tokens - start))
    if args.mamba_layers:
        rows = _rows(args.mamba_row_bytes)
        for i, row in enumerate(rows):
            g = _row_geometry(args.mamba_layers, row, 1)
            out.append((f"state:mamba.{i}" if len(rows) > 1 else "state:mamba", "mamba", g, 1))
    if args.dsa_layers:
        if args.dsa_row_bytes < 1:
            raise ValueError(f"--dsa-layers={args.dsa_layers} needs --dsa-row-bytes >= 1")
        pages = -(-args.tokens // ps)
        out.append(("state:dsa", "dsa", _row_geometry(args.dsa_layers, args.dsa_row_bytes, pages), pages))
    return out


def _row_geometry(layers: int, row_bytes: int, rows: int) -> KVGeometry:
    """One row per index, replicated geometry (as ``sglang_state`` describes mamba and DSA)."""
    return KVGeometry(
        num_layers=layers,
        total_kv_heads=1,
        head_dim=row_bytes,
        dtype="uint8",
        page_size=1,
        mla=True,
        num_pages=2 * rows,
    )


def build(args: argparse.Namespace, p_attn: int, d_attn: int, ps: int) -> list[dict]:
    """The state pools of the example request and each one's (writer, reader) transfers;
    with prefill PP, per stage over the stage's entries of the pool."""
    pools = _pools(args, ps)
    report = []
    for name, kind, g, n in pools:
        if kind == "mamba" and p_attn != d_attn:
            raise ValueError(
                f"--mamba-layers: prefill attention TP {p_attn} and decode attention TP {d_attn} differ; mamba state "
                "rows are sharded over attention TP and are moved at equal attention TP only"
            )
        rows, geo = kind != "swa", g
        if geo.num_layers < args.prefill_pp:
            raise ValueError(
                f"{name}: {geo.num_layers} layer(s) over --prefill-pp={args.prefill_pp} stages leave a stage without "
                "any (every stage holds one or more of each pool's layers)"
            )
        stages = pp_layer_split(geo.num_layers, args.prefill_pp)  # SGLang's even split of the pool's layers
        plan = plan_tp(geo.total_kv_heads, p_attn, d_attn, mla=geo.mla, salt=args.room)
        src = np.arange(-(-n // geo.page_size))
        dst = np.arange(0, 2 * len(src), 2)
        transfers = []
        for s, entries in enumerate(stages):
            part = dataclasses.replace(geo, num_layers=len(entries))
            for t in plan.transfers:
                pair = plan_pair(
                    t,
                    part.placement(p_attn, t.prefill_rank),
                    part.placement(d_attn, t.decode_rank),
                    src,
                    dst,
                    num_tokens=n,
                    path=envs.KVXFER_DATA_PATH.get(),
                    direct_min_op_bytes=envs.KVXFER_DIRECT_MIN_OP_BYTES.get(),
                )
                staged = {"pp_rank": s, "entries": [entries.start, entries.stop]} if args.prefill_pp > 1 else {}
                transfers.append(
                    {
                        **t.to_dict(),
                        **staged,
                        "global_heads": [t.global_head_start, t.global_head_start + t.num_heads],
                        "path": pair.path,
                        "bytes": pair.nbytes,
                        "ops_direct": pair.direct_op_count,
                        "ops_staged": pair.staged_op_count,
                    }
                )
        report.append(
            {
                "pool": name,
                "kind": kind,
                "layers": geo.num_layers,
                "total_kv_heads": None if rows else geo.total_kv_heads,
                "row_bytes": geo.head_dim if rows else None,
                "indices": n if rows else len(src),
                "tokens": None if rows else n,
                "transfers": transfers,
            }
        )
    return report


def render(report: list[dict], fmt_bytes) -> list[str]:
    lines: list[str] = []
    for pool in report:
        if pool["kind"] == "swa":
            what = f"{pool['layers']} layers, {pool['total_kv_heads']} KV head(s), the last {pool['tokens']} tokens"
        else:
            what = f"{pool['layers']} layers, rows of {pool['row_bytes']} bytes, {pool['indices']} row(s) per layer"
        lines += ["", f"state pool {pool['pool']} ({what}):"]
        for t in pool["transfers"]:
            heads = f" heads [{t['global_heads'][0]}, {t['global_heads'][1]})" if pool["kind"] == "swa" else ""
            ops = t["ops_staged"] if t["path"] == "staged" or t["ops_direct"] is None else t["ops_direct"]
            stage = (
                f"PP stage {t['pp_rank']} entries [{t['entries'][0]}, {t['entries'][1]}): " if "pp_rank" in t else ""
            )
            lines.append(
                f"  {stage}prefill {t['prefill_rank']} -> decode {t['decode_rank']}{heads}: {fmt_bytes(t['bytes'])}, "
                f"{t['path']}, {ops} op(s)"
            )
    return lines
