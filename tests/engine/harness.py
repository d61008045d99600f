"""An in-process cluster for engine tests: a bootstrap and prefill/decode managers as
threads of the test process (each manager has its own transport, pool and sockets)."""

from __future__ import annotations

import time

import numpy as np

from sglang_kvxfer.engine import BootstrapServer, EngineConfig, KVManager, KVPoll, KVReceiver, KVSender
from sglang_kvxfer.engine.synthetic import fill_request, verify_request
from sglang_kvxfer.geometry import KVGeometry

TERMINAL = (KVPoll.Success, KVPoll.Failed)


def geometry(h=8, mla=False, page_size=4, layout="NHD", num_pages=64, **kw):
    base = dict(
        num_layers=2,
        total_kv_heads=h,
        head_dim=16,
        v_head_dim=None if mla else 8,
        dtype="bf16",
        mla=mla,
        page_size=page_size,
        layout=layout,
        num_pages=num_pages,
    )
    base.update(kw)
    return KVGeometry(**base)


FAST = dict(
    bootstrap_timeout_s=10.0,
    waiting_timeout_s=10.0,
    transfer_timeout_s=10.0,
    heartbeat_interval_s=0.2,
    heartbeat_timeout_s=2.0,
    staging_bytes=1 << 20,
    staging_slot_bytes=64 << 10,
    num_workers=2,
)


def wait_terminal(handles, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(h.poll() in TERMINAL for h in handles):
            return [h.poll() for h in handles]
        time.sleep(0.005)
    raise AssertionError(f"not terminal after {timeout_s} s: {[h.poll() for h in handles]}")


class Cluster:
    def __init__(self, p, d, gp, gd=None, transport="local", prefill_opts=None, decode_opts=None, bootstrap=None):
        self.boot = bootstrap or BootstrapServer()
        self.own_boot = bootstrap is None
        gd = gd or gp
        self.pre, self.dec = [], []
        try:
            for r in range(p):
                self.pre.append(
                    KVManager(
                        EngineConfig(
                            "prefill", gp, p, r, self.boot.address, transport, **{**FAST, **(prefill_opts or {})}
                        )
                    )
                )
            for r in range(d):
                self.dec.append(
                    KVManager(
                        EngineConfig(
                            "decode", gd, d, r, self.boot.address, transport, **{**FAST, **(decode_opts or {})}
                        )
                    )
                )
            for m in self.pre:
                m.wait_registered(10)
        except BaseException:
            self.close()
            raise
        self.rng = np.random.default_rng(0)

    def pages(self, mgr, tokens):
        g = mgr.config.geometry
        return self.rng.permutation(g.num_pages)[: -(-tokens // g.page_size)]

    def start(self, room, tokens, chunk=None, aux=b"aux", fill=True):
        """Create receivers and senders for one request and hand over every chunk."""
        gp = self.pre[0].config.geometry
        src = self.pages(self.pre[0], tokens)
        dst = self.pages(self.dec[0], tokens)
        rxs = [KVReceiver(m, room) for m in self.dec]
        for rx in rxs:
            rx.send_metadata(dst, num_tokens=tokens)
        txs = []
        chunk = max(gp.page_size, (chunk or tokens) // gp.page_size * gp.page_size)  # whole pages
        for m in self.pre:
            if fill:
                fill_request(m.placement, m.pool.buffers, room, src, 0, tokens)
            tx = KVSender(m, room)
            for a in range(0, tokens, chunk):
                b = min(tokens, a + chunk)
                tx.send(
                    src[a // gp.page_size : -(-b // gp.page_size)],
                    last_chunk=b == tokens,
                    aux=aux if b == tokens else b"",
                )
            txs.append(tx)
        return txs, rxs, dst

    def verify(self, room, dst, tokens):
        return [p for m in self.dec for p in verify_request(m.placement, m.pool.buffers, room, dst, tokens)]

    def close(self):
        for m in self.pre + self.dec:
            m.close()
        if self.own_boot:
            self.boot.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
