"""``kvxfer plan``: JSON fields, the human table, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sglang_kvxfer.cli import main


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "sglang_kvxfer", *args], capture_output=True, text=True, timeout=60)


def test_json_lists_every_writer_reader_pair(capsys):
    assert main(["plan", "--total-kv-heads", "2", "--prefill-tp", "1", "--decode-tp", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["total_kv_heads"], out["prefill_tp"], out["decode_tp"], out["mla"]) == (2, 1, 8, False)
    assert [t["decode_rank"] for t in out["transfers"]] == list(range(8))
    assert [t["src_head_start"] for t in out["transfers"]] == [0, 0, 0, 0, 1, 1, 1, 1]
    for t in out["transfers"]:
        assert {"prefill_rank", "decode_rank", "src_head_start", "dst_head_start", "num_heads"} <= set(t)
        assert t["num_heads"] == 1 and t["dst_head_start"] == 0


def test_json_for_p_greater_than_d_and_mla(capsys):
    main(["plan", "--total-kv-heads", "8", "--prefill-tp", "4", "--decode-tp", "2", "--json", "--tokens", "64"])
    out = json.loads(capsys.readouterr().out)
    got = [
        (t["prefill_rank"], t["decode_rank"], t["src_head_start"], t["dst_head_start"], t["num_heads"])
        for t in out["transfers"]
    ]
    assert got == [(0, 0, 0, 0, 2), (1, 0, 0, 2, 2), (2, 1, 0, 0, 2), (3, 1, 0, 2, 2)]
    assert all(t["path"] == "staged" and t["ops_staged"] == 1 for t in out["transfers"])
    main(
        [
            "plan",
            "--total-kv-heads",
            "1",
            "--prefill-tp",
            "4",
            "--decode-tp",
            "2",
            "--mla",
            "--head-dim",
            "576",
            "--json",
            "--pages",
            "contiguous",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert out["mla"] and len(out["transfers"]) == 2
    assert all(t["path"] == "direct" for t in out["transfers"])


def test_human_table(capsys):
    main(["plan", "--total-kv-heads", "8", "--prefill-tp", "2", "--decode-tp", "1"])
    text = capsys.readouterr().out
    assert "ops per-token" in text and "decode rank 0: heads [0, 8), waits for 2 writer(s): [0, 1]" in text
    assert "staged: head slice 4/8 is strided in the NHD destination" in text


def test_hnd_kv_is_selectable_and_shown_in_json_and_table(capsys):
    base = ["plan", "--total-kv-heads", "8", "--prefill-tp", "1", "--decode-tp", "2", "--tokens", "64"]
    base += ["--layers", "2", "--pages", "contiguous"]
    assert main([*base, "--prefill-layout", "hnd_kv", "--decode-layout", "HND_KV", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["request"]["prefill_layout"], out["request"]["decode_layout"]) == ("HND_KV", "HND_KV")
    # A decode rank's 4 heads of one page: one run of K and V; 4 pages x 2 layers (one buffer each).
    assert all(t["path"] == "direct" and t["ops_direct"] == 8 for t in out["transfers"])
    assert main([*base, "--prefill-layout", "HND_KV", "--decode-layout", "NHD"]) == 0
    text = capsys.readouterr().out
    assert "layout HND_KV/NHD" in text and "staged: layouts differ (HND_KV -> NHD)" in text


@pytest.mark.parametrize(
    "args,words",
    [
        (
            ["--total-kv-heads", "8", "--prefill-tp", "3", "--decode-tp", "1"],
            "total_kv_heads=8 is not divisible by tp_size=3",
        ),
        (
            ["--total-kv-heads", "8", "--prefill-tp", "1", "--decode-tp", "12"],
            "tp_size=12 is not a multiple of total_kv_heads=8",
        ),
        (["--total-kv-heads", "x", "--prefill-tp", "1", "--decode-tp", "1"], "invalid int value: 'x'"),
        (
            ["--total-kv-heads", "8", "--prefill-tp", "1", "--decode-tp", "1", "--dtype", "int3"],
            "dtype='int3' is not supported",
        ),
        (
            ["--total-kv-heads", "8", "--prefill-tp", "1", "--decode-tp", "1", "--tokens", "0"],
            "--tokens=0 must be >= 1",
        ),
        (
            ["--total-kv-heads", "2", "--prefill-tp", "1", "--decode-tp", "1", "--mla"],
            "total_kv_heads=2 must be 1 for MLA",
        ),
        (
            ["--total-kv-heads", "8", "--prefill-tp", "1", "--decode-tp", "1", "--decode-layout", "HKV"],
            "layout='HKV' is not supported; use NHD, HND or HND_KV",
        ),
        (
            ["--total-kv-heads", "8", "--prefill-tp", "1", "--decode-tp", "1"]
            + ["--prefill-layout", "HND_KV", "--v-head-dim", "64"],
            "v_head_dim=64 must equal head_dim=128 for layout=HND_KV",
        ),
    ],
)
def test_invalid_input_is_one_line_without_traceback(args, words):
    proc = run_cli("plan", *args)
    assert proc.returncode == 2
    assert words in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_attention_dp_plans_between_the_routed_groups(capsys):
    """--tp 4 --dp-size 2 prefill (attention TP 2) into a --tp 4 --dp-size 4 decode (attention
    TP 1): room 5 goes to prefill group 5 % 2 = 1 (server ranks 2, 3), both of whose ranks
    write all 8 heads of decode group 3 (server rank 3)."""
    args = ["plan", "--total-kv-heads", "8", "--prefill-tp", "4", "--prefill-dp", "2", "--decode-tp", "4"]
    args += ["--decode-dp", "4", "--decode-dp-rank", "3", "--room", "5", "--tokens", "64", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["prefill_attn_tp"], out["decode_attn_tp"], out["prefill_dp_rank"], out["decode_dp_rank"]) == (
        2,
        1,
        1,
        3,
    )
    got = [
        (t["prefill_rank"], t["prefill_tp_rank"], t["decode_rank"], t["decode_tp_rank"], t["global_heads"])
        for t in out["transfers"]
    ]
    assert got == [(0, 2, 0, 3, [0, 4]), (1, 3, 0, 3, [4, 8])]
    assert [p["tp_rank"] for p in out["prefill_ranks"]] == [2, 3]
    assert [d["tp_rank"] for d in out["decode_ranks"]] == [3]
    # the router's prefill_dp_rank overrides room % dp; the table names both kinds of rank
    assert main([*args[:-1], "--prefill-dp-rank", "0"]) == 0
    table = capsys.readouterr().out
    assert "attention DP: prefill group 0 of 2" in table and "0 (3)" in table


def test_attention_dp_errors_name_the_flags():
    bad = run_cli("plan", "--total-kv-heads", "8", "--prefill-tp", "4", "--prefill-dp", "3", "--decode-tp", "1")
    assert bad.returncode != 0 and "--prefill-tp=4 must be a multiple of --prefill-dp=3" in bad.stderr
    bad = run_cli(
        "plan",
        "--total-kv-heads",
        "8",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "2",
        "--decode-dp",
        "2",
        "--decode-dp-rank",
        "2",
    )
    assert bad.returncode != 0 and "--decode-dp-rank=2 must be in [0, 2)" in bad.stderr


def test_pipeline_parallel_stages_in_json_and_table(capsys):
    """--prefill-pp 2 over 5 layers: SGLang's split ([0, 2), [2, 5)), every stage's writers
    with the stage's layers and bytes; into a decode of PP 1 (one pool) or PP 2 (stage s to
    decode stage s)."""
    args = ["plan", "--total-kv-heads", "8", "--prefill-tp", "2", "--decode-tp", "1", "--layers", "5"]
    args += ["--tokens", "64", "--prefill-pp", "2"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["prefill_pp"], out["decode_pp"]) == (2, 1)
    assert out["stages"] == [
        {"pp_rank": 0, "layers": [0, 2], "decode_pp_rank": 0},
        {"pp_rank": 1, "layers": [2, 5], "decode_pp_rank": 0},
    ]
    rows = [(t["pp_rank"], t["prefill_rank"], t["layers"], t["bytes"]) for t in out["transfers"]]
    per_layer = 2 * 4 * 128 * 2 * 64  # K and V of 4 heads x head_dim 128 x bf16 x 64 tokens
    assert rows == [(0, 0, [0, 2], 2 * per_layer), (0, 1, [0, 2], 2 * per_layer)] + [
        (1, 0, [2, 5], 3 * per_layer),
        (1, 1, [2, 5], 3 * per_layer),
    ]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "(pipeline parallel: 2 prefill PP stages, layers [0, 2), [2, 5), all into the one decode pool" in text
    assert "stage     prefill" in text and "\n1 [2, 5)  1        0  " in text
    assert "prefill PP stage 1: layers [2, 5), written to layers [2, 5) of the decode pool" in text
    # decode PP 2 and an explicit partition (SGLANG_PP_LAYER_PARTITION)
    assert main([*args, "--decode-pp", "2", "--pp-layers", "4,1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(st["layers"], st["decode_pp_rank"]) for st in out["stages"]] == [([0, 4], 0), ([4, 5], 1)]
    assert {t["decode_pp_rank"] for t in out["transfers"] if t["pp_rank"] == 1} == {1}


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--prefill-pp", "2", "--decode-pp", "3"], "--decode-pp=3 must equal --prefill-pp=2 or be 1"),
        (["--prefill-pp", "0"], "--prefill-pp=0 and --decode-pp=1 must be >= 1"),
        (["--prefill-pp", "2", "--pp-layers", "1,2"], "must give each of the 2 PP stages at least one layer, 4 layers"),
        (["--pp-layers", "2,2"], "--pp-layers needs --prefill-pp > 1"),
        (["--prefill-pp", "5"], "4 layers cannot be split over 5 PP stages"),
    ],
)
def test_pipeline_parallel_errors_name_the_flags(extra, words):
    bad = run_cli("plan", "--total-kv-heads", "8", "--prefill-tp", "1", "--decode-tp", "1", "--layers", "4", *extra)
    assert bad.returncode == 2 and words in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


def test_extra_per_request_state_pools_in_json_and_table(capsys):
    base = ["plan", "--total-kv-heads", "8", "--prefill-tp", "2", "--decode-tp", "1", "--layers", "4"]
    state = ["--tokens", "100", "--page-size", "16", "--swa-layers", "3", "--swa-kv-heads", "4", "--swa-window", "40"]
    state += ["--dsa-layers", "2", "--dsa-row-bytes", "528"]
    assert main([*base, *state, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    swa, dsa = out["state"]
    # SGLang's window: from the page-aligned max(0, 100 - 40) = 48, so 52 tokens in 4 pages
    assert (swa["pool"], swa["layers"], swa["total_kv_heads"], swa["tokens"], swa["indices"]) == (
        "state:swa",
        3,
        4,
        52,
        4,
    )
    assert [(t["prefill_rank"], t["decode_rank"], t["global_heads"]) for t in swa["transfers"]] == [
        (0, 0, [0, 2]),
        (1, 0, [2, 4]),
    ]
    assert all(t["bytes"] == 3 * 2 * 52 * 2 * 128 * 2 for t in swa["transfers"])  # layers x K,V x tokens x heads x dim
    assert (dsa["pool"], dsa["row_bytes"], dsa["indices"]) == ("state:dsa", 528, 7)  # one row per KV page
    (writer,) = dsa["transfers"]  # replicated: one writer for the one decode rank
    assert writer["bytes"] == 2 * 7 * 528
    assert main([*base, *state]) == 0
    table = capsys.readouterr().out
    assert "state pool state:swa (3 layers, 4 KV head(s), the last 52 tokens):" in table
    assert "  prefill 1 -> decode 0 heads [2, 4): 156.0 KiB, staged, 1 op(s)" in table
    assert "state pool state:dsa (2 layers, rows of 528 bytes, 7 row(s) per layer):" in table
    assert main([*base, "--json"]) == 0 and json.loads(capsys.readouterr().out)["state"] == []


def test_mamba_state_is_planned_rank_to_rank_and_refused_between_tp_sizes(capsys):
    base = ["plan", "--total-kv-heads", "8", "--decode-tp", "2", "--mamba-layers", "3", "--mamba-row-bytes", "64,256"]
    assert main([*base, "--prefill-tp", "2", "--json"]) == 0
    conv, ssm = json.loads(capsys.readouterr().out)["state"]
    assert (conv["pool"], ssm["pool"], conv["indices"]) == ("state:mamba.0", "state:mamba.1", 1)
    for pool, row in ((conv, 64), (ssm, 256)):
        assert [(t["prefill_rank"], t["decode_rank"], t["bytes"]) for t in pool["transfers"]] == [
            (0, 0, 3 * row),
            (1, 1, 3 * row),
        ]
    done = run_cli(*base, "--prefill-tp", "1")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "prefill attention TP 1 and decode attention TP 2 differ; mamba state rows are sharded" in done.stderr


def test_mamba_channels_are_resliced_between_tp_sizes_each_conv_sub_block_on_its_own(capsys):
    """Conv rows of 96 bytes on a prefill rank of TP 2 (16 of 32 channels, sub-blocks 8, 8, 16),
    SSM rows of 256 bytes (4 of 8 heads), a replicated tensor: to a decode of TP 1, every
    sliced pool's channels come from both writers, the replicated rows from one."""
    base = ["plan", "--total-kv-heads", "8", "--prefill-tp", "2", "--decode-tp", "1", "--mamba-layers", "3"]
    base += ["--mamba-row-bytes", "96,256,10", "--mamba-channels", "32,8,0", "--mamba-conv-groups", "8,8,16"]
    assert main([*base, "--json"]) == 0
    pools = json.loads(capsys.readouterr().out)["state"]
    assert [(p["pool"], p["total_kv_heads"], p["channel_bytes"]) for p in pools] == [
        ("state:mamba.0", 8, 6),
        ("state:mamba.1", 8, 6),
        ("state:mamba.2", 16, 6),
        ("state:mamba.3", 8, 64),
        ("state:mamba.4", None, None),
    ]
    for pool, local in zip(pools[:4], (4, 4, 8, 4)):
        got = [(t["prefill_rank"], t["decode_rank"], t["global_heads"], t["bytes"]) for t in pool["transfers"]]
        per = 3 * local * pool["channel_bytes"]
        assert got == [(0, 0, [0, local], per), (1, 0, [local, 2 * local], per)]
    assert [(t["decode_rank"], t["bytes"]) for t in pools[4]["transfers"]] == [(0, 3 * 10)]
    assert main(base) == 0
    table = capsys.readouterr().out
    assert "state pool state:mamba.2 (3 layers, 16 channels of 6 bytes sliced over attention TP):" in table
    assert "  prefill 1 -> decode 0 channels [8, 16): 144 B, " in table
    done = run_cli(*base[:-2], "--mamba-conv-groups", "8,8,8")
    assert done.returncode == 2 and "--mamba-conv-groups=[8, 8, 8] must add up to the first tensor's 32" in done.stderr
    done = run_cli(*base[:-4], "--mamba-channels", "32,8")
    assert done.returncode == 2 and "--mamba-channels has 2 value(s); --mamba-row-bytes has 3" in done.stderr
    done = run_cli(*base[:-4], "--mamba-channels", "32,6,0")  # 6 channels over TP 2: 3 per rank, 256 bytes
    assert done.returncode == 2 and "tensor 1's 6 channels do not divide over attention TP 2 and 1" in done.stderr


def test_state_pools_with_prefill_pp_are_planned_per_stage(capsys):
    """With --prefill-pp each state pool's layers are split as SGLang splits layers (3 over 2
    stages: 1 and 2) and each stage's writers send its entries, in JSON and the table; a pool
    with fewer layers than stages is refused naming it."""
    base = ["plan", "--total-kv-heads", "8", "--layers", "4", "--prefill-tp", "2", "--prefill-pp", "2"]
    state = ["--tokens", "40", "--page-size", "8", "--swa-layers", "3", "--swa-kv-heads", "2", "--swa-window", "16"]
    state += ["--mamba-layers", "3", "--mamba-row-bytes", "64", "--decode-tp", "2"]
    assert main([*base, *state, "--json"]) == 0
    swa, mamba = json.loads(capsys.readouterr().out)["state"]
    for pool, per_layer in ((swa, 2 * 16 * 1 * 128 * 2), (mamba, 64)):  # SWA: K,V x 16 window tokens x head x dim
        got = [(t["pp_rank"], t["entries"], t["prefill_rank"], t["decode_rank"], t["bytes"]) for t in pool["transfers"]]
        assert got == [
            (0, [0, 1], 0, 0, per_layer),
            (0, [0, 1], 1, 1, per_layer),
            (1, [1, 3], 0, 0, 2 * per_layer),
            (1, [1, 3], 1, 1, 2 * per_layer),
        ], pool["transfers"]
    assert main([*base, *state]) == 0
    table = capsys.readouterr().out
    assert "  PP stage 1 entries [1, 3): prefill 1 -> decode 1 heads [1, 2): 16.0 KiB, " in table
    done = run_cli(*base, "--decode-tp", "1", "--swa-layers", "1")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "state:swa: 1 layer(s) over --prefill-pp=2 stages leave a stage without any" in done.stderr
