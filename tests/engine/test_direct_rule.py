"""The ``auto`` path rule by measured cost, end to end: the costs ``local`` and ``tcp``
declare pick the path of a P1 -> D1 pair (32 KiB pages: direct over ``local``; 256-byte
scattered pages, 1,600 of them: staged over ``tcp``), and a request through in-process managers on that
path lands every byte where the planning oracle puts it. ``KVXFER_DIRECT_MIN_OP_BYTES``
(``direct_min_op_bytes``) and ``KVXFER_DATA_PATH`` still override the rule."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from sglang_kvxfer.engine import BootstrapServer, EngineConfig, KVManager, KVPoll, KVReceiver, KVSender
from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.planning import RequestPlan, plan_pair, plan_tp
from sglang_kvxfer.planning.byteplan import PathCost
from sglang_kvxfer.transports import Transport, _memory, get_transport
from tests.planning.oracle import POISON, SENTINEL, empty_pool, full_kv, place_tokens

from .harness import FAST, wait_terminal

H, LAYERS, PAGES = 8, 2, 64
BIG = dict(page_size=16, head_dim=64, tokens=16 * 12 - 5)  # 32 KiB per page and buffer (float32)
# 256 B per page and buffer, 1,600 of them: tcp's entries (iovecs) cost more than staging them
TINY = dict(page_size=1, head_dim=8, tokens=400, pages=512)


def _geometry(shape):
    return KVGeometry(
        num_layers=LAYERS,
        total_kv_heads=H,
        head_dim=shape["head_dim"],
        dtype="float32",
        page_size=shape["page_size"],
        num_pages=shape.get("pages", PAGES),
    )


def _pages(shape, seed):
    rng = np.random.default_rng(seed)
    n = -(-shape["tokens"] // shape["page_size"])
    pages = shape.get("pages", PAGES)
    return rng.permutation(pages)[:n], rng.permutation(pages)[:n]


def _rule(shape, cost, **kw):
    """The planner's choice for the pair (P1 -> D1) under ``cost``."""
    g = _geometry(shape)
    src, dst = _pages(shape, seed=1)
    t = plan_tp(H, 1, 1).transfers[0]
    return plan_pair(t, g.placement(1, 0), g.placement(1, 0), src, dst, num_tokens=shape["tokens"], cost=cost, **kw)


def _cost(name, pinned_rate=None, monkeypatch=None):
    if pinned_rate is not None:  # what memmove_rate measured on a 2-vCPU VM, so the choice is fixed
        monkeypatch.setattr(_memory, "_rate", pinned_rate)
    t = get_transport(name)
    try:
        return t.path_cost("cpu")
    finally:
        t.close()


def run_p1_d1(shape, transport, **decode_opts):
    """One request P1 -> D1 through fresh managers; returns (decode record, problems, the
    pair's data path)."""
    g = _geometry(shape)
    tokens, ps = shape["tokens"], shape["page_size"]
    src, dst = _pages(shape, seed=1)
    k_full, v_full = full_kv(LAYERS, H, tokens, shape["head_dim"], shape["head_dim"], seed=5)
    records = []
    with BootstrapServer() as boot:
        pre = KVManager(EngineConfig("prefill", g, 1, 0, boot.address, transport, **FAST))
        try:
            dec = KVManager(EngineConfig("decode", g, 1, 0, boot.address, transport, **{**FAST, **decode_opts}))
            try:
                pre.wait_registered(10)
                dec.request_listeners.append(records.append)
                for buf in dec.pool.buffers:  # every byte not written must stay this
                    buf.fill_(SENTINEL)
                rx = KVReceiver(dec, 11)
                rx.send_metadata(dst, num_tokens=tokens)
                arrays = place_tokens(pre.placement, empty_pool(pre.placement, POISON), k_full, v_full, src, tokens)
                for buf, arr in zip(pre.pool.buffers, arrays):
                    buf.copy_(torch.from_numpy(arr))
                tx = KVSender(pre, 11)
                tx.send(src[: -(-tokens // ps)], last_chunk=True, aux=b"a")
                states = wait_terminal([tx, rx])
                assert states == [KVPoll.Success] * 2, [h.failure_reason for h in (tx, rx)]
                (path, _why), *_ = rx.paths.values()
                want = place_tokens(dec.placement, empty_pool(dec.placement), k_full, v_full, dst, tokens)
                problems = [
                    f"buffer {i} differs from the oracle"
                    for i, (buf, exp) in enumerate(zip(dec.pool.buffers, want))
                    if buf.numpy().tobytes() != exp.tobytes()
                ]
            finally:
                dec.close()
        finally:
            pre.close()
    assert len(records) == 1 and records[0].ok, records
    return records[0], problems, path


def _staged(record) -> bool:
    return "scatter" in record.phases  # only the staged path scatters on the reader


def test_local_declares_a_measured_cost_and_tcp_a_declared_one():
    local = _cost("local")
    assert "measured" in local.source
    for value in (local.per_op_s, local.bytes_per_s, local.copy_bytes_per_s):
        assert math.isfinite(value) and value > 0
    tcp = _cost("tcp")  # host entries as iovecs where libc's writev/readv load (here), else a view each
    assert "declared" in tcp.source and "iovecs" in tcp.source and tcp.per_op_s == 0.3e-6
    t = get_transport("local")
    try:
        assert "declared" in t.path_cost("cuda:0").source  # no CUDA needed to read the declaration
        with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"):
            t.path_cost("tpu")
        # a backend that declares nothing (nixl, mori today): None, the planner's fixed rule
        assert Transport.path_cost(t, "cpu") is None
    finally:
        t.close()


def test_local_sends_32k_pages_direct_and_the_bytes_land(monkeypatch):
    cost = _cost("local", (1e-6, 8e9), monkeypatch)
    assert cost == PathCost(1e-6, 8e9, 8e9, source=cost.source)
    plan = _rule(BIG, cost)
    assert plan.path == "direct", plan.reason
    assert "local cost, measured" in plan.reason and "<= staged" in plan.reason
    record, problems, path = run_p1_d1(BIG, "local", data_path=str(plan.path))
    assert problems == [] and not _staged(record) and path == "direct", record.phases


def test_tcp_stages_tiny_scattered_pages_and_the_bytes_land():
    plan = _rule(TINY, _cost("tcp"))
    assert plan.path == "staged", plan.reason
    assert "256 B per op" in plan.reason and "tcp cost, declared" in plan.reason
    record, problems, path = run_p1_d1(TINY, "tcp", data_path=str(plan.path))
    assert problems == [] and _staged(record) and path == "staged", record.phases


@pytest.mark.parametrize("min_op, staged", [(64 << 10, True), (4 << 10, False)])
def test_direct_min_op_bytes_overrides_the_rule_through_the_engine(monkeypatch, min_op, staged):
    """An explicit threshold decides however cheap the transport's ops are. What it would
    stage goes fused here: the decode's pool is shared memory, mapped in the prefill's
    process, and one pass replaces gather + scatter (the fixed rule weighs no cost)."""
    cost = _cost("local", (1e-6, 8e9), monkeypatch)
    assert _rule(BIG, cost).path == "direct"
    assert (_rule(BIG, cost, direct_min_op_bytes=min_op).path == "staged") is staged
    record, problems, path = run_p1_d1(BIG, "local", data_path="auto", direct_min_op_bytes=min_op)
    assert problems == [] and not _staged(record), record.phases
    assert path == ("fused" if staged else "direct")


def test_data_path_overrides_the_rule_through_the_engine(monkeypatch):
    cost = _cost("local", (1e-6, 8e9), monkeypatch)
    assert _rule(BIG, cost).path == "direct"
    assert _rule(BIG, cost, path="staged").path == "staged"
    monkeypatch.setenv("KVXFER_DATA_PATH", "staged")
    record, problems, path = run_p1_d1(BIG, "local")  # EngineConfig takes data_path from the env var
    assert problems == [] and _staged(record) and path == "staged", record.phases


@pytest.mark.parametrize("tokens, path", [(12, "per_token"), (200, "staged")])
def test_tcp_writes_a_strided_head_slice_row_by_row_when_its_rows_cost_less_than_staging(tokens, path):
    """P2 -> D1 on NHD pools: each writer's 4 of 8 heads are a strided slice, never direct.
    Over ``tcp``, whose entries are iovecs, ``auto`` weighs one write per token row against
    staging: 12 tokens (48 rows of 64 B) go row by row (no staging window, no ChunkReady hop),
    200 tokens (800 rows) are staged. The decode decides, each prefill rank follows, and every
    byte lands where the oracle puts it."""
    from .harness import Cluster, geometry

    g = geometry(h=8)
    t = plan_tp(8, 2, 1).transfers[0]
    src, dst = np.arange(-(-tokens // 4)), np.arange(-(-tokens // 4))
    plan = RequestPlan.build(
        t, g.placement(2, t.prefill_rank), g.placement(1, 0), src, dst, num_tokens=tokens, cost=_cost("tcp")
    )
    assert plan.path == path, plan.reason
    assert ("written row by row instead" in plan.reason) is (path == "per_token"), plan.reason
    # the same costs from a transport that does not declare cheap row writes: staged
    no_rows = dataclasses.replace(_cost("tcp"), row_writes=False)
    kept = RequestPlan.build(
        t, g.placement(2, t.prefill_rank), g.placement(1, 0), src, dst, num_tokens=tokens, cost=no_rows
    )
    assert kept.path == "staged", kept.reason
    with Cluster(2, 1, g, transport="tcp") as c:
        txs, rxs, dst_pages = c.start(1, tokens)
        assert wait_terminal(txs + rxs) == [KVPoll.Success] * 3, [h.failure_reason for h in txs + rxs]
        assert c.verify(1, dst_pages, tokens) == []
        assert [tx.paths for tx in txs] == [{path: 1}] * 2
