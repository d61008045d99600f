"""Sparse writers (protocol 14): a prefill rank that holds only some of a request's pages
(SGLang's KV cache sharding: logical page ``l`` lives on shard ``l % N`` as its local page
``l // N``) writes those at the positions of the decode's page list it names
(``KVSender.send(positions=)``), and says which in its ``TransferDone``. Each shard is a
prefill group of its own here, the decode one manager per shard over the same pool, as the
SGLang plugin runs it. Every test compares every byte the decode holds."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from sglang_kvxfer.engine import BootstrapServer, EngineConfig, KVManager, KVPoll, KVReceiver, KVSender
from sglang_kvxfer.engine.pool import KVPool
from sglang_kvxfer.engine.synthetic import fill_request, verify_request
from tests.engine.harness import FAST, geometry, wait_terminal

PAGE = 4


class Shards:
    """``n`` prefill groups of TP ``p`` (one per shard, each with its bootstrap) and a decode
    of TP ``d`` with one manager per shard and rank, the shards' managers over one pool."""

    def __init__(self, stack: contextlib.ExitStack, n: int, p: int, d: int, gp, gd=None, transport="local"):
        gd = gd or gp
        self.n, self.gp = n, gp
        self.boots = [stack.enter_context(_closing(BootstrapServer())) for _ in range(n)]
        self.pre = [
            [self._mgr(stack, "prefill", gp, p, r, boot.address, transport) for r in range(p)] for boot in self.boots
        ]
        self.dec: list[list[KVManager]] = []
        for boot in self.boots:
            pools = [None] * d if not self.dec else [KVPool.wrap(m.placement, m.pool.buffers) for m in self.dec[0]]
            self.dec.append([self._mgr(stack, "decode", gd, d, r, boot.address, transport, pools[r]) for r in range(d)])
        for group in self.pre:
            for m in group:
                m.wait_registered(10)

    @staticmethod
    def _mgr(stack, role, g, size, rank, address, transport, pool=None):
        return stack.enter_context(
            _closing(KVManager(EngineConfig(role, g, size, rank, address, transport, **FAST), pool))
        )

    def fill(self, room: int, logical: np.ndarray, tokens: int) -> None:
        """Each shard's pools hold the request's KV in the local pages of the logical pages
        it owns (and zeros elsewhere)."""
        for s, group in enumerate(self.pre):
            for m in group:
                for pos in np.flatnonzero(logical % self.n == s):
                    a = int(pos) * PAGE
                    fill_request(m.placement, m.pool.buffers, room, logical // self.n, a, min(PAGE, tokens - a))

    def senders(self, room: int, logical: np.ndarray, tokens: int, chunk_pages: int):
        """SGLang's call order on every shard rank: chunks of ``chunk_pages`` logical pages,
        each narrowed to the shard's own (``filter_kv_indices_for_shard_rank``)."""
        txs = []
        for s, group in enumerate(self.pre):
            for m in group:
                tx = KVSender(m, room)
                for a in range(0, len(logical), chunk_pages):
                    part = logical[a : a + chunk_pages]
                    mine = part % self.n == s
                    last = a + chunk_pages >= len(logical)
                    pos = np.arange(a, a + len(part))[mine]
                    if pos.size or last:  # an empty chunk that is not the last is skipped
                        tx.send(part[mine] // self.n, last_chunk=last, aux=b"aux" if last else b"", positions=pos)
                txs.append(tx)
        return txs

    def run(self, room: int, logical: np.ndarray, dst: np.ndarray, tokens: int, chunk_pages: int):
        """Fill the shards, post every decode manager's sparse metadata, send in SGLang's
        order and wait: (senders, receivers by shard and decode rank)."""
        self.fill(room, logical, tokens)
        rxs = [[KVReceiver(m, room) for m in group] for group in self.dec]
        for group in rxs:
            for rx in group:
                rx.send_metadata(dst, num_tokens=tokens, sparse=True)
        txs = self.senders(room, logical, tokens, chunk_pages)
        handles = txs + [rx for group in rxs for rx in group]
        assert wait_terminal(handles) == [KVPoll.Success] * len(handles)
        return txs, rxs


@contextlib.contextmanager
def _closing(obj):
    try:
        yield obj
    finally:
        obj.close()


def _logical(n_pages: int, shards: int, seed: int = 0) -> np.ndarray:
    """A request's logical page ids as SGLang's interleaved allocator might hand them out:
    distinct, owners in any order (correctness must not assume a cycle)."""
    return np.random.default_rng(seed).permutation(64 * shards)[:n_pages]


@pytest.mark.parametrize("n,p,d", [(2, 1, 1), (2, 2, 1), (2, 1, 2), (3, 2, 2)])
@pytest.mark.parametrize("chunk_pages", [2, 100])
def test_each_shard_writes_its_pages_and_every_decode_byte_is_exact(n, p, d, chunk_pages):
    gp = geometry(page_size=PAGE, num_pages=64)
    with contextlib.ExitStack() as stack:
        c = Shards(stack, n, p, d, gp)
        room, tokens = 5, 37  # 10 pages, the last one partial
        logical = _logical(-(-tokens // PAGE), n)
        dst = np.random.default_rng(1).permutation(64)[: len(logical)]
        txs, rxs = c.run(room, logical, dst, tokens, chunk_pages)
        # the decode's one pool holds every page of the request, each from its shard
        for m in c.dec[0]:
            assert verify_request(m.placement, m.pool.buffers, room, dst, tokens) == []
        for s, group in enumerate(rxs):
            want = np.flatnonzero(logical % n == s)
            for rx in group:
                assert rx.positions is not None and rx.positions.tolist() == want.tolist()
                assert rx.aux_payload == b"aux"
        # each prefill rank sent only its shard's share of the bytes
        token_bytes = gp.num_layers * (gp.head_dim + gp.v_head_dim) * gp.itemsize * gp.total_kv_heads
        sent = sum(tx.bytes_sent for tx in txs)
        assert sent == token_bytes * tokens


def test_a_shard_that_owns_none_of_a_short_request_ends_it_with_the_aux_data_only():
    gp = geometry(page_size=PAGE)
    with contextlib.ExitStack() as stack:
        c = Shards(stack, 2, 1, 1, gp)
        room, tokens = 8, 6
        logical = np.array([10, 4])  # both pages on shard 0
        dst = np.array([3, 9])
        txs, (rx0, rx1) = c.run(room, logical, dst, tokens, chunk_pages=1)
        rxs = [rx0[0], rx1[0]]
        assert txs[1].bytes_sent == 0 and rxs[1].positions.tolist() == []
        assert rxs[0].positions.tolist() == [0, 1]
        assert verify_request(c.dec[0][0].placement, c.dec[0][0].pool.buffers, room, dst, tokens) == []


def test_a_sparse_request_between_strided_head_slices_goes_row_by_row_over_tcp():
    """TP 2 -> TP 1 on NHD pools: each prefill rank's heads are a strided slice of the
    decode's rows, which staging would handle; a sparse room cannot be staged, so the pair
    is written row by row."""
    gp = geometry(page_size=PAGE, num_pages=64)
    with contextlib.ExitStack() as stack:
        c = Shards(stack, 2, 2, 1, gp, transport="tcp")
        room, tokens = 12, 30
        logical = _logical(-(-tokens // PAGE), 2, seed=3)
        dst = np.random.default_rng(4).permutation(64)[: len(logical)]
        _, rxs = c.run(room, logical, dst, tokens, chunk_pages=3)
        assert verify_request(c.dec[0][0].placement, c.dec[0][0].pool.buffers, room, dst, tokens) == []
        assert all(path == "per_token" for group in rxs for rx in group for path, _ in rx.paths.values())


@pytest.mark.parametrize(
    "sparse, positions, reason",
    [(False, [1], "RequestMeta.sparse=False"), (True, None, "without positions")],
    ids=["positions-to-a-whole-list-decode", "no-positions-to-a-sparse-decode"],
)
def test_a_writer_and_a_decode_that_disagree_on_sparse_writes_fail_both_sides_naming_it(sparse, positions, reason):
    gp = geometry(page_size=PAGE)
    with contextlib.ExitStack() as stack:
        c = Shards(stack, 1, 1, 1, gp)
        rx = KVReceiver(c.dec[0][0], 3)
        rx.send_metadata([1, 2], num_tokens=8, sparse=sparse)
        tx = KVSender(c.pre[0][0], 3)
        tx.send([5], positions=positions, last_chunk=True)
        assert wait_terminal([tx, rx]) == [KVPoll.Failed, KVPoll.Failed]
        for h in (tx, rx):
            assert reason in h.failure_reason


def test_writers_of_one_room_that_name_different_pages_fail_the_decode():
    """TP 2 -> 1: both prefill ranks write their heads of the same shard's pages; one that
    names other pages would leave heads of some pages unwritten."""
    gp = geometry(page_size=PAGE)
    with contextlib.ExitStack() as stack:
        c = Shards(stack, 1, 2, 1, gp)
        rx = KVReceiver(c.dec[0][0], 6)
        rx.send_metadata([1, 2, 3], num_tokens=12, sparse=True)
        a, b = (KVSender(m, 6) for m in c.pre[0])
        a.send([7, 8], positions=[0, 2], last_chunk=True)
        b.send([7, 8], positions=[0, 1], last_chunk=True)
        assert wait_terminal([rx]) == [KVPoll.Failed]
        assert "the writers of the room wrote different pages" in rx.failure_reason


def test_send_checks_positions_before_anything_is_handed_over():
    gp = geometry(page_size=PAGE)
    with contextlib.ExitStack() as stack:
        c = Shards(stack, 1, 1, 1, gp)
        tx = KVSender(c.pre[0][0], 2)
        with pytest.raises(ValueError, match="positions has 1 entries for 2 page_ids"):
            tx.send([1, 2], positions=[0])
        with pytest.raises(ValueError, match=r"positions must increase: positions\[0\]=3, positions\[1\]=3"):
            tx.send([1, 2], positions=[3, 3])
        with pytest.raises(ValueError, match="cannot go with layers"):
            tx.send([1], positions=[0], layers=range(0, 1))
        tx.send([1], positions=[4])
        with pytest.raises(ValueError, match=r"positions\[0\]=2 must be >= 5"):
            tx.send([2], positions=[2])
        rx = KVReceiver(c.dec[0][0], 2)
        with pytest.raises(ValueError, match="sparse=True takes every token"):
            rx.send_metadata([1, 2], num_tokens=8, token_stride=2, sparse=True)
