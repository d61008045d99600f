"""The ``tcp`` transport's wire format: frame layouts, constants and the handshake proof.

Handshake (wire version 3): the reader speaks first, CHALLENGE ``<4sH2x32s`` = magic,
version, 32 random bytes; the writer answers HELLO ``<4sH2x16s32sQ`` = magic, version,
key id (``SHA-256(secret)[:16]``), ``HMAC-SHA256(secret, challenge || reader agent name ||
key id || connection id)``, connection id (the writer's random 64-bit name for this
connection, nonzero: a landing receipt ``(connection id, frame number)`` names a WRITE
frame of it, counted from 1 on both ends); the reader answers HELLO_OK ``<4sH2x>``, or
closes without a byte when anything is wrong (no reason, no name: a refusal tells a
prober nothing). Then frames
(little-endian): WRITE/BYE header ``<B3xIQQQ`` = type, n_entries, xfer_id, region_id,
total_bytes, then ``n_entries x <QQ`` (remote_offset, size), then the payload; ACK
``<BB2xIQ`` = type, status, reason length, xfer_id, then the UTF-8 reason; the reader's
BYE is an ACK frame of type BYE. No pickle, no eval.

This module must not open sockets, start threads or know about regions and peers
(``conn`` moves these frames, ``transport`` owns the rest).
"""

from __future__ import annotations

import hashlib
import hmac
import struct

MAGIC, WIRE_VERSION = b"KVXT", 3
NONCE_BYTES, KEY_ID_BYTES = 32, 16
CHALLENGE = struct.Struct("<4sH2x32s")  # magic, version, nonce (reader -> writer, first)
HELLO = struct.Struct("<4sH2x16s32sQ")  # magic, version, key id, HMAC-SHA256, connection id
HELLO_OK = struct.Struct("<4sH2x")  # magic, version
HEADER = struct.Struct("<B3xIQQQ")  # type, n_entries, xfer_id, region_id, total_bytes
CONN_ID = struct.Struct("<Q")
ACK = struct.Struct("<BB2xIQ")  # type, status (0 ok, 1 refused), reason length, xfer_id
T_WRITE, T_ACK, T_BYE = 1, 2, 3
MAX_ENTRIES = 1 << 20  # entries per frame the receiver accepts
MAX_TEXT = 1 << 12  # agent names and reasons


class _Violation(Exception):
    """The other end broke the wire protocol; the connection cannot continue."""


def key_id(secret: bytes) -> bytes:
    """Names a secret on the wire without revealing it: the reader finds the grant by it."""
    return hashlib.sha256(secret).digest()[:KEY_ID_BYTES]


def hello_mac(secret: bytes, nonce: bytes, reader_agent: str, kid: bytes, conn_id: int) -> bytes:
    """The writer's proof: bound to this challenge, this reader, this key id and the
    connection id it names (so receipts of this connection are the writer's own)."""
    msg = nonce + reader_agent.encode() + kid + CONN_ID.pack(conn_id)
    return hmac.new(secret, msg, hashlib.sha256).digest()
