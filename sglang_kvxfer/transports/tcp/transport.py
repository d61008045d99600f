"""The ``tcp`` transport: writes into a peer's registered host memory over TCP, no RDMA.

How bytes move: each transport listens on ``host:port``; a writer opens
``num_connections`` connections per peer lazily. A batch is coalesced, split by bytes over
the connections (large entries are cut), and each share goes as one WRITE frame sent
straight from views of the registered memory (``sendmsg``, no joining). The receiver
checks every entry against its registered regions before reading the payload straight
into the region (``recvmsg_into``, no intermediate copy); a write outside them is refused
and the ACK says why. One ACK per share completes that part of the ticket. Each frame
also has a landing receipt (its connection's id and its number there, ``Ticket.receipts``)
that the reader's transport answers for as soon as the frame is served (``landed``), so
the writer's "done" may travel on the control plane while the ACK comes back. A lost
connection fails every outstanding ticket of the peer with ``PeerGoneError`` naming it and
is reported by ``peer_failures``; the peer stays failed until ``remove_peer``/``add_peer``.

Device memory (CUDA pools) goes through pinned host bounce buffers on both ends
(``bounce``, with ``cuda.TorchCudaCopier`` or an injected ``device_copier``): the sender
copies chunk k+1 to the host while chunk k is on the wire, the receiver reads chunk k+1
while chunk k is copied to the device and ACKs once it landed. Host memory never takes
that path, and the wire is the same for both.

Who may write (secure by default): the listener serves only writers that ``authorize_peer``
named, each proving its secret by HMAC over a fresh challenge, and each only into the
regions granted to it. Anything else is closed within ``handshake_timeout_s`` without a
byte of explanation, logged and counted in ``refused_connections``. Pending handshakes are
capped (the oldest is dropped first); an established connection idle for
``idle_timeout_s`` gets a BYE and the writer reconnects on its next write.

This module owns peers, regions, splitting and lifetime, and is the ``ConnOwner`` of its
connections; the connection ends are in ``conn``, the wire format in ``wire``. It must not
import torch (``cuda`` does, once a device region is registered).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from sglang_kvxfer import envs
from sglang_kvxfer.errors import TransferTimeoutError, TransportError
from sglang_kvxfer.transports._common import UseTable, open_write, pack_descriptor, unpack_descriptor
from sglang_kvxfer.transports._memory import view
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
    tensor_memory,
)
from sglang_kvxfer.transports.tcp import iov
from sglang_kvxfer.transports.tcp.bounce import Copier, DevicePayload
from sglang_kvxfer.transports.tcp.conn import ConnSettings, Grant, PeerAddress, _Conn, _Inbound, _Job, _shutdown
from sglang_kvxfer.transports.tcp.wire import HEADER, MAX_ENTRIES, T_WRITE, _Violation, key_id

__all__ = ["TcpTransport"]

log = logging.getLogger("sglang_kvxfer.transports.tcp")

_NAME = "tcp"
_FRAME_ENTRIES = MAX_ENTRIES  # a share with more entries goes as several frames
# Defaults of the constructor's listener limits (candidates for KVXFER_TCP_* variables).
HANDSHAKE_TIMEOUT_S = 5.0  # an accepted connection must have proved its secret by then
IDLE_TIMEOUT_S = 60.0  # an established connection without a frame this long gets BYE
MAX_HANDSHAKES = 64  # connections in the handshake at once; more drop the oldest
# A single-frame host-memory write up to this size, to an idle connection, is sent by the
# caller's thread (it fits the socket buffer: sendmsg returns at once).
INLINE_SEND_BYTES = 256 << 10
# Receipts: ended inbound connections kept so late receipts of their frames are answered,
# and the refusals one connection may collect before it is closed as misbehaving.
_ENDED_KEPT = 1024
_MAX_REFUSED = 1 << 16
# At close, how long the writers told BYE get to answer with theirs before their
# connections are cut (an idle writer answers within a thread wake-up).
_BYE_GRACE_S = 0.5


@dataclass
class _Peer:
    agent: str
    host: str
    port: int
    secret: bytes = field(repr=False)
    conns: list = field(default_factory=list)
    regions: dict = field(default_factory=dict)
    failed: str | None = None
    turn: int = 0


# -- the transport ----------------------------------------------------------------------


@dataclass
class _TcpRegion:
    region: Region
    mem: memoryview | None  # host memory; None for device memory
    dev: object = None  # device memory: the device copier's handle


def _receipts_text(receipts) -> str:
    shown = ", ".join(f"{c:#x}:{s}" for c, s in list(receipts)[:4])
    return f"receipts {shown}{', ...' if len(receipts) > 4 else ''}"


def _slice(entries: Entries, start: int, stop: int) -> Entries:
    return Entries(entries.local_offsets[start:stop], entries.remote_offsets[start:stop], entries.sizes[start:stop])


def _split(entries: Entries, shares: int) -> list[Entries]:
    """Cut a batch into ``shares`` runs of about equal bytes, cutting entries where needed."""
    if shares <= 1:
        return [entries]
    lo, ro, sz = entries.local_offsets, entries.remote_offsets, entries.sizes
    ends = np.cumsum(sz)
    total = int(ends[-1])
    cuts = total * np.arange(1, shares, dtype=np.int64) // shares
    starts = np.union1d(ends - sz, cuts)  # byte positions where a piece begins
    stops = np.append(starts[1:], total)
    owner = np.searchsorted(ends, starts, side="right")  # entry each piece falls in
    delta = starts - (ends - sz)[owner]
    share = np.searchsorted(cuts, starts, side="right")
    bounds = np.searchsorted(share, np.arange(shares + 1), side="left")
    pieces = Entries(lo[owner] + delta, ro[owner] + delta, stops - starts)
    return [_slice(pieces, a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


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
    handshake_timeout_s : an accepted connection that has not proved a granted secret by
        then is closed (default ``HANDSHAKE_TIMEOUT_S``).
    idle_timeout_s : an inbound connection without a frame for this long is closed (BYE;
        its writer reconnects on its next write) (default ``IDLE_TIMEOUT_S``).
    max_handshakes : connections in the handshake at once; a new one beyond it drops the
        oldest (default ``MAX_HANDSHAKES``).
    bounce_bytes : size of each of the two pinned host buffers a connection end uses for
        device memory; device payloads move in chunks of it (default
        ``KVXFER_TCP_BOUNCE_BYTES``).
    device_copier : the ``bounce.Copier`` for device regions (default: a
        ``cuda.TorchCudaCopier``, created when the first device region is registered).

    Its connections reach it only through ``conn.ConnOwner`` (``conn_settings``,
    ``conn_lock`` and seven methods), which it implements; they are not for users.
    """

    name = _NAME
    caps = Caps(
        mem_kinds=frozenset({"cpu", "cuda"}),
        same_host_only=False,
        read_supported=False,
        one_sided=False,
        authenticates_peers=True,
        receipts=True,
    )

    def __init__(
        self,
        *,
        host: str | None = None,
        port: int = 0,
        num_connections: int | None = None,
        io_timeout_s: float | None = None,
        split_min_bytes: int = 1 << 20,
        agent_id: str | None = None,
        close_timeout_s: float = 5.0,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_handshakes: int = MAX_HANDSHAKES,
        bounce_bytes: int | None = None,
        device_copier: Copier | None = None,
    ):
        super().__init__()
        host = envs.KVXFER_TCP_HOST.get() if host is None else host
        if host in ("", "0.0.0.0", "::"):
            raise ValueError(
                f"host={host!r} cannot be advertised to peers; give the address "
                "peers should connect to (KVXFER_TCP_HOST)"
            )
        conns = envs.KVXFER_TCP_CONNECTIONS.get() if num_connections is None else num_connections
        if isinstance(conns, bool) or not isinstance(conns, int) or not 1 <= conns <= 64:
            raise ValueError(f"num_connections must be an int in [1, 64], got {conns!r}")
        timeout = envs.KVXFER_TCP_IO_TIMEOUT_S.get() if io_timeout_s is None else io_timeout_s
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"io_timeout_s must be > 0, got {timeout!r}")
        for name, value in (("handshake_timeout_s", handshake_timeout_s), ("idle_timeout_s", idle_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        if isinstance(max_handshakes, bool) or not isinstance(max_handshakes, int) or max_handshakes < 1:
            raise ValueError(f"max_handshakes must be an int >= 1, got {max_handshakes!r}")
        if not isinstance(split_min_bytes, int) or split_min_bytes < 1:
            raise ValueError(f"split_min_bytes must be an int >= 1, got {split_min_bytes!r}")
        bounce = envs.KVXFER_TCP_BOUNCE_BYTES.get() if bounce_bytes is None else bounce_bytes
        if isinstance(bounce, bool) or not isinstance(bounce, int) or not 4096 <= bounce <= 1 << 30:
            raise ValueError(f"bounce_bytes must be an int in [4096, 2**30], got {bounce!r}")
        self._agent = agent_id or f"tcp-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._num_conns = conns
        self._split_min, self._close_timeout_s = split_min_bytes, close_timeout_s
        self.conn_settings = ConnSettings(
            self._agent, float(timeout), float(handshake_timeout_s), float(idle_timeout_s), bounce
        )
        self.device_copier: Copier | None = device_copier
        self._max_handshakes = max_handshakes
        self._lock = threading.Lock()
        self._ids, self._xfer_ids = itertools.count(1), itertools.count(1)
        self._regions = UseTable()  # region_id -> _TcpRegion
        self._peers: dict[str, _Peer] = {}
        self._grants: dict[str, Grant] = {}  # reader side: peer_id -> grant
        self._grant_keys: dict[bytes, Grant] = {}  # key id -> grant
        self._inbound: set[_Inbound] = set()
        # Receipts: inbound connections by the writer's connection id (HELLO), live ones and
        # the last _ENDED_KEPT that ended; their frame counts change under _landing.
        self._landing = threading.Condition(threading.Lock())
        self._by_conn_id: dict[int, _Inbound] = {}
        self._ended_ids: collections.deque[int] = collections.deque()
        self._handshaking: collections.deque[_Inbound] = collections.deque()
        self.refused_connections = 0  # inbound connections closed at the handshake
        self._refusal_logged_at, self._refusals_unlogged = -1e9, 0
        self._failures: list[PeerFailure] = []
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self._listener.settimeout(0.5)  # so the accept loop also notices close() by itself
        self._host, self._port = host, self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True, name=f"kvxfer-tcp-accept-{self._port}")
        self._acceptor.start()

    @property
    def address(self) -> tuple[str, int]:
        """Where peers connect: ``(host, port)``."""
        return self._host, self._port

    # -- descriptors and peers ----------------------------------------------------------
    def agent_descriptor(self) -> bytes:
        return pack_descriptor(_NAME, "agent", agent=self._agent, host=self._host, port=self._port)

    def add_peer(self, peer_id: str, descriptor: bytes, secret: bytes | None = None) -> None:
        """Writer side; ``secret`` is required: tcp readers serve authenticated writers only.
        An existing ``peer_id`` is replaced (its connections closed, imports dropped)."""
        self._check_open()
        if not isinstance(peer_id, str) or not peer_id:
            raise ValueError(f"peer_id must be a non-empty str, got {peer_id!r}")
        if secret is None:
            raise ValueError(
                f"tcp: add_peer({peer_id!r}) needs secret=, the bytes that peer "
                "was given for this writer by authorize_peer (tcp readers refuse "
                "unauthenticated writers)"
            )
        secret = check_secret(secret)
        desc = unpack_descriptor(descriptor, _NAME, "agent", {"agent": str, "host": str, "port": int})
        peer = _Peer(desc["agent"], desc["host"], desc["port"], secret)
        peer.conns = [_Conn(self, peer_id, peer, i) for i in range(self._num_conns)]
        with self._lock:
            old = self._peers.pop(peer_id, None)
        if old is not None:
            self._stop_peer(peer_id, old, f"peer {peer_id!r} was replaced (add_peer) with the write pending")
        with self._lock:
            self._peers[peer_id] = peer

    def remove_peer(self, peer_id: str) -> None:
        with self._lock:
            peer = self._peers.pop(peer_id, None)
            if peer is None:
                raise ValueError(f"unknown peer {peer_id!r}")
        self._stop_peer(peer_id, peer, f"peer {peer_id!r} was removed with the write pending")

    def _stop_peer(self, peer_id: str, peer: _Peer, reason: str) -> None:
        deadline = time.monotonic() + self._close_timeout_s
        for conn in peer.conns:
            conn.stop(reason, deadline)

    # -- reader-side grants -------------------------------------------------------------
    def authorize_peer(self, peer_id: str, secret: bytes, regions) -> None:
        """Let the writer ``peer_id`` that proves ``secret`` write into exactly ``regions``.

        Replaces an earlier grant of ``peer_id`` at once; if the secret changed, that
        peer's connections made with the old one are closed. Raises ``ValueError`` for a
        region not registered here or a secret already granted to another peer.
        """
        self._check_open()
        secret, regions = self._check_grant_args(peer_id, secret, regions)
        for r in regions:
            live = self._regions.get(r.region_id)
            if live is None or live.region != r:
                raise ValueError(f"region {r.region_id} is not registered here")
        grant = Grant(peer_id, secret, key_id(secret), frozenset(r.region_id for r in regions))
        with self._lock:
            other = self._grant_keys.get(grant.key_id)
            if other is not None and other.peer_id != peer_id:
                raise ValueError(
                    f"this secret is already granted to peer {other.peer_id!r}; each writer needs a secret of its own"
                )
            old = self._grants.get(peer_id)
            if old is not None:
                self._grant_keys.pop(old.key_id, None)
            self._grants[peer_id] = grant
            self._grant_keys[grant.key_id] = grant
            stale = [c for c in self._inbound if c.peer_id == peer_id and c.key_id != grant.key_id]
        for conn in stale:
            conn.cut = True
            _shutdown(conn.sock)

    def revoke_peer(self, peer_id: str) -> None:
        """Drop ``peer_id``'s grant and close its inbound connections (unknown: no-op)."""
        with self._lock:
            grant = self._grants.pop(peer_id, None)
            if grant is not None:
                self._grant_keys.pop(grant.key_id, None)
            conns = [c for c in self._inbound if c.peer_id == peer_id]
        for conn in conns:
            conn.cut = True
            _shutdown(conn.sock)

    # -- conn.ConnOwner (for this transport's connections, not for users): conn_settings,
    # conn_lock and release_lease; the rest sit with what they touch: grant_for_key,
    # bind_inbound and refuse_inbound here, admit_write with regions, peer_lost and
    # inbound_closed with failures.
    @property
    def conn_lock(self) -> threading.Lock:
        return self._lock

    def release_lease(self, lease: UseTable.Lease) -> None:
        self._regions.release(lease)

    def grant_for_key(self, kid: bytes) -> Grant | None:
        with self._lock:
            return self._grant_keys.get(kid)

    def bind_inbound(self, inbound: _Inbound, grant: Grant) -> bool:
        """Bind an inbound connection to ``grant`` unless it was replaced or revoked, or
        its connection id is already taken (receipts must name one connection)."""
        with self._lock:
            if self._grants.get(grant.peer_id) is not grant or self._closed:
                return False
            with self._landing:
                if inbound.conn_id in self._by_conn_id:
                    return False
                self._by_conn_id[inbound.conn_id] = inbound
            inbound.peer_id, inbound.key_id = grant.peer_id, grant.key_id
            with contextlib.suppress(ValueError):
                self._handshaking.remove(inbound)
        return True

    def frame_served(self, inbound: _Inbound, refusal: str | None) -> None:
        with self._landing:
            inbound.served += 1
            if refusal is not None:
                if len(inbound.refused) >= _MAX_REFUSED:
                    raise _Violation(f"{_MAX_REFUSED} writes refused on one connection")
                inbound.refused[inbound.served] = refusal
            self._landing.notify_all()

    def refuse_inbound(self, inbound: _Inbound, why: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.refused_connections += 1
            with contextlib.suppress(ValueError):
                self._handshaking.remove(inbound)
            # one WARNING a second at most: a flood of probes must not flood the log too
            report = now - self._refusal_logged_at >= 1.0 and not self._closed
            if report:
                self._refusal_logged_at = now
                quiet, self._refusals_unlogged = self._refusals_unlogged, 0
            else:
                self._refusals_unlogged += 1
        if report:
            log.warning(
                "tcp: refused an inbound connection from %s: %s%s",
                inbound.addr,
                why,
                f" ({quiet} more refused since the last report)" if quiet else "",
            )

    # -- regions ------------------------------------------------------------------------
    def register(self, ptr: int, nbytes: int, device: str = "cpu") -> Region:
        """Register host memory, or device memory (``"cuda:N"``), which moves through
        pinned bounce buffers; ``register_tensor`` also keeps a device tensor's block alive."""
        return self._register(ptr, nbytes, device, None)

    def register_tensor(self, tensor) -> Region:
        ptr, nbytes, device = tensor_memory(tensor)
        return self._register(ptr, nbytes, device, tensor)

    def _register(self, ptr: int, nbytes: int, device: str, tensor) -> Region:
        self._check_open()
        self._check_register_args(ptr, nbytes)
        kind, index = parse_device(device)
        mem, dev = None, None
        if kind == "cpu":
            mem = view(ptr, nbytes)
        else:
            device = f"{kind}:{index}"
            try:
                dev = self._copier().device_memory(ptr, nbytes, device, tensor)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise TransportError(f"tcp: cannot register {nbytes} bytes of {device} at {ptr:#x}: {exc}") from exc
        region_id = next(self._ids)
        descriptor = pack_descriptor(_NAME, "region", agent=self._agent, region=region_id, nbytes=nbytes, device=device)
        region = Region(region_id, ptr, nbytes, device, descriptor)
        self._regions.add(region_id, _TcpRegion(region, mem, dev))
        return region

    def path_cost(self, device: str = "cpu"):
        """Declared, on a 2-vCPU VM: loopback moves about 4 GB/s. A host entry is a row of its
        frame's table and an iovec on each side, not a frame of its own: with ``writev``/
        ``readv`` (``iov.py``) 0.12-0.21 us on top of the bytes for 1 KiB rows between two
        processes (``bench_tcp_vectored.py``: 0.6-0.76x of a plain stream's rate), about 0.3 us
        in the engine, where both sides' rows and the socket copies share the cores
        (``bench_e2e.py``'s workload moved 0.85x as fast row by row as staged: 0.3 us declared),
        without them (libc's cannot be loaded) a Python view per entry, about 0.6 us (1 us
        declared). A GPU entry adds one device copy call per piece (a few us: 5 us declared);
        the staged path's gather and scatter then run in device memory."""
        from sglang_kvxfer.planning.byteplan import PathCost

        kind, _ = parse_device(device)
        if kind == "cuda":
            return PathCost(5e-6, 4e9, 300e9, source="tcp cost, declared: GPU entries, one device copy each")
        if iov.available():
            return PathCost(
                0.3e-6, 4e9, 10e9, source="tcp cost, declared: host entries as iovecs (writev/readv)", row_writes=True
            )
        return PathCost(1e-6, 4e9, 10e9, source="tcp cost, declared: host entries in one frame per share")

    def _copier(self) -> Copier:
        with self._lock:
            if self.device_copier is None:
                try:
                    from sglang_kvxfer.transports.tcp.cuda import TorchCudaCopier

                    copier: Copier = TorchCudaCopier()
                except (ImportError, RuntimeError) as exc:
                    raise TransportError(
                        f"tcp moves device memory through pinned host buffers with torch's CUDA, "
                        f"which is not usable here ({exc}); register host memory instead"
                    ) from exc
                self.device_copier = copier
            return self.device_copier

    def deregister(self, region: Region) -> None:
        rid = region.region_id

        def stop_users() -> None:  # a misuse: writes in flight; protect the memory first
            with self._lock:
                inbound = [c for c in self._inbound if c.region_id == rid]
                outbound = [c for p in self._peers.values() for c in p.conns if c.uses_region(rid)]
            for c in inbound:
                _shutdown(c.sock)
            for c in outbound:
                c.fail(
                    f"local region {rid} was deregistered while being sent",
                    peer_failure=False,
                    error_cls=TransportError,
                )

        if self._regions.remove(rid, self._close_timeout_s, stop_users) is None:
            raise ValueError(f"region {rid} is not registered here")

    def import_region(self, peer_id: str, descriptor: bytes) -> RemoteRegion:
        self._check_open()
        peer = self._peers.get(peer_id)
        if peer is None:
            raise ValueError(f"unknown peer {peer_id!r} (add_peer it first)")
        desc = unpack_descriptor(
            descriptor, _NAME, "region", {"agent": str, "region": int, "nbytes": int, "device": str}
        )
        if desc["agent"] != peer.agent:
            raise ValueError(
                f"region descriptor belongs to agent {desc['agent']!r}, but peer {peer_id!r} is agent {peer.agent!r}"
            )
        if desc["nbytes"] <= 0:
            raise ValueError(f"tcp region descriptor: nbytes must be > 0, got {desc['nbytes']}")
        remote = RemoteRegion(peer_id, desc["region"], desc["nbytes"], desc["device"])
        with self._lock:
            if remote.region_id in peer.regions:
                raise ValueError(f"region {remote.region_id} of peer {peer_id!r} is already imported")
            peer.regions[remote.region_id] = remote
        return remote

    def admit_write(
        self, inbound: _Inbound, region_id: int, offsets: np.ndarray, sizes: np.ndarray
    ) -> UseTable.Lease | str:
        """Receiver check of one frame: a lease on the region, or why it is refused.

        Raises ``_Violation`` (the connection closes) when the writer's grant is gone."""
        if inbound.peer_id is None:
            raise _Violation("a WRITE frame before the writer proved a granted secret")
        grant = self._grants.get(inbound.peer_id)
        if grant is None or grant.key_id != inbound.key_id:
            raise _Violation(f"the grant of peer {inbound.peer_id!r} was revoked or replaced")
        # one answer for "absent" and "not yours": a writer learns nothing of other grants
        lease = self._regions.acquire(region_id) if region_id in grant.region_ids else None
        if lease is None:
            return f"region {region_id} is not open to this writer (not registered, deregistered, or not granted to it)"
        nbytes = lease.value.region.nbytes
        limit = np.uint64(nbytes)
        bad = (offsets > limit) | (sizes > limit - np.minimum(offsets, limit))
        if bad.any():
            self._regions.release(lease)
            i = int(np.argmax(bad))
            off, size = int(offsets[i]), int(sizes[i])
            return f"entry {i}: offset {off} + size {size} = {off + size} exceeds region {region_id} of {nbytes} bytes"
        return lease

    # -- landing receipts ---------------------------------------------------------------
    def landed(self, peer_id: str, receipts) -> bool:
        with self._landing:
            return self._landed(peer_id, receipts)

    def wait_landed(self, peer_id: str, receipts, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._landing:
            while not self._landed(peer_id, receipts):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeoutError(
                        f"tcp: writes of peer {peer_id!r} not landed after {timeout_s} s ({_receipts_text(receipts)})"
                    )
                self._landing.wait(left)

    def _landed(self, peer_id: str, receipts) -> bool:
        """Call with ``_landing`` held. A connection not bound yet may still come (the
        writer's notice can overtake its handshake): its receipts are pending."""
        done = True
        for conn_id, seq in receipts:
            inbound = self._by_conn_id.get(conn_id)
            if inbound is None:
                done = False
                continue
            if inbound.peer_id != peer_id:
                raise TransportError(
                    f"tcp: a receipt of peer {peer_id!r} names connection {conn_id:#x}, which is "
                    f"{'not from a bound writer' if inbound.peer_id is None else 'another writer'}'s"
                )
            refusal = inbound.refused.get(seq)
            if refusal is not None:
                raise TransportError(f"tcp: write frame {seq} of peer {peer_id!r} was refused here: {refusal}")
            if inbound.served < seq:
                if inbound.ended is not None:
                    raise TransportError(
                        f"tcp: connection {conn_id:#x} from peer {peer_id!r} ended after {inbound.served} "
                        f"frame(s), before frame {seq}: {inbound.ended}"
                    )
                done = False
        return done

    # -- writes -------------------------------------------------------------------------
    def _write(self, local: Region, remote: RemoteRegion, entries: Entries) -> Ticket:
        label = f"tcp write {local.region_id}->{remote.peer_id}:{remote.region_id}"
        peer = self._peers.get(remote.peer_id)
        imported = peer.regions.get(remote.region_id) if peer is not None else None
        opened = open_write(label, peer, imported, remote, self._regions, local, entries)
        if isinstance(opened, Ticket):
            return opened
        peer, lease = opened
        shares = _split(entries, min(self._num_conns, max(1, entries.total_bytes // self._split_min)))
        frames = [
            (i, _slice(share, a, a + _FRAME_ENTRIES))
            for i, share in enumerate(shares)
            for a in range(0, share.num_entries, _FRAME_ENTRIES)
        ]
        ticket = Ticket(label, parts=len(frames))
        mem, dev = lease.value.mem, lease.value.dev
        ready = None
        if mem is None:  # device memory: copies to the host must see work queued before this call
            try:
                ready = self._copier().ready(dev)
            except Exception as exc:
                self._regions.release(lease)
                return Ticket.failed(label, TransportError(f"tcp: cannot order the device copies: {exc}"))
        jobs = []
        for n, (i, frame) in enumerate(frames):
            frame_lease = lease if n == 0 else self._regions.retain(lease)
            xfer_id = next(self._xfer_ids)
            table = np.empty((frame.num_entries, 2), dtype="<u8")
            table[:, 0], table[:, 1] = frame.remote_offsets, frame.sizes
            bufs = [
                memoryview(HEADER.pack(T_WRITE, frame.num_entries, xfer_id, remote.region_id, frame.total_bytes)),
                memoryview(table.tobytes()),
            ]
            if mem is not None and frame.num_entries >= iov.MIN_ENTRIES and iov.available():
                payload_iov = iov.iovecs(local.ptr, frame.local_offsets, frame.sizes)
                jobs.append((i, _Job(xfer_id, ticket, frame_lease, bufs, iov=payload_iov)))
            elif mem is not None:
                bufs += [mem[o : o + size] for o, size in zip(frame.local_offsets.tolist(), frame.sizes.tolist())]
                jobs.append((i, _Job(xfer_id, ticket, frame_lease, bufs)))
            else:
                payload = DevicePayload(dev, frame.local_offsets, frame.sizes, ready)
                jobs.append((i, _Job(xfer_id, ticket, frame_lease, bufs, payload)))
        # picked and queued under the lock: a connection retiring meanwhile (reader's BYE,
        # see _Conn._retire) cannot be handed a job it would never send
        small = len(jobs) == 1 and mem is not None and entries.total_bytes <= INLINE_SEND_BYTES
        claimed = None
        with self._lock:
            first, peer.turn = peer.turn, peer.turn + len(shares)
            conns = [self._live_conn(remote.peer_id, peer, (first + i) % self._num_conns) for i in range(len(shares))]
            for i, job in jobs:
                if small and conns[i].claim(job):
                    claimed = (conns[i], job)
                elif not small:
                    conns[i].submit(job)
        if all(job.seq for _, job in jobs):  # numbered once queued or claimed (not: failed)
            ticket.receipts = tuple((conns[i].conn_id, job.seq) for i, job in jobs)
        if claimed is not None:  # sent here, outside the lock: no hand-over to the sender thread
            claimed[0].send_claimed(claimed[1])
        return ticket

    def _live_conn(self, peer_id: str, peer: _Peer, index: int) -> _Conn:
        conn = peer.conns[index]
        # closed locally or retired after the reader's BYE: not a peer failure, reconnect
        if (conn.dead is not None or conn.retiring) and peer.failed is None:
            conn = peer.conns[index] = _Conn(self, peer_id, peer, index)
        return conn

    # -- failures and lifetime ----------------------------------------------------------
    def peer_lost(self, peer_id: str, peer: PeerAddress, reason: str) -> None:
        if not isinstance(peer, _Peer):  # our connections are given our _Peer records
            raise TypeError(f"tcp: peer_lost expects the _Peer record of {peer_id!r}, got {type(peer).__name__}")
        with self._lock:
            if peer.failed is not None or self._closed:
                return
            peer.failed = reason
            self._failures.append(PeerFailure(peer_id, reason))
        log.warning("tcp: %s", reason)
        for conn in peer.conns:
            conn.fail(reason)

    def inbound_closed(self, inbound: _Inbound, reason: str | None) -> None:
        with self._landing:
            inbound.ended = reason or "closed"
            if self._by_conn_id.get(inbound.conn_id) is inbound:
                self._ended_ids.append(inbound.conn_id)
                while len(self._ended_ids) > _ENDED_KEPT:
                    self._by_conn_id.pop(self._ended_ids.popleft(), None)
            self._landing.notify_all()
        with self._lock:
            self._inbound.discard(inbound)
            with contextlib.suppress(ValueError):
                self._handshaking.remove(inbound)
            # refusals at the handshake are counted, never reported as peer failures
            if reason is None or self._closed or inbound.peer_id is None or inbound.cut:
                return
            text = f"inbound connection from peer {inbound.peer_id!r} {inbound.addr}: {reason}"
            self._failures.append(PeerFailure(inbound.peer_id, text))
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
                # a flood of silent connections must not hold threads: drop the oldest
                evicted = self._handshaking.popleft() if len(self._handshaking) >= self._max_handshakes else None
                self._handshaking.append(inbound)
                self._inbound.add(inbound)
            if evicted is not None:
                _shutdown(evicted.sock)
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
        # A writer told BYE retires its connection (its frames in flight still land and are
        # ACKed): no lost peer on its side for an orderly close here. Those that do not
        # answer within the grace are cut.
        for conn in inbound:
            conn.say_bye()
        grace = min(deadline, time.monotonic() + _BYE_GRACE_S)
        for conn in inbound:
            conn.thread.join(max(0.0, grace - time.monotonic()))
        for conn in inbound:
            _shutdown(conn.sock)
        for conn in inbound:
            conn.thread.join(max(0.0, deadline - time.monotonic()))
        self._acceptor.join(max(0.0, deadline - time.monotonic()))
