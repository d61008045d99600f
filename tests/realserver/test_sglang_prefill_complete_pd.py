"""``--disaggregation-decode-allocation-policy prefill_complete`` with SGLang 0.5.23's own
servers on a CPU (tiny Llama): the decode allocates a request's KV only once the prefill's
forward of it finished (the prefill runs it before the decode's pages are known, SGLang's
optimistic prefill). SGLang refuses the policy for every backend but mooncake before any
backend is built; the plugin lets ``kvxfer`` through that check (``sglang_install``), its
other rules intact: attention TP 1 on both servers.

A prefill of TP 1 and a decode of TP 1, both with the policy, over ``tcp``: one-chunk and
three-chunk prompts decode exactly the tokens of a single TP 1 server. The negative control
zeroes what the prefill wrote into the decode's pool: the tokens change (and come back once
the hook is off)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.realserver import harness as h
from tests.realserver.conftest import PREFILL_CHUNK, running_pair

pytestmark = pytest.mark.timeout(900)

POLICY = ["--disaggregation-decode-allocation-policy", "prefill_complete"]
_rooms = random.Random(20261207)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


@pytest.fixture(scope="module")
def pair(server_env, tiny_model, logs: Path):
    env = dict(server_env, KVXFER_SGLANG_TRANSPORT="tcp")
    with running_pair("prefill-complete", tiny_model, env, logs, 1, 1, POLICY, POLICY) as servers:
        yield servers


def run(pair, ids: list[int]) -> tuple[dict, dict]:
    prefill, decode, port = pair
    return h.generate_pd(prefill, decode, port, ids, _rooms.getrandbits(62) + 1)


def test_both_servers_with_the_policy_decode_the_reference_tokens(pair, reference_tokens):
    for server in pair[:2]:  # the backend runs the policy on both (SGLang's check let it through)
        assert "allocates once the prefill's forward finished (prefill_complete)" in server.log_path.read_text()
    for ids in (prompt(20, 1), prompt(2 * PREFILL_CHUNK + 7, 2)):  # one chunk; three chunks
        pre, dec = run(pair, ids)
        got = h.output_ids(dec)
        assert got == reference_tokens(1, ids), f"decode answered {dec} (prefill: {pre})\n{h.pair_logs(pair)}"


def test_negative_control_zeroed_prefill_kv_changes_the_tokens(pair, reference_tokens, logs: Path):
    ids = prompt(PREFILL_CHUNK + 5, 3)
    want = reference_tokens(1, ids)
    got, zeroed = h.pair_tokens_corrupted(pair, logs, "0/1", ids, _rooms.getrandbits(62) + 1)
    assert "zeroed heads" in zeroed, zeroed
    assert got != want, f"tokens did not change with the prefill's KV zeroed: {got}"
    _, dec = run(pair, ids)  # and the pair decodes the reference again with the hook off
    assert h.output_ids(dec) == want, dec
