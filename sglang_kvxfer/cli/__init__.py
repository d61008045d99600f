"""The ``kvxfer`` command line: one sub-command per module, imported only when used.

Each sub-command module exposes ``add_arguments(parser)`` and ``run(args) -> int``. Bad
input exits with status 2 and a one-line message on stderr, never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from sglang_kvxfer.errors import KVXferError

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("sglang_kvxfer.cli.bench", "sweep prefill/decode configurations here; GB/s, latency, "
                                         "descriptors/s against a same-run baseline"),
    "demo": ("sglang_kvxfer.cli.demo", "run a prefill group and a decode group here and move verified KV"),
    "plan": ("sglang_kvxfer.cli.plan", "show who sends which KV heads to whom for a TP pair"),
}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvxfer", description="KV-cache transfer engine for prefill/decode disaggregation"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except (KVXferError, ValueError) as exc:
        print(f"kvxfer {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvxfer {args.command}: interrupted", file=sys.stderr)
        return 130
