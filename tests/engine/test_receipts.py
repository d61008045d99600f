"""Landing receipts over ``tcp``: a writer's ``TransferDone`` carries the receipts of the
writes it had no ACK for yet, and the decode counts the writer done once its own transport
says they landed. The ACKs are held back here (until the decode reported Success), so the
old order, ACK first and notice after, could not finish at all. Bytes are real and
compared; forged receipts fail the room naming why."""

from __future__ import annotations

import threading
import time

import pytest

from sglang_kvxfer.engine import KVPoll, KVReceiver
from sglang_kvxfer.protocol import TransferDone
from sglang_kvxfer.transports.tcp import conn as tcp_conn

from .harness import Cluster, geometry, wait_terminal

HOLD_S = 20.0  # the longest an ACK is held back (the test releases it long before)


def _record_sends(mgr):
    sent = []
    send = mgr.control.send

    def recording(endpoint, message):
        sent.append(message)
        return send(endpoint, message)

    mgr.control.send = recording
    return sent


def _wait_metadata_sent(rx, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while rx.poll() is not KVPoll.WaitingForInput:
        assert time.monotonic() < deadline, f"still {rx.poll()}: {rx.failure_reason}"
        time.sleep(0.005)


@pytest.fixture
def held_acks(monkeypatch):
    """Every tcp reader in this process holds its ACKs until the event is set."""
    release = threading.Event()
    ack = tcp_conn._Inbound._ack

    def held(self, xfer_id, status, reason):
        release.wait(HOLD_S)
        return ack(self, xfer_id, status, reason)

    monkeypatch.setattr(tcp_conn._Inbound, "_ack", held)
    yield release
    release.set()


@pytest.mark.parametrize(
    "p, opts, path",
    [
        (1, {}, "direct"),  # 1 -> 1, contiguous pages: page runs
        (2, {}, "per_token"),  # 2 -> 1, strided head slices, small: row by row
        (2, {"data_path": "staged"}, "staged"),  # the last staging slot rides on the notice
    ],
)
def test_the_decode_succeeds_on_receipts_while_the_writers_acks_are_held(held_acks, p, opts, path):
    tokens = 24
    with Cluster(p, 1, geometry(8, page_size=4, num_pages=64), transport="tcp", decode_opts=opts) as c:
        sent = [_record_sends(m) for m in c.pre]
        txs, rxs, dst = c.start(61, tokens, aux=b"end")
        assert wait_terminal(rxs) == [KVPoll.Success], rxs[0].failure_reason
        assert c.verify(61, dst, tokens) == [] and rxs[0].aux_payload == b"end"
        # the writers still wait for their ACKs: they told the decode "done" before them
        assert [tx.poll() for tx in txs] == [KVPoll.Transferring] * p
        for tx, msgs in zip(txs, sent):
            (done,) = [m for m in msgs if isinstance(m, TransferDone)]
            assert done.receipts, done
            assert tx.paths == {path: 1}, tx.paths
        held_acks.set()
        assert wait_terminal(txs) == [KVPoll.Success] * p, [tx.failure_reason for tx in txs]
        # the next request, ACKs flowing: receipts or not, the bytes land the same
        txs, rxs, dst = c.start(62, tokens)
        assert wait_terminal(txs + rxs) == [KVPoll.Success] * (p + 1)
        assert c.verify(62, dst, tokens) == []


def test_receipts_that_never_land_fail_the_room_at_the_transfer_deadline():
    with Cluster(1, 1, geometry(8, page_size=4), transport="tcp", decode_opts={"transfer_timeout_s": 1.0}) as c:
        rx = KVReceiver(c.dec[0], 71)
        rx.send_metadata([1, 2, 3], num_tokens=12)
        _wait_metadata_sent(rx)  # the decode knows its writers: their notices are not dropped
        share = 12 * 2 * 8 * (16 + 8) * 2  # tokens x layers x heads x (K + V dims) x bf16
        # the room's own writer, claiming a frame of a connection that never comes
        forged = TransferDone(71, 0, share, 1, b"", {}, receipts=((0xABCDEF, 1),))
        t0 = time.monotonic()
        c.pre[0].control.send(c.dec[0].control.endpoint, forged)
        assert wait_terminal([rx]) == [KVPoll.Failed]
        assert "prefill rank 0's writes did not land" in rx.failure_reason
        assert "not landed after" in rx.failure_reason and "the transfer deadline, 1.0 s" in rx.failure_reason
        assert time.monotonic() - t0 < 10.0  # bounded by the deadline, not the test's timeout


def test_receipts_naming_another_writers_connection_fail_the_room_at_once():
    tokens = 24
    with Cluster(2, 1, geometry(8, page_size=4, num_pages=64), transport="tcp") as c:
        sent = _record_sends(c.pre[1])
        txs, rxs, dst = c.start(81, tokens)
        assert wait_terminal(txs + rxs) == [KVPoll.Success] * 3
        (done,) = [m for m in sent if isinstance(m, TransferDone)]
        # rank 1's connection exists now; make receipts of rank 1's frames look like rank 0's
        conn_id = next(conn.conn_id for peer in c.pre[1].transport._peers.values() for conn in peer.conns)
        rx = KVReceiver(c.dec[0], 82)
        rx.send_metadata(c.pages(c.dec[0], tokens), num_tokens=tokens)
        _wait_metadata_sent(rx)
        forged = TransferDone(82, 0, done.total_bytes, 1, b"", {}, receipts=((conn_id, 1),))
        c.pre[0].control.send(c.dec[0].control.endpoint, forged)
        assert wait_terminal([rx]) == [KVPoll.Failed]
        assert "prefill rank 0's writes did not land" in rx.failure_reason
        assert "which is another writer's" in rx.failure_reason
