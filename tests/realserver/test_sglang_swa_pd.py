"""Hybrid sliding-window attention with SGLang 0.5.23's own servers on a CPU (tiny Gemma-4).

SGLang serves the tiny Gemma-4 text model (``tiny_swa_model.py``: 3 sliding-window layers of
window 16, one full-attention layer) with a separate SWA pool, so every rank's KVArgs carry
``state_types=['swa']`` and each request's last window travels as state beside the full
layers' KV. A prefill of TP 1 and of TP 2 (the SWA heads re-sharded) serve a decode of TP 1;
the decode server's greedy tokens must equal those of a single server of the prefill's TP
size, for prompts shorter than the window, longer than it and over several chunks, and the
transfer records show the SWA part on both sides. The negative control zeroes the rows the
SWA state landed in on the decode after the transfer: the tokens must then change.

Gemma-4 refuses ``--attention-backend torch_native``; ``intel_amx`` falls back to the torch
native kernels on a CPU without AMX (realservers: "Gemma-4 text ... runs").
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
SWA_PART = "SWA state (KVArgs.state_types[0]='swa')"
_rooms = random.Random(20261204)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


@pytest.fixture(scope="module")
def gemma4(sglang_env, tmp_path_factory) -> Path:
    return h.build_tiny_swa_model(tmp_path_factory.mktemp("tiny-gemma4") / "model")


@pytest.fixture(scope="module", params=[1, 2], ids=["prefill-tp1", "prefill-tp2"])
def swa_pair(request, server_env, gemma4, logs: Path):
    """A PD pair (prefill of TP ``param``, decode of TP 1) and a single server of the prefill's TP."""
    tp = request.param
    records = logs / f"records-swa-tp{tp}.jsonl"
    env = dict(server_env, KVXFER_SGLANG_TRANSPORT="local", KVXFER_RECORDS_FILE=str(records))
    keep = ("llama", "gemma4_causal", "gemma3_causal")  # Gemma-4's module imports Gemma-3's
    env["SGLANG_DISABLED_MODEL_ARCHS"] = ",".join(h.other_model_archs(keep=keep))
    port = h.free_port()
    prefill = h.prefill_server(f"swa-prefill-tp{tp}", gemma4, tp, env, logs, port, FLAGS)
    decode = h.decode_server(f"swa-decode-tp1-{tp}", gemma4, 1, env, logs, FLAGS)
    reference = h.reference_server(f"swa-reference-tp{tp}", gemma4, tp, env, logs)
    reference.args += FLAGS
    fleet = Fleet()
    try:
        fleet.start(prefill, decode, reference)
        yield prefill, decode, port, reference, records
    finally:
        fleet.stop()


def test_hybrid_swa_tokens_equal_a_single_server(swa_pair):
    records = swa_pair[4]
    # shorter than the window; longer than it; three chunks
    for n, seed in ((12, 1), (40, 2), (2 * PREFILL_CHUNK + 22, 3)):
        ids = prompt(n, seed)
        rid = _rooms.getrandbits(62) + 1
        got, want = h.pair_tokens(swa_pair, ids, rid), h.pair_reference(swa_pair, ids)
        assert got == want, f"{n}-token prompt: {got} != {want}\n{h.pair_logs(swa_pair)}"
        lines = [json.loads(line) for line in records.read_text().splitlines() if line.strip()]
        mine = [r for r in lines if r.get("room") == rid]
        assert {r["side"] for r in mine} == {"prefill", "decode"} and all(r["ok"] for r in mine), mine
        for r in mine:  # every rank of both sides moved the request's SWA window as its own part
            (part,) = r["state"]
            assert part["pool"] == SWA_PART and part["ok"] and part["bytes"] > 0, r
        decode_swa = sum(r["state_bytes"] for r in mine if r["side"] == "decode")
        assert decode_swa == sum(r["state_bytes"] for r in mine if r["side"] == "prefill"), mine


def test_negative_control_zeroed_swa_state_changes_the_tokens(swa_pair, logs: Path):
    """Zero the rows the SWA state landed in on the decode: the tokens must change (and come
    back once the hook is off)."""
    ids = prompt(PREFILL_CHUNK + 30, 7)
    want = h.pair_reference(swa_pair, ids)
    got, zeroed = h.pair_tokens_corrupted(swa_pair, logs, "swa", ids, _rooms.getrandbits(62) + 1)
    assert "zeroed the SWA state of" in zeroed, zeroed
    assert got != want, f"tokens did not change with the SWA state zeroed: {got}"
    assert h.pair_tokens(swa_pair, ids, _rooms.getrandbits(62) + 1) == want
