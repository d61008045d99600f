"""Prefill room records and the room table with its cap.

Owns ``PrefillRoom`` (one request on a prefill rank: its decode metadata, its TP plan and
per-reader ``RequestPlan``s, pending chunks, flow-control slots and metrics), ``Chunk``,
and ``PrefillRoomTable``, the part of ``PrefillManager`` that creates, attaches, releases
and forgets rooms: a frame may create a record before any sender holds the room
(``_create_unattached``), at most ``MAX_UNATTACHED_ROOMS`` of them, and a finished room
nobody holds is forgotten ``ROOM_RETENTION_S`` after it ended.
Must not: send messages, touch the transport, or decide who may claim a room (that is
``prefill.py``'s metadata handling).
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from sglang_kvxfer.engine.manager import RankBase
from sglang_kvxfer.metrics import RequestRecord
from sglang_kvxfer.planning import RequestPlan, TPPlan
from sglang_kvxfer.protocol.messages import RequestMeta
from sglang_kvxfer.protocol.state import KVPoll, RequestState

__all__ = ["Chunk", "PrefillRoom", "PrefillRoomTable"]


class Synchronizable(Protocol):
    """What ``Chunk.ready`` is (e.g. a ``torch.cuda.Event``)."""

    def synchronize(self) -> None: ...


@dataclass
class Chunk:
    """Pages a sender handed over, in request order (``ready``: see ``KVSender.send``).

    ``layers``: the layers ``[start, stop)`` of the chunk's tokens that are final (layer-wise
    streaming); None: every layer. Layer groups of one token chunk after its first carry no
    pages (they name the tokens the first group opened)."""

    pages: np.ndarray
    last: bool
    aux: bytes
    ready: Synchronizable | None = None  # the pages' KV is written once its synchronize() returns
    layers: tuple[int, int] | None = None
    # the indices into the decode's page list these pages go to (a sparse room: the writer
    # holds only some of the request's pages); None: the pages after the previous chunk's
    positions: np.ndarray | None = None


class PrefillRoom:
    """One request on this prefill rank."""

    def __init__(self, room: int, state: RequestState):
        self.room = room
        self.state = state
        self.ended = threading.Event()  # set when the state becomes Success or Failed
        state.on_terminal(self.ended.set)
        self.metas: dict[int, RequestMeta] = {}  # decode rank -> its metadata (its claim on the room)
        # decode rank -> the session that watches the room (RoomWatch: it allocates only once
        # this rank's forward of the room finished, which ``prefill_complete`` marks)
        self.watchers: dict[int, str] = {}
        self.prefill_complete = False
        self.expected: tuple[int, ...] | None = None
        self.plan: TPPlan | None = None
        self.readers: dict[int, RequestPlan] = {}  # decode rank -> this pair's plan (data path)
        self.num_tokens: int | None = None
        self.prefix_tokens: int | None = None  # the decode's prefix (not sent), with the first RequestMeta
        self.src_pages = np.zeros(0, dtype=np.int64)
        # RequestMeta.sparse (the same from every decode rank): this rank writes the pages it
        # holds, each at the position in the decode's page list that send(positions=) names
        self.sparse = False
        self.positions = np.zeros(0, dtype=np.int64)  # of src_pages, in a sparse room
        self.pending: collections.deque[Chunk] = collections.deque()
        self.scheduled = False
        self.tokens_sent = 0
        self.inflight: dict[int, set[int]] = collections.defaultdict(set)  # reader -> slot offsets
        self.cond = threading.Condition()
        self.bytes = 0
        self.ops = 0
        self.pool_read_bytes = 0  # read from this rank's pool: a fan-out slice counts once
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
        return RequestRecord(
            room=self.room,
            side="prefill",
            tp_rank=tp_rank,
            ok=self.state.poll is KVPoll.Success,
            reason=self.state.reason or "",
            bytes=self.bytes,
            ops=self.ops,
            pool_read_bytes=self.pool_read_bytes,
            phases=dict(self.timings),
            first_byte_ready=first,
            last_chunk_ready=last,
            last_notice=self.marks.get("done"),
            failure_kind="aborted" if "aborted" in self.marks else "",
        )


class PrefillRoomTable(RankBase[PrefillRoom]):
    """Room bookkeeping of ``PrefillManager`` (a mixin over ``RankBase``: it uses
    ``self._lock``, ``self._rooms``, ``new_state`` and ``security_event``)."""

    MAX_UNATTACHED_ROOMS = 4096  # records created by frames before a sender holds the room
    ROOM_RETENTION_S = 60.0  # a finished room nobody holds is forgotten after this
    MAX_FAILED_ROOMS = 4096  # failed rooms remembered after they were forgotten (their reason)

    _num_unattached: int  # set by PrefillManager.__init__

    def _waiting_for(self, rec: PrefillRoom, poll: KVPoll) -> str:
        if poll is not KVPoll.Bootstrapping:
            return ""
        if not rec.metas:
            return "no decode rank sent this room's metadata"
        if rec.expected is not None:
            return f"metadata from decode ranks {sorted(rec.metas)} of {list(rec.expected)}"
        return f"metadata from decode ranks {sorted(rec.metas)}"

    # Failed rooms already forgotten: room -> (reason, when). A decode whose metadata comes
    # after the room failed and was released here is told the reason at once instead of
    # waiting for its own deadline (kept for the decode's waiting deadline, at most
    # MAX_FAILED_ROOMS of them, oldest dropped first).
    _failed_rooms: collections.OrderedDict[int, tuple[str, float]]

    def _create_unattached(self, room: int) -> PrefillRoom | None:
        """A record for a room no sender holds yet (its metadata or abort came first), or None
        when ``MAX_UNATTACHED_ROOMS`` of them exist (call with the lock held). They end by
        their deadline and are forgotten ``ROOM_RETENTION_S`` later, or taken by a sender."""
        if self._num_unattached >= self.MAX_UNATTACHED_ROOMS:
            self.security_event(
                "room_cap", "no record for room %d: %d rooms wait for a sender already", room, self._num_unattached
            )
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
            self._failed_rooms.pop(room, None)  # a new request under this id
            return rec

    def _forget(self, room: int) -> None:
        rec = self._rooms.pop(room, None)
        if rec is None:
            return
        if rec.unattached:
            self._num_unattached -= 1
        if rec.state.poll is KVPoll.Failed:
            self._failed_rooms[room] = (rec.state.reason or "the request failed", time.monotonic())
            self._failed_rooms.move_to_end(room)
            while len(self._failed_rooms) > self.MAX_FAILED_ROOMS:
                self._failed_rooms.popitem(last=False)

    def failed_reason(self, room: int) -> str | None:
        """Why ``room`` failed here, if it failed and was forgotten since (call with the
        lock held); None otherwise."""
        entry = self._failed_rooms.get(room)
        return None if entry is None else entry[0]

    def release(self, room: int) -> None:
        """Forget a room (the sender is done with it)."""
        with self._lock:
            rec = self._rooms.get(room)
            if rec is not None and rec.state.is_terminal:
                self._forget(room)
            elif rec is not None:
                rec.sender_attached = False

    def _forget_stale(self, now: float) -> None:
        """Forget finished rooms nobody holds a sender for (I/O thread, each tick)."""
        with self._lock:
            stale = [
                r
                for r, rec in self._rooms.items()
                if rec.finished_at is not None
                and not rec.sender_attached
                and now - rec.finished_at > self.ROOM_RETENTION_S
            ]
            for r in stale:
                self._forget(r)
            keep_s = max(self.ROOM_RETENTION_S, self.config.waiting_timeout_s)
            while self._failed_rooms:
                room, (_, when) = next(iter(self._failed_rooms.items()))
                if now - when <= keep_s:
                    break
                del self._failed_rooms[room]
