"""Sans-I/O protocol of the engine: messages, one codec, the per-request state machine.

Nothing here opens a socket, starts a thread, reads a clock or imports zmq/torch: the
engine's I/O threads feed bytes to ``decode`` and events (with the time) to
``RequestState``, and send what ``encode`` returns. So the whole protocol is tested
without processes.

Message flow (each arrow one msgpack frame ``[PROTOCOL_VERSION, type, {fields}]``;
control frames are one-way PUSH -> PULL, the bootstrap lookup is request/reply)::

    prefill rank  --PrefillRegister-->  bootstrap                 (once per process start and KV pool)
    prefill rank  --PrefillLeave----->  bootstrap                 (as it closes: its own registration)
    prefill rank  --RoomRoute-------->  bootstrap                 (a room its load balancer placed here)
    decode rank   --RoomQuery-------->  bootstrap                 (which DP group serves these rooms)
    decode rank   --BootstrapQuery--->  bootstrap
    decode rank   <--BootstrapReply---  bootstrap                 (ready once all ranks registered)
    decode rank   --DecodeRegister--->  each candidate prefill rank (once per session pair)
    decode rank   <--RegisterReply----  prefill rank              (ok, or which geometry field differs)
    per room:
    decode rank   --RoomWatch-------->  each prefill rank of the group (only a decode that allocates
    decode rank   <--PrefillReady-----  prefill rank              once the prefill's forward finished)
    decode rank   --RequestMeta------>  each candidate prefill rank (page ids, elected, staging window)
    decode rank   <--ChunkReady-------  elected prefill rank      (staged path, per chunk but the last)
    decode rank   --ChunkAck--------->  that prefill rank         (slot scattered; reuse it)
    decode rank   <--TransferDone-----  each writer               (bytes, ops, aux payload, timings,
                                                                   and its last staged chunk: no ack)
    either side   --TransferFailed--> / --Abort-->  the other side (with a reason)
    both sides    --Heartbeat-------->  peers                     (session, seq, monotonic send time)

Errors say whose fault it is: ``LocalProtocolError`` (this process built or used something
wrongly) vs ``RemoteProtocolError`` (the peer sent a malformed frame); both are
``ProtocolError`` from ``sglang_kvxfer.errors``.
"""

from __future__ import annotations

from sglang_kvxfer.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from sglang_kvxfer.protocol.codec import decode, encode
from sglang_kvxfer.protocol.fields import (
    MAX_AGENT_DESCRIPTOR_BYTES,
    MAX_AUX_PAYLOAD_BYTES,
    MAX_ENDPOINT_CHARS,
    MAX_FRAME_BYTES,
    MAX_KV_REGIONS,
    MAX_NAME_CHARS,
    MAX_PAGE_IDS,
    MAX_REASON_CHARS,
    MAX_RECEIPTS,
    MAX_REGION_DESCRIPTOR_BYTES,
    MAX_TIMINGS,
    MAX_TP_SIZE,
    PROTOCOL_VERSION,
    Side,
)
from sglang_kvxfer.protocol.messages import (
    MESSAGE_TYPES,
    Abort,
    BootstrapQuery,
    BootstrapReply,
    ChunkAck,
    ChunkReady,
    DecodeRegister,
    Heartbeat,
    Message,
    PrefillLeave,
    PrefillRankInfo,
    PrefillReady,
    PrefillRegister,
    RegisterReply,
    RequestMeta,
    RoomQuery,
    RoomRoute,
    RoomWatch,
    StagedChunk,
    TransferDone,
    TransferFailed,
)
from sglang_kvxfer.protocol.state import (
    DECODE_TRANSITIONS,
    PREFILL_TRANSITIONS,
    TRANSITIONS,
    Deadlines,
    Event,
    KVPoll,
    RequestState,
    describe_transitions,
)

__all__ = [
    # codec
    "encode",
    "decode",
    "PROTOCOL_VERSION",
    # messages
    "Message",
    "MESSAGE_TYPES",
    "PrefillRegister",
    "PrefillLeave",
    "RoomRoute",
    "RoomQuery",
    "BootstrapQuery",
    "BootstrapReply",
    "PrefillRankInfo",
    "DecodeRegister",
    "RegisterReply",
    "RoomWatch",
    "PrefillReady",
    "RequestMeta",
    "ChunkReady",
    "ChunkAck",
    "StagedChunk",
    "TransferDone",
    "TransferFailed",
    "Abort",
    "Heartbeat",
    "Side",
    # state machine
    "KVPoll",
    "Event",
    "Deadlines",
    "RequestState",
    "PREFILL_TRANSITIONS",
    "DECODE_TRANSITIONS",
    "TRANSITIONS",
    "describe_transitions",
    # errors
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    # limits
    "MAX_FRAME_BYTES",
    "MAX_NAME_CHARS",
    "MAX_ENDPOINT_CHARS",
    "MAX_REASON_CHARS",
    "MAX_TP_SIZE",
    "MAX_PAGE_IDS",
    "MAX_AUX_PAYLOAD_BYTES",
    "MAX_AGENT_DESCRIPTOR_BYTES",
    "MAX_REGION_DESCRIPTOR_BYTES",
    "MAX_KV_REGIONS",
    "MAX_TIMINGS",
    "MAX_RECEIPTS",
]
