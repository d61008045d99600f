"""SGLang 0.5.23's own servers move real model KV through kvxfer (CPU, tiny Llama).

For each transport (``local``, ``tcp``), one prefill server of TP 1 and one of TP 2 and
one decode server of TP 1 and one of TP 2 run at once; a request goes to a prefill and a
decode server together (as SGLang's router sends it) and the decode server's greedy tokens
must equal those of a non-disaggregated server of the prefill's TP size. Prompts longer
than ``--chunked-prefill-size`` move in several chunks. The negative control zeroes the
heads one prefill writer delivered, on the decode side after the transfer: the tokens must
then differ, so token equality really depends on the transferred KV.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.realserver import harness as h
from tests.realserver.conftest import HEARTBEAT_TIMEOUT_S, PREFILL_CHUNK, Fleet

# A test's deadline covers its fixtures: the first test of a transport starts six servers.
pytestmark = pytest.mark.timeout(900)

PAIRS = [(1, 1), (2, 1), (1, 2)]  # (prefill TP, decode TP)
_rooms = random.Random(20261201)


def room() -> int:
    return _rooms.getrandbits(62) + 1


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


class Cluster:
    def __init__(self, transport: str, prefill: dict, decode: dict, ports: dict, records: Path):
        self.transport, self.prefill, self.decode, self.ports = transport, prefill, decode, ports
        self.records = records  # KVXFER_RECORDS_FILE of every server: one JSON line per request and rank

    def run(self, ptp: int, dtp: int, ids: list[int], n: int = 16) -> tuple[dict, dict]:
        return h.generate_pd(self.prefill[ptp], self.decode[dtp], self.ports[ptp], ids, room(), n)

    def logs(self, ptp: int, dtp: int) -> str:
        p, d = self.prefill[ptp], self.decode[dtp]
        return f"--- {p.name}:\n{p.log_tail()}\n--- {d.name}:\n{d.log_tail()}"


@pytest.fixture(scope="module", params=["local", "tcp"])
def cluster(request, server_env, tiny_model, logs: Path):
    transport = request.param
    records = logs / f"records-{transport}.jsonl"
    env = dict(server_env, KVXFER_SGLANG_TRANSPORT=transport, KVXFER_RECORDS_FILE=str(records))
    chunk = ["--chunked-prefill-size", str(PREFILL_CHUNK)]
    ports = {tp: h.free_port() for tp in (1, 2)}
    prefill = {
        tp: h.prefill_server(f"{transport}-prefill-tp{tp}", tiny_model, tp, env, logs, ports[tp], chunk)
        for tp in (1, 2)
    }
    # The TP 2 decode keeps a radix cache (decode_prefix_len > 0 for a prompt it has seen).
    radix = {1: [], 2: ["--disaggregation-decode-enable-radix-cache"]}
    decode = {tp: h.decode_server(f"{transport}-decode-tp{tp}", tiny_model, tp, env, logs, radix[tp]) for tp in (1, 2)}
    fleet = Fleet()
    try:
        fleet.start(*prefill.values(), *decode.values())
        yield Cluster(transport, prefill, decode, ports, records)
    finally:
        fleet.stop()


def check_equal(cluster: Cluster, ptp: int, dtp: int, ids: list[int], want: list[int]) -> None:
    pre, dec = cluster.run(ptp, dtp, ids)
    got = h.output_ids(dec)
    assert got is not None, f"decode answered {dec} (prefill: {pre})\n{cluster.logs(ptp, dtp)}"
    assert got == want, (
        f"{cluster.transport} prefill TP {ptp} -> decode TP {dtp}, {len(ids)}-token prompt: "
        f"{got} != reference {want}\n{cluster.logs(ptp, dtp)}"
    )


@pytest.mark.parametrize("ptp,dtp", PAIRS, ids=[f"p{p}-d{d}" for p, d in PAIRS])
def test_decoded_tokens_equal_a_single_server_of_the_prefill_tp(cluster, reference_tokens, ptp, dtp):
    for n, seed in ((12, 1), (3 * PREFILL_CHUNK + 17, 2)):  # one chunk; four chunks
        ids = prompt(n, seed)
        check_equal(cluster, ptp, dtp, ids, reference_tokens(ptp, ids))


def test_concurrent_requests_of_different_lengths(cluster, reference_tokens):
    lengths = [9, PREFILL_CHUNK + 5, 2 * PREFILL_CHUNK + 30, 3 * PREFILL_CHUNK + 50]
    prompts = [prompt(n, 100 + n) for n in lengths]
    wants = [reference_tokens(2, ids) for ids in prompts]
    answers: dict = {}

    def one(i: int) -> None:
        answers[i] = cluster.run(2, 1, prompts[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(h.REQUEST_TIMEOUT_S + 30)
    for i, want in enumerate(wants):
        pre, dec = answers.get(i, ({}, {"error": "no answer"}))
        assert h.output_ids(dec) == want, f"request {i} ({lengths[i]} tokens): {dec}\n{cluster.logs(2, 1)}"


def decode_bytes(cluster: Cluster, rid: int) -> int:
    """Bytes the decode ranks received for room ``rid``, from the servers' records."""
    lines = [json.loads(line) for line in cluster.records.read_text().splitlines() if line.strip()]
    mine = [r for r in lines if r.get("room") == rid and r.get("side") == "decode"]
    assert mine and all(r.get("ok") for r in mine), f"records of room {rid}: {mine}"
    return sum(int(r["bytes"]) for r in mine)


def test_decode_radix_cache_receives_only_what_it_does_not_hold(cluster, reference_tokens):
    """The TP 2 decode server keeps a radix cache. A prompt that extends one it has seen hits
    it: the decode tells the prefill the prefix it holds (``decode_prefix_len``) and only the
    rest moves; the same prompt again moves (almost) nothing. Every answer is the reference's
    tokens, and the decode ranks' records show the bytes shrink accordingly."""
    base = prompt(2 * PREFILL_CHUNK + 40, 31)
    longer = base + prompt(50, 32)
    moved = []
    for ids in (base, longer, base):
        want = reference_tokens(1, ids)
        rid = room()
        pre, dec = h.generate_pd(cluster.prefill[1], cluster.decode[2], cluster.ports[1], ids, rid)
        assert h.output_ids(dec) == want, f"{dec} != reference {want}\n{cluster.logs(1, 2)}"
        moved.append(decode_bytes(cluster, rid))
    per_token = moved[0] / len(base)  # nothing cached yet: every token moved
    assert 0 < moved[1] < per_token * len(longer) / 2, f"bytes of base, longer, base again: {moved}"
    assert moved[2] < moved[0], f"bytes of base, longer, base again: {moved}"


def test_negative_control_zeroed_writer_changes_the_tokens(cluster, reference_tokens, logs: Path):
    """Zero what prefill rank 0 of 2 wrote into the decode's pool: the tokens must change
    (and come back once the hook is off), or equality above would prove nothing."""
    ids = prompt(2 * PREFILL_CHUNK + 3, 7)
    want = reference_tokens(2, ids)
    control = logs / "corrupt-writer"
    record = Path(str(control) + ".log")
    before = record.read_text() if record.exists() else ""
    control.write_text("0/2")
    try:
        pre, dec = cluster.run(2, 1, ids)
    finally:
        control.unlink()
    got = h.output_ids(dec)
    assert got is not None, f"decode answered {dec}\n{cluster.logs(2, 1)}"
    zeroed = record.read_text()[len(before) :]
    assert "zeroed heads 0..1" in zeroed, zeroed
    assert got != want, f"tokens did not change with writer 0's KV zeroed: {got}"
    check_equal(cluster, 2, 1, ids, want)


@pytest.mark.parametrize("cluster", ["local"], indirect=True)
def test_a_killed_prefill_rank_fails_the_request_and_a_restarted_prefill_serves(cluster, tiny_model, logs: Path):
    """SIGKILL prefill TP rank 1 while the decode server waits for a request's KV: the
    decode server answers that request with an error within the heartbeat bound, not a
    hang. A new prefill server on the same bootstrap port then serves the decode server
    again (same tokens as before the kill), and ``kvxfer sglang-serve`` ends it and all its
    processes on a plain SIGTERM."""
    ids = prompt(40, 11)
    pre, dec = cluster.run(2, 1, ids)
    before = h.output_ids(dec)
    assert before is not None, f"{dec}\n{cluster.logs(2, 1)}"
    prefill, decode, port = cluster.prefill[2], cluster.decode[1], cluster.ports[2]
    victim = [p for p in prefill.pids() if "sglang::scheduler_TP1" in h.process_title(p)]
    assert len(victim) == 1, [(p, h.process_title(p)) for p in prefill.pids()]
    # the decode server alone gets the request: it registers with the prefill ranks and waits
    body = {
        "input_ids": ids,
        "sampling_params": h.sampling(16),
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": port,
        "bootstrap_room": room(),
    }
    answer: dict = {}
    waiter = threading.Thread(target=lambda: answer.update(decode.generate(body)), daemon=True)
    waiter.start()
    time.sleep(3.0)
    assert waiter.is_alive(), f"the decode answered before the fault: {answer}"
    os.kill(victim[0], signal.SIGKILL)
    t_kill = time.monotonic()
    waiter.join(HEARTBEAT_TIMEOUT_S + 30)
    waited = time.monotonic() - t_kill
    assert not waiter.is_alive(), (
        f"the decode server did not answer within {HEARTBEAT_TIMEOUT_S + 30} s of the prefill rank's death"
    )
    reason = json.dumps(h.finish_reason(answer)) + json.dumps(answer)[:2000]
    assert h.finish_reason(answer).get("type") == "abort" or "http_error" in answer, answer
    assert "kvxfer" in reason or "prefill" in reason, reason
    assert waited < HEARTBEAT_TIMEOUT_S + 15, (
        f"the failure took {waited:.1f} s (heartbeat timeout {HEARTBEAT_TIMEOUT_S} s)"
    )
    # SGLang ends a server whose scheduler died; replace it on the same bootstrap port
    prefill.stop()
    again = h.Server(
        prefill.name + "-restarted", prefill.args, dict(prefill.env), logs / f"{prefill.name}-restarted.log"
    )
    again.start()
    try:
        again.wait_ready()
        cluster.prefill[2] = again
        served, deadline, last = None, time.monotonic() + 60, None
        while served is None and time.monotonic() < deadline:
            pre, dec = cluster.run(2, 1, ids)
            last = dec
            served = h.output_ids(dec)
        assert served == before, f"after the restart: {last}\n{cluster.logs(2, 1)}"
        # a plain SIGTERM to kvxfer sglang-serve ends SGLang's server and all its processes
        pids = again.pids()
        assert len(pids) >= 3, [(p, h.process_title(p)) for p in pids]
        os.kill(again.proc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        while again.pids() and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        left = [(p, h.process_title(p)) for p in again.pids()]
        assert not left, f"processes left 30 s after SIGTERM: {left}"
        assert again.proc.wait(5) is not None
    finally:
        again.stop()


def _retracted_mid_generation(cluster: Cluster, ids: list[int], n: int, rid: int, control: Path | None = None):
    """One request through the TP 1 pair whose decode is paused with ``mode="retract"`` while
    it generates, then resumed: SGLang's decode then asks the prefill (our
    ``submit_prefill_recompute``: ``POST /generate`` at the port the prefill registered) to
    compute the prompt and the tokens so far again and receives that KV through kvxfer.
    With ``control``, the negative control's spec is written there while paused: what the
    recomputed transfer landed is zeroed. Returns the decode's answer."""
    prefill, decode = cluster.prefill[1], cluster.decode[1]
    body = {
        "input_ids": ids,
        "sampling_params": h.sampling(n),
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": cluster.ports[1],
        "bootstrap_room": rid,
    }
    out: dict = {}
    threads = {
        k: threading.Thread(target=lambda s=s, k=k: out.__setitem__(k, s.generate(body)), daemon=True)
        for k, s in (("prefill", prefill), ("decode", decode))
    }
    for t in threads.values():
        t.start()
    threads["prefill"].join(h.REQUEST_TIMEOUT_S)  # the prefill answers once its KV was sent
    time.sleep(0.3)  # the decode generates
    paused = decode.post("/pause_generation", {"mode": "retract"})
    try:
        if control is not None:
            control.write_text("0/1")
        time.sleep(0.5)
    finally:
        resumed = decode.post("/continue_generation", {})
    threads["decode"].join(h.REQUEST_TIMEOUT_S + 10)
    if control is not None:
        control.unlink()
    assert "http_error" not in paused and "http_error" not in resumed, (paused, resumed)
    return out.get("decode", {"error": "no answer"})


def test_a_decode_retracted_mid_generation_is_recomputed_by_the_prefill(cluster, reference_tokens, logs):
    """SGLang 0.5.23's PD retraction with prefill recompute ("rebootstrap", around RL weight
    updates): the retracted request ends with the reference's tokens, SGLang counts the
    retraction, and the decode's records show the room's KV landed twice (the original
    transfer and the recomputed one). Zeroing what the recomputed transfer landed changes the
    tokens after the retraction (the negative control), so they depend on that KV."""
    ids, n = prompt(40, 61), 400
    want = reference_tokens(1, ids, n)
    rid = room()
    answer = _retracted_mid_generation(cluster, ids, n, rid)
    meta = answer.get("meta_info") or {}
    assert h.output_ids(answer) == want, f"{answer}\n{cluster.logs(1, 1)}"
    assert meta.get("num_retractions", 0) >= 1, f"the request was not retracted: {meta}"
    lines = [json.loads(line) for line in cluster.records.read_text().splitlines() if line.strip()]
    landed = [r for r in lines if r.get("room") == rid and r.get("side") == "decode" and r.get("ok")]
    assert len(landed) >= 2, f"decode records of room {rid}: {landed}"
    control = logs / "corrupt-writer"
    record = Path(str(control) + ".log")
    before = record.read_text() if record.exists() else ""
    rid = room()
    zeroed = _retracted_mid_generation(cluster, ids, n, rid, control=control)
    logged = record.read_text()[len(before) :] if record.exists() else ""
    assert f"room {rid}: decode rank 0: zeroed heads" in logged, logged
    assert (zeroed.get("meta_info") or {}).get("num_retractions", 0) >= 1, zeroed
    assert h.output_ids(zeroed) != want, "zeroing the recomputed KV did not change the tokens"
