"""A decode that allocates only once the prefill's forward finished (SGLang's
``--disaggregation-decode-allocation-policy prefill_complete``; protocol 13): the decode's
receiver watches the room (``RoomWatch``), each candidate prefill rank says when its
forward is done (``PrefillReady``, from ``KVSender.mark_prefill_complete``), and only then
does the decode send its pages. Every test moves real bytes and compares them."""

from __future__ import annotations

import time

import pytest

from sglang_kvxfer.engine import KVPoll, KVReceiver, KVSender
from sglang_kvxfer.engine.synthetic import fill_request
from tests.engine.harness import Cluster, geometry, wait_terminal

GEO = geometry()
COMPLETE = {"prefill_complete": True}


def _until(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.005)
    return False


@pytest.mark.parametrize("p,d", [(1, 1), (2, 1), (1, 2)])
def test_the_decode_allocates_only_after_every_prefill_rank_finished_and_the_bytes_land(p, d):
    with Cluster(p, d, GEO, prefill_opts=COMPLETE) as c:
        room, tokens = 7, 21
        src = c.pages(c.pre[0], tokens)
        txs = [KVSender(m, room) for m in c.pre]  # SGLang: the sender exists, its forward runs
        rxs = [KVReceiver(m, room, watch_prefill=True) for m in c.dec]
        assert _until(lambda: all(rx.poll() is KVPoll.WaitingForInput for rx in rxs))
        for m in c.pre:  # the watch reached every prefill rank (each a candidate of each decode rank here)
            assert _until(lambda m=m: len(m.room(room).watchers) == d)
        assert not any(rx.prefill_ready for rx in rxs)
        assert all(tx.poll() is KVPoll.Bootstrapping for tx in txs)
        # the forward: each rank writes its KV, then says it is done; the decode must wait for all
        for m in c.pre:
            fill_request(m.placement, m.pool.buffers, room, src, 0, tokens)
        txs[0].mark_prefill_complete()
        txs[0].mark_prefill_complete()  # idempotent
        if p > 1:
            time.sleep(0.3)
            assert not any(rx.prefill_ready for rx in rxs)  # rank 1 has not finished yet
            for tx in txs[1:]:
                tx.mark_prefill_complete()
        assert _until(lambda: all(rx.prefill_ready for rx in rxs))
        dst = c.pages(c.dec[0], tokens)  # only now does the decode allocate
        for rx in rxs:
            rx.send_metadata(dst, num_tokens=tokens)
        for tx in txs:
            tx.send(src, last_chunk=True, aux=b"first-token")
        assert wait_terminal(txs + rxs) == [KVPoll.Success] * (p + d)
        assert c.verify(room, dst, tokens) == []
        assert all(rx.aux_payload == b"first-token" for rx in rxs)


def test_a_watch_that_comes_after_the_forward_finished_is_answered_at_once():
    with Cluster(1, 1, GEO, prefill_opts=COMPLETE) as c:
        room, tokens = 9, 8
        src = c.pages(c.pre[0], tokens)
        tx = KVSender(c.pre[0], room)
        fill_request(c.pre[0].placement, c.pre[0].pool.buffers, room, src, 0, tokens)
        tx.mark_prefill_complete()
        rx = KVReceiver(c.dec[0], room, watch_prefill=True)
        assert _until(lambda: rx.prefill_ready)
        dst = c.pages(c.dec[0], tokens)
        rx.send_metadata(dst, num_tokens=tokens)
        tx.send(src, last_chunk=True)
        assert wait_terminal([tx, rx]) == [KVPoll.Success, KVPoll.Success]
        assert c.verify(room, dst, tokens) == []


def test_a_watch_to_a_prefill_of_the_early_policy_fails_both_sides_naming_the_policy():
    with Cluster(1, 1, GEO) as c:  # the prefill does not announce finished forwards
        tx = KVSender(c.pre[0], 3)
        rx = KVReceiver(c.dec[0], 3, watch_prefill=True)
        assert wait_terminal([tx, rx]) == [KVPoll.Failed, KVPoll.Failed]
        for handle in (tx, rx):
            assert "prefill_complete" in handle.failure_reason
            assert "set the same policy on both servers" in handle.failure_reason
        with pytest.raises(ValueError, match="needs EngineConfig.prefill_complete=True"):
            tx.mark_prefill_complete()


def test_the_forward_finishing_restarts_the_prefill_deadline_for_the_decodes_metadata():
    opts = {**COMPLETE, "bootstrap_timeout_s": 2.0}
    with Cluster(1, 1, GEO, prefill_opts=opts) as c:
        tx = KVSender(c.pre[0], 5)
        rx = KVReceiver(c.dec[0], 5, watch_prefill=True)
        time.sleep(1.2)  # the forward (queue and compute) took most of the bootstrap deadline
        tx.mark_prefill_complete()  # the wait for the decode's metadata counts from here
        time.sleep(1.0)  # past the sender's first deadline (2.0 s from its creation)
        assert tx.poll() is KVPoll.Bootstrapping
        assert rx.prefill_ready and rx.poll() is KVPoll.WaitingForInput
        # the decode never allocates: the prefill gives up and tells the decode why
        assert wait_terminal([tx, rx], timeout_s=10) == [KVPoll.Failed, KVPoll.Failed]
        assert "timed out after 2.0 s in Bootstrapping" in tx.failure_reason
        assert "prefill rank 0 failed the request" in rx.failure_reason
        assert "timed out after 2.0 s in Bootstrapping" in rx.failure_reason


def test_a_decode_waiting_for_a_forward_that_never_finishes_says_which_ranks_it_waits_for():
    with Cluster(2, 1, GEO, prefill_opts=COMPLETE, decode_opts={"waiting_timeout_s": 1.0}) as c:
        txs = [KVSender(m, 11) for m in c.pre]
        rx = KVReceiver(c.dec[0], 11, watch_prefill=True)
        assert _until(lambda: len(c.pre[1].room(11).watchers) == 1)
        txs[0].mark_prefill_complete()
        assert wait_terminal([rx], timeout_s=10) == [KVPoll.Failed]
        assert "have not finished the forward of this room" in rx.failure_reason
        assert "prefill ranks [1]" in rx.failure_reason
        # the prefill ranks hear it: their senders fail instead of waiting for metadata
        assert wait_terminal(txs, timeout_s=10) == [KVPoll.Failed, KVPoll.Failed]


def test_a_prefill_failure_reaches_a_decode_that_only_watched():
    with Cluster(1, 1, GEO, prefill_opts=COMPLETE) as c:
        tx = KVSender(c.pre[0], 13)
        rx = KVReceiver(c.dec[0], 13, watch_prefill=True)
        assert _until(lambda: len(c.pre[0].room(13).watchers) == 1)
        tx.abort("the prefill scheduler aborted it")
        assert wait_terminal([rx]) == [KVPoll.Failed]
        assert "the prefill scheduler aborted it" in rx.failure_reason


def test_a_watch_from_an_unregistered_session_is_dropped_as_a_security_event():
    from sglang_kvxfer.protocol.messages import RoomWatch

    with Cluster(1, 1, GEO, prefill_opts=COMPLETE) as c:
        m = c.pre[0]
        events = []
        m.security_event = lambda kind, text, *args: events.append(kind)  # type: ignore[method-assign]
        m._on_message(RoomWatch(room=1, session="intruder", tp_rank=0), "intruder")
        assert events == ["unregistered_sender"] and m.room(1) is None


def test_prefill_complete_is_a_prefill_setting():
    from sglang_kvxfer.engine import EngineConfig

    with pytest.raises(ValueError, match="prefill_complete=True must be a bool, and True only on a prefill"):
        EngineConfig("decode", GEO, 1, 0, "127.0.0.1:1", prefill_complete=True)


def test_a_second_session_watching_a_decode_ranks_room_fails_it_as_a_security_event():
    from sglang_kvxfer.protocol.messages import RoomWatch

    with Cluster(1, 2, GEO, prefill_opts=COMPLETE) as c:
        tx = KVSender(c.pre[0], 17)
        rx = KVReceiver(c.dec[0], 17, watch_prefill=True)
        assert _until(lambda: c.pre[0].room(17).watchers.get(0) == c.dec[0].session)
        KVReceiver(c.dec[1], 18)  # decode rank 1 registers with the prefill rank for a request of its own
        assert _until(lambda: c.dec[1].session in c.pre[0]._decode_peers)
        other = c.dec[1].session  # registered, but it is not decode rank 0's process
        c.pre[0]._on_message(RoomWatch(room=17, session=other, tp_rank=0), other)
        assert wait_terminal([tx, rx]) == [KVPoll.Failed, KVPoll.Failed]
        assert f"was watched by session {c.dec[0].session} and again by session {other}" in tx.failure_reason
        assert "security:" in rx.failure_reason
