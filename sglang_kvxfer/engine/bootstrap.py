"""The bootstrap service and its client calls.

Owns ``BootstrapServer`` (a ZMQ ROUTER on one thread: prefill ranks register, decode ranks
ask where the prefill ranks are), ``request`` (one request/reply with a deadline, used by
both) and the address of one prefill DP group (``group_address``). A prefill rank that
registers again with a new session replaces its old entry, so a restarted prefill is found by
the next lookup; one that closes takes its own entry back (``PrefillLeave``: SGLang's runtime
role switch turns a prefill into a decode while its bootstrap keeps serving). Conflicting registrations (another TP size, DP size, geometry or transport
than the ranks already registered) are refused with the reason.

Attention DP (SGLang ``--enable-dp-attention``): one bootstrap serves ``dp_size`` prefill DP
groups, each an attention-TP group of ``tp_size`` ranks with its own pools. Registrations name
their DP group; a query names the group it asks about and gets that group's ranks only, so a
decode rank knows each group as a separate prefill group (its own sessions, registrations,
deadlines and heartbeats) under the address ``host:port#dpN`` (``host:port`` for group 0).
A request's group is ``bootstrap_room % dp_size`` unless the ranks registered
``follows_room=False`` (SGLang's prefill load balancer places requests): then a rank of the
group that got a room registers it (``RoomRoute``, taken from that group's ranks only) and a
decode asks for it (``RoomQuery``), as SGLang's own bootstrap's DP-rank registry.

Pipeline parallelism (SGLang ``--pp-size``, protocol 6): each DP group is ``pp_size`` PP
stages, each an attention-TP group whose pools hold the stage's layers
``[layer_start, layer_start + num_layers)``. Registrations name their stage; a query names the
stage it asks about (address ``host:port#ppS``, ``host:port#dpN#ppS``) and gets that stage's
ranks and first layer only, so a decode rank knows each stage as a prefill group of its own.
Every stage registers the same TP, DP and PP sizes, transport and geometry except the layer
count and the page count (a stage's pool is sized by its own memory); the ranks of one stage
register the same first layer; stages hold disjoint layer ranges in stage order.

KV pools (protocol 6): a rank that serves a speculative draft model's KV as well registers it
separately, with ``kv_pool="draft"`` and the draft's geometry, and announces that geometry in
its registration of the model's pool (``draft_geometry``); likewise each component of the
model's extra per-request state (``kv_pool="state:<kind>[.<n>]"``, announced in
``state_pools``). Registrations, conflicts and queries are per pool; a reply about the model's
pool carries the announced draft geometry and state pools, so a decode learns whether the
prefill has a draft or state pools before any of their ranks is asked about.
Requests and replies travel in the authenticated envelope (``protocol/envelope.py``): a
request must carry a valid tag, be fresh (time-stamped sequence within the window, never
seen before) and name its envelope's sender as its session; anything else is dropped
unanswered and counted. A reply is bound to its request's sequence number.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time

import zmq

from sglang_kvxfer import auth
from sglang_kvxfer.engine.config import config_key, parse_host_port
from sglang_kvxfer.errors import AuthenticationError, KVXferError, RemoteProtocolError, TransferTimeoutError
from sglang_kvxfer.protocol import codec, envelope
from sglang_kvxfer.protocol.fields import MAX_FRAME_BYTES, MAX_ROOM_QUERY
from sglang_kvxfer.protocol.messages import (
    BootstrapQuery,
    BootstrapReply,
    PrefillLeave,
    PrefillRankInfo,
    PrefillRegister,
    RoomQuery,
    RoomRoute,
)

__all__ = [
    "BootstrapServer",
    "request",
    "attempt_timeout",
    "group_address",
    "split_address",
    "split_group_address",
    "split_stage_address",
    "room_groups",
]

log = logging.getLogger("sglang_kvxfer.bootstrap")

# Rooms a bootstrap remembers the DP group of (RoomRoute); the oldest are forgotten first.
MAX_ROOM_ROUTES = 1 << 16

_DP_MARK = "#dp"
_PP_MARK = "#pp"
_CP_MARK = "#cp"


def group_address(address: str, dp_rank: int, pp_rank: int = 0, cp_rank: int = 0) -> str:
    """The address a decode rank knows PP stage ``pp_rank`` of prefill DP group ``dp_rank``
    of the bootstrap at ``address`` by: ``host:port`` for group 0 stage 0, ``host:port#dpN``
    for group N, ``host:port#ppS`` / ``host:port#dpN#ppS`` for stage S; ``...#cpC`` for CP
    rank C of a prefill whose CP ranks each send their share of a request's pages."""
    parse_host_port(address)
    for name, value in (("dp_rank", dp_rank), ("pp_rank", pp_rank), ("cp_rank", cp_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r} must be an int >= 0")
    dp = f"{_DP_MARK}{dp_rank}" if dp_rank else ""
    pp = f"{_PP_MARK}{pp_rank}" if pp_rank else ""
    cp = f"{_CP_MARK}{cp_rank}" if cp_rank else ""
    return f"{address}{dp}{pp}{cp}"


def _mark(address: str, text: str, mark: str, what: str) -> int:
    if not (text.isdigit() and str(int(text)) == text and int(text) > 0):
        raise ValueError(f"bootstrap={address!r}: the {what} after {mark!r} must be an int >= 1")
    return int(text)


def split_address(address: str) -> tuple[str, int, int, int]:
    """``group_address`` reversed: ``(bootstrap host:port, DP group, PP stage, CP rank)``."""
    rest, cmark, cp = address.partition(_CP_MARK)
    rest, pmark, pp = rest.partition(_PP_MARK)
    base, dmark, dp = rest.partition(_DP_MARK)
    dp_rank = _mark(address, dp, _DP_MARK, "DP group") if dmark else 0
    pp_rank = _mark(address, pp, _PP_MARK, "PP stage") if pmark else 0
    cp_rank = _mark(address, cp, _CP_MARK, "CP rank") if cmark else 0
    parse_host_port(base)
    return base, dp_rank, pp_rank, cp_rank


def split_stage_address(address: str) -> tuple[str, int, int]:
    """``(bootstrap host:port, DP group, PP stage)`` of the address of a stage (CP rank 0)."""
    base, dp_rank, pp_rank, cp_rank = split_address(address)
    if cp_rank:
        raise ValueError(f"bootstrap={address!r} names CP rank {cp_rank}; this call takes a PP stage's address")
    return base, dp_rank, pp_rank


def split_group_address(address: str) -> tuple[str, int]:
    """``(bootstrap host:port, DP group)`` of a group address of PP stage 0."""
    base, dp_rank, pp_rank = split_stage_address(address)
    if pp_rank:
        raise ValueError(f"bootstrap={address!r} names PP stage {pp_rank}; this call takes a DP group's address")
    return base, dp_rank


# Geometry fields every PP stage shares (a stage's pool holds its own layers and is sized by
# its own memory, so num_layers and num_pages may differ between stages).
_STAGE_SHARED = ("total_kv_heads", "head_dim", "v_head_dim", "dtype", "page_size", "layout", "mla")


def _layers(msg: PrefillRegister) -> range:
    return range(msg.layer_start, msg.layer_start + msg.geometry.num_layers)


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
        # (kv_pool, dp_rank, pp_rank, cp_rank, tp_rank) -> the rank's registration
        self._ranks: dict[tuple[str, int, int, int, int], PrefillRegister] = {}
        # (kv_pool, dp_rank, pp_rank, cp_rank) -> the latest refusal of a rank of that group,
        # told to whoever asks about the group while it is not ready (until that rank registers)
        self._refused: dict[tuple[str, int, int, int], tuple[int, str]] = {}
        # room -> the DP group a prefill's load balancer placed it in (RoomRoute), oldest first
        self._rooms: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvxfer-bootstrap", daemon=True)
        self._thread.start()

    def registered(self, dp_rank: int = 0, kv_pool: str = "", pp_rank: int = 0, cp_rank: int = 0) -> dict[int, str]:
        """tp_rank -> session of the registered prefill ranks of PP stage ``pp_rank`` (CP rank
        ``cp_rank``) of DP group ``dp_rank`` (for KV pool ``kv_pool``)."""
        with self._lock:
            return {
                tp: m.session
                for (pool, dp, pp, cp, tp), m in self._ranks.items()
                if (pool, dp, pp, cp) == (kv_pool, dp_rank, pp_rank, cp_rank)
            }

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
                group = (msg.kv_pool, msg.dp_rank, msg.pp_rank, msg.cp_rank)
                conflict = self._conflict(msg)
                if conflict:
                    log.warning(
                        "refused prefill rank %d of DP group %d, PP stage %d, CP rank %d: %s",
                        msg.tp_rank,
                        msg.dp_rank,
                        msg.pp_rank,
                        msg.cp_rank,
                        conflict,
                    )
                    self._refused[group] = (msg.tp_rank, conflict)
                    return self._reply(*group, reason=conflict, force_not_ready=True)
                self._ranks[group + (msg.tp_rank,)] = msg
                if self._refused.get(group, (-1, ""))[0] == msg.tp_rank:
                    del self._refused[group]
                return self._reply(*group)
            if isinstance(msg, BootstrapQuery):
                return self._reply(msg.kv_pool, msg.dp_rank, msg.pp_rank, msg.cp_rank)
            if isinstance(msg, RoomRoute):
                return self._route(msg)
            if isinstance(msg, RoomQuery):
                known = tuple((room, self._rooms[room]) for room in msg.rooms if room in self._rooms)
                return dataclasses.replace(self._reply("", 0), room_groups=known)
            if isinstance(msg, PrefillLeave):
                key = (msg.kv_pool, msg.dp_rank, msg.pp_rank, msg.cp_rank, msg.tp_rank)
                held = self._ranks.get(key)
                if held is not None and held.session == msg.session:  # a restart's entry stays
                    del self._ranks[key]
                    log.info(
                        "prefill rank %d of DP group %d, PP stage %d, CP rank %d%s left (session %s)",
                        msg.tp_rank,
                        msg.dp_rank,
                        msg.pp_rank,
                        msg.cp_rank,
                        f", kv_pool={msg.kv_pool!r}" if msg.kv_pool else "",
                        msg.session,
                    )
                return self._reply(*key[:4])
        return self._reply("", 0, reason=f"bootstrap does not handle {type(msg).__name__}", force_not_ready=True)

    def _route(self, msg: RoomRoute) -> BootstrapReply:
        """Take a room's DP group from a registered rank of that group only: no other process
        can send a decode to another group's ranks. The oldest rooms are forgotten past
        ``MAX_ROOM_ROUTES`` (a decode asks within its bootstrap deadline)."""
        if not any(m.session == msg.session and dp == msg.dp_rank for (_, dp, _, _, _), m in self._ranks.items()):
            why = f"RoomRoute of room {msg.room}: session {msg.session} is no registered prefill rank of DP group {msg.dp_rank}"
            log.warning("bootstrap refused a %s", why)
            return self._reply("", msg.dp_rank, reason=why, force_not_ready=True)
        self._rooms[msg.room] = msg.dp_rank
        self._rooms.move_to_end(msg.room)
        while len(self._rooms) > MAX_ROOM_ROUTES:
            self._rooms.popitem(last=False)
        return dataclasses.replace(self._reply("", msg.dp_rank), room_groups=((msg.room, msg.dp_rank),))

    def _conflict(self, msg: PrefillRegister) -> str:
        # Every DP group is pp_size PP stages, each an attention-TP group of the same size over
        # the same model; a draft-model pool is served by the same ranks (same sizes and
        # transport). Stages differ only in their layers and their pool's pages, and in whether
        # they hold the draft model's pool (SGLang runs it on the last stage only). The CP
        # ranks of a stage (cp_size > 1) hold the same layers and pools.
        for (pool, dp, pp, cp, tp), other in self._ranks.items():
            if (pool, dp, pp, cp, tp) == (msg.kv_pool, msg.dp_rank, msg.pp_rank, msg.cp_rank, msg.tp_rank):
                continue  # a restart of the same rank replaces it
            names: tuple[str, ...] = (
                "tp_size",
                "dp_size",
                "pp_size",
                "cp_size",
                "transport",
                "follows_room",
                "dcp_size",
                "kv_sharded",
            )
            if pool == msg.kv_pool:
                names += ("geometry", "draft_geometry") if pp == msg.pp_rank else ()
                names += ("state_pools", "all_heads")
            theirs = f"rank {tp} of DP group {dp}" + (f", PP stage {pp}," if other.pp_size > 1 else "")
            theirs += f" CP rank {cp}" if other.cp_size > 1 else ""
            for name in names:
                a, b = getattr(other, name), getattr(msg, name)
                if a != b:
                    return self._refusal(msg, f"{name}={b!r}", f"{theirs} registered {name}={a!r}", pool)
            if pool != msg.kv_pool:
                continue
            if pp == msg.pp_rank and other.layer_start != msg.layer_start:
                return self._refusal(
                    msg, f"layer_start={msg.layer_start}", f"{theirs} registered layer_start={other.layer_start}", pool
                )
            if pp != msg.pp_rank:
                shared = [
                    (name, getattr(other.geometry, name), getattr(msg.geometry, name))
                    for name in _STAGE_SHARED
                    if getattr(other.geometry, name) != getattr(msg.geometry, name)
                ]
                if shared:
                    name, a, b = shared[0]
                    return self._refusal(msg, f"geometry.{name}={b!r}", f"{theirs} registered {name}={a!r}", pool)
                mine, its = _layers(msg), _layers(other)
                if (pp < msg.pp_rank and its.stop > mine.start) or (pp > msg.pp_rank and mine.stop > its.start):
                    return self._refusal(
                        msg,
                        f"layers [{mine.start}, {mine.stop})",
                        f"PP stage {pp} registered layers [{its.start}, {its.stop}) (stages hold disjoint "
                        "layer ranges in stage order)",
                        pool,
                    )
        return ""

    @staticmethod
    def _refusal(msg: PrefillRegister, mine: str, theirs: str, pool: str) -> str:
        stage = f", PP stage {msg.pp_rank}," if msg.pp_size > 1 else ""
        stage += f" CP rank {msg.cp_rank}" if msg.cp_size > 1 else ""
        what = f" for kv_pool={msg.kv_pool!r}" if msg.kv_pool else ""
        other = f" for kv_pool={pool!r}" if pool else ""
        return f"prefill rank {msg.tp_rank} of DP group {msg.dp_rank}{stage} registers {mine}{what} but {theirs}{other}"

    def _reply(
        self,
        kv_pool: str,
        dp_rank: int,
        pp_rank: int = 0,
        cp_rank: int = 0,
        reason: str = "",
        force_not_ready: bool = False,
    ) -> BootstrapReply:
        pooled = {(dp, pp, cp, tp): m for (pool, dp, pp, cp, tp), m in self._ranks.items() if pool == kv_pool}
        groups = sorted({dp for dp, _, _, _ in pooled})
        stages = sorted({pp for dp, pp, _, _ in pooled if dp == dp_rank})
        first = next(iter(pooled.values()), None)
        dp_size = first.dp_size if first is not None else 0
        pp_size = first.pp_size if first is not None else 0
        cp_size = first.cp_size if first is not None else 1
        ranks = sorted(
            (m for (dp, pp, cp, _), m in pooled.items() if (dp, pp, cp) == (dp_rank, pp_rank, cp_rank)),
            key=lambda m: m.tp_rank,
        )
        size = ranks[0].tp_size if ranks else 0
        ready = bool(ranks) and len(ranks) == size and not force_not_ready
        if not ready and not reason:
            stage = f" PP stage {pp_rank} of" if pp_size > 1 else ""
            stage = f" CP rank {cp_rank} of{stage}" if cp_size > 1 or cp_rank else stage
            if cp_rank >= cp_size and first is not None:
                reason = (
                    f"cp_rank={cp_rank}: the prefill behind this bootstrap registered cp_size={cp_size} "
                    "(CP ranks that send their share of a request's pages)"
                )
            elif dp_size and dp_rank >= dp_size:
                reason = (
                    f"dp_rank={dp_rank}: the prefill behind this bootstrap has dp_size={dp_size} "
                    f"(registered DP groups: {groups})"
                )
            elif pp_size and pp_rank >= pp_size:
                reason = (
                    f"pp_rank={pp_rank}: the prefill behind this bootstrap has pp_size={pp_size} "
                    f"(registered PP stages of DP group {dp_rank}: {stages})"
                )
            elif not ranks and dp_rank not in groups and groups:
                reason = (
                    f"DP group {dp_rank} has no prefill rank registered "
                    f"(registered DP groups: {groups} of dp_size={dp_size})"
                )
            elif not ranks and stages and pp_rank not in stages:
                reason = (
                    f"PP stage {pp_rank} of DP group {dp_rank} has no prefill rank registered "
                    f"(registered PP stages: {stages} of pp_size={pp_size})"
                )
            else:
                reason = f"{len(ranks)} of {size or '?'} prefill rank(s) registered"
                if dp_size > 1 or pp_size > 1 or stage:
                    reason += f" in{stage} DP group {dp_rank}"
            if kv_pool:
                reason += f" (kv_pool={kv_pool!r})"
            refused = self._refused.get((kv_pool, dp_rank, pp_rank, cp_rank))
            if refused is not None:
                reason += f"; refused: {refused[1]}"
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
            kv_pool=kv_pool,
            draft_geometry=ranks[0].draft_geometry if ranks and not kv_pool else None,
            state_pools=ranks[0].state_pools if ranks and not kv_pool else (),
            pp_rank=pp_rank,
            pp_size=pp_size,
            layer_start=ranks[0].layer_start if ranks else 0,
            pp_stages=tuple(stages),
            follows_room=first.follows_room if first is not None else True,
            api_port=ranks[0].api_port if ranks else 0,
            dcp_size=first.dcp_size if first is not None else 1,
            cp_rank=cp_rank,
            cp_size=cp_size,
            all_heads=first.all_heads if first is not None else False,
            kv_sharded=first.kv_sharded if first is not None else False,
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


FIRST_ATTEMPT_S = 0.5
LAST_ATTEMPT_S = 4.0


def attempt_timeout(unanswered: int, deadline: float) -> float:
    """How long the next ``request`` of a retry loop waits, after ``unanswered`` requests in a
    row got no reply: 0.5 s, doubling up to 4 s, and never past ``deadline`` (monotonic; at
    least 0.1 s). A service that is down is asked again twice a second at first; one in a
    process starved of CPU (an engine busy-polling on a crowded host, whose threads wait
    seconds for the GIL) still gets windows long enough to answer in."""
    if isinstance(unanswered, bool) or not isinstance(unanswered, int) or unanswered < 0:
        raise ValueError(f"unanswered={unanswered!r} must be an int >= 0")
    window = min(LAST_ATTEMPT_S, FIRST_ATTEMPT_S * 2 ** min(unanswered, 8))
    return max(0.1, min(window, deadline - time.monotonic()))


def room_groups(address: str, rooms, *, session: str, timeout_s: float, key: bytes | None = None) -> dict[int, int]:
    """room -> DP group of those of ``rooms`` that a prefill's DP group registered with the
    bootstrap at ``address`` (``RoomQuery``; at most ``MAX_ROOM_QUERY`` rooms a request).

    Raises:
        as ``request``.
    """
    base = split_address(address)[0]
    found: dict[int, int] = {}
    rooms = [int(r) for r in rooms]
    for i in range(0, len(rooms), MAX_ROOM_QUERY):
        msg = RoomQuery(session=session, rooms=tuple(rooms[i : i + MAX_ROOM_QUERY]))
        found.update((int(room), int(dp)) for room, dp in request(base, msg, timeout_s, key).room_groups)
    return found


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
    base, dp_rank, pp_rank, cp_rank = split_address(address)
    host, port = parse_host_port(base)
    if isinstance(message, BootstrapQuery) and dp_rank:
        if message.dp_rank not in (0, dp_rank):
            raise ValueError(
                f"BootstrapQuery.dp_rank={message.dp_rank} but the address {address!r} names DP group {dp_rank}"
            )
        message = dataclasses.replace(message, dp_rank=dp_rank)
    if isinstance(message, BootstrapQuery) and pp_rank:
        if message.pp_rank not in (0, pp_rank):
            raise ValueError(
                f"BootstrapQuery.pp_rank={message.pp_rank} but the address {address!r} names PP stage {pp_rank}"
            )
        message = dataclasses.replace(message, pp_rank=pp_rank)
    if isinstance(message, BootstrapQuery) and cp_rank:
        if message.cp_rank not in (0, cp_rank):
            raise ValueError(
                f"BootstrapQuery.cp_rank={message.cp_rank} but the address {address!r} names CP rank {cp_rank}"
            )
        message = dataclasses.replace(message, cp_rank=cp_rank)
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
            # Past the deadline, one last look: a thread that waited long for the GIL or a
            # core takes a reply that came meanwhile rather than calling it a timeout.
            if left <= 0 and not sock.poll(0):
                raise TransferTimeoutError(
                    f"bootstrap {address} did not answer within {timeout_s:.1f} s (down, unreachable, "
                    f"or using another key: set the same KVXFER_AUTH_KEY on every process)"
                )
            if left <= 0 or sock.poll(int(min(left, 0.2) * 1000)):  # pyzmq truncates a float the same way
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
                if isinstance(message, BootstrapQuery) and reply.pp_rank != message.pp_rank:
                    raise RemoteProtocolError(
                        f"bootstrap {address}: asked about PP stage {message.pp_rank}, the reply is about "
                        f"PP stage {reply.pp_rank}"
                    )
                asked = getattr(message, "kv_pool", "")
                if reply.kv_pool != asked:
                    raise RemoteProtocolError(
                        f"bootstrap {address}: asked about kv_pool={asked!r}, the reply is about "
                        f"kv_pool={reply.kv_pool!r}"
                    )
                return reply
    finally:
        sock.close(0)
        ctx.term()
