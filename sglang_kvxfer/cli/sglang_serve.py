"""``kvxfer sglang-serve <SGLang launch_server args>``: SGLang's own server, with this
engine as a transfer backend.

Checks that SGLang's server imports here, then runs the server in a child process of its
own process group: the child adds the ``kvxfer`` backend to SGLang's backend lookup
(``integrations.sglang_install.install``) and runs ``python -m sglang.launch_server`` with
the arguments exactly as given. SGLang's spawned processes get the backend through the
``sglang.srt.plugins`` entry point this package installs. SIGTERM and SIGINT are forwarded
to the child's whole process group (SGLang's server alone does not stop its workers on a
plain SIGTERM); whatever is left after a grace period is killed, and the child group gets
SIGTERM if this process dies (``PR_SET_PDEATHSIG``). Every argument belongs to SGLang, so
this command takes them verbatim (``run_argv``) instead of through argparse.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import subprocess
import sys
import time

from sglang_kvxfer.errors import TransportUnavailableError

USAGE = """usage: kvxfer sglang-serve <python -m sglang.launch_server arguments>

Starts SGLang's server with `--disaggregation-transfer-backend kvxfer` available, e.g.
  kvxfer sglang-serve --model-path M --disaggregation-mode prefill \\
      --disaggregation-transfer-backend kvxfer --disaggregation-bootstrap-port 8998
`kvxfer sglang-serve --help` prints SGLang's own options."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "sglang_args", nargs=argparse.REMAINDER, help="arguments of `python -m sglang.launch_server`, passed verbatim"
    )


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
    return _supervise([sys.executable, "-m", "sglang_kvxfer.cli.sglang_serve", *argv])


STOP_GRACE_S = 15.0


def _supervise(cmd: list[str]) -> int:
    """Run ``cmd`` in a new process group; forward SIGTERM/SIGINT to the group; return its
    exit status (128 + signal when a signal ended it)."""
    from sglang_kvxfer.cluster.group import arm_parent_death_signal

    parent = os.getpid()
    child = subprocess.Popen(
        cmd, start_new_session=True, preexec_fn=lambda: arm_parent_death_signal(signal.SIGTERM, parent)
    )
    stop_at: list[float] = []  # when the first stop signal came

    def forward(sig, _frame) -> None:
        if not stop_at:
            stop_at.append(time.monotonic())
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            pass

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while child.poll() is None:
            if stop_at and time.monotonic() - stop_at[0] > STOP_GRACE_S:
                os.killpg(child.pid, signal.SIGKILL)
            time.sleep(0.1)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        try:
            os.killpg(child.pid, signal.SIGKILL)  # SGLang's workers left behind, if any
        except (ProcessLookupError, PermissionError):
            pass
    code = child.returncode
    return 128 - code if code < 0 else code


def _child_main(argv: list[str]) -> None:
    """The child: install the backend in this process, then become SGLang's server."""
    from sglang_kvxfer.integrations.sglang_install import install

    install()
    sys.argv = ["sglang.launch_server", *argv]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _child_main(sys.argv[1:])
