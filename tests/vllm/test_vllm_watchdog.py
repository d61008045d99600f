"""The vLLM tests' stall watchdog (``tests/vllm/corrupt_connector.py``) reports what it
claims: a process stopped with SIGSTOP, and an engine rank whose I/O thread stopped ticking,
each with every thread's state and frames. Runs in the vLLM environment (the connector
module imports vLLM)."""

from __future__ import annotations

import signal
import subprocess
import time

from tests.vllm import harness as h

SCRIPT = r"""
import sys, threading, time, types
from tests.vllm.corrupt_connector import _watch

mgr = types.SimpleNamespace(side=types.SimpleNamespace(value="decode"), tp_rank=3, _last_tick=time.monotonic())

def ticker():  # ticks like an I/O thread, then blocks
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        mgr._last_tick = time.monotonic()
        time.sleep(0.05)
    time.sleep(60)

threading.Thread(target=ticker, name="kvxfer-io-decode3", daemon=True).start()
conn = types.SimpleNamespace(worker_side=types.SimpleNamespace(prefill=None, decode=mgr))
threading.Thread(target=_watch, args=(conn, 2.0), name="kvxfer-watchdog", daemon=True).start()
print("ready", flush=True)
time.sleep(60)
"""


def test_the_watchdog_reports_a_stopped_process_and_a_stalled_io_thread(vllm_env):
    env = h.base_env("00" * 32)
    proc = subprocess.Popen(
        [str(h.venv_python()), "-c", SCRIPT],
        env=env,
        cwd=h.ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        time.sleep(5.0)  # the ticker stops after 1 s: its stall passes 2 s by about 3 s
        proc.send_signal(signal.SIGSTOP)
        time.sleep(4.0)
        proc.send_signal(signal.SIGCONT)
        time.sleep(2.0)
    finally:
        proc.kill()
        err = proc.communicate(timeout=30)[1]
    lines = [line for line in err.splitlines() if line.startswith("kvxfer: watchdog:")]
    stall = [line for line in lines if "decode rank 3's I/O thread has not ticked for" in line]
    late = [line for line in lines if "the watchdog woke" in line]
    assert len(stall) == 1, err  # one line per stall, not one per second
    assert "[kvxfer-io-decode3 S " in stall[0], stall  # asleep, not running
    assert "ticker" in stall[0].split("kvxfer-io-decode3", 1)[1].split("]")[0], stall
    assert len(late) == 1, err
    woke = float(late[0].split("woke ")[1].split(" s late")[0])
    assert woke > 2.0, late
    assert "check failed" not in err, err
