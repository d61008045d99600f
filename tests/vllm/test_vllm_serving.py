"""examples/vllm_cpu_pd as its README runs it: two vLLM 0.32 OpenAI servers and ``proxy.py``.

A producer server (TP 2, ``kv_producer``) and a consumer server (TP 1, ``kv_consumer``) with
the README's flags, and the example's proxy between them, each in a session of its own.
One completion through the proxy (prefill on the producer, KV over ``local``, decode on the
consumer) must answer the same 16 greedy tokens and text as a plain request to the producer,
and the consumer's metrics must count its prompt tokens as received (``external_kv_transfer``),
not computed.
"""

from __future__ import annotations

import json
import re
import secrets
import time

import pytest

from tests.vllm import harness as h

pytestmark = pytest.mark.timeout(600)

PROXY = h.ROOT / "examples" / "vllm_cpu_pd" / "proxy.py"
COMMON = ["--dtype", "float32", "--enforce-eager", "--block-size", "32", "--max-model-len", "1024"]


def connector(role: str, **extra) -> str:
    cfg = {"kv_connector": "KVXferConnector", "kv_connector_module_path": "sglang_kvxfer.integrations.vllm"}
    return json.dumps(dict(cfg, kv_role=role, **extra))


@pytest.fixture(scope="module")
def servers(vllm_env, vllm_model, vllm_logs):
    env = h.base_env(secrets.token_hex(32))
    env.update(KVXFER_HEARTBEAT_TIMEOUT_S="30")  # two servers busy on two cores (see test_vllm_pd)
    api = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(vllm_model), *COMMON, "--host", "127.0.0.1"]
    pport, cport, xport = h.free_port(), h.free_port(), h.free_port()
    producer = h.Service(
        "producer",
        [*api, "--tensor-parallel-size", "2", "--port", str(pport)]
        + ["--kv-transfer-config", connector("kv_producer", kv_port=h.free_port())],
        env,
        vllm_logs / "serve-producer.log",
        pport,
    )
    consumer = h.Service(
        "consumer",
        [*api, "--port", str(cport), "--no-enable-prefix-caching"] + ["--kv-transfer-config", connector("kv_consumer")],
        env,
        vllm_logs / "serve-consumer.log",
        cport,
    )
    proxy = h.Service(
        "proxy",
        [str(PROXY), "--producer", producer.url, "--consumer", consumer.url, "--port", str(xport)],
        env,
        vllm_logs / "serve-proxy.log",
        xport,
    )
    try:
        for s in (producer, consumer, proxy):
            s.start()
        for s in (producer, consumer, proxy):
            s.wait_ready()
        yield producer, consumer, proxy
    finally:
        for s in (proxy, consumer, producer):
            s.stop()


def test_proxy_answer_equals_the_producers_own(servers):
    producer, consumer, proxy = servers
    body = {
        "model": producer.cmd[producer.cmd.index("--model") + 1],
        "prompt": "the quick brown fox jumps over the lazy dog",
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }

    def logs() -> str:
        return "\n".join(f"--- {s.name}:\n{s.log_tail()}" for s in servers)

    status, plain = producer.post("/v1/completions", body)
    assert status == 200, f"plain request: {status} {plain}\n{logs()}"
    status, moved = proxy.post("/v1/completions", body)
    assert status == 200, f"through the proxy: {status} {moved}\n{logs()}"
    want, got = plain["choices"][0], moved["choices"][0]
    assert len(want["token_ids"]) == 16, want
    assert (got["token_ids"], got["text"]) == (want["token_ids"], want["text"]), f"{got} != {want}\n{logs()}"
    prompt_len = len(want.get("prompt_token_ids") or ()) or plain["usage"]["prompt_tokens"]
    received = 0.0
    deadline = time.monotonic() + 10  # the metrics are recorded just after the answer
    while received < prompt_len - 1 and time.monotonic() < deadline:
        time.sleep(0.5)
        received = external_tokens(consumer.get("/metrics"))
    # vLLM recomputes the prompt's last token; every other one must have come from the producer.
    assert received >= prompt_len - 1 > 0, f"{received} of {prompt_len} prompt tokens received\n{logs()}"


def external_tokens(metrics: str) -> float:
    """The consumer's ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``."""
    found = re.findall(
        r'^vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\} (\S+)$', metrics, re.M
    )
    return sum(float(v) for v in found)
