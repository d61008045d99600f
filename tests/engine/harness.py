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

    def receive(self, room, tokens):
        """Pick one request's prefill and decode pages and post every decode rank's receiver
        with its metadata: (source pages, destination pages, receivers)."""
        src = self.pages(self.pre[0], tokens)
        dst = self.pages(self.dec[0], tokens)
        rxs = [KVReceiver(m, room) for m in self.dec]
        for rx in rxs:
            rx.send_metadata(dst, num_tokens=tokens)
        return src, dst, rxs

    def chunks(self, src, tokens, chunk=None):
        """The request's token chunks of ``chunk`` tokens, rounded down to whole prefill pages
        (at least one; ``None``: one chunk): (the chunk's source pages, whether it is the last)."""
        ps = self.pre[0].config.geometry.page_size
        chunk = max(ps, (chunk or tokens) // ps * ps)
        for a in range(0, tokens, chunk):
            b = min(tokens, a + chunk)
            yield src[a // ps : -(-b // ps)], b == tokens

    def start(self, room, tokens, chunk=None, aux=b"aux", fill=True):
        """Create receivers and senders for one request and hand over every chunk."""
        src, dst, rxs = self.receive(room, tokens)
        txs = []
        for m in self.pre:
            if fill:
                fill_request(m.placement, m.pool.buffers, room, src, 0, tokens)
            tx = KVSender(m, room)
            for pages, last in self.chunks(src, tokens, chunk):
                tx.send(pages, last_chunk=last, aux=aux if last else b"")
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
