"""Command-line options shared by ``demo``, ``bench``, ``prefill`` and ``decode``.

Owns the model-geometry flags (with per-side page size and layout) and the deadline
flags, and turns them into ``KVGeometry`` objects and engine options. With ``sweep=True``
(``kvxfer bench``) the geometry flags take comma-separated lists; ``side_geometry`` then
reads one point of the sweep (a namespace with single values). ``check_ranges`` range-checks
numeric flags after parsing, so that a bad value exits 2 with one line naming the flag and
the value (``--page-size=0 must be >= 1``).
"""

from __future__ import annotations

import argparse
import math

from sglang_kvxfer import envs
from sglang_kvxfer.geometry import KVGeometry

__all__ = [
    "add_model_args",
    "add_side_args",
    "add_deadline_args",
    "side_geometry",
    "engine_options",
    "int_list",
    "str_list",
    "parse_tokens",
    "pool_pages",
    "check_ranges",
    "check_pool_fits",
    "PORT",
    "OPTIONAL_PORT",
    "COMMON_RANGES",
    "MAX_CHUNK_DELAY_S",
]

PORT = (1, 65535)
OPTIONAL_PORT = (1, 65535, 0)  # 0 means "off"
MAX_CHUNK_DELAY_S = 60.0
MAX_DEADLINE_S = 86400.0
# dest -> (lowest, highest or None[, a value that means off]) for the flags every command shares
COMMON_RANGES = {
    "layers": (1, 4096),
    "total_kv_heads": (1, 65536),
    "head_dim": (1, 65536),
    "v_head_dim": (1, 65536),
    "page_size": (1, 1 << 20),
    "num_pages": (1, 1 << 31),
    "prefill_page_size": (1, 1 << 20),
    "decode_page_size": (1, 1 << 20),
    "bootstrap_timeout": (1e-3, MAX_DEADLINE_S),
    "waiting_timeout": (1e-3, MAX_DEADLINE_S),
    "transfer_timeout": (1e-3, MAX_DEADLINE_S),
    "heartbeat_timeout": (1e-3, MAX_DEADLINE_S),
    "chunk_tokens": (0, 1 << 31),
    "chunk_delay_ms": (0, MAX_CHUNK_DELAY_S * 1e3),
    "concurrency": (1, None),
    "requests": (1, None),
    "metrics_port": OPTIONAL_PORT,
}


def _show(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def check_ranges(args: argparse.Namespace, ranges: dict) -> None:
    """Raise ``ValueError("--flag=value must be ...")`` for the first value out of range.

    ``ranges`` maps an argparse dest to ``(lo, hi)`` or ``(lo, hi, off)``; ``hi`` may be
    None; ``off`` is a value accepted besides the range (0 = off). Unset (None) flags and
    flags the namespace lacks are skipped; a list value (sweeps) is checked item by item.
    """
    for dest, bounds in ranges.items():
        value = getattr(args, dest, None)
        if value is None or isinstance(value, bool):
            continue
        lo, hi, off = (*bounds, None)[:3]
        for v in value if isinstance(value, list) else [value]:
            if off is not None and v == off:
                continue
            if math.isfinite(v) and lo <= v and (hi is None or v <= hi):
                continue
            flag = "--" + dest.replace("_", "-")
            if off is not None:
                what = f"{_show(off)} (off) or in {_show(lo)}..{_show(hi)}"
            elif v < lo:
                what = f">= {_show(lo)}"
            elif hi is not None and v > hi:
                what = f"<= {_show(hi)}"
            else:
                what = f"a finite number >= {_show(lo)}"
            raise ValueError(f"{flag}={_show(v)} must be {what}")


def check_pool_fits(tokens: int, geometry: KVGeometry, side: str) -> None:
    """Refuse a request larger than ``side``'s whole pool up front (it could never run)."""
    capacity = geometry.num_pages * geometry.page_size
    if tokens > capacity:
        raise ValueError(
            f"--tokens={tokens} is larger than the {side} pool: {geometry.num_pages} pages of "
            f"{geometry.page_size} tokens hold {capacity} tokens (raise --num-pages)"
        )


def int_list(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (an argparse type; the error names the text)."""
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} lists no value")
    return values


def parse_tokens(text: str) -> list[int]:
    """``--tokens`` text -> positive token counts (a ``ValueError`` names the flag)."""
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--tokens={text!r} must be a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise ValueError(f"--tokens={text!r} must list positive token counts")
    return values


def str_list(text: str) -> list[str]:
    values = [v.strip() for v in str(text).split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} lists no value")
    return values


def _mla_list(text: str) -> list[bool]:
    table = {"on": True, "off": False, "1": True, "0": False, "true": True, "false": False}
    values = str_list(text)
    bad = [v for v in values if v.lower() not in table]
    if bad:
        raise argparse.ArgumentTypeError(f"{text!r}: MLA values must be on/off, got {bad}")
    return [table[v.lower()] for v in values]


def add_model_args(p: argparse.ArgumentParser, layers: int = 16, sweep: bool = False) -> None:
    g = p.add_argument_group("model geometry (must match on both sides)" + ("; lists sweep" if sweep else ""))
    num, lst = (int_list, "comma list of ") if sweep else (int, "")
    g.add_argument("--layers", type=int, default=layers, help=f"KV layers (default {layers})")
    g.add_argument(
        "--total-kv-heads", type=num, default=None, help=f"{lst}un-sharded KV heads (default 8; 1 with --mla)"
    )
    g.add_argument(
        "--head-dim",
        type=num,
        default=[128] if sweep else 128,
        help=f"{lst}K head dim (default 128; MLA latent e.g. 576)",
    )
    g.add_argument("--v-head-dim", type=int, default=None, help="V head dim (default: --head-dim)")
    g.add_argument("--dtype", default="bf16", help="KV dtype: bf16, fp16, fp32, fp8_e4m3, fp8_e5m2 (default bf16)")
    if sweep:
        g.add_argument(
            "--mla",
            type=_mla_list,
            nargs="?",
            const=[True],
            default=[False],
            help="MLA latent cache; a list such as 'off,on' sweeps both",
        )
    else:
        g.add_argument("--mla", action="store_true", help="MLA latent cache (one head replicated on every rank)")


def add_side_args(p: argparse.ArgumentParser, both: bool, sweep: bool = False) -> None:
    """Page size and layout; with ``both`` also per-side overrides (demo, bench); with
    ``sweep`` the per-side values are comma lists."""
    g = p.add_argument_group("pool format")
    g.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    g.add_argument("--layout", default="NHD", help="pool layout NHD, HND, HND_KV or NHD_KV (default NHD)")
    g.add_argument(
        "--num-pages", type=int, default=None, help="pool capacity in pages (default: sized for the workload)"
    )
    if both:
        num, text, lst = (int_list, str_list, "comma list: ") if sweep else (int, str, "")
        g.add_argument(
            "--prefill-page-size", type=num, default=None, help=f"{lst}prefill page size (default --page-size)"
        )
        g.add_argument(
            "--decode-page-size", type=num, default=None, help=f"{lst}decode page size (default --page-size)"
        )
        g.add_argument("--prefill-layout", type=text, default=None, help=f"{lst}prefill layout (default --layout)")
        g.add_argument("--decode-layout", type=text, default=None, help=f"{lst}decode layout (default --layout)")


def add_deadline_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("deadlines (seconds)")
    g.add_argument(
        "--bootstrap-timeout",
        type=float,
        default=envs.KVXFER_BOOTSTRAP_TIMEOUT_S.get(),
        help="deadline in Bootstrapping (KVXFER_BOOTSTRAP_TIMEOUT_S)",
    )
    g.add_argument(
        "--waiting-timeout",
        type=float,
        default=envs.KVXFER_WAITING_TIMEOUT_S.get(),
        help="deadline in WaitingForInput (KVXFER_WAITING_TIMEOUT_S)",
    )
    g.add_argument(
        "--transfer-timeout",
        type=float,
        default=envs.KVXFER_TRANSFER_TIMEOUT_S.get(),
        help="deadline in Transferring without progress (KVXFER_TRANSFER_TIMEOUT_S)",
    )
    g.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=envs.KVXFER_HEARTBEAT_TIMEOUT_S.get(),
        help="declare a silent peer dead after this long (KVXFER_HEARTBEAT_TIMEOUT_S)",
    )


def side_geometry(args: argparse.Namespace, side: str | None, num_pages: int) -> KVGeometry:
    page = getattr(args, f"{side}_page_size", None) if side else None
    layout = getattr(args, f"{side}_layout", None) if side else None
    return KVGeometry(
        num_layers=args.layers,
        total_kv_heads=args.total_kv_heads or (1 if args.mla else 8),
        head_dim=args.head_dim,
        v_head_dim=args.v_head_dim,
        dtype=args.dtype,
        mla=args.mla,
        page_size=page or args.page_size,
        layout=layout or args.layout,
        num_pages=args.num_pages or num_pages,
    )


def pool_pages(max_tokens: int, page_size: int, concurrency: int) -> int:
    """Pool capacity for ``concurrency`` requests of ``max_tokens`` in flight, plus one
    being set up and some slack."""
    return -(-max_tokens // page_size) * (concurrency + 1) + 8


def engine_options(args: argparse.Namespace) -> dict:
    return {
        "bootstrap_timeout_s": args.bootstrap_timeout,
        "waiting_timeout_s": args.waiting_timeout,
        "transfer_timeout_s": args.transfer_timeout,
        "heartbeat_timeout_s": args.heartbeat_timeout,
    }


def summary_shape(gp: KVGeometry, gd: KVGeometry) -> dict:
    """The model and pool fields of a run's summary (``cluster.workload.summarize``)."""
    return dict(
        total_kv_heads=gp.total_kv_heads,
        mla=gp.mla,
        layers=gp.num_layers,
        head_dim=gp.head_dim,
        dtype=gp.dtype,
        prefill_page_size=gp.page_size,
        decode_page_size=gd.page_size,
        prefill_layout=gp.layout.value,
        decode_layout=gd.layout.value,
    )
