"""Decode room records and prefill-group records.

Owns ``GroupStatus``, ``PrefillGroup`` (what one bootstrap said about a prefill group, and
this rank's registration with each of its candidate ranks) and ``DecodeRoom`` (one request
on a decode rank: its pages, writers and their ``RequestPlan``s, staging windows, metrics).
Must not: send messages or touch memory; ``decode.py`` drives these records.
"""

from __future__ import annotations

import enum
import threading

import numpy as np

from sglang_kvxfer.engine.manager import Peer, Worker
from sglang_kvxfer.geometry import RankPlacement
from sglang_kvxfer.metrics import RequestRecord
from sglang_kvxfer.planning import EVERY_TOKEN, HeadTransfer, PoolMapping, RequestPlan
from sglang_kvxfer.protocol.messages import BootstrapReply
from sglang_kvxfer.protocol.state import KVPoll, RequestState

__all__ = ["GroupStatus", "PrefillGroup", "DecodeRoom"]


class GroupStatus(str, enum.Enum):
    """Where this decode rank stands with one prefill group. A ``str`` enum:
    ``prefill_group_status`` callers compare it with the plain names."""

    RESOLVING = "resolving"  # asking the bootstrap
    REGISTERING = "registering"  # registered with the candidates, waiting for their replies
    READY = "ready"  # every candidate accepted this rank
    FAILED = "failed"  # see PrefillGroup.error; the next request looks it up again

    def __str__(self) -> str:
        return self.value


class PrefillGroup:
    """What one bootstrap told us, and our registration with each candidate prefill rank."""

    def __init__(self, address: str):
        self.address = address
        self.status = GroupStatus.RESOLVING  # -> REGISTERING -> READY | FAILED
        self.error = ""
        self.last = ""  # while resolving: why the latest lookup got no ready group
        self.reply: BootstrapReply | None = None
        self.placements: dict[int, RankPlacement] = {}
        self.peers: dict[int, Peer] = {}  # prefill tp_rank -> peer (its endpoint and session)
        self.acks: dict[int, bool] = {}
        # prefill tp_rank -> whether it maps this rank's KV pool (its RegisterReply): fused path
        self.mappings: dict[int, PoolMapping] = {}
        # (room, Abort | TransferFailed, reason) of rooms that ended before the group's ranks were
        # known: sent once they are (ready, or refusing this rank), even if the room is gone by then
        self.untold: list[tuple[int, type, str]] = []


class DecodeRoom:
    """One request on this decode rank."""

    def __init__(self, room: int, state: RequestState, group: str):
        self.room = room
        self.state = state
        self.ended = threading.Event()  # set when the state becomes Success or Failed
        state.on_terminal(self.ended.set)
        self.group = group
        self.pages: np.ndarray | None = None
        self.num_tokens = 0  # tokens this rank receives (of a DCP rank: its own share)
        self.request_tokens = 0  # the whole request's length after the prefix (RequestMeta.num_tokens)
        self.selection = EVERY_TOKEN  # which of them this rank holds (decode context parallel)
        self.prefix_tokens = 0  # tokens the decode already holds (decode radix cache); not sent
        self.aux_slot = -1
        # the writers pick which of ``pages`` they write (RequestMeta.sparse) and name them in
        # TransferDone.positions; every writer of the room names the same ones (``positions``)
        self.sparse = False
        self.positions: np.ndarray | None = None
        self.meta_pending = False
        self.meta_sent = False
        # RoomWatch (SGLang's prefill_complete policy): the candidate prefill ranks are asked
        # to say when their forward of the room finished; ready once each of them said so
        self.watch = False
        self.watch_sent = False
        self.ready_from: set[int] = set()
        self.prefill_ready = False
        self.dispatching = False  # _dispatch_meta is planning this room (outside the lock)
        self.dispatch_queued = False  # a dispatch of it waits on a worker
        self.writers: dict[int, HeadTransfer] = {}  # prefill rank -> its heads
        self.plans: dict[int, RequestPlan] = {}  # prefill rank -> the pair's plan (scatter slices)
        self.windows: dict[int, tuple[int, int]] = {}  # prefill rank -> (arena offset, capacity)
        # Staged writer -> int64 [num_layers]: per layer, the first token not scattered yet.
        # Chunks of each layer arrive in token order, so a chunk must start where its layers
        # stand (a repeat or a gap fails the room) and a writer is done only at num_tokens.
        self.layer_tokens: dict[int, np.ndarray] = {}
        self.candidates: tuple[int, ...] = ()
        self.aux_payload = b""
        self.writer_aux: dict[int, bytes] = {}  # prefill rank -> the aux payload of its TransferDone
        self.bytes = 0
        self.timings: dict[str, float] = {}
        self.first_notice: float | None = None
        self.last_notice: float | None = None
        self.finished_at: float | None = None
        self.waiting_for = ""
        self.ops = 0
        self.marks: dict[str, float] = {}  # transfer-window estimates on this clock (metrics.py)
        self.queued = 0  # tasks of this room handed to a worker and not finished yet
        self.worker: Worker | None = None  # where they run, in order (decode.py picks it)
        # Held while a scatter reads this room's staging windows; freeing them takes it too,
        # so a window is never lent again while it is still being read.
        self.copy_lock = threading.Lock()

    def record(self, tp_rank: int) -> RequestRecord:
        ok = self.state.poll is KVPoll.Success
        return RequestRecord(
            room=self.room,
            side="decode",
            tp_rank=tp_rank,
            ok=ok,
            reason=self.state.reason or "",
            bytes=self.bytes,
            ops=self.ops,
            phases=dict(self.timings),
            first_byte_ready=self.marks.get("first_byte_ready"),
            last_chunk_ready=self.marks.get("last_chunk_ready"),
            last_notice=self.finished_at if ok else None,
            failure_kind="aborted" if "aborted" in self.marks else "",
        )
