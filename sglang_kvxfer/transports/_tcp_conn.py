"""The two ends of a ``tcp`` transport connection, and the wire format between them.

``_Conn`` is the writer's side: a sender thread that connects lazily, greets with HELLO
and sends WRITE frames straight from registered memory with ``sendmsg``, and an ACK reader
thread that completes ticket parts; any loss fails every ticket on the connection.
``_Inbound`` is the receiver's side: it checks each frame against the region table
before reading the payload into the region with ``recvmsg_into``, refuses (drains and
NACKs) writes outside it, and closes the connection on a malformed frame.

Frames (little-endian): HELLO ``<4sHHH`` + agents; HELLO reply ``<4sHBxI`` + reason;
WRITE/BYE header ``<B3xIQQQ`` = type, n_entries, xfer_id, region_id, total_bytes, then
``n_entries x <QQ`` (remote_offset, size), then the payload; ACK ``<BB2xIQ`` = type,
status, reason length, xfer_id, then the UTF-8 reason. No pickle, no eval. This module
must not register memory or manage peers: ``tcp.TcpTransport`` owns those.
"""
from __future__ import annotations

import collections
import logging
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from sglang_kvxfer.errors import PeerGoneError, TransportError
from sglang_kvxfer.transports._common import UseTable
from sglang_kvxfer.transports._memory import IOV_MAX
from sglang_kvxfer.transports.ticket import Ticket

if TYPE_CHECKING:
    from sglang_kvxfer.transports.tcp import TcpTransport, _Peer

log = logging.getLogger("sglang_kvxfer.transports.tcp")

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
