"""Every control message of the engine, as a frozen, slotted, self-validating dataclass.

Owns the message types and the rules across their fields (``tp_rank < tp_size``, a
direct-path pair has no staging window, ...). Field types say what each field may hold
(see ``fields.py``); a bad value raises ``LocalProtocolError`` naming the message, the field
and the value. The codec (``codec.py``) is the only place that turns these into bytes.

Must not: open sockets, start threads, read clocks, import zmq or torch.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Annotated

import numpy as np

from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.protocol.fields import (
    INT32_MAX,
    INT64_MAX,
    MAX_AGENT_DESCRIPTOR_BYTES,
    MAX_AUX_PAYLOAD_BYTES,
    MAX_ENDPOINT_CHARS,
    MAX_KV_REGIONS,
    MAX_NAME_CHARS,
    MAX_REASON_CHARS,
    MAX_RECEIPTS,
    MAX_REGION_DESCRIPTOR_BYTES,
    MAX_ROOM_QUERY,
    MAX_TIMINGS,
    MAX_TP_SIZE,
    UINT64_MAX,
    Blob,
    Flag,
    Geometry,
    Int,
    ListOf,
    Maybe,
    Nested,
    Number,
    PageIds,
    Record,
    Side,
    SideKind,
    Text,
    Timings,
    dataclass_transform,
    record,
)

__all__ = [
    "Message",
    "MESSAGE_TYPES",
    "PrefillRankInfo",
    "PrefillRegister",
    "PrefillLeave",
    "RoomRoute",
    "RoomQuery",
    "BootstrapQuery",
    "BootstrapReply",
    "DecodeRegister",
    "RegisterReply",
    "RequestMeta",
    "ChunkReady",
    "ChunkAck",
    "StagedChunk",
    "TransferDone",
    "TransferFailed",
    "Abort",
    "Heartbeat",
]

# -- field types (name: Annotated[python type, how it is checked]) -------------------------
Room = Annotated[int, Int(0, UINT64_MAX)]  # SGLang's bootstrap_room
TpSize = Annotated[int, Int(1, MAX_TP_SIZE)]
TpRank = Annotated[int, Int(0, MAX_TP_SIZE - 1)]
DpSize = Annotated[int, Int(1, MAX_TP_SIZE)]  # prefill attention-DP groups behind one bootstrap
DpRank = Annotated[int, Int(0, MAX_TP_SIZE - 1)]
PpSize = Annotated[int, Int(1, MAX_TP_SIZE)]  # prefill pipeline-parallel stages (protocol 6)
PpRank = Annotated[int, Int(0, MAX_TP_SIZE - 1)]
CpSize = Annotated[int, Int(1, MAX_TP_SIZE)]  # prefill attention-CP ranks that send (protocol 11)
CpRank = Annotated[int, Int(0, MAX_TP_SIZE - 1)]
Rooms = Annotated[tuple[int, ...], ListOf(Int(0, UINT64_MAX), MAX_ROOM_QUERY)]  # protocol 9: RoomQuery
# protocol 9: (room, DP group) pairs of a RoomQuery's reply
RoomGroups = Annotated[tuple, ListOf(ListOf(Int(0, UINT64_MAX), 2, min_items=2), MAX_ROOM_QUERY)]
Count = Annotated[int, Int(0, INT64_MAX)]  # num_* and *_bytes
Port = Annotated[int, Int(0, 65535)]  # a TCP port; 0: none
Positive = Annotated[int, Int(1, INT64_MAX)]
OffsetOrNone = Annotated[int, Int(-1, INT64_MAX)]  # -1: not used
SlotOrNone = Annotated[int, Int(-1, INT32_MAX)]  # -1: no aux slot
Seq = Annotated[int, Int(0, UINT64_MAX)]
Seconds = Annotated[float, Number(0.0)]
Bool = Annotated[bool, Flag()]
SideField = Annotated[Side, SideKind()]
Name = Annotated[str, Text(MAX_NAME_CHARS, r"[!-~]+", "1 or more printable ASCII chars, no space")]
SessionId = Name
TransportName = Annotated[str, Text(32, r"[a-z][a-z0-9_]*", "a transport name like 'tcp' or 'mori'")]
Endpoint = Annotated[str, Text(MAX_ENDPOINT_CHARS, r"(tcp|ipc|inproc)://\S+", "a ZMQ endpoint like 'tcp://host:port'")]
HostId = Annotated[str, Text(128)]
Reason = Annotated[str, Text(MAX_REASON_CHARS, r"(?s).*\S.*", "a non-empty reason", cut=True)]
ErrorText = Annotated[str, Text(MAX_REASON_CHARS, cut=True)]
GeometryField = Annotated[KVGeometry, Geometry()]
MaybeGeometry = Annotated[KVGeometry | None, Maybe(Geometry())]
# Which of a rank's KV pools (protocol 6): "" the model's own, "draft" a speculative
# decoding draft model's, "state:<kind>[.<n>]" a component of the model's extra per-request
# state (SGLang's KVArgs.state_types: "state:swa", "state:mamba.1"); each has its own
# geometry and is moved by a manager of its own
STATE_POOL_PATTERN = r"state:[a-z][a-z0-9_]{0,15}(\.[0-9]{1,3})?"
KVPoolName = Annotated[
    str,
    Text(
        32,
        rf"(draft|{STATE_POOL_PATTERN})?",
        "'' (the model's KV pool), 'draft' (a draft model's) or 'state:<kind>[.<n>]' (extra per-request state)",
    ),
]
# the state pools a rank serves beside the model's (protocol 6: announced with its
# registration of the model's pool, like draft_geometry)
StatePools = Annotated[tuple[str, ...], ListOf(Text(32, STATE_POOL_PATTERN, "a state pool name like 'state:swa'"), 64)]
PageIdArray = Annotated[np.ndarray, PageIds()]
MaybePageIds = Annotated[np.ndarray | None, Maybe(PageIds())]
AgentDescriptor = Annotated[bytes, Blob(MAX_AGENT_DESCRIPTOR_BYTES, min_bytes=1)]
RegionDescriptor = Blob(MAX_REGION_DESCRIPTOR_BYTES, min_bytes=1)
KVRegions = Annotated[tuple[bytes, ...], ListOf(RegionDescriptor, MAX_KV_REGIONS, min_items=1)]
# (region index, byte offset) of each KV buffer, K_0..K_{L-1} then V_0..V_{L-1}
BufferLocs = Annotated[tuple, ListOf(ListOf(Int(0, INT64_MAX), 2, min_items=2), MAX_KV_REGIONS, min_items=1)]
MaybeRegion = Annotated[bytes | None, Maybe(RegionDescriptor)]
AuxPayload = Annotated[bytes, Blob(MAX_AUX_PAYLOAD_BYTES)]
# (connection id, frame number) of a write the reader's transport can check (Ticket.receipts)
Receipts = Annotated[tuple, ListOf(ListOf(Int(1, UINT64_MAX), 2, min_items=2), MAX_RECEIPTS)]
PhaseTimings = Annotated[Mapping[str, float], Timings(MAX_TIMINGS, Text(MAX_NAME_CHARS, r"[!-~]+", "a phase name"))]

MESSAGE_TYPES: dict[str, type[Message]] = {}


class Message(Record):
    """Base of the messages the codec carries; ``MESSAGE_TYPES`` maps wire tag -> class."""

    __slots__ = ()


_M = typing.TypeVar("_M", bound="Message")


@dataclass_transform(frozen_default=True, eq_default=False)
def message(cls: type[_M]) -> type[_M]:
    cls = record(cls)
    if cls.__name__ in MESSAGE_TYPES:
        raise TypeError(f"message type {cls.__name__} is defined twice")
    MESSAGE_TYPES[cls.__name__] = cls
    return cls


def _rank_below_size(msg: Record, rank_field: str = "tp_rank", size_field: str = "tp_size") -> None:
    rank, size = getattr(msg, rank_field), getattr(msg, size_field)
    if rank >= size:
        msg._bad(rank_field, f"={rank} must be < {size_field}={size}")


def _layers_fit(msg: Record) -> None:
    """``num_layers=0`` (every layer) comes with ``layer_start=0``."""
    start, num = getattr(msg, "layer_start"), getattr(msg, "num_layers")  # noqa: B009
    if num == 0 and start != 0:
        msg._bad("layer_start", f"={start} must be 0 when num_layers=0 (every layer)")


def _state_pools_valid(msg: Record, what: str) -> None:
    """``state_pools`` come with the model's pool only, each named once."""
    pools, pool = list(getattr(msg, "state_pools")), getattr(msg, "kv_pool")  # noqa: B009
    if pool and pools:
        msg._bad("state_pools", f"must be empty in {what} kv_pool={pool!r}")
    if len(set(pools)) != len(pools):
        msg._bad("state_pools", f"names a pool twice: {pools}")


# -- bootstrap ------------------------------------------------------------------------------
@message
class PrefillRegister(Message):
    """Prefill rank -> bootstrap, once per process start (a new ``session`` = a restart)."""

    engine_version: Name
    session: SessionId
    tp_size: TpSize
    tp_rank: TpRank
    endpoint: Endpoint  # the rank's PULL inbox
    geometry: GeometryField
    transport: TransportName
    # attention DP (SGLang --enable-dp-attention): this rank's DP group, each group an
    # attention-TP group of tp_size ranks with its own pools
    dp_rank: DpRank = 0
    dp_size: DpSize = 1
    # protocol 6: which pool this registration is for; a registration of the model's pool
    # ("") names the geometry of the draft-model pool the same rank registers under
    # kv_pool="draft" (None: it has none), so a decode knows at once whether one exists.
    kv_pool: KVPoolName = ""
    draft_geometry: MaybeGeometry = None
    # protocol 6: likewise the state pools (extra per-request state, kv_pool="state:...") the
    # same rank registers, in the order its requests use them (empty: none)
    state_pools: StatePools = ()
    # protocol 6, pipeline parallelism (SGLang --pp-size): this rank's PP stage and the first
    # model layer its pool holds; the geometry's num_layers is the stage's layer count, so the
    # stage holds layers [layer_start, layer_start + geometry.num_layers)
    pp_rank: PpRank = 0
    pp_size: PpSize = 1
    layer_start: Count = 0
    # protocol 9, attention DP: True when a request's DP group is bootstrap_room % dp_size
    # (SGLang's follow_bootstrap_room); False when the prefill's load balancer places requests
    # and registers each room's group with the bootstrap (``RoomRoute``)
    follows_room: Bool = True
    # protocol 10: the HTTP port of the server this rank belongs to (SGLang's --port), so a
    # decode can ask that server to compute a request again (0: not known)
    api_port: Port = 0
    # protocol 10, decode context parallel on the prefill (SGLang --dcp-size): rank r holds
    # the tokens t % dcp_size == r % dcp_size of a request (1: every token)
    dcp_size: TpSize = 1
    # protocol 11, prefill attention CP where every CP rank sends (SGLang's sharded CP): this
    # rank's CP rank of cp_size, each CP rank sending its share of a request's pages (cp_size
    # 1: one rank per attention-TP rank sends every page)
    cp_rank: CpRank = 0
    cp_size: CpSize = 1
    # protocol 12: the rank's pool holds every KV head of the model while it sends the heads
    # of TP rank tp_rank of tp_size (SGLang's CP-TP group sharing: prefill CP rank r holds the
    # whole KV and transfers as TP rank r of a CP-1 prefill)
    all_heads: Bool = False
    # protocol 14: the CP ranks hold a request's pages interleaved (SGLang's KV cache
    # sharding: logical page l on CP rank l % cp_size): each writes the pages it holds at the
    # positions of the decode's page list it names (RequestMeta.sparse)
    kv_sharded: Bool = False

    def _validate(self) -> None:
        _rank_below_size(self)
        _rank_below_size(self, "dp_rank", "dp_size")
        _rank_below_size(self, "pp_rank", "pp_size")
        _rank_below_size(self, "cp_rank", "cp_size")
        if self.kv_sharded and self.cp_size < 2:
            self._bad("kv_sharded", f"=True needs the pages sharded over cp_size >= 2 CP ranks, got {self.cp_size}")
        if self.kv_pool and self.draft_geometry is not None:
            self._bad("draft_geometry", f"must be None in a registration of kv_pool={self.kv_pool!r}")
        _state_pools_valid(self, "a registration of")
        if self.pp_size == 1 and self.layer_start:
            self._bad("layer_start", f"={self.layer_start} must be 0 without pipeline parallelism (pp_size=1)")


@message
class BootstrapQuery(Message):
    """Decode rank -> bootstrap: where are the prefill ranks of DP group ``dp_rank``, PP
    stage ``pp_rank``, CP rank ``cp_rank``? (request/reply)."""

    session: SessionId  # the asking decode process
    tp_rank: TpRank
    dp_rank: DpRank = 0
    kv_pool: KVPoolName = ""  # protocol 6: the pool asked about
    pp_rank: PpRank = 0  # protocol 6: the PP stage asked about
    cp_rank: CpRank = 0  # protocol 11: the CP rank asked about


@message
class PrefillLeave(Message):
    """Prefill rank -> bootstrap as it closes (protocol 9; request/reply): drop this
    session's registration of ``kv_pool`` as rank ``tp_rank`` of DP group ``dp_rank``, PP
    stage ``pp_rank``, CP rank ``cp_rank``. A registration of the same rank by another
    session (a restart) stays: a rank only ever takes back its own."""

    session: SessionId  # the leaving prefill process (the envelope's sender)
    tp_rank: TpRank
    dp_rank: DpRank = 0
    kv_pool: KVPoolName = ""
    pp_rank: PpRank = 0
    cp_rank: CpRank = 0  # protocol 11


@message
class RoomRoute(Message):
    """Prefill rank -> bootstrap (protocol 9; request/reply): DP group ``dp_rank`` serves
    ``room`` (SGLang's prefill load balancer placed it there, not at bootstrap_room %
    dp_size). The bootstrap takes it only from a registered rank of that group."""

    session: SessionId  # the registering prefill process (the envelope's sender)
    room: Room
    dp_rank: DpRank


@message
class RoomQuery(Message):
    """Decode rank -> bootstrap (protocol 9; request/reply): which DP group serves each of
    ``rooms``? The reply's ``room_groups`` lists those registered so far."""

    session: SessionId
    rooms: Rooms


@record
class PrefillRankInfo(Record):
    """One registered prefill rank, as the bootstrap reports it."""

    tp_rank: TpRank
    endpoint: Endpoint
    session: SessionId


@message
class BootstrapReply(Message):
    """Bootstrap -> decode. ``ready`` only once every prefill rank has registered; then
    ``ranks`` lists each of ``0..tp_size-1`` exactly once, in order. Not ready: ``reason``
    says why (e.g. "2 of 4 prefill ranks registered"), other fields hold what is known."""

    ready: Bool
    tp_size: Annotated[int, Int(0, MAX_TP_SIZE)]  # 0: not known yet
    geometry: MaybeGeometry
    transport: Annotated[str, Text(32)]
    ranks: Annotated[tuple[PrefillRankInfo, ...], ListOf(Nested(PrefillRankInfo), MAX_TP_SIZE)]
    reason: ErrorText
    dp_rank: DpRank = 0  # the DP group asked about; ranks are that group's
    dp_size: Annotated[int, Int(0, MAX_TP_SIZE)] = 0  # 0: no prefill rank registered yet
    dp_groups: Annotated[tuple[int, ...], ListOf(Int(0, MAX_TP_SIZE - 1), MAX_TP_SIZE)] = ()  # with a rank
    # protocol 6: the pool asked about; for the model's pool (""), the draft-model pool's
    # geometry the group's ranks announced (None: no draft model, or no rank registered yet)
    kv_pool: KVPoolName = ""
    draft_geometry: MaybeGeometry = None
    state_pools: StatePools = ()  # for the model's pool: the state pools the group's ranks announced
    # protocol 6, pipeline parallelism: the PP stage asked about, the stages behind the
    # bootstrap (0: no rank registered yet), the first layer of the asked stage's pool (its
    # geometry's num_layers is the stage's count) and the stages of the asked DP group that
    # have a registered rank
    pp_rank: PpRank = 0
    pp_size: Annotated[int, Int(0, MAX_TP_SIZE)] = 0
    layer_start: Count = 0
    pp_stages: Annotated[tuple[int, ...], ListOf(Int(0, MAX_TP_SIZE - 1), MAX_TP_SIZE)] = ()
    # protocol 9: whether the registered ranks place requests by bootstrap_room % dp_size
    # (``PrefillRegister.follows_room``), and the (room, DP group) pairs a ``RoomQuery`` asked
    # about that are registered (``RoomRoute``; a ``RoomRoute`` taken: its own pair)
    follows_room: Bool = True
    room_groups: RoomGroups = ()
    api_port: Port = 0  # protocol 10: the registered ranks' server's HTTP port (0: not known)
    dcp_size: TpSize = 1  # protocol 10: the registered ranks' --dcp-size
    # protocol 11: the CP rank asked about, and the registered ranks' cp_size (the CP ranks
    # that send, each its share of a request's pages; 1: one)
    cp_rank: CpRank = 0
    cp_size: CpSize = 1
    all_heads: Bool = False  # protocol 12: the registered ranks' pools hold every KV head
    kv_sharded: Bool = False  # protocol 14: the registered CP ranks hold the pages interleaved

    def _validate(self) -> None:
        if self.kv_pool and self.draft_geometry is not None:
            self._bad("draft_geometry", f"must be None in a reply about kv_pool={self.kv_pool!r}")
        _state_pools_valid(self, "a reply about")
        for name, size in (("dp_groups", self.dp_size), ("pp_stages", self.pp_size)):
            listed = list(getattr(self, name))
            if len(set(listed)) != len(listed) or listed != sorted(listed):
                self._bad(name, f"must list each once, in order, got {listed}")
            if size and any(d >= size for d in listed):
                self._bad(name, f"has an entry >= {name[:2]}_size={size}: {listed}")
        seen = [r.tp_rank for r in self.ranks]
        if len(set(seen)) != len(seen):
            self._bad("ranks", f"lists a tp_rank twice: {seen}")
        if self.tp_size and any(r >= self.tp_size for r in seen):
            self._bad("ranks", f"has tp_rank >= tp_size={self.tp_size}: {seen}")
        if not self.ready:
            return
        if self.reason:
            self._bad("reason", f"must be empty when ready, got {self.reason!r}")
        if self.tp_size == 0 or self.geometry is None or not self.transport:
            self._bad("ready", "is True but tp_size, geometry or transport is missing")
        if self.dp_rank >= max(self.dp_size, 1):
            self._bad("dp_rank", f"={self.dp_rank} must be < dp_size={self.dp_size} when ready")
        if self.pp_rank >= max(self.pp_size, 1):
            self._bad("pp_rank", f"={self.pp_rank} must be < pp_size={self.pp_size} when ready")
        if self.cp_rank >= self.cp_size:
            self._bad("cp_rank", f"={self.cp_rank} must be < cp_size={self.cp_size} when ready")
        if seen != list(range(self.tp_size)):
            self._bad("ranks", f"must list tp_rank 0..{self.tp_size - 1} once each, got {seen}")


# -- decode <-> prefill registration ---------------------------------------------------------
@message
class DecodeRegister(Message):
    """Decode rank -> each candidate prefill rank, once per (decode session, prefill rank).

    ``kv_regions`` holds the descriptors of the regions the KV buffers live in (one per
    buffer, or one for a pool allocated in one block); ``kv_buffer_locs`` gives, per buffer
    (K_0..K_{L-1}, V_0..V_{L-1}), its ``(region index, byte offset)``.
    ``aux_region`` is None when this rank has none. Staging memory is not registered
    here: it is allocated on first staged use, and each ``RequestMeta`` names the segment
    its window lies in.
    """

    engine_version: Name
    session: SessionId
    tp_size: TpSize
    tp_rank: TpRank
    endpoint: Endpoint
    geometry: GeometryField
    transport: TransportName
    agent_descriptor: AgentDescriptor
    kv_regions: KVRegions
    aux_region: MaybeRegion
    kv_buffer_locs: BufferLocs

    def _validate(self) -> None:
        _rank_below_size(self)
        if len(self.kv_buffer_locs) != self.geometry.num_buffers:
            self._bad(
                "kv_buffer_locs",
                f"has {len(self.kv_buffer_locs)} entries; the geometry has {self.geometry.num_buffers} KV buffers",
            )
        for i, (region, _) in enumerate(self.kv_buffer_locs):
            if region >= len(self.kv_regions):
                self._bad(
                    f"kv_buffer_locs[{i}]",
                    f"names region {region}; only {len(self.kv_regions)} region(s) are registered",
                )


@message
class RegisterReply(Message):
    """Prefill -> decode, answering ``DecodeRegister``. ``ok=False``: ``error`` says which
    geometry field differs, with both values. ``geometry`` lets decode check as well.

    ``pool_mapped`` (protocol 5): the prefill process maps every region of the decode's KV
    pool writable, on the device of its own pool, so it can write the decode's pages with
    one fused copy (the decode may then plan the ``fused`` path); ``pool_note`` says where
    it is mapped, or why not (quoted in the decode's plan reasons)."""

    session: SessionId  # the prefill process
    tp_rank: TpRank
    ok: Bool
    error: ErrorText
    geometry: GeometryField
    pool_mapped: Bool = False
    pool_note: ErrorText = ""

    def _validate(self) -> None:
        if self.ok and self.error:
            self._bad("error", f"must be empty when ok=True, got {self.error!r}")
        if not self.ok and not self.error.strip():
            self._bad("error", "must say why when ok=False")
        if self.pool_mapped and not self.ok:
            self._bad("pool_mapped", "must be False when ok=False (the registration was refused)")


# -- per request -----------------------------------------------------------------------------
@message
class RequestMeta(Message):
    """Decode -> each candidate prefill rank, per request: where to write.

    ``dst_page_ids``: read-only ``numpy.int32`` array ``[num_pages]`` of this decode rank's
    pages. ``elected``: whether this prefill rank writes to this decode rank for this room.
    ``staging_offset`` / ``staging_capacity_bytes``: this pair's window in the decode
    staging region ``staging_region`` (the descriptor of the staging segment holding it), or
    ``-1`` / ``0`` / None on the direct path. ``prefix_tokens`` (protocol 3): tokens of the
    request this decode already holds (decode radix cache); ``dst_page_ids`` and
    ``num_tokens`` cover only the tokens after them, and the prefill sends only those.
    ``fused`` (protocol 5): the elected writer writes this decode rank's pool pages itself
    with one pool -> pool copy per chunk (its ``RegisterReply`` said ``pool_mapped``): no
    staging window, no ``ChunkReady``, no scatter; its ``TransferDone`` counts as a direct
    writer's.
    ``token_stride`` / ``token_phase`` (protocol 10, decode context parallel): this decode
    rank holds only the tokens ``t`` (counted from the first token sent) with ``t %
    token_stride == token_phase``, packed in order into ``dst_page_ids``; ``num_tokens`` is
    still the whole request's length (every decode rank sends the same), so this rank's
    pages cover ``ceil((num_tokens - token_phase) / token_stride)`` tokens.
    ``sparse`` (protocol 14): the writer picks which of ``dst_page_ids`` it writes (it holds
    only some of the request's pages: SGLang's KV cache sharding) and names them in its
    ``TransferDone.positions``; direct or fused writes only (no staging window), every token.
    """

    room: Room
    session: SessionId  # the decode process
    tp_rank: TpRank
    tp_size: TpSize
    num_tokens: Count
    dst_page_ids: PageIdArray
    aux_slot: SlotOrNone
    elected: Bool
    staging_offset: OffsetOrNone
    staging_capacity_bytes: Count
    staging_region: MaybeRegion
    prefix_tokens: Count = 0
    fused: Bool = False
    token_stride: Positive = 1
    token_phase: Count = 0
    sparse: Bool = False

    def _validate(self) -> None:
        _rank_below_size(self)
        if self.sparse and (self.staging_offset != -1 or self.token_stride != 1):
            self._bad(
                "sparse",
                f"=True needs direct writes of every token (staging_offset={self.staging_offset}, "
                f"token_stride={self.token_stride})",
            )
        if self.token_phase >= self.token_stride:
            self._bad("token_phase", f"={self.token_phase} must be below token_stride={self.token_stride}")
        direct = self.staging_offset == -1
        if self.fused and not (direct and self.elected):
            self._bad(
                "fused",
                f"=True needs an elected writer without a staging window (elected={self.elected}, "
                f"staging_offset={self.staging_offset})",
            )
        if direct != (self.staging_capacity_bytes == 0):
            self._bad(
                "staging_capacity_bytes",
                f"={self.staging_capacity_bytes} does not fit staging_offset={self.staging_offset} "
                "(direct path: offset -1 and capacity 0; staged: offset >= 0 and capacity > 0)",
            )
        if direct != (self.staging_region is None):
            self._bad(
                "staging_region",
                f"must be {'None on the direct path' if direct else 'a region descriptor on the staged path'} "
                f"(staging_offset={self.staging_offset})",
            )


@message
class ChunkReady(Message):
    """Prefill -> decode, staged path: one chunk of ``num_tokens`` tokens from
    ``token_start`` sits at ``staging_offset`` in the pair's staging window.

    ``layer_start`` / ``num_layers`` (protocol 4, layer-wise streaming): the chunk holds
    layers ``[layer_start, layer_start + num_layers)`` of those tokens; ``num_layers=0``
    means every layer (the engine always sends both explicitly)."""

    room: Room
    tp_rank: TpRank  # the writing prefill rank
    token_start: Count
    num_tokens: Positive
    staging_offset: Count
    chunk_bytes: Positive
    layer_start: Count = 0
    num_layers: Count = 0

    def _validate(self) -> None:
        _layers_fit(self)


@message
class ChunkAck(Message):
    """Decode -> prefill, staged path: the chunk at ``staging_offset`` has been scattered,
    so the writer may reuse that staging slot (flow control for the two-slot window)."""

    room: Room
    tp_rank: TpRank  # the decode rank
    staging_offset: Count


@message
class RoomWatch(Message):
    """Decode -> each prefill rank of the room's group, before any ``RequestMeta``: this
    decode rank allocates the room's pages only once the prefill's forward of it finished
    (SGLang's ``--disaggregation-decode-allocation-policy prefill_complete``); tell it with
    ``PrefillReady``."""

    room: Room
    session: SessionId  # the decode process (the envelope's sender)
    tp_rank: TpRank  # the decode rank


@message
class PrefillReady(Message):
    """Prefill -> each decode rank that watches the room: this rank's forward of the room
    finished (its KV is in the pool), so the decode may allocate and send its metadata."""

    room: Room
    tp_rank: TpRank  # the prefill rank


@record
class StagedChunk(Record):
    """A staged chunk in the reader's staging window: ``num_tokens`` tokens from
    ``token_start`` at ``staging_offset`` (the fields of ``ChunkReady``; its layers are
    ``TransferDone.last_layer_start`` / ``last_num_layers``)."""

    token_start: Count
    num_tokens: Positive
    staging_offset: Count
    chunk_bytes: Positive


MaybeChunk = Annotated[StagedChunk | None, Maybe(Nested(StagedChunk))]


@message
class TransferDone(Message):
    """Prefill -> decode, once per writer after its transport reported every write done.

    ``last_chunk`` (staged path, protocol 3): the writer's last staging slot rides on this
    notice instead of a ``ChunkReady`` of its own; the reader scatters it, then counts the
    writer done, and returns no ``ChunkAck`` for it (the room ends). None otherwise.
    ``last_layer_start`` / ``last_num_layers`` (protocol 4): the layers of ``last_chunk``,
    as in ``ChunkReady`` (``last_num_layers=0``: every layer; both 0 without a chunk).
    ``receipts`` (protocol 8): the landing receipts (``Ticket.receipts``) of this writer's
    writes to the reader that were not acknowledged yet when it sent this notice (the
    transport has ``caps.receipts``); the reader counts the writer done, and scatters
    ``last_chunk``, only once its transport says they all landed. Empty: every write had
    completed.
    ``positions`` (protocol 14, a ``RequestMeta.sparse`` reader): the indices into the
    reader's ``dst_page_ids`` this writer wrote, increasing; None otherwise.
    """

    room: Room
    tp_rank: TpRank
    total_bytes: Count
    num_ops: Count
    aux_payload: AuxPayload  # e.g. first output token id + a small metadata blob
    timings: PhaseTimings  # phase -> seconds, read-only; plus the window ages of metrics.py
    last_chunk: MaybeChunk = None
    last_layer_start: Count = 0
    last_num_layers: Count = 0
    receipts: Receipts = ()
    positions: MaybePageIds = None

    def _validate(self) -> None:
        if self.last_num_layers == 0 and self.last_layer_start != 0:
            self._bad("last_layer_start", f"={self.last_layer_start} must be 0 when last_num_layers=0 (every layer)")
        if self.last_chunk is None and self.last_num_layers:
            self._bad("last_num_layers", f"={self.last_num_layers} must be 0 without a last_chunk")
        chunk = self.last_chunk
        if chunk is not None and chunk.chunk_bytes > self.total_bytes:
            self._bad("last_chunk", f"has {chunk.chunk_bytes} bytes, more than total_bytes={self.total_bytes}")
        if self.positions is not None:
            if chunk is not None:
                self._bad("positions", "come from direct writes only; this notice carries a staged last_chunk")
            steps = np.diff(self.positions)
            if steps.size and int(steps.min()) <= 0:
                i = int(np.flatnonzero(steps <= 0)[0])
                self._bad(
                    "positions",
                    f"must increase: positions[{i}]={int(self.positions[i])}, "
                    f"positions[{i + 1}]={int(self.positions[i + 1])}",
                )


@message
class TransferFailed(Message):
    """Either side -> the other: this room failed here, and why."""

    room: Room
    side: SideField
    tp_rank: TpRank
    reason: Reason


@message
class Abort(Message):
    """Either side -> the other: stop this room (the sender gave up on it)."""

    room: Room
    side: SideField
    tp_rank: TpRank
    reason: Reason


@message
class Heartbeat(Message):
    """Both sides, periodically. ``sent_at`` is the sender's monotonic clock (only
    differences between two heartbeats of one session mean anything)."""

    session: SessionId
    side: SideField
    tp_rank: TpRank
    seq: Seq
    sent_at: Seconds
    # protocol 7: the sender's host and PID namespace (``engine/liveness.host_id``, "" if
    # unknown) and pid, so a peer on the same host can ask the kernel about a silence
    host: HostId = ""
    pid: Annotated[int, Int(0, INT32_MAX)] = 0
