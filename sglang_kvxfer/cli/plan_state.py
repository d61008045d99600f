"""``kvxfer plan``'s extra per-request state: the pools of SGLang's ``KVArgs.state_types``
(``integrations/sglang_state``) planned for the example request, each with its own geometry.

- ``--swa-layers`` (hybrid sliding-window attention): the SWA sub-pool, its own KV heads and
  head dim (``--swa-kv-heads``, ``--swa-head-dim``), holds the request's last window
  (``--swa-window`` tokens from a page-aligned start) and is re-sharded between TP sizes like
  the model's KV: its own TP plan, one row per (writer, reader).
- ``--mamba-layers`` with ``--mamba-row-bytes`` (one row size per state tensor, on one prefill
  rank: conv, SSM...): a pool per tensor, the request's slot per layer. With
  ``--mamba-channels`` (each tensor's un-sharded channels, 0 for a replicated one) a sliced
  tensor is re-sliced by channel between TP sizes like KV heads (``--mamba-conv-groups``: the
  first tensor's sub-blocks, GDN's ``[q|k|v]``, a pool each), as the backend moves it; without
  it rows go rank to rank and differing TP sizes are refused, as the backend refuses them.
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
from sglang_kvxfer.integrations.sglang_state import row_geometry
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
        help="bytes of one slot's row of each mamba state tensor on one prefill rank, e.g. 24576,262144 (conv, SSM)",
    )
    p.add_argument(
        "--mamba-channels",
        default="",
        help="un-sharded channels of each mamba tensor (SGLang's state_dim_per_tensor x TP; 0: replicated), "
        "e.g. 8192,32: re-sliced between TP sizes",
    )
    p.add_argument(
        "--mamba-conv-groups",
        default="",
        help="the first mamba tensor's conv sub-blocks, each sharded on its own (GDN's [q|k|v]), e.g. 2048,2048,4096",
    )
    p.add_argument("--dsa-layers", type=int, default=0, help="layers with a DSA indexer buffer (default 0)")
    p.add_argument("--dsa-row-bytes", type=int, default=0, help="bytes of one KV page's DSA indexer row")


def _ints(flag: str, text: str, low: int) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}={text!r} must be a comma list of integers") from None
    if not values or min(values) < low:
        raise ValueError(f"{flag}={text!r} must give at least one value, each >= {low}")
    return values


def _mamba(args: argparse.Namespace, p_attn: int, d_attn: int) -> list[tuple[KVGeometry, str]]:
    """``(geometry, why equal TP only)`` of each mamba pool (``sglang_state``'s shapes)."""
    rows = _ints("--mamba-row-bytes", args.mamba_row_bytes, 1)
    if not args.mamba_channels:
        why = "mamba state rows are sharded over attention TP and are moved at equal attention TP only"
        return [(row_geometry(args.mamba_layers, row, 2), why) for row in rows]
    channels = _ints("--mamba-channels", args.mamba_channels, 0)
    if len(channels) != len(rows):
        raise ValueError(f"--mamba-channels has {len(channels)} value(s); --mamba-row-bytes has {len(rows)}")
    out = []
    for i, (row, c) in enumerate(zip(rows, channels)):
        if c == 0:
            out.append((row_geometry(args.mamba_layers, row, 2), ""))
            continue
        if c % p_attn or c % d_attn or row % (c // p_attn or 1):
            raise ValueError(
                f"--mamba-channels: tensor {i}'s {c} channels do not divide over attention TP {p_attn} and {d_attn} "
                f"into whole channels of its {row}-byte row"
            )
        blocks = _ints("--mamba-conv-groups", args.mamba_conv_groups, 1) if i == 0 and args.mamba_conv_groups else [c]
        if sum(blocks) != c or any(b % p_attn or b % d_attn or c % b for b in blocks):
            raise ValueError(
                f"--mamba-conv-groups={blocks} must add up to the first tensor's {c} channels, each divisible by "
                f"attention TP {p_attn} and {d_attn} and dividing {c}"
            )
        unit = row // (c // p_attn)
        out += [
            (
                KVGeometry(
                    num_layers=args.mamba_layers,
                    total_kv_heads=b,
                    head_dim=unit,
                    v_head_dim=0,
                    dtype="uint8",
                    page_size=1,
                    num_pages=2,
                ),
                "",
            )
            for b in blocks
        ]
    return out


def _pools(args: argparse.Namespace, ps: int, p_attn: int, d_attn: int) -> list[tuple[str, str, KVGeometry, int, str]]:
    """``(name, kind, geometry, indices of the example request, why equal TP only)`` of every
    state pool."""
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
        out.append(("state:swa", "swa", g, args.tokens - start, ""))
    if args.mamba_layers:
        mamba = _mamba(args, p_attn, d_attn)
        for i, (g, why) in enumerate(mamba):
            out.append((f"state:mamba.{i}" if len(mamba) > 1 else "state:mamba", "mamba", g, 1, why))
    if args.dsa_layers:
        if args.dsa_row_bytes < 1:
            raise ValueError(f"--dsa-layers={args.dsa_layers} needs --dsa-row-bytes >= 1")
        pages = -(-args.tokens // ps)
        out.append(("state:dsa", "dsa", row_geometry(args.dsa_layers, args.dsa_row_bytes, 2 * pages), pages, ""))
    return out


def build(args: argparse.Namespace, p_attn: int, d_attn: int, ps: int) -> list[dict]:
    """The state pools of the example request and each one's (writer, reader) transfers;
    with prefill PP, per stage over the stage's entries of the pool."""
    pools = _pools(args, ps, p_attn, d_attn)
    report = []
    for name, kind, g, n, why in pools:
        if why and p_attn != d_attn:
            raise ValueError(
                f"--mamba-layers: prefill attention TP {p_attn} and decode attention TP {d_attn} differ; {why}"
            )
        rows, geo = g.mla, g  # one replicated row per index (mamba rows, DSA); else heads or channels
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
                "total_kv_heads": None if rows else geo.total_kv_heads,  # (a sliced mamba tensor: channels)
                "row_bytes": geo.head_dim if rows else None,
                "channel_bytes": geo.head_dim if kind == "mamba" and not rows else None,
                "indices": len(src) if kind == "swa" else n,
                "tokens": n if kind == "swa" else None,
                "transfers": transfers,
            }
        )
    return report


def render(report: list[dict], fmt_bytes) -> list[str]:
    lines: list[str] = []
    for pool in report:
        if pool["kind"] == "swa":
            what = f"{pool['layers']} layers, {pool['total_kv_heads']} KV head(s), the last {pool['tokens']} tokens"
        elif pool["total_kv_heads"] is not None:
            what = (
                f"{pool['layers']} layers, {pool['total_kv_heads']} channels of {pool['channel_bytes']} bytes sliced "
                "over attention TP"
            )
        else:
            what = f"{pool['layers']} layers, rows of {pool['row_bytes']} bytes, {pool['indices']} row(s) per layer"
        lines += ["", f"state pool {pool['pool']} ({what}):"]
        for t in pool["transfers"]:
            word = "heads" if pool["kind"] == "swa" else "channels"
            heads = f" {word} [{t['global_heads'][0]}, {t['global_heads'][1]})" if pool["total_kv_heads"] else ""
            ops = t["ops_staged"] if t["path"] == "staged" or t["ops_direct"] is None else t["ops_direct"]
            stage = (
                f"PP stage {t['pp_rank']} entries [{t['entries'][0]}, {t['entries'][1]}): " if "pp_rank" in t else ""
            )
            lines.append(
                f"  {stage}prefill {t['prefill_rank']} -> decode {t['decode_rank']}{heads}: {fmt_bytes(t['bytes'])}, "
                f"{t['path']}, {ops} op(s)"
            )
    return lines
