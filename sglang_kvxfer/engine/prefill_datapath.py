"""The prefill data path: chunks in, bytes to every reader out (worker threads).

Owns ``PrefillDataPath``, the part of ``PrefillManager`` that queues a sender's chunks
(token ranges, each whole or as layer groups: a group moves only its layers' bytes),
keeps one ``RequestPlan`` per reader of a room (built at the reader's first chunk,
extended chunk by chunk, cut per staging slot or direct write), writes direct page runs,
copies fused readers' chunks pool -> pool (``prefill_fused.py``), streams staged tokens
through the readers' two staging slots (gather -> one write -> ``ChunkReady``, waiting for
``ChunkAck`` before a slot is reused; staged readers that need the same head slice, the
replicas of a head, share one gather whose staging is written to each of their slots:
fan-out), and sends ``TransferDone`` after the last chunk, carrying each staged reader's
last slot (one notice instead of a ``ChunkReady`` and a ``TransferDone``; that slot is
never acknowledged). Where the transport has landing receipts (``tcp``), the last chunk's
writes still unacknowledged ride on that ``TransferDone`` as receipts instead of being
waited for first: the reader's transport says when they landed, while the writer's ACK
travels back; the writer waits for them after the notice, before its own Success.
Must not: handle control messages other than sending its own, decide room ownership, or
fail a room itself (it raises; ``_drain`` hands the error to ``_fail_room``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from sglang_kvxfer.engine.manager import RankBase
from sglang_kvxfer.engine.pool import StagingArena
from sglang_kvxfer.engine.prefill_fused import FusedWrites
from sglang_kvxfer.engine.prefill_rooms import Chunk, PrefillRoom, Synchronizable
from sglang_kvxfer.errors import KVXferError, LocalProtocolError, TransferFailedError, TransferTimeoutError
from sglang_kvxfer.geometry import RankPlacement
from sglang_kvxfer.metrics import SINCE_FIRST_BYTE, SINCE_LAST_CHUNK
from sglang_kvxfer.planning import DataPath, HeadTransfer, KVSlice, RequestPlan, TokenSelection, TPPlan
from sglang_kvxfer.planning.byteplan import contiguous_layout, per_token_possible, staged_op_count
from sglang_kvxfer.protocol.fields import MAX_RECEIPTS, STAGING_SLOTS
from sglang_kvxfer.protocol.messages import ChunkReady, RequestMeta, StagedChunk, TransferDone
from sglang_kvxfer.protocol.state import Event, KVPoll
from sglang_kvxfer.transports.base import RemoteRegion, Ticket, TicketState, wait_all
from sglang_kvxfer.transports.ticket import pending_or_raise

if TYPE_CHECKING:
    from sglang_kvxfer.engine.prefill import DecodePeer

__all__ = ["PrefillDataPath"]

log = logging.getLogger("sglang_kvxfer.prefill")


class _Local:
    """Local staging that slot writes read: freed when the last of them has landed (one
    write, or one per reader of a fan-out group: one gather, several writes)."""

    def __init__(self, arena: StagingArena, offset: int, users: int):
        self._arena, self.offset, self._users = arena, offset, users
        self._lock = threading.Lock()

    def release(self, count: int = 1) -> None:
        with self._lock:
            self._users -= count
            last = self._users == 0
        if last:
            self._arena.free(self.offset)


class _Slot(NamedTuple):
    """One staging slot on its way: its write, the local staging it reads (None: gathered
    in place), the reader's slot offset, its bytes, tokens and layers, and its reader."""

    ticket: Ticket
    local: _Local | None
    remote_off: int
    nbytes: int
    a: int
    b: int
    t_posted: float
    layers: tuple[int, int]
    reader: int
    endpoint: str


def selection(meta: RequestMeta) -> TokenSelection:
    """The tokens a reader holds (``RequestMeta`` checked ``token_phase < token_stride``)."""
    return TokenSelection(meta.token_stride, meta.token_phase)


class _Reader(NamedTuple):
    """A staged reader of a chunk: its plan, its peer record and its metadata."""

    plan: RequestPlan
    peer: DecodePeer
    meta: RequestMeta


class PrefillDataPath(FusedWrites, RankBase[PrefillRoom]):
    """Data path of ``PrefillManager`` (a mixin over ``RankBase``; ``DecodePeer`` and
    ``_fail_room`` come from ``prefill.py``, the fused writes from ``prefill_fused.py``)."""

    _decode_peers: dict[str, DecodePeer]  # set by PrefillManager.__init__

    def submit_chunk(self, rec: PrefillRoom, chunk: Chunk) -> None:
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
        self.idle_worker().submit(lambda: self._drain(rec))  # one drain per room at a time

    def _drain(self, rec: PrefillRoom) -> None:
        while True:
            with self._lock:
                if rec.state.is_terminal or not rec.pending:
                    rec.scheduled = False
                    return
                chunk = rec.pending.popleft()
                merged = []
                while chunk.layers is not None and rec.pending and self._continues(chunk, rec.pending[0]):
                    merged.append(chunk)
                    chunk = self._merge(chunk, rec.pending.popleft())
            try:
                for earlier in merged:  # their forwards ended before the last one's
                    if earlier.ready is not None:
                        earlier.ready.synchronize()
                self._send_chunk(rec, chunk)
            except Exception as exc:
                reason = str(exc) if isinstance(exc, KVXferError) else f"{type(exc).__name__}: {exc}"
                if not isinstance(exc, KVXferError):
                    log.exception("prefill rank %d room %d: chunk failed", self.tp_rank, rec.room)
                self._fail_room(rec, reason)

    @staticmethod
    def _continues(chunk: Chunk, nxt: Chunk) -> bool:
        """Whether ``nxt`` is the next layer group of ``chunk``'s token chunk."""
        return (
            nxt.layers is not None
            and chunk.layers is not None
            and nxt.layers[0] == chunk.layers[1]
            and nxt.layers[0] > 0
            and not nxt.pages.size
        )

    @staticmethod
    def _merge(chunk: Chunk, nxt: Chunk) -> Chunk:
        """Layer groups queued behind each other (the transfer lags the forward) move as one
        group: one gather, write and notice for all of them, so a lagging stream catches up
        in one step instead of one round trip per group. ``nxt``'s ``ready`` is the later
        one; ``_drain`` waits for the earlier ones first."""
        assert chunk.layers is not None and nxt.layers is not None  # _continues checked both
        return Chunk(chunk.pages, nxt.last, nxt.aux, nxt.ready, (chunk.layers[0], nxt.layers[1]))

    # -- the data path (worker thread) -----------------------------------------------------------
    def _send_chunk(self, rec: PrefillRoom, chunk: Chunk) -> None:
        if rec.sparse or chunk.positions is not None:
            return self._send_sparse_chunk(rec, chunk)
        g = self.config.geometry
        # The forward that writes these pages may still run: gathers wait for ``ready`` on
        # the copy stream; a direct write (the transport reads the pool) waits here first.
        ready = chunk.ready
        # Layer-wise: a token chunk's first layer group brings its pages; later groups name
        # the same tokens, and only the group that completes the layers moves tokens_sent on.
        layers = chunk.layers or (0, g.num_layers)
        if chunk.pages.size:
            rec.src_pages = np.concatenate([rec.src_pages, chunk.pages])
        tp_plan, total = self._layout(rec)
        start = rec.tokens_sent
        need = -(-total // g.page_size)
        if len(rec.src_pages) > need:
            raise TransferFailedError(
                f"prefill sent {len(rec.src_pages)} pages for a {total}-token request "
                f"(page_size {g.page_size} needs {need})",
                rec.room,
            )
        if chunk.last and len(rec.src_pages) != need:
            raise TransferFailedError(
                f"last chunk leaves {len(rec.src_pages)} pages for a {total}-token "
                f"request (page_size {g.page_size} needs {need})",
                rec.room,
            )
        stop = total if chunk.last else min(total, len(rec.src_pages) * g.page_size)
        readers = tp_plan.readers_of(self.tp_rank)
        held: dict[int, _Slot] = {}  # staged reader -> its last slot, announced with TransferDone
        early: dict[int, list[Ticket]] = {}  # reader -> pending direct writes, sent as receipts
        try:
            if stop > start and readers:
                with self._lock:
                    if rec.state.poll is not KVPoll.Transferring:
                        rec.state.handle(Event.CHUNK_STARTED, time.monotonic())
                direct: dict[int, list[Ticket]] = {}  # reader -> its direct writes' tickets
                # staged readers by the source head slice and tokens they need: replicas of a
                # head share a gather; a reader of every n-th token (DCP) counts its own tokens
                staged: dict[tuple[int, int, TokenSelection], list[_Reader]] = collections.defaultdict(list)
                for t in readers:
                    meta = rec.metas[t.decode_rank]
                    sel = selection(meta)
                    a, b = sel.count(start), sel.count(stop)
                    if a >= b:  # none of this reader's tokens in the chunk
                        continue
                    peer = self._peer_of(meta)
                    plan = self._reader_plan(rec, t, peer, meta)
                    if plan.fused:  # one copy per reader: each reader's pool must be written
                        self._write_fused(rec, plan, peer, a, b, layers, ready)
                    elif meta.staging_offset < 0:
                        if ready is not None:
                            ready.synchronize()
                            ready = None
                        direct[t.decode_rank] = self._write_direct(rec, plan, peer, a, b, layers)
                    else:
                        staged[(t.src_head_start, t.num_heads, sel)].append(_Reader(plan, peer, meta))
                for (_, _, sel), group in staged.items():
                    a, b = sel.count(start), sel.count(stop)
                    held.update(self._write_staged(rec, group, a, b, ready, hold_last=chunk.last, layers=layers))
                if chunk.last:  # writes the reader can check by receipt go on with TransferDone
                    early = {r: p for r, ts in direct.items() if (p := self._receipted(pending_or_raise(ts)))}
                tickets = [t for r, ts in direct.items() if r not in early for t in ts]
                if tickets:
                    t0 = time.perf_counter()
                    wait_all(tickets, self.config.transfer_timeout_s)
                    rec.timings["wire"] += time.perf_counter() - t0
                with self._lock:
                    if not rec.state.is_terminal:
                        rec.state.handle(Event.CHUNK_STARTED, time.monotonic())  # progress
            if layers[1] == g.num_layers:
                rec.tokens_sent = stop
            if chunk.last:
                self._finish(rec, readers, chunk.aux, held, early)
        except BaseException:
            self._drop_slots(rec, held.values())  # those _finish did not take over
            for ts in early.values():  # they may still read the pool: let them end
                self._settle(ts)
            raise

    def _send_sparse_chunk(self, rec: PrefillRoom, chunk: Chunk) -> None:
        """A chunk of a sparse room: its pages go to the decode pages its ``positions`` name
        (this rank holds only some of the request's pages). Each chunk is planned on its
        own, as a request of its pages' tokens, and written directly (or fused): the reader
        cannot scatter pages it does not know of, so no window is lent for such a room."""
        g = self.config.geometry
        if not rec.sparse:
            raise TransferFailedError(
                "the prefill picks the decode pages it writes (send(positions=...)), but the decode "
                "asked for its whole page list (RequestMeta.sparse=False): both sides must shard the "
                "request's pages the same way",
                rec.room,
            )
        if chunk.positions is None and chunk.pages.size:
            raise TransferFailedError(
                f"the decode asked for sparse writes (RequestMeta.sparse=True), but send() gave "
                f"{chunk.pages.size} page(s) without positions",
                rec.room,
            )
        if chunk.layers is not None:  # KVSender.send refuses positions with layers
            raise LocalProtocolError(f"room {rec.room}: a layer-wise chunk in a sparse room")
        tp_plan, total = self._layout(rec)
        need = -(-total // g.page_size)
        where = chunk.positions if chunk.positions is not None else np.zeros(0, dtype=np.int64)
        if where.size and int(where[-1]) >= need:
            raise TransferFailedError(
                f"send() named position {int(where[-1])}; the decode's {total}-token request has pages "
                f"[0, {need}) at page_size {g.page_size}",
                rec.room,
            )
        rec.src_pages = np.concatenate([rec.src_pages, chunk.pages])
        rec.positions = np.concatenate([rec.positions, where])
        tokens = int(np.minimum(g.page_size, total - where * g.page_size).sum())
        readers = tp_plan.readers_of(self.tp_rank)
        ready, layers = chunk.ready, (0, g.num_layers)
        if tokens and readers:
            with self._lock:
                if rec.state.poll is not KVPoll.Transferring:
                    rec.state.handle(Event.CHUNK_STARTED, time.monotonic())
            tickets: list[Ticket] = []
            for t in readers:
                meta = rec.metas[t.decode_rank]
                peer = self._peer_of(meta)
                t0 = time.perf_counter()
                path = self._writer_path(rec, t, peer, meta, self.placement)
                plan = RequestPlan.build(
                    t,
                    self.placement,
                    peer.placement,
                    chunk.pages,
                    meta.dst_page_ids[where],
                    num_tokens=tokens,
                    path=path,
                    mapping=peer.mapping,
                )
                rec.timings["plan"] += time.perf_counter() - t0
                if plan.fused:
                    self._write_fused(rec, plan, peer, 0, tokens, layers, ready)
                elif plan.staged:
                    raise TransferFailedError(
                        f"decode rank {t.decode_rank} asked for sparse writes but the bytes are not "
                        f"contiguous ({plan.reason}), and a sparse request cannot be staged",
                        rec.room,
                    )
                else:
                    if ready is not None:
                        ready.synchronize()
                        ready = None
                    tickets += self._write_direct(rec, plan, peer, 0, tokens, layers)
            if tickets:
                t0 = time.perf_counter()
                wait_all(tickets, self.config.transfer_timeout_s)
                rec.timings["wire"] += time.perf_counter() - t0
            with self._lock:
                if not rec.state.is_terminal:
                    rec.state.handle(Event.CHUNK_STARTED, time.monotonic())  # progress
        rec.tokens_sent += tokens
        if chunk.last:
            self._finish(rec, readers, chunk.aux, {}, {})

    def _receipted(self, pending: list[Ticket]) -> list[Ticket]:
        """``pending`` when the reader can check all of them by receipt (the transport has
        receipts and each names its frames), else [] (they are waited for first)."""
        if not pending or not self._live_transport.caps.receipts:
            return []
        if any(t.receipts is None for t in pending) or sum(len(t.receipts or ()) for t in pending) > MAX_RECEIPTS:
            return []
        return pending

    def _settle(self, tickets: list[Ticket]) -> None:
        """Let writes of a failing room end (bounded), ignoring how."""
        for ticket in tickets:
            if ticket.poll() is TicketState.PENDING:
                try:
                    ticket.wait(self.config.transfer_timeout_s)
                except KVXferError:
                    pass

    @staticmethod
    def _layout(rec: PrefillRoom) -> tuple[TPPlan, int]:
        """The room's TP plan and length: set with its first ``RequestMeta``, which comes
        before any chunk is scheduled (chunks wait for every reader's metadata)."""
        if rec.plan is None or rec.num_tokens is None:
            raise TransferFailedError(f"room {rec.room}: chunk scheduled before the decode metadata", rec.room)
        return rec.plan, rec.num_tokens

    def _covered(self, rec: PrefillRoom) -> int:
        """Tokens of the request the pages handed over so far hold."""
        return min(self._layout(rec)[1], len(rec.src_pages) * self.config.geometry.page_size)

    def _peer_of(self, meta: RequestMeta) -> DecodePeer:
        peer = self._decode_peers.get(meta.session)
        if peer is None or not peer.alive:
            raise TransferFailedError(f"decode rank {meta.tp_rank} (session {meta.session}) is gone", meta.room)
        return peer

    def _reader_plan(self, rec: PrefillRoom, t: HeadTransfer, peer: DecodePeer, meta: RequestMeta) -> RequestPlan:
        """The reader's ``RequestPlan``: built at its first chunk, then extended by the pages
        handed over since (only those are checked). Decode chose the path: no staging window
        means direct writes (or per-token ones, the benchmark baseline), or with ``fused``
        one pool -> pool copy per chunk (this process maps the reader's pool). Without a
        window, a pair whose bytes are not contiguous is written row by row (the decode's
        cost rule found that cheaper than staging, or the per-token benchmark baseline)."""
        t0 = time.perf_counter()
        g, sel = self.config.geometry, selection(meta)
        plan = rec.readers.get(t.decode_rank)
        if plan is None:
            src, pages, total = self.placement, rec.src_pages, self._layout(rec)[1]
            if not sel.every:  # this reader's tokens, each read as a one-token page
                src = TokenSelection.row_view(self.placement)
                pages = sel.rows(rec.src_pages, g.page_size, 0, sel.count(self._covered(rec)))
                total = sel.count(total)
            path = self._writer_path(rec, t, peer, meta, src)
            plan = RequestPlan.build(
                t,
                src,
                peer.placement,
                pages,
                meta.dst_page_ids,
                num_tokens=total,
                path=path,
                mapping=peer.mapping,
            )
            if meta.staging_offset < 0 and plan.staged:  # (a fused plan is never staged)
                raise TransferFailedError(
                    f"decode rank {t.decode_rank} asked for direct writes but the bytes "
                    f"are not contiguous ({plan.reason})",
                    rec.room,
                )
        elif sel.every:
            if len(plan.src_pages) < len(rec.src_pages):
                plan = plan.extend(rec.src_pages[len(plan.src_pages) :])
        elif len(plan.src_pages) < (want := sel.count(self._covered(rec))):
            plan = plan.extend(sel.rows(rec.src_pages, g.page_size, len(plan.src_pages), want))
        rec.readers[t.decode_rank] = plan
        rec.timings["plan"] += time.perf_counter() - t0
        return plan

    def _writer_path(
        self, rec: PrefillRoom, t: HeadTransfer, peer: DecodePeer, meta: RequestMeta, src: RankPlacement
    ) -> DataPath:
        """The path the decode chose for this pair: fused (its pool is mapped here), staged
        (it lent a window), else direct, or row by row where the bytes are not contiguous."""
        if meta.fused:
            if not peer.mapping.mapped:
                raise TransferFailedError(
                    f"decode rank {t.decode_rank} asked for fused writes, but its KV pool is not "
                    f"mapped here ({peer.mapping.note})",
                    rec.room,
                )
            return DataPath.FUSED
        if meta.staging_offset >= 0:
            return DataPath.STAGED
        if self.config.data_path == DataPath.PER_TOKEN:
            return DataPath.PER_TOKEN
        if contiguous_layout(t, src, peer.placement) is None and per_token_possible(src, peer.placement):
            return DataPath.PER_TOKEN  # a strided pair without a window: the decode chose rows
        return DataPath.DIRECT

    def _write_direct(
        self, rec: PrefillRoom, plan: RequestPlan, peer: DecodePeer, start: int, stop: int, layers: tuple[int, int]
    ) -> list[Ticket]:
        """Post the direct writes of tokens [start, stop) x layers [layers[0], layers[1]):
        the page runs of one buffer are the same for every layer, so a layer group posts
        the runs of its own buffers only (one write per region pair, as for all layers)."""
        t0 = time.perf_counter()
        t = plan.transfer
        g = self.config.geometry
        pair = plan.direct(start, stop)
        groups: dict[tuple[int, int], list[np.ndarray]] = collections.defaultdict(list)
        nbytes = 0
        for b in range(g.num_buffers):
            if not layers[0] <= RequestPlan.buffer_layer(g, b) < layers[1]:
                continue
            ops = pair.buffer_ops(b)
            nbytes += int(ops[:, 2].sum()) if len(ops) else 0
            if len(ops):
                mine, theirs = self._live_pool.locs[b], peer.locs[b]
                shifted = ops + np.array([mine.offset, theirs.offset, 0], dtype=np.int64)
                groups[(mine.region, theirs.region)].append(shifted)
        rec.timings["plan"] += time.perf_counter() - t0
        tickets = []
        for (lr, rr), parts in groups.items():
            ops = np.concatenate(parts)
            tickets.append(
                self._live_transport.write(
                    self._live_pool.regions[lr], peer.regions[rr], ops[:, 0], ops[:, 1], ops[:, 2]
                )
            )
            rec.ops += len(ops)
            rec.reader_ops[t.decode_rank] += len(ops)
        rec.bytes += nbytes
        rec.pool_read_bytes += nbytes
        rec.reader_bytes[t.decode_rank] += nbytes
        return tickets

    def _write_staged(
        self,
        rec: PrefillRoom,
        group: list[_Reader],
        start: int,
        stop: int,
        ready: Synchronizable | None = None,
        hold_last: bool = False,
        layers: tuple[int, int] | None = None,
    ) -> dict[int, _Slot]:
        """Stream tokens [start, stop) of ``layers`` (default: all) through the staging
        slots of ``group``: one reader, or readers that need the same head slice of the
        same pages (replicas of a head), which share each gather (fan-out). Gather step k+1
        while step k is on the wire; announce each reader's slot once its write completed.
        Each gather is ordered after ``ready`` (the chunk's producer event). With
        ``hold_last`` (the request's last chunk) the last step's slots are returned
        unannounced, by reader: ``_finish`` lands them and announces them with
        ``TransferDone``."""
        layers = layers or (0, self.config.geometry.num_layers)
        remotes, slot_bytes = [], []
        for r in group:
            if r.meta.staging_region is None:  # RequestMeta refuses a staged window without one
                raise TransferFailedError(
                    f"decode rank {r.plan.transfer.decode_rank} named no staging region", rec.room
                )
            remotes.append(r.peer.staging_segment(self._live_transport, r.meta.staging_region))
            slot_bytes.append(r.meta.staging_capacity_bytes // STAGING_SLOTS)
        per_token = group[0].plan.nbytes(0, 1, layers)  # a layer group's tokens: more of them per slot
        step = min(slot_bytes) // per_token
        if step < 1:
            raise TransferFailedError(
                f"decode staging slot of {min(slot_bytes)} B cannot hold one token ({per_token} B)", rec.room
            )
        inflight: collections.deque[list[_Slot]] = collections.deque()
        a = start
        try:
            while a < stop or inflight:
                if a < stop and len(inflight) < STAGING_SLOTS:
                    b = min(stop, a + step)
                    inflight.append(self._post_step(rec, group, remotes, slot_bytes, a, b, ready, layers))
                    a = b
                    continue
                if hold_last and a >= stop and len(inflight) == 1:
                    return {slot.reader: slot for slot in inflight.popleft()}
                slots = inflight.popleft()
                for i, slot in enumerate(slots):
                    try:
                        self._complete_slot(rec, slot)
                    except BaseException:
                        inflight.appendleft(slots[i + 1 :])  # the handler below drops them
                        raise
        except BaseException:
            self._drop_slots(rec, [slot for slots in inflight for slot in slots])
            raise
        return {}

    def _drop_slots(self, rec: PrefillRoom, slots) -> None:
        """Give up slots of a failing chunk: let their writes end (the bytes may still be
        read from local staging), free their local staging, forget their reader slots."""
        for slot in slots:
            self._settle([slot.ticket])
            if slot.local is not None:
                slot.local.release()
            with rec.cond:
                rec.inflight[slot.reader].discard(slot.remote_off)

    def _post_step(
        self,
        rec: PrefillRoom,
        group: list[_Reader],
        remotes: list[RemoteRegion],
        slot_bytes: list[int],
        a: int,
        b: int,
        ready: Synchronizable | None,
        layers: tuple[int, int],
    ) -> list[_Slot]:
        """Gather tokens [a, b) once and start moving them into a slot of every reader of
        ``group``. One reader whose staging the transport maps here (``local`` shared
        memory, CUDA IPC) on the KV buffers' device gets the gather straight into its slot:
        no local staging and no transport write. Otherwise the gather goes into local
        staging and ``write()`` moves it to each reader's slot (freed after the last)."""
        t0 = time.perf_counter()
        plan = group[0].plan
        piece = plan.gather_slice(a, b)  # a view of the plan's pages: nothing is planned again
        nbytes = plan.nbytes(a, b, layers)
        t_planned = time.perf_counter()
        readers = [r.plan.transfer.decode_rank for r in group]
        acquired: list[int] = []
        local: _Local | None = None
        tickets: list[Ticket] = []
        try:
            for reader, r, size in zip(readers, group, slot_bytes):
                acquired.append(self._acquire_slot(rec, reader, r.meta, size))
            if len(group) == 1:
                with self._live_transport.remote_view(remotes[0], acquired[0], nbytes) as view:
                    if view is not None and self._gatherable(view):
                        t1 = time.perf_counter()
                        self._gather(plan, piece, view, ready, layers)
                        tickets.append(Ticket.completed(f"room {rec.room}: gathered into the reader's slot"))
            if not tickets:
                staging = self._live_staging
                local = _Local(staging, self._alloc_local(rec, nbytes), len(group))
                t1 = time.perf_counter()
                self._gather(plan, piece, staging.view(local.offset, nbytes), ready, layers)
                loc = staging.locate(local.offset)  # the segment region holding the gather
                region = self._open(loc.region, "staging region")
                for remote, remote_off in zip(remotes, acquired):
                    tickets.append(self._live_transport.write(region, remote, [loc.offset], [remote_off], [nbytes]))
        except BaseException:
            for ticket in tickets:  # posted writes may still read the local staging
                if ticket.poll() is TicketState.PENDING:
                    try:
                        ticket.wait(self.config.transfer_timeout_s)
                    except KVXferError:
                        pass
            if local is not None:
                local.release(len(group))
            with rec.cond:
                for reader, remote_off in zip(readers, acquired):
                    rec.inflight[reader].discard(remote_off)
            raise
        t2 = time.perf_counter()
        rec.timings["plan"] += t_planned - t0
        rec.timings["wait"] += t1 - t_planned  # flow control: a free staging slot on both sides
        rec.timings["gather"] += t2 - t1
        rec.pool_read_bytes += nbytes  # once, whatever the number of readers
        return [
            _Slot(ticket, local, remote_off, nbytes, a, b, t2, layers, reader, r.peer.endpoint)
            for ticket, remote_off, reader, r in zip(tickets, acquired, readers, group)
        ]

    def _gatherable(self, view: object) -> bool:
        """Whether the gather kernel may write ``view`` in place: a view on another device
        than the KV buffers may not (the reader's slot mapped over CUDA IPC on its GPU while
        this pool sits on another; the kernel refuses ``out`` on a foreign device). Those
        slots go through local staging and ``write()``, which copies across devices."""
        device = getattr(view, "device", None)
        if device is None:
            return True
        import torch

        return torch.device(device) == self._live_pool.buffers[0].device

    def _gather(
        self,
        plan: RequestPlan,
        piece: KVSlice,
        out,
        ready: Synchronizable | None = None,
        layers: tuple[int, int] | None = None,
    ) -> None:
        """Gather ``piece`` of ``layers`` (default: all) into ``out`` on the copy stream,
        after ``ready``; returns once the bytes are in ``out`` (an event wait: the model's
        streams are not synchronized)."""
        from sglang_kvxfer import ops

        k, v = plan.layer_buffers(self._live_pool.buffers, layers)
        self.copy_stream.run(lambda: ops.gather_kv_heads(k, v, piece, out=out), ready)

    def _land_slot(self, rec: PrefillRoom, entry: _Slot, counted: bool = False) -> None:
        """Wait for the slot's write, release its local staging and count it (unless
        ``counted`` already)."""
        try:
            entry.ticket.wait(self.config.transfer_timeout_s)
        except BaseException:
            with rec.cond:
                rec.inflight[entry.reader].discard(entry.remote_off)
            raise
        finally:
            if entry.local is not None:
                entry.local.release()
        rec.timings["wire"] += time.perf_counter() - entry.t_posted
        if not counted:
            self._count_slot(rec, entry)

    @staticmethod
    def _count_slot(rec: PrefillRoom, entry: _Slot) -> None:
        ops = staged_op_count(entry.nbytes)  # one bulk move into the reader's slot (a write, or in place)
        rec.bytes += entry.nbytes
        rec.ops += ops
        rec.reader_bytes[entry.reader] += entry.nbytes
        rec.reader_ops[entry.reader] += ops

    def _complete_slot(self, rec: PrefillRoom, entry: _Slot) -> None:
        self._land_slot(rec, entry)
        t3 = time.perf_counter()
        self._live_control.send(
            entry.endpoint,
            ChunkReady(
                room=rec.room,
                tp_rank=self.tp_rank,
                token_start=entry.a,
                num_tokens=entry.b - entry.a,
                staging_offset=entry.remote_off,
                chunk_bytes=entry.nbytes,
                layer_start=entry.layers[0],
                num_layers=entry.layers[1] - entry.layers[0],
            ),
        )
        rec.timings["notify"] += time.perf_counter() - t3

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
                    raise TransferTimeoutError(
                        f"room {rec.room}: decode rank {reader} returned no staging "
                        f"slot within {self.config.transfer_timeout_s} s"
                    )
                rec.cond.wait(min(left, 0.1))

    def _alloc_local(self, rec: PrefillRoom, nbytes: int) -> int:
        deadline = time.monotonic() + self.config.transfer_timeout_s
        while True:
            off = self._live_staging.alloc(nbytes)
            if off is not None:
                return off
            if rec.state.is_terminal:
                raise TransferFailedError(rec.state.reason or "request ended", rec.room)
            if time.monotonic() > deadline:
                raise TransferTimeoutError(
                    f"room {rec.room}: no {nbytes} B free in the prefill staging "
                    f"arena (cap {self._live_staging.cap_bytes} B, KVXFER_STAGING_BYTES)"
                )
            time.sleep(0.001)

    def _finish(
        self, rec: PrefillRoom, readers, aux: bytes, held: dict[int, _Slot], early: dict[int, list[Ticket]]
    ) -> None:
        """Land each staged reader's last slot (``held``, taken over one by one), then send
        every reader its ``TransferDone``, carrying that slot. A slot whose write the reader
        can check by receipt, and the direct writes in ``early``, are not waited for first:
        their receipts ride on the notice, and they are waited for after it, before this
        side's Success (a failure then fails the room here, and the reader's transport
        refuses those receipts too)."""
        chunks: dict[int, StagedChunk] = {}
        layer_spans: dict[int, tuple[int, int]] = {}  # reader -> its last chunk's (layer_start, num_layers)
        receipts = {r: [rc for t in ts for rc in t.receipts or ()] for r, ts in early.items()}
        deferred: list[_Slot] = []  # slots taken over, landed after the notices
        try:
            for t in readers:
                slot = held.pop(t.decode_rank, None)
                if slot is None:
                    continue
                deferred.append(slot)
                if self._receipted(pending_or_raise([slot.ticket])):
                    self._count_slot(rec, slot)
                    receipts.setdefault(t.decode_rank, []).extend(slot.ticket.receipts or ())
                else:
                    self._land_slot(rec, deferred.pop())
                chunks[t.decode_rank] = StagedChunk(
                    token_start=slot.a,
                    num_tokens=slot.b - slot.a,
                    staging_offset=slot.remote_off,
                    chunk_bytes=slot.nbytes,
                )
                layer_spans[t.decode_rank] = (slot.layers[0], slot.layers[1] - slot.layers[0])
            timings = {k: round(v, 6) for k, v in rec.timings.items()}
            now = rec.marks["done"] = time.monotonic()  # before the notices: they may land at once
            for key, mark in zip((SINCE_FIRST_BYTE, SINCE_LAST_CHUNK), rec.window()):
                if mark is not None:  # ages, so the decode rank can place the window on its own clock
                    timings[key] = max(0.0, now - mark)
            for t in readers:
                meta = rec.metas[t.decode_rank]
                self._live_control.send(
                    self._peer_of(meta).endpoint,
                    TransferDone(
                        room=rec.room,
                        tp_rank=self.tp_rank,
                        total_bytes=rec.reader_bytes[t.decode_rank],
                        num_ops=rec.reader_ops[t.decode_rank],
                        aux_payload=aux,
                        timings=timings,
                        last_chunk=chunks.get(t.decode_rank),
                        last_layer_start=layer_spans.get(t.decode_rank, (0, 0))[0],
                        last_num_layers=layer_spans.get(t.decode_rank, (0, 0))[1],
                        receipts=tuple(receipts.get(t.decode_rank, ())),
                        positions=rec.positions if rec.sparse else None,
                    ),
                )
            while deferred:
                self._land_slot(rec, deferred.pop(), counted=True)
            if early:
                wait_all([t for ts in early.values() for t in ts], self.config.transfer_timeout_s)
        except BaseException:
            self._drop_slots(rec, deferred)
            raise
        with self._lock:
            if rec.state.is_terminal:
                return
            rec.state.handle(Event.TRANSFER_DONE, time.monotonic())
            rec.finished_at = time.monotonic()
        self._request_ended(rec)
