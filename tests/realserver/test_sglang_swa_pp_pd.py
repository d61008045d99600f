"""Hybrid sliding-window attention with pipeline parallelism, SGLang 0.5.23's own servers on a CPU.

A tiny Gemma-4 of four layers (sliding-window, full, sliding-window, full: each of two PP
stages holds one of each) is served by a prefill of ``--pp-size 2`` and a decode of TP 1, of PP
1 (both stages into its pools) and of PP 2 (stage to stage).
SGLang's ``SWAKVPool`` holds every layer of the model on each PP stage (KVArgs list the whole
model's full-attention and SWA entries, ``prefill_start_layer`` 0 on both stages) while a
stage's forward writes only its own layers: each stage must send its own layers' KV and SWA
window, and a decode of PP 1 place them by the stages' entry counts. The decode's greedy tokens must
equal those of a single TP 1 server, for prompts shorter than the window, longer than it and
over several chunks; the decode's record shows each stage's KV part and each stage's SWA
part. The negative control zeroes the rows the SWA state landed in on the decode: the tokens
must then change.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.realserver import harness as h
from tests.realserver.conftest import PREFILL_CHUNK, Fleet

pytestmark = pytest.mark.timeout(900)

FLAGS = ["--attention-backend", "intel_amx", "--chunked-prefill-size", str(PREFILL_CHUNK)]
SWA = "SWA state (KVArgs.state_types[0]='swa')"
_rooms = random.Random(20261205)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


@pytest.fixture(scope="module")
def gemma4_sfsf(sglang_env, tmp_path_factory) -> Path:
    return h.build_tiny_swa_model(tmp_path_factory.mktemp("tiny-gemma4-sfsf") / "model", "sfsf")


@pytest.fixture(scope="module", params=[1, 2], ids=["decode-pp1", "decode-pp2"])
def pp_pair(request, server_env, gemma4_sfsf, logs: Path):
    """A PD pair (prefill PP 2, decode TP 1 of PP ``param``) and a single TP 1 server."""
    decode_pp = request.param
    records = logs / f"records-swa-pp-decode-pp{decode_pp}.jsonl"
    env = dict(server_env, KVXFER_SGLANG_TRANSPORT="local", KVXFER_RECORDS_FILE=str(records))
    keep = ("llama", "gemma4_causal", "gemma3_causal")  # Gemma-4's module imports Gemma-3's
    env["SGLANG_DISABLED_MODEL_ARCHS"] = ",".join(h.other_model_archs(keep=keep))
    port = h.free_port()
    # two ranks (one per stage) on two cores: one OpenMP thread bound to each
    prefill = h.prefill_server(
        "swa-pp2-prefill", gemma4_sfsf, 1, h.tp_env(env, 2), logs, port, ["--pp-size", "2", *FLAGS]
    )
    decode = h.decode_server(
        f"swa-decode-pp{decode_pp}",
        gemma4_sfsf,
        1,
        h.tp_env(env, decode_pp),
        logs,
        ["--pp-size", str(decode_pp), *FLAGS],
    )
    reference = h.reference_server(f"swa-pp-reference-tp1-{decode_pp}", gemma4_sfsf, 1, env, logs)
    reference.args += FLAGS
    fleet = Fleet()
    try:
        fleet.start(prefill, decode, reference)
        yield prefill, decode, port, reference, records, decode_pp
    finally:
        fleet.stop()


def test_pp2_hybrid_swa_prefill_to_tp1_decode_tokens_equal_a_single_server(pp_pair):
    records = pp_pair[4]
    # shorter than the window; longer than it; three chunks
    for n, seed in ((12, 1), (40, 2), (2 * PREFILL_CHUNK + 22, 3)):
        ids = prompt(n, seed)
        rid = _rooms.getrandbits(62) + 1
        got, want = h.pair_tokens(pp_pair, ids, rid), h.pair_reference(pp_pair, ids)
        assert got == want, f"{n}-token prompt: {got} != {want}\n{h.pair_logs(pp_pair)}"
        lines = [json.loads(line) for line in records.read_text().splitlines() if line.strip()]
        mine = [r for r in lines if r.get("room") == rid]
        writers = sorted((r["pp_rank"], r["bytes"], r["state_bytes"]) for r in mine if r["side"] == "prefill")
        decodes = sorted((r for r in mine if r["side"] == "decode"), key=lambda r: r.get("pp_rank", 0))
        assert all(r["ok"] for r in mine), mine
        if pp_pair[5] == 1:  # one decode record, a KV part and an SWA part per stage (its one layer of each)
            (dec,) = decodes
            stages = [s["stage"] for s in dec["pp_stages"]]
            assert stages == ["PP stage 0 (from layer 0, entries [0, 1))", "PP stage 1 (from layer 2, entries [1, 2))"]
            assert [p["pool"] for p in dec["state"]] == [
                f"{SWA} of PP stage 0 (from layer 0, entries [0, 1))",
                f"{SWA} of PP stage 1 (from layer 2, entries [1, 2))",
            ], dec["state"]
            parts = [(s["bytes"], p["bytes"]) for s, p in zip(dec["pp_stages"], dec["state"])]
        else:  # decode stage s received prefill stage s's KV and SWA window
            assert [r["pp_rank"] for r in decodes] == [0, 1], decodes
            stages = [r["pp_stages"][0]["stage"] for r in decodes]
            assert stages == ["PP stage 0 (from layer 0, entries [0, 1))", "PP stage 1 (from layer 2, entries [0, 1))"]
            assert all([p["pool"] for p in r["state"]] == [SWA] for r in decodes), decodes
            parts = [(r["bytes"] - r["state_bytes"], r["state_bytes"]) for r in decodes]
        assert all(b > 0 and sb > 0 for b, sb in parts), parts
        assert [(b, sb) for _, b, sb in writers] == [(b + sb, sb) for b, sb in parts], (writers, decodes)


def test_negative_control_zeroed_swa_state_changes_the_tokens(pp_pair, logs: Path):
    """Zero the rows both stages' SWA state landed in on the decode: the tokens must change
    (and come back once the hook is off)."""
    ids = prompt(PREFILL_CHUNK + 30, 7)
    want = h.pair_reference(pp_pair, ids)
    got, zeroed = h.pair_tokens_corrupted(pp_pair, logs, "swa", ids, _rooms.getrandbits(62) + 1)
    assert "zeroed the SWA state of" in zeroed, zeroed
    assert got != want, f"tokens did not change with the SWA state zeroed: {got}"
    assert h.pair_tokens(pp_pair, ids, _rooms.getrandbits(62) + 1) == want
