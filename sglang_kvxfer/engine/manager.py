"""What a prefill rank and a decode rank share: resources, workers, rooms, liveness.

Owns ``RankBase``: the transport, the registered KV pool and staging arena, the control
channel, the worker threads, the table of rooms (one ``RequestState`` each), deadline
checks, and heartbeats with peer-death detection. The two roles (``prefill.py``,
``decode.py``) implement its abstract hooks (``_on_message``, ``_peers``, ``_peer_lost``,
``_fail_room``, ``abort``, ``release``) and add their data path. ``KVManager``
(``factory.py``) builds the right one from an ``EngineConfig``.
Must not: import the roles (they import this module), or know a role's messages.

Locking: ``self._lock`` guards the room and peer tables; it is never held while waiting
on a transport, a socket or another thread.
"""

from __future__ import annotations

import abc
import collections
import functools
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast

from sglang_kvxfer.engine.config import EngineConfig
from sglang_kvxfer.engine.control import ControlChannel
from sglang_kvxfer.engine.copystream import CopyStream
from sglang_kvxfer.engine.liveness import PeerProcess, host_id
from sglang_kvxfer.engine.pool import KVPool, StagingArena
from sglang_kvxfer.protocol.fields import Side
from sglang_kvxfer.protocol.messages import Heartbeat
from sglang_kvxfer.protocol.state import Deadlines, KVPoll, RequestState
from sglang_kvxfer.transports import get_transport

if TYPE_CHECKING:
    from sglang_kvxfer.metrics import RequestRecord
    from sglang_kvxfer.transports.base import Transport

__all__ = ["RankBase", "RoomRecord", "Worker", "Peer", "RequestHandle"]

log = logging.getLogger("sglang_kvxfer.engine")


class Worker:
    """One thread running submitted callables in order; ``pending`` counts those queued or
    running (``RankBase.idle_worker`` picks by it)."""

    def __init__(self, name: str):
        self._q: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._count = threading.Lock()
        self.pending = 0
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        with self._count:
            self.pending += 1
        self._q.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._q.get()
            if fn is None:
                return
            try:
                if not self._closing:  # a closing rank starts nothing: its memory is about to go
                    fn()
            except Exception:
                log.exception("worker task failed")
            finally:
                with self._count:
                    self.pending -= 1

    def close(self, timeout_s: float) -> bool:
        """Stop after the task running now (queued ones are dropped). True once the thread
        has ended; False if that task still runs after ``timeout_s``."""
        self._closing = True
        self._q.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


class Peer:
    """A registered peer process (one session of one rank)."""

    def __init__(self, session: str, tp_rank: int, endpoint: str, now: float):
        self.session, self.tp_rank, self.endpoint = session, tp_rank, endpoint
        self.last_seen = now
        self.alive = True
        # its process, when it runs on this host in this PID namespace (first heartbeat)
        self.process: PeerProcess | None = None
        self.starved_since: float | None = None  # a silence past the timeout given grace


class RoomRecord(Protocol):
    """What ``RankBase`` needs of a role's room record (``PrefillRoom``, ``DecodeRoom``)."""

    room: int
    state: RequestState
    ended: threading.Event  # set when ``state`` becomes Success or Failed

    def record(self, tp_rank: int) -> RequestRecord: ...


R = TypeVar("R", bound=RoomRecord)
T = TypeVar("T")
RankT = TypeVar("RankT", bound="RankBase[Any]")


class RankBase(abc.ABC, Generic[R]):
    """Resources and bookkeeping of one rank; see ``PrefillManager`` / ``DecodeManager``.
    ``R`` is the role's room record (``PrefillRoom``, ``DecodeRoom``)."""

    side: Side
    _rooms: dict[int, R]

    def __init__(self, config: EngineConfig, pool: KVPool | None = None):
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        if config.role != self.side.value:
            raise ValueError(f"config.role={config.role!r} but this is a {self.side.value} manager")
        self.config = config
        self.placement = config.placement
        self.session = secrets.token_hex(8)
        self.deadlines = Deadlines(config.bootstrap_timeout_s, config.waiting_timeout_s, config.transfer_timeout_s)
        self._lock = threading.RLock()
        self._rooms = {}
        self._closed = False
        # Security events by kind (room_conflict, unexpected_sender, ...): Prometheus counts them.
        self.security_events: dict[str, int] = collections.defaultdict(int)
        # Called with each finished request's RequestRecord (metrics.py); on engine threads.
        self.request_listeners: list[Callable[[RequestRecord], Any]] = []
        # None before construction finished and after close().
        self.transport: Transport | None = None
        self.pool: KVPool | None = None
        self.staging: StagingArena | None = None
        self.control: ControlChannel | None = None
        self._workers: list[Worker] = []
        self._helpers: list[threading.Thread] = []
        try:
            device = pool.device if pool is not None else config.device
            from sglang_kvxfer import ops  # torch: not at import time

            ops.check_native_backend(device)  # before any memory is taken
            self.transport = transport = get_transport(config.transport, **config.transport_options)
            shared = config.transport == "local" and config.device == "cpu"
            if pool is not None and pool.placement != self.placement:
                raise ValueError("pool was built for another placement than config")
            self.pool = pool = pool or KVPool.allocate(self.placement, config.device, shared=shared)
            # Gathers and scatters run on this rank's own stream of the pool's device.
            self.copy_stream = CopyStream(pool.device)
            self.kv_descriptors = pool.register(transport)
            # Lazy: no byte until a transfer is staged, then grown on demand up to the cap.
            self.staging = StagingArena(config.staging_bytes, pool.device, shared=shared, transport=transport)
            self._workers = [
                Worker(f"kvxfer-{self.side.value}{config.tp_rank}-w{i}") for i in range(config.num_workers)
            ]
            self._hb_seq = 0
            self._next_heartbeat = 0.0
            self._pid = os.getpid()  # what heartbeats name as this rank's process
            self._last_tick: float | None = None
            self.control = ControlChannel(
                config.host,
                self._on_message,
                self._on_tick,
                f"{self.side.value}{config.tp_rank}",
                session=self.session,
                key=config.key,
            )
        except BaseException:
            self.close()
            raise

    # -- helpers for the roles -----------------------------------------------------------------
    @property
    def tp_rank(self) -> int:
        return self.config.tp_rank

    def _open(self, resource: T | None, what: str) -> T:
        """``resource``, or a clear error where it is None: the manager is closed (or was
        never fully built), so there is no transport, pool, staging arena or channel."""
        if resource is None:
            raise RuntimeError(f"{self.side.value} rank {self.tp_rank} has no {what}: the manager is closed")
        return resource

    @property
    def _live_transport(self) -> Transport:
        return self._open(self.transport, "transport")

    @property
    def _live_pool(self) -> KVPool:
        return self._open(self.pool, "KV pool")

    @property
    def _live_staging(self) -> StagingArena:
        return self._open(self.staging, "staging arena")

    @property
    def _live_control(self) -> ControlChannel:
        return self._open(self.control, "control channel")

    def start_thread(self, target: Callable[..., None], name: str, *args: Any) -> None:
        """A helper thread that ``close()`` joins (it must check ``self._closed`` often)."""
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._helpers.append(thread)
        thread.start()

    def idle_worker(self) -> Worker:
        """The worker with the fewest tasks queued or running. A room whose tasks must run
        in order uses one worker while it has any queued; picking the idlest for its next
        batch keeps two requests in flight from queueing behind each other on one worker
        while another is idle (by room id, half of all pairs would)."""
        return min(self._workers, key=lambda w: w.pending)

    def new_state(self, room: int) -> RequestState:
        return RequestState(room, self.side, time.monotonic(), self.deadlines)

    def room(self, room: int) -> R | None:
        with self._lock:
            return self._rooms.get(room)

    def num_inflight(self) -> int:
        """Requests on this rank that have not succeeded or failed yet."""
        with self._lock:
            return sum(not rec.state.is_terminal for rec in self._rooms.values())

    def _request_ended(self, rec: R) -> None:
        """Give the finished room's record to the listeners; a listener's error is logged,
        never raised into the data path."""
        if not self.request_listeners:
            return
        record = rec.record(self.tp_rank)
        for listener in list(self.request_listeners):
            try:
                listener(record)
            except Exception:
                log.exception("request listener failed for room %d", rec.room)

    # -- the hooks each role implements ----------------------------------------------------------
    @abc.abstractmethod
    def _on_message(self, msg: Any, sender: str) -> None:
        """One authenticated control message from session ``sender`` (I/O thread)."""

    @abc.abstractmethod
    def _peers(self) -> list[Peer]:
        """Peers to send heartbeats to and watch."""

    @abc.abstractmethod
    def _peer_lost(self, peer: Peer, reason: str) -> None:
        """A peer stopped answering."""

    @abc.abstractmethod
    def _fail_room(self, rec: R, reason: str, notify: bool = True, already_failed: bool = False) -> None:
        """Fail a room here and, when ``notify``, tell the peers involved."""

    @abc.abstractmethod
    def abort(self, rec: R, reason: str) -> None:
        """Abort a room on behalf of this side's caller and tell the peers involved."""

    @abc.abstractmethod
    def release(self, room: int) -> None:
        """The caller is done with ``room``: forget it once it has ended."""

    def security_event(self, kind: str, text: str, *args: Any) -> None:
        """Count a security event and log it at ERROR (rate-limited per kind)."""
        self.security_events[kind] += 1
        count = self.security_events[kind]
        if count <= 5 or count % 1000 == 0:
            log.error("%s rank %d security (%s, %d so far): " + text, self.side.value, self.tp_rank, kind, count, *args)

    # -- the I/O thread's periodic work ----------------------------------------------------------
    def _on_tick(self, now: float) -> None:
        last, self._last_tick = self._last_tick, now
        if last is not None and now - last > self.config.heartbeat_timeout_s:
            # This rank did not run (SIGSTOP, a debugger, a starved host): its peers' silence
            # is its own doing. Give every peer a fresh heartbeat window instead of declaring
            # them all dead; a peer that really died is caught one window later.
            log.warning(
                "%s rank %d did not run for %.1f s (stopped or starved); peers get a fresh heartbeat window",
                self.side.value,
                self.tp_rank,
                now - last,
            )
            for peer in self._peers():
                peer.last_seen = max(peer.last_seen, now)
            self._next_heartbeat = 0.0
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.config.heartbeat_interval_s
            self._hb_seq += 1
            for peer in self._peers():
                self._live_control.send(
                    peer.endpoint,
                    Heartbeat(
                        session=self.session,
                        side=self.side,
                        tp_rank=self.tp_rank,
                        seq=self._hb_seq,
                        sent_at=max(now, 0.0),
                        host=host_id(),
                        pid=self._pid,
                    ),
                )
        for peer in self._peers():
            if peer.alive:
                self._watch(peer, now)
        with self._lock:
            rooms = list(self._rooms.values())
        for rec in rooms:
            state = rec.state
            deadline = state.deadline  # None only once terminal
            if not state.is_terminal and deadline is not None and now >= deadline:
                with self._lock:
                    expired = state.check_deadline(now, functools.partial(self._waiting_for, rec))
                if expired:
                    # check_deadline() failed the room, which always sets a reason
                    self._fail_room(rec, cast(str, state.reason), notify=True, already_failed=True)

    def _heard(self, peer: Peer, msg: Heartbeat) -> None:
        """A heartbeat of ``peer`` (I/O thread): it is alive; a peer process on this host is
        watched from its first heartbeat on."""
        peer.last_seen = time.monotonic()
        if peer.process is not None:
            peer.process.quiet()
        elif msg.pid and msg.host and msg.host == host_id() and msg.pid != os.getpid():
            peer.process = PeerProcess(msg.pid, self.config.heartbeat_timeout_s / 4)
        if peer.starved_since is not None:
            log.warning(
                "%s rank %d: peer %s (session %s) spoke again after %.1f s past the heartbeat timeout",
                self.side.value,
                self.tp_rank,
                peer.endpoint,
                peer.session,
                peer.last_seen - peer.starved_since,
            )
            peer.starved_since = None

    def _watch(self, peer: Peer, now: float) -> None:
        """Declare a silent peer lost (``_peer_lost``) when it is: at the heartbeat timeout,
        or at once when its process on this host exited; a peer process on this host that the
        kernel still schedules gets ``heartbeat_starved_grace_s`` more (I/O thread)."""
        cfg = self.config
        silent = now - peer.last_seen
        proc = peer.process
        verdict = None
        if proc is not None and silent > 2 * cfg.heartbeat_interval_s:
            proc.look(now)
            verdict = proc.verdict()
        base = (
            f"peer {peer.endpoint} (session {peer.session}) sent nothing for "
            f"{silent:.1f} s (KVXFER_HEARTBEAT_TIMEOUT_S={cfg.heartbeat_timeout_s})"
        )
        if verdict == "exited":
            assert proc is not None
            peer.alive = False
            self._peer_lost(peer, f"{base}: its process {proc.pid} on this host exited")
            return
        if silent <= cfg.heartbeat_timeout_s:
            return
        if verdict == "scheduled" and silent <= cfg.heartbeat_timeout_s + cfg.heartbeat_starved_grace_s:
            assert proc is not None  # a verdict comes only from a watched process
            if peer.starved_since is None:
                peer.starved_since = now
                log.warning(
                    "%s rank %d: %s, but its process %d on this host is still scheduled (%.0f%% of a core "
                    "running or waiting for one: starved, not dead); waiting up to %.1f s more "
                    "(KVXFER_HEARTBEAT_STARVED_GRACE_S)",
                    self.side.value,
                    self.tp_rank,
                    base,
                    proc.pid,
                    100 * (proc.share or 0.0),
                    cfg.heartbeat_starved_grace_s,
                )
            return
        note = ""
        if proc is not None and verdict == "stopped":
            note = f": its process {proc.pid} on this host is stopped"
        elif proc is not None and verdict == "scheduled":
            note = (
                f": its process {proc.pid} on this host is still scheduled, past "
                f"KVXFER_HEARTBEAT_STARVED_GRACE_S={cfg.heartbeat_starved_grace_s}"
            )
        peer.alive = False
        self._peer_lost(peer, base + note)

    def _waiting_for(self, rec: R, poll: KVPoll) -> str:
        """What room ``rec`` in state ``poll`` waits for, for its timeout's reason (under
        ``_lock``; "" when nothing more than the state is known)."""
        return ""

    def poll(self, room: int) -> KVPoll:
        rec = self.room(room)
        return KVPoll.Failed if rec is None else rec.state.poll

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop threads, deregister memory, close the transport. Idempotent, bounded."""
        if getattr(self, "_closed", False) and self.control is None:
            return
        self._closed = True
        for thread in getattr(self, "_helpers", []):
            if thread is not threading.current_thread():
                thread.join(timeout_s)
        if self.control is not None:
            self.control.close(timeout_s)
            self.control = None
        # Nothing may write into memory after it is freed: workers stop first, then the
        # regions are deregistered while the transport runs (a receive into one is waited
        # for, or stopped), then the transport closes, and only then is memory released.
        # Memory a writer might still touch stays mapped for the life of the process.
        stuck = [w for w in self._workers if not w.close(timeout_s)]
        self._workers = []
        if stuck:
            log.error(
                "%s rank %d: %d worker(s) still running after %.0f s; its KV pool and staging memory stay mapped",
                self.side.value,
                self.tp_rank,
                len(stuck),
                timeout_s,
            )
        clean = [res.deregister() for res in (self.pool, self.staging) if res is not None]
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        for res in (self.pool, self.staging):
            if res is not None:
                res.release(free=not stuck and all(clean))
        self.pool = self.staging = None

    def __enter__(self: RankT) -> RankT:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RequestHandle:
    """What ``KVSender`` and ``KVReceiver`` share: the request's poll, its failure, abort,
    its metrics record and ``clear``. Subclasses set ``mgr``, ``room`` and ``_rec``."""

    mgr: RankBase[Any]
    room: int
    _rec: RoomRecord
    _abort_reason = "aborted"

    def poll(self) -> KVPoll:
        return self._rec.state.poll

    def wait(self, timeout_s: float) -> KVPoll:
        """Block until the request succeeded or failed, at most ``timeout_s`` seconds, and
        return its poll (not terminal after a timeout). Woken by the transition itself: no
        polling, for callers that have nothing else to do meanwhile."""
        if timeout_s < 0:
            raise ValueError(f"timeout_s={timeout_s} must be >= 0")
        self._rec.ended.wait(timeout_s)
        return self._rec.state.poll

    @property
    def failure_reason(self) -> str | None:
        return self._rec.state.reason

    def failure_exception(self) -> None:
        from sglang_kvxfer.errors import TransferFailedError

        raise TransferFailedError(self._rec.state.reason or "the transfer failed", self.room)

    def abort(self, reason: str | None = None) -> None:
        self.mgr.abort(self._rec, reason or self._abort_reason)

    @property
    def record(self) -> RequestRecord:
        """This request on this rank: bytes, ops, phases and its transfer window (metrics.py)."""
        return self._rec.record(self.mgr.tp_rank)

    def clear(self) -> None:
        """Forget the request on this rank (after it ended)."""
        self.mgr.release(self.room)
