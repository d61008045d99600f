"""The bootstrap service and its client calls.

Owns ``BootstrapServer`` (a ZMQ ROUTER on one thread: prefill ranks register, decode ranks
ask where the prefill ranks are), ``request`` (one request/reply with a deadline, used by
both) and the address of one prefill DP group (``group_address``). A prefill rank that
registers again with a new session replaces its old entry, so a restarted prefill is found by
the next lookup. Conflicting registrations (another TP size, DP size, geometry or transport
than the ranks already registered) are refused with the reason.

Attention DP (SGLang ``--enable-dp-attention``): one bootstrap serves ``dp_size`` prefill DP
groups, each an attention-TP group of ``tp_size`` ranks with its own pools. Registrations name
their DP group; a query names the group it asks about and gets that group's ranks only, so a
decode rank knows each group as a separate prefill group (its own sessions, registrations,
deadlines and heartbeats) under the address ``host:port#dpN`` (``host:port`` for group 0).
Requests and replies travel in the authenticated envelope (``protocol/envelope.py``): a
request must carry a valid tag, be fresh (time-stamped sequence within the window, never
seen before) and name its envelope's sender as its session; anything else is dropped
unanswered and counted. A reply is bound to its request's sequence number.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import zmq

from sglang_kvxfer import auth
from sglang_kvxfer.engine.config import config_key, parse_host_port
from sglang_kvxfer.errors import AuthenticationError, KVXferError, RemoteProtocolError, TransferTimeoutError
from sglang_kvxfer.protocol import codec, envelope
from sglang_kvxfer.protocol.fields import MAX_FRAME_BYTES
from sglang_kvxfer.protocol.messages import (
    BootstrapQuery,
    BootstrapReply,
    PrefillRankInfo,
    PrefillRegister,
)

__all__ = ["BootstrapServer", "request", "group_address", "split_group_address"]

log = logging.getLogger("sglang_kvxfer.bootstrap")

_DP_MARK = "#dp"


def group_address(address: str, dp_rank: int) -> str:
    """The address a decode rank knows prefill DP group ``dp_rank`` of the bootstrap at
    ``address`` by: ``host:port`` for group 0, ``host:port#dpN`` for group N."""
    parse_host_port(address)
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0:
        raise ValueError(f"dp_rank={dp_rank!r} must be an int >= 0")
    return address if dp_rank == 0 else f"{address}{_DP_MARK}{dp_rank}"


def split_group_address(address: str) -> tuple[str, int]:
    """``group_address`` reversed: ``(bootstrap host:port, DP group)``."""
    base, mark, dp = address.partition(_DP_MARK)
    if mark and not (dp.isdigit() and str(int(dp)) == dp and int(dp) > 0):
        raise ValueError(f"bootstrap={address!r}: the DP group after {_DP_MARK!r} must be an int >= 1")
    parse_host_port(base)
    return base, int(dp) if mark else 0


class BootstrapServer:
    """Serve prefill registrations and decode lookups on ``host:port`` (port 0: any).

    ``key``: the shared key (see ``EngineConfig.auth_key``; None: from the environment).
    ``dropped`` counts refused frames by reason."""

    SENDER = "bootstrap"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, key: bytes | str | None = None):
        self._key = config_key(key, host)
        self._fresh = envelope.FreshnessGuard()
        self.dropped: dict[str, int] = {"unauthenticated": 0, "replayed": 0, "spoofed": 0, "malformed": 0}
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        try:
            if port:
                self._sock.bind(f"tcp://{host}:{port}")
            else:
                port = self._sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            self._sock.close(0)
            self._ctx.term()
            raise KVXferError(f"bootstrap service cannot listen on {host}:{port}: {exc}") from None
        self.host, self.port = host, port
        self.address = f"{host}:{port}"
        self._ranks: dict[tuple[int, int], PrefillRegister] = {}  # (dp_rank, tp_rank) ->
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvxfer-bootstrap", daemon=True)
        self._thread.start()

    def registered(self, dp_rank: int = 0) -> dict[int, str]:
        """tp_rank -> session of the registered prefill ranks of DP group ``dp_rank``."""
        with self._lock:
            return {tp: m.session for (dp, tp), m in self._ranks.items() if dp == dp_rank}

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            try:
                ident, _, frame = self._sock.recv_multipart(zmq.NOBLOCK)
            except (zmq.Again, ValueError):
                continue
            kind, why = "unauthenticated", ""
            try:
                sender, seq, payload = envelope.open_frame(self._key, frame)
                why = self._fresh.accept(sender, seq, time.time())
                if why:
                    kind = "replayed"
                else:
                    kind = "malformed"
                    msg = codec.decode(payload)
                    named = getattr(msg, "session", sender)
                    if named != sender:
                        kind, why = "spoofed", f"{type(msg).__name__} names session {named}, sent by {sender}"
            except KVXferError as exc:
                why = str(exc)
            if why:
                self.dropped[kind] += 1
                if self.dropped[kind] <= 3 or self.dropped[kind] % 1000 == 0:
                    log.warning("bootstrap dropped a frame (%s, %d so far): %s", kind, self.dropped[kind], why)
                continue
            reply = self._handle(msg)
            out = envelope.seal(self._key, self.SENDER, seq, codec.encode(reply))
            self._sock.send_multipart([ident, b"", out])

    def _handle(self, msg) -> BootstrapReply:
        with self._lock:
            if isinstance(msg, PrefillRegister):
                conflict = self._conflict(msg)
                if conflict:
                    log.warning("refused prefill rank %d of DP group %d: %s", msg.tp_rank, msg.dp_rank, conflict)
                    return self._reply(msg.dp_rank, reason=conflict, force_not_ready=True)
                self._ranks[(msg.dp_rank, msg.tp_rank)] = msg
                return self._reply(msg.dp_rank)
            if isinstance(msg, BootstrapQuery):
                return self._reply(msg.dp_rank)
        return self._reply(0, reason=f"bootstrap does not handle {type(msg).__name__}", force_not_ready=True)

    def _conflict(self, msg: PrefillRegister) -> str:
        # Every DP group is an attention-TP group of the same size over the same model.
        for (dp, tp), other in self._ranks.items():
            if (dp, tp) == (msg.dp_rank, msg.tp_rank):
                continue  # a restart of the same rank replaces it
            for name in ("tp_size", "dp_size", "geometry", "transport"):
                a, b = getattr(other, name), getattr(msg, name)
                if a != b:
                    return (
                        f"prefill rank {msg.tp_rank} of DP group {msg.dp_rank} registers {name}={b!r} but "
                        f"rank {tp} of DP group {dp} registered {name}={a!r}"
                    )
        return ""

    def _reply(self, dp_rank: int, reason: str = "", force_not_ready: bool = False) -> BootstrapReply:
        groups = sorted({dp for dp, _ in self._ranks})
        dp_size = next(iter(self._ranks.values())).dp_size if self._ranks else 0
        ranks = sorted((m for (dp, _), m in self._ranks.items() if dp == dp_rank), key=lambda m: m.tp_rank)
        size = ranks[0].tp_size if ranks else 0
        ready = bool(ranks) and len(ranks) == size and not force_not_ready
        if not ready and not reason:
            if dp_size and dp_rank >= dp_size:
                reason = (
                    f"dp_rank={dp_rank}: the prefill behind this bootstrap has dp_size={dp_size} "
                    f"(registered DP groups: {groups})"
                )
            elif not ranks and groups:
                reason = (
                    f"DP group {dp_rank} has no prefill rank registered "
                    f"(registered DP groups: {groups} of dp_size={dp_size})"
                )
            else:
                reason = f"{len(ranks)} of {size or '?'} prefill rank(s) registered"
                if dp_size > 1:
                    reason += f" in DP group {dp_rank}"
        return BootstrapReply(
            ready=ready,
            tp_size=size,
            geometry=ranks[0].geometry if ranks else None,
            transport=ranks[0].transport if ranks else "",
            ranks=tuple(PrefillRankInfo(tp_rank=m.tp_rank, endpoint=m.endpoint, session=m.session) for m in ranks),
            reason="" if ready else reason,
            dp_rank=dp_rank,
            dp_size=dp_size,
            dp_groups=tuple(groups),
        )

    def close(self, timeout_s: float = 5.0) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout_s)
        self._sock.close(0)
        self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def request(address: str, message, timeout_s: float, key: bytes | None = None) -> BootstrapReply:
    """Send ``message`` (its ``session`` is the sender) to the bootstrap at ``address`` and
    return its reply. ``key``: the shared key (None: from the environment).

    ``address`` may be a DP group's address (``group_address``): a ``BootstrapQuery`` sent
    there asks about that group (its ``dp_rank`` must be 0 or the same group); the reply must
    be about the group asked for.

    Raises ``TransferTimeoutError`` when no reply comes within ``timeout_s`` (the service is
    down or unreachable, or it uses another key: it drops what it cannot authenticate) and
    ``RemoteProtocolError`` for a malformed or unauthenticated reply.
    """
    base, dp_rank = split_group_address(address)
    host, port = parse_host_port(base)
    if isinstance(message, BootstrapQuery) and dp_rank:
        if message.dp_rank not in (0, dp_rank):
            raise ValueError(
                f"BootstrapQuery.dp_rank={message.dp_rank} but the address {address!r} names DP group {dp_rank}"
            )
        message = dataclasses.replace(message, dp_rank=dp_rank)
    key = auth.resolve_key() if key is None else key
    seq = envelope.fresh_seq(time.time())
    frame = envelope.seal(key, message.session, seq, codec.encode(message))
    ctx = zmq.Context()  # its own: nothing global outlives the call (or a closing manager)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send_multipart([b"", frame])
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeoutError(
                    f"bootstrap {address} did not answer within {timeout_s:.1f} s (down, unreachable, "
                    f"or using another key: set the same KVXFER_AUTH_KEY on every process)"
                )
            if sock.poll(int(min(left, 0.2) * 1000)):  # pyzmq truncates a float the same way
                parts = sock.recv_multipart()
                try:
                    sender, got_seq, payload = envelope.open_frame(key, parts[-1])
                except AuthenticationError as exc:
                    raise RemoteProtocolError(f"bootstrap {address} sent an unauthenticated reply: {exc}") from None
                if sender != BootstrapServer.SENDER or got_seq != seq:
                    raise RemoteProtocolError(f"bootstrap {address} sent a reply to another request")
                reply = codec.decode(payload)
                if not isinstance(reply, BootstrapReply):
                    raise RemoteProtocolError(f"bootstrap {address} answered with {type(reply).__name__}")
                if isinstance(message, BootstrapQuery) and reply.dp_rank != message.dp_rank:
                    raise RemoteProtocolError(
                        f"bootstrap {address}: asked about DP group {message.dp_rank}, the reply is about "
                        f"DP group {reply.dp_rank}"
                    )
                return reply
    finally:
        sock.close(0)
        ctx.term()
