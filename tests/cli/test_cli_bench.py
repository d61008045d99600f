"""``kvxfer bench``: the sweep and its refusals, and one small real run
whose records are checked field by field (bytes verified, GB/s not above the baseline)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_kvxfer.cli import build_parser, main
from sglang_kvxfer.cli.bench import QUICK, _resolve, render, sweep
from sglang_kvxfer.metrics import PHASES

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv):
    return build_parser().parse_args(["bench", *argv])


def test_quick_fills_only_the_flags_not_given():
    args = _resolve(parse("--quick", "--tokens", "64", "--transport", "tcp"))
    assert args.tokens == [64] and args.transport == ["tcp"]
    assert (args.prefill_tp, args.decode_tp, args.requests, args.repeats, args.layers) == (
        QUICK["prefill_tp"],
        QUICK["decode_tp"],
        QUICK["requests"],
        QUICK["repeats"],
        QUICK["layers"],
    )
    plain = _resolve(parse())
    assert (plain.transport, plain.tokens, plain.layers) == (["local"], [1024, 4096, 16384], 16)


def test_sweep_is_the_product_of_the_lists_minus_invalid_shapes_with_a_note():
    args = _resolve(
        parse(
            "--prefill-tp",
            "1,3",
            "--decode-tp",
            "1,2",
            "--mla",
            "off,on",
            "--tokens",
            "64,128",
            "--concurrency",
            "1,2",
            "--decode-page-size",
            "8,16",
            "--decode-layout",
            "NHD,hnd",
        )
    )
    shapes, points, notes = sweep(args)
    # P=3 is invalid for 8 KV heads (MHA); MLA (one head) takes every TP size
    assert sorted({(s.prefill_tp, s.mla) for s in shapes}) == [(1, False), (1, True), (3, True)]
    assert len(shapes) == 3 * 2 * 2 * 2  # x decode TP x decode page size x decode layout
    assert {s.decode_layout for s in shapes} == {"NHD", "HND"}
    assert {s.total_kv_heads for s in shapes if s.mla} == {1}
    assert points == [(64, 1, 0), (64, 2, 0), (128, 1, 0), (128, 2, 0)]
    assert len(notes) == 8 and all("total_kv_heads=8 is not divisible by tp_size=3" in n for n in notes)


BAD = [
    (["--prefill-tp", "0"], "--prefill-tp values must be >= 1, got [0]"),
    (["--tokens", "12,x"], "argument --tokens: '12,x' is not a comma-separated list of integers"),
    (["--mla", "maybe"], "MLA values must be on/off, got ['maybe']"),
    (["--transport", "nope"], "--transport 'nope' is unknown; registered: local, mori, nixl, tcp"),
    (
        ["--prefill-devices", "cuda:0", "--prefill-tp", "1,2"],
        "--prefill-devices lists 1 device(s) (cuda:0); --prefill-tp 2 needs 2",
    ),
    (["--decode-devices", "gpu0"], "--decode-devices: ['gpu0'] must be cpu or cuda[:N]"),
    (["--requests", "0"], "--requests=0 must be >= 1"),
    (["--chunk-tokens", "-16"], "--chunk-tokens values must be >= 0, got [-16]"),
    (["--metrics-port", "70000"], "--metrics-port=70000 must be 0 (off) or a port"),
    (
        ["--total-kv-heads", "8", "--prefill-tp", "3"],
        "no valid configuration to run: skipped local P3->D1 H8 d128 pages 16/16 NHD/NHD: invalid TP layout: "
        "total_kv_heads=8 is not divisible by tp_size=3",
    ),
]


@pytest.mark.parametrize("argv,message", BAD)
def test_bad_input_exits_2_with_a_one_line_message(argv, message, capsys):
    try:
        code = main(["bench", *argv])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_a_registered_transport_that_cannot_be_imported_is_refused_by_name(monkeypatch, capsys):
    import sglang_kvxfer.transports as transports

    monkeypatch.setattr(transports, "available_transports", lambda: ["local"])
    assert main(["bench", "--transport", "local,tcp"]) == 2
    assert (
        "--transport 'tcp' cannot be used here: a package it needs is not installed (pip install 'sglang_kvxfer[tcp]')"
    ) in capsys.readouterr().err


def test_small_real_run_records_every_field_and_stays_below_its_baseline(tmp_path, capsys):
    plot = importlib.util.find_spec("matplotlib") is not None
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = [
        "bench",
        "--transport",
        "local,tcp",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "1",
        "--tokens",
        "64,512",
        "--chunk-tokens",
        "128",
        "--requests",
        "3",
        "--repeats",
        "2",
        "--layers",
        "2",
        "--json",
        "--quiet",
        "--output",
        str(out_json),
    ] + (["--plot", str(out_png)] if plot else [])
    assert main(argv) == 0
    printed = capsys.readouterr().out

    def no_nan(text):
        raise AssertionError(f"{text} in strict JSON")

    out = json.loads(printed, parse_constant=no_nan)
    assert json.loads(out_json.read_text(), parse_constant=no_nan) == out
    assert out["skipped"] == [] and out["machine"]["cpus"] >= 1 and "gbps" in out["definitions"]
    records = out["records"]
    assert [(r["transport"], r["tokens"]) for r in records] == [
        ("local", 64),
        ("local", 512),
        ("tcp", 64),
        ("tcp", 512),
    ]
    for r in records:
        assert (r["prefill_tp"], r["decode_tp"], r["total_kv_heads"], r["layers"], r["mla"]) == (2, 1, 8, 2, False)
        assert r["verified_requests"] == r["succeeded_requests"] == 6 and r["failures"] == []
        assert r["bytes_per_request"] == r["tokens"] * 8 * 2 * (128 + 128) * 2  # heads x layers x K+V dims x bf16
        assert r["bytes"] == 6 * r["bytes_per_request"]
        # TP 2 -> 1 on NHD pools: two writers per request, each a strided head slice. Over
        # local the decode's shared-memory pool is mapped in the prefill's process: one fused
        # copy each; over tcp 64 tokens go row by row (256 rows cost less than staging them)
        # and 512 tokens are staged
        fused = r["transport"] == "local"
        rows = r["transport"] == "tcp" and r["tokens"] == 64
        path = "fused" if fused else "per_token" if rows else "staged"
        assert r["data_path"] == {path: 6 * 2}
        assert r["pool_read_bytes_per_request"] == r["bytes_per_request"]  # no replicated heads: read once
        assert r["ops_per_request"] >= 2 and r["descriptors_per_s"] > 0
        base = r["baseline"]
        assert base["method"] == ("socket" if r["transport"] == "tcp" else "copy") and base["streams"] >= 1
        assert len(r["gbps_repeats"]) == len(base["gbps_repeats"]) == 2
        assert r["ratio"] == pytest.approx(r["gbps"] / base["gbps"], abs=1e-4)  # both rounded to 4 places
        # the engine moves these bytes at most as fast as a plain mover of the same bytes
        assert 0 < r["gbps"] <= base["gbps"] and 0 < r["request_gbps_p50"] <= base["gbps"]
        assert 0 < r["latency_ms"]["p50"] <= r["latency_ms"]["p90"] <= r["latency_ms"]["p99"]
        assert set(r["phases_ms"]) == set(PHASES)
        if fused:  # one move into the reader's memory; nothing is gathered or scattered
            assert r["phases_ms"]["wire"]["p50"] > 0 and r["phases_ms"]["scatter"]["p50"] == 0
        elif rows:  # rows straight into the reader's pool; the writer's notice no longer waits
            # for the ACK (landing receipts), so no wire time goes into its timings
            assert r["phases_ms"]["gather"]["p50"] == 0 and r["phases_ms"]["scatter"]["p50"] == 0
        else:
            assert r["phases_ms"]["gather"]["p50"] > 0 and r["phases_ms"]["scatter"]["p50"] > 0
        assert r["p99_over_p50"] == pytest.approx(r["latency_ms"]["p99"] / r["latency_ms"]["p50"], abs=2e-3)
        assert r["tail_ms"]["p50"] <= r["latency_ms"]["p50"]
    table = render(out).splitlines()
    assert table[0].startswith("transport  P->D  tokens") and len(table) == 2 + len(records)
    assert all(line.rstrip().endswith("6/6") for line in table[2:])
    if plot:
        data = out_png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_the_benchmark_script_runs_the_same_command():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_transfer.py"), "--requests", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "kvxfer bench: error: --requests=0 must be >= 1" in out.stderr
