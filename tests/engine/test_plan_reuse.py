"""The data path plans once per (request, writer, reader): staged slots and decode scatters
cut slices of one ``RequestPlan``; nothing calls ``plan_pair`` per slot."""

from __future__ import annotations

from sglang_kvxfer.engine import KVPoll
from sglang_kvxfer.planning import byteplan, request_plan
from tests.engine.harness import Cluster, geometry, wait_terminal


def test_staged_slots_reuse_one_plan_per_reader(monkeypatch):
    counts = {"plan_pair": 0, "build": 0, "extend": 0, "gather_slice": 0, "scatter_slice": 0}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(byteplan, "plan_pair", counting("plan_pair", byteplan.plan_pair))
    RP = request_plan.RequestPlan
    monkeypatch.setattr(RP, "build", classmethod(counting("build", RP.build.__func__)))
    for name in ("extend", "gather_slice", "scatter_slice"):
        monkeypatch.setattr(RP, name, counting(name, getattr(RP, name)))
    g = geometry(8, page_size=4, num_pages=256)
    opts = {"staging_slot_bytes": 4096, "staging_bytes": 1 << 16, "data_path": "staged"}  # auto would fuse
    with Cluster(2, 1, g, decode_opts=opts) as c:
        txs, rxs, dst = c.start(41, 400, chunk=64)  # 7 chunks, ~38 slots per writer
        assert wait_terminal(txs + rxs) == [KVPoll.Success] * 3
        assert c.verify(41, dst, 400) == []
    per_token = 2 * 4 * (16 + 8) * 2
    slots = 2 * -(-400 // (4096 // per_token))  # at least this many per writer, 2 writers
    assert counts["plan_pair"] == 0
    assert counts["build"] == 2 + 2  # decode: one per writer; prefill: one per reader
    assert counts["extend"] == 2 * 6  # each later chunk extends each prefill plan once
    assert counts["gather_slice"] >= slots and counts["scatter_slice"] == counts["gather_slice"]
