"""Closing a rank never frees memory a writer may still touch: a region the transport could
not deregister (a receive into it in flight) and the memory of a rank whose worker is still
running stay mapped; otherwise everything is released. Real shared-memory pools."""

from __future__ import annotations

import threading

from sglang_kvxfer.engine import EngineConfig, KVManager
from sglang_kvxfer.engine.pool import KVPool
from sglang_kvxfer.errors import TransportError
from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.transports import get_transport

from .harness import FAST

GEO = KVGeometry(num_layers=2, total_kv_heads=2, head_dim=16, num_pages=8)


class _BusyRegions:
    """Wraps a real transport; deregistering a region says a transfer is still in flight."""

    def __init__(self, inner, busy: bool):
        self.inner, self.busy, self._closed = inner, busy, False

    def register_tensor(self, tensor):
        return self.inner.register_tensor(tensor)

    def deregister(self, region):
        if self.busy:
            raise TransportError(f"{region.region_id!r} still has 1 transfer(s) in flight after 5.0 s")
        self.inner.deregister(region)


def _shared_pool() -> tuple[KVPool, list]:
    pool = KVPool.allocate(GEO.placement(1, 0), shared=True)
    return pool, list(pool._owners)


def test_a_region_with_a_transfer_in_flight_keeps_its_memory_mapped():
    from sglang_kvxfer.engine import pool as pool_module

    with get_transport("tcp") as tcp:
        busy, owners = _shared_pool()
        busy.register(_BusyRegions(tcp, busy=True))
        busy.buffers[0].fill_(7)
        before = owners[0].as_numpy()[:64].copy()
        assert before.any()
        assert busy.close() is False
        assert owners and not any(o.closed for o in owners)  # still mapped: a writer may be in it
        assert all(o in pool_module._KEPT_MAPPED for o in owners)
        assert (owners[0].as_numpy()[:64] == before).all()  # and readable, not unmapped
        idle, owners = _shared_pool()
        idle.register(_BusyRegions(tcp, busy=False))
        assert idle.close() is True and all(o.closed for o in owners)


def test_a_rank_whose_worker_still_runs_keeps_its_pool_mapped_and_drops_queued_work():
    cfg = EngineConfig("prefill", GEO, 1, 0, "127.0.0.1:1", "local", auth_key="off", **FAST)
    mgr = KVManager(cfg, KVPool.allocate(cfg.placement, shared=True))
    owners = list(mgr.pool._owners)
    release, ran = threading.Event(), []
    worker = mgr._workers[0]
    worker.submit(lambda: release.wait(30))  # a copy that outlasts the close timeout
    worker.submit(lambda: ran.append("queued"))  # queued behind it: must not start
    try:
        mgr.close(timeout_s=0.3)
        assert owners and not any(o.closed for o in owners)
    finally:
        release.set()
    worker._thread.join(10)
    assert not worker._thread.is_alive() and ran == []
    # a rank whose workers end in time releases its memory
    mgr = KVManager(cfg, KVPool.allocate(cfg.placement, shared=True))
    owners = list(mgr.pool._owners)
    mgr.close(timeout_s=5)
    assert owners and all(o.closed for o in owners)
