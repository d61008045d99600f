"""The two ends of a ``tcp`` transport connection, and the interface to their owner.

``_Conn`` is the writer's side: a sender thread that connects lazily, answers the
reader's challenge with HELLO and sends WRITE frames straight from registered memory with
``sendmsg`` (a frame of many host entries with ``writev``, ``iov``), and an ACK reader thread that completes ticket parts; any loss fails every
ticket on the connection. A small host-memory frame handed to an idle, connected
connection is sent by the caller's thread instead (``claim``/``send_claimed``): one
thread hand-over less on a small write's path, in the same order and with the same
failure handling. A BYE from the reader (it closes idle connections) retires the
connection cleanly: what is in flight completes, and the next write opens a new one.
Each connection has a random 64-bit id, named in its HELLO, and numbers its WRITE frames
from 1 in the order they go on the wire (a job's number is taken when it is queued or
claimed): ``(connection id, frame number)`` is the frame's landing receipt, which the
reader's transport can check without waiting for the ACK to travel back.
``_Inbound`` is the receiver's side: it authenticates the writer, checks each frame
against the regions granted to that writer before reading the payload into the region
with ``recvmsg_into`` (many entries: ``readv``), refuses (drains and NACKs) writes outside them, and closes the
connection on a malformed frame. It counts every frame it served (landed or refused)
before the ACK, through ``frame_served``, so its owner can answer for receipts.

A frame whose memory is on a device takes the same path through the pinned bounce
buffers of ``bounce`` (allocated per connection end on its first device frame); the wire
is the same. Both ends reach their transport only through ``ConnOwner`` (below); the
frame layouts are in ``wire``. This module must not register memory or manage peers and grants, and must not
import ``transport``: ``TcpTransport`` owns those and implements ``ConnOwner``.
"""

from __future__ import annotations

import collections
import hmac
import logging
import secrets
import socket
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from sglang_kvxfer.errors import PeerGoneError, TransportError
from sglang_kvxfer.transports._common import UseTable
from sglang_kvxfer.transports._memory import IOV_MAX
from sglang_kvxfer.transports.tcp.bounce import BounceBuffers, Copier, DevicePayload, recv_into_device, send_from_device
from sglang_kvxfer.transports.tcp.iov import MIN_ENTRIES, iovecs, recv_iov, send_iov
from sglang_kvxfer.transports.tcp.iov import available as iov_available
from sglang_kvxfer.transports.tcp.wire import (
    ACK,
    CHALLENGE,
    HEADER,
    HELLO,
    HELLO_OK,
    MAGIC,
    MAX_ENTRIES,
    MAX_TEXT,
    NONCE_BYTES,
    T_ACK,
    T_BYE,
    T_WRITE,
    WIRE_VERSION,
    _Violation,
    hello_mac,
    key_id,
)
from sglang_kvxfer.transports.ticket import Ticket

log = logging.getLogger("sglang_kvxfer.transports.tcp")

_DRAIN = 1 << 20
_NO_SECRET = bytes(32)  # stands in for an unknown key id's secret (never granted: see Grant)


# -- the owner interface ----------------------------------------------------------------


@dataclass(frozen=True)
class ConnSettings:
    """What both ends read from their transport's configuration.

    ``agent`` is the transport's agent name (a writer's HELLO proof is bound to the
    reader's); ``io_timeout_s`` bounds a stall with transfers pending and a reader's wait
    for the writer's BYE; ``handshake_timeout_s`` is how long an accepted connection has
    to prove a granted secret; ``idle_timeout_s`` is how long an inbound connection may go
    without a frame before the reader says BYE; ``bounce_bytes`` is the size of each of a
    connection end's two pinned buffers for device memory.
    """

    agent: str
    io_timeout_s: float
    handshake_timeout_s: float
    idle_timeout_s: float
    bounce_bytes: int = 4 << 20


class PeerAddress(Protocol):
    """Where a writer connects and what it proves there (the owner's peer record)."""

    agent: str
    host: str
    port: int
    secret: bytes


@dataclass(frozen=True)
class Grant:
    """Reader side: what the writer ``peer_id`` proving ``secret`` may write into."""

    peer_id: str
    secret: bytes = field(repr=False)
    key_id: bytes
    region_ids: frozenset


class ConnOwner(Protocol):
    """The transport a connection belongs to: all that a connection may ask of it.

    Implemented by ``TcpTransport``; a test can implement it with a few lines. Methods
    are called from connection threads, never with the connection's own lock held unless
    said so.

    Attributes
    ----------
    conn_settings : agent name, deadlines and bounce buffer size (``ConnSettings``).
    device_copier : the ``bounce.Copier`` for device memory, or None while no device
        region is registered (then no frame can involve one).
    conn_lock : held while the owner hands jobs to connections; a writer connection
        takes it (then its own lock) to stop taking jobs, so none is handed one after.

    Methods
    -------
    release_lease(lease) : a region lease taken for a frame is no longer read or written.
    peer_lost(peer_id, peer, reason) : a writer connection to ``peer`` (the record given to
        it) was lost; the owner marks the peer failed and fails its other connections.
    grant_for_key(kid) : the grant whose secret has key id ``kid``, or None.
    bind_inbound(inbound, grant) : a writer proved ``grant``'s secret; bind the inbound
        connection to it (sets its ``peer_id`` and ``key_id``) and return True, or False
        when the grant was replaced or revoked meanwhile.
    refuse_inbound(inbound, why) : the handshake failed; count and log it (rate-limited).
    admit_write(inbound, region_id, offsets, sizes) : a lease when the bound writer may
        write these entries into ``region_id``, else why not (a ``str``); raises
        ``_Violation`` (the connection closes) when the writer's grant is gone.
    frame_served(inbound, refusal) : the inbound connection's next WRITE frame (number
        ``inbound.served + 1``) landed (``refusal`` None) or was refused (why); called
        before its ACK is sent.
    inbound_closed(inbound, reason) : the inbound connection ended; ``reason`` is None
        for a clean end, else why (a peer failure once the writer was bound).
    """

    conn_settings: ConnSettings
    device_copier: Copier | None

    @property
    def conn_lock(self) -> AbstractContextManager: ...

    def release_lease(self, lease: UseTable.Lease) -> None: ...

    def peer_lost(self, peer_id: str, peer: PeerAddress, reason: str) -> None: ...

    def grant_for_key(self, kid: bytes) -> Grant | None: ...

    def bind_inbound(self, inbound: _Inbound, grant: Grant) -> bool: ...

    def refuse_inbound(self, inbound: _Inbound, why: str) -> None: ...

    def admit_write(
        self, inbound: _Inbound, region_id: int, offsets: np.ndarray, sizes: np.ndarray
    ) -> UseTable.Lease | str: ...

    def frame_served(self, inbound: _Inbound, refusal: str | None) -> None: ...

    def inbound_closed(self, inbound: _Inbound, reason: str | None) -> None: ...


# -- socket helpers ---------------------------------------------------------------------


def _send_all(sock: socket.socket, bufs: list, on_progress=None) -> None:
    """Send every buffer (memoryviews), up to IOV_MAX per ``sendmsg``; resumes partial sends."""
    i, n = 0, len(bufs)
    while i < n:
        sent = sock.sendmsg(bufs[i : i + IOV_MAX])
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
        got = sock.recvmsg_into(bufs[i : i + IOV_MAX])[0]
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


def _recv_exact_by(sock: socket.socket, nbytes: int, deadline: float) -> bytes:
    """``nbytes`` from ``sock`` before ``deadline`` (monotonic) in total, however they
    trickle in; raises ``TimeoutError`` or ``ConnectionError``."""
    buf = memoryview(bytearray(nbytes))
    got = 0
    while got < nbytes:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{got} of {nbytes} bytes before the deadline")
        sock.settimeout(left)
        n = sock.recv_into(buf[got:])
        if n == 0:
            raise ConnectionError(f"connection closed after {got} of {nbytes} bytes")
        got += n
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
    bufs: list  # header, table and (host memory) the payload's views
    device: DevicePayload | None = None  # the payload, when it is in device memory
    iov: np.ndarray | None = None  # the payload as iovecs (host memory, many entries: see iov.py)
    seq: int = 0  # its frame number on the connection, once queued or claimed (from 1)


class _DeviceCopyError(Exception):
    """A device-to-host copy failed (not the peer's fault, but the frame is torn)."""


def _bounce_buffers(owner: ConnOwner) -> BounceBuffers:
    copier = owner.device_copier
    if copier is None:  # registering device memory creates it: a frame cannot get here
        raise _DeviceCopyError("no device copier")
    return BounceBuffers(copier, owner.conn_settings.bounce_bytes)


class _Conn:
    """One outgoing connection to a peer: a sender thread and an ACK reader thread."""

    def __init__(self, owner: ConnOwner, peer_id: str, peer: PeerAddress, index: int):
        self.owner, self.peer_id, self.peer, self.index = owner, peer_id, peer, index
        self.sock: socket.socket | None = None
        self.cond = threading.Condition()
        self.queue: collections.deque[_Job] = collections.deque()
        self.outstanding: dict[int, Ticket] = {}
        self.sending: _Job | None = None
        self.dead: str | None = None
        self.stopping = False
        self.retiring = False  # the reader said BYE: finish what is queued, then go
        self.closing = False  # the sender has said BYE itself: no job is accepted any more
        self.last_progress = time.monotonic()
        self.threads: list[threading.Thread] = []
        self.bounce: BounceBuffers | None = None  # the sender thread's, on its first device frame
        self.connected = False  # handshake done, ACK reader running: a caller may send (claim)
        self.conn_id = secrets.randbits(64) or 1  # named in HELLO: receipts are (conn_id, seq)
        self.next_seq = 1  # the number of the next frame queued or claimed (wire order)

    @property
    def where(self) -> str:
        return f"peer {self.peer_id!r} at {self.peer.host}:{self.peer.port}"

    def submit(self, job: _Job) -> None:
        with self.cond:
            if self.dead is None and not self.stopping and not self.closing:
                job.seq, self.next_seq = self.next_seq, self.next_seq + 1
                self.queue.append(job)
                if not self.threads:
                    self._start()
                self.cond.notify()
                return
            reason = self.dead or f"connection to {self.where} is closing"
        self.owner.release_lease(job.lease)
        job.ticket._fail(PeerGoneError(reason))

    def claim(self, job: _Job) -> bool:
        """Take ``job`` for the caller to send with ``send_claimed`` (outside any lock) when
        the connection is connected and idle: nothing queued or being sent. Otherwise it is
        queued for the sender thread (``submit``) and False is returned."""
        with self.cond:
            idle = self.sending is None and not self.queue and not self.retiring
            if self.connected and idle and self.dead is None and not self.stopping and not self.closing:
                job.seq, self.next_seq = self.next_seq, self.next_seq + 1
                self.sending = job
                self.outstanding[job.xfer_id] = job.ticket
                return True
        self.submit(job)
        return False

    def send_claimed(self, job: _Job) -> None:
        """Send a job ``claim`` gave to the caller; a failure fails the connection (and so
        the job's ticket), as on the sender thread."""
        sock = self.sock
        try:
            if sock is None:  # claim() needs a connected socket: a bug if it is missing
                raise OSError("not connected")
            _send_all(sock, job.bufs, self._touch)
            if job.iov is not None:
                send_iov(sock, job.iov, self._touch)
        except OSError as exc:
            self._sent(job)
            self.fail(f"connection {self.index} to {self.where} lost: {_describe(exc)}")
            return
        self._sent(job)

    def _sent(self, job: _Job) -> None:
        with self.cond:
            self.sending = None
            if self.queue or self.stopping or self.retiring:
                # the sender thread waits while a claimed job is sent; with nothing for it to
                # do it would only wake to wait again (a thread switch per small write)
                self.cond.notify_all()
        self.owner.release_lease(job.lease)  # the source is no longer read

    def _start(self) -> None:
        thread = threading.Thread(
            target=self._run_sender, daemon=True, name=f"kvxfer-tcp-send-{self.peer_id}-{self.index}"
        )
        self.threads.append(thread)
        thread.start()

    def uses_region(self, region_id: int) -> bool:
        with self.cond:
            return any(j.lease.key == region_id for j in (self.sending, *self.queue) if j)

    def _touch(self) -> None:
        self.last_progress = time.monotonic()

    def _run_sender(self) -> None:
        try:
            sock = self._connect()
            while True:
                with self.cond:
                    # a job a caller claimed is being sent: wait for it, the socket is one stream
                    while self.dead is None and (
                        self.sending is not None or (not self.queue and not self.stopping and not self.retiring)
                    ):
                        self.cond.wait()
                    if self.dead is not None:
                        return
                    if not self.queue:  # stopping or retiring with nothing left to send
                        self.closing = True
                        break
                    job = self.sending = self.queue.popleft()
                    self.outstanding[job.xfer_id] = job.ticket
                try:
                    _send_all(sock, job.bufs, self._touch)
                    if job.iov is not None:
                        send_iov(sock, job.iov, self._touch)
                    if job.device is not None:
                        self._send_device(sock, job.device)
                finally:
                    self._sent(job)
            sock.sendall(HEADER.pack(T_BYE, 0, 0, 0, 0))
        except (OSError, _Violation) as exc:
            self.fail(f"connection {self.index} to {self.where} lost: {_describe(exc)}")
        except _DeviceCopyError as exc:  # our fault, not the peer's: the next write reconnects
            self.fail(
                f"connection {self.index} to {self.where} closed: {_describe(exc)}",
                peer_failure=False,
                error_cls=TransportError,
            )

    def _send_device(self, sock: socket.socket, payload: DevicePayload) -> None:
        def send(views: list) -> None:
            _send_all(sock, views, self._touch)

        try:
            if self.bounce is None:
                self.bounce = _bounce_buffers(self.owner)
            send_from_device(payload, self.bounce, send)
        except (OSError, _Violation, _DeviceCopyError):
            raise
        except Exception as exc:
            raise _DeviceCopyError(f"copying the payload from the device failed: {type(exc).__name__}: {exc}") from exc

    def _connect(self) -> socket.socket:
        """Connect and authenticate; start the ACK reader. Returns the socket (``self.sock``)."""
        timeout = self.owner.conn_settings.io_timeout_s
        sock = self.sock = socket.create_connection((self.peer.host, self.peer.port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        magic, version, nonce = CHALLENGE.unpack(_recv_exact(sock, CHALLENGE.size))
        if magic != MAGIC or version != WIRE_VERSION:
            raise _Violation(
                f"not a kvxfer tcp reader of wire version {WIRE_VERSION} (magic {magic!r}, version {version})"
            )
        secret = self.peer.secret
        kid = key_id(secret)
        mac = hello_mac(secret, nonce, self.peer.agent, kid, self.conn_id)
        sock.sendall(HELLO.pack(MAGIC, WIRE_VERSION, kid, mac, self.conn_id))
        try:
            magic, version = HELLO_OK.unpack(_recv_exact(sock, HELLO_OK.size))
        except ConnectionError:
            raise _Violation(
                "the reader closed the connection at the handshake: it has no "
                "grant for this writer's secret (authorize_peer on the reader, "
                "secret= on add_peer here) or it was revoked"
            ) from None
        if magic != MAGIC or version != WIRE_VERSION:
            raise _Violation(f"bad HELLO_OK (magic {magic!r}, version {version})")
        reader = threading.Thread(
            target=self._run_acks, args=(sock,), daemon=True, name=f"kvxfer-tcp-ack-{self.peer_id}-{self.index}"
        )
        self.threads.append(reader)
        reader.start()
        with self.cond:
            self.connected = True
        return sock

    def _run_acks(self, sock: socket.socket) -> None:
        buf = bytearray()
        try:
            while True:
                try:
                    chunk = sock.recv(1 << 16)
                except TimeoutError:
                    with self.cond:
                        waiting = bool(self.outstanding) or self.sending is not None
                    idle = time.monotonic() - self.last_progress
                    if waiting and idle > self.owner.conn_settings.io_timeout_s:
                        raise TimeoutError(f"no progress for {idle:.1f} s") from None
                    continue
                if not chunk:
                    with self.cond:
                        ending = (self.stopping or self.retiring) and not self.outstanding
                        retired = ending and not self.stopping and self.dead is None
                        if retired:  # nobody stops a replaced connection: close it here
                            self.dead = "retired after the reader's BYE"
                    if retired:
                        sock.close()
                    if ending:
                        return
                    raise ConnectionError("connection closed by the peer")
                buf += chunk
                self._touch()
                while len(buf) >= ACK.size:
                    kind, status, n, xfer_id = ACK.unpack_from(buf)
                    if kind == T_BYE and n == 0:  # the reader closes this idle connection
                        del buf[: ACK.size]
                        self._retire()
                        continue
                    if kind != T_ACK or n > MAX_TEXT:
                        raise _Violation(f"bad ACK frame (type {kind}, reason length {n})")
                    if len(buf) < ACK.size + n:
                        break
                    reason = bytes(buf[ACK.size : ACK.size + n]).decode(errors="replace")
                    del buf[: ACK.size + n]
                    self._acked(xfer_id, status, reason)
        except (OSError, _Violation) as exc:
            self.fail(f"connection {self.index} to {self.where} lost: {_describe(exc)}")

    def _retire(self) -> None:
        """Stop taking jobs (under the owner's ``conn_lock``, so the owner hands jobs to a
        new connection from now on), send what is queued, say BYE; the ACK reader ends at
        the close."""
        with self.owner.conn_lock, self.cond:
            if self.dead is None and not self.stopping:
                self.retiring = True
                self.cond.notify_all()

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
            self.owner.release_lease(job.lease)
        error = error_cls(reason)
        for ticket in tickets:
            ticket._fail(error)
        if peer_failure and not self.stopping:
            self.owner.peer_lost(self.peer_id, self.peer, reason)

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
    """One accepted connection: authenticates the writer, checks WRITE frames against its
    grant, reads payloads into regions, ACKs; says BYE when idle too long, or when this
    transport closes (``say_bye``: the writer retires the connection instead of counting a
    lost peer)."""

    def __init__(self, owner: ConnOwner, sock: socket.socket, addr):
        self.owner, self.sock, self.addr = owner, sock, addr
        self.peer_id: str | None = None  # set once the writer proved a granted secret
        self.key_id: bytes | None = None
        self.region_id: int | None = None  # the region being filled right now
        self.bye_sent = False
        self.send_lock = threading.Lock()  # ACKs (this thread) and a closing BYE (another) share the socket
        self.cut = False  # closed here on purpose (revoke_peer): not a peer failure
        self.bounce: BounceBuffers | None = None  # allocated on the first device frame
        self.conn_id = 0  # the writer's name for this connection (HELLO), once bound
        self.served = 0  # WRITE frames landed or refused so far (receipts up to it are answered)
        self.refused: dict[int, str] = {}  # frame number -> why it was refused
        self.ended: str | None = None  # set when the connection ended: how
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"kvxfer-tcp-recv-{addr[0]}:{addr[1]}")

    def _run(self) -> None:
        reason = None
        try:
            if self._handshake():
                reason = self._serve()
        except (OSError, _Violation) as exc:
            reason = _describe(exc)
        finally:
            self.sock.close()
            self.owner.inbound_closed(self, reason)

    def _handshake(self) -> bool:
        """True once the writer proved a granted secret; otherwise the connection is
        refused (logged and counted by the owner) and nothing at all is sent back."""
        owner, settings = self.owner, self.owner.conn_settings
        nonce = secrets.token_bytes(NONCE_BYTES)
        deadline = time.monotonic() + settings.handshake_timeout_s
        try:
            self.sock.settimeout(settings.handshake_timeout_s)
            self.sock.sendall(CHALLENGE.pack(MAGIC, WIRE_VERSION, nonce))
            magic, version, kid, mac, conn_id = HELLO.unpack(_recv_exact_by(self.sock, HELLO.size, deadline))
        except OSError as exc:
            owner.refuse_inbound(
                self,
                f"no HELLO ({_describe(exc)}; the deadline is "
                f"{settings.handshake_timeout_s} s, and the oldest "
                "pending handshake is dropped when too many are open)",
            )
            return False
        grant = owner.grant_for_key(kid)
        # compute a MAC either way, so a probe cannot time whether a key id is granted
        expected = hello_mac(grant.secret if grant else _NO_SECRET, nonce, settings.agent, kid, conn_id)
        if magic != MAGIC or version != WIRE_VERSION:
            owner.refuse_inbound(self, f"bad HELLO (magic {magic!r}, version {version})")
            return False
        if not hmac.compare_digest(mac, expected) or grant is None:
            owner.refuse_inbound(
                self,
                "HELLO with an unknown key id"
                if grant is None
                else f"HELLO for peer {grant.peer_id!r} with a wrong MAC",
            )
            return False
        if conn_id == 0:
            owner.refuse_inbound(self, f"HELLO for peer {grant.peer_id!r} with connection id 0")
            return False
        self.conn_id = conn_id
        if not owner.bind_inbound(self, grant):  # revoked meanwhile, or the id is taken
            owner.refuse_inbound(
                self, f"grant of peer {grant.peer_id!r} was revoked, or connection id {conn_id:#x} is in use"
            )
            return False
        self.sock.sendall(HELLO_OK.pack(MAGIC, WIRE_VERSION))
        return True

    def _serve(self) -> str | None:
        """Serve frames until BYE or close; returns why it ended abnormally, or None."""
        header = bytearray(HEADER.size)
        while True:
            if not self._next_header(header):
                return None if self.bye_sent else "closed without BYE"
            kind, num_entries, xfer_id, region_id, total = HEADER.unpack(header)
            if kind == T_BYE:
                return None
            if kind != T_WRITE:
                raise _Violation(f"unknown frame type {kind}")
            if num_entries > MAX_ENTRIES:
                raise _Violation(f"{num_entries} entries in one frame (limit {MAX_ENTRIES})")
            self._serve_write(num_entries, xfer_id, region_id, total)

    def _next_header(self, header: bytearray) -> bool:
        """Read the next frame header; False on a close before it. Idle past
        ``idle_timeout_s``: say BYE, after which the writer has ``io_timeout_s`` to finish
        what it already sent and say BYE itself."""
        settings = self.owner.conn_settings
        while True:
            self.sock.settimeout(settings.io_timeout_s if self.bye_sent else settings.idle_timeout_s)
            try:
                got = self.sock.recv_into(header)
            except TimeoutError:
                if self.bye_sent:
                    raise TimeoutError(f"no BYE within {settings.io_timeout_s} s of ours") from None
                with self.send_lock:
                    self.sock.sendall(ACK.pack(T_BYE, 0, 0, 0))
                    self.bye_sent = True
                continue
            if got == 0:
                return False
            self.sock.settimeout(settings.io_timeout_s)  # a frame, once begun, must keep coming
            _recv_all_into(self.sock, [memoryview(header)[got:]])
            return True

    def _serve_write(self, num_entries: int, xfer_id: int, region_id: int, total: int) -> None:
        table = bytearray(16 * num_entries)
        _recv_all_into(self.sock, [memoryview(table)])
        pairs = np.frombuffer(table, dtype="<u8").reshape(num_entries, 2)
        offsets, sizes = pairs[:, 0], pairs[:, 1]
        if sum(sizes.tolist()) != total:
            raise _Violation(f"frame {xfer_id}: entry sizes do not add up to {total} bytes")
        lease = self.owner.admit_write(self, region_id, offsets, sizes)
        if isinstance(lease, str):
            refusal = lease
            log.warning("tcp: refused a write from peer %r: %s", self.peer_id, refusal)
            self._drain(total)
            self.owner.frame_served(self, refusal)
            self._ack(xfer_id, 1, refusal)
            return
        failure: str | None = None
        try:
            self.region_id = region_id
            mem = lease.value.mem
            if mem is not None and num_entries >= MIN_ENTRIES and iov_available():
                recv_iov(self.sock, iovecs(lease.value.region.ptr, offsets, sizes))
            elif mem is not None:
                _recv_all_into(self.sock, [mem[o : o + n] for o, n in zip(offsets.tolist(), sizes.tolist())])
            else:
                failure = self._recv_device(lease.value.dev, offsets, sizes, total)
        finally:
            self.region_id = None
            self.owner.release_lease(lease)
        if failure is not None:
            log.warning("tcp: refused a write from peer %r: %s", self.peer_id, failure)
        self.owner.frame_served(self, failure)
        self._ack(xfer_id, 0 if failure is None else 1, failure or "")

    def _recv_device(self, dev: object, offsets: np.ndarray, sizes: np.ndarray, total: int) -> str | None:
        """Read the payload into device memory through the bounce buffers; None once it
        landed, else why not (the payload is consumed either way)."""
        try:
            if self.bounce is None:
                self.bounce = _bounce_buffers(self.owner)
        except Exception as exc:  # no pinned memory: refuse this write, keep the connection
            self._drain(total)
            return f"no bounce buffers for device memory: {type(exc).__name__}: {exc}"
        return recv_into_device(
            dev,
            offsets.astype(np.int64),
            sizes.astype(np.int64),
            self.bounce,
            lambda views: _recv_all_into(self.sock, views),
        )

    def _drain(self, nbytes: int) -> None:
        scratch = memoryview(bytearray(min(nbytes, _DRAIN)))
        while nbytes:
            chunk = min(nbytes, scratch.nbytes)
            _recv_all_into(self.sock, [scratch[:chunk]])
            nbytes -= chunk

    def _ack(self, xfer_id: int, status: int, reason: str) -> None:
        text = reason.encode()[:MAX_TEXT]
        with self.send_lock:
            self.sock.sendall(ACK.pack(T_ACK, status, len(text), xfer_id) + text)

    def say_bye(self) -> None:
        """Tell the writer (from the closing thread) that this side closes: it sends what it
        has queued, says BYE and retires the connection, which then ends here without a
        failure on either side. Not before the handshake, nor twice; a socket already gone
        is left to the close."""
        if self.peer_id is None:
            return
        with self.send_lock:
            if self.bye_sent:
                return
            try:
                self.sock.sendall(ACK.pack(T_BYE, 0, 0, 0))
            except OSError:
                return
            self.bye_sent = True
