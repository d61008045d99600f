"""The ``tcp`` transport: writes into a peer's registered host memory over TCP, no RDMA.

Owns the sender and receiver sides of one small binary protocol (no pickle, no eval):

* Each transport listens on ``host:port``. A writer opens ``num_connections`` connections
  per peer, lazily, each greeted with HELLO (magic, version, sender agent, target agent).
* A batch is coalesced, split by bytes over the connections (large entries are cut), and
  each share goes as one WRITE frame: a fixed header, a ``(remote_offset, size)`` table,
  then the payload sent with ``sendmsg`` straight from views of the registered memory.
* The receiver checks every entry against its region table first; a write outside a
  registered region is refused (payload drained, never stored) and the ACK says why.
  Otherwise ``recvmsg_into`` reads the payload straight into views of the region.
* One ACK per frame completes that share of the ticket. A lost connection fails every
  outstanding ticket of that peer with ``PeerGoneError`` naming the peer, and is recorded
  as a ``PeerFailure``; the peer stays failed until ``remove_peer``/``add_peer``.

Frames (little-endian): WRITE/BYE header ``<B3xIQQQ`` = type, n_entries, xfer_id,
region_id, total_bytes; table ``n_entries x <QQ``; ACK ``<BB2xIQ`` = type, status,
reason length, xfer_id, then the UTF-8 reason. This module must not import torch.
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from sglang_kvxfer import envs
from sglang_kvxfer.errors import PeerGoneError, TransportError
from sglang_kvxfer.transports._memory import IOV_MAX, view
from sglang_kvxfer.transports.base import (Caps, Entries, PeerFailure, Region, RemoteRegion,
                                           Ticket, Transport, UseTable, pack_descriptor,
                                           parse_device, unpack_descriptor)

__all__ = ["TcpTransport"]

log = logging.getLogger(__name__)

_NAME = "tcp"
MAGIC, WIRE_VERSION = b"KVXT", 1
HELLO = struct.Struct("<4sHHH")        # magic, version, len(sender agent), len(target agent)
HELLO_REPLY = struct.Struct("<4sHBxI")  # magic, version, status (0 ok), reason length
HEADER = struct.Struct("<B3xIQQQ")     # type, n_entries, xfer_id, region_id, total_bytes
ACK = struct.Struct("<BB2xIQ")         # type, status (0 ok, 1 refused), reason length, xfer_id
T_WRITE, T_ACK, T_BYE = 1, 2, 3
MAX_ENTRIES = 1 << 20                  # entries per frame the receiver accepts
MAX_TEXT = 1 << 12                     # agent names and reasons
_DRAIN = 1 << 20


class _Violation(Exception):
    """The other end broke the wire protocol; the connection cannot continue."""


# -- socket helpers ---------------------------------------------------------------------


def _send_all(sock: socket.socket, bufs: list, on_progress=None) -> None:
    """Send every buffer (memoryviews), up to IOV_MAX per ``sendmsg``; resumes partial sends."""
    i, n = 0, len(bufs)
    while i < n:
        sent = sock.sendmsg(bufs[i:i + IOV_MAX])
        if on_progress is not None:
            on_progress()
        while i < n and sent >= bufs[i].nbytes:
            sent -= bufs[i].nbytes
            i += 1
        if sent:
            bufs[i] = bufs[i][sent:]


def _recv_all_into(sock: socket.socket, bufs: list, *, eof_ok: bool = False) -> bool:
    """Fill every buffer (memoryviews) from ``sock``; False on EOF before the first byte.

    A connection closed after the first byte raises ``ConnectionError`` (a torn frame).
    """
    i, n, first = 0, len(bufs), True
    while i < n and bufs[i].nbytes == 0:
        i += 1
    while i < n:
        got = sock.recvmsg_into(bufs[i:i + IOV_MAX])[0]
        if got == 0:
            if first and eof_ok:
                return False
            raise ConnectionError("connection closed in the middle of a frame")
        first = False
        while i < n and got >= bufs[i].nbytes:
            got -= bufs[i].nbytes
            i += 1
        if got:
            bufs[i] = bufs[i][got:]
    return True


def _recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    buf = bytearray(nbytes)
    _recv_all_into(sock, [memoryview(buf)])
    return bytes(buf)


def _shutdown(sock: socket.socket | None) -> None:
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


# -- sender side ------------------------------------------------------------------------


@dataclass
class _Job:
    xfer_id: int
    ticket: Ticket
    lease: UseTable.Lease
    bufs: list


class _Conn:
    """One outgoing connection to a peer: a sender thread and an ACK reader thread."""

    def __init__(self, owner: "TcpTransport", peer_id: str, peer: "_Peer", index: int):
        self.owner, self.peer_id, self.peer, self.index = owner, peer_id, peer, index
        self.sock: socket.socket | None = None
        self.cond = threading.Condition()
        self.queue: collections.deque[_Job] = collections.deque()
        self.outstanding: dict[int, Ticket] = {}
        self.sending: _Job | None = None
        self.dead: str | None = None
        self.stopping = False
        self.last_progress = time.monotonic()
        self.threads: list[threading.Thread] = []

    @property
    def where(self) -> str:
        return f"peer {self.peer_id!r} at {self.peer.host}:{self.peer.port}"

    def submit(self, job: _Job) -> None:
        with self.cond:
            if self.dead is None and not self.stopping:
                self.queue.append(job)
                if not self.threads:
                    self._start()
                self.cond.notify()
                return
            reason = self.dead or f"connection to {self.where} is closing"
        self.owner._regions.release(job.lease)
        job.ticket._fail(PeerGoneError(reason))

    def _start(self) -> None:
        thread = threading.Thread(target=self._run_sender, daemon=True,
                                  name=f"kvxfer-tcp-send-{self.peer_id}-{self.index}")
        self.threads.append(thread)
        thread.start()

    def uses_region(self, region_id: int) -> bool:
        with self.cond:
            return any(j.lease.key == region_id for j in (self.sending, *self.queue) if j)

    def _touch(self) -> None:
        self.last_progress = time.monotonic()

    def _run_sender(self) -> None:
        try:
            self._connect()
            while True:
                with self.cond:
                    while not self.queue and not self.stopping and self.dead is None:
                        self.cond.wait()
                    if self.dead is not None:
                        return
                    if not self.queue:  # stopping with nothing left to send
                        break
                    job = self.sending = self.queue.popleft()
                    self.outstanding[job.xfer_id] = job.ticket
                try:
                    _send_all(self.sock, job.bufs, self._touch)
                finally:
                    with self.cond:
                        self.sending = None
                    self.owner._regions.release(job.lease)  # the source is no longer read
            self.sock.sendall(HEADER.pack(T_BYE, 0, 0, 0, 0))
        except (OSError, _Violation) as exc:
            self.fail(f"connection {self.index} to {self.where} lost: {_describe(exc)}")

    def _connect(self) -> None:
        timeout = self.owner._io_timeout_s
        self.sock = socket.create_connection((self.peer.host, self.peer.port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        me, them = self.owner._agent.encode(), self.peer.agent.encode()
        self.sock.sendall(HELLO.pack(MAGIC, WIRE_VERSION, len(me), len(them)) + me + them)
        magic, version, status, n = HELLO_REPLY.unpack(_recv_exact(self.sock, HELLO_REPLY.size))
        if magic != MAGIC or version != WIRE_VERSION:
            raise _Violation(f"bad HELLO reply (magic {magic!r}, version {version})")
        if status != 0:
            reason = _recv_exact(self.sock, min(n, MAX_TEXT)).decode(errors="replace")
            raise _Violation(f"peer refused the connection: {reason}")
        reader = threading.Thread(target=self._run_acks, daemon=True,
                                  name=f"kvxfer-tcp-ack-{self.peer_id}-{self.index}")
        self.threads.append(reader)
        reader.start()

    def _run_acks(self) -> None:
        buf = bytearray()
        try:
            while True:
                try:
                    chunk = self.sock.recv(1 << 16)
                except TimeoutError:
                    with self.cond:
                        waiting = bool(self.outstanding) or self.sending is not None
                    idle = time.monotonic() - self.last_progress
                    if waiting and idle > self.owner._io_timeout_s:
                        raise TimeoutError(f"no progress for {idle:.1f} s") from None
                    continue
                if not chunk:
                    with self.cond:
                        if self.stopping and not self.outstanding:
                            return
                    raise ConnectionError("connection closed by the peer")
                buf += chunk
                self._touch()
                while len(buf) >= ACK.size:
                    kind, status, n, xfer_id = ACK.unpack_from(buf)
                    if kind != T_ACK or n > MAX_TEXT:
                        raise _Violation(f"bad ACK frame (type {kind}, reason length {n})")
                    if len(buf) < ACK.size + n:
                        break
                    reason = bytes(buf[ACK.size:ACK.size + n]).decode(errors="replace")
                    del buf[:ACK.size + n]
                    self._acked(xfer_id, status, reason)
        except (OSError, _Violation) as exc:
            self.fail(f"connection {self.index} to {self.where} lost: {_describe(exc)}")

    def _acked(self, xfer_id: int, status: int, reason: str) -> None:
        with self.cond:
            ticket = self.outstanding.pop(xfer_id, None)
        if ticket is None:
            raise _Violation(f"ACK for unknown transfer {xfer_id}")
        if status == 0:
            ticket._part_done()
        else:
            ticket._fail(TransportError(f"{self.where} refused the write: {reason}"))

    def fail(self, reason: str, *, peer_failure: bool = True, error_cls=PeerGoneError) -> None:
        """Mark dead, fail everything queued or awaiting an ACK, and tell the owner."""
        with self.cond:
            if self.dead is not None:
                return
            self.dead = reason
            jobs, self.queue = list(self.queue), collections.deque()
            tickets = list(self.outstanding.values()) + [j.ticket for j in jobs]
            self.outstanding.clear()
            self.cond.notify_all()
        _shutdown(self.sock)
        for job in jobs:
            self.owner._regions.release(job.lease)
        error = error_cls(reason)
        for ticket in tickets:
            ticket._fail(error)
        if peer_failure and not self.stopping:
            self.owner._peer_failed(self.peer_id, self.peer, reason)

    def stop(self, reason: str, deadline: float) -> None:
        """Send what is queued (bounded by ``deadline``), say BYE, close; fail what is left."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        for thread in self.threads[:1]:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self.cond:
            clean = not self.outstanding and not self.queue
        if clean and self.threads:  # let the ACK reader see the peer close after BYE
            self.threads[-1].join(min(0.2, max(0.0, deadline - time.monotonic())))
        self.fail(reason, peer_failure=False, error_cls=TransportError)
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if self.sock is not None:
            self.sock.close()


@dataclass
class _Peer:
    agent: str
    host: str
    port: int
    conns: list = field(default_factory=list)
    regions: dict = field(default_factory=dict)
    failed: str | None = None
    turn: int = 0


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


# -- receiver side ----------------------------------------------------------------------


class _Inbound:
    """One accepted connection: checks WRITE frames, reads payloads into regions, ACKs."""

    def __init__(self, owner: "TcpTransport", sock: socket.socket, addr):
        self.owner, self.sock, self.addr = owner, sock, addr
        self.agent: str | None = None
        self.region_id: int | None = None  # the region being filled right now
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"kvxfer-tcp-recv-{addr[0]}:{addr[1]}")

    def _run(self) -> None:
        reason = None
        try:
            self._handshake()
            header = bytearray(HEADER.size)
            while True:
                if not _recv_all_into(self.sock, [memoryview(header)], eof_ok=True):
                    reason = "closed without BYE"
                    break
                kind, num_entries, xfer_id, region_id, total = HEADER.unpack(header)
                if kind == T_BYE:
                    break
                if kind != T_WRITE:
                    raise _Violation(f"unknown frame type {kind}")
                if num_entries > MAX_ENTRIES:
                    raise _Violation(f"{num_entries} entries in one frame (limit {MAX_ENTRIES})")
                self._serve_write(num_entries, xfer_id, region_id, total)
        except (OSError, _Violation) as exc:
            reason = _describe(exc)
        finally:
            self.sock.close()
            self.owner._inbound_closed(self, reason)

    def _handshake(self) -> None:
        self.sock.settimeout(self.owner._io_timeout_s)
        magic, version, n_from, n_to = HELLO.unpack(_recv_exact(self.sock, HELLO.size))
        if magic != MAGIC or version != WIRE_VERSION or max(n_from, n_to) > MAX_TEXT:
            raise _Violation(f"bad HELLO (magic {magic!r}, version {version})")
        self.agent = _recv_exact(self.sock, n_from).decode(errors="replace")
        target = _recv_exact(self.sock, n_to).decode(errors="replace")
        if target != self.owner._agent:
            reason = f"this is agent {self.owner._agent!r}, not {target!r}".encode()
            self.sock.sendall(HELLO_REPLY.pack(MAGIC, WIRE_VERSION, 1, len(reason)) + reason)
            raise _Violation(f"HELLO for agent {target!r}")
        self.sock.sendall(HELLO_REPLY.pack(MAGIC, WIRE_VERSION, 0, 0))
        self.sock.settimeout(None)  # idle connections are normal; close() shuts them down

    def _serve_write(self, num_entries: int, xfer_id: int, region_id: int, total: int) -> None:
        table = bytearray(16 * num_entries)
        _recv_all_into(self.sock, [memoryview(table)])
        pairs = np.frombuffer(table, dtype="<u8").reshape(num_entries, 2)
        offsets, sizes = pairs[:, 0], pairs[:, 1]
        if sum(sizes.tolist()) != total:
            raise _Violation(f"frame {xfer_id}: entry sizes do not add up to {total} bytes")
        lease, refusal = self.owner._admit(region_id, offsets, sizes)
        if refusal is not None:
            log.warning("tcp: refused a write from agent %r: %s", self.agent, refusal)
            self._drain(total)
            self._ack(xfer_id, 1, refusal)
            return
        try:
            self.region_id = region_id
            mem = lease.value.mem
            _recv_all_into(self.sock, [mem[o:o + n] for o, n in zip(offsets.tolist(),
                                                                    sizes.tolist())])
        finally:
            self.region_id = None
            self.owner._regions.release(lease)
        self._ack(xfer_id, 0, "")

    def _drain(self, nbytes: int) -> None:
        scratch = memoryview(bytearray(min(nbytes, _DRAIN)))
        while nbytes:
            chunk = min(nbytes, scratch.nbytes)
            _recv_all_into(self.sock, [scratch[:chunk]])
            nbytes -= chunk

    def _ack(self, xfer_id: int, status: int, reason: str) -> None:
        text = reason.encode()[:MAX_TEXT]
        self.sock.sendall(ACK.pack(T_ACK, status, len(text), xfer_id) + text)


# -- the transport ----------------------------------------------------------------------


@dataclass
class _TcpRegion:
    region: Region
    mem: memoryview


def _split(entries: Entries, shares: int) -> list[Entries]:
    """Cut a batch into ``shares`` runs of about equal bytes, cutting entries where needed."""
    if shares <= 1:
        return [entries]
    lo, ro, sz = entries.local_offsets, entries.remote_offsets, entries.sizes
    ends = np.cumsum(sz)
    total = int(ends[-1])
    cuts = total * np.arange(1, shares, dtype=np.int64) // shares
    starts = np.union1d(ends - sz, cuts)            # byte positions where a piece begins
    stops = np.append(starts[1:], total)
    owner = np.searchsorted(ends, starts, side="right")  # entry each piece falls in
    delta = starts - (ends - sz)[owner]
    share = np.searchsorted(cuts, starts, side="right")
    bounds = np.searchsorted(share, np.arange(shares + 1), side="left")
    pieces = Entries(lo[owner] + delta, ro[owner] + delta, stops - starts)
    return [Entries(pieces.local_offsets[a:b], pieces.remote_offsets[a:b], pieces.sizes[a:b])
            for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


class TcpTransport(Transport):
    """Writes into peers' registered host memory over TCP (any hosts, no RDMA needed).

    Parameters
    ----------
    host : address to listen on and advertise (default ``KVXFER_TCP_HOST``); must be
        reachable by peers, so ``0.0.0.0``/``::`` are refused.
    port : listening port (0: any free port).
    num_connections : connections per peer that share each large batch
        (default ``KVXFER_TCP_CONNECTIONS``).
    io_timeout_s : a connection with transfers pending and no progress (bytes sent or ACK
        received) for this long is failed (default ``KVXFER_TCP_IO_TIMEOUT_S``).
    split_min_bytes : a batch is split over connections only into shares of at least this.
    agent_id : name in descriptors (default: host, pid and a random tag).
    """

    name = _NAME
    caps = Caps(mem_kinds=frozenset({"cpu"}), same_host_only=False, read_supported=False,
                one_sided=False)

    def __init__(self, *, host: str | None = None, port: int = 0,
                 num_connections: int | None = None, io_timeout_s: float | None = None,
                 split_min_bytes: int = 1 << 20, agent_id: str | None = None,
                 close_timeout_s: float = 5.0):
        super().__init__()
        host = envs.KVXFER_TCP_HOST.get() if host is None else host
        if host in ("", "0.0.0.0", "::"):
            raise ValueError(f"host={host!r} cannot be advertised to peers; give the address "
                             "peers should connect to (KVXFER_TCP_HOST)")
        conns = envs.KVXFER_TCP_CONNECTIONS.get() if num_connections is None else num_connections
        if isinstance(conns, bool) or not isinstance(conns, int) or not 1 <= conns <= 64:
            raise ValueError(f"num_connections must be an int in [1, 64], got {conns!r}")
        timeout = envs.KVXFER_TCP_IO_TIMEOUT_S.get() if io_timeout_s is None else io_timeout_s
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"io_timeout_s must be > 0, got {timeout!r}")
        if not isinstance(split_min_bytes, int) or split_min_bytes < 1:
            raise ValueError(f"split_min_bytes must be an int >= 1, got {split_min_bytes!r}")
        self._agent = agent_id or f"tcp-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._num_conns, self._io_timeout_s = conns, float(timeout)
        self._split_min, self._close_timeout_s = split_min_bytes, close_timeout_s
        self._lock = threading.Lock()
        self._ids, self._xfer_ids = itertools.count(1), itertools.count(1)
        self._regions = UseTable()  # region_id -> _TcpRegion
        self._peers: dict[str, _Peer] = {}
        self._agent_peers: dict[str, str] = {}
        self._inbound: set[_Inbound] = set()
        self._failures: list[PeerFailure] = []
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self._listener.settimeout(0.5)  # so the accept loop also notices close() by itself
        self._host, self._port = host, self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"kvxfer-tcp-accept-{self._port}")
        self._acceptor.start()

    @property
    def address(self) -> tuple[str, int]:
        """Where peers connect: ``(host, port)``."""
        return self._host, self._port

    # -- descriptors and peers ----------------------------------------------------------
    def agent_descriptor(self) -> bytes:
        return pack_descriptor(_NAME, "agent", agent=self._agent, host=self._host, port=self._port)

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        self._check_open()
        if not isinstance(peer_id, str) or not peer_id:
            raise ValueError(f"peer_id must be a non-empty str, got {peer_id!r}")
        desc = unpack_descriptor(descriptor, _NAME, "agent", {"agent": str, "host": str,
                                                              "port": int})
        peer = _Peer(desc["agent"], desc["host"], desc["port"])
        peer.conns = [_Conn(self, peer_id, peer, i) for i in range(self._num_conns)]
        with self._lock:
            if peer_id in self._peers:
                raise ValueError(f"peer {peer_id!r} is already added; remove_peer it first")
            self._peers[peer_id] = peer
            self._agent_peers[peer.agent] = peer_id

    def remove_peer(self, peer_id: str) -> None:
        with self._lock:
            peer = self._peers.pop(peer_id, None)
            if peer is None:
                raise ValueError(f"unknown peer {peer_id!r}")
            self._agent_peers.pop(peer.agent, None)
        deadline = time.monotonic() + self._close_timeout_s
        for conn in peer.conns:
            conn.stop(f"peer {peer_id!r} was removed with the write pending", deadline)

    # -- regions ------------------------------------------------------------------------
    def register(self, ptr: int, nbytes: int, device: str = "cpu") -> Region:
        self._check_open()
        self._check_register_args(ptr, nbytes)
        if parse_device(device)[0] != "cpu":
            raise TransportError(f"tcp moves host memory only, got device {device!r}; stage "
                                 "device data in a host region or use 'local'/'nixl'/'mori'")
        region_id = next(self._ids)
        descriptor = pack_descriptor(_NAME, "region", agent=self._agent, region=region_id,
                                     nbytes=nbytes, device="cpu")
        region = Region(region_id, ptr, nbytes, "cpu", descriptor)
        self._regions.add(region_id, _TcpRegion(region, view(ptr, nbytes)))
        return region

    def deregister(self, region: Region) -> None:
        rid = region.region_id

        def stop_users() -> None:  # a misuse: writes in flight; protect the memory first
            with self._lock:
                inbound = [c for c in self._inbound if c.region_id == rid]
                outbound = [c for p in self._peers.values() for c in p.conns if c.uses_region(rid)]
            for c in inbound:
                _shutdown(c.sock)
            for c in outbound:
                c.fail(f"local region {rid} was deregistered while being sent",
                       peer_failure=False, error_cls=TransportError)

        if self._regions.remove(rid, self._close_timeout_s, stop_users) is None:
            raise ValueError(f"region {rid} is not registered here")

    def import_region(self, peer_id: str, descriptor: bytes) -> RemoteRegion:
        self._check_open()
        peer = self._peers.get(peer_id)
        if peer is None:
            raise ValueError(f"unknown peer {peer_id!r} (add_peer it first)")
        desc = unpack_descriptor(descriptor, _NAME, "region", {"agent": str, "region": int,
                                                               "nbytes": int, "device": str})
        if desc["agent"] != peer.agent:
            raise ValueError(f"region descriptor belongs to agent {desc['agent']!r}, but peer "
                             f"{peer_id!r} is agent {peer.agent!r}")
        if desc["nbytes"] <= 0:
            raise ValueError(f"tcp region descriptor: nbytes must be > 0, got {desc['nbytes']}")
        remote = RemoteRegion(peer_id, desc["region"], desc["nbytes"], desc["device"])
        with self._lock:
            if remote.region_id in peer.regions:
                raise ValueError(f"region {remote.region_id} of peer {peer_id!r} is already "
                                 "imported")
            peer.regions[remote.region_id] = remote
        return remote

    def _admit(self, region_id: int, offsets: np.ndarray, sizes: np.ndarray):
        """Receiver check of one frame: ``(lease, None)`` or ``(None, why it is refused)``."""
        lease = self._regions.acquire(region_id)
        if lease is None:
            return None, (f"unknown region {region_id} (not registered with agent "
                          f"{self._agent!r}, or deregistered)")
        nbytes = lease.value.region.nbytes
        limit = np.uint64(nbytes)
        bad = (offsets > limit) | (sizes > limit - np.minimum(offsets, limit))
        if bad.any():
            self._regions.release(lease)
            i = int(np.argmax(bad))
            off, size = int(offsets[i]), int(sizes[i])
            return None, (f"entry {i}: offset {off} + size {size} = {off + size} exceeds "
                          f"region {region_id} of {nbytes} bytes")
        return lease, None

    # -- writes -------------------------------------------------------------------------
    def _write(self, local: Region, remote: RemoteRegion, entries: Entries) -> Ticket:
        label = f"tcp write {local.region_id}->{remote.peer_id}:{remote.region_id}"
        peer = self._peers.get(remote.peer_id)
        if peer is None:
            raise ValueError(f"unknown peer {remote.peer_id!r} (add_peer it first)")
        if peer.regions.get(remote.region_id) != remote:
            raise ValueError(f"remote region {remote.region_id} of peer {remote.peer_id!r} is "
                             "not imported (import_region it first)")
        lease = self._regions.acquire(local.region_id)
        if lease is None:
            raise ValueError(f"local region {local.region_id} is not registered here")
        if peer.failed is not None or entries.num_entries == 0:
            self._regions.release(lease)
            if peer.failed is not None:
                return Ticket.failed(label, PeerGoneError(peer.failed))
            return Ticket.completed(label)
        shares = _split(entries, min(self._num_conns,
                                     max(1, entries.total_bytes // self._split_min)))
        ticket = Ticket(label, parts=len(shares))
        with self._lock:
            first, peer.turn = peer.turn, peer.turn + len(shares)
            conns = [self._live_conn(remote.peer_id, peer, (first + i) % self._num_conns)
                     for i in range(len(shares))]
        mem = lease.value.mem
        for i, (share, conn) in enumerate(zip(shares, conns)):
            share_lease = lease if i == 0 else self._regions.acquire(local.region_id)
            xfer_id = next(self._xfer_ids)
            table = np.empty((share.num_entries, 2), dtype="<u8")
            table[:, 0], table[:, 1] = share.remote_offsets, share.sizes
            bufs = [memoryview(HEADER.pack(T_WRITE, share.num_entries, xfer_id,
                                           remote.region_id, share.total_bytes)),
                    memoryview(table.tobytes())]
            bufs += [mem[o:o + n] for o, n in zip(share.local_offsets.tolist(),
                                                  share.sizes.tolist())]
            conn.submit(_Job(xfer_id, ticket, share_lease, bufs))
        return ticket

    def _live_conn(self, peer_id: str, peer: _Peer, index: int) -> _Conn:
        conn = peer.conns[index]
        if conn.dead is not None and peer.failed is None:  # closed locally, not a peer failure
            conn = peer.conns[index] = _Conn(self, peer_id, peer, index)
        return conn

    # -- failures and lifetime ----------------------------------------------------------
    def _peer_failed(self, peer_id: str, peer: _Peer, reason: str) -> None:
        with self._lock:
            if peer.failed is not None or self._closed:
                return
            peer.failed = reason
            self._failures.append(PeerFailure(peer_id, reason))
        log.warning("tcp: %s", reason)
        for conn in peer.conns:
            conn.fail(reason)

    def _inbound_closed(self, inbound: _Inbound, reason: str | None) -> None:
        with self._lock:
            self._inbound.discard(inbound)
            if reason is None or self._closed:
                return
            name = self._agent_peers.get(inbound.agent) or inbound.agent or str(inbound.addr)
            text = f"inbound connection from agent {inbound.agent!r} {inbound.addr}: {reason}"
            self._failures.append(PeerFailure(name, text))
        log.warning("tcp: %s", text)

    def peer_failures(self) -> list[PeerFailure]:
        with self._lock:
            out, self._failures = self._failures, []
        return out

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._closed:
                    return
                log.warning("tcp: accept failed: %s", exc)
                time.sleep(0.1)
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            inbound = _Inbound(self, sock, addr)
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._inbound.add(inbound)
            inbound.thread.start()

    def _close(self) -> None:
        deadline = time.monotonic() + self._close_timeout_s
        _shutdown(self._listener)
        self._listener.close()
        for peer_id in list(self._peers):
            peer = self._peers.pop(peer_id)
            for conn in peer.conns:
                conn.stop("the tcp transport was closed with the write pending", deadline)
        with self._lock:
            inbound = list(self._inbound)
        for conn in inbound:
            _shutdown(conn.sock)
        for conn in inbound:
            conn.thread.join(max(0.0, deadline - time.monotonic()))
        self._acceptor.join(max(0.0, deadline - time.monotonic()))
