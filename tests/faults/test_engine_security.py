"""Forged, replayed and conflicting control frames against live ranks.

The attacker is a separate process with its own sockets that can reach every port: without
the key (everything dropped and counted before it creates state), with a replayed frame,
and with the key but another session (a misbehaving or compromised peer: room ownership and
expected-sender rules). Each test checks what the victim request sees, the counters, and
that the real transfer still moves and verifies every byte.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from sglang_kvxfer import auth
from sglang_kvxfer.engine import BootstrapServer, KVPoll, KVReceiver, KVSender
from sglang_kvxfer.protocol import codec, envelope
from sglang_kvxfer.protocol.fields import Side
from sglang_kvxfer.protocol.messages import Abort, RequestMeta, TransferDone, TransferFailed
from tests.engine.harness import Cluster, geometry, wait_terminal

SECRET = "fault-suite-shared-secret-0123456789"
KEY = auth.key_from_secret(SECRET)

ATTACKER = r"""
import json, sys, time, zmq
spec = json.loads(sys.stdin.read())
ctx = zmq.Context()
sock = ctx.socket(zmq.PUSH)
sock.setsockopt(zmq.LINGER, 2000)
sock.setsockopt(zmq.SNDHWM, 0)
sock.connect(spec["endpoint"])
frames = [bytes.fromhex(f) for f in spec["frames"]]
for _ in range(spec.get("repeat", 1)):
    for f in frames:
        sock.send(f)
sock.close()
ctx.term()
"""


def attack(endpoint: str, frames: list[bytes], repeat: int = 1) -> None:
    """Send raw frames to ``endpoint`` from another process (not a peer of anybody)."""
    spec = json.dumps({"endpoint": endpoint, "frames": [f.hex() for f in frames], "repeat": repeat})
    subprocess.run([sys.executable, "-c", ATTACKER], input=spec.encode(), check=True, timeout=120)


def sealed(message, sender: str, seq: int, endpoint: str, key: bytes = KEY) -> bytes:
    return envelope.seal(key, sender, seq, codec.encode(message), endpoint)


def wait_for(cond, timeout_s=10.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"{what} not reached within {timeout_s} s")


@pytest.fixture
def keyed(monkeypatch):
    monkeypatch.setenv("KVXFER_AUTH_KEY", SECRET)
    monkeypatch.delenv("KVXFER_AUTH", raising=False)


def meta_for(room: int, session: str, pages, tokens: int) -> RequestMeta:
    return RequestMeta(
        room=room,
        session=session,
        tp_rank=0,
        tp_size=1,
        num_tokens=tokens,
        dst_page_ids=np.asarray(pages, dtype=np.int32),
        aux_slot=-1,
        elected=True,
        staging_offset=-1,
        staging_capacity_bytes=0,
        staging_region=None,
    )


def test_frames_without_the_key_are_dropped_and_counted_before_they_create_state(keyed):
    with Cluster(1, 1, geometry()) as c:
        pre = c.pre[0]
        wrong = auth.key_from_secret("not-the-shared-secret-at-all")
        frames = [
            sealed(
                Abort(room=r, side=Side.DECODE, tp_rank=0, reason="forged"),
                "attacker",
                r + 1,
                pre.control.endpoint,
                key=wrong,
            )
            for r in range(50)
        ]
        frames.append(sealed(meta_for(7, "attacker", [1], 4), "attacker", 99, pre.control.endpoint, key=wrong))
        frames.append(codec.encode(Abort(room=7, side=Side.DECODE, tp_rank=0, reason="no envelope")))
        attack(pre.control.endpoint, frames)
        wait_for(lambda: pre.control.dropped["unauthenticated"] == len(frames), what="all frames dropped")
        assert pre.num_inflight() == 0 and pre.room(7) is None and pre.room(3) is None
        txs, rxs, dst = c.start(7, 12)  # the room the attacker tried to fail in advance
        assert wait_terminal(txs + rxs) == [KVPoll.Success] * 2
        assert c.verify(7, dst, 12) == []


def test_a_forged_transfer_done_does_not_complete_a_request(keyed):
    with Cluster(1, 1, geometry()) as c:
        pre, dec = c.pre[0], c.dec[0]
        tokens, room = 12, 21
        rx = KVReceiver(dec, room)
        dst = c.pages(dec, tokens)
        rx.send_metadata(dst, num_tokens=tokens)
        wait_for(lambda: pre.room(room) is not None, what="metadata at the prefill")
        done = TransferDone(room=room, tp_rank=0, total_bytes=1, num_ops=1, aux_payload=b"forged", timings={})
        # Without the key, and with the key from a session that is not the room's writer.
        attack(
            dec.control.endpoint,
            [
                sealed(
                    done, "attacker", 1, dec.control.endpoint, key=auth.key_from_secret("wrong-secret-for-this-test")
                ),
                sealed(done, "attacker", 2, dec.control.endpoint),
            ],
        )
        wait_for(lambda: dec.security_events["unexpected_sender"] == 1, what="the keyed forgery counted")
        assert dec.control.dropped["unauthenticated"] == 1
        time.sleep(0.3)
        assert rx.poll() not in (KVPoll.Success, KVPoll.Failed)
        src = c.pages(pre, tokens)
        from sglang_kvxfer.engine.synthetic import fill_request

        fill_request(pre.placement, pre.pool.buffers, room, src, 0, tokens)
        tx = KVSender(pre, room)
        tx.send(src, last_chunk=True, aux=b"real")
        assert wait_terminal([tx, rx]) == [KVPoll.Success] * 2
        assert rx.aux_payload == b"real"
        assert c.verify(room, dst, tokens) == []


def test_replayed_and_redirected_frames_are_dropped(keyed):
    with Cluster(1, 2, geometry(h=8)) as c:
        pre = c.pre[0]
        rogue_session = "replayer"
        abort = Abort(room=5, side=Side.DECODE, tp_rank=0, reason="replayed")
        frame = sealed(abort, rogue_session, 10, pre.control.endpoint)
        # The same frame twice (the second is a replay), and a frame sealed for decode rank 0's
        # inbox delivered to the prefill instead (another destination).
        other = sealed(abort, rogue_session, 11, c.dec[0].control.endpoint)
        attack(pre.control.endpoint, [frame, frame, other])
        wait_for(
            lambda: pre.control.dropped["replayed"] == 1 and pre.control.dropped["unauthenticated"] == 1,
            what="replay and redirect dropped",
        )
        # The first copy passed the envelope but comes from an unregistered session: no state.
        wait_for(lambda: pre.security_events["unregistered_sender"] >= 1, what="unregistered sender counted")
        assert pre.room(5) is None


def test_a_second_session_claiming_a_room_fails_it_on_both_sides_instead_of_taking_the_kv(keyed):
    boot = BootstrapServer()
    try:
        with Cluster(1, 1, geometry(), bootstrap=boot) as c, Cluster(0, 1, geometry(), bootstrap=boot) as rogue:
            pre, victim, thief = c.pre[0], c.dec[0], rogue.dec[0]
            tokens, room = 16, 33
            rx = KVReceiver(victim, room)
            dst = c.pages(victim, tokens)
            rx.send_metadata(dst, num_tokens=tokens)
            wait_for(lambda: pre.room(room) is not None and pre.room(room).metas, what="victim metadata")
            stolen = KVReceiver(thief, room)
            stolen.send_metadata(np.arange(4), num_tokens=tokens)
            wait_for(lambda: pre.security_events["room_conflict"] == 1, what="the second claim")
            from sglang_kvxfer.engine.synthetic import fill_request

            src = c.pages(pre, tokens)
            fill_request(pre.placement, pre.pool.buffers, room, src, 0, tokens)
            t0 = time.monotonic()
            tx = KVSender(pre, room)
            tx.send(src, last_chunk=True)
            assert wait_terminal([tx, rx, stolen]) == [KVPoll.Failed] * 3
            assert time.monotonic() - t0 < 5.0
            for handle in (tx, rx, stolen):
                assert "security: room 33 for decode rank 0 was claimed by session" in handle.failure_reason
            assert pre.security_events["room_conflict"] == 1
            # Not one byte reached the second claimant's pool.
            assert all(int(b.float().abs().sum()) == 0 for b in thief.pool.buffers)
            txs, rxs, dst2 = c.start(34, tokens)  # the victim pair still works
            assert wait_terminal(txs + rxs) == [KVPoll.Success] * 2
            assert c.verify(34, dst2, tokens) == []
    finally:
        boot.close()


def test_late_metadata_for_a_failed_room_is_answered_at_once(keyed):
    with Cluster(1, 1, geometry(), decode_opts={"waiting_timeout_s": 60.0}) as c:
        pre, dec = c.pre[0], c.dec[0]
        tx = KVSender(pre, 41)
        tx.abort("the prefill gave up on this request")
        assert tx.poll() is KVPoll.Failed
        t0 = time.monotonic()
        rx = KVReceiver(dec, 41)
        rx.send_metadata(c.pages(dec, 8), num_tokens=8)
        assert wait_terminal([rx], timeout_s=10) == [KVPoll.Failed]
        assert time.monotonic() - t0 < 5.0  # not the 60 s waiting deadline
        assert "the prefill gave up on this request" in rx.failure_reason


def test_a_flood_of_unknown_room_frames_keeps_the_room_table_bounded(keyed, monkeypatch):
    from sglang_kvxfer.engine.prefill import PrefillManager

    monkeypatch.setattr(PrefillManager, "MAX_UNATTACHED_ROOMS", 200)
    with Cluster(1, 1, geometry()) as c:
        pre, dec = c.pre[0], c.dec[0]
        c.start(1, 8)  # registers the decode session
        wait_for(lambda: dec.session in pre._decode_peers, what="decode registered")
        rss0 = _rss_bytes()
        n = 20_000
        unregistered = [
            sealed(
                TransferFailed(room=1000 + i, side=Side.DECODE, tp_rank=0, reason="flood"),
                "nobody",
                i + 1,
                pre.control.endpoint,
            )
            for i in range(n)
        ]
        attack(pre.control.endpoint, unregistered)
        wait_for(lambda: pre.security_events["unregistered_sender"] >= n, timeout_s=60, what="flood handled")
        assert pre.room(1000) is None
        # From the registered session (a key holder gone wrong): capped by count.
        # Its frames must carry its own sequence numbers: a fresh, higher range.
        registered = [
            sealed(
                Abort(room=50_000 + i, side=Side.DECODE, tp_rank=0, reason="flood"),
                dec.session,
                (1 << 40) + i,
                pre.control.endpoint,
            )
            for i in range(1000)
        ]
        attack(pre.control.endpoint, registered)
        wait_for(lambda: pre.security_events["room_cap"] >= 800, timeout_s=60, what="cap reached")
        assert len(pre._rooms) <= 200 + 2
        assert _rss_bytes() - rss0 < 64 << 20


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
