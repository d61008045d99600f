"""KV geometry: what one rank's KV pool looks like, and which heads the rank owns.

Owns ``KVGeometry`` (model and pool format: layers, total KV heads, head dims, dtype,
page size, layout, MHA/MLA, pool capacity), ``RankPlacement`` (a geometry on one TP rank:
the heads it owns and the byte layout of its buffers), their msgpack-able dict forms, and
``check_compatible`` between a prefill and a decode geometry.

Sizes are always *derived from the geometry*, never inferred from byte lengths: that is
what makes SGLang's "Head slice size evaluates to zero" impossible here. This module
imports nothing heavy (no torch, no numpy).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sglang_kvxfer.errors import GeometryError, IncompatibleGeometryError

__all__ = [
    "DTYPE_ITEMSIZE",
    "Layout",
    "KVGeometry",
    "RankPlacement",
    "Compatibility",
    "owned_heads",
    "validate_tp",
    "check_compatible",
    "normalize_dtype",
    "GEOMETRY_SCHEMA_VERSION",
]

GEOMETRY_SCHEMA_VERSION = 1

# Canonical dtype names (torch spelling) -> bytes per element. fp8 types are 1 byte; the
# engine copies bits, so any 1/2/4-byte type works as long as both sides agree on the name.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "uint8": 1,
    "int8": 1,
}

_DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "f32": "float32",
    "fp16": "float16",
    "half": "float16",
    "f16": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e4m3fn": "float8_e4m3fn",
    "fp8_e4m3fnuz": "float8_e4m3fnuz",
    "fp8_e5m2": "float8_e5m2",
    "fp8_e5m2fnuz": "float8_e5m2fnuz",
}


def normalize_dtype(name: Any) -> str:
    """Canonical dtype name for ``name`` (a string such as ``"bf16"`` or a ``torch.dtype``)."""
    text = str(name)
    if text.startswith("torch."):
        text = text[len("torch.") :]
    key = text.strip().lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_ITEMSIZE:
        known = ", ".join(sorted(set(DTYPE_ITEMSIZE) | set(_DTYPE_ALIASES)))
        raise GeometryError(f"dtype={name!r} is not supported; use one of: {known}")
    return key


class Layout(str, enum.Enum):
    """Per-layer pool layout.

    NHD: ``[num_pages * page_size, heads, dim]`` (token-major; SGLang's MHA pool).
    HND: ``[num_pages, heads, page_size, dim]`` (head-major inside a page; vLLM's NIXL layout).
    HND_KV: ``[num_pages, heads, 2, page_size, dim]``: one buffer per layer holding K and V
    per (page, head) tile, the K rows of the page's tokens then their V rows (vLLM's CPU
    cache, which vLLM shapes ``[num_blocks, heads, block_size, 2 * head_dim]``: there
    ``[b, h, n, :head_dim]`` is *not* token n's key). Needs ``v_head_dim == head_dim``; not for
    MLA.
    NHD_KV: ``[num_pages, page_size, heads, head_dim + v_head_dim]``: one buffer per layer, each
    (token, head) its K row then its V row (vLLM's GPU cache in its default ``LBNHC`` layout,
    which vLLM hands over as the logical view ``[num_blocks, heads, block_size, head_dim +
    v_head_dim]`` with token-major strides). Not for MLA.
    """

    NHD = "NHD"
    HND = "HND"
    HND_KV = "HND_KV"
    NHD_KV = "NHD_KV"

    @classmethod
    def parse(cls, value: Any) -> Layout:
        if isinstance(value, Layout):
            return value
        text = str(value).strip().upper()
        try:
            return cls(text)
        except ValueError:
            raise GeometryError(
                f"layout={value!r} is not supported; use NHD, HND or HND_KV (vLLM CPU) or NHD_KV (vLLM GPU)"
            ) from None

    def __str__(self) -> str:  # "NHD", not "Layout.NHD", in messages and JSON
        return self.value


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise GeometryError(f"{name}={value!r} must be an integer")
    if value < minimum:
        raise GeometryError(f"{name}={value} must be >= {minimum}")
    return value


def validate_tp(total_kv_heads: int, tp_size: int, mla: bool = False, side: str = "") -> None:
    """Reject an (H, T) pair that no model parallel layout produces.

    T <= H needs T | H (each rank owns H/T heads); T > H needs H | T (T/H ranks replicate
    each head). MLA has one latent head replicated everywhere, so any T >= 1 is valid.
    """
    who = f"{side} " if side else ""
    _check_int(f"{who}tp_size", tp_size, 1)
    _check_int("total_kv_heads", total_kv_heads, 1)
    if mla:
        if total_kv_heads != 1:
            raise GeometryError(f"total_kv_heads={total_kv_heads} must be 1 for MLA (one latent head)")
        return
    if tp_size <= total_kv_heads:
        if total_kv_heads % tp_size:
            raise GeometryError(
                f"invalid {who}TP layout: total_kv_heads={total_kv_heads} is not divisible by "
                f"tp_size={tp_size} (with tp_size <= total_kv_heads, tp_size must divide total_kv_heads)"
            )
    elif tp_size % total_kv_heads:
        raise GeometryError(
            f"invalid {who}TP layout: tp_size={tp_size} is not a multiple of "
            f"total_kv_heads={total_kv_heads} (with tp_size > total_kv_heads, heads are replicated "
            f"and total_kv_heads must divide tp_size)"
        )


def owned_heads(total_kv_heads: int, tp_size: int, tp_rank: int, mla: bool = False) -> range:
    """Global KV heads held by ``tp_rank`` of a ``tp_size``-way group (QKVParallelLinear rule).

    T <= H: ``[r*H/T, (r+1)*H/T)``. T > H: the single head ``r // (T/H)``. MLA: head 0.
    """
    validate_tp(total_kv_heads, tp_size, mla)
    _check_int("tp_rank", tp_rank, 0)
    if tp_rank >= tp_size:
        raise GeometryError(f"tp_rank={tp_rank} must be < tp_size={tp_size}")
    if mla:
        return range(0, 1)
    if tp_size <= total_kv_heads:
        per = total_kv_heads // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per)
    head = tp_rank // (tp_size // total_kv_heads)
    return range(head, head + 1)


@dataclass(frozen=True)
class KVGeometry:
    """The KV cache of a model as one rank's pool stores it.

    Args:
        num_layers: KV layers in the pool.
        total_kv_heads: un-sharded KV head count of the model (1 for MLA).
        head_dim: K head dim (MLA: the latent width, e.g. 512 + 64 = 576).
        v_head_dim: V head dim; ``None`` means equal to ``head_dim``. MLA pools have no V
            buffer: use 0 (the default for ``mla=True``). 0 with ``mla=False``: sharded heads
            with K buffers only (NHD or HND), as a mamba state row sliced over TP is moved.
        dtype: element type name (``bfloat16``, ``float16``, ``float32``, ``float8_e4m3fn``...).
        page_size: tokens per page.
        layout: ``NHD``, ``HND``, ``HND_KV`` or ``NHD_KV`` (see ``Layout``).
        mla: True for an MLA latent cache (one buffer per layer, replicated on all ranks).
        num_pages: pool capacity in pages per layer buffer (may differ between ranks).
    """

    num_layers: int
    total_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    page_size: int = 16
    layout: Layout = Layout.NHD
    mla: bool = False
    v_head_dim: int | None = None
    num_pages: int = 1024
    itemsize: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.mla, bool):
            raise GeometryError(f"mla={self.mla!r} must be a bool")
        _check_int("num_layers", self.num_layers, 1)
        _check_int("total_kv_heads", self.total_kv_heads, 1)
        _check_int("head_dim", self.head_dim, 1)
        _check_int("page_size", self.page_size, 1)
        _check_int("num_pages", self.num_pages, 1)
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        object.__setattr__(self, "layout", Layout.parse(self.layout))
        object.__setattr__(self, "itemsize", DTYPE_ITEMSIZE[self.dtype])
        if self.mla:
            if self.layout in (Layout.HND_KV, Layout.NHD_KV):
                raise GeometryError(
                    f"layout={self.layout} is not valid with mla=True ({self.layout} packs K and V in one "
                    "buffer; an MLA latent cache has no V): use NHD or HND"
                )
            if self.total_kv_heads != 1:
                raise GeometryError(f"total_kv_heads={self.total_kv_heads} must be 1 for MLA (one latent head)")
            if self.v_head_dim is None:
                object.__setattr__(self, "v_head_dim", 0)
            elif self.v_head_dim != 0:
                raise GeometryError(
                    f"v_head_dim={self.v_head_dim!r} must be 0 for MLA (the latent cache has no V buffer)"
                )
        else:
            if self.v_head_dim is None:
                object.__setattr__(self, "v_head_dim", self.head_dim)
            _check_int("v_head_dim", self.v_head_dim, 0)
            if self.v_head_dim == 0 and self.packed_kv:
                raise GeometryError(
                    f"v_head_dim=0 (K only) is not valid with layout={self.layout}, which packs K and V in "
                    "one buffer: use NHD or HND"
                )
            if self.layout is Layout.HND_KV and self.v_head_dim != self.head_dim:
                raise GeometryError(
                    f"v_head_dim={self.v_head_dim} must equal head_dim={self.head_dim} for layout=HND_KV "
                    "(K and V rows share each (page, head) tile of one buffer)"
                )

    # -- derived sizes -------------------------------------------------------------------
    @property
    def _v_dim(self) -> int:
        """``v_head_dim`` as resolved by ``__post_init__`` (never None after construction)."""
        v = self.v_head_dim
        if v is None:
            raise GeometryError("v_head_dim was not resolved; construct KVGeometry normally")
        return v

    @property
    def has_v(self) -> bool:
        return self._v_dim > 0

    @property
    def packed_kv(self) -> bool:
        """True when one buffer per layer holds both K and V (``HND_KV``, ``NHD_KV``)."""
        return self.layout in (Layout.HND_KV, Layout.NHD_KV)

    @property
    def num_buffers(self) -> int:
        """KV buffers per rank: K_0..K_{L-1} then V_0..V_{L-1} (MLA, HND_KV, NHD_KV: one per layer)."""
        return self.num_layers * (2 if self.has_v and not self.packed_kv else 1)

    def buffer_dim(self, buffer_index: int) -> int:
        """Head dim of buffer ``buffer_index`` (K buffers first, then V; HND_KV, NHD_KV: the K dim)."""
        if not 0 <= buffer_index < self.num_buffers:
            raise GeometryError(f"buffer_index={buffer_index} must be in [0, {self.num_buffers})")
        return self.head_dim if buffer_index < self.num_layers else self._v_dim

    def placement(self, tp_size: int, tp_rank: int, all_heads: bool = False) -> RankPlacement:
        return RankPlacement(self, tp_size, tp_rank, all_heads)

    # -- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": GEOMETRY_SCHEMA_VERSION,
            "num_layers": self.num_layers,
            "total_kv_heads": self.total_kv_heads,
            "head_dim": self.head_dim,
            "v_head_dim": self.v_head_dim,
            "dtype": self.dtype,
            "page_size": self.page_size,
            "layout": self.layout.value,
            "mla": self.mla,
            "num_pages": self.num_pages,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVGeometry:
        fields = _check_schema("KVGeometry", data, _GEOMETRY_FIELDS)
        return cls(**fields)


_GEOMETRY_FIELDS = (
    "num_layers",
    "total_kv_heads",
    "head_dim",
    "v_head_dim",
    "dtype",
    "page_size",
    "layout",
    "mla",
    "num_pages",
)


def _check_schema(what: str, data: Mapping[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise GeometryError(f"{what} must be a dict, got {type(data).__name__}")
    schema = data.get("schema")
    if schema != GEOMETRY_SCHEMA_VERSION:
        raise GeometryError(
            f"{what} schema={schema!r} is not supported (this engine reads schema "
            f"{GEOMETRY_SCHEMA_VERSION}); upgrade the older side"
        )
    missing = [n for n in names if n not in data]
    if missing:
        raise GeometryError(f"{what} is missing field(s): {', '.join(missing)}")
    unknown = sorted(set(data) - set(names) - {"schema"})
    if unknown:
        raise GeometryError(f"{what} has unknown field(s): {', '.join(map(str, unknown))}")
    return {n: data[n] for n in names}


@dataclass(frozen=True)
class RankPlacement:
    """A geometry on one TP rank: the heads it owns and the byte layout of its buffers.

    Buffers are numbered as SGLang's ``kv_data_ptrs``: K of layers 0..L-1, then V of layers
    0..L-1 (MLA: one latent buffer per layer; HND_KV: one K-and-V buffer per layer). Every
    buffer of a kind has the same shape: NHD ``[num_pages * page_size, local_heads, dim]``,
    HND ``[num_pages, local_heads, page_size, dim]``, HND_KV ``[num_pages, local_heads, 2,
    page_size, dim]``, NHD_KV ``[num_pages, page_size, local_heads, head_dim + v_head_dim]``.

    ``heads`` are the heads the rank owns as TP rank ``tp_rank`` of ``tp_size`` (what a plan
    moves from or to it); ``stored_heads`` the heads its pool holds, in order (``local_heads``
    above). They are the same except with ``all_heads``: a pool of every KV head of the model
    on a rank that sends only the heads of its TP rank (SGLang's CP-TP group sharing, where
    prefill CP rank r holds the whole KV and transfers as TP rank r).
    """

    geometry: KVGeometry
    tp_size: int
    tp_rank: int
    all_heads: bool = False
    heads: range = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.geometry, KVGeometry):
            raise GeometryError(f"geometry must be a KVGeometry, got {type(self.geometry).__name__}")
        if not isinstance(self.all_heads, bool):
            raise GeometryError(f"all_heads={self.all_heads!r} must be a bool")
        g = self.geometry
        object.__setattr__(self, "heads", owned_heads(g.total_kv_heads, self.tp_size, self.tp_rank, g.mla))

    @property
    def stored_heads(self) -> range:
        """The global heads this rank's pool holds, in pool order."""
        return range(0, 1 if self.geometry.mla else self.geometry.total_kv_heads) if self.all_heads else self.heads

    @property
    def num_local_heads(self) -> int:
        """Heads per token in this rank's buffers (``stored_heads``)."""
        return len(self.stored_heads)

    def buffer_shape(self, buffer_index: int) -> tuple[int, ...]:
        g = self.geometry
        dim = g.buffer_dim(buffer_index)
        if g.layout is Layout.NHD:
            return (g.num_pages * g.page_size, self.num_local_heads, dim)
        if g.layout is Layout.HND_KV:
            return (g.num_pages, self.num_local_heads, 2, g.page_size, dim)
        if g.layout is Layout.NHD_KV:
            return (g.num_pages, g.page_size, self.num_local_heads, dim + g._v_dim)
        return (g.num_pages, self.num_local_heads, g.page_size, dim)

    def buffer_nbytes(self, buffer_index: int) -> int:
        n = self.geometry.itemsize
        for s in self.buffer_shape(buffer_index):
            n *= s
        return n

    def page_nbytes(self, buffer_index: int) -> int:
        """Bytes of one page of one buffer (SGLang's ``kv_item_lens`` entry; HND_KV, NHD_KV: K and V)."""
        return self.buffer_nbytes(buffer_index) // self.geometry.num_pages

    def to_dict(self) -> dict[str, Any]:
        out = {
            "schema": GEOMETRY_SCHEMA_VERSION,
            "geometry": self.geometry.to_dict(),
            "tp_size": self.tp_size,
            "tp_rank": self.tp_rank,
        }
        if self.all_heads:  # (only when set: a reader of the plain form keeps reading it)
            out["all_heads"] = True
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankPlacement:
        optional = ("all_heads",) if isinstance(data, Mapping) and "all_heads" in data else ()
        fields = _check_schema("RankPlacement", data, ("geometry", "tp_size", "tp_rank", *optional))
        return cls(
            KVGeometry.from_dict(fields["geometry"]),
            fields["tp_size"],
            fields["tp_rank"],
            fields.get("all_heads", False),
        )


# Fields that must agree between prefill and decode, with what to fix when they do not.
_MUST_MATCH: tuple[tuple[str, str], ...] = (
    ("mla", "both sides must run the same attention type (MHA vs MLA) of the same model"),
    ("num_layers", "both sides must serve the same model (same number of KV layers)"),
    ("total_kv_heads", "both sides must serve the same model; pass the model's un-sharded KV head count"),
    ("head_dim", "both sides must serve the same model (same K head dim)"),
    ("v_head_dim", "both sides must serve the same model (same V head dim)"),
    ("dtype", "set the same KV cache dtype on both servers"),
)


@dataclass(frozen=True)
class Compatibility:
    """Result of ``check_compatible``: the sides agree; these are the differences the
    staged data path absorbs (page size, layout)."""

    page_size_differs: bool
    layout_differs: bool

    @property
    def reformat_needed(self) -> bool:
        return self.page_size_differs or self.layout_differs


def check_compatible(prefill: KVGeometry, decode: KVGeometry) -> Compatibility:
    """Check that KV produced with ``prefill`` can be consumed with ``decode``.

    Raises ``IncompatibleGeometryError`` listing every differing field with both values
    and what to fix. Page size and layout may differ; the result records whether they do.
    """
    for name, geo in (("prefill", prefill), ("decode", decode)):
        if not isinstance(geo, KVGeometry):
            raise GeometryError(f"{name} must be a KVGeometry, got {type(geo).__name__}")
    mismatches = [
        (name, getattr(prefill, name), getattr(decode, name), hint)
        for name, hint in _MUST_MATCH
        if getattr(prefill, name) != getattr(decode, name)
    ]
    if mismatches:
        raise IncompatibleGeometryError(mismatches)
    return Compatibility(
        page_size_differs=prefill.page_size != decode.page_size,
        layout_differs=prefill.layout != decode.layout,
    )
