"""One rank server process: a ``KVManager`` plus the synthetic request jobs.

A rank process is started by a ``RankGroup`` (``cli/group.py``) and talks to it over a
pipe in msgpack (no pickle): it answers ``ready`` once its manager is up, runs ``transfer``
jobs concurrently and answers each with a ``result``, and stops on ``stop`` or when its
parent disappears. Because there is no model, a prefill rank fills the request's pages
with content derived from (room, layer, head, token) before it hands over the first chunk
(so filling is not part of the transfer window) and a decode rank verifies every byte it
received against the same function. Each result carries the rank's ``RequestRecord``
(``metrics.py``). With ``metrics_port`` in its spec the rank serves Prometheus metrics on
``metrics_port + tp_rank``.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import msgpack
import numpy as np

__all__ = ["rank_main"]

log = logging.getLogger("sglang_kvxfer.rank")


def _send(conn, lock: threading.Lock, obj: dict) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    with lock:
        conn.send_bytes(data)


def _wait_terminal(handle, timeout_s: float):
    from sglang_kvxfer.protocol.state import KVPoll

    deadline = time.monotonic() + timeout_s
    delay = 0.0005
    while True:
        poll = handle.poll()
        if poll in (KVPoll.Success, KVPoll.Failed):
            return poll
        if time.monotonic() > deadline:
            handle.abort(f"the rank server gave up after {timeout_s:.0f} s")
            return handle.poll()
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


class RankServer:
    """Runs synthetic transfer jobs on one rank."""

    def __init__(self, spec: dict):
        from sglang_kvxfer.engine import EngineConfig, KVManager
        from sglang_kvxfer.engine.pool import PageAllocator
        from sglang_kvxfer.geometry import KVGeometry

        geometry = KVGeometry.from_dict(spec["geometry"])
        self.config = EngineConfig(
            role=spec["role"], geometry=geometry, tp_size=spec["tp_size"], tp_rank=spec["tp_rank"],
            bootstrap=spec["bootstrap"], transport=spec["transport"], host=spec["host"],
            device=spec["device"], **spec.get("options", {}))
        self.mgr = KVManager(self.config)
        self.metrics = None
        try:
            if spec.get("metrics_port"):
                from sglang_kvxfer.metrics import serve_metrics

                self.metrics = serve_metrics(self.mgr, spec["metrics_port"] + self.config.tp_rank, spec["host"])
        except BaseException:
            self.mgr.close()
            raise
        self.pages = PageAllocator(geometry.num_pages, seed=spec.get("seed", 0) + self.config.tp_rank)
        self.job_timeout_s = (self.config.bootstrap_timeout_s + self.config.waiting_timeout_s
                              + self.config.transfer_timeout_s)
        if spec["role"] == "prefill":
            try:
                self.mgr.wait_registered(self.config.bootstrap_timeout_s + 5)
            except BaseException:
                self.close()
                raise

    def _alloc(self, n: int) -> np.ndarray:
        deadline = time.monotonic() + self.config.waiting_timeout_s
        while True:
            pages = self.pages.alloc(n)
            if pages is not None:
                return pages
            if n > self.config.geometry.num_pages:
                raise ValueError(f"a request needs {n} pages; the pool has {self.config.geometry.num_pages}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {n} free pages within {self.config.waiting_timeout_s} s")
            time.sleep(0.005)

    def run(self, job: dict) -> dict:
        t0 = time.monotonic()
        try:
            out = self._prefill(job) if self.config.role == "prefill" else self._decode(job)
        except Exception as exc:  # report, never crash the rank
            log.exception("job %s failed", job.get("id"))
            out = {"ok": False, "reason": f"{type(exc).__name__}: {exc}"}
        out.update(op="result", id=job["id"], rank=self.config.tp_rank, t_job=time.monotonic() - t0)
        return out

    def _prefill(self, job: dict) -> dict:
        from sglang_kvxfer.engine import KVSender
        from sglang_kvxfer.engine.synthetic import fill_request
        from sglang_kvxfer.protocol.state import KVPoll

        g = self.config.geometry
        tokens, chunk = job["tokens"], job["chunk_tokens"] or job["tokens"]
        pages = self._alloc(-(-tokens // g.page_size))
        try:
            sender = KVSender(self.mgr, job["room"])
            if job["verify"]:
                fill_request(self.mgr.placement, self.mgr.pool.buffers, job["room"], pages, 0, tokens)
            t_start = time.monotonic()
            for a in range(0, tokens, chunk):
                b = min(tokens, a + chunk)
                last = b == tokens
                if a and job.get("chunk_delay_s"):
                    time.sleep(job["chunk_delay_s"])  # stands in for the prefill forward of this chunk
                sender.send(pages[a // g.page_size: -(-b // g.page_size)], last_chunk=last,
                            aux=job["aux"] if last else b"")
            poll = _wait_terminal(sender, self.job_timeout_s)
            out = {"ok": poll == KVPoll.Success, "reason": sender.failure_reason or "",
                   "bytes": sender.bytes_sent, "ops": sender.ops, "paths": sender.paths,
                   "timings": sender.timings, "t_start": t_start, "t_end": time.monotonic(),
                   "record": sender.record.to_dict()}
            sender.clear()
            return out
        finally:
            self.pages.free(pages)

    def _decode(self, job: dict) -> dict:
        from sglang_kvxfer.engine import KVReceiver
        from sglang_kvxfer.engine.synthetic import verify_request
        from sglang_kvxfer.protocol.state import KVPoll

        g = self.config.geometry
        tokens = job["tokens"]
        pages = self._alloc(-(-tokens // g.page_size))
        try:
            rx = KVReceiver(self.mgr, job["room"])
            t_start = time.monotonic()
            rx.send_metadata(pages, num_tokens=tokens)
            poll = _wait_terminal(rx, self.job_timeout_s)
            t_end = time.monotonic()
            ok = poll == KVPoll.Success
            problems = []
            if ok and job["verify"]:
                problems = verify_request(self.mgr.placement, self.mgr.pool.buffers, job["room"], pages, tokens)
            stats = rx.stats
            out = {"ok": ok, "reason": rx.failure_reason or "", "verified": ok and job["verify"] and not problems,
                   "problems": problems[:3], "bytes": stats["bytes"], "timings": stats["timings"],
                   "aux_ok": (not ok) or rx.aux_payload == job["aux"],
                   "t_start": t_start, "t_end": t_end, "record": rx.record.to_dict()}
            if ok and rx.aux_payload != job["aux"]:
                out["problems"].append(f"aux payload {rx.aux_payload!r} != {job['aux']!r}")
                out["verified"] = False
            rx.clear()
            return out
        finally:
            self.pages.free(pages)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        self.mgr.close()


def rank_main(specs_bytes: bytes, conn) -> None:
    """Entry point of a rank process (``multiprocessing`` spawn target).

    ``specs_bytes`` is a msgpack list of rank specs: normally one; several when a
    ``RankGroup`` hosts a whole TP group in one process (each rank still has its own
    manager, transport, pool and sockets).
    """
    specs = msgpack.unpackb(specs_bytes, raw=False)
    first = specs[0]
    logging.basicConfig(level=first.get("log_level", "WARNING"),
                        format=f"%(asctime)s {first['role']} %(levelname)s %(name)s: %(message)s")
    lock = threading.Lock()
    parent = os.getppid()
    servers = []
    try:
        for spec in specs:
            try:
                servers.append(RankServer(spec))
            except Exception as exc:
                _send(conn, lock, {"op": "ready", "ok": False, "rank": spec["tp_rank"],
                                   "reason": f"{type(exc).__name__}: {exc}"})
                return
            _send(conn, lock, {"op": "ready", "ok": True, "reason": "", "rank": spec["tp_rank"],
                               "session": servers[-1].mgr.session,
                               "endpoint": servers[-1].mgr.control.endpoint,
                               "metrics_port": servers[-1].metrics.port if servers[-1].metrics else 0})
        _serve(servers, conn, lock, parent, first.get("concurrency", 4))
    finally:
        for server in servers:
            server.close()
        _leave_if_nixl()


def _leave_if_nixl() -> None:
    """A process that created a NIXL UCX backend can crash in exit handlers (research/
    peers.md): leave through the transport's exit helper instead."""
    import sys

    agent = sys.modules.get("sglang_kvxfer.transports._nixl_agent")
    if agent is not None and agent.ucx_backend_created():
        agent.exit_process(0)


def _serve(servers: list, conn, lock: threading.Lock, parent: int, concurrency: int) -> None:
    pool = ThreadPoolExecutor(max_workers=concurrency * len(servers), thread_name_prefix="job")
    try:
        while True:
            if os.getppid() != parent:
                break  # the group launcher died: do not linger
            if not conn.poll(0.2):
                continue
            try:
                cmd = msgpack.unpackb(conn.recv_bytes(), raw=False)
            except (EOFError, OSError):
                break
            if cmd.get("op") == "stop":
                break
            if cmd.get("op") == "transfer":
                for server in servers:
                    pool.submit(lambda c=cmd, s=server: _send(conn, lock, s.run(c)))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
