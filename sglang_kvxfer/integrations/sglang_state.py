"""SGLang's extra per-request state (``KVArgs.state_types``) as engine pools of their own.

Owns ``StatePool`` (one engine pool of a rank's state: a component of ``state_types``, or a
run of its entries of one row size), ``states_from_kv_args`` (the translation, every refusal
naming the KVArgs field), ``state_pages`` (a request's ``state_indices``, checked) and
``state_problem`` (why two servers' state pools cannot exchange a request), and ``kv_page_pools``
(a DeepSeek-V4 ``kv_layout`` pool's KV entries as whole pages). Each pool is moved
by an engine manager of its own (``kv_pool=StatePool.name``), one engine request per SGLang
request over the pool's own indices, so validation at registration, deadlines, failures and
head re-sharding are the engine's. Must not import sglang or torch.

What each type SGLang 0.5.23 hands a backend becomes (``disaggregation/utils.py``
``setup_state_kv_args``; the indices come from its schedulers' payloads):

- ``swa``: ``SWAKVPool``'s sliding-window sub-pool: K of every SWA layer, then V, paged by
  SWA page ids (a request's last window, ``_swa_payload``). MHA: a geometry of the SWA heads
  (the count SGLang sizes the sub-pool with: ``swa_num_key_value_heads`` for the models whose
  pool uses it, else the model's; from the model config, never from bytes), head dims from
  ``state_item_lens``, the pool's page size, NHD; so a TP mismatch re-shards its heads
  exactly as the model's KV. An MLA sub-pool: one latent per layer, replicated.
- ``dsa``: DSA's indexer buffers (one per layer, one row of bytes per KV page id,
  ``_dsa_pages_payload``), replicated on every rank like the MLA latent: a replicated
  geometry with one row per index (``page_size=1``, ``head_dim`` = bytes of a row, ``uint8``).
  Layers without an indexer buffer (``skip_topk``, empty entries) are left out.
- ``dsa_tail``: a DSA indexer's kpool-compression tails (``index_kpool_compress``, GLM-5-style):
  per layer a K and a score ring ``[request slots, ring tokens, index_head_dim]`` (bf16; K
  tails of every layer, then score tails), one item per request slot. A request's indices are
  SGLang's six numbers (slot, offset, count, offset, count, ring size: the live tokens of the
  open pool, ``get_dsa_tail_state_indices``; none when it is closed), so the pool has one row
  per ring token (its bytes: ``index_head_dim`` x 2 from the model config, never from bytes)
  and a request's rows are its live tokens in order; the two sides' rings may differ in size
  (speculative slots), their live tokens are paired in order, as SGLang's
  ``build_dsa_tail_transfer_blocks`` pairs them. Replicated like the DSA indexer.
- ``block_scale`` / ``block_scale_swa``: an MXFP8 KV cache's (``--kv-cache-dtype mxfp8``)
  UE8M0 scale buffers of the full-attention pool and of the SWA sub-pool (K scales of every
  layer, then V), one row of a page's scales per KV page id (the request's pages from its
  first token, ``_full_kv_pages_payload``; the SWA window's pages, ``_swa_payload``). The
  rows span the rank's KV heads (SGLang swizzles them for a page size of 128), so they move
  rank to rank between equal attention TP sizes only, as SGLang's own backends move them.
- ``minimax_index_k`` / ``minimax_dense_kv``: a MiniMax sparse-attention pool's
  (``MiniMaxSparseKVPool``) index K of its K-only sparse layers (one buffer per layer, one
  row of a page's index keys per KV page id; the request's KV pages after the decode's prefix,
  ``minimax_index_transfer_pages``) and its dense layers' K, then V (one page of rows per KV
  page id, the pages from the request's first token, ``_full_kv_pages_payload``; without
  hierarchical sparse attention these are the main KV pool's own buffers of those layers).
  Both span the rank's heads and move rank to rank between equal attention TP sizes only,
  with PP 1, as SGLang's own backends move them (it refuses both otherwise).
- ``qsa_pending`` / ``qsa_compressed``: a QSA model's (``QSATokenToKVPool``, Qwen4-Exp) indexer
  state, one index head replicated on every rank: per QSA layer the pending key ring of a
  request slot (``compress_ratio`` rows; then the layer-independent RoPE position ring), one
  item per request slot (the request's row, ``get_qsa_pending_state_indices``), and per QSA
  layer the compressed keys, one item per KV page (one page's groups; the request's KV pages
  from its first token). Replicated like the DSA indexer: any TP pair, one writer per decode
  rank. Entries are paired by position, so both sides list the same QSA layers (with PP: stage
  to stage, or each stage's into its slice of a decode of PP 1, the RoPE ring, which every
  stage holds whole, from each: ``shared``; a stage without a QSA layer, whose components
  SGLang leaves empty, is refused).
- DeepSeek-V4 (``DeepSeekV4TokenToKVPool``, a ``KVArgs.kv_layout`` pool; MLA: every row is
  replicated over attention TP, any TP pair, one writer per decode rank): its ``swa`` component
  is a list of entries of their own sizes (the SWA KV of every layer, one item an SWA page,
  then the C4 compressor and indexer state, one item an SWA page's ring), one row per entry
  and SWA page id (the window's pages); ``swa_ring`` (unified KV: one row per ring row of
  every layer, the window's positions ``req_pool_idx * ring + pos % ring``), ``c128_state``
  (the request-scoped C128 compressor ring page or online row: none at a block boundary,
  ``request_state_transfer_indices``) and ``request_row`` (a draft's SWA valid-from mark, the
  request's row) are rows of their own sizes. Each run of entries of one row size is a pool.
- ``mamba``: the conv and SSM state of the mamba pool (tensor-major, one entry per layer, one
  row per request slot, ``_mamba_payload``). An entry sliced over attention TP
  (``state_dim_per_tensor`` > 0: ``state_slice_outer_counts`` rows of that many channels,
  each channel a run of bytes) is a K-only MHA geometry whose "heads" are the un-sharded
  channels, ``page_size`` 1, one page per outer row of the slot: so a TP mismatch re-slices
  the channels exactly as the model's KV heads are. GDN's conv row ``[q|k|v]``
  (``state_conv_shard_groups``, each sub-block sharded on its own) is one such pool per
  sub-block, its buffers starting at the sub-block and its pages counted in sub-block
  widths (so every sub-block must divide the row: otherwise, and without per-tensor dims,
  the rows move whole between equal TP sizes only). A replicated entry (dim 0) is one row
  replicated on every rank. One pool per run of consecutive entries of one shape.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from sglang_kvxfer.errors import GeometryError
from sglang_kvxfer.geometry import KVGeometry, owned_heads
from sglang_kvxfer.integrations.sglang_args import _get, _int, _not_supported, _pool_geometry

__all__ = [
    "HANDLED_STATE_TYPES",
    "SCALE_KINDS",
    "MINIMAX_KINDS",
    "QSA_KINDS",
    "DSV4_KINDS",
    "KV_PAGES",
    "StatePool",
    "kv_page_pools",
    "states_from_kv_args",
    "state_pages",
    "state_problem",
    "describe",
    "row_geometry",
]

HANDLED_STATE_TYPES = (
    "mamba", "swa", "dsa", "dsa_tail", "block_scale", "block_scale_swa", "minimax_index_k", "minimax_dense_kv",
    "qsa_pending", "qsa_compressed", "swa_ring", "c128_state", "request_row",
)  # fmt: skip
SCALE_KINDS = ("block_scale", "block_scale_swa")  # an MXFP8 KV cache's block scales
MINIMAX_KINDS = ("minimax_index_k", "minimax_dense_kv")  # a MiniMax sparse-attention pool's state
QSA_KINDS = ("qsa_pending", "qsa_compressed")  # a QSA indexer's state (one index head: replicated)
DSV4_KINDS = ("swa_ring", "c128_state", "request_row")  # a DeepSeek-V4 pool's request-addressed state
KV_PAGES = "kv_pages"  # a kv_layout pool's KV entries past its first run of one page size (moved as state)

_MAMBA_NO_DIMS = (
    "mamba conv/SSM state rows are sharded over attention TP, and this server's KVArgs.state_dim_per_tensor "
    "does not say how (SGLang leaves it empty with --enable-unified-memory), so they cannot be re-sliced"
)
_DSA_TP = (
    "the DSA indexer of a non-MLA model is not replicated over attention TP, and SGLang's own backends "
    "refuse it between TP sizes too ('does NOT support PD different TP sizes for non-MLA DSA hybrid models')"
)
_SCALE_TP = (
    "a page's MXFP8 block scales are one row over the rank's KV heads (swizzled for a page size of 128), not "
    "re-sliced between TP sizes, and SGLang's own backends refuse them between TP sizes too ('does NOT support "
    "PD different TP sizes for non-MLA BLOCK_SCALE hybrid models')"
)
_MINIMAX_TP = (
    "a MiniMax sparse pool's index keys and dense-layer KV are page rows of the rank's own heads, not re-sliced "
    "between TP sizes, and SGLang refuses MiniMax sparse PD between attention TP sizes too ('MiniMax sparse PD "
    "requires matching attention TP sizes')"
)


@dataclass(frozen=True)
class StatePool:
    """One engine pool of a rank's extra per-request state."""

    name: str  # the kv_pool of its engine manager: "state:swa", "state:mamba.1"
    kind: str  # one of HANDLED_STATE_TYPES, or KV_PAGES
    index: int  # its component of KVArgs.state_types: its indices are state_indices[index] (KV_PAGES: -1)
    label: str  # how failures name it
    geometry: KVGeometry
    ptrs: tuple[int, ...]  # the geometry's buffers (SWA: K of every layer, then V)
    lens: tuple[int, ...]
    equal_tp_only: str = ""  # why the two sides must have one attention TP size ("": any sizes)
    # (stride, step, count): a request's index i is the pages i * stride + o * step, o < count
    # (a sliced mamba slot: one page per outer row, in sub-block widths); else the index itself
    slot_pages: tuple[int, int, int] = (1, 0, 1)
    ring: int = 0  # dsa_tail: the tokens of a request slot's ring (a request's index: its live tokens)
    # every PP stage registers this pool whole (QSA's RoPE position ring, layer-independent): a
    # decode of PP 1 receives it from each stage, as SGLang's backends pair it by its layer id
    shared: bool = False


def _type_name(value: Any) -> str:
    return str(getattr(value, "value", value))


def _component(args: Any, name: str, i: int, count: int) -> list:
    seq = _get(args, name, None)
    if seq is None or len(seq) != count:
        got = "unset" if seq is None else f"{len(seq)} components"
        raise GeometryError(f"KVArgs.{name} is {got}; KVArgs.state_types has {count}")
    return list(seq[i] or [])


def states_from_kv_args(
    args: Any,
    *,
    tp_size: int,
    rank: int,
    mla: bool,
    dtype: str,
    page_size: int,
    swa_kv_heads: Callable[[], int] | None = None,
    dsa_index_head_dim: Callable[[], int] | None = None,
) -> tuple[StatePool, ...]:
    """The state pools of ``KVArgs`` (empty without ``state_types``).

    ``swa_kv_heads`` is called for the un-sharded KV head count of the SWA sub-pool (the
    model's config; KVArgs carries only the full-attention layers' count), and
    ``dsa_index_head_dim`` for the DSA indexer's head dim (a ``dsa_tail`` token's width). A type this
    backend does not move, or fields that do not describe whole rows or heads, raise
    ``KVXferError`` / ``GeometryError`` naming the field.
    """
    names = [_type_name(t) for t in (_get(args, "state_types", None) or [])]
    for i, name in enumerate(names):
        if name not in HANDLED_STATE_TYPES:
            raise _not_supported(
                f"KVArgs.state_types[{i}]",
                name,
                f"the backend moves {', '.join(HANDLED_STATE_TYPES)} state only (types {names}); "
                f"transferring {name!r} state is not implemented",
            )
    # DeepSeek-V4 NextN: SGLang appends the draft's SWA (or SWA ring) component after the
    # target's, paired by position on both sides; its pools are named by component index
    if len(set(names)) != len(names) and _get(args, "kv_layout", None) is None:
        raise GeometryError(f"KVArgs.state_types={names} names a type twice")
    pools: list[StatePool] = []
    for i, kind in enumerate(names):
        again = kind in names[:i]
        ptrs, lens, items = (
            _component(args, f"state_{n}", i, len(names)) for n in ("data_ptrs", "data_lens", "item_lens")
        )
        if not ptrs and kind in QSA_KINDS:  # (SGLang's QSATokenToKVPool on a PP stage without a QSA layer)
            raise GeometryError(
                f"KVArgs.state_data_ptrs[{i}] ({kind}) is empty: this PP stage holds no QSA layer, and PP stages "
                "with and without QSA state are not implemented by the kvxfer backend (give every stage a QSA "
                "layer with SGLANG_PP_LAYER_PARTITION)"
            )
        if not ptrs or not len(ptrs) == len(lens) == len(items):
            raise GeometryError(
                f"KVArgs.state_data_ptrs[{i}]/state_data_lens[{i}]/state_item_lens[{i}] ({kind}) have "
                f"{len(ptrs)}/{len(lens)}/{len(items)} entries; they must match and be non-empty"
            )
        if again and kind not in ("swa", *DSV4_KINDS):
            raise GeometryError(f"KVArgs.state_types={names} names {kind!r} twice (a DeepSeek-V4 draft adds swa rows)")
        if again:  # (a DeepSeek-V4 draft's: rows, as the target's; "state:swa_3.0")
            made = _row_pools(i, kind, ptrs, lens, items, "")
            pools += [replace(p, name=p.name.replace(f"state:{kind}", f"state:{kind}_{i}", 1)) for p in made]
        elif kind == "swa" and _get(args, "kv_layout", None) is not None:  # DeepSeek-V4: per-entry rows
            pools += _row_pools(i, kind, ptrs, lens, items, "")
        elif kind == "swa":
            pools.append(_swa_pool(args, i, ptrs, lens, items, tp_size, rank, mla, dtype, page_size, swa_kv_heads))
        elif kind == "mamba":
            pools += _mamba_pools(args, i, ptrs, lens, items, tp_size)
        elif kind == "dsa_tail":
            pools += _tail_pools(i, ptrs, lens, items, mla, dsa_index_head_dim)
        elif kind in MINIMAX_KINDS:  # (MiniMax's attention is MHA: never replicated over TP)
            pools += _row_pools(i, kind, ptrs, lens, items, _MINIMAX_TP)
        elif kind == "qsa_pending":  # (one index head: every rank holds the same rows)
            pools += _qsa_pending_pools(args, i, ptrs, lens, items)
        elif kind in (*QSA_KINDS, *DSV4_KINDS):  # (one index head / an MLA pool: every rank holds the same rows)
            pools += _row_pools(i, kind, ptrs, lens, items, "")
        else:
            why = _DSA_TP if kind == "dsa" else _SCALE_TP
            pools += _row_pools(i, kind, ptrs, lens, items, "" if mla else why)
    return tuple(pools)


def _from_config(read: Callable[[], int] | None, what: str) -> Any:
    """``what``, read from the model config by ``read``; ``GeometryError`` saying why not."""
    if read is None:
        raise GeometryError(f"{what} is needed, and no model config was given")
    try:
        return read()
    except Exception as exc:
        raise GeometryError(f"the model config could not supply {what} ({type(exc).__name__}: {exc})") from exc


def _swa_pool(
    args: Any,
    i: int,
    ptrs: list,
    lens: list,
    items: list,
    tp_size: int,
    rank: int,
    mla: bool,
    dtype: str,
    page_size: int,
    swa_kv_heads: Callable[[], int] | None,
) -> StatePool:
    layout = _get(args, "swa_kv_cache_layout", None)
    sub_mla = mla and layout is None  # an MLA sub-pool (SGLang sets the layout for MHA ones only)
    if not sub_mla and layout != "nhd":
        raise _not_supported(
            "KVArgs.swa_kv_cache_layout",
            layout,
            "the SWA sub-pool is moved as an NHD MHA pool ([tokens, heads, head_dim] per layer, K then V) or an "
            "MLA one; other SWA layouts (hnd, vectorized_5d, per-entry state lists such as DeepSeek-V4's) are "
            "not implemented",
        )
    if sub_mla:
        heads_total, local = 1, 1
    else:
        if len(ptrs) % 2:
            raise GeometryError(
                f"KVArgs.state_data_ptrs[{i}] (swa) has {len(ptrs)} entries; an MHA SWA sub-pool has K and V "
                "of every SWA layer (an even count)"
            )
        heads_total = _int(
            "the SWA layers' total KV heads", _from_config(swa_kv_heads, "the SWA layers' KV head count"), 1
        )
        try:
            local = len(owned_heads(heads_total, tp_size, rank))
        except GeometryError as exc:
            raise GeometryError(f"the SWA layers' KV heads on attention TP {tp_size}: {exc}") from None
    for e, p in enumerate(ptrs):
        _int(f"KVArgs.state_data_ptrs[{i}][{e}]", p, 1)
    geometry = _pool_geometry(
        "SWA ",
        0,
        items,
        lens,
        mla=sub_mla,
        heads_total=heads_total,
        local=local,
        page_size=page_size,
        dtype=dtype,
        items_field=f"state_item_lens[{i}]",
        lens_field=f"state_data_lens[{i}]",
    )
    label = f"SWA state (KVArgs.state_types[{i}]='swa')"
    return StatePool("state:swa", "swa", i, label, geometry, tuple(ptrs), tuple(lens))


def _field(i: int, name: str) -> str:
    """KVArgs field ``name`` (``data_ptrs``...) of state component ``i``; ``i`` -1: the KV's."""
    return f"kv_{name}" if i < 0 else f"state_{name}[{i}]"


def _entry(i: int, kind: str, e: int, ptrs: list, lens: list, items: list) -> None:
    """Entry ``e`` of a non-empty row buffer: an address and at least one row."""
    _int(f"KVArgs.{_field(i, 'data_ptrs')}[{e}]", ptrs[e], 1)
    if _int(f"KVArgs.{_field(i, 'data_lens')}[{e}]", lens[e], 0) < items[e]:
        raise GeometryError(
            f"KVArgs.{_field(i, 'data_lens')}[{e}]={lens[e]} ({kind}) holds no row of "
            f"{_field(i, 'item_lens')}[{e}]={items[e]}"
        )


def _run_rows(i: int, kind: str, run: list[int], lens: list, items: list, what: str) -> int:
    """The rows every entry of ``run`` holds (one count, else ``GeometryError``)."""
    rows = {lens[e] // items[e] for e in run}
    if len(rows) > 1:
        raise GeometryError(
            f"KVArgs.{_field(i, 'data_lens')} // {_field(i, 'item_lens')} ({kind}): entries {run[0]}..{run[-1]} "
            f"hold {sorted(rows)} rows; the entries of one {what} must hold the same rows"
        )
    return rows.pop()


def row_geometry(layers: int, row_bytes: int, rows: int) -> KVGeometry:
    """One row per index as one replicated "head" (page size 1, ``uint8``): mamba rows rank to
    rank at equal TP or replicated, DSA rows."""
    return KVGeometry(
        num_layers=layers, total_kv_heads=1, head_dim=row_bytes, dtype="uint8", page_size=1, mla=True, num_pages=rows
    )


def _row_pools(i: int, kind: str, ptrs: list, lens: list, items: list, why: str) -> list[StatePool]:
    """Pools of one row per index: a run of consecutive non-empty entries of one row size each
    (entries tensor-major, one per layer: mamba's conv rows, then its SSM rows...)."""
    runs: list[list[int]] = []
    for e, item in enumerate(items):
        _int(f"KVArgs.{_field(i, 'item_lens')}[{e}]", item, 0)
        if item == 0:  # no buffer (a DSA layer reusing another's top-k): nothing to move
            continue
        _entry(i, kind, e, ptrs, lens, items)
        if runs and items[runs[-1][-1]] == item:  # (an empty entry between does not end a run)
            runs[-1].append(e)
        else:
            runs.append([e])
    if not runs:
        raise GeometryError(f"KVArgs.{_field(i, 'item_lens')} ({kind}) has no non-empty entry: {items}")
    what = {
        "mamba": "mamba state",
        "dsa": "DSA indexer state",
        "dsa_tail": "DSA indexer tails",
        "block_scale": "MXFP8 KV block scales",
        "block_scale_swa": "MXFP8 SWA KV block scales",
        "minimax_index_k": "MiniMax sparse index keys",
        "minimax_dense_kv": "MiniMax dense-layer KV",
        "qsa_pending": "QSA pending key and RoPE rings",
        "qsa_compressed": "QSA compressed keys",
        "swa": "DeepSeek-V4 SWA KV and compressor state",
        "swa_ring": "DeepSeek-V4 SWA ring rows",
        "c128_state": "DeepSeek-V4 request-scoped compressor state",
        "request_row": "DeepSeek-V4 request rows",
        KV_PAGES: "compressed KV pages",
    }[kind]
    out = []
    for g, run in enumerate(runs):
        geometry = row_geometry(len(run), items[run[0]], _run_rows(i, kind, run, lens, items, "row size"))
        name = f"state:{kind}" if len(runs) == 1 else f"state:{kind}.{g}"
        field = f"KVArgs.state_types[{i}]={kind!r}" if i >= 0 else "kv_data_ptrs"
        label = f"{what} ({field}, entries {run[0]}..{run[-1]}: rows of {items[run[0]]} bytes)"
        out.append(
            StatePool(name, kind, i, label, geometry, tuple(ptrs[e] for e in run), tuple(lens[e] for e in run), why)
        )
    return out


QSA_ROPE_LAYER_ID = (1 << 32) - 2  # SGLang's QSA_ROPE_STATE_LAYER_ID: the RoPE ring's entry


def _qsa_pending_pools(args: Any, i: int, ptrs: list, lens: list, items: list) -> list[StatePool]:
    """A ``qsa_pending`` component: its key rings (one run per row size) and its RoPE position
    ring (the entry whose ``state_layer_ids`` is SGLang's ``QSA_ROPE_STATE_LAYER_ID``; every PP
    stage holds it whole: ``shared``), each a pool of its own even where their rows are of one size."""
    ids = _per_entry(args, "state_layer_ids", i, len(items), None)
    rope = [e for e, lid in enumerate(ids) if lid == QSA_ROPE_LAYER_ID]
    if not rope:  # (no layer ids: the pools by row size, the RoPE ring not known)
        return _row_pools(i, "qsa_pending", ptrs, lens, items, "")
    keys = [0 if e in rope else item for e, item in enumerate(items)]
    rings = [item if e in rope else 0 for e, item in enumerate(items)]
    pools = _row_pools(i, "qsa_pending", ptrs, lens, keys, "") if any(keys) else []
    pools += [replace(p, shared=True) for p in _row_pools(i, "qsa_pending", ptrs, lens, rings, "")]
    return [replace(p, name=f"state:qsa_pending.{g}") for g, p in enumerate(pools)]


def _tail_pools(
    i: int, ptrs: list, lens: list, items: list, mla: bool, index_head_dim: Callable[[], int] | None
) -> list[StatePool]:
    """A ``dsa_tail`` component: rows of one ring token (``index_head_dim`` bf16 values) over
    each non-empty entry's ``[slots, ring, index_head_dim]`` buffer."""
    dim = _from_config(index_head_dim, "the DSA indexer's index_head_dim")
    token = 2 * _int("the DSA indexer's index_head_dim (model config)", dim, 1)  # bf16 tails
    rings = set()
    for e, item in enumerate(items):
        if _int(f"KVArgs.state_item_lens[{i}][{e}]", item, 0) and item % token:
            raise GeometryError(
                f"KVArgs.state_item_lens[{i}][{e}]={item} (dsa_tail) is not a whole ring of tail tokens of {token} "
                f"bytes (the model's index_head_dim {dim}, bf16)"
            )
        if item:
            rings.add(item // token)
    if len(rings) > 1:
        raise GeometryError(
            f"KVArgs.state_item_lens[{i}] (dsa_tail) holds rings of {sorted(rings)} tokens; every layer's ring "
            "has one size"
        )
    rows = [token if item else 0 for item in items]
    pools = _row_pools(i, "dsa_tail", ptrs, lens, rows, "" if mla else _DSA_TP)
    return [replace(p, ring=next(iter(rings))) for p in pools]


def _tail_rows(index: np.ndarray, ring: int, where: str) -> np.ndarray:
    """A ``dsa_tail`` index (SGLang's slot, offset, count, offset, count, ring size; empty when
    the request has no open pool) as the rows of its live tokens, in order."""
    if index.size == 0:
        return index
    if index.size != 6:
        raise ValueError(
            f"{where} must be SGLang's six numbers (slot, offset, count, offset, count, ring size) or none, "
            f"got {index.size}"
        )
    slot, off1, n1, off2, n2, size = (int(x) for x in index)
    if size != ring:
        raise ValueError(
            f"{where} names a ring of {size} tokens; this server's rings (KVArgs.state_item_lens) hold {ring}"
        )
    if slot < 0 or min(off1, n1, off2, n2) < 0 or off1 + n1 > ring or off2 + n2 > ring:
        raise ValueError(f"{where}={index.tolist()} is not a slot and two segments inside a ring of {ring} tokens")
    base = slot * ring
    return np.concatenate([base + off1 + np.arange(n1), base + off2 + np.arange(n2)]).astype(np.int64)


def _per_entry(args: Any, name: str, i: int, n: int, default: Any) -> list:
    """Component ``i`` of a per-entry KVArgs field (``default`` for every entry when SGLang
    left it out or empty); one value per entry of ``state_item_lens[i]``."""
    seq = _get(args, name, None)
    value = list(seq[i] or []) if seq is not None and i < len(seq) else []
    if not value:
        return [default] * n
    if len(value) != n:
        raise GeometryError(f"KVArgs.{name}[{i}] has {len(value)} entries; KVArgs.state_item_lens[{i}] has {n}")
    return value


def _mamba_pools(args: Any, i: int, ptrs: list, lens: list, items: list, tp_size: int) -> list[StatePool]:
    """The pools of a mamba component: each run of consecutive entries of one shape, sliced
    over attention TP by channel (one pool per conv sub-block), or replicated; whole rows
    between equal TP sizes where SGLang gives no per-tensor dims."""
    n = len(items)
    dims = _per_entry(args, "state_dim_per_tensor", i, n, None)
    if dims[0] is None:
        return _row_pools(i, "mamba", ptrs, lens, items, _MAMBA_NO_DIMS)
    outers = _per_entry(args, "state_slice_outer_counts", i, n, 1)
    groups = _per_entry(args, "state_conv_shard_groups", i, n, None)
    shapes: list[tuple] = []
    for e in range(n):
        item = _int(f"KVArgs.state_item_lens[{i}][{e}]", items[e], 1)
        _entry(i, "mamba", e, ptrs, lens, items)
        dim = _int(f"KVArgs.state_dim_per_tensor[{i}][{e}]", dims[e], 0)
        if dim == 0:  # replicated over attention TP
            shapes.append(("replicated", item))
            continue
        outer = _int(f"KVArgs.state_slice_outer_counts[{i}][{e}]", outers[e], 1)
        if item % (dim * outer):
            raise GeometryError(
                f"KVArgs.state_item_lens[{i}][{e}]={item} is not a whole number of channels: "
                f"state_dim_per_tensor[{i}][{e}]={dim} x state_slice_outer_counts[{i}][{e}]={outer}"
            )
        blocks: tuple[int, ...] = (dim * tp_size,)
        if groups[e] is not None:
            subs = tuple(_int(f"KVArgs.state_conv_shard_groups[{i}][{e}][{b}]", g, 1) for b, g in enumerate(groups[e]))
            if sum(subs) == dim * tp_size:  # SGLang's rule: sub-blocks only when they make up the row
                blocks = subs
        bad = [g for g in blocks if g % tp_size]
        if bad:
            raise GeometryError(
                f"KVArgs.state_conv_shard_groups[{i}][{e}]={list(blocks)}: sub-blocks {bad} are not divisible by "
                f"attention TP size {tp_size}"
            )
        if any((dim * tp_size) % g for g in blocks):
            why = (
                f"the conv sub-blocks {list(blocks)} (KVArgs.state_conv_shard_groups[{i}][{e}]) do not each divide "
                f"the row of {dim * tp_size} channels, and re-slicing such a row is not implemented by the kvxfer "
                "backend"
            )
            return _row_pools(i, "mamba", ptrs, lens, items, why)
        shapes.append(("sliced", item // (dim * outer), outer, blocks))
    runs: list[list[int]] = []
    for e in range(n):
        if runs and shapes[runs[-1][-1]] == shapes[e]:
            runs[-1].append(e)
        else:
            runs.append([e])
    made: list[tuple[KVGeometry, tuple[int, ...], tuple[int, ...], str, tuple[int, int, int]]] = []
    for run in runs:
        e0, shape = run[0], shapes[run[0]]
        rows = _run_rows(i, "mamba", run, lens, items, "shape")
        what = f"mamba state (KVArgs.state_types[{i}]='mamba', entries {run[0]}..{run[-1]}: "
        if shape[0] == "replicated":
            geometry = row_geometry(len(run), items[e0], rows)
            label = f"{what}rows of {items[e0]} bytes replicated over attention TP)"
            made.append((geometry, tuple(ptrs[e] for e in run), tuple(lens[e] for e in run), label, (1, 0, 1)))
            continue
        _, unit, outer, blocks = shape
        dim, first = dims[e0], 0
        rows_of = f"{outer} rows of " if outer > 1 else ""
        for b, full in enumerate(blocks):
            local = full // tp_size
            skip, width = first * unit, local * unit  # where the sub-block starts, its bytes per outer row
            geometry = KVGeometry(
                num_layers=len(run), total_kv_heads=full, head_dim=unit, v_head_dim=0, dtype="uint8", page_size=1,
                num_pages=min((lens[e] - skip) // width for e in run),
            )  # fmt: skip
            part = f", conv sub-block {b} of {list(blocks)}" if len(blocks) > 1 else ""
            label = f"{what}{rows_of}{dim * tp_size} channels of {unit} bytes sliced over attention TP{part})"
            made.append(
                (
                    geometry,
                    tuple(ptrs[e] + skip for e in run),
                    tuple(lens[e] - skip for e in run),
                    label,
                    (items[e0] // width, dim // local, outer),
                )
            )
            first += local
    return [
        StatePool(
            "state:mamba" if len(made) == 1 else f"state:mamba.{k}", "mamba", i, label, g, p, ln, slot_pages=pages
        )
        for k, (g, p, ln, label, pages) in enumerate(made)
    ]


def index_array(raw: Any, name: str) -> np.ndarray:
    """One type's entry of SGLang's ``state_indices`` (a numpy array, a CPU tensor, or a list
    of them: mamba's ``[array(slot)]``) as a 1-D int64 array."""
    parts = raw if isinstance(raw, (list, tuple)) else [raw]
    arrays = [np.asarray(p.cpu().numpy() if hasattr(p, "cpu") else p) for p in parts]
    for a in arrays:
        if a.ndim > 1 or (a.size and a.dtype.kind not in "iu"):
            raise ValueError(f"{name} must hold integer indices, got shape {a.shape} dtype {a.dtype}")
    if not arrays:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([a.reshape(-1).astype(np.int64, copy=False) for a in arrays])


def state_pages(pools: Sequence[StatePool], state_indices: Any, kv_pages: Any = None) -> list[np.ndarray]:
    """Each pool's indices from SGLang's ``state_indices`` (one entry per ``state_types``
    entry); a ``KV_PAGES`` pool's are the request's KV pages ``kv_pages``. ``ValueError`` naming
    the entry when one is missing or malformed."""
    if not pools:
        if state_indices and any(s is not None and len(s) for s in state_indices):
            raise ValueError("state_indices were given, but this server keeps no per-request state (no state_types)")
        return []
    kinds = sorted({(p.index, p.kind) for p in pools if p.kind != KV_PAGES})
    if state_indices is None and kinds:
        raise ValueError(f"state_indices are missing: KVArgs.state_types {[k for _, k in kinds]} need one entry each")
    seq = list(state_indices or [])
    out = []
    for pool in pools:
        if pool.kind == KV_PAGES:  # (the same page ids as the model's pool)
            if kv_pages is None:
                raise ValueError(f"{pool.label}: the request's KV pages are needed")
            out.append(np.asarray(kv_pages, dtype=np.int64).reshape(-1))
            continue
        where = f"state_indices[{pool.index}] ({pool.kind})"
        if pool.index >= len(seq) or seq[pool.index] is None:
            raise ValueError(f"{where} is missing (state_indices has {len(seq)} entries)")
        pages = index_array(seq[pool.index], where)
        if pool.kind in ("mamba", "qsa_pending", "request_row") and pages.size != 1:
            raise ValueError(f"{where} must be the request's one slot, got {pages.size} indices")
        if pool.kind == "dsa_tail":
            pages = _tail_rows(pages, pool.ring, where)
        stride, step, count = pool.slot_pages
        if (stride, step, count) != (1, 0, 1):
            pages = (pages[:, None] * stride + np.arange(count, dtype=np.int64) * step).reshape(-1)
        out.append(pages)
    return out


def kv_page_pools(layout: str, ptrs: list, lens: list, items: list) -> tuple[KVGeometry, list, list, list[StatePool]]:
    """A ``KVArgs.kv_layout`` pool's KV entries as whole pages: DeepSeek-V4's compressed pools
    (C4 KV, C4 indexer keys, C128 KV; under fp8 a RoPE group after each KV group), one item a
    KV page's rows of that pool (padded, of its own size), all addressed by the request's KV
    page ids, replicated over attention TP like an MLA latent. The entries of the first run of
    one page size are the model's pool (its geometry: one row a page, ``row_geometry``); every
    other run is a ``KV_PAGES`` pool over the same page ids, named with a digest of the layout
    so that servers of different layouts announce different pools. Returns ``(geometry, ptrs,
    lens, pools)``."""
    runs = _row_pools(-1, KV_PAGES, ptrs, lens, items, "")
    tag = hashlib.sha256(str(layout).encode()).hexdigest()[:8]
    pools = [
        replace(p, name=f"state:kv_{tag}.{g}", label=f"{p.label}, KVArgs.kv_layout={layout!r}")
        for g, p in enumerate(runs[1:], 1)
    ]
    return runs[0].geometry, list(runs[0].ptrs), list(runs[0].lens), pools


def describe(names: Sequence[str]) -> str:
    return ", ".join(names) if names else "none"


def state_problem(prefill: Sequence[str], decode: Sequence[StatePool], prefill_tp: int, decode_tp: int) -> str:
    """Why a request between these servers cannot carry its state ("" when it can): the
    prefill's announced state pools differ from this decode's, or a pool that needs one
    attention TP size on both sides meets two."""
    ours = [p.name for p in decode]
    kv = ([n for n in prefill if n.startswith("state:kv_")], [n for n in ours if n.startswith("state:kv_")])
    if kv[0] != kv[1]:
        return (
            f"compressed KV pools (KVArgs.kv_layout, kv_item_lens): prefill [{describe(kv[0])}] decode "
            f"[{describe(kv[1])}]; the servers register different KV layouts or page sizes (a pool's name carries a "
            "digest of its kv_layout: serve both with the same --page-size and SGLANG_DSV4_KV_LAYOUT, "
            "SGLANG_DSV4_COMPRESSED_KV_LAYOUT and SGLANG_DSV4_UNIFIED_KV_FP8)"
        )
    if list(prefill) != ours:
        return (
            f"extra per-request state (KVArgs.state_types): prefill pools [{describe(prefill)}] decode pools "
            f"[{describe(ours)}]; the servers keep different per-request state (serve the same model with the same "
            "memory flags on both, e.g. --disable-hybrid-swa-memory on both or neither)"
        )
    for p in decode:
        if p.equal_tp_only and prefill_tp != decode_tp:
            return (
                f"{p.label}: prefill attention TP size {prefill_tp} and decode attention TP size {decode_tp} differ; "
                f"{p.equal_tp_only}; serve both servers with the same attention TP size"
            )
    return ""
