"""The one error hierarchy of sglang_kvxfer.

Every failure the engine reports is a ``KVXferError`` (or, for bad arguments, a
``ValueError``/``TypeError`` subclass that is *also* a ``KVXferError`` where that helps
callers). Messages name the field and the values involved; nothing here logs or swallows.
"""

from __future__ import annotations

__all__ = [
    "KVXferError",
    "GeometryError",
    "IncompatibleGeometryError",
    "PlanError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "TransportError",
    "TransportUnavailableError",
    "TransferTimeoutError",
    "PeerGoneError",
    "TransferFailedError",
]


class KVXferError(Exception):
    """Base class of every error raised by sglang_kvxfer."""


class GeometryError(KVXferError, ValueError):
    """A KV geometry or rank placement field is invalid (names the field and its value)."""


class IncompatibleGeometryError(KVXferError, ValueError):
    """A prefill geometry and a decode geometry cannot exchange KV.

    ``mismatches`` holds one ``(field, prefill_value, decode_value, hint)`` per differing
    field; the message lists all of them.
    """

    def __init__(self, mismatches):
        self.mismatches = list(mismatches)
        lines = [f"{field}: prefill={p!r} decode={d!r} ({hint})" for field, p, d, hint in self.mismatches]
        super().__init__("incompatible KV geometry: " + "; ".join(lines))


class PlanError(KVXferError, ValueError):
    """A transfer plan cannot be built from the given inputs (page lists, ranks...)."""


class ProtocolError(KVXferError):
    """A protocol rule was broken. See the two subclasses for whose fault it is."""


class LocalProtocolError(ProtocolError):
    """This process tried to do something the protocol forbids (a local bug or misuse)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something malformed or out of order."""


class TransportError(KVXferError):
    """A transport failed to register memory, connect, or move bytes."""


class TransportUnavailableError(TransportError, ImportError):
    """The requested transport needs a package or hardware that is not present."""


class TransferTimeoutError(KVXferError, TimeoutError):
    """A wait ran past its deadline."""


class PeerGoneError(TransportError):
    """The peer process or connection is gone."""


class TransferFailedError(KVXferError):
    """A KV transfer for one request failed; ``reason`` says why."""

    def __init__(self, reason: str, room: int | None = None):
        self.reason = reason
        self.room = room
        super().__init__(reason if room is None else f"room {room}: {reason}")


class AuthenticationError(ProtocolError):
    """A frame failed authentication (no envelope, a wrong tag, a replay), or this process
    has no usable key. Frames that fail it are dropped and counted, never decoded."""
