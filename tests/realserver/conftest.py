"""Fixtures of the real-server tests: the SGLang environment, the tiny model, reference
servers, and a check after every test that no stand-in was used.

Without the SGLang environment (``tests/realserver/make_env.sh``) these tests skip, with
the reason; with ``KVXFER_REALSERVER=required`` (``.ci/run`` sets it) that is a failure.
"""

from __future__ import annotations

import os
import secrets
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.realserver import harness as h


@pytest.fixture(scope="session")
def sglang_env() -> Path:
    problem = h.env_problem()
    if problem is not None:
        if os.environ.get("KVXFER_REALSERVER") == "required":
            pytest.fail(f"KVXFER_REALSERVER=required, but {problem}", pytrace=False)
        pytest.skip(problem)
    return h.venv_dir()


@pytest.fixture(scope="session")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("realserver-logs")


@pytest.fixture(scope="session")
def tiny_model(sglang_env, tmp_path_factory) -> Path:
    return h.build_model(tmp_path_factory.mktemp("tiny-llama") / "model")


# Long enough for a starved rank on two shared cores: CI saw a prefill rank of the DP test
# not run for 4.7 s while other servers started, and its decode peer, at 3 s, failed the
# request; later one not run for 12.2 s (its engine logged "did not run for 12.2 s (stopped or
# starved)") against a bound of 12 s, while another deployment's servers started. A killed
# rank is still noticed within seconds of this bound.
HEARTBEAT_TIMEOUT_S = 30.0


@pytest.fixture(scope="session")
def server_env(sglang_env, logs) -> dict:
    """What every server of this session gets: stand-ins, loopback, one auth key, heartbeats
    (a dead peer is noticed within ``HEARTBEAT_TIMEOUT_S``) and the negative control's file."""
    env = h.base_env(logs / "standins-used.log", secrets.token_hex(32))
    env.update(
        KVXFER_HEARTBEAT_INTERVAL_S="0.5",
        KVXFER_HEARTBEAT_TIMEOUT_S=str(HEARTBEAT_TIMEOUT_S),
        KVXFER_TEST_CORRUPT_FILE=str(logs / "corrupt-writer"),
    )
    return env


@pytest.fixture(autouse=True)
def no_standin_used(request, logs):
    """A stand-in that was called fails the test that was running."""
    if "server_env" not in request.fixturenames:
        yield
        return
    path = logs / "standins-used.log"
    before = path.read_text() if path.exists() else ""
    yield
    after = path.read_text() if path.exists() else ""
    assert after == before, f"a stand-in for a missing SGLang dependency was used:\n{after[len(before) :]}"


class Fleet:
    """Servers started on demand, several at once, all ended at the end of the scope."""

    def __init__(self) -> None:
        self.servers: list[h.Server] = []

    def start(self, *servers: h.Server) -> list[h.Server]:
        for s in servers:
            s.start()
            self.servers.append(s)
        try:
            for s in servers:
                s.wait_ready()
        except BaseException:
            self.stop()
            raise
        return list(servers)

    def stop(self) -> None:
        """End every server at once (each waits out its own grace period)."""
        threads = [threading.Thread(target=s.stop) for s in self.servers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(h.STOP_GRACE_S + 30)
        self.servers.clear()


PREFILL_CHUNK = 64  # --chunked-prefill-size: a prompt over 64 tokens moves in several chunks


@contextmanager
def running_pair(
    name: str, model: Path, env: dict, logs: Path, prefill_tp: int, decode_tp: int, prefill_extra, decode_extra
):
    """A prefill (``name``-prefill, chunked at ``PREFILL_CHUNK``) and a decode server up for the
    ``with`` block: yields ``(prefill, decode, bootstrap port)``, then ends both."""
    port = h.free_port()
    chunk = ["--chunked-prefill-size", str(PREFILL_CHUNK)]
    prefill = h.prefill_server(f"{name}-prefill", model, prefill_tp, env, logs, port, [*prefill_extra, *chunk])
    decode = h.decode_server(f"{name}-decode", model, decode_tp, env, logs, list(decode_extra))
    fleet = Fleet()
    try:
        fleet.start(prefill, decode)
        yield prefill, decode, port
    finally:
        fleet.stop()


# The reference servers of ``references`` while that fixture is up, by TP size: a module that
# needs one reference only reuses it instead of starting its own (``reference_server_tp1``).
RUNNING_REFERENCES: dict[int, h.Server] = {}


@pytest.fixture(scope="package")
def references(server_env, tiny_model, logs):
    """Non-disaggregated servers of TP 1 and TP 2 (greedy tokens depend on TP: bf16). Up
    until the last test of tests/realserver: they would otherwise hold memory and CPU through
    the tests after it (the vLLM engines' among them) until the session ends."""
    fleet = Fleet()
    chunk = ["--chunked-prefill-size", str(PREFILL_CHUNK)]
    ref = {tp: h.reference_server(f"reference-tp{tp}", tiny_model, tp, server_env, logs) for tp in (1, 2)}
    for s in ref.values():
        s.args += chunk
    try:
        fleet.start(*ref.values())
        RUNNING_REFERENCES.update(ref)
        yield ref
    finally:
        RUNNING_REFERENCES.clear()
        fleet.stop()


@pytest.fixture
def reference_tokens(references):
    cache: dict = {}

    def tokens(tp: int, ids: list[int], n: int = 16) -> list[int]:
        key = (tp, tuple(ids), n)
        if key not in cache:
            answer = h.generate_single(references[tp], ids, n)
            out = h.output_ids(answer)
            assert out is not None, f"reference TP {tp} failed: {answer}\n{references[tp].log_tail()}"
            cache[key] = out
        return cache[key]

    return tokens
