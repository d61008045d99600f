"""Bad command-line input: every case exits 2 quickly with one line naming the flag and the
value, never a traceback or a hang (real ``kvxfer`` processes, each with a deadline)."""

from __future__ import annotations

import time

import pytest

from tests.cli.test_cli_servers import free_port, kvxfer

TINY = ["--layers", "2", "--total-kv-heads", "2", "--head-dim", "16", "--page-size", "8"]


def assert_one_line_error(proc, command: str, words: str, took: float) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.startswith(f"kvxfer {command}: error: "), proc.stderr
    assert words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert took < 20.0, f"took {took:.1f} s"  # refused up front: no rank process was started


@pytest.mark.parametrize(
    "args,words",
    [
        (["--page-size", "0"], "--page-size=0 must be >= 1"),
        (["--chunk-delay-ms", "-5"], "--chunk-delay-ms=-5 must be >= 0"),
        (["--chunk-delay-ms", "600000"], "--chunk-delay-ms=600000 must be <= 60000"),
        (["--chunk-tokens", "-1"], "--chunk-tokens=-1 must be >= 0"),
        (["--requests", "0"], "--requests=0 must be >= 1"),
        (["--layers", "0"], "--layers=0 must be >= 1"),
        (["--num-pages", "0"], "--num-pages=0 must be >= 1"),
        (["--prefill-tp", "0"], "--prefill-tp=0 must be >= 1"),
        (["--waiting-timeout", "-1"], "--waiting-timeout=-1 must be >= 0.001"),
        (["--transfer-timeout", "inf"], "--transfer-timeout=inf must be <= 86400"),
        (["--bootstrap-timeout", "nan"], "--bootstrap-timeout=nan must be a finite number >= 0.001"),
        (["--metrics-port", "70000"], "--metrics-port=70000 must be 0 (off) or in 1..65535"),
        (
            ["--tokens", "1000", "--num-pages", "16"],
            "--tokens=1000 is larger than the prefill pool: 16 pages of 8 tokens hold 128 tokens",
        ),
        (
            ["--tokens", "100", "--num-pages", "16", "--decode-page-size", "4"],
            "--tokens=100 is larger than the decode pool: 16 pages of 4 tokens hold 64 tokens",
        ),
    ],
)
def test_demo_refuses_bad_numbers_in_one_line(args, words):
    t0 = time.monotonic()
    proc = kvxfer("demo", "--quiet", *TINY, *args, timeout=60)
    assert_one_line_error(proc, "demo", words, time.monotonic() - t0)


@pytest.mark.parametrize(
    "role,args,words",
    [
        ("prefill", ["--port", "70000"], "--port=70000 must be <= 65535"),
        ("prefill", ["--port", "0"], "--port=0 must be >= 1"),
        ("prefill", ["--bootstrap-port", "-3"], "--bootstrap-port=-3 must be >= 1"),
        ("prefill", ["--tp", "0"], "--tp=0 must be >= 1"),
        ("prefill", ["--concurrency", "0"], "--concurrency=0 must be >= 1"),
        ("prefill", ["--restart-ranks", "-1"], "--restart-ranks=-1 must be >= 0"),
        ("prefill", ["--page-size", "0"], "--page-size=0 must be >= 1"),
        ("prefill", ["--transport", "pigeon"], "unknown transport 'pigeon'; registered: local"),
        ("decode", ["--bootstrap", "127.0.0.1:1", "--transport", "pigeon"], "unknown transport 'pigeon'"),
        (
            "decode",
            ["--bootstrap", "127.0.0.1:1", "--heartbeat-timeout", "0"],
            "--heartbeat-timeout=0 must be >= 0.001",
        ),
        (
            "decode",
            ["--bootstrap", "127.0.0.1:1", "--metrics-port", "65536"],
            "--metrics-port=65536 must be 0 (off) or in 1..65535",
        ),
    ],
)
def test_launchers_refuse_bad_numbers_in_one_line(role, args, words):
    t0 = time.monotonic()
    proc = kvxfer(role, *TINY, *args, timeout=60)
    assert_one_line_error(proc, role, words, time.monotonic() - t0)


@pytest.mark.parametrize(
    "args,words",
    [
        (["--chunk-tokens", "-1"], "--chunk-tokens=-1 must be >= 0"),
        (["--chunk-delay-ms", "-5"], "--chunk-delay-ms=-5 must be >= 0"),
        (["--concurrency", "0"], "--concurrency=0 must be >= 1"),
        (["--timeout", "0"], "--timeout=0 must be >= 0.001"),
    ],
)
def test_client_refuses_bad_numbers_before_connecting(args, words):
    addr = f"127.0.0.1:{free_port()}"  # nothing listens: the check must come first
    t0 = time.monotonic()
    proc = kvxfer("client", "--prefill", addr, "--decode", addr, *args, timeout=60)
    assert_one_line_error(proc, "client", words, time.monotonic() - t0)


def test_bench_refuses_a_negative_chunk_delay():
    t0 = time.monotonic()
    proc = kvxfer("bench", "--quiet", "--chunk-delay-ms", "-5", timeout=60)
    assert_one_line_error(proc, "bench", "--chunk-delay-ms=-5 must be >= 0", time.monotonic() - t0)


def test_client_refuses_a_request_larger_than_a_servers_pool():
    from tests.faults.test_launcher_faults import Launcher

    bport = free_port()
    pre = Launcher("prefill", "--tp", "1", "--bootstrap-port", str(bport))
    dec = None
    try:
        pre.wait_ready()
        dec = Launcher("decode", "--tp", "1", "--bootstrap", f"127.0.0.1:{bport}")
        dec.wait_ready()
        t0 = time.monotonic()
        proc = kvxfer(
            "client",
            "--prefill",
            pre.address,
            "--decode",
            dec.address,
            "--tokens",
            "64,600",
            "--requests",
            "2",
            "--quiet",
            timeout=60,
        )
        assert_one_line_error(
            proc,
            "client",
            f"--tokens=600 is larger than the prefill server's ({pre.address}) "
            "pool: 64 pages of 8 tokens hold 512 tokens",
            time.monotonic() - t0,
        )
    finally:
        for launcher in (dec, pre):
            if launcher is not None:
                launcher.stop()
