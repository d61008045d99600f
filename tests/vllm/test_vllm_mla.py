"""MLA under vLLM 0.32 (CPU_MLA, tiny DeepSeek-V3): the latent moves byte-exactly.

vLLM's CPU MLA gives no stable token reference (docs/vllm.md, "KV layouts": TP 1 and TP 2
decode differently without any transfer, and so does an engine fed its own KV), so this
module checks the bytes instead of the tokens. A TP 1 producer sends a prompt's latent
blocks to a TP 2 consumer over ``tcp``; both consumer ranks hold the whole latent (MLA
replicates it), so each must hold exactly the bytes the producer's rank sent, every layer,
every block, the last block's unused rows included (whole blocks move). The test connector
(tests/vllm/corrupt_connector.py) dumps the blocks on both sides; the comparison is raw bytes.
Controls: the dumps are not all zeros, and two different prompts give different bytes (so
equal bytes mean the transfer, not a constant). The consumer then decodes its 16 tokens.
"""

from __future__ import annotations

import secrets

import pytest

from tests.vllm import harness as h
from tests.vllm.test_vllm_pd import N, prompt

pytestmark = pytest.mark.timeout(900)

BLOCK_SIZE = 16  # vLLM's CPU platform forces 16 for MLA


@pytest.fixture(scope="module")
def mla_pair(vllm_env, vllm_mla_model, vllm_logs, tmp_path_factory):
    dumps = tmp_path_factory.mktemp("mla-dumps")
    env = h.base_env(secrets.token_hex(32))
    env.update(
        KVXFER_HEARTBEAT_INTERVAL_S="1",
        KVXFER_HEARTBEAT_TIMEOUT_S="30",
        KVXFER_BOOTSTRAP_TIMEOUT_S="30",
        KVXFER_TEST_DUMP_DIR=str(dumps),
    )
    test_connector = dict(connector="KVXferTestConnector", connector_module="tests.vllm.corrupt_connector")
    # CPU_MLA on every CPU: AMX_MLA (vLLM's pick where AMX tiles exist) refuses float32 weights
    base = {"model": str(vllm_mla_model), "transport": "tcp", "block_size": BLOCK_SIZE, "attention_backend": "CPU_MLA"}
    producer = h.Engine(
        "mla-producer",
        dict(base, tp=1, kv_role="kv_both", kv_port=h.free_port(), **test_connector),
        env,
        vllm_logs / "mla-producer.log",
    )
    consumer = h.Engine(
        "mla-consumer",
        dict(base, tp=2, kv_role="kv_consumer", kv_port=h.free_port(), **test_connector),
        env,
        vllm_logs / "mla-consumer.log",
    )
    try:
        producer.start()
        consumer.start()
        producer.wait_ready()
        consumer.wait_ready()
        yield producer, consumer, dumps
    finally:
        producer.stop()
        consumer.stop()


def _transfer(producer: h.Engine, consumer: h.Engine, ids: list[int]) -> dict:
    logs = f"--- producer:\n{producer.log_tail()}\n--- consumer:\n{consumer.log_tail()}"
    out = producer.generate([ids], 1, [{"do_remote_decode": True}])
    assert "outputs" in out, f"prefill failed: {out}\n{logs}"
    params = out["outputs"][0]["kv_transfer_params"]
    assert params and params["remote_num_tokens"] == len(ids), params
    got = consumer.generate([ids], N, [params])
    assert "outputs" in got, f"decode failed: {got}\n{logs}"
    return got["outputs"][0]


def test_each_consumer_rank_holds_exactly_the_latent_bytes_the_producer_sent(mla_pair):
    producer, consumer, dumps = mla_pair
    sent: list[bytes] = []
    for n, (tokens, seed) in enumerate(((40, 21), (40, 22))):  # 3 blocks of 16, the last partial
        got = _transfer(producer, consumer, prompt(tokens, seed))
        assert got["finish_reason"] == "length" and len(got["token_ids"]) == N, got
        want = (dumps / f"producer-rank0-{n}.bin").read_bytes()
        # 3 blocks x 16 rows x 576 float32 x 2 layers
        assert len(want) == 3 * BLOCK_SIZE * 576 * 4 * 2, len(want)
        assert want.count(0) < len(want), "the producer's latent blocks are all zeros"
        for rank in (0, 1):
            have = (dumps / f"consumer-rank{rank}-{n}.bin").read_bytes()
            assert have == want, (
                f"prompt {n}: consumer rank {rank} holds {len(have)} bytes that differ from the producer's "
                f"{len(want)} (first difference at byte "
                f"{next((i for i, (a, b) in enumerate(zip(have, want)) if a != b), min(len(have), len(want)))})"
            )
        sent.append(want)
    assert sent[0] != sent[1], "two different prompts gave the same latent bytes: the comparison proves nothing"
