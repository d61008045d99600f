"""The ``mori`` transport: one-sided RDMA writes through MORI-IO (AMD ROCm, ``amd-mori``).

Mapping: one ``IOEngine(key, IOEngineConfig(host, port))`` per
transport; its RDMA backend is created with ``RdmaBackendConfig(qp_per_transfer,
post_batch_size, num_worker_threads, POLLING, False)`` before any memory is registered
(MORI's backends only see memory registered after they exist). Built-in notification is
off: the engine sends its own "done" message after the ticket. Regions are
``register_memory(ptr, nbytes, device_id or -1, GPU|CPU)``; the agent descriptor carries
``EngineDesc.pack()`` and a region descriptor ``MemoryDesc.pack()``, each in our tagged
msgpack envelope. ``add_peer`` calls ``register_remote_engine``. Sessions are cached per
(local region, remote region) and created when the pair first exists (``import_region`` /
``register``) so connection setup and the target's MR registration happen before traffic.
A batch is one ``session.batch_write`` (entries over 4 GiB - 1 are split first); its
``TransferStatus`` stays referenced here until it reaches a terminal state, because MORI's
completion thread holds a raw pointer to it. ``wait_all`` blocks in ``engine.wait_all`` in
short slices so our deadline rules. Peer failures come from ``pop_peer_failure`` where the
installed MORI has it, and from ERR_RDMA_OP completions.

``mori.engine`` checks the options and creates the engine, after ``mori.probe`` has
checked in a child process that MORI can run (MORI ends the process with ``exit``/``abort``
when ROCm, an AMD GPU or an active RDMA port is missing). This module owns peers, regions,
sessions, statuses and their tickets; it must not import mori at import time.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sglang_kvxfer.errors import PeerGoneError, TransferTimeoutError, TransportError
from sglang_kvxfer.transports._common import UseTable, open_write, pack_descriptor, unpack_descriptor
from sglang_kvxfer.transports.base import (
    Caps,
    Entries,
    PeerFailure,
    Region,
    RemoteRegion,
    Ticket,
    Transport,
    check_secret,
    parse_device,
)
from sglang_kvxfer.transports.mori.engine import UINT32_MAX, EngineSettings, create_engine, int_option
from sglang_kvxfer.transports.ticket import _check_timeout, pending_or_raise

__all__ = ["MoriTransport"]

log = logging.getLogger("sglang_kvxfer.transports.mori")

_NAME = "mori"
_WAIT_SLICE_MS = 50  # longest single block inside engine.wait_all
_EVENT_POLL_S = 0.005  # how often a pending ticket drains pop_peer_failure
_abandoned: list = []  # statuses never terminal at close: MORI may still write them


@dataclass
class _MoriRegion:
    region: Region
    md: object  # MORI MemoryDesc


@dataclass
class _Peer:
    key: str  # MORI engine key
    desc: object  # MORI EngineDesc
    regions: dict = field(default_factory=dict)  # region_id -> (RemoteRegion, MemoryDesc)
    failed: str | None = None


class _Xfer:
    """One posted batch: the MORI status (kept alive until terminal) and its source lease."""

    __slots__ = ("transport", "peer_id", "status", "lease", "ticket")

    def __init__(self, transport: MoriTransport, peer_id: str, status: Any, lease: UseTable.Lease, label: str):
        self.transport, self.peer_id, self.status, self.lease = transport, peer_id, status, lease
        self.ticket = Ticket(label, progress=self)

    def __call__(self) -> bool:  # the ticket's progress hook
        return self.transport._progress(self)


class MoriTransport(Transport):
    """One-sided RDMA writes through MORI-IO (AMD GPUs and host memory, RDMA NICs).

    Parameters
    ----------
    host : address MORI's control plane listens on and advertises (peers fetch RDMA keys
        there); default ``KVXFER_MORI_HOST``, else the address of this host's name.
        ``0.0.0.0``/``::`` are refused.
    port : control-plane port (0: any free port).
    nics : RDMA devices to use (-> ``MORI_RDMA_DEVICES``); default ``KVXFER_MORI_NICS``,
        empty keeps ``MORI_RDMA_DEVICES`` from the environment (or all devices).
    qp_per_transfer, num_worker_threads, post_batch_size : ``RdmaBackendConfig`` fields;
        defaults ``KVXFER_MORI_QP_PER_TRANSFER`` (4), ``KVXFER_MORI_WORKERS`` (4),
        ``KVXFER_MORI_POST_BATCH_SIZE`` (-1, MORI's choice). MORI's ``MORI_IO_*`` variables
        override them inside MORI.
    engine_key : MORI engine key, unique among peers (default: host, pid, random tag).
    probe : check in a child process that MORI-IO can run here before creating the engine
        (default True; False only where that is known, e.g. tests against a fake MORI).
    warmup : create each (local, remote) session when the pair first exists (default True);
        False creates it at the pair's first write.
    max_entry_bytes : entries above this are split before posting (MORI's limit: 4 GiB - 1).
    close_timeout_s : how long ``deregister``/``remove_peer``/``close`` wait for writes.
    """

    name = _NAME
    caps = Caps(mem_kinds=frozenset({"cpu", "cuda"}), same_host_only=False, read_supported=False, one_sided=True)

    def __init__(
        self,
        *,
        host: str | None = None,
        port: int = 0,
        nics=None,
        qp_per_transfer: int | None = None,
        num_worker_threads: int | None = None,
        post_batch_size: int | None = None,
        engine_key: str | None = None,
        probe: bool = True,
        warmup: bool = True,
        max_entry_bytes: int = UINT32_MAX,
        close_timeout_s: float = 5.0,
    ):
        super().__init__()
        settings = EngineSettings.resolve(host, port, nics, qp_per_transfer, num_worker_threads, post_batch_size)
        self._max_entry = int_option("max_entry_bytes", max_entry_bytes, 1)
        if self._max_entry > UINT32_MAX:
            raise ValueError(f"max_entry_bytes must be <= {UINT32_MAX} (MORI's limit), got {max_entry_bytes}")
        self._warmup, self._close_timeout_s = warmup, close_timeout_s
        self._key = engine_key or f"kvxfer-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.settings = settings.describe()
        self._io, self._engine = create_engine(self._key, settings, probe)
        self._lock = threading.RLock()  # MORI's engine tables are not thread-safe
        self._ids = itertools.count(1)
        self._regions = UseTable()  # region_id -> _MoriRegion
        self._peers: dict[str, _Peer] = {}
        self._sessions: dict[tuple, object] = {}  # (local rid, peer id, remote rid) -> session
        self._inflight: set[_Xfer] = set()
        self._failures: list[PeerFailure] = []
        self._next_event_poll = 0.0

    # -- descriptors and peers ----------------------------------------------------------
    def agent_descriptor(self) -> bytes:
        self._check_open()
        return pack_descriptor(_NAME, "agent", engine=self._key, desc=bytes(self._engine.get_engine_desc().pack()))

    def add_peer(self, peer_id: str, descriptor: bytes, secret: bytes | None = None) -> None:
        """``secret`` is checked and not used: MORI does not authenticate engines (any
        that reaches the control-plane port can ask for memory regions; see
        docs/trust-model-transports.md). An existing ``peer_id`` is removed first (its
        pending writes fail), then re-added."""
        self._check_open()
        check_secret(secret, optional=True)
        if not isinstance(peer_id, str) or not peer_id:
            raise ValueError(f"peer_id must be a non-empty str, got {peer_id!r}")
        env = unpack_descriptor(descriptor, _NAME, "agent", {"engine": str, "desc": bytes})
        desc = self._unpack(self._io.EngineDesc, env["desc"], f"agent descriptor of {peer_id!r}")
        if desc.key != env["engine"] or desc.port <= 0 or desc.host in ("", "0.0.0.0", "::"):
            raise ValueError(
                f"agent descriptor of {peer_id!r}: MORI EngineDesc key={desc.key!r} "
                f"host={desc.host!r} port={desc.port} is not a reachable engine "
                f"{env['engine']!r}"
            )
        if peer_id in self._peers:  # a restarted or re-registered peer replaces its record
            try:
                self.remove_peer(peer_id)
            except ValueError:  # removed concurrently
                pass
        with self._lock:
            if peer_id in self._peers:
                raise ValueError(f"peer {peer_id!r} was added concurrently")
            if desc.key == self._key:
                raise ValueError(f"peer {peer_id!r} is this engine itself ({self._key!r})")
            self._engine.register_remote_engine(desc)
            self._peers[peer_id] = _Peer(desc.key, desc)

    @staticmethod
    def _unpack(cls, blob: bytes, what: str):
        try:
            return cls.unpack(blob)
        except (RuntimeError, ValueError, TypeError) as exc:  # MORI's parser: std::bad_cast
            raise ValueError(f"{what}: not a MORI {cls.__name__} ({exc})") from None

    def remove_peer(self, peer_id: str) -> None:
        with self._lock:
            peer = self._peers.pop(peer_id, None)
        if peer is None:
            raise ValueError(f"unknown peer {peer_id!r}")
        self._settle(lambda x: x.peer_id == peer_id, f"peer {peer_id!r} was removed with the write pending")
        with self._lock:
            for key in [k for k in self._sessions if k[1] == peer_id]:
                del self._sessions[key]
            self._engine.deregister_remote_engine(peer.desc)

    # -- regions ------------------------------------------------------------------------
    def register(self, ptr: int, nbytes: int, device: str = "cpu") -> Region:
        self._check_open()
        self._check_register_args(ptr, nbytes)
        kind, index = parse_device(device)
        loc = self._io.MemoryLocationType.CPU if kind == "cpu" else self._io.MemoryLocationType.GPU
        device = "cpu" if kind == "cpu" else f"cuda:{index}"
        with self._lock:
            try:
                md = self._engine.register_memory(ptr, nbytes, index, loc)
            except Exception as exc:
                raise TransportError(
                    f"mori: registering {nbytes} bytes at {ptr:#x} on {device} failed ({type(exc).__name__}: {exc})"
                ) from exc
            region_id = next(self._ids)
            descriptor = pack_descriptor(
                _NAME, "region", engine=self._key, region=region_id, device=device, md=bytes(md.pack())
            )
            region = Region(region_id, ptr, nbytes, device, descriptor)
            self._regions.add(region_id, _MoriRegion(region, md))
            if self._warmup:  # a peer that cannot be reached now fails its writes later
                for peer_id, peer in self._peers.items():
                    for rid in peer.regions:
                        try:
                            self._warm(region_id, peer_id, rid)
                        except TransportError as exc:
                            log.warning("%s", exc)
        return region

    def deregister(self, region: Region) -> None:
        rid = region.region_id
        if self._regions.get(rid) is None:
            raise ValueError(f"region {rid} is not registered here")
        self._settle(lambda x: x.lease.key == rid, f"local region {rid} was deregistered while being sent")
        entry = self._regions.remove(rid, self._close_timeout_s)
        with self._lock:
            for key in [k for k in self._sessions if k[0] == rid]:
                del self._sessions[key]
            self._engine.deregister_memory(entry.md)

    def import_region(self, peer_id: str, descriptor: bytes) -> RemoteRegion:
        self._check_open()
        env = unpack_descriptor(descriptor, _NAME, "region", {"engine": str, "region": int, "device": str, "md": bytes})
        with self._lock:
            peer = self._peers.get(peer_id)
            if peer is None:
                raise ValueError(f"unknown peer {peer_id!r} (add_peer it first)")
            md = self._unpack(self._io.MemoryDesc, env["md"], f"region {env['region']} of peer {peer_id!r}")
            if env["engine"] != peer.key or md.engine_key != peer.key:
                raise ValueError(
                    f"region descriptor belongs to engine {md.engine_key!r}, but "
                    f"peer {peer_id!r} is engine {peer.key!r}"
                )
            if md.size <= 0:
                raise ValueError(f"mori region descriptor: size must be > 0, got {md.size}")
            if env["region"] in peer.regions:
                raise ValueError(f"region {env['region']} of peer {peer_id!r} is already imported")
            remote = RemoteRegion(peer_id, env["region"], int(md.size), env["device"])
            peer.regions[remote.region_id] = (remote, md)
            if self._warmup:
                try:
                    for local_id, _ in self._regions.items():
                        self._warm(local_id, peer_id, remote.region_id)
                except TransportError:
                    del peer.regions[remote.region_id]
                    raise
        return remote

    def _warm(self, local_id: int, peer_id: str, remote_id: int):
        """The cached session of a pair, created now (connect, remote MR lookup) if needed."""
        key = (local_id, peer_id, remote_id)
        session = self._sessions.get(key)
        if session is None:
            local = self._regions.get(local_id)
            remote, md = self._peers[peer_id].regions[remote_id]
            try:
                session = self._engine.create_session(local.md, md)
            except RuntimeError as exc:  # unknown remote MR, unreachable control plane...
                raise TransportError(
                    f"mori: cannot open a session from local region "
                    f"{local_id} to region {remote_id} of peer {peer_id!r}: "
                    f"{exc}"
                ) from exc
            if session is None:
                raise TransportError(
                    f"mori: no MORI backend moves local region {local_id} "
                    f"({local.region.device}) to region {remote_id} of peer "
                    f"{peer_id!r} ({remote.device})"
                )
            self._sessions[key] = session
        return session

    # -- writes -------------------------------------------------------------------------
    def _write(self, local: Region, remote: RemoteRegion, entries: Entries) -> Ticket:
        label = f"mori write {local.region_id}->{remote.peer_id}:{remote.region_id}"
        with self._lock:
            self._check_open()
            self._drain_events()
            self._reap()
            peer = self._peers.get(remote.peer_id)
            imported = peer.regions.get(remote.region_id, (None,))[0] if peer is not None else None
            opened = open_write(label, peer, imported, remote, self._regions, local, entries)
            if isinstance(opened, Ticket):
                return opened
            _, lease = opened
            entries = _split_large(entries, self._max_entry)
            try:
                session = self._warm(local.region_id, remote.peer_id, remote.region_id)
                status = session.batch_write(
                    entries.local_offsets.tolist(),
                    entries.remote_offsets.tolist(),
                    entries.sizes.tolist(),
                    session.allocate_transfer_uid(),
                )
            except Exception as exc:  # MORI raises for some failures instead of a status
                self._regions.release(lease)
                return Ticket.failed(
                    label,
                    exc
                    if isinstance(exc, TransportError)
                    else TransportError(
                        f"mori: posting the write to peer {remote.peer_id!r} raised {type(exc).__name__}: {exc}"
                    ),
                )
            xfer = _Xfer(self, remote.peer_id, status, lease, label)
            self._inflight.add(xfer)
            xfer.ticket.poll()  # errors found at submission are already on the status
            return xfer.ticket

    def _progress(self, xfer: _Xfer) -> bool:
        code = xfer.status.Code()
        if code == self._io.StatusCode.IN_PROGRESS:
            if time.monotonic() >= self._next_event_poll:
                with self._lock:
                    self._drain_events()  # may fail this ticket (peer failure event)
            return False
        with self._lock:
            self._finish(xfer)
        if code == self._io.StatusCode.SUCCESS:
            return True
        xfer.ticket._fail(self._status_error(xfer, code))
        return False

    def _status_error(self, xfer: _Xfer, code) -> TransportError:
        """The one place MORI's status codes become our errors."""
        sc = self._io.StatusCode
        name = getattr(code, "name", str(code))
        message = xfer.status.Message()
        if code == sc.INIT:
            return TransportError(f"mori: MORI never started the write to peer {xfer.peer_id!r} (status INIT)")
        if code != sc.ERR_RDMA_OP:
            return TransportError(f"mori: the write to peer {xfer.peer_id!r} failed: {name}: {message}")
        reason = (
            f"mori: RDMA write to peer {xfer.peer_id!r} failed ({name}: {message}); the peer is unreachable or gone"
        )
        with self._lock:
            self._peer_failed(xfer.peer_id, reason)
        return PeerGoneError(reason)

    def _finish(self, xfer: _Xfer) -> None:
        """Forget a write whose status is terminal; under ``_lock``."""
        if xfer in self._inflight:
            self._inflight.discard(xfer)
            self._regions.release(xfer.lease)

    def _reap(self) -> None:
        """Drop writes whose status has ended, also where nobody polls the ticket any more
        (dropped, or failed early by a peer failure); under ``_lock``."""
        in_progress = self._io.StatusCode.IN_PROGRESS
        for xfer in list(self._inflight):
            if xfer.status.Code() != in_progress:
                xfer.ticket.poll()
                self._finish(xfer)

    def wait_all(self, tickets, timeout_s: float) -> None:
        """Wait until every ticket is DONE, blocking inside MORI (``engine.wait_all``, GIL
        released) in slices of at most 50 ms; failure wins. Raises like ``ticket.wait_all``.
        """
        tickets = list(tickets)
        deadline = time.monotonic() + _check_timeout(timeout_s)
        while True:
            pending = pending_or_raise(tickets)
            if not pending:
                return
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise TransferTimeoutError(
                    f"{len(pending)} of {len(tickets)} tickets not "
                    f"complete after {timeout_s} s (first: "
                    f"{pending[0].label})"
                )
            statuses = [t._progress.status for t in pending if isinstance(t._progress, _Xfer)]
            if statuses:
                self._engine.wait_all(statuses, max(1, min(_WAIT_SLICE_MS, left_ms)))
            else:
                pending[0].wait(min(_WAIT_SLICE_MS, left_ms) / 1000)

    # -- failures and lifetime ----------------------------------------------------------
    def _peer_failed(self, peer_id: str, reason: str) -> None:
        peer = self._peers.get(peer_id)
        if peer is None or peer.failed is not None:
            return
        peer.failed = reason
        self._failures.append(PeerFailure(peer_id, reason))
        log.warning("%s", reason)
        for xfer in list(self._inflight):
            if xfer.peer_id == peer_id:  # its status stays referenced until terminal
                xfer.ticket._fail(PeerGoneError(reason))

    def _drain_events(self) -> None:
        """Turn MORI's peer-failure events (wheel >= 1.2.4) into failed peers; under _lock."""
        self._next_event_poll = time.monotonic() + _EVENT_POLL_S
        pop = getattr(self._engine, "pop_peer_failure", None)
        if pop is None:
            return
        by_key = {p.key: pid for pid, p in self._peers.items()}
        for _ in range(10_000):  # bounded: MORI could report faster than we drain
            event = pop()
            if event is None:
                break
            reason_name = getattr(event.reason, "name", str(event.reason))
            text = (
                f"mori: peer failure {reason_name} on {event.device_name} port "
                f"{event.port_num} qp {event.qp_num}: {event.detail}"
            )
            peer_id = by_key.get(event.remote_engine_key)
            if peer_id is None:
                self._failures.append(PeerFailure(event.remote_engine_key or "(local device)", text))
            else:
                self._peer_failed(peer_id, f"{text} (peer {peer_id!r})")

    def peer_failures(self) -> list[PeerFailure]:
        with self._lock:
            if not self._closed:
                self._drain_events()
                self._reap()
            out, self._failures = self._failures, []
        return out

    def _settle(self, which, reason: str) -> None:
        """Wait (bounded) until the matching writes end; fail the rest and keep their
        statuses forever (MORI may still complete them through a raw pointer)."""
        deadline = time.monotonic() + self._close_timeout_s
        in_progress = self._io.StatusCode.IN_PROGRESS
        while True:
            with self._lock:
                self._reap()
                pending = [x for x in self._inflight if which(x)]
            for xfer in pending:
                xfer.ticket.poll()
            pending = [x for x in pending if x.status.Code() == in_progress]
            if not pending or time.monotonic() >= deadline:
                break
            self._engine.wait_all([x.status for x in pending], _WAIT_SLICE_MS)
        with self._lock:
            for xfer in [x for x in self._inflight if which(x)]:
                xfer.ticket._fail(TransportError(f"mori: {reason}"))
                if xfer.status.Code() == in_progress:
                    _abandoned.append(xfer.status)
                    log.warning("mori: %s; a MORI status is kept for the process lifetime", reason)
                self._finish(xfer)

    def _close(self) -> None:
        self._settle(lambda x: True, "the mori transport was closed with the write pending")
        with self._lock:
            self._sessions.clear()
            for rid, entry in self._regions.items():
                self._regions.remove(rid, 0)
                self._engine.deregister_memory(entry.md)
            for peer in self._peers.values():
                self._engine.deregister_remote_engine(peer.desc)
            self._peers.clear()
            self._engine = None  # MORI's destructor stops its threads


def _split_large(entries: Entries, limit: int) -> Entries:
    """Cut entries above ``limit`` bytes into consecutive pieces of at most ``limit``."""
    sz = entries.sizes
    if int(sz.max()) <= limit:
        return entries
    pieces = -(-sz // limit)
    owner = np.repeat(np.arange(sz.shape[0]), pieces)
    start = (np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * limit
    return Entries(
        entries.local_offsets[owner] + start,
        entries.remote_offsets[owner] + start,
        np.minimum(limit, sz[owner] - start),
    )
