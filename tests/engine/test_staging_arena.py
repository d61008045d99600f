"""The staging arena is allocated on first staged use and grows on demand up to its cap:
a rank that never stages holds no staging memory; a staged transfer takes only what it
uses; a grown arena's new segments are registered, exported to the writers and named in
``RequestMeta``, and the bytes still arrive intact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_kvxfer.engine import KVPoll, KVReceiver, KVSender, StagingArena
from sglang_kvxfer.engine import pool as pool_module
from sglang_kvxfer.engine.synthetic import fill_request
from sglang_kvxfer.errors import KVXferError

from .harness import Cluster, geometry, wait_terminal


class RecordingTransport:
    """``register_tensor`` / ``deregister`` of a transport, remembered."""

    def __init__(self):
        self.registered: list[tuple[int, int]] = []
        self.deregistered: list[object] = []

    def register_tensor(self, tensor):
        self.registered.append((tensor.data_ptr(), tensor.numel()))
        return f"region{len(self.registered)}"

    def deregister(self, region):
        self.deregistered.append(region)


def test_nothing_is_allocated_before_the_first_alloc():
    transport = RecordingTransport()
    arena = StagingArena(1 << 20, transport=transport, min_segment_bytes=4096)
    assert (arena.nbytes, arena.num_segments, arena.regions, transport.registered) == (0, 0, [], [])
    arena.close()
    assert transport.deregistered == []


def test_the_arena_grows_by_segments_up_to_its_cap():
    transport = RecordingTransport()
    arena = StagingArena(64 << 10, transport=transport, min_segment_bytes=4096)
    a = arena.alloc(3000)  # first segment: the floor of 4 KiB
    assert (a, arena.nbytes, arena.num_segments) == (0, 4096, 1)
    b = arena.alloc(3000)  # no room left: a second segment as large as all before
    assert (b, arena.nbytes, arena.num_segments) == (4096, 8192, 2)
    c = arena.alloc(20000)  # larger than all before: sized to the request
    assert (c, arena.num_segments) == (8192, 3) and arena.nbytes == 8192 + 20224
    assert arena.regions == ["region1", "region2", "region3"]
    assert [n for _, n in transport.registered] == [4096, 4096, 20224]
    # a window never spans two segments, and its view and location say which one
    assert arena.locate(b + 256) == ("region2", 256, 4096)
    arena.view(c, 20000).fill_(7)
    assert int(arena.view(c, 20000).sum()) == 7 * 20000
    with pytest.raises(ValueError, match="crosses the end of its segment"):
        arena.view(b, 5000)
    # the cap: 64 KiB; 28416 B held, 37120 B left, so 40 KiB cannot come now
    assert arena.alloc(40 << 10) is None and arena.num_segments == 3
    d = arena.alloc(30 << 10)  # fits under the cap
    assert d == 28416 and arena.nbytes == 28416 + (30 << 10)
    arena.free(a)
    assert arena.alloc(2000) == a  # freed windows are reused before anything grows
    assert arena.used_bytes == 256 * 12 + 256 * 8 + 20224 + (30 << 10)
    with pytest.raises(ValueError, match="staging offset 17 is not allocated"):
        arena.free(17)
    arena.close()
    assert transport.deregistered == ["region1", "region2", "region3", "region4"]


def test_a_failed_growth_names_the_cap(monkeypatch):
    def no_memory(nbytes, device, shared):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 KiB")

    monkeypatch.setattr(pool_module, "_alloc_bytes", no_memory)
    arena = StagingArena(1 << 20, min_segment_bytes=4096)
    with pytest.raises(KVXferError, match=r"cannot grow by 4096 B on cpu .*KVXFER_STAGING_BYTES.*out of memory"):
        arena.alloc(100)
    assert arena.nbytes == 0


def test_ranks_that_never_stage_allocate_no_staging_memory():
    # equal TP, HND layout: every pair is direct
    opts = {"data_path": "direct"}
    with Cluster(1, 1, geometry(8, layout="HND"), decode_opts=opts) as c:
        txs, rxs, dst = c.start(51, 37, chunk=8)
        assert wait_terminal(txs + rxs) == [KVPoll.Success] * 2, [h.failure_reason for h in txs + rxs]
        assert c.verify(51, dst, 37) == []
        assert txs[0].paths == {"direct": 1}
        for m in c.pre + c.dec:
            assert (m.staging.nbytes, m.staging.num_segments) == (0, 0), m.side


def test_staged_transfers_grow_the_reader_arena_and_name_each_segment(monkeypatch):
    # 4 KiB segments at first: a window of two 2 KiB slots fills one, so the concurrent
    # requests below need new segments, which must reach the writers before they write.
    monkeypatch.setattr(pool_module, "MIN_SEGMENT_BYTES", 4096)
    opts = {"staging_slot_bytes": 2048, "staging_bytes": 1 << 20, "data_path": "staged"}  # local would fuse
    with Cluster(2, 1, geometry(8, page_size=4), prefill_opts=opts, decode_opts=opts) as c:
        dec = c.dec[0]
        assert dec.staging.nbytes == 0  # registered with the prefill ranks, nothing allocated
        started = []
        for i, room in enumerate((61, 62, 63)):  # in flight together, on disjoint pages
            src, dst = np.arange(i * 10, i * 10 + 10), np.arange(63 - i * 10, 53 - i * 10, -1)
            rx = KVReceiver(dec, room)
            rx.send_metadata(dst, num_tokens=40)
            txs = []
            for m in c.pre:
                fill_request(m.placement, m.pool.buffers, room, src, 0, 40)
                txs.append(KVSender(m, room))
                txs[-1].send(src[:4])
            started.append((room, txs, rx, dst, src))
        for _, txs, _, _, src in started:
            for tx in txs:
                tx.send(src[4:], last_chunk=True)
        handles = [h for _, txs, rx, _, _ in started for h in txs + [rx]]
        assert wait_terminal(handles) == [KVPoll.Success] * len(handles), [h.failure_reason for h in handles]
        for room, txs, _, dst, _ in started:
            assert c.verify(room, dst, 40) == [], room
            assert all(tx.paths == {"staged": 1} for tx in txs)
        assert 0 < dec.staging.nbytes <= 1 << 20
        assert dec.staging.num_segments >= 2, dec.staging.nbytes
        assert dec.staging.used_bytes == 0  # every window came back
        # each writer imported the segments its windows named, once each
        imported = {d for m in c.pre for p in m._decode_peers.values() for d in p._staging}
        assert imported and imported <= {r.descriptor for r in dec.staging.regions}


def test_a_window_larger_than_the_cap_fails_the_request_with_the_cap():
    opts = {"staging_slot_bytes": 4096, "staging_bytes": 8192, "data_path": "staged"}  # local would fuse
    # a 4-head slice of 2 layers, K and V of 512 bf16 each: 16 KiB per token, so two slots
    # of one token each exceed the 8 KiB cap
    g = geometry(8, page_size=4, head_dim=512, v_head_dim=512)
    with Cluster(2, 1, g, decode_opts=opts, prefill_opts=opts) as c:
        txs, rxs, _ = c.start(71, 8)
        assert wait_terminal(txs + rxs)[-1] is KVPoll.Failed
        assert "may hold 8192 B (KVXFER_STAGING_BYTES)" in rxs[0].failure_reason
        assert c.dec[0].staging.nbytes == 0
