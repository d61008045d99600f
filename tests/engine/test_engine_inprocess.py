"""The engine with every rank as threads of this process: data paths, aborts, deadlines,
bad frames, validation. Bytes are real and checked; every wait has a deadline."""

from __future__ import annotations

import logging
import time

import pytest
import zmq

from sglang_kvxfer.engine import BootstrapServer, EngineConfig, KVManager, KVPoll, KVReceiver, KVSender
from sglang_kvxfer.errors import TransferFailedError
from sglang_kvxfer.protocol import PROTOCOL_VERSION, ChunkAck, StagedChunk, TransferDone

from .harness import FAST, Cluster, geometry, wait_terminal


@pytest.mark.parametrize("transport", ["local", "tcp"])
@pytest.mark.parametrize(
    "h,p,d,pages,layouts",
    [
        (8, 2, 1, (4, 4), ("NHD", "NHD")),  # staged gather of strided head slices
        (8, 1, 2, (4, 8), ("NHD", "HND")),  # page size and layout differ
        (8, 2, 2, (4, 4), ("NHD", "NHD")),  # equal TP
        (2, 1, 4, (8, 8), ("HND", "HND")),  # replicated decode heads, HND head slices
        (6, 2, 1, (1, 1), ("NHD", "NHD", 0)),  # K only (a mamba state row sliced over TP), gathered
        (6, 1, 3, (3, 3), ("NHD", "NHD", 0)),  # K only, split over three readers
    ],
)
def test_transfers_are_byte_exact(transport, h, p, d, pages, layouts):
    k_only = dict(v_head_dim=0, head_dim=12, dtype="uint8") if len(layouts) > 2 else {}
    gp = geometry(h, page_size=pages[0], layout=layouts[0], **k_only)
    gd = geometry(h, page_size=pages[1], layout=layouts[1], **k_only)
    with Cluster(p, d, gp, gd, transport) as c:
        for room, tokens, chunk in ((11, 37, 8), (12, 64, None), (13, 5, 4)):
            txs, rxs, dst = c.start(room, tokens, chunk=chunk, aux=b"tok%d" % room)
            assert wait_terminal(txs + rxs) == [KVPoll.Success] * (p + d), [x.failure_reason for x in txs + rxs]
            assert c.verify(room, dst, tokens) == []
            assert all(rx.aux_payload == b"tok%d" % room for rx in rxs)


def test_direct_path_for_equal_tp_with_contiguous_pages():
    g = geometry(8, page_size=4, num_pages=64)
    with Cluster(1, 1, g) as c:
        rx = KVReceiver(c.dec[0], 5)
        rx.send_metadata(list(range(10, 20)), num_tokens=40)
        from sglang_kvxfer.engine.synthetic import fill_request, verify_request

        src = list(range(30, 40))
        fill_request(c.pre[0].placement, c.pre[0].pool.buffers, 5, src, 0, 40)
        tx = KVSender(c.pre[0], 5)
        tx.send(src, last_chunk=True)
        assert wait_terminal([tx, rx]) == [KVPoll.Success] * 2
        assert tx.paths == {"direct": 1} and tx.ops == 4  # one run per buffer (2 layers x K, V), one call
        assert verify_request(c.dec[0].placement, c.dec[0].pool.buffers, 5, list(range(10, 20)), 40) == []


def test_mla_one_writer_per_decode_rank():
    g = geometry(1, mla=True, head_dim=24)
    with Cluster(3, 2, g) as c:
        txs, rxs, dst = c.start(21, 30, chunk=12)
        assert wait_terminal(txs + rxs) == [KVPoll.Success] * 5
        assert c.verify(21, dst, 30) == []
        assert sum(bool(tx.paths) for tx in txs) == 2  # exactly one writer per decode rank


@pytest.mark.parametrize("transport", ["tcp", "local"])
def test_staging_window_smaller_than_a_request_streams_through_slots(transport):
    g = geometry(8, page_size=4, num_pages=256)
    opts = {"staging_slot_bytes": 4096, "staging_bytes": 1 << 16, "data_path": "staged"}  # local would fuse
    with Cluster(2, 1, g, transport=transport, decode_opts=opts) as c:
        txs, rxs, dst = c.start(31, 400, chunk=64)
        assert wait_terminal(txs + rxs) == [KVPoll.Success] * 3
        assert c.verify(31, dst, 400) == []
        per_token = 2 * 4 * (16 + 8) * 2  # layers x writer heads x (K + V dims) x bf16: 384 B
        assert all(tx.bytes_sent == 400 * per_token for tx in txs)  # 150 KiB through two 4 KiB slots
        # one op per slot fill: a transport write (tcp) or a gather straight into the
        # reader's mapped slot (local shared memory)
        assert all(tx.ops >= 400 // (4096 // per_token) for tx in txs)


def test_abort_from_decode_reaches_prefill_and_the_next_request_works():
    with Cluster(2, 1, geometry()) as c:
        rx = KVReceiver(c.dec[0], 41)
        rx.send_metadata([1, 2, 3], num_tokens=12)
        txs = [KVSender(m, 41) for m in c.pre]
        wait_for(lambda: all(tx.poll() == KVPoll.WaitingForInput for tx in txs))
        rx.abort("client went away")
        assert wait_terminal(txs) == [KVPoll.Failed] * 2
        assert all("decode rank 0 aborted the request: client went away" in tx.failure_reason for tx in txs)
        with pytest.raises(TransferFailedError, match="client went away"):
            rx.failure_exception()
        txs, rxs, dst = c.start(42, 12)
        assert wait_terminal(txs + rxs) == [KVPoll.Success] * 3
        assert c.verify(42, dst, 12) == []


def test_abort_from_prefill_reaches_decode():
    with Cluster(1, 1, geometry()) as c:
        rx = KVReceiver(c.dec[0], 51)
        rx.send_metadata([4, 5], num_tokens=8)
        tx = KVSender(c.pre[0], 51)
        wait_for(lambda: tx.poll() == KVPoll.WaitingForInput)
        tx.abort("prefill was preempted")
        assert wait_terminal([rx]) == [KVPoll.Failed]
        assert "prefill rank 0 aborted the request: prefill was preempted" in rx.failure_reason


def test_sender_created_after_the_decode_failed_fails_at_once():
    with Cluster(1, 1, geometry()) as c:
        rx = KVReceiver(c.dec[0], 61)
        rx.send_metadata([1], num_tokens=4)
        rx.abort("gave up early")
        time.sleep(0.3)
        tx = KVSender(c.pre[0], 61)
        assert wait_terminal([tx], 2.0) == [KVPoll.Failed]


def test_waiting_for_input_has_a_deadline():
    with Cluster(1, 1, geometry(), prefill_opts={"waiting_timeout_s": 0.5}) as c:
        rx = KVReceiver(c.dec[0], 71)
        rx.send_metadata([1], num_tokens=4)
        tx = KVSender(c.pre[0], 71)  # never sends
        assert wait_terminal([tx, rx], 10) == [KVPoll.Failed] * 2
        assert "timed out after 0.5 s in WaitingForInput" in tx.failure_reason
        assert "timed out after 0.5 s in WaitingForInput" in rx.failure_reason  # told by prefill


def test_no_prefill_group_fails_within_the_bootstrap_deadline():
    with BootstrapServer() as boot:
        cfg = EngineConfig("decode", geometry(), 1, 0, boot.address, **{**FAST, "bootstrap_timeout_s": 0.6})
        with KVManager(cfg) as mgr:
            rx = KVReceiver(mgr, 81)
            rx.send_metadata([1], num_tokens=4)
            assert wait_terminal([rx], 10) == [KVPoll.Failed]
            assert "0 of ? prefill rank(s) registered" in rx.failure_reason or "timed out" in rx.failure_reason


def test_geometry_mismatch_fails_both_sides_with_the_field_message():
    gp, bad = geometry(head_dim=16), geometry(head_dim=32)
    with Cluster(1, 1, gp) as c:
        cfg = EngineConfig("decode", bad, 1, 0, c.boot.address, **FAST)
        with KVManager(cfg) as wrong:
            tx = KVSender(c.pre[0], 91)
            rx = KVReceiver(wrong, 91)
            rx.send_metadata([1], num_tokens=4)
            assert wait_terminal([rx, tx], 10) == [KVPoll.Failed] * 2
            for msg in (rx.failure_reason, tx.failure_reason):
                assert "head_dim: prefill=16 decode=32" in msg, msg
        txs, rxs, dst = c.start(92, 9)  # the prefill keeps serving the compatible decode rank
        assert wait_terminal(txs + rxs) == [KVPoll.Success] * 2
        assert c.verify(92, dst, 9) == []


def test_malformed_frames_are_logged_and_dropped(caplog):
    from sglang_kvxfer.protocol import envelope

    with Cluster(1, 1, geometry()) as c:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        endpoint = c.pre[0].control.endpoint
        sock.connect(endpoint)
        import msgpack

        payloads = [
            b"\x00garbage",
            msgpack.packb([99, "Heartbeat", {}]),
            msgpack.packb([PROTOCOL_VERSION, "Heartbeat", {"session": 5}]),
            msgpack.packb([PROTOCOL_VERSION, "NoSuchMessage", {}]),
            msgpack.packb({"a": 1}),
        ]
        # Authenticated envelopes around malformed payloads (a key holder's bug), and one
        # payload with no envelope at all (dropped before it is even decoded).
        frames = [envelope.seal(c.pre[0].config.auth_key, "tester", i + 1, p, endpoint) for i, p in enumerate(payloads)]
        with caplog.at_level(logging.WARNING, logger="sglang_kvxfer.control"):
            for f in frames + [payloads[1]]:
                sock.send(f)
            wait_for(lambda: c.pre[0].control.bad_frames == len(frames) + 1)
        sock.close()
        assert c.pre[0].control.dropped["malformed"] == len(frames)
        assert c.pre[0].control.dropped["unauthenticated"] == 1
        text = caplog.text
        assert "dropped a control frame (malformed" in text
        assert "protocol version 99" in text and "NoSuchMessage" in text
        txs, rxs, dst = c.start(101, 10)
        assert wait_terminal(txs + rxs) == [KVPoll.Success] * 2


def test_sender_and_receiver_reject_bad_calls():
    with Cluster(1, 1, geometry(num_pages=16)) as c:
        tx = KVSender(c.pre[0], 111)
        with pytest.raises(ValueError, match=r"page_ids must lie in \[0, 16\), got 3..16"):
            tx.send([3, 16])
        with pytest.raises(ValueError, match="aux travels with the last chunk only"):
            tx.send([1], aux=b"x")
        tx.send([1], last_chunk=True)
        with pytest.raises(ValueError, match="send\\(\\) after the last chunk"):
            tx.send([2])
        rx = KVReceiver(c.dec[0], 112)
        with pytest.raises(ValueError, match="page_ids repeats a page"):
            rx.send_metadata([2, 2])
        with pytest.raises(ValueError, match="num_tokens=9 does not fit 2 page\\(s\\) of 4 tokens"):
            rx.send_metadata([2, 3], num_tokens=9)
        with pytest.raises(ValueError, match="page_ids is empty"):
            rx.send_metadata([])
        rx.send_metadata([2, 3], num_tokens=8)
        with pytest.raises(ValueError, match="send_metadata\\(\\) was already called"):
            rx.send_metadata([4])
        with pytest.raises(ValueError, match="room 112 is already in flight"):
            KVReceiver(c.dec[0], 112)


def wait_for(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def _record_sends(mgr):
    """Wrap ``mgr``'s control channel so that every message it sends is kept, in order."""
    sent = []
    control = mgr.control
    send = control.send

    def recording(endpoint, message):
        sent.append(message)
        return send(endpoint, message)

    control.send = recording
    return sent


@pytest.mark.parametrize("transport", ["local", "tcp"])
@pytest.mark.parametrize("slot_bytes, slots", [(64 << 10, 1), (4096, 4)])
def test_the_last_staged_chunk_rides_on_transfer_done(transport, slot_bytes, slots):
    """One notice for a writer's last slot: no ChunkReady and no ChunkAck for it."""
    per_token = 2 * 4 * (16 + 8) * 2  # layers x writer heads x (K + V dims) x bf16: 384 B
    tokens = slots * (slot_bytes // per_token) if slots > 1 else 40
    with Cluster(
        2,
        1,
        geometry(8, page_size=4, num_pages=256),
        transport=transport,
        decode_opts={"staging_slot_bytes": slot_bytes, "data_path": "staged"},  # local would fuse
    ) as c:
        pre_sent = [_record_sends(m) for m in c.pre]
        dec_sent = _record_sends(c.dec[0])
        txs, rxs, dst = c.start(41, tokens, aux=b"last")
        assert wait_terminal(txs + rxs) == [KVPoll.Success] * 3, [x.failure_reason for x in txs + rxs]
        assert c.verify(41, dst, tokens) == [] and rxs[0].aux_payload == b"last"
        for tx, sent in zip(txs, pre_sent):
            names = [type(m).__name__ for m in sent]
            assert names.count("ChunkReady") == slots - 1, names
            (done,) = [m for m in sent if isinstance(m, TransferDone)]
            assert done.last_chunk is not None and done.total_bytes == tx.bytes_sent == tokens * per_token
            assert done.last_chunk.token_start + done.last_chunk.num_tokens == tokens
        acks = [m for m in dec_sent if isinstance(m, ChunkAck)]
        assert len(acks) == 2 * (slots - 1)  # every slot but each writer's last one


def test_a_last_chunk_outside_its_window_fails_the_room_naming_it():
    with Cluster(2, 1, geometry(8, page_size=4), decode_opts={"data_path": "staged"}) as c:
        rx = KVReceiver(c.dec[0], 51)
        rx.send_metadata([1, 2, 3], num_tokens=12)
        wait_for(lambda: c.dec[0].room(51).windows)
        forged = TransferDone(51, 0, 1 << 20, 1, b"", {}, StagedChunk(0, 4, 1 << 40, 4096))
        c.pre[0].control.send(c.dec[0].control.endpoint, forged)  # the room's own writer, gone wrong
        assert wait_terminal([rx]) == [KVPoll.Failed]
        assert "TransferDone's last chunk from prefill rank 0 points outside its staging window" in rx.failure_reason


def test_the_control_loop_sleeps_until_its_tick_instead_of_spinning(monkeypatch):
    """The I/O thread's wait before a tick is rounded up: a wait cut to 0 ms would spin
    for the last millisecond of every tick and take the GIL from the data path."""
    from sglang_kvxfer.engine.control import ControlChannel

    polls, ticks = [0], [0]
    real_poll = zmq.Poller.poll

    def counting_poll(self, timeout=None):
        polls[0] += 1
        return real_poll(self, timeout)

    monkeypatch.setattr(zmq.Poller, "poll", counting_poll)
    channel = ControlChannel(
        "127.0.0.1",
        lambda *a: None,
        lambda now: ticks.__setitem__(0, ticks[0] + 1),
        "spin",
        session="s",
        key=b"",
        tick_s=0.005,
    )
    try:
        time.sleep(0.5)
    finally:
        channel.close()
    assert ticks[0] >= 20
    assert polls[0] <= 3 * ticks[0] + 5, f"{polls[0]} polls for {ticks[0]} ticks"


def test_wait_returns_when_the_request_ends_and_not_before():
    """``wait`` blocks until the request's own transition (success, or an abort from the
    peer) and returns the live poll after a timeout."""
    with Cluster(2, 1, geometry()) as c:
        rx = KVReceiver(c.dec[0], 61)
        assert rx.wait(0.05) in (KVPoll.Bootstrapping, KVPoll.WaitingForInput)  # the timeout ends it
        rx.send_metadata([1, 2, 3], num_tokens=12)
        txs = [KVSender(m, 61) for m in c.pre]
        rx.abort("the client left")
        assert [tx.wait(10) for tx in txs] == [KVPoll.Failed] * 2  # woken by the peer's abort
        txs, rxs, dst = c.start(62, 12)
        assert [h.wait(10) for h in txs + rxs] == [KVPoll.Success] * 3
        assert c.verify(62, dst, 12) == []
        with pytest.raises(ValueError, match="timeout_s=-1 must be >= 0"):
            rxs[0].wait(-1)


def test_metadata_for_a_room_that_failed_and_was_released_is_answered_with_the_reason():
    """The prefill gave up on a room and forgot it before the decode's metadata came (a
    client that aborted early, a consumer that registers late): the decode is told why at
    once instead of waiting for its own deadline."""
    with Cluster(1, 1, geometry()) as c:
        tx = KVSender(c.pre[0], 71)
        tx.abort("the client left before the decode asked")
        assert tx.poll() == KVPoll.Failed
        tx.clear()
        assert c.pre[0].room(71) is None  # forgotten
        rx = KVReceiver(c.dec[0], 71)
        rx.send_metadata([1, 2], num_tokens=8)
        assert rx.wait(5) == KVPoll.Failed  # the waiting deadline is 10 s
        assert "the client left before the decode asked" in rx.failure_reason
        txs, rxs, dst = c.start(72, 8)  # the next request is served
        assert [h.wait(10) for h in txs + rxs] == [KVPoll.Success] * 2
        assert c.verify(72, dst, 8) == []
