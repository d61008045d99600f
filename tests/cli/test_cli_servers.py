"""``kvxfer demo``, ``kvxfer prefill|decode|client`` as a user runs them (real processes)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.ports import free_port

SMALL = ["--layers", "2", "--head-dim", "32", "--page-size", "8"]


def kvxfer(*args, timeout=120, **kw):
    return subprocess.run(
        [sys.executable, "-m", "sglang_kvxfer", *args], capture_output=True, text=True, timeout=timeout, **kw
    )


def test_demo_json_verifies_every_request():
    proc = kvxfer("demo", "--json", "--quiet", "--requests", "3", "--tokens", "64,200", "--chunk-tokens", "32", *SMALL)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert {
        "requests",
        "verified_requests",
        "bytes",
        "gbps",
        "p50_ms",
        "p99_ms",
        "prefill_tp",
        "decode_tp",
        "transport",
    } <= set(out)
    assert (out["requests"], out["verified_requests"], out["prefill_tp"], out["decode_tp"], out["transport"]) == (
        3,
        3,
        2,
        1,
        "local",
    )
    assert out["bytes"] == 2 * (64 + 200 + 64) * 8 * (32 + 32) * 2  # layers x tokens x heads x (K+V dims) x bf16
    # P2 -> D1 on NHD pools: strided head slices, copied pool -> pool into the decode's
    # shared-memory pool, which local maps in the prefill's process
    assert out["data_path"] == {"fused": 6}


@pytest.mark.parametrize(
    "args,words",
    [
        (["--prefill-tp", "3"], "total_kv_heads=8 is not divisible by tp_size=3"),
        (["--tokens", "0"], "--tokens='0' must list positive token counts"),
        (["--transport", "pigeon"], "unknown transport 'pigeon'"),
        (["--concurrency", "0"], "--concurrency=0 must be >= 1"),
    ],
)
def test_demo_rejects_bad_input_in_one_line(args, words):
    proc = kvxfer("demo", "--quiet", *args, *SMALL, timeout=60)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert words in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_servers_and_client():
    pport, dport, bport = free_port(), free_port(), free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    pre = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sglang_kvxfer",
            "prefill",
            "--tp",
            "2",
            "--port",
            str(pport),
            "--bootstrap-port",
            str(bport),
            "--log-level",
            "WARNING",
            *SMALL,
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    dec = None
    try:
        wait_ready(pre)
        dec = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sglang_kvxfer",
                "decode",
                "--tp",
                "2",
                "--port",
                str(dport),
                "--bootstrap",
                f"127.0.0.1:{bport}",
                "--log-level",
                "WARNING",
                *SMALL,
            ],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        line = wait_ready(dec)
        assert "transport local" in line  # auto: decode follows the prefill group
        proc = kvxfer(
            "client",
            "--prefill",
            f"127.0.0.1:{pport}",
            "--decode",
            f"127.0.0.1:{dport}",
            "--requests",
            "4",
            "--tokens",
            "48,100",
            "--chunk-tokens",
            "16",
            "--json",
            "--quiet",
        )
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["verified_requests"] == 4 and out["decode_tp"] == 2
        wrong = kvxfer("client", "--prefill", f"127.0.0.1:{dport}", "--decode", f"127.0.0.1:{pport}")
        assert wrong.returncode == 2 and f"127.0.0.1:{dport} is a decode server, expected prefill" in wrong.stderr
    finally:
        for p in (dec, pre):
            if p is not None:
                p.send_signal(signal.SIGINT)
        for p in (dec, pre):
            if p is not None:
                assert p.wait(30) == 0


def wait_ready(proc, timeout_s=60.0) -> str:
    """The server's "ready" line; a reader thread keeps the wait bounded."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            if proc.poll() is not None:
                raise AssertionError(f"server exited: {''.join(seen)}") from None
            continue
        seen.append(line)
        if "ready on" in line:
            return line
    raise AssertionError(f"server not ready in time: {''.join(seen)}")
