"""SGLang 0.5.23's runtime prefill <-> decode role switch through kvxfer (CPU, tiny Llama).

Two servers of TP 1, both with ``--enable-pd-role-switch`` (SGLang then runs a bootstrap on
each, at its own ``--disaggregation-bootstrap-port``): A starts as the prefill, B as the
decode. A request through A -> B decodes the tokens of a single TP 1 server; then
``POST /pd_role_switch`` turns A into a decode and B into a prefill (SGLang's scheduler calls
the manager's ``teardown()`` and builds a manager of the other role over the same KV pool),
and a request through B -> A decodes the same tokens. Zeroing what the writer delivered on
the decode changes them (the negative control). Switching back serves A -> B again, and the
bootstrap A ran as a prefill no longer names its old prefill rank while A is a decode.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.realserver import harness as h
from tests.realserver.conftest import Fleet

pytestmark = pytest.mark.timeout(900)

_rooms = random.Random(20261205)
# What both servers run with, whatever their role: a switched server keeps its flags.
COMMON = ["--disable-overlap-schedule", "--disaggregation-decode-retraction-backup", "none", "--enable-pd-role-switch"]


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


class Flip:
    """Two servers that trade roles; ``prefill``/``decode`` name the current ones."""

    def __init__(self, a: h.Server, b: h.Server, ports: dict[str, int]):
        self.a, self.b, self.ports = a, b, ports
        self.prefill, self.decode = a, b

    def tokens(self, ids: list[int]) -> tuple[list[int] | None, dict]:
        port = self.ports[self.prefill.name]
        pre, dec = h.generate_pd(self.prefill, self.decode, port, ids, _rooms.getrandbits(62) + 1)
        return h.output_ids(dec), {"decode": dec, "prefill": pre}

    def switch(self) -> list[dict]:
        """Both servers trade roles (the prefill first); each answer must say it switched."""
        answers = []
        for server, role in ((self.prefill, "decode"), (self.decode, "prefill")):
            # CPU: no decode CUDA graphs to make room for (SGLang asks for the footprint)
            answer = server.post("/pd_role_switch", {"new_role": role, "decode_cuda_graph_memory_gb": 0.0})
            assert answer.get("success") is True and answer.get("new_role") == role, (
                f"{server.name} -> {role}: {answer}\n{server.log_tail()}"
            )
            answers.append(answer)
        self.prefill, self.decode = self.decode, self.prefill
        return answers

    def logs(self) -> str:
        return f"--- {self.a.name}:\n{self.a.log_tail()}\n--- {self.b.name}:\n{self.b.log_tail()}"


@pytest.fixture(scope="module", params=["local", "tcp"])
def flip(request, server_env, tiny_model, logs: Path):
    env = dict(server_env, KVXFER_SGLANG_TRANSPORT=request.param)
    ports = {f"switch-a-{request.param}": h.free_port(), f"switch-b-{request.param}": h.free_port()}
    (na, pa), (nb, pb) = ports.items()
    a = h.prefill_server(na, tiny_model, 1, env, logs, pa, COMMON)
    b = h.decode_server(nb, tiny_model, 1, env, logs, [*COMMON, "--disaggregation-bootstrap-port", str(pb)])
    fleet = Fleet()
    try:
        fleet.start(a, b)
        yield Flip(a, b, ports)
    finally:
        fleet.stop()


def query_bootstrap(port: int, server_env: dict):
    """The kvxfer bootstrap at ``port``'s answer about DP group 0's prefill ranks."""
    from sglang_kvxfer import auth
    from sglang_kvxfer.engine import bootstrap
    from sglang_kvxfer.protocol.messages import BootstrapQuery

    key = auth.key_from_secret(server_env["KVXFER_AUTH_KEY"])
    return bootstrap.request(f"127.0.0.1:{port}", BootstrapQuery(session="test", tp_rank=0), 10.0, key=key)


def test_servers_that_trade_roles_decode_the_reference_tokens_both_ways(flip, reference_tokens, server_env):
    ids = prompt(40, 1)
    want = reference_tokens(1, ids)
    got, answers = flip.tokens(ids)
    assert got == want, f"{flip.prefill.name} -> {flip.decode.name}: {answers}\n{flip.logs()}"

    old = flip.prefill
    switched = flip.switch()
    assert [(x["old_role"], x["new_role"]) for x in switched] == [("prefill", "decode"), ("decode", "prefill")]
    got, answers = flip.tokens(ids)
    assert got == want, f"after the switch, {flip.prefill.name} -> {flip.decode.name}: {answers}\n{flip.logs()}"
    for ids2 in (prompt(150, 2), prompt(9, 3)):  # several chunks; a short one
        got, answers = flip.tokens(ids2)
        assert got == reference_tokens(1, ids2), f"{answers}\n{flip.logs()}"

    # The bootstrap A ran as a prefill (it keeps serving) no longer names A's old prefill rank:
    # the rank took its registration back on teardown, so a decode that still looks there is
    # told no rank is registered instead of being sent to a rank that is now a decode.
    reply = query_bootstrap(flip.ports[old.name], server_env)
    assert not reply.ready and reply.reason == "0 of ? prefill rank(s) registered", reply
    assert query_bootstrap(flip.ports[flip.prefill.name], server_env).ready

    flip.switch()  # and back: A prefill, B decode again
    assert flip.prefill is flip.a
    got, answers = flip.tokens(ids)
    assert got == want, f"after switching back: {answers}\n{flip.logs()}"


def test_zeroing_what_the_switched_prefill_wrote_changes_the_tokens(flip, reference_tokens, logs: Path):
    if flip.prefill is flip.a:
        flip.switch()  # B is the prefill: the control runs on the roles after a switch
    ids = prompt(40, 4)
    got, _ = flip.tokens(ids)
    assert got == reference_tokens(1, ids), flip.logs()
    control = logs / "corrupt-writer"
    record = Path(str(control) + ".log")
    before = record.read_text() if record.exists() else ""
    control.write_text("0/1")  # the decode zeroes what prefill rank 0 of 1 wrote, once landed
    try:
        bad, answers = flip.tokens(ids)
    finally:
        control.unlink()
    assert "zeroed heads" in record.read_text()[len(before) :], record.read_text()[len(before) :]
    assert bad is not None, f"{answers}\n{flip.logs()}"
    assert bad != reference_tokens(1, ids), "zeroing the transferred KV did not change the tokens"
