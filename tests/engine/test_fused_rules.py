"""The decode's rules for a fused writer, with every rank as threads of this process: it
counts the writer's bytes like a direct writer's (its ``TransferDone`` must carry its whole
share), it never scatters (a chunk notice from a fused writer fails the room), and a prefill
asked for fused writes into a pool it does not map refuses with the reason. Also: fused
copies run on the rank's copy stream after the chunk's ``ready``."""

from __future__ import annotations

import time

import numpy as np

from sglang_kvxfer.engine import KVPoll, KVReceiver, KVSender
from sglang_kvxfer.engine.synthetic import fill_request
from sglang_kvxfer.planning import PoolMapping
from sglang_kvxfer.protocol import ChunkReady, StagedChunk, TransferDone

from .harness import Cluster, geometry, wait_terminal

FUSED = {"data_path": "fused"}


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.005)


def _fused_room(c, room: int, tokens: int = 12) -> KVReceiver:
    rx = KVReceiver(c.dec[0], room)
    rx.send_metadata([1, 2, 3], num_tokens=tokens)
    wait_for(lambda: c.dec[0].room(room).plans)
    assert {p: path for p, (path, _) in rx.paths.items()} == {0: "fused", 1: "fused"}
    assert c.dec[0].room(room).windows == {}  # no staging lent to a fused writer
    return rx


def test_a_fused_writer_must_deliver_its_whole_share():
    with Cluster(2, 1, geometry(8, page_size=4), decode_opts=FUSED) as c:
        rx = _fused_room(c, 51)
        share = 2 * 12 * 4 * (16 + 8) * 2  # layers x tokens x heads x (K + V dims) x bf16
        short = TransferDone(51, 0, share - 96, 1, b"", {})
        c.pre[0].control.send(c.dec[0].control.endpoint, short)  # the room's own writer, gone wrong
        assert wait_terminal([rx]) == [KVPoll.Failed]
        assert f"prefill rank 0 sent TransferDone with total_bytes={share - 96}; its share" in rx.failure_reason
        assert f"is {share} B" in rx.failure_reason


def test_a_fused_writer_sends_no_chunks_and_the_decode_scatters_none():
    with Cluster(2, 1, geometry(8, page_size=4), decode_opts=FUSED) as c:
        rx = _fused_room(c, 52)
        forged = ChunkReady(52, 0, 0, 4, 0, 4 * 4 * (16 + 8) * 2 * 2, 0, 2)
        c.pre[0].control.send(c.dec[0].control.endpoint, forged)
        assert wait_terminal([rx]) == [KVPoll.Failed]
        assert "ChunkReady from prefill rank 0 points outside its staging window" in rx.failure_reason
        assert "scatter" not in rx.record.phases
    with Cluster(2, 1, geometry(8, page_size=4), decode_opts=FUSED) as c:
        rx = _fused_room(c, 53)
        done = TransferDone(53, 1, 1 << 20, 1, b"", {}, StagedChunk(0, 4, 0, 4096))
        c.pre[1].control.send(c.dec[0].control.endpoint, done)
        assert wait_terminal([rx]) == [KVPoll.Failed]
        assert "TransferDone's last chunk from prefill rank 1 points outside its staging window" in rx.failure_reason


def test_a_prefill_that_does_not_map_the_pool_refuses_fused_writes_with_the_reason():
    with Cluster(1, 1, geometry(8, page_size=4), decode_opts=FUSED) as c:
        rx = KVReceiver(c.dec[0], 54)  # registers with the prefill rank
        wait_for(lambda: c.pre[0]._decode_peers)
        # the decode believes its pool mapped (its RegisterReply said so); the prefill no longer does
        (peer,) = c.pre[0]._decode_peers.values()
        peer.mapping = PoolMapping(False, "unmapped for this test")
        rx.send_metadata([1, 2, 3, 4], num_tokens=16)
        tx = KVSender(c.pre[0], 54)
        tx.send(np.arange(4), last_chunk=True)
        txs, rxs = [tx], [rx]
        assert wait_terminal(txs + rxs) == [KVPoll.Failed] * 2
        want = "decode rank 0 asked for fused writes, but its KV pool is not mapped here (unmapped for this test)"
        assert want in txs[0].failure_reason and want in rxs[0].failure_reason


class HostReady:
    def __init__(self, log):
        self.log = log

    def synchronize(self):
        self.log.append("ready")


def test_fused_copies_run_on_the_copy_stream_after_ready():
    with Cluster(2, 1, geometry(8, page_size=4)) as c:  # auto: strided slices into a mapped pool
        calls = []
        for m in c.pre:
            run = m.copy_stream.run

            def recording(copy, ready=None, _run=run):
                calls.append(ready)
                return _run(copy, ready)

            m.copy_stream.run = recording
        log: list[str] = []
        src, dst, tokens = np.arange(1, 7), np.arange(20, 26), 24
        rx = KVReceiver(c.dec[0], 55)
        rx.send_metadata(dst, num_tokens=tokens)
        txs = []
        for m in c.pre:
            fill_request(m.placement, m.pool.buffers, 55, src, 0, tokens)
            txs.append(KVSender(m, 55))
            txs[-1].send(src[:3], ready=HostReady(log))
            txs[-1].send(src[3:], last_chunk=True, ready=HostReady(log))
        assert wait_terminal(txs + [rx]) == [KVPoll.Success] * 3, [h.failure_reason for h in txs + [rx]]
        assert c.verify(55, dst, tokens) == []
        assert all(tx.paths == {"fused": 1} and tx.ops == 2 for tx in txs)  # one copy per chunk
        assert len(calls) == 4 and all(isinstance(r, HostReady) for r in calls) and len(log) == 4
        assert "scatter" not in rx.record.phases and rx.record.bytes == sum(tx.bytes_sent for tx in txs)
