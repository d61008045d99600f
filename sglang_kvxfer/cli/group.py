"""A group of rank processes of one role (one TP group), driven over pipes.

Owns ``RankGroup``: spawns ``tp_size`` rank processes (``cli/rank.py``), waits for each to
report ready (with a deadline), fans a transfer job out to every rank and gathers the
per-rank results, and stops the processes (terminating any that do not stop in time).
Messages are msgpack over ``multiprocessing`` pipes; one reader thread per group routes
results to waiting jobs.
"""
from __future__ import annotations

import multiprocessing as mp
import threading
import time
from concurrent.futures import Future

import msgpack

from sglang_kvxfer.errors import KVXferError, TransferTimeoutError

__all__ = ["RankGroup", "make_spec", "open_groups"]


def make_spec(role: str, geometry, tp_size: int, bootstrap: str, transport: str, host: str = "127.0.0.1",
              devices: list[str] | None = None, options: dict | None = None, concurrency: int = 4,
              log_level: str = "WARNING", metrics_port: int = 0) -> dict:
    """The per-group part of a rank spec (``tp_rank`` and ``device`` are added per rank).

    ``metrics_port``: 0 = no metrics endpoint; otherwise rank ``r`` serves Prometheus
    metrics on ``metrics_port + r`` at ``host``.
    """
    if isinstance(metrics_port, bool) or not isinstance(metrics_port, int) or not 0 <= metrics_port < 65536 - tp_size:
        raise ValueError(f"metrics_port={metrics_port!r} must be 0 (off) or a port with room for "
                         f"{tp_size} rank(s) below 65536")
    return {"role": role, "geometry": geometry.to_dict(), "tp_size": tp_size, "bootstrap": bootstrap,
            "transport": transport, "host": host, "devices": devices or ["cpu"] * tp_size,
            "options": options or {}, "concurrency": concurrency, "log_level": log_level,
            "metrics_port": metrics_port}


class RankGroup:
    """``tp_size`` ranks of one role, one process each; with ``one_process=True`` all ranks
    of the group share one process (quick runs and tests: every rank still has its own
    manager, transport, pool and sockets)."""

    def __init__(self, spec: dict, ready_timeout_s: float = 120.0, one_process: bool = False):
        from sglang_kvxfer.cli.rank import rank_main

        self.role, self.tp_size = spec["role"], spec["tp_size"]
        devices = spec["devices"]
        if len(devices) != self.tp_size:
            raise ValueError(f"{self.role}: {len(devices)} device(s) given for TP {self.tp_size}")
        ctx = mp.get_context("spawn")
        self._procs, self._conns = [], []
        self._pending: dict[int, tuple[Future, dict]] = {}
        self._lock = threading.Lock()
        self._next_id = 0
        self._closed = False
        self.sessions: list[str] = []
        self.metrics_ports: list[int] = []  # per rank, 0 when off
        specs = [dict(spec, tp_rank=rank, device=devices[rank]) for rank in range(self.tp_size)]
        for part in ([specs] if one_process else [[s] for s in specs]):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(msgpack.packb(part), child),
                               name=f"kvxfer-{self.role}{part[0]['tp_rank']}", daemon=True)
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._ranks_per_conn = [len(specs)] if one_process else [1] * len(specs)
        try:
            self._await_ready(ready_timeout_s)
        except BaseException:
            self.close()
            raise
        self._reader = threading.Thread(target=self._read, name=f"kvxfer-{self.role}-group", daemon=True)
        self._reader.start()

    def _await_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for i, conn in enumerate(self._conns):
            for _ in range(self._ranks_per_conn[i]):
                while not conn.poll(0.1):
                    if not self._procs[i].is_alive():
                        raise KVXferError(f"{self.role} rank process {self._procs[i].name} exited during "
                                          f"start-up (exit code {self._procs[i].exitcode})")
                    if time.monotonic() > deadline:
                        raise TransferTimeoutError(f"{self.role} ranks not ready after {timeout_s:.0f} s")
                msg = msgpack.unpackb(conn.recv_bytes(), raw=False)
                if not msg.get("ok"):
                    raise KVXferError(f"{self.role} rank {msg.get('rank')} failed to start: {msg.get('reason')}")
                self.sessions.append(msg["session"])
                self.metrics_ports.append(msg.get("metrics_port", 0))

    def _read(self) -> None:
        from multiprocessing.connection import wait

        conns = list(self._conns)
        while conns and not self._closed:
            for conn in wait(conns, timeout=0.2):
                try:
                    msg = msgpack.unpackb(conn.recv_bytes(), raw=False)
                except (EOFError, OSError):
                    conns.remove(conn)
                    self._fail_all(f"a {self.role} rank process exited")
                    continue
                self._deliver(msg)

    def _deliver(self, msg: dict) -> None:
        with self._lock:
            entry = self._pending.get(msg.get("id"))
            if entry is None:
                return
            fut, results = entry
            results[msg["rank"]] = msg
            if len(results) < self.tp_size:
                return
            del self._pending[msg["id"]]
        fut.set_result([results[r] for r in range(self.tp_size)])

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut, results in pending.values():
            fut.set_result([results.get(r, {"ok": False, "reason": reason, "rank": r})
                            for r in range(self.tp_size)])

    def submit(self, job: dict) -> Future:
        """Run ``job`` on every rank; the future gives the per-rank results in rank order."""
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise KVXferError(f"{self.role} group is closed")
            job_id = self._next_id
            self._next_id += 1
            self._pending[job_id] = (fut, {})
        data = msgpack.packb(dict(job, op="transfer", id=job_id), use_bin_type=True)
        for conn in self._conns:
            conn.send_bytes(data)
        return fut

    def kill_rank(self, rank: int) -> None:
        """Kill the process of ``rank`` (fault-injection tests; with ``one_process`` that is
        the whole group)."""
        self._procs[0 if len(self._procs) == 1 else rank].kill()

    def close(self, timeout_s: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        stop = msgpack.packb({"op": "stop"})
        for conn in self._conns:
            try:
                conn.send_bytes(stop)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(2)
        for conn in self._conns:
            conn.close()
        self._fail_all(f"{self.role} group closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_groups(spec_p: dict, spec_d: dict, one_process: bool = False,
                ready_timeout_s: float = 120.0) -> tuple["RankGroup", "RankGroup"]:
    """Start a prefill group and a decode group at the same time (process start-up is
    most of a short run); if either fails, both are closed and the first error raised."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2, thread_name_prefix="kvxfer-start") as pool:
        futs = [pool.submit(RankGroup, spec, ready_timeout_s, one_process) for spec in (spec_p, spec_d)]
    groups, errors = [], []
    for fut in futs:
        try:
            groups.append(fut.result())
        except BaseException as exc:
            errors.append(exc)
    if errors:
        for group in groups:
            group.close()
        raise errors[0]
    return groups[0], groups[1]
