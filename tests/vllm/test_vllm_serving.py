"""examples/vllm_cpu_pd as its README runs it: two vLLM 0.32 OpenAI servers and ``proxy.py``.

A producer server (TP 2, ``kv_producer``) and a consumer server (TP 1, ``kv_consumer``) with
the README's flags, and the example's proxy between them, each in a session of its own.
One completion through the proxy (prefill on the producer, KV over ``local``, decode on the
consumer) must answer the same 16 greedy tokens and text as a plain request to the producer,
and the consumer's metrics must count its prompt tokens as received (``external_kv_transfer``),
not computed. A second proxy in its concurrent mode (``--bootstrap``: it picks the room and
sends both requests at once) must answer the same.
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
    # Two servers busy on two cores (see test_vllm_pd). CI once saw the consumer's decode
    # rank not run for 33.9 s mid-request ("did not run for"), so the prefill's 60 s wait for
    # the decode's metadata ran out: deadlines with room for such a stall, below the
    # requests' own 120 s.
    env.update(KVXFER_HEARTBEAT_TIMEOUT_S="30", KVXFER_BOOTSTRAP_TIMEOUT_S="100", KVXFER_WAITING_TIMEOUT_S="100")
    api = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(vllm_model), *COMMON, "--host", "127.0.0.1"]
    pport, cport, xport, yport, kv_port = (h.free_port() for _ in range(5))
    producer = h.Service(
        "producer",
        [*api, "--tensor-parallel-size", "2", "--port", str(pport)]
        + ["--kv-transfer-config", connector("kv_producer", kv_port=kv_port)],
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
    concurrent = h.Service(
        "proxy-concurrent",
        [str(PROXY), "--producer", producer.url, "--consumer", consumer.url, "--port", str(yport)]
        + ["--bootstrap", f"127.0.0.1:{kv_port}"],
        env,
        vllm_logs / "serve-proxy-concurrent.log",
        yport,
    )
    services = (producer, consumer, proxy, concurrent)
    try:
        for s in services:
            s.start()
        for s in services:
            s.wait_ready()
        yield services
    finally:
        for s in reversed(services):
            s.stop()


def completion(producer: h.Service, prompt: str) -> dict:
    return {
        "model": producer.cmd[producer.cmd.index("--model") + 1],
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def test_proxy_answer_equals_the_producers_own(servers):
    producer, consumer, proxy, _ = servers
    body = completion(producer, "the quick brown fox jumps over the lazy dog")

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


def test_concurrent_proxy_answer_equals_the_producers_own(servers):
    """The proxy picks the room and posts to the consumer first, then to the producer, and
    waits for both: the consumer registers while the producer computes."""
    producer, _, _, concurrent = servers
    body = completion(producer, "a lazy dog sleeps while the quick brown fox runs")
    status, plain = producer.post("/v1/completions", body)
    assert status == 200, f"plain request: {status} {plain}"
    status, moved = concurrent.post("/v1/completions", body)
    logs = "\n".join(f"--- {s.name}:\n{s.log_tail()}" for s in servers)
    assert status == 200, f"through the concurrent proxy: {status} {moved}\n{logs}"
    want, got = plain["choices"][0], moved["choices"][0]
    assert len(want["token_ids"]) == 16, want
    assert (got["token_ids"], got["text"]) == (want["token_ids"], want["text"]), f"{got} != {want}\n{logs}"


def external_tokens(metrics: str) -> float:
    """The consumer's ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``."""
    found = re.findall(
        r'^vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\} (\S+)$', metrics, re.M
    )
    return sum(float(v) for v in found)
