"""Layer-wise streaming: ``KVSender.send(..., layers=range(a, b))`` hands over layers as a
forward pass finishes them, combined with chunked prefill (token chunks x layer groups).

Each layer group's KV is written into the prefill pool only when the engine waits for
that group's ``ready`` (the simulated forward), so a transfer that read a layer before it
was declared final would move garbage that no later write repairs: the byte-exact check
against ``verify_request`` (content computed from room, layer, head and token) fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_kvxfer.engine import KVPoll, KVReceiver, KVSender
from sglang_kvxfer.engine.prefill_rooms import Chunk
from sglang_kvxfer.engine.synthetic import fill_request

from .harness import Cluster, geometry, wait_terminal

NUM_LAYERS = 4
# A starved 2-core host can stall a process past the harness's 2 s heartbeat timeout; these
# tests are about the data, so silence is given more room (the fault test keeps 1 s).
CALM = {"heartbeat_timeout_s": 10.0}


class LayerForward:
    """A forward pass over one rank's pool: the pool starts as garbage; ``group(pages, a, b)``
    returns a ``ready`` whose ``synchronize()`` writes layers [a, b) of the request's true KV
    (the engine calls it before it reads those pages)."""

    def __init__(self, mgr, room, src, tokens):
        self.mgr = mgr
        g = mgr.config.geometry
        gen = torch.Generator().manual_seed(room)
        truth = []
        for buf in mgr.pool.buffers:
            raw = buf.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))  # garbage
            truth.append(buf.clone())
        fill_request(mgr.placement, truth, room, src, 0, tokens)
        self.truth, self.num_layers = truth, g.num_layers
        self.synced: list[tuple[int, int]] = []

    def group(self, a, b):
        forward = self

        class Ready:
            def synchronize(self):
                for i, buf in enumerate(forward.mgr.pool.buffers):
                    if a <= i % forward.num_layers < b:
                        buf.copy_(forward.truth[i])
                forward.synced.append((a, b))

        return Ready()


def groups_of(num_layers, size):
    return [range(a, min(num_layers, a + size)) for a in range(0, num_layers, size)]


def start_layerwise(c, room, tokens, chunk_tokens, group_size, aux=b"aux"):
    """Receivers and layer-wise senders for one request: every token chunk's layers in
    groups of ``group_size``, each group's ``ready`` writing its layers."""
    num_layers = c.pre[0].config.geometry.num_layers
    src, dst, rxs = c.receive(room, tokens)
    txs, forwards = [], []
    for m in c.pre:
        fwd = LayerForward(m, room, src, tokens)
        tx = KVSender(m, room)
        for pages, last_chunk in c.chunks(src, tokens, chunk_tokens):
            for layers in groups_of(num_layers, group_size):
                last = last_chunk and layers.stop == num_layers
                tx.send(
                    pages,
                    last_chunk=last,
                    aux=aux if last else b"",
                    ready=fwd.group(layers.start, layers.stop),
                    layers=layers,
                )
        txs.append(tx)
        forwards.append(fwd)
    return txs, rxs, dst, forwards


SHAPES = [
    pytest.param(1, 1, 8, id="p1-d1"),
    pytest.param(2, 1, 8, id="p2-d1"),
    pytest.param(1, 2, 8, id="p1-d2"),
    pytest.param(4, 1, 2, id="replicated-h2-p4-d1"),
]


@pytest.mark.parametrize("transport", ["local", "tcp"])
@pytest.mark.parametrize("p,d,h", SHAPES)
@pytest.mark.parametrize("group_size", [1, 3])
@pytest.mark.parametrize("path", ["auto", "staged"])
def test_layer_groups_x_token_chunks_are_byte_exact(p, d, h, transport, group_size, path):
    g = geometry(h, page_size=4, num_layers=NUM_LAYERS, num_pages=64)
    tokens, chunk = 22, 8  # 3 token chunks, the last one partial
    opts = {"data_path": path, **CALM}
    with Cluster(p, d, g, transport=transport, decode_opts=opts, prefill_opts=opts) as c:
        txs, rxs, dst, forwards = start_layerwise(c, 7, tokens, chunk, group_size)
        states = wait_terminal(txs + rxs)
        assert states == [KVPoll.Success] * (p + d), [x.failure_reason for x in txs + rxs]
        assert c.verify(7, dst, tokens) == []
        assert all(rx.aux_payload == b"aux" for rx in rxs)
        want = [(r.start, r.stop) for r in groups_of(NUM_LAYERS, group_size)] * 3
        writers = [f for m, f in zip(c.pre, forwards) if m.room(7).readers]  # a replica may write to no reader
        assert writers
        for f in writers:  # each read waits for its group's forward (once per reader and slot)
            order = [x for i, x in enumerate(f.synced) if i == 0 or f.synced[i - 1] != x]
            assert order == want, order
        # The same request again, whole (no layers): the pool is reused and still exact.
        txs, rxs, dst = c.start(8, tokens, chunk=chunk)
        assert wait_terminal(txs + rxs) == [KVPoll.Success] * (p + d)
        assert c.verify(8, dst, tokens) == []


@pytest.mark.parametrize("transport", ["local", "tcp"])
@pytest.mark.parametrize("p,layout", [(1, "NHD"), (2, "HND")])
@pytest.mark.parametrize("path", ["direct", "staged"])
def test_both_paths_are_taken_and_count_each_layer_once(p, layout, path, transport):
    """Direct page runs (P1 -> D1 NHD; P2 -> D1 HND head slices) and staged slots, layer by
    layer: the bytes each writer reports equal its share of the request once."""
    g = geometry(8, page_size=4, num_layers=NUM_LAYERS, layout=layout)
    opts = {"data_path": path, **CALM}
    with Cluster(p, 1, g, transport=transport, decode_opts=opts, prefill_opts=opts) as c:
        txs, rxs, dst, _ = start_layerwise(c, 9, 16, 8, 1)
        assert wait_terminal(txs + rxs) == [KVPoll.Success] * (p + 1), [x.failure_reason for x in txs + rxs]
        assert c.verify(9, dst, 16) == []
        plans = c.dec[0].room(9).plans
        for r, tx in enumerate(txs):
            assert tx.paths == {path: 1}
            assert tx.bytes_sent == plans[r].nbytes()
        assert rxs[0].stats["bytes"] == sum(pl.nbytes() for pl in plans.values())


@pytest.mark.parametrize("path", ["direct", "staged"])
def test_layer_groups_queued_behind_each_other_move_as_one(path):
    """Groups handed over before the decode's metadata came (a transfer that lags the
    forward) queue up; they move as one group: one notice, every forward waited for."""
    from sglang_kvxfer.protocol.messages import ChunkReady, TransferDone

    g = geometry(8, page_size=4, num_layers=NUM_LAYERS)
    opts = {"data_path": path, **CALM}
    with Cluster(1, 1, g, decode_opts=opts, prefill_opts=opts) as c:
        sent = []
        send = c.pre[0].control.send
        c.pre[0].control.send = lambda endpoint, msg: (sent.append(msg), send(endpoint, msg))[1]
        src, dst = c.pages(c.pre[0], 16), c.pages(c.dec[0], 16)
        fwd = LayerForward(c.pre[0], 31, src, 16)
        tx = KVSender(c.pre[0], 31)
        for layer in range(NUM_LAYERS):
            last = layer == NUM_LAYERS - 1
            tx.send(
                src,
                last_chunk=last,
                aux=b"x" if last else b"",
                ready=fwd.group(layer, layer + 1),
                layers=range(layer, layer + 1),
            )
        rx = KVReceiver(c.dec[0], 31)
        rx.send_metadata(dst, num_tokens=16)
        assert wait_terminal([tx, rx]) == [KVPoll.Success] * 2, [tx.failure_reason, rx.failure_reason]
        assert c.verify(31, dst, 16) == [] and rx.aux_payload == b"x"
        assert fwd.synced == [(i, i + 1) for i in range(NUM_LAYERS)]
        data = [m for m in sent if isinstance(m, (ChunkReady, TransferDone))]
        assert [type(m) for m in data] == [TransferDone], data
        if path == "staged":
            assert (data[0].last_layer_start, data[0].last_num_layers) == (0, NUM_LAYERS)


# -- the sender's checks ------------------------------------------------------------------------
def _sender(c, room=11, tokens=8):
    rx = KVReceiver(c.dec[0], room)
    src = c.pages(c.pre[0], tokens)
    rx.send_metadata(c.pages(c.dec[0], tokens), num_tokens=tokens)
    return KVSender(c.pre[0], room), src, rx


@pytest.fixture(scope="module")
def one_pair():
    with Cluster(1, 1, geometry(8, page_size=4, num_layers=NUM_LAYERS), prefill_opts=CALM, decode_opts=CALM) as c:
        yield c


def test_a_layer_group_sent_twice_is_refused_naming_both_ranges(one_pair):
    tx, src, rx = _sender(one_pair, 11)
    tx.send(src, layers=range(0, 2))
    with pytest.raises(ValueError, match=r"layers=range\(1, 3\) was already sent: layers \[0, 2\) .* start at layer 2"):
        tx.send(src, layers=range(1, 3))
    with pytest.raises(ValueError, match=r"layers=range\(3, 4\) skips layers: layers \[0, 2\) .* start at layer 2"):
        tx.send(src, layers=range(3, 4))
    tx.send(src, layers=range(2, 4), last_chunk=True)  # the refusals changed nothing
    assert wait_terminal([tx, rx]) == [KVPoll.Success] * 2


def test_layers_out_of_range_or_malformed_are_refused(one_pair):
    tx, src, rx = _sender(one_pair, 12)
    with pytest.raises(ValueError, match=r"layers=range\(2, 5\) is outside the model's layers \[0, 4\) \(num_layers\)"):
        tx.send(src, layers=range(2, 5))
    with pytest.raises(ValueError, match=r"layers=range\(0, 4, 2\) must be a non-empty range\(a, b\) with step 1"):
        tx.send(src, layers=range(0, 4, 2))
    with pytest.raises(ValueError, match=r"layers=\(0, 2\) must be a non-empty range"):
        tx.send(src, layers=(0, 2))
    with pytest.raises(ValueError, match=r"layers=range\(1, 2\) must start at 0: no token chunk is open"):
        tx.send(src, layers=range(1, 2))
    tx.abort("test over")


def test_declaring_the_request_complete_with_layers_missing_is_refused(one_pair):
    tx, src, rx = _sender(one_pair, 13)
    with pytest.raises(
        ValueError, match=r"last_chunk=True with layers=range\(0, 3\) leaves layers \[3, 4\) .*num_layers=4"
    ):
        tx.send(src, layers=range(0, 3), last_chunk=True)
    tx.send(src[:1], layers=range(0, 2))
    with pytest.raises(ValueError, match=r"layers=None \(every layer\) opens a new token chunk while layers \[2, 4\)"):
        tx.send(src[1:], last_chunk=True)
    with pytest.raises(ValueError, match=r"page_ids \(1 pages\) differ from the open token chunk's pages \(1\)"):
        tx.send(src[1:], layers=range(2, 4))
    tx.send(src[:1], layers=range(2, 4))
    tx.send(src[1:], last_chunk=True)
    assert wait_terminal([tx, rx]) == [KVPoll.Success] * 2


# -- the decode side's accounting -----------------------------------------------------------------
@pytest.mark.parametrize("path", ["direct", "staged"])
def test_a_writer_done_with_layers_missing_fails_the_request_with_the_reason(path):
    """A writer that skips the sender's checks (a bug, or another implementation) and ends
    the request after layers [0, 2): the decode refuses to count it done."""
    opts = {"data_path": path, **CALM}
    with Cluster(1, 1, geometry(8, page_size=4, num_layers=NUM_LAYERS), decode_opts=opts, prefill_opts=opts) as c:
        tx, src, rx = _sender(c, 21)
        c.pre[0].submit_chunk(tx._rec, Chunk(np.asarray(src), True, b"", None, (0, 2)))
        assert wait_terminal([rx]) == [KVPoll.Failed]
        if path == "staged":
            assert "prefill rank 0 sent TransferDone with layers [2, 3] incomplete: layer 2 has tokens [0, 0) of 8" in (
                rx.failure_reason
            )
        else:
            assert "prefill rank 0 sent TransferDone with total_bytes=6144; its share of the request is 12288 B" in (
                rx.failure_reason
            )


def test_a_layer_group_streamed_twice_fails_the_request_naming_the_layer():
    opts = {"data_path": "staged", **CALM}
    with Cluster(1, 1, geometry(8, page_size=4, num_layers=NUM_LAYERS), decode_opts=opts, prefill_opts=opts) as c:
        tx, src, rx = _sender(c, 22)
        c.pre[0].submit_chunk(tx._rec, Chunk(np.asarray(src), False, b"", None, (0, 2)))
        c.pre[0].submit_chunk(tx._rec, Chunk(np.asarray(src)[:0], True, b"", None, (1, 4)))
        assert wait_terminal([rx]) == [KVPoll.Failed]
        assert "tokens [0, 8) of layer 1, but layer 1 has tokens [0, 8) (a repeated or skipped chunk)" in (
            rx.failure_reason
        )


def test_a_stream_that_stops_mid_request_fails_by_its_deadline():
    """Layers [0, 2) go, the forward never finishes: both sides fail with the deadline."""
    opts = {"transfer_timeout_s": 1.0, **CALM}
    with Cluster(1, 1, geometry(8, page_size=4, num_layers=NUM_LAYERS), decode_opts=opts, prefill_opts=opts) as c:
        tx, src, rx = _sender(c, 23)
        tx.send(src, layers=range(0, 2))
        assert wait_terminal([rx, tx], timeout_s=15) == [KVPoll.Failed] * 2
        assert "timed out after 1" in rx.failure_reason and "Transferring" in rx.failure_reason


# -- the messages --------------------------------------------------------------------------------
def test_layer_ranges_round_trip_and_malformed_ones_are_refused_naming_the_field():
    import msgpack

    from sglang_kvxfer.errors import LocalProtocolError, RemoteProtocolError
    from sglang_kvxfer.protocol.codec import decode, encode
    from sglang_kvxfer.protocol.messages import ChunkReady, StagedChunk, TransferDone

    ready = ChunkReady(1, 0, 8, 4, 0, 256, layer_start=3, num_layers=2)
    done = TransferDone(1, 0, 512, 2, b"", {}, StagedChunk(8, 4, 256, 256), last_layer_start=30, last_num_layers=2)
    for msg in (ready, done):
        assert decode(encode(msg)) == msg
    got = decode(encode(done))
    assert (got.last_layer_start, got.last_num_layers) == (30, 2)
    with pytest.raises(LocalProtocolError, match=r"ChunkReady.layer_start.*=3 must be 0 when num_layers=0"):
        ChunkReady(1, 0, 8, 4, 0, 256, layer_start=3, num_layers=0)
    with pytest.raises(LocalProtocolError, match=r"TransferDone.last_num_layers.*=2 must be 0 without a last_chunk"):
        TransferDone(1, 0, 512, 2, b"", {}, None, last_layer_start=0, last_num_layers=2)
    version, tag, fields = msgpack.unpackb(encode(ready), raw=False)
    fields["layer_start"] = -1
    with pytest.raises(RemoteProtocolError, match=r"ChunkReady.layer_start=-1 is out of range"):
        decode(msgpack.packb([version, tag, fields], use_bin_type=True))
    del fields["layer_start"]
    with pytest.raises(RemoteProtocolError, match=r"missing field\(s\): layer_start"):
        decode(msgpack.packb([version, tag, fields], use_bin_type=True))
