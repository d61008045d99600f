"""A closing prefill rank takes its registration back from the bootstrap (``PrefillLeave``,
protocol 9): a bootstrap that outlives the rank (SGLang's runtime role switch turns a prefill
into a decode while its bootstrap keeps serving) stops naming it, so a decode looking up that
bootstrap is told no rank is registered instead of being sent to a closed one. A rank only
takes back its own registration: a restart's newer one, or one of another session, stays."""

from __future__ import annotations

import time

from sglang_kvxfer.engine import bootstrap
from sglang_kvxfer.engine.bootstrap import BootstrapServer
from sglang_kvxfer.engine.prefill import LEAVE_TIMEOUT_S
from sglang_kvxfer.protocol.messages import BootstrapQuery, PrefillLeave, PrefillRegister
from tests.engine.harness import Cluster, geometry, wait_terminal
from tests.ports import free_port

GEO = geometry()


def _register(addr: str, tp: int, session: str, tp_size: int = 2):
    msg = PrefillRegister(
        engine_version="t",
        session=session,
        tp_size=tp_size,
        tp_rank=tp,
        endpoint=f"tcp://127.0.0.1:{4000 + tp}",
        geometry=GEO,
        transport="local",
    )
    return bootstrap.request(addr, msg, timeout_s=5.0, key=b"")


def _leave(addr: str, tp: int, session: str):
    return bootstrap.request(addr, PrefillLeave(session=session, tp_rank=tp), timeout_s=5.0, key=b"")


def _query(addr: str, key: bytes | None = b""):
    return bootstrap.request(addr, BootstrapQuery(session="d", tp_rank=0), timeout_s=5.0, key=key)


def test_a_rank_takes_back_its_own_registration_only():
    with BootstrapServer("127.0.0.1", 0, key="off") as srv:
        addr = srv.address
        _register(addr, 0, "first")
        _register(addr, 1, "p1")
        _register(addr, 0, "restarted")  # a restart of rank 0 replaces its entry
        assert srv.registered() == {0: "restarted", 1: "p1"}
        reply = _leave(addr, 0, "first")  # the old process leaving late: the restart stays
        assert reply.ready and srv.registered() == {0: "restarted", 1: "p1"}
        reply = _leave(addr, 1, "someone-else")  # another session cannot remove rank 1
        assert reply.ready and srv.registered() == {0: "restarted", 1: "p1"}
        reply = _leave(addr, 1, "p1")
        assert not reply.ready and srv.registered() == {0: "restarted"}
        assert reply.reason == "1 of 2 prefill rank(s) registered"
        _leave(addr, 0, "restarted")
        assert srv.registered() == {}
        assert _query(addr).reason == "0 of ? prefill rank(s) registered"
        _register(addr, 0, "again")  # and the rank may register again
        assert srv.registered() == {0: "again"}


def test_closed_prefill_ranks_leave_and_a_decode_of_that_bootstrap_is_told_so():
    with BootstrapServer() as boot:
        c = Cluster(2, 1, GEO, bootstrap=boot)
        try:
            assert set(boot.registered()) == {0, 1}
            txs, rxs, dst = c.start(room=1, tokens=10)
            assert wait_terminal(txs + rxs) == [4, 4, 4]  # KVPoll.Success
            c.verify(1, dst, 10)
            for m in c.pre:
                m.close()
            assert boot.registered() == {}
            # A decode that looks this bootstrap up now is told why it waits: no rank.
            reply = _query(boot.address, key=None)  # the engine's key (from the environment)
            assert not reply.ready and reply.reason == "0 of ? prefill rank(s) registered"
        finally:
            c.close()


def test_a_rank_whose_bootstrap_ended_first_closes_within_the_leave_bound():
    boot = BootstrapServer("127.0.0.1", free_port())
    c = Cluster(1, 0, GEO, bootstrap=boot)
    try:
        boot.close()  # as at a server's shutdown, where the bootstrap may end first
        t0 = time.monotonic()
        c.pre[0].close()
        took = time.monotonic() - t0
        # it does not wait on the gone bootstrap past the leave's bound (LEAVE_TIMEOUT_S)
        assert took < 10 * (LEAVE_TIMEOUT_S + 1), took
    finally:
        c.close()
