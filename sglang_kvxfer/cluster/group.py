"""A group of rank processes of one role (one TP group), driven over pipes.

Owns ``RankGroup``: spawns ``tp_size`` rank processes (``cluster/rank.py``), waits for each to
report ready (with a deadline), fans a transfer job out to every rank and gathers the
per-rank results, watches every rank process (pipe EOF and process sentinel), fails the
jobs of a rank that died at once with a reason naming the rank, its pid and the signal or
exit code, restarts it (``max_restarts``, with backoff), refuses jobs past ``max_jobs``
with a "busy" result, and stops the processes (terminating any that do not stop in time).

Messages are msgpack over ``multiprocessing`` pipes. One watcher thread per group reads
results, notices deaths and spawns every rank process: a rank arms ``PR_SET_PDEATHSIG``,
which fires when the *thread* that spawned it ends, so the spawning thread must live as
long as the group. Must not parse command-line arguments or print: it reports through
return values, exceptions and the ``sglang_kvxfer.group`` logger.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import msgpack

from sglang_kvxfer.errors import KVXferError, TransferTimeoutError
from sglang_kvxfer.transports import check_transport

__all__ = ["RankGroup", "make_spec", "open_groups", "arm_parent_death_signal", "describe_exit", "StopFlag"]

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.context import SpawnProcess

log = logging.getLogger("sglang_kvxfer.group")

RESTART_BACKOFF_S = (0.5, 8.0)  # first delay, cap; doubles per death in a row
HEALTHY_AFTER_S = 30.0  # a rank up this long has its death-in-a-row count reset


def make_spec(
    role: str,
    geometry,
    tp_size: int,
    bootstrap: str,
    transport: str,
    host: str = "127.0.0.1",
    devices: list[str] | None = None,
    options: dict | None = None,
    concurrency: int = 4,
    log_level: str = "WARNING",
    metrics_port: int = 0,
) -> dict:
    """The per-group part of a rank spec (``tp_rank`` and ``device`` are added per rank).

    ``metrics_port``: 0 = no metrics endpoint; otherwise rank ``r`` serves Prometheus
    metrics on ``metrics_port + r`` at ``host``.
    """
    if isinstance(metrics_port, bool) or not isinstance(metrics_port, int) or not 0 <= metrics_port < 65536 - tp_size:
        raise ValueError(
            f"metrics_port={metrics_port!r} must be 0 (off) or a port with room for {tp_size} rank(s) below 65536"
        )
    check_transport(transport)  # before any rank starts: one error, not one per rank
    return {
        "role": role,
        "geometry": geometry.to_dict(),
        "tp_size": tp_size,
        "bootstrap": bootstrap,
        "transport": transport,
        "host": host,
        "devices": devices or ["cpu"] * tp_size,
        "options": options or {},
        "concurrency": concurrency,
        "log_level": log_level,
        "metrics_port": metrics_port,
    }


class StopFlag:
    """A stop request that a signal handler may set: unlike ``threading.Event.set`` it takes
    no lock. A handler that takes a lock deadlocks the main thread when a second signal lands
    inside the first handler, and signals do come in bursts: ``PR_SET_PDEATHSIG`` fires once
    per launcher thread as the child is handed from one dying thread to the next."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


def arm_parent_death_signal(sig: int = signal.SIGTERM, parent_pid: int | None = None) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent (thread) ends; if the
    parent is already gone (``getppid`` differs from ``parent_pid``), send it now. False
    where ``prctl`` is not available (not Linux)."""
    import ctypes
    import os

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(sig), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return False
    except (OSError, AttributeError):
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)  # the parent died before prctl took effect
    return True


def describe_exit(exitcode: int | None) -> str:
    """``-9`` -> "killed by SIGKILL", ``3`` -> "exited with code 3"."""
    if exitcode is None:
        return "stopped answering (process state unknown)"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return "exited" if exitcode == 0 else f"exited with code {exitcode}"


class _Slot:
    """One rank process: the ranks it hosts, its pipe and where it is in its life."""

    def __init__(self, specs: list[dict]):
        self.specs = specs
        self.ranks = [s["tp_rank"] for s in specs]
        self.proc: SpawnProcess | None = None  # set by RankGroup._spawn, before any other use
        self.conn: Connection | None = None
        self.state = "starting"  # starting -> up -> restarting | down
        self.reason = ""  # why it is not up
        self.num_ready = 0
        self.ready_deadline = 0.0
        self.up_since = 0.0
        self.deaths_in_a_row = 0
        self.restart_at = 0.0

    @property
    def process(self) -> SpawnProcess:
        if self.proc is None:
            raise RuntimeError(f"rank(s) {self.ranks}: no process was spawned yet")
        return self.proc

    @property
    def pipe(self) -> Connection:
        if self.conn is None:
            raise RuntimeError(f"rank(s) {self.ranks}: no pipe was opened yet")
        return self.conn


class RankGroup:
    """``tp_size`` ranks of one role, one process each; with ``one_process=True`` all ranks
    of the group share one process (quick runs and tests: every rank still has its own
    manager, transport, pool and sockets).

    ``max_restarts``: how many times in a row a dead rank process is started again (0: a
    dead rank stays down and its jobs fail). ``max_jobs``: jobs in flight at most; a job
    past it gets a "busy" result at once (None: no limit).
    """

    def __init__(
        self,
        spec: dict,
        ready_timeout_s: float = 120.0,
        one_process: bool = False,
        max_restarts: int = 0,
        max_jobs: int | None = None,
    ):
        self.role, self.tp_size = spec["role"], spec["tp_size"]
        devices = spec["devices"]
        if len(devices) != self.tp_size:
            raise ValueError(f"{self.role}: {len(devices)} device(s) given for TP {self.tp_size}")
        if max_restarts < 0:
            raise ValueError(f"max_restarts={max_restarts} must be >= 0")
        if max_jobs is not None and max_jobs < 1:
            raise ValueError(f"max_jobs={max_jobs} must be >= 1")
        self.max_restarts, self.max_jobs, self.ready_timeout_s = max_restarts, max_jobs, ready_timeout_s
        self.restarts = 0  # rank processes started again after a death
        self._ctx = mp.get_context("spawn")
        # job id -> (future, results by rank, room; None if the job named none)
        self._pending: dict[int, tuple[Future, dict, int | None]] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._next_id = 0
        self._closed = False
        self._finished = threading.Event()  # close() is done with the processes: the watcher may end
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self.sessions: list[str] = [""] * self.tp_size
        self.metrics_ports: list[int] = [0] * self.tp_size  # per rank, 0 when off
        specs = [dict(spec, tp_rank=rank, device=devices[rank]) for rank in range(self.tp_size)]
        self._slots = [_Slot(part) for part in ([specs] if one_process else [[s] for s in specs])]
        self._watcher = threading.Thread(target=self._watch, name=f"kvxfer-{self.role}-group", daemon=True)
        self._watcher.start()
        if not self._started.wait(ready_timeout_s + 5):
            self._start_error = TransferTimeoutError(f"{self.role} ranks not ready after {ready_timeout_s:.0f} s")
        if self._start_error is not None:
            self.close()
            raise self._start_error

    # -- the watcher thread: spawns, reads, notices deaths, restarts -------------------------

    def _spawn(self, slot: _Slot) -> None:
        from sglang_kvxfer.cluster.rank import rank_main

        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=rank_main,
            args=(msgpack.packb(slot.specs), child),
            name=f"kvxfer-{self.role}{slot.ranks[0]}",
            daemon=True,
        )
        proc.start()
        child.close()
        slot.proc, slot.conn, slot.state, slot.num_ready = proc, parent, "starting", 0
        slot.ready_deadline = time.monotonic() + self.ready_timeout_s

    def _watch(self) -> None:
        from multiprocessing.connection import wait

        try:
            for slot in self._slots:
                self._spawn(slot)
            while not self._finished.is_set():
                now = time.monotonic()
                for slot in self._slots:
                    if self._closed:
                        break
                    if slot.state == "restarting" and now >= slot.restart_at:
                        self._restart(slot)
                    elif slot.state == "starting" and now > slot.ready_deadline:
                        slot.process.kill()
                        self._died(slot, f"not ready after {self.ready_timeout_s:.0f} s")
                    elif slot.state == "up" and slot.deaths_in_a_row and now - slot.up_since > HEALTHY_AFTER_S:
                        slot.deaths_in_a_row = 0
                watched: dict[object, _Slot] = {}  # pipe or process sentinel -> its slot
                handles: list[Connection | int] = []  # the same, in order, for wait()
                for slot in self._slots:
                    if slot.state in ("starting", "up"):
                        pipe, sentinel = slot.pipe, slot.process.sentinel
                        watched[pipe] = watched[sentinel] = slot
                        handles += [pipe, sentinel]
                if not watched:
                    time.sleep(0.1)
                    continue
                for obj in wait(handles, timeout=0.1):
                    slot = watched[obj]
                    if slot.state not in ("starting", "up"):
                        continue  # already handled through its other handle
                    if obj is slot.conn:
                        try:
                            msg = msgpack.unpackb(slot.pipe.recv_bytes(), raw=False)
                        except (EOFError, OSError):
                            self._died(slot)
                            continue
                        self._on_message(slot, msg)
                    elif not slot.pipe.poll():  # exited; read what it wrote first
                        self._died(slot)
        except BaseException as exc:  # never let the group hang its callers
            log.exception("%s group watcher failed", self.role)
            self._start_error = self._start_error or exc
            self._started.set()
            why = f"{self.role} group watcher failed: {exc}"
            self._fail_pending(lambda r: why)

    def _on_message(self, slot: _Slot, msg: dict) -> None:
        if msg.get("op") != "ready":
            self._deliver(msg)
            return
        if not msg.get("ok"):
            reason = f"{self.role} rank {msg.get('rank')} failed to start: {msg.get('reason')}"
            slot.process.kill()
            self._died(slot, reason, exact=True)
            return
        self.sessions[msg["rank"]] = msg["session"]
        self.metrics_ports[msg["rank"]] = msg.get("metrics_port", 0)
        slot.num_ready += 1
        if slot.num_ready == len(slot.ranks):
            with self._lock:
                slot.state, slot.reason, slot.up_since = "up", "", time.monotonic()
            if self._started.is_set():
                log.warning(
                    "%s rank %s is back (pid %d, session %s)",
                    self.role,
                    self._names(slot),
                    slot.process.pid,
                    msg["session"],
                )
            elif all(s.state == "up" for s in self._slots):
                self._started.set()

    def _names(self, slot: _Slot) -> str:
        return ",".join(map(str, slot.ranks))

    def _died(self, slot: _Slot, how: str | None = None, exact: bool = False) -> None:
        """Fail ``slot``'s part of every pending job, then schedule its restart."""
        proc = slot.process
        proc.join(1.0)
        pid = proc.pid
        if not exact:
            how = how or describe_exit(proc.exitcode)
        reason = how if exact else f"{self.role} rank {self._names(slot)} (pid {pid}) died: {how}"
        try:
            slot.pipe.close()
        except OSError:
            pass
        if self._closed:
            slot.state = "down"
            return
        if not self._started.is_set():  # during start-up: the group fails as a whole
            if exact:
                self._start_error = KVXferError(reason)
            elif how is not None and how.startswith("not ready"):  # not exact: ``how`` is set
                self._start_error = TransferTimeoutError(
                    f"{self.role} ranks not ready after {self.ready_timeout_s:.0f} s"
                )
            else:
                self._start_error = KVXferError(
                    f"{self.role} rank process {proc.name} exited during start-up (exit code {proc.exitcode})"
                )
            slot.state = "down"
            self._started.set()
            return
        slot.deaths_in_a_row += 1
        with self._lock:
            if slot.deaths_in_a_row <= self.max_restarts:
                delay = min(RESTART_BACKOFF_S[0] * 2 ** (slot.deaths_in_a_row - 1), RESTART_BACKOFF_S[1])
                slot.state, slot.restart_at = "restarting", time.monotonic() + delay
                slot.reason = f"{self.role} rank {self._names(slot)} is restarting after: {reason}"
            else:
                slot.state = "down"
                slot.reason = f"{self.role} rank {self._names(slot)} is down after: {reason}" + (
                    f" (not restarted: {self.max_restarts} restart(s) in a row used)"
                    if self.max_restarts
                    else " (rank restarts are off)"
                )
        log.error("%s", reason)
        if slot.state == "restarting":
            log.warning(
                "restarting %s rank %s in %.1f s (restart %d of %d in a row)",
                self.role,
                self._names(slot),
                delay,
                slot.deaths_in_a_row,
                self.max_restarts,
            )
        else:
            log.error("%s", slot.reason)
        # The group's other ranks keep their part of these jobs: they fail as the peer learns
        # (``run_workload`` aborts the request on the other side, or the peer's heartbeat).
        self._fail_pending(lambda r: reason if r in slot.ranks else None)

    def _restart(self, slot: _Slot) -> None:
        try:
            self._spawn(slot)
        except Exception as exc:  # e.g. out of processes: count it as another death
            log.error("cannot restart %s rank %s: %s", self.role, self._names(slot), exc)
            slot.restart_at = time.monotonic() + RESTART_BACKOFF_S[1]
            return
        self.restarts += 1
        log.warning("%s rank %s restarted as pid %d", self.role, self._names(slot), slot.process.pid)

    # -- jobs --------------------------------------------------------------------------------

    def _deliver(self, msg: dict) -> None:
        with self._lock:
            entry = self._pending.get(msg.get("id", -1))  # job ids are >= 0
            if entry is None:
                return
            fut, results, _ = entry
            results.setdefault(msg["rank"], msg)
            if len(results) < self.tp_size:
                return
            del self._pending[msg["id"]]
        fut.set_result([results[r] for r in range(self.tp_size)])

    def _fail_pending(self, reason_of: Callable[[int], str | None]) -> list[int | None]:
        """Give every pending job a failed result for each rank where ``reason_of(rank)``
        is a reason (and that has not answered yet); returns the rooms of the jobs hit."""
        done: list[tuple[Future, dict]] = []
        rooms: list[int | None] = []
        with self._lock:
            for job_id, (fut, results, room) in list(self._pending.items()):
                hit = False
                for r in range(self.tp_size):
                    reason = reason_of(r)
                    if reason is not None and r not in results:
                        results[r] = {"ok": False, "reason": reason, "rank": r}
                        hit = True
                if hit:
                    rooms.append(room)
                if len(results) == self.tp_size:
                    del self._pending[job_id]
                    done.append((fut, results))
        for fut, results in done:
            fut.set_result([results[r] for r in range(self.tp_size)])
        return rooms

    def _refused(self, reason: str) -> Future:
        fut: Future = Future()
        fut.set_result([{"ok": False, "reason": reason, "rank": r} for r in range(self.tp_size)])
        return fut

    def submit(self, job: dict) -> Future:
        """Run ``job`` on every rank; the future gives the per-rank results in rank order.
        Never raises for a dead rank: the job then fails with the reason."""
        with self._lock:
            if self._closed:
                raise KVXferError(f"{self.role} group is closed")
            down = [s.reason for s in self._slots if s.state != "up"]
            if down:
                return self._refused("; ".join(down))
            if self.max_jobs is not None and len(self._pending) >= self.max_jobs:
                return self._refused(
                    f"{self.role} group is busy: {len(self._pending)} job(s) in flight, "
                    f"its limit (--concurrency) is {self.max_jobs}"
                )
            job_id = self._next_id
            self._next_id += 1
            fut: Future = Future()
            self._pending[job_id] = (fut, {}, job.get("room"))
            conns = [s.conn for s in self._slots]
        self._send_all(conns, msgpack.packb(dict(job, op="transfer", id=job_id), use_bin_type=True))
        return fut

    def abort(self, room: int, reason: str) -> None:
        """Ask every rank to abort its request ``room`` now (its peer learns at once)."""
        with self._lock:
            conns = [s.conn for s in self._slots if s.state == "up"]
        self._send_all(conns, msgpack.packb({"op": "abort", "room": room, "reason": reason}, use_bin_type=True))

    def _send_all(self, conns: list, data: bytes) -> None:
        for conn in conns:
            try:
                with self._send_lock:
                    conn.send_bytes(data)
            except (OSError, ValueError):
                pass  # a dead rank: the watcher fails its part of the job

    @property
    def pids(self) -> list[int]:
        """The pid of each rank's process, in rank order (0 while none runs)."""
        out = [0] * self.tp_size
        for slot in self._slots:
            for r in slot.ranks:
                out[r] = (slot.proc.pid or 0) if slot.proc is not None and slot.state in ("starting", "up") else 0
        return out

    @property
    def states(self) -> list[str]:
        """``up``, ``starting``, ``restarting`` or ``down`` per rank."""
        out = [""] * self.tp_size
        for slot in self._slots:
            for r in slot.ranks:
                out[r] = slot.state
        return out

    def kill_rank(self, rank: int) -> None:
        """Kill the process of ``rank`` (fault-injection tests; with ``one_process`` that is
        the whole group)."""
        self._slots[0 if len(self._slots) == 1 else rank].process.kill()

    def close(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        stop = msgpack.packb({"op": "stop"})
        slots = [s for s in self._slots if s.proc is not None]
        self._send_all([s.conn for s in slots], stop)
        deadline = time.monotonic() + timeout_s
        for slot in slots:
            proc = slot.process
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(2)
        self._finished.set()
        if self._watcher is not threading.current_thread():
            self._watcher.join(2)
        for slot in slots:
            slot.pipe.close()
        self._fail_pending(lambda r: f"{self.role} group closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_groups(
    spec_p: dict, spec_d: dict, one_process: bool = False, ready_timeout_s: float = 120.0
) -> tuple[RankGroup, RankGroup]:
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
