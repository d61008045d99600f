"""``kvxfer sglang-serve <SGLang launch_server args>``: SGLang's own server, with this
engine as a transfer backend.

Adds the ``kvxfer`` backend to SGLang's backend lookup in this process
(``integrations.sglang_install.install``), then runs ``python -m sglang.launch_server``
with the arguments exactly as given. SGLang's spawned processes get the backend through
the ``sglang.srt.plugins`` entry point this package installs. Every argument belongs to
SGLang, so this command takes them verbatim (``run_argv``) instead of through argparse.
"""
from __future__ import annotations

import argparse
import runpy
import sys

from sglang_kvxfer.errors import TransportUnavailableError

USAGE = """usage: kvxfer sglang-serve <python -m sglang.launch_server arguments>

Starts SGLang's server with `--disaggregation-transfer-backend kvxfer` available, e.g.
  kvxfer sglang-serve --model-path M --disaggregation-mode prefill \\
      --disaggregation-transfer-backend kvxfer --disaggregation-bootstrap-port 8998
`kvxfer sglang-serve --help` prints SGLang's own options."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("sglang_args", nargs=argparse.REMAINDER,
                        help="arguments of `python -m sglang.launch_server`, passed verbatim")


def run(args: argparse.Namespace) -> int:
    return run_argv(list(args.sglang_args))


def run_argv(argv: list[str]) -> int:
    """Install the backend, then hand ``argv`` to SGLang's ``launch_server`` entry point."""
    if not argv:
        print(USAGE)
        return 0
    from sglang_kvxfer.integrations.sglang_install import install

    try:
        install()
    except ImportError as exc:
        raise TransportUnavailableError(
            f"SGLang's server modules do not import here ({type(exc).__name__}: {exc}); install "
            "SGLang with its dependencies on the serving machine: pip install 'sglang==0.5.23'"
        ) from exc
    sys.argv = ["sglang.launch_server", *argv]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
    return 0
