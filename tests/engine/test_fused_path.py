"""The fused data path end to end: a prefill TP group in its own process writes the decode
ranks' shared-memory pools (mapped in its process by ``local``) with one pool -> pool copy
per chunk; the decode ranks live in the test process, so every byte of their pools is
compared with what they must hold: the requests' rows where the oracle puts them, sentinel
bytes everywhere else (nothing outside the destination rows is written).

Covered: P1 -> D1, P2 -> D1, P1 -> D2, replicated heads (H=2, P1 -> D8), MLA, page sizes and
NHD/HND differing between the sides, chunked and layer-wise sends; the fallback where the
decode's pool is not mapped in the prefill's process (``tcp``, private memory written with
``process_vm_writev``), with the plan's reason; a reader that dies mid-request; and fan-out
on the staged path (a replicated head slice is gathered once and written to each reader:
the record's ``pool_read_bytes`` counts the distinct slices only).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from sglang_kvxfer.cluster.group import RankGroup, make_spec
from sglang_kvxfer.cluster.workload import make_requests
from sglang_kvxfer.engine import BootstrapServer, EngineConfig, KVManager, KVPoll, KVReceiver, KVSender
from sglang_kvxfer.engine.pool import KVPool
from sglang_kvxfer.engine.synthetic import fill_request
from sglang_kvxfer.errors import TransportError

from .harness import FAST, geometry, wait_terminal

SENTINEL = 0xA5  # every decode byte no request writes keeps this
TIMEOUT_S = 60.0
# A starved 2-core host can stall a process past the harness's 2 s heartbeat timeout; these
# tests are about the bytes (the dead-reader test relies on the reader's exit, not silence).
OPTS = {**{k: v for k, v in FAST.items() if k != "num_workers"}, "heartbeat_timeout_s": 10.0}


class Decodes:
    """In-process decode ranks whose pools start as sentinel bytes, and the pools they must
    hold after each request (``expected``)."""

    def __init__(self, boot, g, d, transport="local", shared=True, **opts):
        self.mgrs: list[KVManager] = []
        try:
            for r in range(d):
                config = EngineConfig("decode", g, d, r, boot.address, transport, **{**OPTS, **opts})
                pool = None if shared else KVPool.allocate(config.placement, "cpu", shared=False)
                self.mgrs.append(KVManager(config, pool))
        except BaseException:
            self.close()
            raise
        for m in self.mgrs:
            for buf in m.pool.buffers:
                buf.view(torch.uint8).fill_(SENTINEL)
        self.expected = [[buf.clone() for buf in m.pool.buffers] for m in self.mgrs]
        self.rng = np.random.default_rng(7)

    def receive(self, room: int, tokens: int) -> tuple[list[KVReceiver], np.ndarray]:
        g = self.mgrs[0].config.geometry
        dst = self.rng.permutation(g.num_pages)[: -(-tokens // g.page_size)]
        rxs = [KVReceiver(m, room) for m in self.mgrs]
        for rx in rxs:
            rx.send_metadata(dst, num_tokens=tokens)
        for m, want in zip(self.mgrs, self.expected):
            fill_request(m.placement, want, room, dst, 0, tokens)
        return rxs, dst

    def problems(self) -> list[str]:
        """Every buffer that differs from its expected bytes, with the first bad byte."""
        out = []
        for r, (m, want) in enumerate(zip(self.mgrs, self.expected)):
            for b, (got, exp) in enumerate(zip(m.pool.buffers, want)):
                g8, e8 = got.view(torch.uint8).reshape(-1), exp.view(torch.uint8).reshape(-1)
                if not torch.equal(g8, e8):
                    i = int(torch.nonzero(g8 != e8)[0])
                    what = "a sentinel byte overwritten" if int(e8[i]) == SENTINEL else "a wrong byte"
                    out.append(f"decode rank {r} buffer {b} byte {i}: {int(g8[i])}, expected {int(e8[i])} ({what})")
        return out

    def close(self):
        for m in self.mgrs:
            m.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def prefill_group(boot, g, p, transport="local"):
    """The prefill TP group in one process of its own (every rank its own manager and pool)."""
    return RankGroup(make_spec("prefill", g, p, boot.address, transport, options=OPTS), one_process=True)


def transfer(pre, decs, room, tokens, page, chunk=0, layer_group=0):
    """One request: the prefill process fills and sends its pages (``page`` tokens each, in
    chunks of ``chunk`` tokens, each in groups of ``layer_group`` layers), the decode ranks
    receive. Returns the prefill ranks' results and the receivers."""
    (job,) = make_requests(1, [tokens], chunk, page, seed=room)
    job.update(room=room, layer_group=layer_group)
    fut = pre.submit(job)
    rxs, _ = decs.receive(room, tokens)
    wait_terminal(rxs, TIMEOUT_S)
    return fut.result(TIMEOUT_S), rxs


def _open(boot, gp, gd, p, d, transport="local", **decode_opts):
    pre = prefill_group(boot, gp, p, transport)
    try:
        decs = Decodes(boot, gd, d, transport, **decode_opts)
    except BaseException:
        pre.close()
        raise
    return pre, decs


def kv_bytes(g, tokens, heads) -> int:
    """Bytes of ``heads`` heads of ``tokens`` tokens in every layer, K and V."""
    return g.num_layers * tokens * heads * (g.head_dim + (g.v_head_dim or 0)) * g.itemsize


# (H, P, D, MLA, (prefill page, layout), (decode page, layout), chunk tokens, layer group, forced path)
CASES = {
    "p1-d1": (8, 1, 1, False, (4, "NHD"), (4, "NHD"), 16, 0, "fused"),  # auto: a few direct runs win
    "p2-d1-nhd-hnd": (8, 2, 1, False, (4, "NHD"), (8, "HND"), 16, 0, "auto"),
    "p1-d2-hnd-nhd": (8, 1, 2, False, (8, "HND"), (4, "NHD"), 0, 0, "auto"),
    "h2-p1-d8": (2, 1, 8, False, (4, "NHD"), (4, "NHD"), 16, 0, "auto"),
    "mla-p1-d2": (1, 1, 2, True, (4, "NHD"), (8, "HND"), 16, 0, "fused"),  # MLA rows are contiguous: direct
    "p2-d1-layerwise": (8, 2, 1, False, (4, "NHD"), (16, "NHD"), 16, 2, "auto"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_transfers_write_exactly_the_destination_rows(name):
    h, p, d, mla, (ps, lp), (pd, ld), chunk, group, path = CASES[name]
    dims = dict(head_dim=24 if mla else 16, num_layers=3)
    gp = geometry(h, mla=mla, page_size=ps, layout=lp, num_pages=96, **dims)
    gd = geometry(h, mla=mla, page_size=pd, layout=ld, num_pages=96, **dims)
    with BootstrapServer() as boot:
        pre, decs = _open(boot, gp, gd, p, d, data_path=path)
        with pre, decs:
            for room, tokens in ((101, 37), (102, 128)):
                results, rxs = transfer(pre, decs, room, tokens, ps, chunk, group)
                assert [rx.poll() for rx in rxs] == [KVPoll.Success] * d, [rx.failure_reason for rx in rxs]
                for res in results:
                    assert res["ok"], res["reason"]
                    readers = sum(res["paths"].values())
                    assert res["paths"] == {"fused": readers}
                    record = res["record"]
                    # one copy per reader: each reads its slice of the pool (fan-out is a copy each)
                    assert record["pool_read_bytes"] == record["bytes"] == res["bytes"]
                for rx in rxs:
                    for taken, why in rx.paths.values():
                        assert taken == "fused", why
                        want = "forced by path='fused'" if path == "fused" else "fused, the reader's pool is mapped"
                        assert why.startswith(want), why
                        assert "local maps its 1 KV region(s) on cpu" in why
                total = sum(res["bytes"] for res in results)
                assert total == kv_bytes(gp, tokens, max(h, d) if not mla else d)
                assert decs.problems() == []


def _staged_reasons(rxs) -> list[str]:
    return [why for rx in rxs for taken, why in rx.paths.values() if taken != "fused"]


def test_over_tcp_nothing_is_mapped_and_the_plan_says_why():
    g = geometry(8, page_size=4, num_pages=96)
    with BootstrapServer() as boot:
        pre, decs = _open(boot, g, g, 2, 1, "tcp")
        with pre, decs:
            results, rxs = transfer(pre, decs, 201, 50, g.page_size, chunk=16)
            assert all(r["ok"] for r in results) and rxs[0].poll() is KVPoll.Success
            # 50 tokens of a strided head slice: 200 rows cost less than staging them over tcp
            assert [r["paths"] for r in results] == [{"per_token": 1}, {"per_token": 1}]
            for why in _staged_reasons(rxs):
                assert "not fused: transport 'tcp' does not map region 0 of the reader's KV pool" in why, why
                assert "written row by row instead" in why, why
            assert decs.problems() == []
    with BootstrapServer() as boot:
        pre, decs = _open(boot, g, g, 2, 1, "tcp", data_path="fused")
        with pre, decs:
            results, rxs = transfer(pre, decs, 202, 50, g.page_size, chunk=16)
            assert [r["paths"] for r in results] == [{"staged": 1}, {"staged": 1}]
            for why in _staged_reasons(rxs):
                assert why.startswith("path='fused' but not fused (transport 'tcp' does not map region 0"), why
            assert decs.problems() == []


def test_a_private_decode_pool_is_written_through_the_transport_and_the_plan_says_why():
    g = geometry(8, page_size=4, num_pages=96)
    with BootstrapServer() as boot:
        with prefill_group(boot, g, 2) as pre:
            try:
                decs = Decodes(boot, g, 1, shared=False)
            except TransportError as exc:  # a host that forbids process_vm_writev
                pytest.skip(f"private pools cannot be written by a peer here: {exc}")
            with decs:
                results, rxs = transfer(pre, decs, 301, 50, g.page_size, chunk=16)
                assert all(r["ok"] for r in results), [r["reason"] for r in results]
                assert [r["paths"] for r in results] == [{"staged": 1}, {"staged": 1}]
                for why in _staged_reasons(rxs):
                    assert "not fused: transport 'local' does not map region 0 of the reader's KV pool" in why
                assert decs.problems() == []


def test_a_reader_that_dies_mid_request_fails_the_room_with_the_reason():
    g = geometry(8, page_size=4, num_pages=128)
    tokens = 96
    with BootstrapServer() as boot:
        pre = KVManager(EngineConfig("prefill", g, 1, 0, boot.address, "local", **OPTS))
        try:
            pre.wait_registered(10)
            spec = make_spec("decode", g, 2, boot.address, "local", options=OPTS)
            with RankGroup(spec, one_process=True) as dec:  # the two readers share one process
                (job,) = make_requests(1, [tokens], 0, g.page_size, seed=5)
                fut = dec.submit(job)
                src = np.random.default_rng(1).permutation(g.num_pages)[: tokens // g.page_size]
                fill_request(pre.placement, pre.pool.buffers, job["room"], src, 0, tokens)
                tx = KVSender(pre, job["room"])
                tx.send(src[:8])  # the first 32 tokens
                wait_for(lambda: tx.bytes_sent > 0, "the first chunk")
                assert tx.paths == {"fused": 2}  # H=8 P1 -> D2: strided source slices, both fused
                dec.kill_rank(0)
                fut.result(TIMEOUT_S)  # the group noticed the death
                tx.send(src[8:], last_chunk=True)
                assert wait_terminal([tx], TIMEOUT_S) == [KVPoll.Failed]
                assert "has exited" in tx.failure_reason, tx.failure_reason
                assert not tx.record.ok and tx.record.failure_kind == "peer_gone"
        finally:
            pre.close()


def wait_for(predicate, what: str, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.005)


@pytest.mark.parametrize("transport, path, group", [("local", "staged", 0), ("local", "staged", 2), ("tcp", "auto", 0)])
def test_a_replicated_head_is_gathered_once_and_written_to_each_reader(transport, path, group):
    """H=2, P1 -> D8: decode ranks 0-3 hold head 0, 4-7 head 1. On the staged path the
    prefill gathers each head once per slot and writes that staging to its four readers."""
    g = geometry(2, page_size=4, num_pages=96, num_layers=3)
    tokens = 70
    with BootstrapServer() as boot:
        pre, decs = _open(boot, g, g, 1, 8, transport, data_path=path)
        with pre, decs:
            (res,), rxs = transfer(pre, decs, 401, tokens, g.page_size, chunk=32, layer_group=group)
            assert res["ok"], res["reason"]
            assert [rx.poll() for rx in rxs] == [KVPoll.Success] * 8, [rx.failure_reason for rx in rxs]
            assert res["paths"] == {"staged": 8}
            record = res["record"]
            assert record["bytes"] == 8 * kv_bytes(g, tokens, 1)  # every reader got its head
            assert record["pool_read_bytes"] == kv_bytes(g, tokens, 2)  # the distinct slices, once
            assert decs.problems() == []
