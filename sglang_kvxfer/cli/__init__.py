"""The ``kvxfer`` command line: one sub-command per module, imported only when used.

Each sub-command is a module (or ``module:object``) exposing ``add_arguments(parser)`` and
``run(args) -> int``; one that wraps another program also exposes ``run_argv(argv) -> int``
and gets its arguments verbatim. Bad input exits with status 2 and a one-line message on
stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from sglang_kvxfer.errors import KVXferError

# name -> (module or "module:object", one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": (
        "sglang_kvxfer.cli.bench",
        "sweep prefill/decode configurations here; GB/s, latency, descriptors/s against a same-run baseline",
    ),
    "demo": ("sglang_kvxfer.cli.demo", "run a prefill group and a decode group here and move verified KV"),
    "plan": ("sglang_kvxfer.cli.plan", "show who sends which KV heads to whom for a TP pair"),
    "prefill": (
        "sglang_kvxfer.cli.servers:PrefillCommand",
        "run a prefill TP group (and its bootstrap) serving clients",
    ),
    "decode": ("sglang_kvxfer.cli.servers:DecodeCommand", "run a decode TP group serving clients"),
    "client": ("sglang_kvxfer.cli.client", "send verified requests to a prefill and a decode server"),
    "sglang-serve": (
        "sglang_kvxfer.cli.sglang_serve",
        "run SGLang's server with this engine as --disaggregation-transfer-backend kvxfer",
    ),
}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _load(target: str):
    module, _, attr = target.partition(":")
    mod = importlib.import_module(module)
    return getattr(mod, attr) if attr else mod


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvxfer", description="KV-cache transfer engine for prefill/decode disaggregation")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, (target, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_target=target)
        _load(target).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        command = _load(COMMANDS[argv[0]][0])
        if hasattr(command, "run_argv"):  # wraps another program: its arguments pass verbatim
            return _guarded(argv[0], lambda: command.run_argv(argv[1:]))
    parser = build_parser()
    args = parser.parse_args(argv)
    command = _load(args._target)
    return _guarded(args.command, lambda: command.run(args))


def _guarded(command: str, call) -> int:
    try:
        return int(call() or 0)
    except (KVXferError, ValueError) as exc:
        print(f"kvxfer {command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvxfer {command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (``kvxfer plan | head``): not an error of ours
        # Python would report the pipe again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
