"""The prefill side: ``PrefillManager`` and ``KVSender``.

A prefill rank registers with the bootstrap, accepts decode registrations (checking the
geometry and answering with the field-level message on a mismatch), collects each
request's metadata from every candidate decode rank, and then writes the request's KV as
the sender hands over chunks of pages: direct page runs where the bytes are contiguous,
otherwise gather -> one write per staging slot -> ``ChunkReady`` (the decode rank
scatters and returns the slot with ``ChunkAck``). After the last chunk every reader gets a
``TransferDone`` carrying the aux payload. Every wait has a deadline; a failure fails only
its room and is reported to the decode ranks involved.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from sglang_kvxfer.engine import bootstrap
from sglang_kvxfer.engine.config import ENGINE_VERSION
from sglang_kvxfer.engine.manager import Peer, RankBase, RequestHandle
from sglang_kvxfer.engine.pool import BufferLoc
from sglang_kvxfer.errors import KVXferError, TransferFailedError, TransferTimeoutError
from sglang_kvxfer.geometry import check_compatible
from sglang_kvxfer.metrics import SINCE_FIRST_BYTE, SINCE_LAST_CHUNK, RequestRecord
from sglang_kvxfer.planning import candidate_decode_ranks, plan_pair, plan_tp
from sglang_kvxfer.protocol.envelope import peer_secret
from sglang_kvxfer.protocol.fields import STAGING_SLOTS, Side
from sglang_kvxfer.protocol.messages import (
    Abort,
    ChunkAck,
    ChunkReady,
    DecodeRegister,
    Heartbeat,
    PrefillRegister,
    RegisterReply,
    RequestMeta,
    TransferDone,
    TransferFailed,
)
from sglang_kvxfer.protocol.state import Event, KVPoll
from sglang_kvxfer.transports.base import Ticket, TicketState, wait_all

__all__ = ["PrefillManager", "KVSender"]

log = logging.getLogger("sglang_kvxfer.prefill")



class DecodePeer(Peer):
    """A registered decode rank: its placement, imported regions and buffer locations."""

    def __init__(self, msg: DecodeRegister, regions, staging, now: float):
        super().__init__(msg.session, msg.tp_rank, msg.endpoint, now)
        self.placement = msg.geometry.placement(msg.tp_size, msg.tp_rank)
        self.regions = regions
        self.locs = [BufferLoc(int(r), int(o)) for r, o in msg.kv_buffer_locs]
        self.staging = staging


@dataclass
class _Chunk:
    pages: np.ndarray
    last: bool
    aux: bytes
    ready: object = None  # has .synchronize(): the pages' KV is written once it returns


class PrefillRoom:
    """One request on this prefill rank."""

    def __init__(self, room: int, state):
        self.room = room
        self.state = state
        self.metas: dict[int, RequestMeta] = {}
        self.expected: tuple[int, ...] | None = None
        self.plan = None
        self.num_tokens: int | None = None
        self.src_pages = np.zeros(0, dtype=np.int64)
        self.pending: collections.deque[_Chunk] = collections.deque()
        self.scheduled = False
        self.tokens_sent = 0
        self.inflight: dict[int, set[int]] = collections.defaultdict(set)  # reader -> slot offsets
        self.cond = threading.Condition()
        self.bytes = 0
        self.ops = 0
        self.reader_bytes: dict[int, int] = collections.defaultdict(int)
        self.reader_ops: dict[int, int] = collections.defaultdict(int)
        self.timings: dict[str, float] = collections.defaultdict(float)
        self.sender_attached = False
        self.unattached = False  # created by a frame, no sender yet (capped, see PrefillManager)
        self.finished_at: float | None = None
        self.marks: dict[str, float] = {}  # monotonic times of the transfer window (metrics.py)

    def window(self) -> tuple[float | None, float | None]:
        """(first byte ready, last chunk ready): handed over and destinations known."""
        known = self.marks.get("dest_known")
        if known is None or "first_chunk" not in self.marks:
            return None, None
        last = self.marks.get("last_chunk")
        return max(known, self.marks["first_chunk"]), (max(known, last) if last is not None else None)

    def record(self, tp_rank: int) -> RequestRecord:
        first, last = self.window()
        return RequestRecord(room=self.room, side="prefill", tp_rank=tp_rank, ok=self.state.poll is KVPoll.Success,
                             reason=self.state.reason or "", bytes=self.bytes, ops=self.ops,
                             phases=dict(self.timings), first_byte_ready=first, last_chunk_ready=last,
                             last_notice=self.marks.get("done"),
                             failure_kind="aborted" if "aborted" in self.marks else "")


class PrefillManager(RankBase):
    """One prefill TP rank. Registers with the bootstrap at construction (with retries
    until ``bootstrap_timeout_s``; ``wait_registered`` blocks on it)."""

    side = Side.PREFILL

    MAX_UNATTACHED_ROOMS = 4096  # records created by frames before a sender holds the room
    ROOM_RETENTION_S = 60.0      # a finished room nobody holds is forgotten after this

    def __init__(self, config, pool=None):
        self._decode_peers: dict[str, DecodePeer] = {}  # before the I/O thread starts
        # Forgotten decode sessions -> (peer, last time told to register again), capped.
        self._lost_peers: collections.OrderedDict[str, tuple[Peer, float]] = collections.OrderedDict()
        self._num_unattached = 0
        super().__init__(config, pool)
        self._registered = threading.Event()
        self.registration_error: str | None = None
        self.start_thread(self._register_with_bootstrap, f"kvxfer-prefill{self.tp_rank}-boot")

    # -- bootstrap -----------------------------------------------------------------------------
    def _register_with_bootstrap(self) -> None:
        msg = PrefillRegister(engine_version=ENGINE_VERSION, session=self.session,
                              tp_size=self.config.tp_size, tp_rank=self.tp_rank,
                              endpoint=self.control.endpoint, geometry=self.config.geometry,
                              transport=self.config.transport)
        deadline = time.monotonic() + self.config.bootstrap_timeout_s
        last = "no answer"
        while not self._closed and time.monotonic() < deadline:
            try:
                reply = bootstrap.request(self.config.bootstrap, msg, timeout_s=0.5, key=self.config.auth_key)
            except KVXferError as exc:
                last = str(exc)
                time.sleep(0.2)
                continue
            if reply.reason and not reply.ready and "registered" not in reply.reason:
                self.registration_error = reply.reason  # refused: conflicting group settings
                log.error("bootstrap refused prefill rank %d: %s", self.tp_rank, reply.reason)
                break
            self._registered.set()
            return
        if self.registration_error is None:
            self.registration_error = f"could not register with bootstrap {self.config.bootstrap}: {last}"
        self._registered.set()

    def wait_registered(self, timeout_s: float) -> None:
        """Block until registered with the bootstrap; raise if it failed or timed out."""
        if not self._registered.wait(timeout_s):
            raise TransferTimeoutError(f"prefill rank {self.tp_rank} not registered after {timeout_s} s")
        if self.registration_error:
            raise TransferFailedError(self.registration_error)

    # -- messages (I/O thread) ------------------------------------------------------------------
    def _on_message(self, msg, sender: str) -> None:
        if isinstance(msg, Heartbeat):
            peer = self._decode_peers.get(sender)
            if peer is not None:
                peer.last_seen = time.monotonic()
            else:
                self._unknown_session(sender)
        elif isinstance(msg, DecodeRegister):
            self._on_register(msg)
        elif isinstance(msg, RequestMeta):
            self._on_meta(msg)
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
        self.control.send(lost[0].endpoint, RegisterReply(
            session=self.session, tp_rank=self.tp_rank, ok=False, geometry=self.config.geometry,
            error=f"prefill rank {self.tp_rank} no longer knows decode session {sender} (declared dead "
                  f"after {self.config.heartbeat_timeout_s} s of silence); register again"))

    def _on_peer_failure(self, msg, sender: str) -> None:
        """Abort/TransferFailed from a decode rank: only from a registered session, and for a
        room another session's metadata claims for that decode rank, not at all."""
        if sender not in self._decode_peers and sender not in self._lost_peers:
            self.security_event("unregistered_sender", "%s for room %d from unregistered session %s dropped",
                                type(msg).__name__, msg.room, sender)
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
                self.security_event("unexpected_sender", "%s for room %d, decode rank %d, from session %s; "
                                    "the room belongs to session %s", type(msg).__name__, msg.room,
                                    msg.tp_rank, sender, owner.session)
                return
        # An unknown room keeps a failed record, so a sender created later fails at once.
        self._fail_room(rec, f"decode rank {msg.tp_rank} {what} the request: {msg.reason}", notify=False)

    def _on_register(self, msg: DecodeRegister) -> None:
        error = ""
        old = self._decode_peers.get(msg.session)
        if old is not None:  # a re-registration replaces the stale record on both layers
            self._drop_peer(old, f"decode session {msg.session} registered again (it had been stalled or "
                                 f"lost this rank); its earlier requests end")
            with self._lock:
                self._decode_peers.pop(msg.session, None)
        try:
            if msg.transport != self.config.transport:
                raise KVXferError(f"transport: prefill={self.config.transport!r} decode={msg.transport!r} "
                                  f"(start both sides with the same --transport)")
            check_compatible(self.config.geometry, msg.geometry)
            if len(msg.kv_buffer_locs) != msg.geometry.num_buffers:
                raise KVXferError(f"kv_buffer_locs has {len(msg.kv_buffer_locs)} entries; the geometry "
                                  f"has {msg.geometry.num_buffers} buffers")
            self.transport.add_peer(msg.session, msg.agent_descriptor,
                                    secret=peer_secret(self.config.auth_key, self.session, msg.session))
            regions = [self.transport.import_region(msg.session, d) for d in msg.kv_regions]
            staging = (self.transport.import_region(msg.session, msg.staging_region)
                       if msg.staging_region is not None else None)
            peer = DecodePeer(msg, regions, staging, time.monotonic())
            for b, loc in enumerate(peer.locs):
                if not 0 <= loc.region < len(regions) or loc.offset + peer.placement.buffer_nbytes(b) > regions[loc.region].nbytes:
                    raise KVXferError(f"kv_buffer_locs[{b}]={loc.region, loc.offset} is outside the "
                                      f"registered regions")
        except Exception as exc:  # any refusal is reported to the peer, never raised here
            error = str(exc)
            log.error("prefill rank %d refused decode rank %d (session %s): %s",
                      self.tp_rank, msg.tp_rank, msg.session, error)
            try:
                self.transport.remove_peer(msg.session)
            except Exception:
                pass
            with self._lock:  # refused, but authenticated: its aborts and failures still count
                self._remember_lost(Peer(msg.session, msg.tp_rank, msg.endpoint, time.monotonic()))
        else:
            with self._lock:
                self._decode_peers[msg.session] = peer
                self._lost_peers.pop(msg.session, None)
        self.control.send(msg.endpoint, RegisterReply(
            session=self.session, tp_rank=self.tp_rank, ok=not error, error=error,
            geometry=self.config.geometry))

    def _on_meta(self, meta: RequestMeta) -> None:
        peer = self._decode_peers.get(meta.session)
        if peer is None:
            if meta.session in self._lost_peers:  # forgotten while stalled: it must register again
                log.warning("prefill rank %d: RequestMeta for room %d from forgotten decode session %s; "
                            "asking it to register again", self.tp_rank, meta.room, meta.session)
                self._unknown_session(meta.session)
            else:
                self.security_event("unregistered_sender", "RequestMeta for room %d from unregistered "
                                    "decode session %s dropped", meta.room, meta.session)
            return
        peer.last_seen = time.monotonic()
        g = self.config.geometry
        conflict = late = ""
        with self._lock:
            rec = self._rooms.get(meta.room) or self._create_unattached(meta.room)
            if rec is None:
                late = f"prefill rank {self.tp_rank} holds too many requests nobody sends yet"
            elif rec.state.is_terminal:
                late = rec.state.reason or f"room {meta.room} already completed on prefill rank {self.tp_rank}"
            else:
                owner = rec.metas.get(meta.tp_rank)
                if owner is not None:
                    conflict = (f"security: room {meta.room} for decode rank {meta.tp_rank} was claimed by "
                                f"session {owner.session} and again by session {meta.session}"
                                if owner.session != meta.session else
                                f"decode rank {meta.tp_rank} sent the metadata of room {meta.room} twice")
            if late or conflict:
                ready = problem = False
            else:
                if rec.expected is None:
                    rec.expected = candidate_decode_ranks(g.total_kv_heads, self.config.tp_size, meta.tp_size,
                                                          self.tp_rank, g.mla)
                    rec.plan = plan_tp(g.total_kv_heads, self.config.tp_size, meta.tp_size, g.mla,
                                       salt=meta.room)
                    rec.num_tokens = meta.num_tokens
                problem = self._meta_problem(rec, meta)
                if problem:
                    ready = False
                else:
                    rec.metas[meta.tp_rank] = meta
                    ready = rec.state.poll is KVPoll.Bootstrapping and set(rec.metas) == set(rec.expected)
                    if ready:
                        rec.marks["dest_known"] = time.monotonic()
                        rec.state.handle(Event.BOOTSTRAPPED, rec.marks["dest_known"])
        if late:  # the request already ended here: say so instead of leaving decode to its deadline
            self.control.send(peer.endpoint, TransferFailed(room=meta.room, side=Side.PREFILL,
                                                            tp_rank=self.tp_rank, reason=late))
        elif conflict:
            if conflict.startswith("security"):
                self.security_event("room_conflict", "%s", conflict)
            self._fail_room(rec, conflict, extra_sessions=(meta.session,))
        elif problem:
            self._fail_room(rec, problem, extra_sessions=(meta.session,))
        elif ready:
            self._schedule(rec)

    def _meta_problem(self, rec: PrefillRoom, meta: RequestMeta) -> str:
        if meta.tp_rank not in rec.expected:
            return f"decode rank {meta.tp_rank} is not a candidate reader of prefill rank {self.tp_rank}"
        if meta.num_tokens != rec.num_tokens:
            return (f"decode ranks disagree on the request length: {meta.num_tokens} vs "
                    f"{rec.num_tokens} tokens")
        if rec.plan.decode_tp != meta.tp_size:
            return f"decode ranks disagree on the decode TP size: {meta.tp_size} vs {rec.plan.decode_tp}"
        elected = meta.tp_rank in rec.plan.decode_targets(self.tp_rank)
        if meta.elected != elected:
            return (f"writer election differs: decode rank {meta.tp_rank} says elected={meta.elected}, "
                    f"prefill rank {self.tp_rank} computed {elected}")
        return ""

    def _on_ack(self, msg: ChunkAck, sender: str) -> None:
        rec = self.room(msg.room)
        if rec is None:
            return
        owner = rec.metas.get(msg.tp_rank)
        if owner is None or owner.session != sender:
            self.security_event("unexpected_sender", "ChunkAck for room %d, decode rank %d, from session %s "
                                "dropped (not the room's reader)", msg.room, msg.tp_rank, sender)
            return
        with rec.cond:
            rec.inflight[msg.tp_rank].discard(msg.staging_offset)
            rec.cond.notify_all()

    # -- rooms ---------------------------------------------------------------------------------
    def _create_unattached(self, room: int) -> PrefillRoom | None:
        """A record for a room no sender holds yet (its metadata or abort came first), or None
        when ``MAX_UNATTACHED_ROOMS`` of them exist (call with the lock held). They end by
        their deadline and are forgotten ``ROOM_RETENTION_S`` later, or taken by a sender."""
        if self._num_unattached >= self.MAX_UNATTACHED_ROOMS:
            self.security_event("room_cap", "no record for room %d: %d rooms wait for a sender already",
                                room, self._num_unattached)
            return None
        rec = self._rooms[room] = PrefillRoom(room, self.new_state(room))
        rec.unattached = True
        self._num_unattached += 1
        return rec

    def attach_sender(self, room: int) -> PrefillRoom:
        with self._lock:
            rec = self._rooms.get(room)
            if rec is None:
                rec = self._rooms[room] = PrefillRoom(room, self.new_state(room))
            elif rec.unattached:
                rec.unattached = False
                self._num_unattached -= 1
            rec.sender_attached = True
            return rec

    def _forget(self, room: int) -> None:
        rec = self._rooms.pop(room, None)
        if rec is not None and rec.unattached:
            self._num_unattached -= 1

    def submit_chunk(self, rec: PrefillRoom, chunk: _Chunk) -> None:
        with self._lock:
            if rec.state.is_terminal:
                return
            now = time.monotonic()
            rec.marks.setdefault("first_chunk", now)
            if chunk.last:
                rec.marks["last_chunk"] = now
            rec.pending.append(chunk)
            ready = rec.state.poll in (KVPoll.WaitingForInput, KVPoll.Transferring)
        if ready:
            self._schedule(rec)

    def _schedule(self, rec: PrefillRoom) -> None:
        with self._lock:
            if rec.scheduled or not rec.pending:
                return
            rec.scheduled = True
        self.worker_for(rec.room).submit(lambda: self._drain(rec))

    def _drain(self, rec: PrefillRoom) -> None:
        while True:
            with self._lock:
                if rec.state.is_terminal or not rec.pending:
                    rec.scheduled = False
                    return
                chunk = rec.pending.popleft()
            try:
                self._send_chunk(rec, chunk)
            except Exception as exc:
                reason = str(exc) if isinstance(exc, KVXferError) else f"{type(exc).__name__}: {exc}"
                if not isinstance(exc, KVXferError):
                    log.exception("prefill rank %d room %d: chunk failed", self.tp_rank, rec.room)
                self._fail_room(rec, reason)

    # -- the data path (worker thread) -----------------------------------------------------------
    def _send_chunk(self, rec: PrefillRoom, chunk: _Chunk) -> None:
        g = self.config.geometry
        if chunk.ready is not None:
            chunk.ready.synchronize()  # the forward that writes these pages may still run
        rec.src_pages = np.concatenate([rec.src_pages, chunk.pages])
        total = rec.num_tokens
        start = rec.tokens_sent
        need = -(-total // g.page_size)
        if len(rec.src_pages) > need:
            raise TransferFailedError(f"prefill sent {len(rec.src_pages)} pages for a {total}-token request "
                                      f"(page_size {g.page_size} needs {need})", rec.room)
        if chunk.last and len(rec.src_pages) != need:
            raise TransferFailedError(f"last chunk leaves {len(rec.src_pages)} pages for a {total}-token "
                                      f"request (page_size {g.page_size} needs {need})", rec.room)
        stop = total if chunk.last else min(total, len(rec.src_pages) * g.page_size)
        readers = rec.plan.readers_of(self.tp_rank)
        if stop > start and readers:
            with self._lock:
                if rec.state.poll is not KVPoll.Transferring:
                    rec.state.handle(Event.CHUNK_STARTED, time.monotonic())
            tickets = []
            for t in readers:
                meta = rec.metas[t.decode_rank]
                peer = self._peer_of(meta)
                if meta.staging_offset < 0:
                    tickets += self._write_direct(rec, t, peer, meta, start, stop)
                else:
                    self._write_staged(rec, t, peer, meta, start, stop)
            if tickets:
                t0 = time.perf_counter()
                wait_all(tickets, self.config.transfer_timeout_s)
                rec.timings["wire"] += time.perf_counter() - t0
            with self._lock:
                if not rec.state.is_terminal:
                    rec.state.handle(Event.CHUNK_STARTED, time.monotonic())  # progress
        rec.tokens_sent = stop
        if chunk.last:
            self._finish(rec, readers, chunk.aux)

    def _peer_of(self, meta: RequestMeta) -> DecodePeer:
        peer = self._decode_peers.get(meta.session)
        if peer is None or not peer.alive:
            raise TransferFailedError(f"decode rank {meta.tp_rank} (session {meta.session}) is gone", meta.room)
        return peer

    def _write_direct(self, rec, t, peer: DecodePeer, meta: RequestMeta, start: int, stop: int):
        t0 = time.perf_counter()
        path = "per_token" if self.config.data_path == "per_token" else "direct"
        pair = plan_pair(t, self.placement, peer.placement, rec.src_pages, meta.dst_page_ids,
                         num_tokens=rec.num_tokens, token_start=start, token_stop=stop, path=path)
        if pair.path != "direct":
            raise TransferFailedError(f"decode rank {t.decode_rank} asked for direct writes but the bytes "
                                      f"are not contiguous ({pair.reason})", rec.room)
        groups: dict[tuple[int, int], list[np.ndarray]] = collections.defaultdict(list)
        for b in range(self.config.geometry.num_buffers):
            ops = pair.buffer_ops(b)
            if len(ops):
                mine, theirs = self.pool.locs[b], peer.locs[b]
                shifted = ops + np.array([mine.offset, theirs.offset, 0], dtype=np.int64)
                groups[(mine.region, theirs.region)].append(shifted)
        rec.timings["plan"] += time.perf_counter() - t0
        tickets = []
        for (lr, rr), parts in groups.items():
            ops = np.concatenate(parts)
            tickets.append(self.transport.write(self.pool.regions[lr], peer.regions[rr],
                                                ops[:, 0], ops[:, 1], ops[:, 2]))
            rec.ops += len(ops)
            rec.reader_ops[t.decode_rank] += len(ops)
        rec.bytes += pair.nbytes
        rec.reader_bytes[t.decode_rank] += pair.nbytes
        return tickets

    def _write_staged(self, rec, t, peer: DecodePeer, meta: RequestMeta, start: int, stop: int) -> None:
        """Stream tokens [start, stop) through the reader's two staging slots: gather slot
        k+1 while slot k is on the wire; announce each slot once its write completed."""
        g = self.config.geometry
        if peer.staging is None:
            raise TransferFailedError(f"decode rank {t.decode_rank} registered no staging region", rec.room)
        slot_bytes = meta.staging_capacity_bytes // STAGING_SLOTS
        per_token = g.num_layers * t.num_heads * (g.head_dim + g.v_head_dim) * g.itemsize
        step = slot_bytes // per_token
        if step < 1:
            raise TransferFailedError(f"decode staging slot of {slot_bytes} B cannot hold one token "
                                      f"({per_token} B)", rec.room)
        inflight: collections.deque = collections.deque()
        a = start
        try:
            while a < stop or inflight:
                if a < stop and len(inflight) < STAGING_SLOTS:
                    b = min(stop, a + step)
                    inflight.append(self._post_slot(rec, t, peer, meta, a, b, slot_bytes))
                    a = b
                    continue
                self._complete_slot(rec, t, peer, inflight.popleft())
        except BaseException:
            for ticket, local_off, remote_off, *_ in inflight:
                if ticket.poll() is TicketState.PENDING:
                    try:  # the bytes may still be read from local staging: let the write end
                        ticket.wait(self.config.transfer_timeout_s)
                    except KVXferError:
                        pass
                if local_off is not None:
                    self.staging.free(local_off)
                with rec.cond:
                    rec.inflight[t.decode_rank].discard(remote_off)
            raise

    def _post_slot(self, rec, t, peer: DecodePeer, meta: RequestMeta, a: int, b: int, slot_bytes: int):
        """Gather tokens [a, b) for one staging slot and start moving it. Where the transport
        maps the reader's staging here (``local`` shared memory, CUDA IPC) the gather writes
        straight into the slot: no local staging and no transport write."""
        t0 = time.perf_counter()
        pair = plan_pair(t, self.placement, peer.placement, rec.src_pages, meta.dst_page_ids,
                         num_tokens=rec.num_tokens, token_start=a, token_stop=b, path="staged")
        t_planned = time.perf_counter()
        remote_off = self._acquire_slot(rec, t.decode_rank, meta, slot_bytes)
        local_off = None
        try:
            with self.transport.remote_view(peer.staging, remote_off, pair.staging_nbytes) as view:
                if view is not None:
                    t1 = time.perf_counter()
                    self._gather(pair, view)
                    ticket = Ticket.completed(f"room {rec.room}: gathered into the reader's slot")
            if view is None:
                local_off = self._alloc_local(rec, pair.staging_nbytes)
                t1 = time.perf_counter()
                self._gather(pair, self.staging.view(local_off, pair.staging_nbytes))
                ticket = self.transport.write(self.staging.region, peer.staging, [local_off], [remote_off],
                                              [pair.staging_nbytes])
        except BaseException:
            if local_off is not None:
                self.staging.free(local_off)
            with rec.cond:
                rec.inflight[t.decode_rank].discard(remote_off)
            raise
        t2 = time.perf_counter()
        rec.timings["plan"] += t_planned - t0
        rec.timings["wait"] += t1 - t_planned  # flow control: a free staging slot on both sides
        rec.timings["gather"] += t2 - t1
        return ticket, local_off, remote_off, pair, a, b, t2

    def _gather(self, pair, out) -> None:
        from sglang_kvxfer import ops

        g = self.config.geometry
        ops.gather_kv_heads(self.pool.buffers[: g.num_layers],
                            self.pool.buffers[g.num_layers:] if g.has_v else None,
                            out=out, **pair.gather_kwargs())
        self._sync_device()

    def _complete_slot(self, rec, t, peer: DecodePeer, entry) -> None:
        ticket, local_off, remote_off, pair, a, b, t_posted = entry
        ops = pair.staged_op_count  # one bulk move into the reader's slot (a write, or in place)
        try:
            ticket.wait(self.config.transfer_timeout_s)
        except BaseException:
            with rec.cond:
                rec.inflight[t.decode_rank].discard(remote_off)
            raise
        finally:
            if local_off is not None:
                self.staging.free(local_off)
        t3 = time.perf_counter()
        self.control.send(peer.endpoint, ChunkReady(
            room=rec.room, tp_rank=self.tp_rank, token_start=a, num_tokens=b - a,
            staging_offset=remote_off, chunk_bytes=pair.staging_nbytes))
        rec.timings["wire"] += t3 - t_posted
        rec.timings["notify"] += time.perf_counter() - t3
        rec.bytes += pair.nbytes
        rec.ops += ops
        rec.reader_bytes[t.decode_rank] += pair.nbytes
        rec.reader_ops[t.decode_rank] += ops

    def _acquire_slot(self, rec: PrefillRoom, reader: int, meta: RequestMeta, slot_bytes: int) -> int:
        """Wait (bounded) until one of the reader's staging slots has been scattered."""
        deadline = time.monotonic() + self.config.transfer_timeout_s
        slots = [meta.staging_offset + i * slot_bytes for i in range(STAGING_SLOTS)]
        with rec.cond:
            while True:
                if rec.state.is_terminal:
                    raise TransferFailedError(rec.state.reason or "request ended", rec.room)
                for off in slots:
                    if off not in rec.inflight[reader]:
                        rec.inflight[reader].add(off)
                        return off
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeoutError(f"room {rec.room}: decode rank {reader} returned no staging "
                                               f"slot within {self.config.transfer_timeout_s} s")
                rec.cond.wait(min(left, 0.1))

    def _alloc_local(self, rec: PrefillRoom, nbytes: int) -> int:
        deadline = time.monotonic() + self.config.transfer_timeout_s
        while True:
            off = self.staging.alloc(nbytes)
            if off is not None:
                return off
            if rec.state.is_terminal:
                raise TransferFailedError(rec.state.reason or "request ended", rec.room)
            if time.monotonic() > deadline:
                raise TransferTimeoutError(f"room {rec.room}: no {nbytes} B free in the prefill staging "
                                           f"arena ({self.staging.nbytes} B, KVXFER_STAGING_BYTES)")
            time.sleep(0.001)

    def _sync_device(self) -> None:
        if self.config.device.startswith("cuda"):
            import torch

            torch.cuda.current_stream(self.config.device).synchronize()

    def _finish(self, rec: PrefillRoom, readers, aux: bytes) -> None:
        timings = {k: round(v, 6) for k, v in rec.timings.items()}
        now = rec.marks["done"] = time.monotonic()  # before the notices: they may land at once
        for key, mark in zip((SINCE_FIRST_BYTE, SINCE_LAST_CHUNK), rec.window()):
            if mark is not None:  # ages, so the decode rank can place the window on its own clock
                timings[key] = max(0.0, now - mark)
        for t in readers:
            meta = rec.metas[t.decode_rank]
            self.control.send(self._peer_of(meta).endpoint, TransferDone(
                room=rec.room, tp_rank=self.tp_rank, total_bytes=rec.reader_bytes[t.decode_rank],
                num_ops=rec.reader_ops[t.decode_rank],
                aux_payload=aux, timings=timings))
        with self._lock:
            if rec.state.is_terminal:
                return
            rec.state.handle(Event.TRANSFER_DONE, time.monotonic())
            rec.finished_at = time.monotonic()
        self._request_ended(rec)

    # -- failures --------------------------------------------------------------------------------
    def _fail_room(self, rec, reason: str, notify: bool = True, already_failed: bool = False,
                   extra_sessions: tuple[str, ...] = ()) -> None:
        with self._lock:
            if not already_failed:
                if rec.state.is_terminal:
                    return
                rec.state.fail(reason, time.monotonic())
            rec.finished_at = time.monotonic()
            targets = [(d, m.session) for d, m in rec.metas.items()]
            targets += [(-1, s) for s in extra_sessions if s not in {t[1] for t in targets}]
        with rec.cond:
            rec.cond.notify_all()
        log.warning("prefill rank %d room %d failed: %s", self.tp_rank, rec.room, reason)
        self._request_ended(rec)
        if notify:
            for d, session in targets:
                peer = self._decode_peers.get(session) or self._lost_peer(session)
                if peer is not None:
                    self.control.send(peer.endpoint, TransferFailed(
                        room=rec.room, side=Side.PREFILL, tp_rank=self.tp_rank, reason=reason))

    def abort(self, rec: PrefillRoom, reason: str) -> None:
        with self._lock:
            if rec.state.is_terminal:
                return
            rec.marks["aborted"] = time.monotonic()
            rec.state.abort(reason, rec.marks["aborted"])
            targets = [m.session for m in rec.metas.values()]
        with rec.cond:
            rec.cond.notify_all()
        self._request_ended(rec)
        for session in targets:
            peer = self._decode_peers.get(session)
            if peer is not None:
                self.control.send(peer.endpoint, Abort(room=rec.room, side=Side.PREFILL,
                                                       tp_rank=self.tp_rank, reason=reason))

    def _peers(self):
        with self._lock:
            return list(self._decode_peers.values())

    def _peer_lost(self, peer, reason: str) -> None:
        with self._lock:
            if self._decode_peers.get(peer.session) is not peer:
                return
        self._drop_peer(peer, reason)
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
            rooms = [r for r in self._rooms.values()
                     if not r.state.is_terminal and any(m.session == peer.session for m in r.metas.values())]
        for rec in rooms:
            self._fail_room(rec, reason, extra_sessions=(peer.session,))
        try:
            self.transport.remove_peer(peer.session)
        except Exception:
            pass

    def _lost_peer(self, session: str) -> Peer | None:
        entry = self._lost_peers.get(session)
        return entry[0] if entry is not None else None

    def _on_tick(self, now: float) -> None:
        super()._on_tick(now)
        with self._lock:  # forget finished rooms nobody holds a sender for
            stale = [r for r, rec in self._rooms.items() if rec.finished_at is not None
                     and not rec.sender_attached and now - rec.finished_at > self.ROOM_RETENTION_S]
            for r in stale:
                self._forget(r)

    def release(self, room: int) -> None:
        """Forget a room (the sender is done with it)."""
        with self._lock:
            rec = self._rooms.get(room)
            if rec is not None and rec.state.is_terminal:
                self._forget(room)
            elif rec is not None:
                rec.sender_attached = False


class KVSender(RequestHandle):
    """Prefill side of one request, as SGLang's scheduler drives it.

    ``send(page_ids, last_chunk)`` may be called in Bootstrapping: chunks wait until every
    decode rank's metadata is in. ``poll()`` returns a ``KVPoll``.
    """

    _abort_reason = "aborted by the prefill side"

    def __init__(self, mgr: PrefillManager, room: int):
        if not isinstance(mgr, PrefillManager):
            raise TypeError(f"mgr must be a PrefillManager, got {type(mgr).__name__}")
        self.mgr, self.room = mgr, room
        self._rec = mgr.attach_sender(room)
        self._finished = False

    def send(self, page_ids, last_chunk: bool = False, aux: bytes = b"", ready=None) -> None:
        """Hand over the next pages of the request (page-aligned; the last chunk ends it).

        ``aux`` (last chunk only) reaches every decode reader with ``TransferDone``.
        ``ready`` (optional, e.g. a ``torch.cuda.Event``): the worker calls its
        ``synchronize()`` before it reads these pages, so a chunk can be handed over while
        the forward that writes it is still running.
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
        self._finished = bool(last_chunk)
        self.mgr.submit_chunk(self._rec, _Chunk(pages, bool(last_chunk), bytes(aux), ready))

    @property
    def bytes_sent(self) -> int:
        return self._rec.bytes

    @property
    def ops(self) -> int:
        """Transport ops posted for this request so far."""
        return self._rec.ops

    @property
    def paths(self) -> dict[str, int]:
        """Readers of this request by data path, e.g. ``{"staged": 1}``."""
        out: dict[str, int] = {}
        for meta in self._rec.metas.values():
            if meta.elected:
                key = "direct" if meta.staging_offset < 0 else "staged"
                out[key] = out.get(key, 0) + 1
        return out

    @property
    def timings(self) -> dict[str, float]:
        return dict(self._rec.timings)
