"""One rank server process: a ``KVManager`` plus the synthetic request jobs.

A rank process is started by a ``RankGroup`` (``cluster/group.py``) and talks to it over a
pipe in msgpack (no pickle): it answers ``ready`` once its manager is up, runs ``transfer``
jobs concurrently (at most ``concurrency`` per rank; past that a job gets a "busy" result)
and answers each with a ``result``, aborts a request on ``abort``, and stops on ``stop``,
on SIGTERM, on pipe EOF or when its parent disappears (``PR_SET_PDEATHSIG`` on Linux). Its
exit is bounded: managers are closed with a short timeout and the process leaves through
``os._exit``, never waiting for job threads. A job that fails part-way aborts its
``KVSender``/``KVReceiver`` so the peer learns at once instead of waiting out a deadline.

Because there is no model, a prefill rank fills the request's pages
with content derived from (room, layer, head, token) before it hands over the first chunk
(so filling is not part of the transfer window) and a decode rank verifies every byte it
received against the same function. A job's ``layer_group`` (optional) makes the prefill
hand each token chunk over in groups of that many layers (layer-wise streaming). Each
result carries the rank's ``RequestRecord``
(``metrics.py``). With ``metrics_port`` in its spec the rank serves Prometheus metrics on
``metrics_port + tp_rank``. The module is the spawn target (``rank_main``), so it stays
importable on its own; it must not parse command-line arguments or print: a rank answers
over its pipe and logs.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import msgpack
import numpy as np

if TYPE_CHECKING:
    from sglang_kvxfer.cluster.group import StopFlag
    from sglang_kvxfer.engine.decode import DecodeManager
    from sglang_kvxfer.engine.manager import RankBase, RequestHandle
    from sglang_kvxfer.engine.pool import KVPool
    from sglang_kvxfer.engine.prefill import PrefillManager
    from sglang_kvxfer.metrics import MetricsServer

__all__ = ["rank_main"]

log = logging.getLogger("sglang_kvxfer.rank")

EXIT_CLOSE_S = (0.5, 3.0)  # manager close timeout: launcher lost, stop asked


def _send(conn, lock: threading.Lock, obj: dict) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    with lock:
        conn.send_bytes(data)


def _wait_terminal(handle, timeout_s: float):
    from sglang_kvxfer.protocol.state import KVPoll

    poll = handle.wait(timeout_s)  # woken by the request's end: no polling beside the transfer
    if poll in (KVPoll.Success, KVPoll.Failed):
        return poll
    handle.abort(f"the rank server gave up after {timeout_s:.0f} s")
    return handle.poll()


def _pause(handle, seconds: float) -> None:
    """Sleep ``seconds`` (a negative value raises, like ``time.sleep``), waking early when
    ``handle`` failed (an abort must not wait for the rest of a chunk delay)."""
    from sglang_kvxfer.protocol.state import KVPoll

    if seconds < 0:
        raise ValueError(f"sleep length must be non-negative, got chunk_delay_s={seconds}")
    end = time.monotonic() + seconds
    while handle.poll() != KVPoll.Failed and (left := end - time.monotonic()) > 0:
        time.sleep(min(left, 0.05))


class RankServer:
    """Runs synthetic transfer jobs on one rank."""

    def __init__(self, spec: dict):
        from sglang_kvxfer.engine import EngineConfig, KVManager
        from sglang_kvxfer.engine.pool import PageAllocator
        from sglang_kvxfer.geometry import KVGeometry

        geometry = KVGeometry.from_dict(spec["geometry"])
        self.config = EngineConfig(
            role=spec["role"],
            geometry=geometry,
            tp_size=spec["tp_size"],
            tp_rank=spec["tp_rank"],
            bootstrap=spec["bootstrap"],
            transport=spec["transport"],
            host=spec["host"],
            device=spec["device"],
            **spec.get("options", {}),
        )
        self.mgr: RankBase = KVManager(self.config)
        self.metrics: MetricsServer | None = None
        self.concurrency = spec.get("concurrency", 4)
        # room -> the running job's KVSender / KVReceiver (None while it is being set up)
        self._handles: dict[int, RequestHandle | None] = {}
        self._early_aborts: dict[int, str] = {}  # room -> reason, for an abort before the handle exists
        self._lock = threading.Lock()
        try:
            if spec.get("metrics_port"):
                from sglang_kvxfer.metrics import serve_metrics

                self.metrics = serve_metrics(self.mgr, spec["metrics_port"] + self.config.tp_rank, spec["host"])
        except BaseException:
            self.mgr.close()
            raise
        self.pages = PageAllocator(geometry.num_pages, seed=spec.get("seed", 0) + self.config.tp_rank)
        self.job_timeout_s = (
            self.config.bootstrap_timeout_s + self.config.waiting_timeout_s + self.config.transfer_timeout_s
        )
        if spec["role"] == "prefill":
            try:
                self._prefill_mgr().wait_registered(self.config.bootstrap_timeout_s + 5)
            except BaseException:
                self.close()
                raise

    def _prefill_mgr(self) -> PrefillManager:
        from sglang_kvxfer.engine.prefill import PrefillManager

        mgr = self.mgr
        if not isinstance(mgr, PrefillManager):
            raise TypeError(f"{self.config.role} rank {self.config.tp_rank} has no prefill manager")
        return mgr

    def _decode_mgr(self) -> DecodeManager:
        from sglang_kvxfer.engine.decode import DecodeManager

        mgr = self.mgr
        if not isinstance(mgr, DecodeManager):
            raise TypeError(f"{self.config.role} rank {self.config.tp_rank} has no decode manager")
        return mgr

    def _pool(self) -> KVPool:
        pool = self.mgr.pool
        if pool is None:
            raise RuntimeError(f"{self.config.role} rank {self.config.tp_rank} has no KV pool (manager closed)")
        return pool

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

    def admit(self, job: dict) -> dict | None:
        """None when the rank takes ``job``; otherwise its "busy" result."""
        with self._lock:
            if len(self._handles) < self.concurrency and job["room"] not in self._handles:
                self._handles[job["room"]] = None
                return None
        return self._result(
            job,
            {
                "ok": False,
                "reason": f"{self.config.role} rank {self.config.tp_rank} is busy: "
                f"it runs {self.concurrency} job(s) (its concurrency) or "
                f"room {job['room']} already",
            },
            0.0,
        )

    def _result(self, job: dict, out: dict, t_job: float) -> dict:
        out.update(op="result", id=job["id"], rank=self.config.tp_rank, t_job=t_job)
        return out

    def run(self, job: dict) -> dict:
        """Run an admitted job; never raises."""
        t0 = time.monotonic()
        try:
            out = self._prefill(job) if self.config.role == "prefill" else self._decode(job)
        except Exception as exc:  # report, never crash the rank
            log.warning("job %s (room %s) failed: %s: %s", job.get("id"), job.get("room"), type(exc).__name__, exc)
            out = {"ok": False, "reason": f"{type(exc).__name__}: {exc}"}
        finally:
            with self._lock:
                self._handles.pop(job["room"], None)
                self._early_aborts.pop(job["room"], None)
        return self._result(job, out, time.monotonic() - t0)

    def abort(self, room: int, reason: str) -> None:
        with self._lock:
            handle = self._handles.get(room)
            if handle is None and room in self._handles:
                self._early_aborts[room] = reason
        if handle is not None:
            handle.abort(reason)

    def _track(self, room: int, handle: RequestHandle) -> None:
        with self._lock:
            self._handles[room] = handle
            reason = self._early_aborts.pop(room, None)
        if reason is not None:
            handle.abort(reason)

    def _failed_part_way(self, handle: RequestHandle, exc: BaseException) -> None:
        """Abort ``handle`` so that the peer learns now, not at its deadline."""
        try:
            handle.abort(f"{self.config.role} rank {self.config.tp_rank} job failed: {type(exc).__name__}: {exc}")
        except Exception:  # already terminal or the manager is closing: the peer learns anyway
            log.debug("abort after a failed job did not apply", exc_info=True)

    def _prefill(self, job: dict) -> dict:
        from sglang_kvxfer.engine import KVSender
        from sglang_kvxfer.engine.synthetic import fill_request
        from sglang_kvxfer.protocol.state import KVPoll

        g = self.config.geometry
        tokens, chunk = job["tokens"], job["chunk_tokens"] or job["tokens"]
        pages = self._alloc(-(-tokens // g.page_size))
        try:
            sender = KVSender(self._prefill_mgr(), job["room"])
            self._track(job["room"], sender)
            try:
                if job["verify"]:
                    fill_request(self.mgr.placement, self._pool().buffers, job["room"], pages, 0, tokens)
                t_start = time.monotonic()
                for a in range(0, tokens, chunk):
                    b = min(tokens, a + chunk)
                    last = b == tokens
                    if a and job.get("chunk_delay_s"):
                        _pause(sender, job["chunk_delay_s"])  # stands in for the prefill forward of this chunk
                    if sender.poll() == KVPoll.Failed:
                        break  # aborted or the peer failed: no point in sending the rest
                    chunk_pages = pages[a // g.page_size : -(-b // g.page_size)]
                    step = job.get("layer_group") or g.num_layers  # layer-wise: layers per send()
                    for la in range(0, g.num_layers, step):
                        lb = min(g.num_layers, la + step)
                        done = lb == g.num_layers
                        sender.send(
                            chunk_pages,
                            last_chunk=last and done,
                            aux=job["aux"] if last and done else b"",
                            layers=range(la, lb) if step < g.num_layers else None,
                        )
            except BaseException as exc:
                self._failed_part_way(sender, exc)
                raise
            poll = _wait_terminal(sender, self.job_timeout_s)
            out = {
                "ok": poll == KVPoll.Success,
                "reason": sender.failure_reason or "",
                "bytes": sender.bytes_sent,
                "ops": sender.ops,
                "paths": sender.paths,
                "timings": sender.timings,
                "t_start": t_start,
                "t_end": time.monotonic(),
                "record": sender.record.to_dict(),
            }
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
            rx = KVReceiver(self._decode_mgr(), job["room"])
            self._track(job["room"], rx)
            t_start = time.monotonic()
            try:
                rx.send_metadata(pages, num_tokens=tokens)
            except BaseException as exc:
                self._failed_part_way(rx, exc)
                raise
            poll = _wait_terminal(rx, self.job_timeout_s)
            t_end = time.monotonic()
            ok = poll == KVPoll.Success
            problems = []
            if ok and job["verify"]:
                problems = verify_request(self.mgr.placement, self._pool().buffers, job["room"], pages, tokens)
            stats = rx.stats
            out = {
                "ok": ok,
                "reason": rx.failure_reason or "",
                "verified": ok and job["verify"] and not problems,
                "problems": problems[:3],
                "bytes": stats["bytes"],
                "timings": stats["timings"],
                "aux_ok": (not ok) or rx.aux_payload == job["aux"],
                "t_start": t_start,
                "t_end": t_end,
                "record": rx.record.to_dict(),
            }
            if ok and rx.aux_payload != job["aux"]:
                out["problems"].append(f"aux payload {rx.aux_payload!r} != {job['aux']!r}")
                out["verified"] = False
            rx.clear()
            return out
        finally:
            self.pages.free(pages)

    def close(self, timeout_s: float = EXIT_CLOSE_S[1]) -> None:
        if self.metrics is not None:
            self.metrics.close()
        self.mgr.close(timeout_s)


class _Stop(BaseException):
    """SIGTERM during start-up: unwind (closing what was opened) and leave."""


def rank_main(specs_bytes: bytes, conn) -> None:
    """Entry point of a rank process (``multiprocessing`` spawn target).

    ``specs_bytes`` is a msgpack list of rank specs: normally one; several when a
    ``RankGroup`` hosts a whole TP group in one process (each rank still has its own
    manager, transport, pool and sockets). Never returns: the process leaves through
    ``os._exit`` (or the NIXL exit helper) once its managers are closed.
    """
    import multiprocessing as mp

    from sglang_kvxfer.cluster.group import StopFlag, arm_parent_death_signal

    stop, serving = StopFlag(), StopFlag()  # set from the signal handler: no locks

    def on_term(*_):
        if stop.is_set():
            return  # a later signal of a burst: the first one is being acted on
        stop.set()
        if not serving.is_set():
            raise _Stop()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the launcher, which stops the ranks
    parent = mp.parent_process()
    arm_parent_death_signal(signal.SIGTERM, parent.pid if parent is not None else None)
    specs = msgpack.unpackb(specs_bytes, raw=False)
    first = specs[0]
    logging.basicConfig(
        level=first.get("log_level", "WARNING"),
        format=f"%(asctime)s {first['role']} %(levelname)s %(name)s: %(message)s",
    )
    lock = threading.Lock()
    servers: list[RankServer] = []
    close_s = EXIT_CLOSE_S[0]
    code = 0
    try:
        for spec in specs:
            try:
                servers.append(RankServer(spec))
            except Exception as exc:
                _send(
                    conn,
                    lock,
                    {"op": "ready", "ok": False, "rank": spec["tp_rank"], "reason": f"{type(exc).__name__}: {exc}"},
                )
                code = 1
                return
            mgr, metrics = servers[-1].mgr, servers[-1].metrics
            if mgr.control is None:
                raise RuntimeError(f"rank {spec['tp_rank']}: the manager has no control channel")
            _send(
                conn,
                lock,
                {
                    "op": "ready",
                    "ok": True,
                    "reason": "",
                    "rank": spec["tp_rank"],
                    "session": mgr.session,
                    "endpoint": mgr.control.endpoint,
                    "metrics_port": metrics.port if metrics else 0,
                },
            )
        serving.set()
        if _serve(servers, conn, lock, stop) == "stop":
            close_s = EXIT_CLOSE_S[1]
    except (_Stop, OSError):  # SIGTERM while starting; or the launcher's pipe broke
        pass
    finally:
        _leave(servers, close_s, code)


def _leave(servers: list[RankServer], close_s: float, code: int) -> None:
    """Close the managers within a bounded time, then end the process without waiting for
    job threads (a job may be sleeping in a long chunk delay or waiting on a peer)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watchdog = threading.Timer(close_s * max(1, len(servers)) + 1.0, os._exit, (code,))
    watchdog.daemon = True
    watchdog.start()
    for server in servers:
        try:
            server.close(close_s)
        except Exception:
            log.warning("closing rank %s failed", server.config.tp_rank, exc_info=True)
    _leave_if_nixl()
    logging.shutdown()
    os._exit(code)


def _leave_if_nixl() -> None:
    """A process that created a NIXL UCX backend can crash in its exit handlers: leave
    through the transport's exit helper instead."""
    import sys

    agent = sys.modules.get("sglang_kvxfer.transports.nixl.agent")
    if agent is not None and agent.ucx_backend_created():
        agent.exit_process(0)


def _serve(servers: list[RankServer], conn, lock: threading.Lock, stop: StopFlag) -> str:
    """Run commands until told to stop; returns why: "stop", "eof", "parent" or "signal"."""
    parent = os.getppid()
    pool = ThreadPoolExecutor(max_workers=sum(s.concurrency for s in servers), thread_name_prefix="job")

    def reply(obj: dict) -> None:
        try:
            _send(conn, lock, obj)
        except (OSError, ValueError):
            pass  # the launcher is gone; the main loop notices and leaves

    def run_job(server: RankServer, job: dict) -> None:
        reply(server.run(job))

    try:
        while not stop.is_set():
            if os.getppid() != parent:
                return "parent"  # the group launcher died: do not linger
            if not conn.poll(0.2):
                continue
            try:
                cmd = msgpack.unpackb(conn.recv_bytes(), raw=False)
            except (EOFError, OSError):
                return "eof"
            op = cmd.get("op")
            if op == "stop":
                return "stop"
            if op == "abort":
                for server in servers:
                    server.abort(cmd["room"], cmd.get("reason") or "aborted by the launcher")
            elif op == "transfer":
                for server in servers:
                    busy = server.admit(cmd)
                    if busy is not None:
                        reply(busy)
                    else:
                        pool.submit(run_job, server, cmd)
        return "signal"
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
