"""The decode side: ``DecodeManager`` and ``KVReceiver``.

A decode rank looks the prefill group up at the bootstrap, registers its pool with every
candidate prefill rank (both sides check the geometry; a mismatch fails the requests at
once with the field-level message), then per request sends metadata to every candidate:
destination pages, and for each elected writer either nothing (direct writes into the
pool, or ``fused``: one pool -> pool copy by a writer that maps this rank's pool) or a
window of two staging slots. It scatters each staged chunk as its
``ChunkReady`` arrives and returns the slot, scatters a writer's last chunk, which rides on
its ``TransferDone``, together with counting that writer done, and reports Success only
when every expected writer has sent ``TransferDone`` with every (token x layer) of its
share in place: per staged writer and layer it counts the tokens scattered (chunks may
carry a layer range: layer-wise streaming), and every writer's bytes must be its share. Scatters run in order on the room's
worker; a ``TransferDone`` whose room has nothing queued there and whose last chunk is
small (``INLINE_NOTICE_BYTES``) is handled on the I/O thread at once: no thread hand-over
on a small request's last step. A ``TransferDone`` with landing receipts (``tcp``: writes
the writer posted but had no ACK for yet) counts, and its last chunk is scattered, only
once this rank's transport says every receipt landed (at once when they already have, else
on the worker, waiting with the transfer deadline); a receipt refused or cut off fails the
room with why. Deadlines, aborts and peer death fail a request and free
its staging windows; the next request to a live peer works.

This module owns the decode manager's flow: lookup and registration, metadata, messages,
scatter, failures. The records it drives are ``decode_rooms.py``.
Must not: write into prefill memory, or act on a data message from a session other than
the one its room expects (``_from_expected``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from sglang_kvxfer.engine import bootstrap
from sglang_kvxfer.engine.config import ENGINE_VERSION, EngineConfig
from sglang_kvxfer.engine.decode_plans import DecodePlanning
from sglang_kvxfer.engine.decode_rooms import DecodeRoom, GroupStatus, PrefillGroup
from sglang_kvxfer.engine.manager import Peer, RankBase, RequestHandle
from sglang_kvxfer.engine.pool import KVPool
from sglang_kvxfer.errors import (
    IncompatibleGeometryError,
    KVXferError,
    LocalProtocolError,
    RemoteProtocolError,
    TransferFailedError,
    TransferTimeoutError,
)
from sglang_kvxfer.geometry import check_compatible
from sglang_kvxfer.metrics import note_writer_done
from sglang_kvxfer.planning import (
    EVERY_TOKEN,
    PathCost,
    PoolMapping,
    RequestPlan,
    TokenSelection,
    candidate_prefill_ranks,
    plan_tp,
)
from sglang_kvxfer.protocol.envelope import peer_secret
from sglang_kvxfer.protocol.fields import Side
from sglang_kvxfer.protocol.messages import (
    Abort,
    BootstrapQuery,
    ChunkAck,
    ChunkReady,
    DecodeRegister,
    Heartbeat,
    PrefillReady,
    RegisterReply,
    RequestMeta,
    RoomWatch,
    StagedChunk,
    TransferDone,
    TransferFailed,
)
from sglang_kvxfer.protocol.state import Event, KVPoll

__all__ = ["DecodeManager", "KVReceiver"]

log = logging.getLogger("sglang_kvxfer.decode")

# A TransferDone whose last chunk is at most this large (a scatter of ~0.1 ms) is handled
# on the I/O thread when its room has no task queued on a worker.
INLINE_NOTICE_BYTES = 256 << 10


class DecodeManager(DecodePlanning, RankBase[DecodeRoom]):
    """One decode TP rank (writer plans and staging windows: ``decode_plans.py``)."""

    side = Side.DECODE

    def __init__(self, config: EngineConfig, pool: KVPool | None = None):
        self._groups: dict[str, PrefillGroup] = {}  # before the I/O thread starts
        # Grants to the prefill sessions (pool + staging segments) are replaced as a whole
        # under this lock, so the newest list of regions is the one that stays.
        self._export_lock = threading.Lock()
        self._exported_segments = 0
        self._path_cost: tuple[PathCost | None] | None = None  # (cost,) once asked
        super().__init__(config, pool)

    # -- bootstrap and registration --------------------------------------------------------------
    def _group(self, address: str) -> PrefillGroup:
        with self._lock:
            group = self._groups.get(address)
            if group is None or group.status is GroupStatus.FAILED:
                group = self._groups[address] = PrefillGroup(address)
                self.start_thread(self._resolve, f"kvxfer-decode{self.tp_rank}-resolve", group)
            return group

    def prefill_group_status(self, address: str) -> tuple:
        """``(status, error, prefill_tp_size, prefill_geometry)`` of the prefill group at
        bootstrap ``address``; starts looking it up if nobody has yet. ``status`` is
        ``resolving``, ``registering``, ``ready`` or ``failed`` (then ``error`` says why); the
        TP size is 0 and the geometry None until known. A failed lookup is reported, not
        retried (the next request's receiver retries it)."""
        with self._lock:
            group = self._groups.get(address)
        if group is None:
            group = self._group(address)
        with self._lock:
            reply = group.reply
            return (
                group.status,
                group.error,
                reply.tp_size if reply is not None else 0,
                reply.geometry if reply is not None else None,
            )

    def _resolve(self, group: PrefillGroup) -> None:
        deadline = time.monotonic() + self.config.bootstrap_timeout_s
        query = BootstrapQuery(session=self.session, tp_rank=self.tp_rank, kv_pool=self.config.kv_pool)
        reply, last, unanswered = None, "no answer", 0
        while not self._closed and time.monotonic() < deadline:
            wait_s = bootstrap.attempt_timeout(unanswered, deadline)
            try:
                reply = bootstrap.request(group.address, query, timeout_s=wait_s, key=self.config.key)
            except TransferTimeoutError as exc:
                last, unanswered = str(exc), unanswered + 1
            except KVXferError as exc:
                last = str(exc)
            else:
                unanswered = 0
                if reply.ready:
                    break
                last = reply.reason or "the prefill group is not complete yet"
            group.last = last
            reply = None
            time.sleep(0.1)
        if self._closed:
            return
        if reply is None:
            return self._group_failed(
                group,
                f"bootstrap {group.address}: prefill group not ready after "
                f"{self.config.bootstrap_timeout_s:.0f} s ({last})",
            )
        g = self.config.geometry
        try:
            candidates = candidate_prefill_ranks(
                g.total_kv_heads, reply.tp_size, self.config.tp_size, self.tp_rank, g.mla
            )
        except KVXferError as exc:
            return self._group_failed(group, str(exc))
        geometry = reply.geometry
        if geometry is None:  # BootstrapReply refuses ready=True without one
            raise RemoteProtocolError(f"bootstrap {group.address}: a ready reply without the prefill geometry")
        now = time.monotonic()
        with self._lock:
            group.reply = reply
            group.status = GroupStatus.REGISTERING
            for info in reply.ranks:
                if info.tp_rank in candidates:
                    group.peers[info.tp_rank] = Peer(info.session, info.tp_rank, info.endpoint, now)
                    group.placements[info.tp_rank] = geometry.placement(reply.tp_size, info.tp_rank, reply.all_heads)
        try:
            self._export([group])
        except KVXferError as exc:
            return self._group_failed(group, f"cannot export this rank's memory to the prefill ranks: {exc}")
        register = DecodeRegister(
            engine_version=ENGINE_VERSION,
            session=self.session,
            tp_size=self.config.tp_size,
            tp_rank=self.tp_rank,
            endpoint=self._live_control.endpoint,
            geometry=g,
            transport=self.config.transport,
            agent_descriptor=self._live_transport.agent_descriptor(),
            kv_regions=tuple(self.kv_descriptors),
            kv_buffer_locs=tuple((loc.region, loc.offset) for loc in self._live_pool.locs),
            aux_region=None,
        )
        for peer in list(group.peers.values()):
            self._live_control.send(peer.endpoint, register)

    def _export(self, groups: list[PrefillGroup] | None = None) -> None:
        """The data plane: each candidate writer (of ``groups``, default every live group)
        may write into this rank's pool and staging segments only, proving the secret of its
        (writer, reader) session pair. Called again whenever the staging arena grew."""
        with self._export_lock:
            staging = self._live_staging
            num_segments = staging.num_segments
            exported = list(self._live_pool.regions) + staging.regions
            every = groups is None
            with self._lock:
                if groups is None:
                    groups = [
                        g for g in self._groups.values() if g.status in (GroupStatus.REGISTERING, GroupStatus.READY)
                    ]
                sessions = [p.session for g in groups for p in g.peers.values()]
            for session in sessions:
                self._live_transport.authorize_peer(
                    session, peer_secret(self.config.key, session, self.session), exported
                )
            if every:  # every live writer may now write into num_segments segments
                self._exported_segments = num_segments

    def _waiting_for(self, rec: DecodeRoom, poll: KVPoll) -> str:
        group = self._groups.get(rec.group)
        if poll is KVPoll.WaitingForInput and rec.watch and not rec.prefill_ready and group is not None:
            waiting = sorted(set(group.peers) - rec.ready_from)
            return f"prefill ranks {waiting} of {group.address} have not finished the forward of this room"
        if poll is not KVPoll.Bootstrapping or group is None:
            return ""
        if group.status is GroupStatus.RESOLVING:
            return f"bootstrap {group.address}: {group.last or 'no answer yet'}"
        if group.status is GroupStatus.REGISTERING:
            waiting = sorted(set(group.peers) - set(group.acks))
            return f"prefill ranks {waiting} of {group.address} have not answered this rank's registration"
        return ""

    def _group_failed(self, group: PrefillGroup, reason: str) -> None:
        log.error("decode rank %d: %s", self.tp_rank, reason)
        with self._lock:
            group.status, group.error = GroupStatus.FAILED, reason
            rooms = [r for r in self._rooms.values() if r.group == group.address and not r.state.is_terminal]
        for rec in rooms:
            self._fail_room(rec, reason)
        # Rooms that ended before the group's ranks were known: those ranks, known once it
        # resolved (even when they then refused this rank), hear why now instead of never.
        self._tell_untold(group)

    def _tell_untold(self, group: PrefillGroup) -> None:
        with self._lock:
            untold, group.untold = group.untold, []
            peers = list(group.peers.values())
        for room, kind, reason in untold:
            for peer in peers:
                self._live_control.send(
                    peer.endpoint, kind(room=room, side=Side.DECODE, tp_rank=self.tp_rank, reason=reason)
                )

    def _on_register_reply(self, msg: RegisterReply) -> None:
        with self._lock:
            group = next(
                (
                    g
                    for g in self._groups.values()
                    if msg.tp_rank in g.peers and g.peers[msg.tp_rank].session == msg.session
                ),
                None,
            )
        if group is None:
            return
        error = msg.error if not msg.ok else ""
        if not error:
            try:
                check_compatible(msg.geometry, self.config.geometry)
            except IncompatibleGeometryError as exc:
                error = str(exc)
        if error:
            return self._group_failed(group, f"prefill rank {msg.tp_rank} refused this decode rank: {error}")
        with self._lock:
            group.acks[msg.tp_rank] = True
            group.mappings[msg.tp_rank] = PoolMapping(msg.pool_mapped, msg.pool_note or "no reason given")
            group.peers[msg.tp_rank].last_seen = time.monotonic()
            if set(group.acks) != set(group.peers) or group.status is not GroupStatus.REGISTERING:
                return
            group.status = GroupStatus.READY
            rooms = [r for r in self._rooms.values() if r.group == group.address]
            for rec in rooms:
                if rec.state.poll is KVPoll.Bootstrapping:
                    rec.state.handle(Event.BOOTSTRAPPED, time.monotonic())
        self._tell_untold(group)
        for rec in rooms:
            self._send_watch(rec, group)
        for rec in rooms:
            if rec.meta_pending:
                self._dispatch_later(rec)

    # -- requests --------------------------------------------------------------------------------
    def create_room(self, room: int, address: str, watch: bool = False) -> DecodeRoom:
        group = self._group(address)
        with self._lock:
            old = self._rooms.get(room)
            if old is not None and not old.state.is_terminal:
                raise ValueError(f"room {room} is already in flight on decode rank {self.tp_rank}")
            rec = self._rooms[room] = DecodeRoom(room, self.new_state(room), address)
            rec.watch = bool(watch)
            if group.status is GroupStatus.READY:
                rec.state.handle(Event.BOOTSTRAPPED, time.monotonic())
            failed = group.error if group.status is GroupStatus.FAILED else ""
        if failed:
            self._fail_room(rec, failed)
        else:
            self._send_watch(rec, group)
        return rec

    def _send_watch(self, rec: DecodeRoom, group: PrefillGroup) -> None:
        """A watching room whose group is ready asks each candidate prefill rank, once, to
        say when its forward of the room finished (``PrefillReady``)."""
        with self._lock:
            if not rec.watch or rec.watch_sent or rec.state.poll is not KVPoll.WaitingForInput:
                return
            if group.status is not GroupStatus.READY:
                return
            rec.watch_sent = True
            peers = list(group.peers.values())
        for peer in peers:
            self._live_control.send(peer.endpoint, RoomWatch(room=rec.room, session=self.session, tp_rank=self.tp_rank))

    def _on_ready(self, rec: DecodeRoom, msg: PrefillReady) -> None:
        """A candidate prefill rank finished the room's forward; once each did, the room is
        ready for its metadata, and the wait for it starts again."""
        with self._lock:
            if not rec.watch or rec.prefill_ready or rec.state.is_terminal:
                return
            rec.ready_from.add(msg.tp_rank)
            group = self._groups.get(rec.group)
            if group is None or not set(group.peers) <= rec.ready_from:
                return
            rec.prefill_ready = True
            if rec.state.poll is KVPoll.WaitingForInput:
                rec.state.handle(Event.PREFILL_COMPLETE, time.monotonic())

    def set_metadata(
        self,
        rec: DecodeRoom,
        pages: np.ndarray,
        num_tokens: int,
        aux_slot: int,
        prefix_tokens: int = 0,
        selection: TokenSelection = EVERY_TOKEN,
        sparse: bool = False,
    ) -> None:
        """``num_tokens``: the whole request's length after the prefix; ``pages`` hold the
        ``selection`` of them (all, or a DCP rank's every n-th); ``sparse``: the writers pick
        which of them they write."""
        with self._lock:
            rec.pages, rec.aux_slot, rec.sparse = pages, aux_slot, sparse
            rec.request_tokens, rec.num_tokens = num_tokens, selection.count(num_tokens)
            rec.prefix_tokens, rec.selection = prefix_tokens, selection
            rec.meta_pending = True
            ready = rec.state.poll is KVPoll.WaitingForInput
        if ready:
            self._dispatch_meta(rec)

    def _dispatch_meta(self, rec: DecodeRoom) -> None:
        """Plan the request, lend staging windows to staged writers, send RequestMeta.

        Planning and lending run outside the manager's lock: lending may grow the staging
        arena, which faults in and registers a new segment (seconds for a large one), and
        the I/O thread needs that lock for every message and tick meanwhile (heartbeats
        included). One dispatch of a room runs at a time; the room is checked again before
        its plans are kept, and windows lent to a room that ended meanwhile are given back.
        """
        g = self.config.geometry
        with self._lock:
            if rec.dispatching or not rec.meta_pending or rec.meta_sent or rec.state.is_terminal:
                return
            pages = rec.pages
            if pages is None:  # set_metadata() sets it with meta_pending
                raise LocalProtocolError(f"room {rec.room}: metadata pending without pages")
            group = self._groups.get(rec.group)
            if group is None or group.status is not GroupStatus.READY:
                return  # the group was lost; the room fails through _peer_lost or its deadline
            reply = group.reply
            if reply is None:  # _resolve() sets it before the group can become READY
                raise LocalProtocolError(f"prefill group {rec.group} is ready without a bootstrap reply")
            rec.dispatching = True
        stale: dict[int, tuple[int, int]] = {}
        try:
            try:
                plan = plan_tp(g.total_kv_heads, reply.tp_size, self.config.tp_size, g.mla, salt=rec.room)
                writers = {t.prefill_rank: t for t in plan.writers_of(self.tp_rank)}
                plans = self._plan_writers(rec, writers, group)
                windows = self._lend_windows(rec, plans)
            except KVXferError as exc:
                windows, problem = None, str(exc)
            else:
                problem = ""
            with self._lock:
                if not problem:
                    if windows is None:
                        rec.waiting_for = "staging space on this decode rank (KVXFER_STAGING_BYTES)"
                        return  # retried on the next tick, within the request's deadline
                    if rec.state.is_terminal or self._groups.get(rec.group) is not group:
                        stale = windows  # it ended (or lost its group) while being planned
                        return
                    rec.writers, rec.plans, rec.windows = writers, plans, windows
                    rec.layer_tokens = {p: np.zeros(g.num_layers, dtype=np.int64) for p in windows}
                    rec.candidates = tuple(group.peers)
                    rec.state.expect_writers(list(writers))
                    rec.meta_sent, rec.meta_pending, rec.waiting_for = True, False, ""
        finally:
            with self._lock:
                rec.dispatching = False
            for offset, _ in stale.values():
                self._live_staging.free(offset)
        if not problem and self._live_staging.num_segments != self._exported_segments:
            try:  # a window lies in a new staging segment: its writers may write there first
                self._export()
            except KVXferError as exc:
                problem = f"cannot export this rank's staging memory to the prefill ranks: {exc}"
        if problem:
            return self._fail_room(rec, problem)
        for p, peer in group.peers.items():
            offset, capacity = rec.windows.get(p, (-1, 0))
            region = None
            if offset >= 0:  # the window's segment and its offset there
                loc = self._live_staging.locate(offset)
                offset, region = loc.offset, self._open(loc.region, "staging region").descriptor
            self._live_control.send(
                peer.endpoint,
                RequestMeta(
                    room=rec.room,
                    session=self.session,
                    tp_rank=self.tp_rank,
                    tp_size=self.config.tp_size,
                    num_tokens=rec.request_tokens,
                    dst_page_ids=pages,
                    aux_slot=rec.aux_slot,
                    elected=p in writers,
                    staging_offset=offset,
                    staging_capacity_bytes=capacity,
                    staging_region=region,
                    prefix_tokens=rec.prefix_tokens,
                    fused=p in writers and rec.plans[p].fused,
                    token_stride=rec.selection.stride,
                    token_phase=rec.selection.phase,
                    sparse=rec.sparse,
                ),
            )

    # -- messages (I/O thread) --------------------------------------------------------------------
    def _on_message(self, msg: Any, sender: str) -> None:
        if isinstance(msg, Heartbeat):
            self._on_heartbeat(msg, sender)
        elif isinstance(msg, RegisterReply):
            self._on_register_reply(msg)
        elif isinstance(msg, (ChunkReady, TransferDone, TransferFailed, Abort, PrefillReady)):
            rec = self.room(msg.room)
            if rec is None or not self._from_expected(rec, msg, sender):
                return
            if isinstance(msg, PrefillReady):
                self._on_ready(rec, msg)
            elif isinstance(msg, ChunkReady):
                self._on_chunk(msg)
            elif isinstance(msg, TransferDone):
                self._on_done(msg, sender)
            else:
                what = "aborted" if isinstance(msg, Abort) else "failed"
                self._fail_room(rec, f"prefill rank {msg.tp_rank} {what} the request: {msg.reason}", notify=False)
        else:
            log.warning("decode rank %d ignored unexpected %s", self.tp_rank, type(msg).__name__)

    def _from_expected(self, rec: DecodeRoom, msg, sender: str) -> bool:
        """Whether ``sender`` is the prefill session this room expects as ``msg.tp_rank``."""
        with self._lock:
            group = self._groups.get(rec.group)
            peer = group.peers.get(msg.tp_rank) if group is not None else None
        if peer is not None and peer.session == sender:
            return True
        self.security_event(
            "unexpected_sender",
            "%s for room %d as prefill rank %d from session %s dropped (expected session %s)",
            type(msg).__name__,
            msg.room,
            msg.tp_rank,
            sender,
            peer.session if peer is not None else "none",
        )
        return False

    def _on_heartbeat(self, msg: Heartbeat, session: str) -> None:
        with self._lock:
            peers = [g.peers.get(msg.tp_rank) for g in self._groups.values()]
        for peer in peers:
            if peer is not None and peer.session == session:
                self._heard(peer, msg)

    def _touch(self, tp_rank: int, session: str | None = None) -> None:
        now = time.monotonic()
        with self._lock:
            for group in self._groups.values():
                peer = group.peers.get(tp_rank)
                if peer is not None and (session is None or peer.session == session):
                    peer.last_seen = now

    def _writer(self, rec: DecodeRoom, tp_rank: int) -> RequestPlan:
        """The plan of writer ``tp_rank`` of this request (a ``TransferFailedError`` if none)."""
        plan = rec.plans.get(tp_rank)
        if plan is None:
            raise TransferFailedError(
                f"prefill rank {tp_rank} is not a writer of this request (writers: {sorted(rec.writers)})", rec.room
            )
        return plan

    def _on_chunk(self, msg: ChunkReady) -> None:
        rec = self.room(msg.room)
        if rec is None or rec.state.is_terminal:
            return
        self._touch(msg.tp_rank)
        try:
            layers = self._chunk_layers(msg.layer_start, msg.num_layers)
            plan, arena_offset = self._check_chunk(rec, msg.tp_rank, msg, layers)
        except KVXferError as exc:
            return self._fail_room(rec, str(exc))
        self._submit(rec, lambda: self._scatter(rec, plan, msg.tp_rank, msg, arena_offset, layers))

    def _submit(self, rec: DecodeRoom, task: Callable[[], object]) -> None:
        """Run ``task`` on a worker after the room's earlier tasks: on the worker those
        went to while any is queued, else on the idlest one."""

        def counted() -> None:
            try:
                task()
            finally:
                with self._lock:
                    rec.queued -= 1

        with self._lock:
            if rec.queued == 0 or rec.worker is None:
                rec.worker = self.idle_worker()
            rec.queued += 1
            worker = rec.worker
        worker.submit(counted)

    def _check_chunk(
        self, rec: DecodeRoom, tp_rank: int, chunk: ChunkReady | StagedChunk, layers: tuple[int, int]
    ) -> tuple[RequestPlan, int]:
        """Check a staged chunk writer ``tp_rank`` announced (in its window, within the
        request, its bytes those of its tokens x ``layers``, and its tokens the next ones of
        each of its layers), count its layers' tokens and count it as progress; returns the
        pair's plan and the chunk's arena offset. Raises ``TransferFailedError`` saying what
        is wrong."""
        now = time.monotonic()
        plan = self._writer(rec, tp_rank)
        window, capacity = rec.windows.get(tp_rank, (-1, 0))
        # Chunks speak offsets in the window's staging segment, as RequestMeta did.
        offset, base = (-1, 0) if window < 0 else self._live_staging.locate(window)[1:]
        what = "ChunkReady" if isinstance(chunk, ChunkReady) else "TransferDone's last chunk"
        if not (0 <= offset <= chunk.staging_offset and chunk.staging_offset + chunk.chunk_bytes <= offset + capacity):
            raise TransferFailedError(
                f"{what} from prefill rank {tp_rank} points outside its staging window [{offset}, {offset + capacity})",
                rec.room,
            )
        a, b = chunk.token_start, chunk.token_start + chunk.num_tokens
        if b > rec.num_tokens:
            raise TransferFailedError(f"{what} tokens [{a}, {b}) exceed the request's {rec.num_tokens}", rec.room)
        la, lb = layers
        num_layers = self.config.geometry.num_layers
        if lb > num_layers:
            raise TransferFailedError(
                f"{what} from prefill rank {tp_rank}: layers [{la}, {lb}) exceed num_layers={num_layers}", rec.room
            )
        expected = plan.nbytes(a, b, (la, lb))
        if chunk.chunk_bytes != expected:
            raise TransferFailedError(
                f"{what} from prefill rank {tp_rank}: chunk_bytes={chunk.chunk_bytes}, but tokens [{a}, {b}) x "
                f"layers [{la}, {lb}) are {expected} B",
                rec.room,
            )
        with self._lock:
            stand = rec.layer_tokens.get(tp_rank)
            if stand is None:  # a direct writer sends no chunks
                raise TransferFailedError(f"{what} from prefill rank {tp_rank}, a direct writer", rec.room)
            off = np.flatnonzero(stand[la:lb] != a)
            if off.size:
                layer = la + int(off[0])
                raise TransferFailedError(
                    f"{what} from prefill rank {tp_rank}: tokens [{a}, {b}) of layer {layer}, but layer "
                    f"{layer} has tokens [0, {int(stand[layer])}) (a repeated or skipped chunk)",
                    rec.room,
                )
            stand[la:lb] = b
            rec.first_notice = rec.first_notice or now
            rec.state.handle(Event.CHUNK_STARTED, now)
        return plan, base + chunk.staging_offset

    def _chunk_layers(self, layer_start: int, num_layers: int) -> tuple[int, int]:
        """A chunk's layers ``(start, stop)`` from its wire fields (``num_layers=0``: all)."""
        if num_layers == 0:
            return 0, self.config.geometry.num_layers
        return layer_start, layer_start + num_layers

    def _scatter(
        self,
        rec: DecodeRoom,
        plan: RequestPlan,
        tp_rank: int,
        chunk: ChunkReady | StagedChunk,
        arena_offset: int,
        layers: tuple[int, int],
    ) -> bool:
        """Scatter one staged chunk into the pool (worker thread); a ``ChunkReady``'s slot
        is returned with ``ChunkAck``, a ``TransferDone``'s last chunk is not (the room
        ends). False when the room has ended or the scatter failed (it fails the room)."""
        from sglang_kvxfer import ops

        if rec.state.is_terminal:
            return False
        a, b = chunk.token_start, chunk.token_start + chunk.num_tokens
        t0 = time.perf_counter()
        try:
            with rec.copy_lock:
                if rec.state.is_terminal:  # failed meanwhile: its windows may be freed
                    return False
                piece = plan.scatter_slice(a, b)
                k, v = plan.layer_buffers(self._live_pool.buffers, layers, side="dst")
                staging = self._live_staging.view(arena_offset, chunk.chunk_bytes)
                # On the copy stream, waited for by event: the slot is returned only once the
                # bytes are in the pool, and the model's streams are not synchronized.
                self.copy_stream.run(lambda: ops.scatter_kv_heads(staging, k, v, piece))
        except Exception as exc:
            self._fail_room(rec, f"scatter of tokens [{a}, {b}) failed: {exc}")
            return False
        rec.timings["scatter"] = rec.timings.get("scatter", 0.0) + time.perf_counter() - t0
        if isinstance(chunk, ChunkReady):
            group = self._groups.get(rec.group)
            peer = group.peers.get(tp_rank) if group else None
            if peer is not None:
                self._live_control.send(
                    peer.endpoint, ChunkAck(room=rec.room, tp_rank=self.tp_rank, staging_offset=chunk.staging_offset)
                )
        return True

    def _on_done(self, msg: TransferDone, sender: str) -> None:
        rec = self.room(msg.room)
        if rec is None or rec.state.is_terminal:
            return
        self._touch(msg.tp_rank)
        arrived = rec.last_notice = time.monotonic()
        chunk = msg.last_chunk
        task: Callable[[], None]
        if chunk is None:
            task = lambda: self._writer_done(rec, msg, arrived)  # noqa: E731
        else:
            try:
                layers = self._chunk_layers(msg.last_layer_start, msg.last_num_layers)
                plan, arena_offset = self._check_chunk(rec, msg.tp_rank, chunk, layers)
            except KVXferError as exc:
                return self._fail_room(rec, str(exc))

            def task() -> None:  # the last chunk, then the writer is done: one step
                if self._scatter(rec, plan, msg.tp_rank, chunk, arena_offset, layers):
                    self._writer_done(rec, msg, arrived)

        landed = True
        if msg.receipts:  # the writer's writes it had no ACK for yet: in place here?
            try:
                landed = self._live_transport.landed(sender, msg.receipts)
            except KVXferError as exc:
                return self._fail_room(rec, f"prefill rank {msg.tp_rank}'s writes did not land: {exc}")
            if not landed:
                task = functools.partial(self._after_receipts, rec, msg, sender, task)
        with self._lock:  # nothing of the room queued: nothing to keep in order with
            inline = landed and rec.queued == 0 and (chunk is None or chunk.chunk_bytes <= INLINE_NOTICE_BYTES)
        if inline:
            task()
        else:
            self._submit(rec, task)

    def _after_receipts(self, rec: DecodeRoom, msg: TransferDone, sender: str, then: Callable[[], None]) -> None:
        """Run ``then`` (worker thread) once the transport says every receipt of ``msg``
        landed; not when the room ended meanwhile, or when they did not land within the
        transfer deadline (the room is failed saying why)."""
        deadline = time.monotonic() + self.config.transfer_timeout_s
        while not rec.state.is_terminal:
            left = deadline - time.monotonic()
            try:  # in slices: a room failed meanwhile (abort, the writer's own failure) stops it
                self._live_transport.wait_landed(sender, msg.receipts, max(0.0, min(left, 0.05)))
            except TransferTimeoutError as exc:
                if left > 0.05:
                    continue
                reason = f"{exc} (the transfer deadline, {self.config.transfer_timeout_s} s)"
            except KVXferError as exc:
                reason = str(exc)
            else:
                return then()
            return self._fail_room(rec, f"prefill rank {msg.tp_rank}'s writes did not land: {reason}")

    def _writer_done(self, rec: DecodeRoom, msg: TransferDone, arrived: float) -> None:
        with self._lock:
            if rec.state.is_terminal:
                return
            try:
                self._check_complete(rec, self._writer(rec, msg.tp_rank), msg)
                rec.state.writer_done(msg.tp_rank, time.monotonic())
            except KVXferError as exc:
                problem = str(exc)
            else:
                problem = ""
                rec.bytes += msg.total_bytes
                rec.ops += msg.num_ops
                for k, v in note_writer_done(rec.marks, msg.timings, arrived).items():
                    rec.timings[k] = rec.timings.get(k, 0.0) + v
                rec.writer_aux[msg.tp_rank] = msg.aux_payload
                if msg.aux_payload:
                    rec.aux_payload = msg.aux_payload
                done = rec.state.poll is KVPoll.Success
        if problem:
            return self._fail_room(rec, problem)
        if done:
            rec.finished_at = time.monotonic()
            self._free_windows(rec)
            self._request_ended(rec)

    def _check_complete(self, rec: DecodeRoom, plan: RequestPlan, msg: TransferDone) -> None:
        """A writer's ``TransferDone`` counts only with every (token x layer) of its share in
        place: a staged writer's chunks reached ``num_tokens`` in every layer; any writer's
        ``total_bytes`` is its plan's payload. Call with the lock held."""
        if rec.sparse or msg.positions is not None:
            return self._check_sparse(rec, plan, msg)
        stand = rec.layer_tokens.get(msg.tp_rank)
        if stand is not None:
            short = np.flatnonzero(stand != rec.num_tokens)
            if short.size:
                layer = int(short[0])
                raise TransferFailedError(
                    f"prefill rank {msg.tp_rank} sent TransferDone with layers {short.tolist()} incomplete: "
                    f"layer {layer} has tokens [0, {int(stand[layer])}) of {rec.num_tokens}",
                    rec.room,
                )
        if msg.total_bytes != plan.nbytes():
            raise TransferFailedError(
                f"prefill rank {msg.tp_rank} sent TransferDone with total_bytes={msg.total_bytes}; "
                f"its share of the request is {plan.nbytes()} B",
                rec.room,
            )

    def _check_sparse(self, rec: DecodeRoom, plan: RequestPlan, msg: TransferDone) -> None:
        """A writer of a sparse room names the pages it wrote (``positions``): they lie in this
        rank's page list, every writer of the room names the same ones (each writes its
        heads of them), and ``total_bytes`` is its heads' payload of their tokens. Call with
        the lock held."""
        where = None if msg.positions is None else msg.positions.astype(np.int64)
        if not rec.sparse or where is None:
            asked = "asked for sparse writes" if rec.sparse else "asked for its whole page list"
            sent = "sent no positions" if where is None else f"named {where.size} position(s)"
            raise TransferFailedError(
                f"prefill rank {msg.tp_rank} {sent} in TransferDone; decode rank {self.tp_rank} {asked}", rec.room
            )
        pages = 0 if rec.pages is None else len(rec.pages)
        if where.size and int(where[-1]) >= pages:
            raise TransferFailedError(
                f"prefill rank {msg.tp_rank} named position {int(where[-1])}; this rank's page list has {pages}",
                rec.room,
            )
        if rec.positions is not None and not np.array_equal(rec.positions, where):
            diff = np.setxor1d(rec.positions, where)
            raise TransferFailedError(
                f"the writers of the room wrote different pages: prefill rank {msg.tp_rank} named "
                f"{where.size} position(s), another writer {rec.positions.size}; they differ at position "
                f"{int(diff[0])}",
                rec.room,
            )
        page_size = self.config.geometry.page_size
        tokens = int(np.minimum(page_size, rec.num_tokens - where * page_size).sum())
        if msg.total_bytes != plan.token_nbytes * tokens:
            raise TransferFailedError(
                f"prefill rank {msg.tp_rank} sent TransferDone with total_bytes={msg.total_bytes}; "
                f"its share of the {tokens} tokens of the {where.size} page(s) it named is "
                f"{plan.token_nbytes * tokens} B",
                rec.room,
            )
        rec.positions = where

    # -- failures and liveness ---------------------------------------------------------------------
    def _free_windows(self, rec: DecodeRoom) -> None:
        with rec.copy_lock, self._lock:  # after a scatter reading them has ended
            windows, rec.windows = rec.windows, {}
        for offset, _ in windows.values():
            self._live_staging.free(offset)

    def _fail_room(self, rec: DecodeRoom, reason: str, notify: bool = True, already_failed: bool = False) -> None:
        with self._lock:
            if not already_failed:
                if rec.state.is_terminal:
                    return
                rec.state.fail(reason, time.monotonic())
            rec.finished_at = time.monotonic()
            group = self._groups.get(rec.group)
            # Tell the candidate prefill ranks (all known ranks of the group before metadata
            # went out), so their side of the request fails now too, with this reason.
            ranks = rec.candidates or (tuple(group.peers) if group else ())
            peers = [group.peers[p] for p in ranks if group and p in group.peers] if notify else []
            if notify and not peers:
                if group is not None:  # sent once the group's ranks are known
                    group.untold.append((rec.room, TransferFailed, reason))
        log.warning("decode rank %d room %d failed: %s", self.tp_rank, rec.room, reason)
        self._request_ended(rec)
        # Free the windows after any scatter already queued for this room has run.
        self._submit(rec, lambda: self._free_windows(rec))
        for peer in peers:
            self._live_control.send(
                peer.endpoint, TransferFailed(room=rec.room, side=Side.DECODE, tp_rank=self.tp_rank, reason=reason)
            )

    def abort(self, rec: DecodeRoom, reason: str) -> None:
        with self._lock:
            if rec.state.is_terminal:
                return
            rec.marks["aborted"] = rec.finished_at = time.monotonic()
            rec.state.abort(reason, rec.finished_at)
            group = self._groups.get(rec.group)
            peers = list(group.peers.values()) if group else []
            if not peers:
                if group is not None:  # sent once the group's ranks are known
                    group.untold.append((rec.room, Abort, reason))
        self._request_ended(rec)
        self._submit(rec, lambda: self._free_windows(rec))
        for peer in peers:
            self._live_control.send(
                peer.endpoint, Abort(room=rec.room, side=Side.DECODE, tp_rank=self.tp_rank, reason=reason)
            )

    def _peers(self) -> list[Peer]:
        with self._lock:
            return [
                p
                for g in self._groups.values()
                if g.status in (GroupStatus.REGISTERING, GroupStatus.READY)
                for p in g.peers.values()
            ]

    def _peer_lost(self, peer: Peer, reason: str) -> None:
        with self._lock:
            groups = [g for g in self._groups.values() if peer in g.peers.values()]
            if any(g.status is GroupStatus.REGISTERING and not g.acks.get(peer.tp_rank) for g in groups):
                # It never answered this rank's DecodeRegister: an endpoint nobody serves
                # (a stale bootstrap entry) or a rank that stalled since registering.
                reason += f"; it never answered this rank's registration (sent to {peer.endpoint})"
            for g in groups:
                g.status, g.error = GroupStatus.FAILED, reason
            rooms = [
                r for r in self._rooms.values() if not r.state.is_terminal and any(r.group == g.address for g in groups)
            ]
        for rec in rooms:  # the other prefill ranks of the room hear of it too
            self._fail_room(rec, f"prefill rank {peer.tp_rank} is gone: {reason}")
        with self._lock:
            for g in groups:  # the next request looks the group up again (a restarted prefill)
                if self._groups.get(g.address) is g:
                    self._groups.pop(g.address)
        self._revoke(groups)
        self._live_control.forget(peer.endpoint)

    def _revoke(self, groups: list[PrefillGroup]) -> None:
        """Withdraw the data-plane grants of these groups' prefill sessions."""
        for g in groups:
            for p in g.peers.values():
                try:
                    self._live_transport.revoke_peer(p.session)
                except Exception:
                    log.exception("decode rank %d: revoking prefill session %s failed", self.tp_rank, p.session)

    def _on_tick(self, now: float) -> None:
        super()._on_tick(now)
        with self._lock:
            retry = [
                r
                for r in self._rooms.values()
                if r.meta_pending and not r.meta_sent and r.state.poll is KVPoll.WaitingForInput
            ]
        for rec in retry:
            self._dispatch_later(rec)

    def _dispatch_later(self, rec: DecodeRoom) -> None:
        """``_dispatch_meta`` on a worker, for the I/O thread (which must not plan or grow
        staging); at most one queued per room."""
        with self._lock:
            if rec.dispatch_queued or rec.dispatching:
                return
            rec.dispatch_queued = True

        def dispatch() -> None:
            with self._lock:
                rec.dispatch_queued = False
            self._dispatch_meta(rec)

        self._submit(rec, dispatch)

    def release(self, room: int) -> None:
        with self._lock:
            rec = self._rooms.get(room)
            if rec is not None and rec.state.is_terminal:
                del self._rooms[room]


class KVReceiver(RequestHandle):
    """Decode side of one request, as SGLang's scheduler drives it.

    ``KVReceiver(mgr, room)`` starts looking up and registering with the prefill group
    (non-blocking). ``send_metadata(page_ids)`` says where the KV goes; ``poll()`` reaches
    ``KVPoll.Success`` when every writer is done (then ``aux_payload`` holds the prefill's
    aux bytes) or ``KVPoll.Failed`` (then ``failure_reason`` says why).
    """

    mgr: DecodeManager
    _rec: DecodeRoom
    _abort_reason = "aborted by the decode side"

    def __init__(self, mgr: DecodeManager, room: int, bootstrap_addr: str | None = None, watch_prefill: bool = False):
        """``watch_prefill``: this rank allocates the room's pages only once the prefill's
        forward of it finished (SGLang's ``prefill_complete`` policy): the candidate prefill
        ranks are asked to say so, and ``prefill_ready`` turns True once each did."""
        if not isinstance(mgr, DecodeManager):
            raise TypeError(f"mgr must be a DecodeManager, got {type(mgr).__name__}")
        self.mgr, self.room = mgr, room
        self._rec = mgr.create_room(room, bootstrap_addr or mgr.config.bootstrap, watch=watch_prefill)
        self._sent = False

    @property
    def prefill_ready(self) -> bool:
        """With ``watch_prefill``: every candidate prefill rank finished the room's forward."""
        return self._rec.prefill_ready

    def init(self) -> None:
        """Kept for SGLang-shaped callers: lookup and registration already started."""

    def send_metadata(
        self,
        page_ids,
        aux_slot: int = -1,
        num_tokens: int | None = None,
        prefix_tokens: int = 0,
        token_stride: int = 1,
        token_phase: int = 0,
        sparse: bool = False,
    ) -> None:
        """Tell the writers where this request's KV goes (this rank's page ids).

        ``prefix_tokens``: tokens of the request this rank already holds (a decode radix
        cache hit). ``page_ids`` and ``num_tokens`` then cover only the tokens after them; the
        prefill reads the length (``KVSender.decode_prefix_tokens``) and sends only those.

        ``token_stride`` / ``token_phase`` (decode context parallel): this rank holds only
        the tokens ``t`` (counted after the prefix) with ``t % token_stride == token_phase``,
        packed in order into ``page_ids``; ``num_tokens`` (required then) stays the whole
        request's length, the same on every decode rank.

        An empty ``page_ids`` needs ``prefix_tokens`` (the decode holds the whole prompt) or
        ``num_tokens=0`` (a writer with no share of this request: a prefill CP rank whose
        share of a short request is empty): the writers send only the aux data.

        ``sparse``: the writers hold only some of the request's pages (a SGLang prefill with
        KV cache sharding) and each writes those at the positions of ``page_ids`` it picks
        (``KVSender.send(positions=)``), naming them when done (``positions`` then); the
        caller checks that the writers of all its requests covered every page. Direct or
        fused writes only, every token (not with ``token_stride``).
        """
        if self._sent:
            raise ValueError(f"room {self.room}: send_metadata() was already called")
        if isinstance(prefix_tokens, bool) or not isinstance(prefix_tokens, (int, np.integer)) or prefix_tokens < 0:
            raise ValueError(f"prefix_tokens={prefix_tokens!r} must be an int >= 0")
        g = self.mgr.config.geometry
        pages = np.asarray(page_ids, dtype=np.int64).reshape(-1)
        if pages.size == 0 and not prefix_tokens and num_tokens != 0:
            raise ValueError("page_ids is empty (num_tokens=0 says this rank receives no token, only the aux data)")
        if pages.size and (pages.min() < 0 or pages.max() >= g.num_pages):
            raise ValueError(f"page_ids must lie in [0, {g.num_pages}), got {pages.min()}..{pages.max()}")
        if len(np.unique(pages)) != pages.size:
            raise ValueError("page_ids repeats a page")
        for name, value, low in (("token_stride", token_stride, 1), ("token_phase", token_phase, 0)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"{name}={value!r} must be an int >= {low}")
        if token_phase >= token_stride:
            raise ValueError(f"token_phase={token_phase} must be below token_stride={token_stride}")
        if sparse and token_stride != 1:
            raise ValueError(f"sparse=True takes every token (token_stride={token_stride})")
        if token_stride > 1 and num_tokens is None:
            raise ValueError(f"token_stride={token_stride} needs num_tokens (the whole request's length)")
        selection = TokenSelection(int(token_stride), int(token_phase))
        tokens = pages.size * g.page_size if num_tokens is None else int(num_tokens)
        own = selection.count(tokens)
        of = (
            f" ({own} of {tokens} at token_stride {token_stride}, token_phase {token_phase})"
            if token_stride > 1
            else ""
        )
        # A decode that holds the whole prompt (prefix) receives no KV, only the aux data.
        if pages.size and not (pages.size - 1) * g.page_size < own <= pages.size * g.page_size:
            raise ValueError(f"num_tokens={tokens}{of} does not fit {pages.size} page(s) of {g.page_size} tokens")
        if not pages.size and own:
            raise ValueError(f"num_tokens={tokens}{of} does not fit 0 pages")
        self._sent = True
        self.mgr.set_metadata(self._rec, pages, tokens, int(aux_slot), int(prefix_tokens), selection, bool(sparse))

    @property
    def positions(self) -> np.ndarray | None:
        """With ``send_metadata(sparse=True)``: the indices into ``page_ids`` the writers
        wrote (every writer the same), once ``poll()`` reached Success; else None."""
        return self._rec.positions

    @property
    def aux_payload(self) -> bytes:
        return self._rec.aux_payload

    @property
    def writer_aux(self) -> dict[int, bytes]:
        """The aux payload of each writer's ``TransferDone``, by prefill rank (complete once
        ``poll()`` reached Success)."""
        with self.mgr._lock:
            return dict(self._rec.writer_aux)

    @property
    def waiting_for(self) -> str:
        return self._rec.waiting_for

    @property
    def paths(self) -> dict[int, tuple[str, str]]:
        """Each writer's data path (``direct``, ``staged``, ``fused``, ``per_token``) and
        why (its plan's ``reason``), by prefill rank; empty until the metadata went out."""
        return {p: (str(plan.path), plan.reason) for p, plan in self._rec.plans.items()}

    @property
    def stats(self) -> dict:
        r = self._rec
        return {
            "bytes": r.bytes,
            "timings": dict(r.timings),
            "first_notice": r.first_notice,
            "last_notice": r.last_notice,
            "finished_at": r.finished_at,
        }
