"""The one codec: ``encode(message) -> bytes`` and ``decode(bytes) -> message``.

Wire format: one msgpack array ``[PROTOCOL_VERSION, type_tag, {field: value}]`` where
``type_tag`` is the message class name (``"RequestMeta"``) and the map holds every field of
that message, no more, no less (page ids as raw little-endian int32 bytes; geometry as
``KVGeometry.to_dict()``; the side as ``"prefill"``/``"decode"``).

``decode`` is the trust boundary. Whatever bytes arrive, it returns a valid message or
raises ``RemoteProtocolError`` naming the message type, the field and what was wrong;
any other exception from it is a bug (the fuzz tests hold it to that). msgpack runs with
hard limits, so a hostile frame cannot make it allocate more than a bounded amount.

Must not: open sockets, start threads, import zmq or torch.
"""

from __future__ import annotations

from typing import Any

import msgpack

from sglang_kvxfer.errors import LocalProtocolError, RemoteProtocolError
from sglang_kvxfer.protocol.fields import (
    MAX_AGENT_DESCRIPTOR_BYTES,
    MAX_AUX_PAYLOAD_BYTES,
    MAX_FRAME_BYTES,
    MAX_KV_REGIONS,
    MAX_PAGE_IDS,
    MAX_REASON_CHARS,
    MAX_TIMINGS,
    MAX_TP_SIZE,
    PROTOCOL_VERSION,
    short,
)
from sglang_kvxfer.protocol.messages import MESSAGE_TYPES, Message

__all__ = ["encode", "decode"]

# msgpack-level ceilings, above every per-field limit so that an oversized field of a
# well-formed frame gets the precise per-field message; anything bigger than any field
# allows is refused by msgpack itself. max_array_len stays tight because msgpack allocates
# a list of the declared length before reading its items (a frame of nested headers costs
# at most ~1000 levels x 64 KiB, transiently).
_UNPACK_LIMITS = dict(
    max_bin_len=2 * max(4 * MAX_PAGE_IDS, MAX_AUX_PAYLOAD_BYTES, MAX_AGENT_DESCRIPTOR_BYTES),
    max_str_len=8 * MAX_REASON_CHARS,  # utf-8: up to 4 bytes per char
    max_array_len=max(MAX_KV_REGIONS, MAX_TP_SIZE) + 1,
    max_map_len=2 * max(MAX_TIMINGS, 16),
    max_ext_len=0,  # no ext types (timestamps included) in this protocol
)


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[Any, Any]]) -> dict:
    # A plain dict would keep the last duplicate silently; a peer sending two values for
    # one field is malformed.
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"a map in the frame has the key {short(key)} twice")
        out[key] = value
    return out


def encode(message: Message) -> bytes:
    """Serialise ``message`` to one frame.

    Raises:
        LocalProtocolError: ``message`` is not a protocol message, or the frame would
            exceed ``MAX_FRAME_BYTES`` (the peer would refuse it).
    """
    if not isinstance(message, Message):
        raise LocalProtocolError(f"encode() takes a protocol message, got {type(message).__name__} {short(message)}")
    frame = msgpack.packb([PROTOCOL_VERSION, type(message).__name__, message.to_wire()], use_bin_type=True)
    if len(frame) > MAX_FRAME_BYTES:
        raise LocalProtocolError(
            f"{type(message).__name__} encodes to {len(frame)} bytes, over MAX_FRAME_BYTES={MAX_FRAME_BYTES}"
        )
    return frame


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Parse one frame from a peer.

    Raises:
        RemoteProtocolError: the frame is not msgpack, not the envelope, of another
            protocol version or an unknown type, or a field is missing, unknown, of the
            wrong type, out of range or over its size limit. The message names the message
            type and field.
        LocalProtocolError: ``data`` is not bytes-like (a caller bug, not the peer's).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise LocalProtocolError(f"decode() takes bytes, got {type(data).__name__}")
    nbytes = data.nbytes if isinstance(data, memoryview) else len(data)
    if nbytes > MAX_FRAME_BYTES:
        raise RemoteProtocolError(f"frame of {nbytes} bytes exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            object_pairs_hook=_unique_keys,
            **_UNPACK_LIMITS,
        )
    except _DuplicateKey as exc:
        raise RemoteProtocolError(f"malformed frame: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - anything msgpack raises means a bad frame
        text = str(exc)[:200] or "truncated or malformed data"
        raise RemoteProtocolError(f"frame is not valid msgpack ({type(exc).__name__}: {text})") from None
    cls, fields = _open_envelope(obj)
    try:
        return cls.from_wire(fields)
    except LocalProtocolError as exc:
        raise RemoteProtocolError(f"invalid {cls.__name__} from peer: {exc}") from None


def _open_envelope(obj: Any) -> tuple[type[Message], dict]:
    if not isinstance(obj, list) or len(obj) != 3:
        got = f"a list of {len(obj)}" if isinstance(obj, list) else type(obj).__name__
        raise RemoteProtocolError(f"frame must be a msgpack array [version, type, fields], got {got}")
    version, tag, fields = obj
    if isinstance(version, bool) or not isinstance(version, int):
        raise RemoteProtocolError(f"frame version must be an integer, got {type(version).__name__} {short(version)}")
    if version != PROTOCOL_VERSION:
        raise RemoteProtocolError(
            f"peer speaks protocol version {short(version)}, this engine speaks "
            f"{PROTOCOL_VERSION}: run the same sglang_kvxfer version on both sides"
        )
    if not isinstance(tag, str):
        raise RemoteProtocolError(f"frame type must be a str, got {type(tag).__name__} {short(tag)}")
    cls = MESSAGE_TYPES.get(tag)
    if cls is None:
        raise RemoteProtocolError(f"unknown message type {short(tag)} (known: {', '.join(sorted(MESSAGE_TYPES))})")
    if not isinstance(fields, dict):
        raise RemoteProtocolError(f"{tag} fields must be a msgpack map, got {type(fields).__name__} {short(fields)}")
    return cls, fields
