"""Packed K-and-V pools (vLLM's caches: NHD_KV, the GPU layout LBNHC with one ``[num_blocks,
block_size, heads, head_dim + v_head_dim]`` tensor per layer, and HND_KV, the CPU layout with
one ``[num_blocks, heads, block_size, 2 * head_dim]`` tensor per layer) end to end through
in-process prefill/decode managers, on CPU tensors: TP 2 -> 1 and 1 -> 2, each packing to
itself (direct and staged), to and from NHD, HND and the other packing, equal and different
page sizes, over ``local`` and ``tcp``. Packed prefill pools are wrapped around vLLM-shaped
tensors, as a vLLM connector hands them over. Every decode pool is compared byte for byte,
untouched pages included, with the planning oracle's placement of the same full KV."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_kvxfer.engine import BootstrapServer, EngineConfig, KVManager, KVPoll, KVReceiver, KVSender
from sglang_kvxfer.engine.pool import KVPool
from sglang_kvxfer.geometry import KVGeometry, Layout
from tests.planning.oracle import POISON, SENTINEL, empty_pool, full_kv, place_tokens

from .harness import FAST, wait_terminal

H, LAYERS, DIM, TOKENS, CHUNK = 4, 2, 8, 37, 8

# (prefill TP, decode TP, prefill layout, decode layout, prefill page, decode page)
CASES = [
    (2, 2, "NHD_KV", "NHD_KV", 4, 4),
    (2, 2, "NHD_KV", "NHD_KV", 4, 8),
    (2, 1, "NHD_KV", "NHD_KV", 4, 4),
    (1, 2, "NHD_KV", "NHD_KV", 8, 4),
    (2, 1, "NHD_KV", "NHD", 4, 4),
    (1, 2, "NHD_KV", "NHD", 4, 2),
    (2, 1, "NHD", "NHD_KV", 4, 4),
    (1, 2, "HND", "NHD_KV", 2, 4),
    (2, 2, "NHD_KV", "HND_KV", 4, 4),
    (1, 1, "HND_KV", "NHD_KV", 4, 8),
    (2, 1, "HND_KV", "HND_KV", 4, 4),
    (2, 1, "HND_KV", "HND_KV", 4, 8),
    (1, 2, "HND_KV", "HND_KV", 4, 4),
    (1, 2, "HND_KV", "HND_KV", 8, 4),
    (2, 1, "HND_KV", "NHD", 4, 4),
    (1, 2, "HND_KV", "NHD", 4, 2),
    (2, 1, "NHD", "HND_KV", 4, 4),
    (1, 2, "NHD", "HND_KV", 2, 4),
    (2, 2, "HND_KV", "HND", 4, 4),
    (1, 1, "HND", "HND_KV", 4, 8),
]


def _geometry(layout, page_size):
    return KVGeometry(
        num_layers=LAYERS,
        total_kv_heads=H,
        head_dim=DIM,
        dtype="float32",
        page_size=page_size,
        layout=layout,
        num_pages=24,
    )


def _vllm_pool(geometry, tp, rank):
    """A pool over per-layer tensors as vLLM's connector sees them: the CPU cache for HND_KV,
    and for NHD_KV the logical ``[blocks, heads, block_size, 2 * head_dim]`` view over
    token-major storage, turned contiguous."""
    place = geometry.placement(tp, rank)
    g, heads = geometry, place.num_local_heads
    if g.layout is Layout.HND_KV:  # vLLM's CPU cache
        caches = [torch.zeros(g.num_pages, heads, g.page_size, 2 * DIM) for _ in range(LAYERS)]
    else:
        store = [torch.zeros(g.num_pages, g.page_size, heads, 2 * DIM) for _ in range(LAYERS)]
        caches = [s.permute(0, 2, 1, 3).permute(0, 2, 1, 3) for s in store]  # logical view and back
    pool = KVPool.wrap(place, caches)
    assert [b.data_ptr() for b in pool.buffers] == [c.data_ptr() for c in caches]
    return pool


def _managers(boot, role, geometry, tp, transport, opts):
    out = []
    try:
        for r in range(tp):
            config = EngineConfig(role, geometry, tp, r, boot.address, transport, **{**FAST, **opts})
            pool = _vllm_pool(geometry, tp, r) if role == "prefill" and geometry.packed_kv else None
            out.append(KVManager(config, pool))
    except BaseException:
        for m in out:
            m.close()
        raise
    return out


def _fill(mgr, pages, k_full, v_full, fill):
    arrays = place_tokens(mgr.placement, empty_pool(mgr.placement, fill), k_full, v_full, pages, TOKENS)
    for buf, arr in zip(mgr.pool.buffers, arrays):
        buf.copy_(torch.from_numpy(arr))


def run_pair(p, d, lp, ld, ps, pd, transport, data_path="direct", room=7):
    """One request through a fresh cluster; returns (decode records, problems)."""
    gp, gd = _geometry(lp, ps), _geometry(ld, pd)
    rng = np.random.default_rng(p * 10 + d + ps)
    src = rng.permutation(gp.num_pages)[: -(-TOKENS // ps)]
    dst = rng.permutation(gd.num_pages)[: -(-TOKENS // pd)]
    k_full, v_full = full_kv(LAYERS, H, TOKENS, DIM, DIM, seed=room)
    records = []
    with BootstrapServer() as boot:
        pre = _managers(boot, "prefill", gp, p, transport, {})
        try:
            dec = _managers(boot, "decode", gd, d, transport, {"data_path": data_path})
            try:
                for m in pre:
                    m.wait_registered(10)
                for m in dec:
                    m.request_listeners.append(records.append)
                    for buf in m.pool.buffers:  # every byte not written must stay this
                        buf.fill_(SENTINEL)
                rxs = [KVReceiver(m, room) for m in dec]
                for rx in rxs:
                    rx.send_metadata(dst, num_tokens=TOKENS)
                txs = []
                for m in pre:
                    _fill(m, src, k_full, v_full, POISON)
                    tx = KVSender(m, room)
                    for a in range(0, TOKENS, CHUNK):
                        b = min(TOKENS, a + CHUNK)
                        tx.send(src[a // ps : -(-b // ps)], last_chunk=b == TOKENS, aux=b"" if b < TOKENS else b"a")
                    txs.append(tx)
                states = wait_terminal(txs + rxs)
                assert states == [KVPoll.Success] * len(states), [h.failure_reason() for h in txs + rxs]
                problems = []
                for m in dec:
                    want = place_tokens(m.placement, empty_pool(m.placement), k_full, v_full, dst, TOKENS)
                    for i, (buf, exp) in enumerate(zip(m.pool.buffers, want)):
                        got = buf.numpy()
                        if got.tobytes() != exp.tobytes():
                            bad = np.argwhere(got.view(np.uint32) != exp.view(np.uint32))[0].tolist()
                            problems.append(f"decode rank {m.tp_rank} buffer {i}: first wrong element {bad}")
            finally:
                for m in dec:
                    m.close()
        finally:
            for m in pre:
                m.close()
    return records, problems


def _direct(p, d, lp, ld, ps, pd):
    """Whether data_path=direct writes in place: the same packing on both sides and the bytes
    line up (NHD_KV: all heads on each rank, any page size; HND_KV: the same page size)."""
    if lp != ld:
        return False
    return {"NHD_KV": p == d, "HND_KV": ps == pd}.get(lp, False)


@pytest.mark.parametrize("transport", ["local", "tcp"])
@pytest.mark.parametrize("case", CASES, ids=["{}-{}-{}-{}-p{}-p{}".format(*c) for c in CASES])
def test_packed_kv_transfers_match_the_oracle(case, transport):
    p, d, lp, ld, ps, pd = case
    records, problems = run_pair(p, d, lp, ld, ps, pd, transport)
    assert problems == []
    assert len(records) == d and all(r.ok for r in records)
    direct = _direct(*case)
    assert all(("scatter" in r.phases) is not direct for r in records), [r.phases for r in records]


@pytest.mark.parametrize("data_path", ["staged", "per_token", "auto"])
@pytest.mark.parametrize(("p", "d", "layout"), [(2, 2, "NHD_KV"), (2, 1, "HND_KV")])
def test_packed_kv_other_data_paths(p, d, layout, data_path):
    records, problems = run_pair(p, d, layout, layout, 4, 4, "local", data_path=data_path)
    assert problems == [] and len(records) == d
    if data_path != "auto":  # per_token is direct writes, one per token row
        assert all(("scatter" in r.phases) is (data_path == "staged") for r in records)


@pytest.mark.parametrize(("packed", "other"), [("NHD_KV", "NHD"), ("NHD_KV", "HND_KV"), ("HND_KV", "NHD")])
def test_per_token_between_a_packing_and_another_is_staged(packed, other):
    records, problems = run_pair(1, 2, packed, other, 4, 4, "tcp", data_path="per_token")
    assert problems == [] and all("scatter" in r.phases for r in records)
