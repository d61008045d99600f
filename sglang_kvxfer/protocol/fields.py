"""Field kinds of the protocol: how each message field is checked and carried on the wire.

Owns the size limits (``MAX_*``), the ``Kind`` classes (one per sort of field: bounded
integer, number, flag, text, blob, page ids, geometry, list, nested record...) and the
``Record`` base that frozen message dataclasses build on. A field is declared once, as an
``Annotated`` type on the dataclass (``room: Room``); the same declaration drives the
constructor's validation and the codec's strict decoding, so the two cannot drift apart.

Rules:
1. Every check raises ``LocalProtocolError`` whose text names the field (``RequestMeta.room``)
   and the offending value; the codec re-raises it as ``RemoteProtocolError`` for frames
   from a peer (h11's split: whose fault it is).
2. Values from the wire may be anything msgpack can produce (deeply nested lists, bytes
   where a str belongs, huge ints): nothing here calls ``str``/``repr``/``hash`` on such a
   value before its type is known. Messages show values through ``short()``, which is
   depth- and length-bounded.
3. No sockets, threads, clocks, zmq or torch. numpy only for page ids.
"""

from __future__ import annotations

import abc
import enum
import functools
import math
import re
import reprlib
import types
import typing
from collections.abc import Mapping
from dataclasses import Field, dataclass
from typing import Any

import numpy as np

from sglang_kvxfer.errors import GeometryError, LocalProtocolError
from sglang_kvxfer.geometry import KVGeometry

__all__ = [
    "PROTOCOL_VERSION",
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
    "MAX_ROOM_QUERY",
    "Side",
    "Kind",
    "Record",
    "record",
    "short",
]

# -- limits --------------------------------------------------------------------------------
# Bump PROTOCOL_VERSION on any change of a message's fields or their meaning; peers with a
# different version are rejected at the first frame with a message saying so.
# 2: staging_region moved from DecodeRegister to RequestMeta; 3: TransferDone carries the
# writer's last staged chunk (last_chunk), which then has no ChunkReady and no ChunkAck;
# 4: ChunkReady carries layer_start/num_layers and TransferDone last_layer_start/
# last_num_layers (layer-wise streaming), and prefill registrations carry their DP group;
# 5: RegisterReply says whether the prefill maps the decode's KV pool (pool_mapped,
# pool_note) and RequestMeta whether the writer writes it with one fused copy (fused);
# 6: PrefillRegister, BootstrapQuery and BootstrapReply name a KV pool (kv_pool: "" or
# "draft" or "state:<kind>[.<n>]"), and the model's pool registration and reply carry
# draft_geometry and state_pools; prefill registrations name their pipeline-parallel stage
# (pp_rank, pp_size, layer_start), queries the stage they ask about and replies the stage's
# layers and the registered stages; 7: Heartbeat carries the sender's host id and pid;
# 8: TransferDone carries the landing receipts of writes not yet acknowledged (receipts);
# 9: PrefillLeave (a closing prefill rank takes its registration back from the bootstrap);
# prefill registrations and bootstrap replies say whether DP groups follow bootstrap_room
# (follows_room), RoomRoute registers a room's DP group and RoomQuery asks for it
# (room_groups in the reply); 10: RequestMeta carries the reader's token selection
# (token_stride, token_phase: a decode-context-parallel rank holds every stride-th token), and
# prefill registrations and bootstrap replies the serving process's HTTP port (api_port) and
# its decode-context-parallel size (dcp_size); 11: prefill registrations, queries, leaves and
# bootstrap replies name an attention-CP rank (cp_rank; registrations and replies cp_size: the
# CP ranks that send, each its share of a request's pages); 12: prefill registrations and
# bootstrap replies say whether the rank's pool holds every KV head (all_heads); 13: RoomWatch
# (a decode rank that allocates only once the prefill finished asks to be told) and
# PrefillReady (the prefill's forward of that room finished: the decode may allocate); 14:
# RequestMeta says whether the writer picks which of the decode's pages it writes (sparse:
# a prefill rank that holds only some of a request's pages, SGLang's KV cache sharding) and
# TransferDone names them (positions).
PROTOCOL_VERSION = 14
MAX_FRAME_BYTES = 64 * 1024 * 1024  # whole encoded frame (set ZMQ_MAXMSGSIZE to this)
MAX_NAME_CHARS = 64  # session ids, engine version, transport name
MAX_ENDPOINT_CHARS = 256  # "tcp://host:port"
MAX_REASON_CHARS = 4096  # failure / abort reasons (local ones are cut)
MAX_TP_SIZE = 1024
MAX_PAGE_IDS = 1 << 21  # destination pages of one request (8 MiB on the wire)
MAX_AUX_PAYLOAD_BYTES = 1024 * 1024  # first token id + small metadata blob
MAX_AGENT_DESCRIPTOR_BYTES = 4 * 1024 * 1024  # a transport agent's connection info (NIXL: KBs)
MAX_REGION_DESCRIPTOR_BYTES = 16 * 1024  # one registered memory region
MAX_KV_REGIONS = 8192  # KV buffers of one rank (2 * layers, draft layers)
MAX_TIMINGS = 32  # entries of TransferDone.timings
MAX_RECEIPTS = 4096  # entries of TransferDone.receipts (more pending frames: the writer waits instead)
MAX_ROOM_QUERY = 4096  # rooms of one RoomQuery and (room, DP group) pairs of its reply
# A staged pair's window (RequestMeta.staging_capacity_bytes) is this many equal slots: the
# writer fills one while the reader scatters the other (ChunkReady / ChunkAck).
STAGING_SLOTS = 2

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1

_short = reprlib.Repr()
_short.maxstring = 40
_short.maxlist = 4
_short.maxdict = 4
_short.maxother = 100
_short.maxlevel = 3


def short(value: Any) -> str:
    """A bounded repr for error messages (safe on hostile, deeply nested values)."""
    if isinstance(value, (bytes, bytearray, memoryview)) and len(value) > 16:
        return f"<{len(value)} bytes>"
    return _short.repr(value)


def fail(where: str, problem: str) -> typing.NoReturn:
    """Raise ``LocalProtocolError("<where> <problem>")``; ``"=value ..."`` problems attach."""
    sep = "" if problem.startswith("=") else " "
    raise LocalProtocolError(f"{where}{sep}{problem}")


def _wrong_type(where: str, expected: str, value: Any) -> typing.NoReturn:
    fail(where, f"must be {expected}, got {type(value).__name__} {short(value)}")


def _too_long(where: str, size: int, unit: str, limit: int) -> typing.NoReturn:
    fail(where, f"is too long: {size} {unit} (limit {limit})")


# -- kinds ---------------------------------------------------------------------------------
class Kind(abc.ABC):
    """How one field is validated locally (``check``) and carried on the wire.

    ``check`` returns the stored (normalised) value; ``from_wire`` is the strict decoder
    for what msgpack produced and defaults to ``check``; ``to_wire`` makes the value
    msgpack-able.
    """

    @abc.abstractmethod
    def check(self, value: Any, where: str) -> Any:
        """Validate a local value; return what the message stores."""

    def from_wire(self, value: Any, where: str) -> Any:
        return self.check(value, where)

    def to_wire(self, value: Any) -> Any:
        return value


@dataclass(frozen=True)
class Int(Kind):
    lo: int
    hi: int

    def check(self, value, where):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            _wrong_type(where, "an integer", value)
        value = int(value)
        if not self.lo <= value <= self.hi:
            fail(where, f"={value} is out of range [{self.lo}, {self.hi}]")
        return value


@dataclass(frozen=True)
class Number(Kind):
    """A finite float >= ``lo`` (ints are accepted and stored as float)."""

    lo: float = 0.0

    def check(self, value, where):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
            _wrong_type(where, "a number", value)
        # float() of an int beyond the float range raises OverflowError: refuse it first.
        if isinstance(value, int) and abs(value) > 2**1023 or not math.isfinite(value):
            fail(where, f"={short(value)} must be a finite number >= {self.lo}")
        value = float(value)
        if value < self.lo:
            fail(where, f"={value!r} must be a finite number >= {self.lo}")
        return value


class Flag(Kind):
    def check(self, value, where):
        if not isinstance(value, bool):
            _wrong_type(where, "a bool", value)
        return value


@functools.cache
def _compiled(pattern: str) -> re.Pattern:
    return re.compile(pattern)


@dataclass(frozen=True)
class Text(Kind):
    """A str of at most ``max_chars``; ``pattern`` (a regex, with ``means`` in words) if set.

    ``cut=True`` (reasons): a *local* value that is too long is cut with a marker, so that
    reporting a failure never fails; a peer's too-long value is still rejected.
    """

    max_chars: int
    pattern: str | None = None
    means: str = ""
    cut: bool = False

    def check(self, value, where):
        if not isinstance(value, str):
            _wrong_type(where, "a str", value)
        try:
            value.encode("utf-8")  # lone surrogates (e.g. from surrogateescape) cannot be sent
        except UnicodeEncodeError:
            if not self.cut:
                fail(where, f"={short(value)} is not valid unicode (lone surrogate)")
            value = value.encode("utf-8", "backslashreplace").decode("utf-8")
        if len(value) > self.max_chars:
            if not self.cut:
                _too_long(where, len(value), "chars", self.max_chars)
            marker = f" ... [cut {len(value) - self.max_chars + 40} chars]"
            value = value[: self.max_chars - 40] + marker
        if self.pattern is not None and not _compiled(self.pattern).fullmatch(value):
            fail(where, f"={short(value)} is not {self.means}")
        return value

    def from_wire(self, value, where):
        if isinstance(value, str) and len(value) > self.max_chars:
            _too_long(where, len(value), "chars", self.max_chars)
        return self.check(value, where)


@dataclass(frozen=True)
class Blob(Kind):
    """Opaque bytes (descriptors, aux payload); bytearray/memoryview are copied to bytes."""

    max_bytes: int
    min_bytes: int = 0

    def check(self, value, where):
        if isinstance(value, (bytearray, memoryview)):
            value = bytes(value)
        if not isinstance(value, bytes):
            _wrong_type(where, "bytes", value)
        if len(value) > self.max_bytes:
            _too_long(where, len(value), "bytes", self.max_bytes)
        if len(value) < self.min_bytes:
            fail(where, f"has {len(value)} bytes; needs at least {self.min_bytes}")
        return value

    def from_wire(self, value, where):
        if not isinstance(value, bytes):
            _wrong_type(where, "bytes", value)
        return self.check(value, where)


@dataclass(frozen=True)
class Maybe(Kind):
    """``None`` or a value of ``inner``."""

    inner: Kind

    def check(self, value, where):
        return None if value is None else self.inner.check(value, where)

    def from_wire(self, value, where):
        return None if value is None else self.inner.from_wire(value, where)

    def to_wire(self, value):
        return None if value is None else self.inner.to_wire(value)


@dataclass(frozen=True)
class ListOf(Kind):
    """A list on the wire, a tuple in the message."""

    item: Kind
    max_items: int
    min_items: int = 0

    def _each(self, value, where, convert):
        if len(value) > self.max_items:
            _too_long(where, len(value), "items", self.max_items)
        if len(value) < self.min_items:
            fail(where, f"has {len(value)} items; needs at least {self.min_items}")
        return tuple(convert(v, f"{where}[{i}]") for i, v in enumerate(value))

    def check(self, value, where):
        if not isinstance(value, (list, tuple)):
            _wrong_type(where, "a list", value)
        return self._each(value, where, self.item.check)

    def from_wire(self, value, where):
        if not isinstance(value, list):
            _wrong_type(where, "a list", value)
        return self._each(value, where, self.item.from_wire)

    def to_wire(self, value):
        return [self.item.to_wire(v) for v in value]


class Side(str, enum.Enum):
    """Which end of a transfer a message or a request state belongs to."""

    PREFILL = "prefill"
    DECODE = "decode"

    def __str__(self) -> str:
        return self.value


class SideKind(Kind):
    def check(self, value, where):
        if isinstance(value, Side):
            return value
        if isinstance(value, str) and value in ("prefill", "decode"):
            return Side(value)
        fail(where, f"={short(value)} must be 'prefill' or 'decode'")

    def to_wire(self, value):
        return value.value


@dataclass(frozen=True)
class Timings(Kind):
    """Phase name -> seconds (finite, >= 0); stored read-only."""

    max_items: int
    key: Text
    seconds: Number = Number(0.0)

    def check(self, value, where):
        if not isinstance(value, Mapping):
            _wrong_type(where, "a dict of str -> seconds", value)
        if len(value) > self.max_items:
            _too_long(where, len(value), "entries", self.max_items)
        out = {}
        for k, v in value.items():
            k = self.key.check(k, f"{where} key")
            out[k] = self.seconds.check(v, f"{where}[{k!r}]")
        return types.MappingProxyType(out)

    def from_wire(self, value, where):
        if not isinstance(value, dict):
            _wrong_type(where, "a dict of str -> seconds", value)
        return self.check(value, where)

    def to_wire(self, value):
        return dict(value)


class PageIds(Kind):
    """Destination page ids: a read-only 1-D ``numpy.int32`` array ``[num_pages]``.

    On the wire: raw little-endian int32 bytes (4 per page). Locally any 1-D integer array
    or sequence of ints is accepted and copied, so the caller cannot change a sent message.
    """

    def check(self, value, where):
        if isinstance(value, np.ndarray):
            if value.dtype.kind not in "iu":
                _wrong_type(where, "integer page ids", value)
            if value.ndim != 1:
                fail(where, f"must be 1-D, got shape {value.shape}")
            arr = value
        elif isinstance(value, (list, tuple, range)):
            for i, v in enumerate(value):
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    _wrong_type(f"{where}[{i}]", "an integer page id", v)
                if not 0 <= v <= INT32_MAX:
                    fail(f"{where}[{i}]", f"={int(v)} is out of range [0, {INT32_MAX}]")
            arr = np.asarray(value, dtype=np.int64).reshape(-1)
        else:
            _wrong_type(where, "an integer array or a list of ints", value)
        if arr.size > MAX_PAGE_IDS:
            _too_long(where, int(arr.size), "page ids", MAX_PAGE_IDS)
        if arr.size:
            bad = np.flatnonzero((arr < 0) | (arr > INT32_MAX))
            if bad.size:
                i = int(bad[0])
                fail(f"{where}[{i}]", f"={int(arr[i])} is out of range [0, {INT32_MAX}]")
        # Reuse only arrays nobody can write through: decoded ones (over immutable bytes)
        # and ones this module already froze.
        frozen = not arr.flags.writeable and (arr.base is None or isinstance(arr.base, bytes))
        if arr.dtype == np.int32 and frozen:
            return arr
        out = np.array(arr, dtype=np.int32, copy=True)
        out.setflags(write=False)
        return out

    def from_wire(self, value, where):
        if not isinstance(value, bytes):
            _wrong_type(where, "bytes of little-endian int32 page ids", value)
        if len(value) % 4:
            fail(where, f"has {len(value)} bytes, not a multiple of 4 (int32 page ids)")
        if len(value) // 4 > MAX_PAGE_IDS:
            _too_long(where, len(value) // 4, "page ids", MAX_PAGE_IDS)
        arr = np.frombuffer(value, dtype="<i4")
        if arr.dtype != np.int32:  # big-endian host: convert once, then freeze
            arr = arr.astype(np.int32)
            arr.setflags(write=False)
        return self.check(arr, where)

    def to_wire(self, value):
        return value.astype("<i4", copy=False).tobytes()


class Geometry(Kind):
    """A ``KVGeometry``; a dict (``KVGeometry.to_dict()`` form) is accepted and parsed."""

    _SCALARS = (int, float, str, bool, type(None))

    def check(self, value, where):
        if isinstance(value, KVGeometry):
            return value
        if not isinstance(value, Mapping):
            _wrong_type(where, "a KVGeometry or its dict", value)
        for k, v in value.items():
            if not isinstance(k, str):
                fail(where, f"keys must be str, got {type(k).__name__} {short(k)}")
            if not isinstance(v, self._SCALARS):  # the parser str()s values: keep them flat
                _wrong_type(f"{where}.{k}", "a scalar", v)
        try:
            return KVGeometry.from_dict(value)
        except GeometryError as exc:
            fail(where, f"is invalid: {exc}")

    def to_wire(self, value):
        return value.to_dict()


@dataclass(frozen=True)
class Nested(Kind):
    """A ``Record`` inside a message (a map on the wire)."""

    cls: type

    def check(self, value, where):
        if not isinstance(value, self.cls):
            _wrong_type(where, f"a {self.cls.__name__}", value)
        return value

    def from_wire(self, value, where):
        return self.cls.from_wire(value, where)

    def to_wire(self, value):
        return value.to_wire()


# -- records -------------------------------------------------------------------------------
class Record:
    """Base of the frozen, slotted, self-validating dataclasses made by ``@record``.

    Subclasses declare fields as ``Annotated[type, Kind]``; ``_kinds`` maps each field
    name to its Kind. ``_validate`` (optional) checks rules across fields.
    """

    __slots__ = ()
    _kinds: typing.ClassVar[dict[str, Kind]] = {}
    # Declared only (no value, so dataclass() does not see a base field): ``@record`` sets it.
    __dataclass_fields__: typing.ClassVar[dict[str, Field[Any]]]

    def __post_init__(self) -> None:
        where = type(self).__name__
        for name, kind in self._kinds.items():
            value = getattr(self, name)
            checked = kind.check(value, f"{where}.{name}")
            if checked is not value:
                object.__setattr__(self, name, checked)
        self._validate()

    def _validate(self) -> None:
        """Cross-field rules; raise through ``self._bad(field, problem)``."""

    def _bad(self, name: str, problem: str) -> typing.NoReturn:
        fail(f"{type(self).__name__}.{name}", problem)

    def to_wire(self) -> dict[str, Any]:
        return {name: kind.to_wire(getattr(self, name)) for name, kind in self._kinds.items()}

    @classmethod
    def from_wire(cls, data: Any, where: str | None = None):
        """Strictly rebuild from a decoded msgpack map: every field present, none unknown."""
        where = where or cls.__name__
        if not isinstance(data, dict):
            _wrong_type(where, "a map of fields", data)
        missing = [n for n in cls._kinds if n not in data]
        if missing:
            fail(where, f"is missing field(s): {', '.join(missing)}")
        unknown = [k for k in data if k not in cls._kinds]
        if unknown:
            shown = ", ".join(short(k) for k in unknown[:8])
            fail(where, f"has unknown field(s): {shown}" + (" ..." if len(unknown) > 8 else ""))
        # Each from_wire returns exactly what check would store, so the constructor's
        # per-field pass would only repeat it: set the fields directly, then run the
        # cross-field rules.
        obj = object.__new__(cls)
        for name, kind in cls._kinds.items():
            object.__setattr__(obj, name, kind.from_wire(data[name], f"{where}.{name}"))
        try:
            obj._validate()
            return obj
        except LocalProtocolError as exc:
            if where == cls.__name__:
                raise
            raise LocalProtocolError(f"{where}: {exc}") from None

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        for name in self._kinds:
            a, b = getattr(self, name), getattr(other, name)
            if isinstance(a, np.ndarray):
                if not (a.dtype == b.dtype and np.array_equal(a, b)):
                    return False
            elif a != b:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]  # fields may be arrays / mappings

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={short(getattr(self, n))}" for n in self._kinds)
        return f"{type(self).__name__}({parts})"


_R = typing.TypeVar("_R", bound=Record)

if typing.TYPE_CHECKING:
    from typing_extensions import dataclass_transform
else:

    def dataclass_transform(**_kwargs):  # only type checkers need it (PEP 681)
        return lambda fn: fn


@dataclass_transform(frozen_default=True, eq_default=False)
def record(cls: type[_R]) -> type[_R]:
    """Make ``cls`` a frozen, slotted dataclass whose fields validate themselves."""
    cls = dataclass(frozen=True, slots=True, eq=False, repr=False)(cls)
    hints = typing.get_type_hints(cls, include_extras=True)
    kinds: dict[str, Kind] = {}
    for name in cls.__dataclass_fields__:
        extras = getattr(hints[name], "__metadata__", ())
        found = [k for k in extras if isinstance(k, Kind)]
        if len(found) != 1:
            raise TypeError(f"{cls.__name__}.{name} needs exactly one Kind in its Annotated type")
        kinds[name] = found[0]
    cls._kinds = kinds
    return cls
