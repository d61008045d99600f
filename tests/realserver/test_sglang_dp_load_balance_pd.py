"""A prefill whose DP groups a load balancer fills, through kvxfer (SGLang 0.5.23, CPU, Qwen3).

A tiny Qwen3 prefill server with ``--tp 2 --dp-size 2 --enable-dp-attention
--load-balance-method round_robin``: SGLang's controller places requests in turn, not by
``bootstrap_room % 2``. Every room here is even, so half of them land on DP group 1, which a
decode could not find by the room. The group registers each room with our bootstrap and the
TP 1 decode server's scheduler asks for it (SGLang's ``query_prefill_dp_ranks``, answered by
ours). Every request decodes the tokens of a single TP 1 server, the bootstrap names both
groups for the rooms, and zeroing what the writer delivered changes the tokens.

Its own module: started beside the eight servers of ``test_sglang_dp_attention_pd.py`` this
prefill did not become ready (twice, 600 s); alone it starts in about 30 s.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.realserver import harness as h
from tests.realserver.conftest import PREFILL_CHUNK, Fleet
from tests.realserver.test_sglang_dp_attention_pd import DP_FLAGS, dp_env, dp_models, fleet_port, prompt, room

pytestmark = pytest.mark.timeout(900)
__all__ = ["dp_env", "dp_models"]  # the fixtures, shared with the attention-DP module


@pytest.fixture(scope="module")
def balanced(dp_env, dp_models, logs):
    """(prefill, decode, reference, bootstrap port)."""
    chunk = ["--chunked-prefill-size", str(PREFILL_CHUNK)]
    model, port = dp_models["qwen3"], fleet_port()
    prefill = h.Server(
        "qwen3-prefill-dp2-round-robin",
        ["--model-path", str(model), *DP_FLAGS, "--load-balance-method", "round_robin"]
        + [*h.CPU_FLAGS, *h.PREFILL_FLAGS, *chunk, "--disaggregation-bootstrap-port", str(port)],
        h.tp_env(dp_env, 2),
        logs / "qwen3-prefill-dp2-round-robin.log",
        port=fleet_port(),
    )
    decode = h.decode_server("qwen3-decode-tp1-lb", model, 1, dp_env, logs)
    reference = h.reference_server("qwen3-reference-tp1-lb", model, 1, dp_env, logs)
    reference.args += chunk
    decode.port, reference.port = fleet_port(), fleet_port()
    fleet = Fleet()
    try:
        fleet.start(prefill, decode, reference)
        yield prefill, decode, reference, port
    finally:
        fleet.stop()


def test_rooms_a_round_robin_prefill_placed_are_found_through_its_bootstrap(balanced, server_env, logs: Path):
    from sglang_kvxfer import auth
    from sglang_kvxfer.engine import bootstrap

    prefill, decode, reference, port = balanced
    logs_of = f"--- {prefill.name}:\n{prefill.log_tail()}\n--- {decode.name}:\n{decode.log_tail()}"
    rooms = []
    for n, seed in ((12, 31), (PREFILL_CHUNK + 7, 32), (20, 33), (2 * PREFILL_CHUNK + 5, 34)):
        ids, rid = prompt(n, seed), room(0)
        rooms.append(rid)
        pre, dec = h.generate_pd(prefill, decode, port, ids, rid)
        want = h.output_ids(h.generate_single(reference, ids))
        assert want is not None and h.output_ids(dec) == want, f"{n}-token prompt: {dec} (prefill: {pre})\n{logs_of}"
    key = auth.key_from_secret(server_env["KVXFER_AUTH_KEY"])
    groups = bootstrap.room_groups(f"127.0.0.1:{port}", rooms, session="test", timeout_s=10.0, key=key)
    assert sorted(groups) == sorted(rooms) and set(groups.values()) == {0, 1}, groups

    # The negative control: zero what the (attention TP 1) writer delivered; tokens change.
    ids = prompt(PREFILL_CHUNK + 21, 35)
    want = h.output_ids(h.generate_single(reference, ids))
    got, zeroed = h.pair_tokens_corrupted((prefill, decode, port), logs, "0/1", ids, room(0))
    assert "zeroed heads" in zeroed, zeroed
    assert got != want, f"tokens did not change with the writer's KV zeroed: {got}"
