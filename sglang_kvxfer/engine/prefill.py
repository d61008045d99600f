"""The prefill side: ``PrefillManager`` and ``KVSender``.

A prefill rank registers with the bootstrap, accepts decode registrations (checking the
geometry and answering with the field-level message on a mismatch), collects each
request's metadata from every candidate decode rank, and then writes the request's KV as
the sender hands over chunks of pages (and, layer-wise, groups of layers of each chunk as
the forward finishes them): direct page runs where the bytes are contiguous,
otherwise gather -> one write per staging slot -> ``ChunkReady`` (the decode rank
scatters and returns the slot with ``ChunkAck``). After the last chunk every reader gets a
``TransferDone`` carrying the aux payload. Every wait has a deadline; a failure fails only
its room and is reported to the decode ranks involved.

This module owns registration (bootstrap, decode registrations and forgotten sessions),
the control messages, room ownership (the first decode session to claim a room for a
decode rank wins; a conflicting claim fails the room on both sides) and failure handling.
The room table is ``prefill_rooms.py``; the bytes are ``prefill_datapath.py``.
Must not: move KV bytes or plan them (the data path does), or block the I/O thread.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import numpy as np

from sglang_kvxfer.engine import bootstrap
from sglang_kvxfer.engine.config import ENGINE_VERSION, EngineConfig
from sglang_kvxfer.engine.manager import Peer, RankBase, RequestHandle
from sglang_kvxfer.engine.pool import BufferLoc, KVPool
from sglang_kvxfer.engine.prefill_datapath import PrefillDataPath
from sglang_kvxfer.engine.prefill_rooms import Chunk, PrefillRoom, PrefillRoomTable
from sglang_kvxfer.errors import KVXferError, LocalProtocolError, TransferFailedError, TransferTimeoutError
from sglang_kvxfer.geometry import check_compatible
from sglang_kvxfer.planning import DataPath, PoolMapping, candidate_decode_ranks, plan_tp
from sglang_kvxfer.protocol.envelope import peer_secret
from sglang_kvxfer.protocol.fields import Side
from sglang_kvxfer.protocol.messages import (
    Abort,
    ChunkAck,
    DecodeRegister,
    Heartbeat,
    PrefillLeave,
    PrefillReady,
    PrefillRegister,
    RegisterReply,
    RequestMeta,
    RoomRoute,
    RoomWatch,
    TransferFailed,
)
from sglang_kvxfer.protocol.state import Event, KVPoll
from sglang_kvxfer.transports.base import RemoteRegion, Transport

__all__ = ["PrefillManager", "KVSender"]

# How long a closing rank waits for the bootstrap to confirm it left (a bootstrap that has
# ended first, as at a server's shutdown, is not waited for longer).
LEAVE_TIMEOUT_S = 0.5
# How long registering a room's DP group with the bootstrap may take (SGLang's own: 5 s).
ROUTE_TIMEOUT_S = 5.0

log = logging.getLogger("sglang_kvxfer.prefill")


class DecodePeer(Peer):
    """A registered decode rank: its placement, imported regions and buffer locations, and
    the staging segments its ``RequestMeta``s named (imported on first use)."""

    def __init__(self, msg: DecodeRegister, regions: list[RemoteRegion], now: float):
        super().__init__(msg.session, msg.tp_rank, msg.endpoint, now)
        self.placement = msg.geometry.placement(msg.tp_size, msg.tp_rank)
        self.regions = regions
        self.locs = [BufferLoc(int(r), int(o)) for r, o in msg.kv_buffer_locs]
        self.mapping = PoolMapping(False, "its registration was not accepted")  # fused path: prefill_fused.py
        self.mapped_buffers: dict[int, tuple[int, Any]] = {}  # buffer -> (region base, tensor): prefill_fused.py
        self._staging: dict[bytes, RemoteRegion] = {}
        self._staging_lock = threading.Lock()

    def staging_segment(self, transport: Transport, descriptor: bytes) -> RemoteRegion:
        """The peer's staging segment ``descriptor`` as a ``RemoteRegion`` (imported once:
        a decode rank's segments live as long as its session)."""
        with self._staging_lock:
            region = self._staging.get(descriptor)
            if region is None:
                region = self._staging[descriptor] = transport.import_region(self.session, descriptor)
            return region


class PrefillManager(PrefillRoomTable, PrefillDataPath, RankBase[PrefillRoom]):
    """One prefill TP rank. Registers with the bootstrap at construction (with retries
    until ``bootstrap_timeout_s``; ``wait_registered`` blocks on it). The room table
    (``MAX_UNATTACHED_ROOMS``, ``ROOM_RETENTION_S``) and the data path are mixins."""

    side = Side.PREFILL

    def __init__(self, config: EngineConfig, pool: KVPool | None = None):
        self._decode_peers: dict[str, DecodePeer] = {}  # before the I/O thread starts
        # Forgotten decode sessions -> (peer, last time told to register again), capped.
        self._lost_peers: collections.OrderedDict[str, tuple[Peer, float]] = collections.OrderedDict()
        self._num_unattached = 0
        self._failed_rooms = collections.OrderedDict()
        super().__init__(config, pool)
        self._registered = threading.Event()
        self._left = False
        self.registration_error: str | None = None
        self.start_thread(self._register_with_bootstrap, f"kvxfer-prefill{self.tp_rank}-boot")

    # -- bootstrap -----------------------------------------------------------------------------
    def _register_with_bootstrap(self) -> None:
        msg = PrefillRegister(
            engine_version=ENGINE_VERSION,
            session=self.session,
            tp_size=self.config.tp_size,
            tp_rank=self.tp_rank,
            endpoint=self._live_control.endpoint,
            geometry=self.config.geometry,
            transport=self.config.transport,
            dp_rank=self.config.dp_rank,
            dp_size=self.config.dp_size,
            kv_pool=self.config.kv_pool,
            draft_geometry=self.config.draft_geometry,
            state_pools=self.config.state_pools,
            pp_rank=self.config.pp_rank,
            pp_size=self.config.pp_size,
            layer_start=self.config.layer_start,
            follows_room=self.config.follows_room,
            api_port=self.config.api_port,
            dcp_size=self.config.dcp_size,
            cp_rank=self.config.cp_rank,
            cp_size=self.config.cp_size,
            all_heads=self.config.all_heads,
            kv_sharded=self.config.kv_sharded,
        )
        deadline = time.monotonic() + self.config.bootstrap_timeout_s
        last, unanswered = "no answer", 0
        while not self._closed and time.monotonic() < deadline:
            wait_s = bootstrap.attempt_timeout(unanswered, deadline)
            try:
                reply = bootstrap.request(self.config.bootstrap, msg, timeout_s=wait_s, key=self.config.key)
            except KVXferError as exc:
                last = str(exc)
                unanswered += isinstance(exc, TransferTimeoutError)
                time.sleep(0.2)
                continue
            # Registered means the bootstrap now lists this session in its group; a refusal
            # (settings that conflict with the group's) leaves it out and says why.
            if any(info.session == self.session for info in reply.ranks):
                self._registered.set()
                return
            self.registration_error = reply.reason or "the bootstrap's reply does not list this rank"
            log.error("bootstrap refused prefill rank %d: %s", self.tp_rank, self.registration_error)
            break
        if self.registration_error is None:
            self.registration_error = f"could not register with bootstrap {self.config.bootstrap}: {last}"
        self._registered.set()
        if not self._closed:  # no decode can find this rank: its requests fail now, not at their deadline
            with self._lock:
                waiting = [r for r in self._rooms.values() if not r.state.is_terminal]
            for rec in waiting:
                self._fail_room(rec, self.unregistered_reason() or "", notify=False)

    def unregistered_reason(self) -> str | None:
        """Why this rank is not registered with the bootstrap (its requests fail with it); None
        while registered or still registering."""
        if not self._registered.is_set() or not self.registration_error:
            return None
        return (
            f"prefill rank {self.tp_rank} is not registered with the bootstrap {self.config.bootstrap}, so no "
            f"decode rank can reach it: {self.registration_error}"
        )

    def route_room(self, room: int, timeout_s: float = ROUTE_TIMEOUT_S) -> None:
        """Tell the bootstrap that this rank's DP group serves ``room`` (``RoomRoute``: SGLang's
        load balancer placed the request here, so a decode cannot find it as
        ``bootstrap_room % dp_size``). Blocks for the bootstrap's answer, at most ``timeout_s``.

        Raises:
            TransferFailedError: the bootstrap refused it (naming why), or did not answer.
        """
        msg = RoomRoute(session=self.session, room=room, dp_rank=self.config.dp_rank)
        try:
            reply = bootstrap.request(self.config.bootstrap, msg, timeout_s=timeout_s, key=self.config.key)
        except KVXferError as exc:
            raise TransferFailedError(
                f"could not register room {room}'s DP group {self.config.dp_rank} with the bootstrap: {exc}", room
            ) from None
        if (room, self.config.dp_rank) not in [tuple(pair) for pair in reply.room_groups]:
            raise TransferFailedError(f"the bootstrap refused room {room}'s DP group: {reply.reason}", room)

    def close(self, timeout_s: float = 5.0) -> None:
        """Close (``RankBase.close``), then take this rank's registration back from the
        bootstrap (``PrefillLeave``, at most ``LEAVE_TIMEOUT_S``): a bootstrap that outlives
        the rank (SGLang's role switch) stops naming it to decode ranks. A bootstrap that is
        gone or slow is logged, not waited for. Idempotent."""
        super().close(timeout_s)
        if getattr(self, "_left", True) or not self._registered.is_set() or self.registration_error:
            return
        self._left = True
        leave = PrefillLeave(
            session=self.session,
            tp_rank=self.tp_rank,
            dp_rank=self.config.dp_rank,
            kv_pool=self.config.kv_pool,
            pp_rank=self.config.pp_rank,
            cp_rank=self.config.cp_rank,
        )
        try:
            bootstrap.request(self.config.bootstrap, leave, timeout_s=LEAVE_TIMEOUT_S, key=self.config.key)
        except KVXferError as exc:
            log.info("prefill rank %d: leaving bootstrap %s: %s", self.tp_rank, self.config.bootstrap, exc)

    def wait_registered(self, timeout_s: float) -> None:
        """Block until registered with the bootstrap; raise if it failed or timed out."""
        if not self._registered.wait(timeout_s):
            raise TransferTimeoutError(f"prefill rank {self.tp_rank} not registered after {timeout_s} s")
        if self.registration_error:
            raise TransferFailedError(self.registration_error)

    # -- messages (I/O thread) ------------------------------------------------------------------
    def _on_message(self, msg: Any, sender: str) -> None:
        if isinstance(msg, Heartbeat):
            peer = self._decode_peers.get(sender)
            if peer is not None:
                self._heard(peer, msg)
            else:
                self._unknown_session(sender)
        elif isinstance(msg, DecodeRegister):
            self._on_register(msg)
        elif isinstance(msg, RequestMeta):
            self._on_meta(msg)
        elif isinstance(msg, RoomWatch):
            self._on_watch(msg, sender)
        elif isinstance(msg, ChunkAck):
            self._on_ack(msg, sender)
        elif isinstance(msg, (Abort, TransferFailed)):
            self._on_peer_failure(msg, sender)
        else:
            log.warning("prefill rank %d ignored unexpected %s", self.tp_rank, type(msg).__name__)

    def _unknown_session(self, sender: str) -> None:
        """A decode session this rank forgot (declared dead while it was stalled) is still
        talking: tell it to register again, at most once per heartbeat interval."""
        now = time.monotonic()
        with self._lock:
            lost = self._lost_peers.get(sender)
            if lost is None or now - lost[1] < self.config.heartbeat_interval_s:
                return
            self._lost_peers[sender] = (lost[0], now)
        self._live_control.send(
            lost[0].endpoint,
            RegisterReply(
                session=self.session,
                tp_rank=self.tp_rank,
                ok=False,
                geometry=self.config.geometry,
                error=f"prefill rank {self.tp_rank} no longer knows decode session {sender} (declared dead "
                f"after {self.config.heartbeat_timeout_s} s of silence); register again",
            ),
        )

    def _on_peer_failure(self, msg: Abort | TransferFailed, sender: str) -> None:
        """Abort/TransferFailed from a decode rank: only from a registered session, and for a
        room another session's metadata claims for that decode rank, not at all."""
        if sender not in self._decode_peers and sender not in self._lost_peers:
            self.security_event(
                "unregistered_sender",
                "%s for room %d from unregistered session %s dropped",
                type(msg).__name__,
                msg.room,
                sender,
            )
            return
        what = "aborted" if isinstance(msg, Abort) else "failed"
        with self._lock:
            rec = self._rooms.get(msg.room)
            if rec is None:
                rec = self._create_unattached(msg.room)
                if rec is None:
                    return
            owner = rec.metas.get(msg.tp_rank)
            if owner is not None and owner.session != sender:
                self.security_event(
                    "unexpected_sender",
                    "%s for room %d, decode rank %d, from session %s; the room belongs to session %s",
                    type(msg).__name__,
                    msg.room,
                    msg.tp_rank,
                    sender,
                    owner.session,
                )
                return
        # An unknown room keeps a failed record, so a sender created later fails at once.
        self._fail_room(rec, f"decode rank {msg.tp_rank} {what} the request: {msg.reason}", notify=False)

    def _on_register(self, msg: DecodeRegister) -> None:
        error = ""
        old = self._decode_peers.get(msg.session)
        if old is not None:  # a re-registration replaces the stale record on both layers
            self._drop_peer(
                old,
                f"decode session {msg.session} registered again (it had been stalled or "
                f"lost this rank); its earlier requests end",
            )
            with self._lock:
                self._decode_peers.pop(msg.session, None)
        try:
            if msg.transport != self.config.transport:
                raise KVXferError(
                    f"transport: prefill={self.config.transport!r} decode={msg.transport!r} "
                    f"(start both sides with the same --transport)"
                )
            check_compatible(self.config.geometry, msg.geometry)
            if len(msg.kv_buffer_locs) != msg.geometry.num_buffers:
                raise KVXferError(
                    f"kv_buffer_locs has {len(msg.kv_buffer_locs)} entries; the geometry "
                    f"has {msg.geometry.num_buffers} buffers"
                )
            transport = self._live_transport
            transport.add_peer(
                msg.session, msg.agent_descriptor, secret=peer_secret(self.config.key, self.session, msg.session)
            )
            regions = [transport.import_region(msg.session, d) for d in msg.kv_regions]
            peer = DecodePeer(msg, regions, time.monotonic())
            for b, loc in enumerate(peer.locs):
                if (
                    not 0 <= loc.region < len(regions)
                    or loc.offset + peer.placement.buffer_nbytes(b) > regions[loc.region].nbytes
                ):
                    raise KVXferError(f"kv_buffer_locs[{b}]={loc.region, loc.offset} is outside the registered regions")
            peer.mapping = self._pool_mapping(peer)
        except Exception as exc:  # any refusal is reported to the peer, never raised here
            error = str(exc)
            log.error(
                "prefill rank %d refused decode rank %d (session %s): %s", self.tp_rank, msg.tp_rank, msg.session, error
            )
            try:
                self._live_transport.remove_peer(msg.session)
            except Exception:
                pass
            with self._lock:  # refused, but authenticated: its aborts and failures still count
                self._remember_lost(Peer(msg.session, msg.tp_rank, msg.endpoint, time.monotonic()))
        else:
            with self._lock:
                self._decode_peers[msg.session] = peer
                self._lost_peers.pop(msg.session, None)
        mapping = PoolMapping(False, "") if error else peer.mapping
        self._live_control.send(
            msg.endpoint,
            RegisterReply(
                session=self.session,
                tp_rank=self.tp_rank,
                ok=not error,
                error=error,
                geometry=self.config.geometry,
                pool_mapped=mapping.mapped,
                pool_note=mapping.note,
            ),
        )

    def _on_meta(self, meta: RequestMeta) -> None:
        peer = self._decode_peers.get(meta.session)
        if peer is None:
            if meta.session in self._lost_peers:  # forgotten while stalled: it must register again
                log.warning(
                    "prefill rank %d: RequestMeta for room %d from forgotten decode session %s; "
                    "asking it to register again",
                    self.tp_rank,
                    meta.room,
                    meta.session,
                )
                self._unknown_session(meta.session)
            else:
                self.security_event(
                    "unregistered_sender",
                    "RequestMeta for room %d from unregistered decode session %s dropped",
                    meta.room,
                    meta.session,
                )
            return
        peer.last_seen = time.monotonic()
        g = self.config.geometry
        conflict = ""
        with self._lock:
            rec, late = self._frame_room(meta.room)
            if not late and rec is not None:
                owner = rec.metas.get(meta.tp_rank)
                if owner is not None:
                    conflict = (
                        f"security: room {meta.room} for decode rank {meta.tp_rank} was claimed by "
                        f"session {owner.session} and again by session {meta.session}"
                        if owner.session != meta.session
                        else f"decode rank {meta.tp_rank} sent the metadata of room {meta.room} twice"
                    )
            if late or conflict or rec is None:  # rec is None only with a reason in late
                ready, problem = False, ""
            else:
                if rec.expected is None:
                    rec.expected = candidate_decode_ranks(
                        g.total_kv_heads, self.config.tp_size, meta.tp_size, self.tp_rank, g.mla
                    )
                    rec.plan = plan_tp(g.total_kv_heads, self.config.tp_size, meta.tp_size, g.mla, salt=meta.room)
                    rec.num_tokens = meta.num_tokens
                    rec.prefix_tokens = meta.prefix_tokens
                    rec.sparse = meta.sparse
                problem = self._meta_problem(rec, meta)
                if problem:
                    ready = False
                else:
                    rec.metas[meta.tp_rank] = meta
                    ready = rec.state.poll is KVPoll.Bootstrapping and set(rec.metas) == set(rec.expected)
                    if ready:
                        rec.marks["dest_known"] = time.monotonic()
                        rec.state.handle(Event.BOOTSTRAPPED, rec.marks["dest_known"])
        if late or rec is None:  # the request already ended here: say so instead of leaving decode to its deadline
            self._live_control.send(
                peer.endpoint, TransferFailed(room=meta.room, side=Side.PREFILL, tp_rank=self.tp_rank, reason=late)
            )
        elif conflict:
            if conflict.startswith("security"):
                self.security_event("room_conflict", "%s", conflict)
            self._fail_room(rec, conflict, extra_sessions=(meta.session,))
        elif problem:
            self._fail_room(rec, problem, extra_sessions=(meta.session,))
        elif ready:
            self._schedule(rec)

    def _frame_room(self, room: int) -> tuple[PrefillRoom | None, str]:
        """The record a decode's frame about ``room`` acts on (made, unattached, if none
        exists), and why the room cannot take it (empty if it can): it failed and was
        released before the frame came, no record could be made, or it already ended.
        Call with the lock held."""
        rec = self._rooms.get(room)
        failed = self.failed_reason(room) if rec is None else None
        if rec is None and failed is None:
            rec = self._create_unattached(room)
        if failed is not None:  # it failed here and was released before this frame came
            return rec, failed
        if rec is None:
            return None, f"prefill rank {self.tp_rank} holds too many requests nobody sends yet"
        if rec.state.is_terminal:
            return rec, rec.state.reason or f"room {room} already completed on prefill rank {self.tp_rank}"
        return rec, ""

    def _on_watch(self, msg: RoomWatch, sender: str) -> None:
        """A decode rank waits for this room's forward before it allocates: tell it once
        ``mark_prefill_complete`` did (at once if it already has). Only a registered
        session, naming itself, and not for a decode rank another session watches."""
        peer = self._decode_peers.get(sender)
        if peer is None or msg.session != sender:
            if sender in self._lost_peers:
                self._unknown_session(sender)
                return
            self.security_event(
                "unregistered_sender",
                "RoomWatch for room %d from session %s (naming session %s) dropped",
                msg.room,
                sender,
                msg.session,
            )
            return
        peer.last_seen = time.monotonic()
        conflict = ""
        ready = False
        with self._lock:
            rec, late = self._frame_room(msg.room)
            if not self.config.prefill_complete:
                late = (
                    f"the decode allocates only once the prefill finished (SGLang's "
                    f"--disaggregation-decode-allocation-policy prefill_complete), but prefill rank {self.tp_rank} "
                    "does not announce it (policy early): set the same policy on both servers"
                )
            elif not late and rec is not None:
                owner = rec.watchers.get(msg.tp_rank)
                if owner is not None and owner != sender:
                    conflict = (
                        f"security: room {msg.room} for decode rank {msg.tp_rank} was watched by "
                        f"session {owner} and again by session {sender}"
                    )
                else:
                    rec.watchers[msg.tp_rank] = sender
                    ready = rec.prefill_complete
        if late:
            if rec is not None and not rec.state.is_terminal and not self.config.prefill_complete:
                return self._fail_room(rec, late, extra_sessions=(sender,))
            self._live_control.send(
                peer.endpoint, TransferFailed(room=msg.room, side=Side.PREFILL, tp_rank=self.tp_rank, reason=late)
            )
        elif conflict and rec is not None:  # (a conflict needs a record: rec is set)
            self.security_event("room_conflict", "%s", conflict)
            self._fail_room(rec, conflict, extra_sessions=(sender,))
        elif ready:
            self._live_control.send(peer.endpoint, PrefillReady(room=msg.room, tp_rank=self.tp_rank))

    def mark_prefill_complete(self, rec: PrefillRoom) -> None:
        """The room's forward finished here: restart its wait for the decode's metadata
        (the decode allocates only now) and tell every decode rank that watches it."""
        with self._lock:
            if rec.prefill_complete or rec.state.is_terminal:
                return
            rec.prefill_complete = True
            if rec.state.poll is KVPoll.Bootstrapping:
                rec.state.handle(Event.PREFILL_COMPLETE, time.monotonic())
            sessions = list(rec.watchers.values())
        for session in sessions:
            peer = self._decode_peers.get(session)
            if peer is not None:
                self._live_control.send(peer.endpoint, PrefillReady(room=rec.room, tp_rank=self.tp_rank))

    def _meta_problem(self, rec: PrefillRoom, meta: RequestMeta) -> str:
        expected, plan = rec.expected, rec.plan
        if expected is None or plan is None:  # _on_meta sets both before it checks a claim
            raise LocalProtocolError(f"room {rec.room}: metadata checked before the room's TP plan exists")
        if meta.tp_rank not in expected:
            return f"decode rank {meta.tp_rank} is not a candidate reader of prefill rank {self.tp_rank}"
        if meta.num_tokens != rec.num_tokens:
            return f"decode ranks disagree on the request length: {meta.num_tokens} vs {rec.num_tokens} tokens"
        if meta.prefix_tokens != rec.prefix_tokens:
            return (
                f"decode ranks disagree on the prefix they hold: prefix_tokens={meta.prefix_tokens} "
                f"(decode rank {meta.tp_rank}) vs {rec.prefix_tokens}"
            )
        if plan.decode_tp != meta.tp_size:
            return f"decode ranks disagree on the decode TP size: {meta.tp_size} vs {plan.decode_tp}"
        if meta.sparse != rec.sparse:
            return (
                f"decode ranks disagree on whether the writer picks their pages: sparse={meta.sparse} "
                f"(decode rank {meta.tp_rank}) vs {rec.sparse}"
            )
        elected = meta.tp_rank in plan.decode_targets(self.tp_rank)
        if meta.elected != elected:
            return (
                f"writer election differs: decode rank {meta.tp_rank} says elected={meta.elected}, "
                f"prefill rank {self.tp_rank} computed {elected}"
            )
        return ""

    def _on_ack(self, msg: ChunkAck, sender: str) -> None:
        rec = self.room(msg.room)
        if rec is None:
            return
        owner = rec.metas.get(msg.tp_rank)
        if owner is None or owner.session != sender:
            self.security_event(
                "unexpected_sender",
                "ChunkAck for room %d, decode rank %d, from session %s dropped (not the room's reader)",
                msg.room,
                msg.tp_rank,
                sender,
            )
            return
        with rec.cond:
            rec.inflight[msg.tp_rank].discard(msg.staging_offset)
            rec.cond.notify_all()

    # -- rooms ---------------------------------------------------------------------------------
    # -- failures --------------------------------------------------------------------------------
    def _fail_room(
        self,
        rec: PrefillRoom,
        reason: str,
        notify: bool = True,
        already_failed: bool = False,
        extra_sessions: tuple[str, ...] = (),
    ) -> None:
        with self._lock:
            if not already_failed:
                if rec.state.is_terminal:
                    return
                rec.state.fail(reason, time.monotonic())
            rec.finished_at = time.monotonic()
            targets = [(d, m.session) for d, m in rec.metas.items()]
            extra = (*rec.watchers.values(), *extra_sessions)
            targets += [(-1, s) for s in dict.fromkeys(extra) if s not in {t[1] for t in targets}]
        with rec.cond:
            rec.cond.notify_all()
        log.warning("prefill rank %d room %d failed: %s", self.tp_rank, rec.room, reason)
        self._request_ended(rec)
        if notify:
            for _reader, session in targets:
                peer = self._decode_peers.get(session) or self._lost_peer(session)
                if peer is not None:
                    self._live_control.send(
                        peer.endpoint,
                        TransferFailed(room=rec.room, side=Side.PREFILL, tp_rank=self.tp_rank, reason=reason),
                    )

    def abort(self, rec: PrefillRoom, reason: str) -> None:
        with self._lock:
            if rec.state.is_terminal:
                return
            rec.marks["aborted"] = time.monotonic()
            rec.state.abort(reason, rec.marks["aborted"])
            targets = list(dict.fromkeys([*(m.session for m in rec.metas.values()), *rec.watchers.values()]))
        with rec.cond:
            rec.cond.notify_all()
        self._request_ended(rec)
        for session in targets:
            peer = self._decode_peers.get(session)
            if peer is not None:
                self._live_control.send(
                    peer.endpoint, Abort(room=rec.room, side=Side.PREFILL, tp_rank=self.tp_rank, reason=reason)
                )

    def _peers(self) -> list[Peer]:
        with self._lock:
            return list(self._decode_peers.values())

    def _peer_lost(self, peer: Peer, reason: str) -> None:
        with self._lock:
            known = self._decode_peers.get(peer.session)
            if known is None or known is not peer:
                return
        self._drop_peer(known, reason)
        with self._lock:
            self._decode_peers.pop(peer.session, None)
            self._remember_lost(peer)

    def _remember_lost(self, peer: Peer) -> None:
        """Keep a forgotten or refused session's endpoint (capped): it is told to register
        again if it speaks, and hears about its rooms' failures. Call with the lock held."""
        self._lost_peers[peer.session] = (peer, 0.0)
        while len(self._lost_peers) > 1024:
            self._lost_peers.popitem(last=False)

    def _drop_peer(self, peer: DecodePeer, reason: str) -> None:
        """Fail the peer's rooms (telling every reader, the peer too if it still listens),
        then drop its transport peer. The caller removes it from ``_decode_peers``."""
        with self._lock:
            rooms = [
                r
                for r in self._rooms.values()
                if not r.state.is_terminal and any(m.session == peer.session for m in r.metas.values())
            ]
        for rec in rooms:
            self._fail_room(rec, reason, extra_sessions=(peer.session,))
        try:
            self._live_transport.remove_peer(peer.session)
        except Exception:
            pass

    def _lost_peer(self, session: str) -> Peer | None:
        entry = self._lost_peers.get(session)
        return entry[0] if entry is not None else None

    def _on_tick(self, now: float) -> None:
        super()._on_tick(now)
        self._forget_stale(now)


class KVSender(RequestHandle):
    """Prefill side of one request, as SGLang's scheduler drives it.

    ``send(page_ids, last_chunk)`` may be called in Bootstrapping: chunks wait until every
    decode rank's metadata is in. ``poll()`` returns a ``KVPoll``.
    """

    mgr: PrefillManager
    _rec: PrefillRoom
    _abort_reason = "aborted by the prefill side"

    def __init__(self, mgr: PrefillManager, room: int):
        if not isinstance(mgr, PrefillManager):
            raise TypeError(f"mgr must be a PrefillManager, got {type(mgr).__name__}")
        self.mgr, self.room = mgr, room
        self._rec = mgr.attach_sender(room)
        unregistered = mgr.unregistered_reason()
        if unregistered:
            mgr._fail_room(self._rec, unregistered, notify=False)
        self._finished = False
        self._open_pages: np.ndarray | None = None  # the token chunk whose layers are partly sent
        self._last_position = -1  # the last of the positions sent (sparse writes)
        self._next_layer = 0  # its first layer not sent yet

    def send(
        self, page_ids, last_chunk: bool = False, aux: bytes = b"", ready=None, layers=None, positions=None
    ) -> None:
        """Hand over the next pages of the request (page-aligned; the last chunk ends it).

        ``aux`` (last chunk only) reaches every decode reader with ``TransferDone``.
        ``ready`` (optional): marks when these pages' KV is written, so a chunk can be
        handed over while the forward that writes it is still running. A
        ``torch.cuda.Event`` recorded on the producer's stream: the gathers of the staged
        path wait for it on the engine's own copy stream (no host wait; the producer's
        stream is never synchronized); a direct write, or any other object with a
        ``synchronize()`` method, waits for it on the worker thread first.

        ``layers`` (layer-wise streaming; default: every layer): a ``range(a, b)`` saying
        that layers ``[a, b)`` of these pages' tokens are final, so their transfer overlaps
        the compute of the layers after them. A token chunk's layer groups come in order,
        each once: ``a=0`` opens the chunk with its new pages, later groups repeat the same
        ``page_ids`` and start where the previous group stopped, and the chunk is complete
        at ``b=num_layers``. ``last_chunk`` goes with the group that completes the last
        chunk. A repeated, skipped or out-of-range layer range is a ``ValueError`` naming
        ``layers`` and the values.

        ``positions`` (a decode that asked for sparse writes, ``KVReceiver.send_metadata(
        sparse=True)``: this rank holds only some of the request's pages, as a SGLang prefill
        with KV cache sharding does): for each of ``page_ids``, its index in the decode's page
        list, increasing over the whole request; the other pages are other ranks' to send.
        Not with ``layers``.
        """
        if self._finished:
            raise ValueError(f"room {self.room}: send() after the last chunk")
        pages = np.asarray(page_ids, dtype=np.int64).reshape(-1)
        num_pages = self.mgr.config.geometry.num_pages
        if pages.size and (pages.min() < 0 or pages.max() >= num_pages):
            raise ValueError(f"page_ids must lie in [0, {num_pages}), got {pages.min()}..{pages.max()}")
        if aux and not last_chunk:
            raise ValueError("aux travels with the last chunk only")
        if not isinstance(aux, (bytes, bytearray)):
            raise TypeError(f"aux must be bytes, got {type(aux).__name__}")
        if ready is not None and not callable(getattr(ready, "synchronize", None)):
            raise TypeError(f"ready must have a synchronize() method, got {type(ready).__name__}")
        where = self._check_positions(positions, pages, layers)
        span, pages = self._layer_span(layers, pages, bool(last_chunk))
        self._finished = bool(last_chunk)
        if where is not None and where.size:
            self._last_position = int(where[-1])
        self.mgr.submit_chunk(self._rec, Chunk(pages, bool(last_chunk), bytes(aux), ready, span, where))

    def _check_positions(self, positions, pages: np.ndarray, layers) -> np.ndarray | None:
        """``positions`` as an int64 array, checked against ``pages`` and the positions sent
        before (increasing over the request); None stays None."""
        if positions is None:
            return None
        if layers is not None:
            raise ValueError("positions (sparse writes) cannot go with layers (layer-wise sends)")
        where = np.asarray(positions)
        if where.ndim != 1 or (where.size and not np.issubdtype(where.dtype, np.integer)):
            raise ValueError(f"positions must be a 1-D list of ints, got {where.dtype} {where.shape}")
        where = where.astype(np.int64)
        if where.size != pages.size:
            raise ValueError(f"positions has {where.size} entries for {pages.size} page_ids")
        if where.size:
            low = self._last_position + 1
            if int(where[0]) < low:
                raise ValueError(
                    f"positions[0]={int(where[0])} must be >= {low}: positions increase over the request "
                    f"(the last one sent was {self._last_position})"
                )
            steps = np.diff(where)
            if steps.size and int(steps.min()) <= 0:
                i = int(np.flatnonzero(steps <= 0)[0])
                raise ValueError(
                    f"positions must increase: positions[{i}]={int(where[i])}, positions[{i + 1}]={int(where[i + 1])}"
                )
        return where

    def _layer_span(self, layers, pages: np.ndarray, last: bool) -> tuple[tuple[int, int] | None, np.ndarray]:
        """Check ``layers`` against the open token chunk; returns the chunk's layer span and
        the pages to hand over (none for a group after a chunk's first). Changes nothing on
        an error."""
        num_layers = self.mgr.config.geometry.num_layers
        open_pages, nxt = self._open_pages, self._next_layer
        if layers is None:
            if open_pages is not None:
                raise ValueError(
                    f"layers=None (every layer) opens a new token chunk while layers [{nxt}, {num_layers}) "
                    f"of the previous one are not sent"
                )
            return None, pages
        if not isinstance(layers, range) or layers.step != 1 or not len(layers):
            raise ValueError(f"layers={layers!r} must be a non-empty range(a, b) with step 1")
        a, b = layers.start, layers.stop
        if a < 0 or b > num_layers:
            raise ValueError(f"layers=range({a}, {b}) is outside the model's layers [0, {num_layers}) (num_layers)")
        if open_pages is None:
            if a != 0:
                raise ValueError(f"layers=range({a}, {b}) must start at 0: no token chunk is open (next layer 0)")
        elif a != nxt:
            what = "was already sent" if a < nxt else "skips layers"
            raise ValueError(
                f"layers=range({a}, {b}) {what}: layers [0, {nxt}) of the open token chunk are sent, "
                f"the next group must start at layer {nxt}"
            )
        elif not np.array_equal(pages, open_pages):
            raise ValueError(
                f"page_ids ({pages.size} pages) differ from the open token chunk's pages ({open_pages.size}): "
                f"layers [{nxt}, {num_layers}) of those tokens come first"
            )
        if last and b != num_layers:
            raise ValueError(
                f"last_chunk=True with layers=range({a}, {b}) leaves layers [{b}, {num_layers}) of the last "
                f"token chunk unsent (num_layers={num_layers})"
            )
        handed = pages if open_pages is None else pages[:0]
        if b == num_layers:
            self._open_pages, self._next_layer = None, 0
        else:
            self._open_pages, self._next_layer = pages, b
        return (a, b), handed

    def mark_prefill_complete(self) -> None:
        """The forward of this request finished on this rank (its KV is in the pool): a
        decode rank that watches the room (``KVReceiver(watch_prefill=True)``) may allocate
        now, and the wait for its metadata starts again (the bootstrap deadline). Needs
        ``EngineConfig.prefill_complete``; idempotent."""
        if not self.mgr.config.prefill_complete:
            raise ValueError(
                f"room {self.room}: mark_prefill_complete() needs EngineConfig.prefill_complete=True "
                "(a decode that allocates only once the prefill finished)"
            )
        self.mgr.mark_prefill_complete(self._rec)

    @property
    def decode_prefix_tokens(self) -> int | None:
        """Tokens of the request the decode already holds, which the sender skips (its pages
        count from the first token after them); None until every decode rank's request came
        (poll reached WaitingForInput)."""
        rec = self._rec
        with self.mgr._lock:
            return None if rec.state.poll is KVPoll.Bootstrapping else rec.prefix_tokens

    @property
    def decode_tokens(self) -> tuple[int, int] | None:
        """(the request's length after the prefix, as every decode rank sent it; the largest
        ``token_stride`` among them): a decode-context-parallel decode counts whole pages of
        ``page_size * stride`` tokens, so it may expect up to ``stride - 1`` pages more than
        the request fills here. None until every decode rank's request came."""
        rec = self._rec
        with self.mgr._lock:
            if rec.state.poll is KVPoll.Bootstrapping or rec.num_tokens is None:
                return None
            return rec.num_tokens, max((m.token_stride for m in rec.metas.values()), default=1)

    @property
    def bytes_sent(self) -> int:
        return self._rec.bytes

    @property
    def pool_read_bytes(self) -> int:
        """Bytes read from this rank's KV pool for the request so far (a head slice that
        several staged readers need is gathered once: fan-out)."""
        return self._rec.pool_read_bytes

    @property
    def ops(self) -> int:
        """Transport ops posted for this request so far."""
        return self._rec.ops

    @property
    def paths(self) -> dict[str, int]:
        """Readers of this request by data path, e.g. ``{"staged": 1}``."""
        out: dict[str, int] = {}
        rec = self._rec
        for meta in rec.metas.values():
            if meta.elected:
                plan = rec.readers.get(meta.tp_rank)  # the path this rank took (row by row, ...)
                if plan is not None:
                    key = plan.path.value
                else:  # no chunk planned yet: what the decode asked for
                    key = DataPath.DIRECT.value if meta.staging_offset < 0 else DataPath.STAGED.value
                    key = DataPath.FUSED.value if meta.fused else key
                out[key] = out.get(key, 0) + 1
        return out

    @property
    def timings(self) -> dict[str, float]:
        return dict(self._rec.timings)
