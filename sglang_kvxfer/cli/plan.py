"""``kvxfer plan``: show who sends which KV heads to whom, with bytes and op counts.

Builds the TP plan and, for one example request, the byte plan of every (writer, reader)
pair, then prints a table (or one JSON object with ``--json``). Pure planning: no servers,
no transport, no torch.

With attention DP (``--prefill-dp``/``--decode-dp``, SGLang's ``--dp-size`` with
``--enable-dp-attention``) each side's ``--tp`` ranks form DP groups of ``tp / dp``
attention-TP ranks; a request moves between one prefill group (SGLang's routing:
``--prefill-dp-rank``, else ``room % prefill_dp``) and one decode group (``--decode-dp-rank``),
so the plan is the one between those two groups' attention-TP sizes. Ranks are shown as the
group's attention-TP ranks, with the server-wide TP rank beside them.

With pipeline parallelism (``--prefill-pp``/``--decode-pp``, SGLang's ``--pp-size``) the
prefill's layers are split over its stages as SGLang splits them (``--pp-layers``: its
``SGLANG_PP_LAYER_PARTITION``); every stage writes its layers with the same TP plan, to the
decode stage of its rank (decode PP equal) or all into the one decode pool (decode PP 1), so
each (stage, writer, reader) is a row with the stage's layers and bytes.

Extra per-request state (``--swa-layers``, ``--mamba-layers``, ``--dsa-layers``; SGLang's
``KVArgs.state_types``) is planned per pool with its own geometry (``plan_state``) and listed
under ``state`` after the KV.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

from sglang_kvxfer import envs
from sglang_kvxfer.cli import plan_state
from sglang_kvxfer.geometry import KVGeometry, owned_heads
from sglang_kvxfer.integrations.sglang_args import pp_layer_split
from sglang_kvxfer.planning import plan_pair, plan_tp
from sglang_kvxfer.planning.byteplan import per_token_op_count


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--total-kv-heads", type=int, required=True, help="the model's un-sharded KV heads (1 for MLA)")
    p.add_argument("--prefill-tp", type=int, required=True, help="prefill TP size")
    p.add_argument("--decode-tp", type=int, required=True, help="decode TP size")
    p.add_argument(
        "--prefill-dp", type=int, default=1, help="prefill attention-DP groups (--dp-size with DP attention; default 1)"
    )
    p.add_argument(
        "--decode-dp", type=int, default=1, help="decode attention-DP groups (--dp-size with DP attention; default 1)"
    )
    p.add_argument(
        "--prefill-dp-rank",
        type=int,
        default=None,
        help="the request's prefill DP group (the router's prefill_dp_rank; default room %% prefill-dp)",
    )
    p.add_argument("--decode-dp-rank", type=int, default=0, help="the decode DP group serving the request (default 0)")
    p.add_argument("--prefill-pp", type=int, default=1, help="prefill pipeline-parallel stages (--pp-size; default 1)")
    p.add_argument(
        "--decode-pp", type=int, default=1, help="decode pipeline-parallel stages: 1 or --prefill-pp (default 1)"
    )
    p.add_argument(
        "--pp-layers",
        default=None,
        help="layers per prefill PP stage, e.g. 10,22 (SGLANG_PP_LAYER_PARTITION; default SGLang's even split)",
    )
    p.add_argument("--mla", action="store_true", help="MLA latent cache (one head on every rank)")
    p.add_argument("--layers", type=int, default=32, help="KV layers (default 32)")
    p.add_argument("--head-dim", type=int, default=128, help="K head dim (default 128; MLA e.g. 576)")
    p.add_argument("--v-head-dim", type=int, default=None, help="V head dim (default: --head-dim)")
    p.add_argument("--dtype", default="bf16", help="KV dtype (default bf16)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page on both sides (default 16)")
    p.add_argument("--prefill-page-size", type=int, default=None, help="prefill page size (default --page-size)")
    p.add_argument("--decode-page-size", type=int, default=None, help="decode page size (default --page-size)")
    p.add_argument(
        "--prefill-layout", default="NHD", help="prefill pool layout: NHD, HND, HND_KV or NHD_KV (default NHD)"
    )
    p.add_argument(
        "--decode-layout", default="NHD", help="decode pool layout: NHD, HND, HND_KV or NHD_KV (default NHD)"
    )
    p.add_argument("--tokens", type=int, default=8192, help="tokens in the example request (default 8192)")
    p.add_argument(
        "--pages",
        choices=["scattered", "contiguous"],
        default="scattered",
        help="decode page ids of the example request (default scattered: every other page)",
    )
    p.add_argument("--room", type=int, default=0, help="request id; rotates writer election among replicas")
    plan_state.add_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _dp_groups(tp: int, dp: int, dp_rank: int, side: str) -> tuple[int, int]:
    """(attention-TP size, the request's DP group) of one side; errors name the flags."""
    if tp % dp:
        raise ValueError(f"--{side}-tp={tp} must be a multiple of --{side}-dp={dp}")
    if not 0 <= dp_rank < dp:
        raise ValueError(f"--{side}-dp-rank={dp_rank} must be in [0, {dp}) (--{side}-dp={dp})")
    return tp // dp, dp_rank


def build_report(args: argparse.Namespace) -> dict:
    if args.tokens < 1:
        raise ValueError(f"--tokens={args.tokens} must be >= 1")
    p_dp, d_dp = args.prefill_dp, args.decode_dp
    if p_dp < 1 or d_dp < 1:
        raise ValueError(f"--prefill-dp={p_dp} and --decode-dp={d_dp} must be >= 1")
    p_rank = args.room % p_dp if args.prefill_dp_rank is None else args.prefill_dp_rank
    p_attn, p_group = _dp_groups(args.prefill_tp, p_dp, p_rank, "prefill")
    d_attn, d_group = _dp_groups(args.decode_tp, d_dp, args.decode_dp_rank, "decode")
    p_pp, d_pp = args.prefill_pp, args.decode_pp
    if p_pp < 1 or d_pp < 1:
        raise ValueError(f"--prefill-pp={p_pp} and --decode-pp={d_pp} must be >= 1")
    if d_pp not in (1, p_pp):
        raise ValueError(f"--decode-pp={d_pp} must equal --prefill-pp={p_pp} or be 1 (SGLang's rule for PD with PP)")
    if args.pp_layers is not None and p_pp == 1:
        raise ValueError("--pp-layers needs --prefill-pp > 1")
    try:
        stages = pp_layer_split(args.layers, p_pp, args.pp_layers)
    except ValueError as exc:
        raise ValueError(f"--pp-layers/--layers/--prefill-pp: {exc}") from None
    plan = plan_tp(args.total_kv_heads, p_attn, d_attn, mla=args.mla, salt=args.room)
    ps = args.prefill_page_size or args.page_size
    pd = args.decode_page_size or args.page_size
    src_n, dst_n = -(-args.tokens // ps), -(-args.tokens // pd)
    step = 2 if args.pages == "scattered" else 1
    common = dict(
        num_layers=args.layers,
        total_kv_heads=args.total_kv_heads,
        head_dim=args.head_dim,
        v_head_dim=args.v_head_dim,
        dtype=args.dtype,
        mla=args.mla,
    )
    gp = KVGeometry(**common, page_size=ps, layout=args.prefill_layout, num_pages=src_n)
    gd = KVGeometry(**common, page_size=pd, layout=args.decode_layout, num_pages=dst_n * step)
    src_pages = np.arange(src_n)
    dst_pages = np.arange(0, dst_n * step, step)
    transfers = []
    for s, layers in enumerate(stages):
        sp = dataclasses.replace(gp, num_layers=len(layers))  # the stage's pool, and its share of the decode's
        sd = dataclasses.replace(gd, num_layers=len(layers))
        for t in plan.transfers:
            pair = plan_pair(
                t,
                sp.placement(p_attn, t.prefill_rank),
                sd.placement(d_attn, t.decode_rank),
                src_pages,
                dst_pages,
                num_tokens=args.tokens,
                path=envs.KVXFER_DATA_PATH.get(),
                direct_min_op_bytes=envs.KVXFER_DIRECT_MIN_OP_BYTES.get(),
            )
            transfers.append(
                {
                    **t.to_dict(),
                    "prefill_tp_rank": p_group * p_attn + t.prefill_rank,
                    "decode_tp_rank": d_group * d_attn + t.decode_rank,
                    "pp_rank": s,
                    "decode_pp_rank": s if d_pp > 1 else 0,
                    "layers": _span(layers),
                    "global_heads": [t.global_head_start, t.global_head_start + t.num_heads],
                    "path": pair.path,
                    "reason": pair.reason,
                    "bytes": pair.nbytes,
                    "ops_direct": pair.direct_op_count,
                    "ops_staged": pair.staged_op_count,
                    "ops_per_token": per_token_op_count(len(layers), args.tokens, gp.has_v),
                }
            )
    return {
        "total_kv_heads": args.total_kv_heads,
        "prefill_tp": args.prefill_tp,
        "decode_tp": args.decode_tp,
        "prefill_dp": p_dp,
        "decode_dp": d_dp,
        "prefill_attn_tp": p_attn,
        "decode_attn_tp": d_attn,
        "prefill_dp_rank": p_group,
        "decode_dp_rank": d_group,
        "prefill_pp": p_pp,
        "decode_pp": d_pp,
        "stages": [
            {"pp_rank": s, "layers": _span(layers), "decode_pp_rank": s if d_pp > 1 else 0}
            for s, layers in enumerate(stages)
        ],
        "mla": args.mla,
        "room": args.room,
        "request": {
            "tokens": args.tokens,
            "layers": args.layers,
            "dtype": gp.dtype,
            "prefill_page_size": ps,
            "decode_page_size": pd,
            "prefill_layout": gp.layout.value,
            "decode_layout": gd.layout.value,
            "decode_pages": args.pages,
        },
        "transfers": transfers,
        "state": plan_state.build(args, p_attn, d_attn, ps),
        "decode_ranks": [
            {
                "rank": d,
                "tp_rank": d_group * d_attn + d,
                "heads": _span(owned_heads(args.total_kv_heads, d_attn, d, args.mla)),
                "writers": [t.prefill_rank for t in plan.writers_of(d)],
            }
            for d in range(d_attn)
        ],
        "prefill_ranks": [
            {
                "rank": p,
                "tp_rank": p_group * p_attn + p,
                "heads": _span(owned_heads(args.total_kv_heads, p_attn, p, args.mla)),
                "targets": list(plan.decode_targets(p)),
            }
            for p in range(p_attn)
        ],
    }


def _rank(rank: int, tp_rank: int) -> str:
    """A group's attention-TP rank, with the server-wide TP rank where they differ."""
    return str(rank) if rank == tp_rank else f"{rank} ({tp_rank})"


def _span(r: range) -> list[int]:
    return [r.start, r.stop]


def _fmt_bytes(n: int) -> str:
    size: float = n
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(size)


def render(report: dict) -> str:
    req = report["request"]
    kind = "MLA" if report["mla"] else "MHA"
    dp = ""
    if report["prefill_dp"] > 1 or report["decode_dp"] > 1:
        dp = (
            f" (attention DP: prefill group {report['prefill_dp_rank']} of {report['prefill_dp']}, "
            f"attention TP {report['prefill_attn_tp']} -> decode group {report['decode_dp_rank']} of "
            f"{report['decode_dp']}, attention TP {report['decode_attn_tp']}; ranks below are the "
            "groups' attention-TP ranks, server TP ranks in parentheses)"
        )
    staged = report["prefill_pp"] > 1
    if staged:
        spans = ", ".join(f"[{a}, {b})" for a, b in (st["layers"] for st in report["stages"]))
        into = (
            "each to the decode PP stage of its rank"
            if report["decode_pp"] > 1
            else "all into the one decode pool (decode PP 1)"
        )
        dp += f" (pipeline parallel: {report['prefill_pp']} prefill PP stages, layers {spans}, {into})"
    lines = [
        f"{kind}: {report['total_kv_heads']} KV head(s), prefill TP {report['prefill_tp']} -> "
        f"decode TP {report['decode_tp']}{dp}; example request: {req['tokens']} tokens x "
        f"{req['layers']} layers, {req['dtype']}, pages {req['prefill_page_size']}/{req['decode_page_size']} "
        f"tokens, layout {req['prefill_layout']}/{req['decode_layout']}, {req['decode_pages']} decode pages",
        "",
    ]
    header: tuple[str, ...] = (
        "prefill",
        "decode",
        "global heads",
        "src local",
        "dst local",
        "bytes",
        "path",
        "ops direct",
        "ops staged",
        "ops per-token",
    )
    if staged:
        header = ("stage", *header)
    rows: list[tuple[str, ...]] = []
    for t in report["transfers"]:
        g0, g1 = t["global_heads"]
        stage = (f"{t['pp_rank']} [{t['layers'][0]}, {t['layers'][1]})",) if staged else ()
        rows.append(
            (
                *stage,
                _rank(t["prefill_rank"], t["prefill_tp_rank"]),
                _rank(t["decode_rank"], t["decode_tp_rank"]),
                f"[{g0}, {g1})",
                f"[{t['src_head_start']}, {t['src_head_start'] + t['num_heads']})",
                f"[{t['dst_head_start']}, {t['dst_head_start'] + t['num_heads']})",
                _fmt_bytes(t["bytes"]),
                t["path"],
                "-" if t["ops_direct"] is None else str(t["ops_direct"]),
                str(t["ops_staged"]),
                str(t["ops_per_token"]),
            )
        )
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append("")
    for d in report["decode_ranks"]:
        lines.append(
            f"decode rank {_rank(d['rank'], d['tp_rank'])}: heads [{d['heads'][0]}, {d['heads'][1]}), "
            f"waits for {len(d['writers'])} writer(s): {d['writers']}"
        )
    for p in report["prefill_ranks"]:
        lines.append(
            f"prefill rank {_rank(p['rank'], p['tp_rank'])}: heads [{p['heads'][0]}, {p['heads'][1]}), "
            f"writes to decode rank(s) {p['targets'] or 'none (not elected for this room)'}"
        )
    for st in report["stages"] if staged else ():
        a, b = st["layers"]
        dst = (
            f"decode PP stage {st['decode_pp_rank']} (which holds the same layers)"
            if report["decode_pp"] > 1
            else f"layers [{a}, {b}) of the decode pool"
        )
        lines.append(f"prefill PP stage {st['pp_rank']}: layers [{a}, {b}), written to {dst}")
    lines += plan_state.render(report["state"], _fmt_bytes)
    reasons = sorted({(t["path"], t["reason"]) for t in report["transfers"]})
    lines.append("")
    lines += [f"{path}: {reason}" for path, reason in reasons]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    report = build_report(args)
    print(json.dumps(report) if args.json else render(report))
    return 0
