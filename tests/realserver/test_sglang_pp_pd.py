"""Pipeline parallelism on the prefill with SGLang 0.5.23's own servers on a CPU (tiny Llama).

A prefill server of ``--pp-size 2`` (two scheduler processes, each a writer of its two of the
four layers) and a decode server of TP 1 (PP 1: both stages' layers into its one pool): the
decoded tokens equal those of a single TP 1 server (realservers: PP 2 gives TP 1's tokens),
for a one-chunk and a four-chunk prompt; the decode's records show a part per stage. The
negative control zeroes what stage 1 delivered, on the decode after it landed: the tokens
must then differ, so equality really depends on the bytes both stages wrote.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.realserver import conftest
from tests.realserver import harness as h
from tests.realserver.conftest import PREFILL_CHUNK, Fleet

pytestmark = pytest.mark.timeout(900)

_rooms = random.Random(20261203)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


@pytest.fixture(scope="module")
def pp_pair(server_env, tiny_model, logs: Path):
    """The PD pair, and a TP 1 reference: the session's if it is up, else one of its own."""
    records = logs / "records-pp.jsonl"
    env = dict(server_env, KVXFER_SGLANG_TRANSPORT="local", KVXFER_RECORDS_FILE=str(records))
    port = h.free_port()
    chunk = ["--chunked-prefill-size", str(PREFILL_CHUNK)]
    # two ranks (one per stage) on two cores: one OpenMP thread bound to each
    prefill = h.prefill_server("pp2-prefill", tiny_model, 1, h.tp_env(env, 2), logs, port, ["--pp-size", "2", *chunk])
    decode = h.decode_server("pp-decode-tp1", tiny_model, 1, env, logs)
    servers = [prefill, decode]
    reference = conftest.RUNNING_REFERENCES.get(1)
    if reference is None:
        reference = h.reference_server("pp-reference-tp1", tiny_model, 1, server_env, logs)
        reference.args += chunk
        servers.append(reference)
    fleet = Fleet()
    try:
        fleet.start(*servers)
        yield prefill, decode, port, reference, records
    finally:
        fleet.stop()


def logs_of(pp_pair) -> str:
    prefill, decode = pp_pair[:2]
    return f"--- {prefill.name}:\n{prefill.log_tail()}\n--- {decode.name}:\n{decode.log_tail()}"


def run(pp_pair, ids: list[int], rid: int) -> list[int] | None:
    prefill, decode, port = pp_pair[:3]
    pre, dec = h.generate_pd(prefill, decode, port, ids, rid)
    got = h.output_ids(dec)
    assert got is not None, f"decode answered {dec} (prefill: {pre})\n{logs_of(pp_pair)}"
    return got


def reference(pp_pair, ids: list[int]) -> list[int]:
    answer = h.generate_single(pp_pair[3], ids)
    want = h.output_ids(answer)
    assert want is not None, f"reference failed: {answer}"
    return want


def test_pp2_prefill_to_tp1_decode_tokens_equal_a_single_server(pp_pair):
    records = pp_pair[4]
    for n, seed in ((12, 1), (3 * PREFILL_CHUNK + 17, 2)):  # one chunk; four chunks
        ids = prompt(n, seed)
        rid = _rooms.getrandbits(62) + 1
        got, want = run(pp_pair, ids, rid), reference(pp_pair, ids)
        assert got == want, f"PP 2 prefill -> TP 1 decode, {n}-token prompt: {got} != {want}\n{logs_of(pp_pair)}"
        lines = [json.loads(line) for line in records.read_text().splitlines() if line.strip()]
        mine = [r for r in lines if r.get("room") == rid and r.get("side") == "decode"]
        assert len(mine) == 1 and mine[0]["ok"], mine
        stages = mine[0]["pp_stages"]
        assert [s["stage"] for s in stages] == ["PP stage 0 (layers [0, 2))", "PP stage 1 (layers [2, 4))"], stages
        assert all(s["ok"] and s["bytes"] > 0 for s in stages) and stages[0]["bytes"] == stages[1]["bytes"], stages
        writers = sorted((r["pp_rank"], r["bytes"]) for r in lines if r.get("room") == rid and r["side"] == "prefill")
        assert writers == [(0, stages[0]["bytes"]), (1, stages[1]["bytes"])], writers  # each stage sent its layers


def test_negative_control_zeroed_stage_changes_the_tokens(pp_pair, logs: Path):
    """Zero the layers stage 1 wrote into the decode's pool: the tokens must change (and come
    back once the hook is off)."""
    ids = prompt(2 * PREFILL_CHUNK + 3, 7)
    want = reference(pp_pair, ids)
    control = logs / "corrupt-writer"
    record = Path(str(control) + ".log")
    before = record.read_text() if record.exists() else ""
    control.write_text("stage 1")
    try:
        got = run(pp_pair, ids, _rooms.getrandbits(62) + 1)
    finally:
        control.unlink()
    zeroed = record.read_text()[len(before) :]
    assert "zeroed layers 2..3 (PP stage 1)" in zeroed, zeroed
    assert got != want, f"tokens did not change with stage 1's KV zeroed: {got}"
    assert run(pp_pair, ids, _rooms.getrandbits(62) + 1) == want
