"""SGLang 0.5.23's own servers with attention DP on the prefill, through kvxfer (CPU).

A tiny Qwen3 (MHA, 4 KV heads) and a tiny DeepSeek-V3 (MLA) each run a prefill server with
``--tp 2 --dp-size 2 --enable-dp-attention`` (two DP groups of attention TP 1 behind one
bootstrap) and a decode server of TP 1. Rooms of both parities go through, so both prefill
DP groups serve requests (SGLang's prefill dispatches by ``bootstrap_room % 2``, and the
decode looks for the KV in that group); the decode server's greedy tokens must equal those of
a non-disaggregated server of TP 1. The Qwen3 prefill also serves a decode server with
``--tp 2 --dp-size 2 --enable-dp-attention``. The negative control zeroes what the prefill
writer delivered, on the decode side after the transfer: the tokens must then change.

DP replicas (``--tp 1 --dp-size 2`` without ``--enable-dp-attention``, SGLang's system DP:
two whole TP groups behind one bootstrap) run a Qwen3 prefill too, serving the same TP 1
decode server: rooms of both parities decode the reference tokens, and zeroing what the
replica's writer delivered changes them.

SGLang's CPU path needs three small patches for attention DP and DeepSeek MLA
(``dp_patches/sitecustomize.py``, test tree only); every server here loads them.
"""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest

from tests.realserver import harness as h
from tests.realserver.conftest import PREFILL_CHUNK, Fleet

pytestmark = pytest.mark.timeout(900)

PATCHES = Path(__file__).resolve().parent / "dp_patches"
DP_FLAGS = ["--tp", "2", "--dp-size", "2", "--enable-dp-attention"]
REPLICA_FLAGS = ["--tp", "1", "--dp-size", "2"]  # DP replicas: two schedulers of TP 1
MODELS = ("qwen3", "deepseek")
_rooms = random.Random(20261202)


def room(parity: int) -> int:
    """A room that SGLang's follow_bootstrap_room sends to prefill DP group ``parity``."""
    return (_rooms.getrandbits(61) + 1) * 2 + parity


# With attention DP, SGLang binds internal ZMQ ports at fixed offsets from --port: its DP
# controller's handshake at + 13 (DP_ATTENTION_HANDSHAKE_PORT_DELTA) and PortArgs' ports at
# + 233 .. + 239 (ZMQ_TCP_PORT_DELTA). CI once saw a DP decode exit on "Address already in
# use" at its + 13 port. Every port of a fleet keeps those offsets free and reserved too.
DERIVED = (13, *range(233, 241))


def fleet_port() -> int:
    """A free port whose DP-derived ports are free too, clear of every port handed out."""
    return h.free_port(derived=DERIVED)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


def _build(script: str, *args: str) -> Path:
    done = subprocess.run(
        [str(h.venv_python()), str(h.HERE / script), *args], timeout=300, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"building a tiny model failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def dp_models(sglang_env, tmp_path_factory) -> dict:
    return {
        name: _build("tiny_dp_models.py", name, str(tmp_path_factory.mktemp(f"tiny-{name}") / "model"))
        for name in MODELS
    }


@pytest.fixture(scope="module")
def dp_env(server_env, logs) -> dict:
    env = dict(server_env)
    env["PYTHONPATH"] = f"{PATCHES}:{h.STANDINS}"
    env["KVXFER_DP_PATCHES_LOG"] = str(logs / "dp-patches.log")
    env["SGLANG_DISABLED_MODEL_ARCHS"] = ",".join(h.other_model_archs(keep=("llama", "qwen3", "deepseek_v2")))
    return env


class Deployment:
    def __init__(self, name: str, prefill: h.Server, decode: h.Server, reference: h.Server, port: int):
        self.name, self.prefill, self.decode, self.reference, self.port = name, prefill, decode, reference, port
        self.dp_decode: h.Server | None = None  # a decode server with DP attention too (Qwen3)
        self.replicas: tuple[h.Server, int] | None = None  # a prefill of DP replicas, its bootstrap port (Qwen3)
        self._refs: dict = {}

    def run(self, ids: list[int], rid: int, n: int = 16, decode: h.Server | None = None) -> tuple[dict, dict]:
        return h.generate_pd(self.prefill, decode or self.decode, self.port, ids, rid, n)

    def want(self, ids: list[int], n: int = 16) -> list[int]:
        key = (tuple(ids), n)
        if key not in self._refs:
            answer = h.generate_single(self.reference, ids, n)
            out = h.output_ids(answer)
            assert out is not None, f"{self.name} reference failed: {answer}\n{self.reference.log_tail()}"
            self._refs[key] = out
        return self._refs[key]

    def logs(self) -> str:
        return "\n".join(f"--- {s.name}:\n{s.log_tail()}" for s in (self.prefill, self.decode))


@pytest.fixture(scope="module")
def deployments(dp_env, dp_models, logs):
    chunk = ["--chunked-prefill-size", str(PREFILL_CHUNK)]
    out = {}
    for name in MODELS:
        model = dp_models[name]
        port = fleet_port()
        prefill = h.Server(
            f"{name}-prefill-dp2",
            ["--model-path", str(model), *DP_FLAGS, *h.CPU_FLAGS, *h.PREFILL_FLAGS, *chunk]
            + ["--disaggregation-bootstrap-port", str(port)],
            h.tp_env(dp_env, 2),
            logs / f"{name}-prefill-dp2.log",
            port=fleet_port(),
        )
        decode = h.decode_server(f"{name}-decode-tp1", model, 1, dp_env, logs)
        reference = h.reference_server(f"{name}-reference-tp1", model, 1, dp_env, logs)
        reference.args += chunk
        decode.port, reference.port = fleet_port(), fleet_port()
        out[name] = Deployment(name, prefill, decode, reference, port)
    dp_decode = h.Server(
        "qwen3-decode-dp2",
        ["--model-path", str(dp_models["qwen3"]), *DP_FLAGS, *h.CPU_FLAGS, *h.DECODE_FLAGS],
        h.tp_env(dp_env, 2),
        logs / "qwen3-decode-dp2.log",
        port=fleet_port(),
    )
    out["qwen3"].dp_decode = dp_decode
    replica_port = fleet_port()
    replicas = h.Server(
        "qwen3-prefill-replicas2",
        ["--model-path", str(dp_models["qwen3"]), *REPLICA_FLAGS, *h.CPU_FLAGS, *h.PREFILL_FLAGS, *chunk]
        + ["--disaggregation-bootstrap-port", str(replica_port)],
        h.tp_env(dp_env, 2),
        logs / "qwen3-prefill-replicas2.log",
        port=fleet_port(),
    )
    out["qwen3"].replicas = (replicas, replica_port)
    fleet = Fleet()
    try:
        fleet.start(*(s for d in out.values() for s in (d.prefill, d.decode, d.reference)), dp_decode, replicas)
        yield out
    finally:
        fleet.stop()


@pytest.mark.parametrize("name", MODELS)
def test_both_prefill_dp_groups_serve_tokens_equal_to_a_single_server(deployments, name, logs):
    dep = deployments[name]
    for parity, (n, seed) in (
        (0, (12, 1)),
        (1, (12, 2)),
        (1, (2 * PREFILL_CHUNK + 17, 3)),
        (0, (PREFILL_CHUNK + 9, 4)),
    ):
        ids = prompt(n, seed)
        pre, dec = dep.run(ids, room(parity))
        got = h.output_ids(dec)
        assert got is not None, f"{name}: decode answered {dec} (prefill: {pre})\n{dep.logs()}"
        assert got == dep.want(ids), (
            f"{name} prefill DP group {parity} -> decode TP 1, {n}-token prompt: {got} != reference "
            f"{dep.want(ids)}\n{dep.logs()}"
        )
    patched = (logs / "dp-patches.log").read_text()
    assert "patched sglang.srt.layers.attention.torch_native_backend" in patched, patched


@pytest.mark.parametrize("name", MODELS)
def test_negative_control_zeroed_dp_group_writer_changes_the_tokens(deployments, name, logs):
    """Zero what the prefill DP group's only writer (attention TP 1: rank 0 of 1) wrote into
    the decode's pool: the tokens must change, or equality above would prove nothing."""
    dep = deployments[name]
    ids = prompt(PREFILL_CHUNK + 21, 7)
    want = dep.want(ids)
    control = logs / "corrupt-writer"
    record = Path(str(control) + ".log")
    before = record.read_text() if record.exists() else ""
    control.write_text("0/1")
    try:
        pre, dec = dep.run(ids, room(1))
    finally:
        control.unlink()
    got = h.output_ids(dec)
    assert got is not None, f"decode answered {dec}\n{dep.logs()}"
    assert "zeroed heads" in record.read_text()[len(before) :]
    assert got != want, f"{name}: tokens did not change with the writer's KV zeroed: {got}"
    pre, dec = dep.run(ids, room(1))
    assert h.output_ids(dec) == want, f"{name}: {dec}\n{dep.logs()}"


def test_prefill_dp_groups_to_a_decode_with_dp_attention(deployments):
    """Prefill DP 2 -> decode DP 2 (Qwen3): the decode server's own DP controller hands each
    request to one of its groups, which pulls the KV from the prefill group the room names."""
    dep = deployments["qwen3"]
    for parity, (n, seed) in ((0, (PREFILL_CHUNK + 5, 11)), (1, (20, 12))):
        ids = prompt(n, seed)
        pre, dec = dep.run(ids, room(parity), decode=dep.dp_decode)
        got = h.output_ids(dec)
        assert got == dep.want(ids), (
            f"qwen3 prefill DP group {parity} -> decode DP 2, {n}-token prompt: {got} != reference "
            f"{dep.want(ids)}\n{dep.logs()}\n--- {dep.dp_decode.name}:\n{dep.dp_decode.log_tail()}"
        )


def test_dp_replicas_serve_tokens_equal_to_a_single_server_and_a_zeroed_writer_changes_them(deployments, logs):
    """Prefill --tp 1 --dp-size 2 without --enable-dp-attention (two TP 1 replicas behind one
    bootstrap; SGLang's prefill dispatches by bootstrap_room % 2) -> decode TP 1 (Qwen3):
    both replicas serve tokens equal to a single TP 1 server. The negative control zeroes
    what the replica's only writer delivered: the tokens must change, then come back."""
    dep = deployments["qwen3"]
    server, port = dep.replicas
    for parity, (n, seed) in ((0, (PREFILL_CHUNK + 13, 21)), (1, (14, 22)), (1, (2 * PREFILL_CHUNK + 3, 23))):
        ids = prompt(n, seed)
        pre, dec = h.generate_pd(server, dep.decode, port, ids, room(parity))
        got = h.output_ids(dec)
        assert got == dep.want(ids), (
            f"qwen3 DP replica {parity} -> decode TP 1, {n}-token prompt: {got} != reference {dep.want(ids)} "
            f"(prefill: {pre})\n--- {server.name}:\n{server.log_tail()}\n{dep.logs()}"
        )
    ids = prompt(PREFILL_CHUNK + 29, 24)
    control = logs / "corrupt-writer"
    record = Path(str(control) + ".log")
    before = record.read_text() if record.exists() else ""
    control.write_text("0/1")
    try:
        pre, dec = h.generate_pd(server, dep.decode, port, ids, room(1))
    finally:
        control.unlink()
    got = h.output_ids(dec)
    assert got is not None, f"decode answered {dec}\n{dep.logs()}"
    assert "zeroed heads" in record.read_text()[len(before) :]
    assert got != dep.want(ids), f"tokens did not change with the replica writer's KV zeroed: {got}"
    pre, dec = h.generate_pd(server, dep.decode, port, ids, room(1))
    assert h.output_ids(dec) == dep.want(ids), f"{dec}\n{dep.logs()}"
