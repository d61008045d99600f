"""Machinery the transport implementations share; not part of the interface.

``pack_descriptor``/``unpack_descriptor``: agent and region descriptors as tagged msgpack
maps (never pickle), checked field by field on the way in. ``UseTable``: live regions or
mappings with in-flight use counts, so memory is released only after the transfers that
touch it. This module must not open sockets or map memory.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from sglang_kvxfer.errors import TransportError

if TYPE_CHECKING:
    from sglang_kvxfer.transports.base import Entries, Region, RemoteRegion
    from sglang_kvxfer.transports.ticket import Ticket

__all__ = ["pack_descriptor", "unpack_descriptor", "UseTable", "open_write", "env_override"]

DESCRIPTOR_VERSION = 1


def pack_descriptor(transport: str, what: str, **fields: Any) -> bytes:
    """Encode an agent or region descriptor: a msgpack map, tagged with transport and version."""
    import msgpack

    return msgpack.packb(
        {"transport": transport, "what": what, "version": DESCRIPTOR_VERSION, **fields}, use_bin_type=True
    )


def unpack_descriptor(
    blob: object, transport: str, what: str, fields: Mapping[str, type | tuple[type, ...]]
) -> dict[str, Any]:
    """Decode a descriptor made by ``pack_descriptor`` and check its fields.

    ``fields`` maps each required field to its type (or tuple of types). Raises
    ``TypeError`` if ``blob`` is not bytes and ``ValueError`` naming the field otherwise.
    """
    import msgpack

    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"{what} descriptor must be bytes, got {type(blob).__name__}")
    try:
        obj = msgpack.unpackb(bytes(blob), raw=False)
    except Exception as exc:
        raise ValueError(f"{what} descriptor is not a valid msgpack map ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{what} descriptor must be a msgpack map, got {type(obj).__name__}")
    if obj.get("transport") != transport:
        raise ValueError(
            f"{what} descriptor is for transport {obj.get('transport')!r}; transport {transport!r} cannot use it"
        )
    if obj.get("what") != what:
        raise ValueError(f"expected a {transport} {what} descriptor, got {obj.get('what')!r}")
    if obj.get("version") != DESCRIPTOR_VERSION:
        raise ValueError(
            f"{transport} {what} descriptor has version {obj.get('version')!r}, this build speaks {DESCRIPTOR_VERSION}"
        )
    for name, types in fields.items():
        value = obj.get(name)
        if (
            not isinstance(value, types)
            or isinstance(value, bool)
            and bool not in (types if isinstance(types, tuple) else (types,))
        ):
            raise ValueError(
                f"{transport} {what} descriptor: field {name!r} is {value!r}, "
                f"expected {getattr(types, '__name__', types)}"
            )
    return obj


class UseTable:
    """Live objects by key, each with a count of in-flight users.

    Transports keep their regions and mappings here so that removing one (``deregister``,
    ``remove_peer``) stops new users at once and then waits, bounded, for the users already
    copying into or out of that memory before the memory may be freed or unmapped.
    """

    class Lease:
        __slots__ = ("key", "value", "uses")

        def __init__(self, key: Any, value: Any):
            self.key, self.value, self.uses = key, value, 0

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._live: dict[Any, UseTable.Lease] = {}

    def add(self, key: Any, value: Any) -> None:
        with self._cond:
            if key in self._live:
                raise ValueError(f"{key!r} is already present")
            self._live[key] = UseTable.Lease(key, value)

    def get(self, key: Any) -> Any:
        """The value under ``key``, or None."""
        lease = self._live.get(key)
        return None if lease is None else lease.value

    def items(self) -> list[tuple[Any, Any]]:
        with self._cond:
            return [(k, lease.value) for k, lease in self._live.items()]

    def acquire(self, key: Any) -> UseTable.Lease | None:
        """Count one more user of ``key``; None when it is absent (or being removed)."""
        with self._cond:
            lease = self._live.get(key)
            if lease is not None:
                lease.uses += 1
            return lease

    def retain(self, lease: UseTable.Lease) -> UseTable.Lease:
        """Count one more user of a key ``lease`` (held) is on; the same lease."""
        with self._cond:
            lease.uses += 1
            return lease

    def release(self, lease: UseTable.Lease) -> None:
        with self._cond:
            lease.uses -= 1
            if lease.uses == 0:
                self._cond.notify_all()

    def remove(self, key: Any, timeout_s: float, on_timeout: Callable[[], None] | None = None) -> Any:
        """Remove ``key`` now; wait until its users are gone. Returns the value (None if absent).

        If users remain after ``timeout_s``, ``on_timeout`` (which should make them stop,
        e.g. by shutting their sockets down) is called and the wait repeats once. Raises
        ``TransportError`` when users still remain (the key stays removed).
        """
        with self._cond:
            lease = self._live.pop(key, None)
            if lease is None:
                return None
            idle = self._cond.wait_for(lambda: lease.uses == 0, timeout_s)
        if not idle and on_timeout is not None:
            on_timeout()
            with self._cond:
                idle = self._cond.wait_for(lambda: lease.uses == 0, timeout_s)
        if not idle:
            raise TransportError(f"{key!r} still has {lease.uses} transfer(s) in flight after {timeout_s} s")
        return lease.value

    def busy(self, key: Any) -> bool:
        lease = self._live.get(key)
        return lease is not None and lease.uses > 0


@contextlib.contextmanager
def env_override(name: str, value: str | None) -> Iterator[None]:
    """Set environment variable ``name`` to ``value`` (when not empty) for the ``with``
    block, then restore what was there: for libraries that read their settings from the
    environment only while a backend is created."""
    saved = os.environ.get(name)
    if value:
        os.environ[name] = value
    try:
        yield
    finally:
        if value:
            if saved is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = saved


class _PeerRecord(Protocol):
    @property
    def failed(self) -> str | None: ...


_P = TypeVar("_P", bound=_PeerRecord)


def open_write(
    label: str,
    peer: _P | None,
    imported: object,
    remote: RemoteRegion,
    regions: UseTable,
    local: Region,
    entries: Entries,
) -> tuple[_P, UseTable.Lease] | Ticket:
    """The checks every transport's ``_write`` starts with.

    ``peer`` is the transport's record of ``remote.peer_id`` (None if unknown; it has a
    ``failed`` reason or None) and ``imported`` what it imported as ``remote.region_id``.
    Returns ``(peer, lease)``, the peer and a lease on the local region to go on with, or a
    ticket when the batch is over without a byte moved (the peer failed, or no entries).
    Raises ``ValueError`` for an unknown peer, a remote region not imported, or a local
    region not registered.
    """
    from sglang_kvxfer.errors import PeerGoneError
    from sglang_kvxfer.transports.ticket import Ticket

    if peer is None:
        raise ValueError(f"unknown peer {remote.peer_id!r} (add_peer it first)")
    if imported != remote:
        raise ValueError(
            f"remote region {remote.region_id} of peer {remote.peer_id!r} is not imported (import_region it first)"
        )
    lease = regions.acquire(local.region_id)
    if lease is None:
        raise ValueError(f"local region {local.region_id} is not registered here")
    if peer.failed is not None or entries.num_entries == 0:
        regions.release(lease)
        if peer.failed is not None:
            return Ticket.failed(label, PeerGoneError(peer.failed))
        return Ticket.completed(label)
    return peer, lease
