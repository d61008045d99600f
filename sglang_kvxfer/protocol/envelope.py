"""The authenticated envelope around every control and bootstrap frame.

Owns the envelope's byte layout, its HMAC-SHA256 tag, and the two replay guards: a
strictly increasing sequence per sender session (control channel: one ordered stream per
sender and receiver) and a time window with a seen-set (bootstrap: request/reply over fresh
connections). A frame whose tag does not verify is refused here, before any of its payload
is decoded, so an unauthenticated frame cannot create state anywhere.

Layout: ``MAGIC(4) | tag(32) | seq(u64 LE) | len(sender)(u8) | sender | payload``. The tag
is ``HMAC-SHA256(key, DOMAIN | destination | 0x00 | seq | len | sender | payload)``: the
destination (the receiver's endpoint) is inside the MAC, so a frame captured on its way to
one rank is refused by every other. With authentication off (``key == b""``) the tag is
all zeros and is not checked, but the sender and sequence are still carried and enforced.

Must not: open sockets, start threads, read files or the environment. Clocks come in as
arguments.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets
import struct

from sglang_kvxfer.errors import AuthenticationError, LocalProtocolError

__all__ = [
    "seal",
    "open_frame",
    "SequenceGuard",
    "FreshnessGuard",
    "fresh_seq",
    "peer_secret",
    "MAGIC",
    "OVERHEAD_BYTES",
]

MAGIC = b"KXA1"
DOMAIN = b"sglang_kvxfer control v1\x00"
_HEAD = struct.Struct("<4s32sQB")  # magic, tag, seq, len(sender)
OVERHEAD_BYTES = _HEAD.size
_ZERO_TAG = bytes(32)
MAX_SENDER = 64


def _mac(key: bytes, destination: bytes, body) -> bytes:
    mac = hmac.new(key, DOMAIN, hashlib.sha256)
    mac.update(destination)
    mac.update(b"\x00")
    mac.update(body)
    return mac.digest()


def seal(key: bytes, sender: str, seq: int, payload: bytes, destination: str = "") -> bytes:
    """Wrap ``payload`` from ``sender`` (its session id) with sequence number ``seq``."""
    name = sender.encode("ascii")
    if not 0 < len(name) <= MAX_SENDER:
        raise LocalProtocolError(f"sender={sender!r} must be 1..{MAX_SENDER} ASCII chars")
    if not 0 <= seq < 1 << 64:
        raise LocalProtocolError(f"seq={seq} must fit 64 bits")
    body = struct.pack("<QB", seq, len(name)) + name + payload
    tag = _mac(key, destination.encode(), body) if key else _ZERO_TAG
    return MAGIC + tag + body


def open_frame(key: bytes, data, destination: str = "") -> tuple[str, int, memoryview]:
    """Check ``data``'s envelope; return ``(sender, seq, payload)``.

    Raises ``AuthenticationError`` (the frame must be dropped and counted) when the frame is
    not an envelope or its tag does not verify with ``key``.
    """
    view = memoryview(data).cast("B")
    if view.nbytes < _HEAD.size or bytes(view[:4]) != MAGIC:
        raise AuthenticationError(
            "frame is not an authenticated envelope (another engine version, or not from sglang_kvxfer)"
        )
    _, tag, seq, n = _HEAD.unpack_from(view)
    if n == 0 or n > MAX_SENDER or view.nbytes < _HEAD.size + n:
        raise AuthenticationError("envelope has a malformed sender field")
    body = view[36:]
    if key and not hmac.compare_digest(tag, _mac(key, destination.encode(), body)):
        raise AuthenticationError(
            "tag does not verify: the sender uses another key "
            "(KVXFER_AUTH_KEY) or KVXFER_AUTH=off, or the frame was altered"
        )
    try:
        sender = bytes(view[_HEAD.size : _HEAD.size + n]).decode("ascii")
    except UnicodeDecodeError:
        raise AuthenticationError("envelope sender is not ASCII") from None
    return sender, seq, view[_HEAD.size + n :]


class SequenceGuard:
    """Per-sender strictly increasing sequence numbers (replay and reorder protection for
    one ordered stream per sender). Remembers at most ``capacity`` senders (least recently
    seen forgotten first); only authenticated frames reach it, so only key holders fill it."""

    def __init__(self, capacity: int = 65536):
        self._last: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._capacity = capacity

    def accept(self, sender: str, seq: int) -> bool:
        last = self._last.get(sender)
        if last is not None and seq <= last:
            return False
        self._last[sender] = seq
        self._last.move_to_end(sender)
        if len(self._last) > self._capacity:
            self._last.popitem(last=False)
        return True


def fresh_seq(now_unix_s: float) -> int:
    """A sequence number for a one-off request: microseconds since the epoch (52 bits) and
    12 random bits, so two requests in one microsecond still differ."""
    return (int(now_unix_s * 1e6) << 12) | secrets.randbits(12)


class FreshnessGuard:
    """Accept each (sender, seq) once, only within ``window_s`` of now (``fresh_seq``
    numbers carry their time). Holds at most ``capacity`` entries; past it, new frames are
    refused until old ones age out."""

    def __init__(self, window_s: float = 300.0, capacity: int = 100_000):
        self.window_s, self._capacity = window_s, capacity
        self._seen: collections.OrderedDict[tuple[str, int], float] = collections.OrderedDict()

    def accept(self, sender: str, seq: int, now_unix_s: float) -> str:
        """'' if fresh, else why the frame is refused."""
        while self._seen:
            key, at = next(iter(self._seen.items()))
            if now_unix_s - at <= self.window_s:
                break
            del self._seen[key]
        sent = (seq >> 12) / 1e6
        if abs(now_unix_s - sent) > self.window_s:
            return (
                f"its time stamp is {now_unix_s - sent:+.0f} s away from this clock (window "
                f"{self.window_s:.0f} s): a replay, or clocks out of sync"
            )
        if (sender, seq) in self._seen:
            return "it is a replay of a frame already accepted"
        if len(self._seen) >= self._capacity:
            return "too many fresh requests in the window"
        self._seen[(sender, seq)] = now_unix_s
        return ""


def peer_secret(key: bytes, writer_session: str, reader_session: str) -> bytes:
    """The 32-byte data-plane secret of one (writer, reader) pair of sessions: both sides
    derive it from the shared key and the session ids they exchanged over the authenticated
    control plane; it never travels. With authentication off it is derived from the session
    ids alone (anyone who learns them can compute it)."""
    mac = hmac.new(key or b"sglang_kvxfer unauthenticated", b"sglang_kvxfer data v1\x00", hashlib.sha256)
    mac.update(writer_session.encode() + b"\x00" + reader_session.encode())
    return mac.digest()
