"""vLLM 0.32's own offline engines move real model KV through the kvxfer connector (CPU).

Per configuration, one producer engine (``kv_both``: requests without transfer params run
normally on it, so it is also the reference of its TP size) and one consumer engine run at
once: the tiny Llama TP 2 -> TP 1 over ``local``, then TP 1 -> TP 2 over ``tcp`` (MLA is in
test_vllm_mla.py, by bytes: vLLM's CPU MLA gives no token reference, docs/vllm.md). A
request runs on the producer with ``max_tokens=1`` and ``do_remote_decode``; its
``kv_transfer_params`` go to the consumer, whose 16 greedy tokens must equal the producer's
own 16 (float32: TP 1 and TP 2 agree with themselves, not necessarily with each other).
Every send is layer-wise: each producer rank's record (``SendReport``, written by the test
connector) must show one hand-over per model layer, all from ``save_kv_layer``. The
negative control zeroes what one producer rank delivered, on the consumer after the
transfer: the tokens must then differ, and equal again with the hook off. A client-chosen
room lets the consumer register before the producer computes (both requests at once). Bad
rooms fail naming the value. Last, the producer is killed: a consumer request that needs its
KV ends with an error within the heartbeat bound, not a hang.
"""

from __future__ import annotations

import json
import random
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.realserver.harness import machine_snapshot
from tests.vllm import harness as h

# A module's deadline covers its fixture: two engines start (1-2 minutes on 2 cores).
pytestmark = pytest.mark.timeout(900)


@dataclass(frozen=True)
class Config:
    ptp: int  # producer TP
    dtp: int  # consumer TP
    transport: str
    block_size: int = 32  # CPU attention: a multiple of 32
    prompts: tuple[tuple[int, int], ...] = ((12, 1), (75, 2), (200, 3))  # (tokens, seed): 1 partial block; 3; 7 of 32

    @property
    def name(self) -> str:
        return f"p{self.ptp}-d{self.dtp}-{self.transport}"


CONFIGS = [Config(2, 1, "local"), Config(1, 2, "tcp")]


HEARTBEAT_TIMEOUT_S = 30.0  # generous: vLLM engines waiting on a transfer busy-poll both cores;
# with 10 s a peer was declared dead once under that load (its heartbeats arrived late)
N = 16
BOOTSTRAP_TIMEOUT_S = 150.0
DECODE_TIMEOUT_S = BOOTSTRAP_TIMEOUT_S + 50  # a decode answers after its room's deadline at worst


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


RECORD_WAIT_S = 60.0  # a producer rank reports a send at its next step after the transfer


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class Pair:
    def __init__(
        self,
        config: Config,
        producer: h.Engine,
        consumer: h.Engine,
        control: Path,
        records: tuple[Path, Path],
        num_layers: int,
        bootstrap: str,
    ):
        self.config = config
        self.ptp, self.dtp, self.transport = config.ptp, config.dtp, config.transport
        self.producer, self.consumer, self.control = producer, consumer, control
        self.producer_records, self.consumer_records = records
        self.num_layers, self.bootstrap = num_layers, bootstrap
        self._refs: dict = {}

    def wait_records(self, path: Path, pick, count: int, what: str) -> list[dict]:
        deadline = time.monotonic() + RECORD_WAIT_S
        while True:
            found = [r for r in read_records(path) if pick(r)]
            if len(found) >= count:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: {len(found)} of {count} records after {RECORD_WAIT_S} s\n{self.logs()}")
            time.sleep(0.2)

    def assert_layerwise(self, room: int) -> None:
        """Every producer rank sent room ``room`` layer-wise: one hand-over per model layer,
        each from ``save_kv_layer`` (none left for ``wait_for_save``), and it succeeded."""
        sent = self.wait_records(
            self.producer_records,
            lambda r: r["event"] == "sent" and r["room"] == room,
            self.ptp,
            f"the producer ranks' sends of room {room}",
        )
        assert sorted(r["tp_rank"] for r in sent) == list(range(self.ptp)), sent
        for r in sent:
            assert r["ok"] and r["layerwise"] and r["bytes"] > 0, r
            assert (r["layer_groups"], r["layers_streamed"], r["layers_late"]) == (
                self.num_layers,
                self.num_layers,
                0,
            ), r

    def logs(self) -> str:
        return (
            f"--- producer:\n{self.producer.log_tail()}\n--- consumer:\n{self.consumer.log_tail()}\n"
            f"--- machine:\n{machine_snapshot()}"
        )

    def reference(self, ids: list[int]) -> list[int]:
        key = tuple(ids)
        if key not in self._refs:
            out = self.producer.generate([ids], N)
            assert "outputs" in out, f"reference failed: {out}\n{self.logs()}"
            self._refs[key] = out["outputs"][0]["token_ids"]
        return self._refs[key]

    def prefill(self, ids: list[int], **extra) -> dict:
        out = self.producer.generate([ids], 1, [{"do_remote_decode": True, **extra}])
        assert "outputs" in out, f"prefill failed: {out}\n{self.logs()}"
        params = out["outputs"][0]["kv_transfer_params"]
        assert params and params.get("engine") == "sglang_kvxfer" and params.get("do_remote_prefill"), params
        assert params["tp_size"] == self.ptp and params["remote_num_tokens"] == len(ids), params
        return params

    def decode(self, ids: list[int], params: dict, timeout_s: float = DECODE_TIMEOUT_S) -> dict:
        out = self.consumer.generate([ids], N, [params], timeout_s=timeout_s)
        assert "outputs" in out, f"decode failed: {out}\n{self.logs()}"
        return out["outputs"][0]


@pytest.fixture(scope="module", params=CONFIGS, ids=[c.name for c in CONFIGS])
def pair(request, vllm_env, vllm_model, vllm_logs):
    cfg: Config = request.param
    ptp, dtp, transport, name = cfg.ptp, cfg.dtp, cfg.transport, cfg.name
    env = h.base_env(secrets.token_hex(32))
    control = vllm_logs / f"corrupt-{name}"
    env.update(
        KVXFER_HEARTBEAT_INTERVAL_S="1",
        KVXFER_HEARTBEAT_TIMEOUT_S=str(HEARTBEAT_TIMEOUT_S),
        # CI saw engine threads not run for 30-34 s on two cores, and once a decode rank's for
        # 62 s (its request then outlived a 90 s bootstrap deadline)
        KVXFER_BOOTSTRAP_TIMEOUT_S=str(BOOTSTRAP_TIMEOUT_S),
        KVXFER_TEST_CORRUPT_FILE=str(control),
        # CI saw a decode rank's I/O thread not run for 62 s once (its cause is open): each
        # worker reports a stall of 5 s while it lasts, with every thread's state and frames.
        KVXFER_TEST_WATCHDOG_S="5",
    )
    records = (vllm_logs / f"{name}-producer-records.jsonl", vllm_logs / f"{name}-consumer-records.jsonl")
    test_connector = dict(connector="KVXferTestConnector", connector_module="tests.vllm.corrupt_connector")
    base = {"model": str(vllm_model), "transport": transport, "block_size": cfg.block_size, **test_connector}
    kv_port = h.free_port()
    producer = h.Engine(
        f"{name}-producer",
        dict(base, tp=ptp, kv_role="kv_both", kv_port=kv_port),
        dict(env, KVXFER_TEST_RECORD_FILE=str(records[0])),
        vllm_logs / f"{name}-producer.log",
    )
    consumer = h.Engine(
        f"{name}-consumer",
        dict(base, tp=dtp, kv_role="kv_consumer", kv_port=h.free_port()),
        dict(env, KVXFER_TEST_RECORD_FILE=str(records[1])),
        vllm_logs / f"{name}-consumer.log",
    )
    num_layers = json.loads((Path(vllm_model) / "config.json").read_text())["num_hidden_layers"]
    try:
        producer.start()
        consumer.start()
        producer.wait_ready()
        consumer.wait_ready()
        yield Pair(cfg, producer, consumer, control, records, num_layers, f"127.0.0.1:{kv_port}")
    finally:
        producer.stop()
        consumer.stop()


def test_decoded_tokens_equal_the_reference_of_the_prefill_tp(pair):
    for n, seed in pair.config.prompts:
        ids = prompt(n, seed)
        want = pair.reference(ids)
        params = pair.prefill(ids)
        got = pair.decode(ids, params)
        assert got["token_ids"] == want, (
            f"{pair.config.name}: producer TP {pair.ptp} -> consumer TP {pair.dtp}, {n}-token prompt: "
            f"{got} != reference {want}\n{pair.logs()}"
        )
        pair.assert_layerwise(params["room"])


def test_negative_control_zeroed_writer_changes_the_tokens(pair):
    """Zero what producer rank 0 wrote into the consumer's blocks: the tokens must change
    (and come back once the hook is off), or the equality above would prove nothing."""
    ids = prompt(90, 7)
    want = pair.reference(ids)
    record = Path(str(pair.control) + ".log")
    before = record.read_text() if record.exists() else ""
    params = pair.prefill(ids)
    pair.control.write_text(f"0/{pair.ptp}")
    try:
        got = pair.decode(ids, params)
    finally:
        pair.control.unlink()
    assert got["finish_reason"] != "error", f"the transfer failed: {got}\n{pair.logs()}"
    pair.assert_layerwise(params["room"])  # the zeroed KV came the layer-wise way
    zeroed = record.read_text()[len(before) :] if record.exists() else ""
    assert "zeroed local heads" in zeroed, f"the hook zeroed nothing ({zeroed!r}); {got}\n{pair.logs()}"
    assert got["token_ids"] != want, f"tokens did not change with writer 0's KV zeroed: {got}"
    again = pair.decode(ids, pair.prefill(ids))
    assert again["token_ids"] == want, f"with the hook off: {again} != {want}\n{pair.logs()}"


def test_a_client_room_lets_the_consumer_register_before_the_producer_computes(pair):
    """The router's order (both requests at once, the room chosen by the client): the
    consumer's request with the room and the producer's bootstrap address starts first; the
    producer's request is sent once the consumer's receive has started (its metadata is on
    its way). The tokens equal the reference, and the sends were layer-wise."""
    ids = prompt(150, 21)
    want = pair.reference(ids)
    room = secrets.randbits(63)
    consumer_params = {"do_remote_prefill": True, "room": room, "bootstrap_addr": pair.bootstrap}
    answer: dict = {}
    thread = threading.Thread(target=lambda: answer.update(pair.decode(ids, consumer_params)), daemon=True)
    thread.start()
    pair.wait_records(
        pair.consumer_records,
        lambda r: r["event"] == "recv_started" and r["room"] == room,
        pair.dtp,
        f"the consumer's receives of room {room}",
    )
    params = pair.prefill(ids, room=room)
    assert params["room"] == room, params
    thread.join(DECODE_TIMEOUT_S + 10)
    assert not thread.is_alive(), f"the consumer did not answer\n{pair.logs()}"
    assert answer.get("token_ids") == want, f"{answer} != reference {want}\n{pair.logs()}"
    pair.assert_layerwise(room)


def test_bad_rooms_fail_naming_the_field_and_the_value(pair):
    """A client-given room must be an int in [0, 2**63): the producer moves nothing and says
    why in its kv_transfer_params (vLLM lets no connector fail a producer request); the
    consumer fails the request (finish_reason "error") with the message in its log."""
    ids = prompt(30, 23)
    out = pair.producer.generate([ids], 1, [{"do_remote_decode": True, "room": -1}])
    params = out["outputs"][0]["kv_transfer_params"]
    assert params["do_remote_prefill"] is False, params
    assert params["error"] == "kv_transfer_params room=-1 (int) must be an int with 0 <= room < 2**63", params
    got = pair.decode(ids, {"do_remote_prefill": True, "room": "abc", "bootstrap_addr": pair.bootstrap})
    assert got["finish_reason"] == "error" and got["token_ids"] == [], got
    log = pair.consumer.log_tail(400)
    assert "kv_transfer_params room='abc' (str) must be an int with 0 <= room < 2**63" in log, log


def test_a_block_size_mismatch_fails_the_request_naming_both_values(pair):
    """Only whole blocks of equal size are interchangeable (vLLM's CPU kernel orders the rows
    inside a block its own way): a consumer with another block size must refuse the KV, not
    decode from rows the engine would re-page."""
    ids = prompt(40, 9)
    params = pair.prefill(ids)
    own = params["block_size"]
    got = pair.decode(ids, dict(params, block_size=own * 2))
    assert got["finish_reason"] == "error" and got["token_ids"] == [], got
    log = pair.consumer.log_tail(400)
    want = f"block_size={own * 2} (producer) differs from this consumer's block_size={own}"
    assert want in log, log


def test_a_killed_producer_fails_the_consumer_request_in_bounded_time(pair):
    """SIGKILL every process of the producer after its prefill: the consumer's request for
    that KV ends with finish_reason 'error' (kv_load_failure_policy='fail') within the
    heartbeat bound, and the consumer still serves requests that need no transfer."""
    ids = prompt(60, 11)
    params = pair.prefill(ids)
    killed = pair.producer.kill()
    assert killed, "the producer had no processes"
    t0 = time.monotonic()
    got = pair.decode(ids, params, timeout_s=HEARTBEAT_TIMEOUT_S + 50)
    waited = time.monotonic() - t0
    assert got["finish_reason"] == "error" and got["token_ids"] == [], got
    assert waited < HEARTBEAT_TIMEOUT_S + 20, (
        f"the failure took {waited:.1f} s (heartbeat timeout {HEARTBEAT_TIMEOUT_S} s)"
    )
    log = pair.consumer.log_tail(400)
    assert "kvxfer: receive of request" in log and "failed" in log, log
    plain = pair.consumer.generate([prompt(20, 12)], 4)
    assert "outputs" in plain and len(plain["outputs"][0]["token_ids"]) == 4, plain
