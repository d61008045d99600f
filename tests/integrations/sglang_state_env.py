"""Extra per-request state (``KVArgs.state_types``) as the scripted scheduler sees it: the
state buffers SGLang's hybrid pools allocate, the KVArgs fields ``setup_state_kv_args`` fills
over them (with SGLang's own ``append_state_component``), the ``state_indices`` its schedulers'
payloads hand a backend, and an oracle of what every state row must hold.

- ``swa``: ``SWAKVPool.swa_kv_pool``, an NHD MHA pool of its own (the SWA layers' K then V,
  ``[swa_pool_tokens + page_size, swa heads on the rank, dim]``), paged by SWA page ids; a
  request's payload is the pages of its last window (``_swa_payload``: from the page-aligned
  ``max(prefix, seq_len - window)``). Its content is a function of (room, layer, K/V, global
  SWA head, window position), so a head re-sharded into the wrong slot is caught.
- ``mamba``: ``MambaPool``'s conv ``[layers, slots + 1, conv_dim / tp, k - 1]`` (bf16; Kimi's
  ``[..., k - 1, conv_dim / tp]`` with ``mamba_kimi``), SSM ``[layers, slots + 1, heads / tp,
  head_dim, state]`` (fp32) and, with ``mamba_replicated``, a per-slot uint8 tensor replicated
  on every rank; one entry per layer (tensor-major), with SGLang's per-tensor dims, outer
  counts and conv sub-blocks (``mamba_groups``, GDN's ``[q|k|v]``: each sharded on its own);
  the payload is the request's slot. A row's content is a function of the un-sharded
  channel: a rank holds, of each sub-block, its own channels, so a channel re-sliced into the
  wrong place (or another rank's rows) is caught.
- ``dsa``: the DSA indexer's uint8 buffers, one per layer, one row of ``page_size *
  index_bytes`` per KV page (a layer in ``dsa_skip`` has an empty buffer); the payload is the
  request's KV pages after the decode's prefix (``_dsa_pages_payload``). Replicated: every rank
  holds the same rows.
- ``dsa_tail``: a DSA indexer's kpool-compression tails (``DSATokenToKVPool``'s
  ``get_compress_tail_buf_infos``: per layer a K and a score ring ``[slots + 1, ring, index
  dim]`` bf16, K of every layer then score; a layer in ``dsa_skip`` has none); the payload is
  SGLang's own ``get_dsa_tail_state_indices`` (slot, two segments, ring size) over this side's
  ring (``tail_pool + tail_extra`` tokens). The live token ``t`` of a request (of the open
  pool) sits at ring position ``(start + t) % ring`` and its content is a function of ``t``,
  so rings of different sizes (speculative slots) must be re-mapped token by token.
- ``block_scale`` / ``block_scale_swa``: an MXFP8 pool's scale buffers (``get_kv_scale_buf_infos``,
  the flat layout: ``[tokens + page_size, heads on the rank * scale bytes]`` uint8, K of every
  layer then V, ``item_len`` one page of rows) of the full-attention pool and of the SWA
  sub-pool; the payloads are the request's KV pages from its first token
  (``_full_kv_pages_payload``) and the SWA window's pages. A page's rows are a function of the
  rank, so a page from another rank (or position) is caught.
- ``minimax_index_k`` / ``minimax_dense_kv``: ``MiniMaxSparseKVPool``'s index K of its K-only
  sparse layers (``MHATokenToKOnlyPool``: ``[tokens + page_size, 1, index dim]`` per layer,
  ``item_len`` one page of rows) and its dense layers' K, then V: with ``minimax_alias`` the
  main KV pool's own buffers of those layers (as SGLang's non-hisparse pool registers them;
  the main KV's oracle covers them, prefix included), else buffers of their own (a hisparse
  pool's ``dense_pool``) whose page rows are a function of the rank. The payloads are SGLang's
  own ``minimax_index_transfer_pages`` (the KV pages after the decode's prefix) and every KV
  page from the first token (``_full_kv_pages_payload``).
- ``qsa_pending`` / ``qsa_compressed``: ``QSATokenToKVPool``'s per-layer pending key rings
  ``[request slots x ratio, 1, index dim]`` (bf16) and its RoPE position ring ``[request slots x
  ratio, 3]`` (int64), ``item_len`` one request's ring, and per-layer compressed keys
  ``[ceil(tokens / ratio), 1, index dim]``, ``item_len`` one KV page's groups; the payloads are
  SGLang's own ``get_qsa_pending_state_indices`` (the request's row of the request pool, a slot
  of its own beside the mamba slot) and every KV page from the first token. One index head:
  every rank holds the same rows (a function of room, entry and position).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from sglang_kvxfer.engine.synthetic import fill_request, row_bytes, verify_request
from sglang_kvxfer.geometry import KVGeometry

SALT = {"swa": 0x5A5A_0001, "mamba": 0x3A3B_0002, "dsa": 0xD5A0_0003, "block_scale": 0xB5C0_0004,
        "block_scale_swa": 0xB5C0_0005, "dsa_tail": 0xD5A7_0006, "minimax_index_k": 0x313A_0007,
        "minimax_dense_kv": 0x313A_0008, "qsa_pending": 0x05A0_0009, "qsa_compressed": 0x05A0_000A,
        "kv_pages": 0xD540_000B, "dsv4_swa": 0xD540_000C, "swa_ring": 0xD540_000D, "c128_state": 0xD540_000E,
        "request_row": 0xD540_000F}  # fmt: skip
# kinds whose request rows are whole units of rows (a page's, a request row's ring), each unit's
# content a function of (room, entry, position) and, unless replicated (QSA, DeepSeek-V4), of the rank
DSV4_UNITS = ("kv_pages", "dsv4_swa", "swa_ring", "c128_state", "request_row")
UNIT_KINDS = ("block_scale", "block_scale_swa", "minimax_index_k", "qsa_pending", "qsa_compressed", *DSV4_UNITS)


@dataclass
class StateModel:
    """The hybrid pools of the test model (``Model.state``); ``kinds`` in state_types order
    (a kind this file does not lay out is registered with one small row buffer)."""

    kinds: tuple[str, ...] = ("swa",)
    swa_layers: int = 2
    swa_heads: int = 2  # swa_num_key_value_heads
    swa_head_dim: int = 8
    swa_v_head_dim: int = 4
    swa_pool_tokens: int = 64
    window: int = 10  # sliding_window_size
    mamba_layers: int = 2
    mamba_conv_dim: int = 12  # un-sharded conv channels
    mamba_conv_k: int = 4
    mamba_heads: int = 4
    mamba_head_dim: int = 2
    mamba_state: int = 3
    mamba_slots: int = 6
    mamba_groups: tuple[int, ...] | None = None  # conv sub-blocks (un-sharded, sum conv_dim): GDN's [q|k|v]
    mamba_kimi: bool = False  # conv per slot [k - 1, conv_dim / tp] (slice axis 1)
    mamba_replicated: int = 0  # bytes per slot of a tensor replicated over attention TP (0: none)
    mamba_dims: bool = True  # KVArgs.state_dim_per_tensor given (False: as with --enable-unified-memory)
    dsa_layers: int = 3
    dsa_index_bytes: int = 20  # per token: index_head_dim + its scale bytes
    dsa_skip: tuple[int, ...] = (1,)
    scale_bytes: int = 2  # MXFP8 scale bytes per KV head and token (head_dim / 32)
    tail_dim: int = 4  # the model's index_head_dim: a tail token is tail_dim bf16 values
    tail_pool: int = 4  # index_kpool: tokens per compressed pool
    tail_extra: int = 1  # tail_extra_slots (speculative): the ring holds tail_pool + tail_extra tokens
    minimax_index_layers: int = 2  # K-only sparse layers
    minimax_index_dim: int = 8  # sparse_index_dim (the model's dtype)
    minimax_dense: tuple[int, ...] = (0,)  # dense layer ids (of the model's layers)
    minimax_alias: bool = True  # dense KV state = the main pool's buffers (False: a hisparse dense_pool)
    qsa_layers: int = 2  # full-attention (QSA) layers
    qsa_dim: int = 8  # qsa_index_head_dim (indexer_kv_heads is 1)
    qsa_ratio: int = 2  # compress_ratio (divides the page size)
    qsa_first: int = 0  # a PP stage's first QSA layer (of the model's)
    qsa_total: int | None = None  # the model's QSA layers (None: qsa_layers)
    # DeepSeek-V4 (Model.kv_layout set): the KV entries after the model's pool (one row of that
    # many bytes per KV page: C4 indexer keys, C128 KV...), the SWA component's entries (one row
    # per SWA page: SWA KV of every layer, then compressor state), swa_ring's (one row per ring
    # row, a ring of dsv4_ring rows per request row), c128_state's (one row per ring page of
    # c128_ratio tokens, c128_ring tokens per request row) and request_row's width
    kv_pages: tuple[int, ...] = (40, 40, 72)
    dsv4_swa: tuple[int, ...] = (48, 48, 24)
    dsv4_ring: int = 16
    swa_ring: tuple[int, ...] = (32, 32)
    c128_ratio: int = 8
    c128_ring: int = 16
    c128_state: tuple[int, ...] = (56,)
    request_row: int = 8
    dsv4_stage: int = 0  # a PP stage's DeepSeek-V4 entries: rows of their own (the stage's layers)

    @property
    def tail_ring(self) -> int:
        return self.tail_pool + self.tail_extra

    # A PP stage's part of the model's state (sglang_pp_sides): the global index of its first
    # SWA, mamba and DSA layer, and the model's mamba layers (None: mamba_layers). The rows'
    # content is a function of the global entry, so a stage's rows in the wrong slice are caught.
    swa_first: int = 0
    mamba_first: int = 0
    mamba_total: int | None = None
    dsa_first: int = 0
    dsa_total: int | None = None  # the model's DSA layers (None: dsa_layers)
    scale_first: int = 0  # the stage's first KV layer (MXFP8 block scales: one K and one V entry per KV layer)
    scale_total: int | None = None  # the model's KV layers (None: the pool's)

    def entry_id(self, kind: str, e: int) -> int:
        """The model-wide entry of this pool's entry ``e`` (mamba: tensor-major, conv of every
        layer of the model, then SSM)."""
        if kind == "mamba":
            tensor, i = divmod(e, self.mamba_layers)
            return tensor * (self.mamba_total or self.mamba_layers) + self.mamba_first + i
        return e + (self.dsa_first if kind == "dsa" else 0)

    def mamba_tensors(self) -> list[tuple[int, int, int, tuple[int, ...]]]:
        """Per mamba tensor: (un-sharded channels, outer rows, bytes per channel, sub-blocks);
        channels 0 for the replicated one."""
        k = self.mamba_conv_k - 1
        conv = (self.mamba_conv_dim, k if self.mamba_kimi else 1, 2 * (1 if self.mamba_kimi else k))
        out = [(*conv, self.mamba_groups or (self.mamba_conv_dim,))]
        out.append((self.mamba_heads, 1, self.mamba_head_dim * self.mamba_state * 4, (self.mamba_heads,)))
        if self.mamba_replicated:
            out.append((0, 1, self.mamba_replicated, ()))
        return out

    def mamba_row(self, room: int, e: int, tp: int, rank: int) -> np.ndarray:
        """What rank ``rank`` of ``tp`` holds of mamba entry ``e``'s slot: of each sub-block its
        own channels (un-sharded channel ``c`` of outer row ``o`` has content (entry, o, c))."""
        channels, outer, unit, blocks = self.mamba_tensors()[e // self.mamba_layers]
        entry = self.entry_id("mamba", e)
        if not channels:
            return _row(room, "mamba", entry, 0, 0, unit)
        full = row_bytes(room ^ SALT["mamba"], entry, 0, range(channels), 0, outer, unit)  # [outer, channels, unit]
        mine, first = [], 0
        for size in blocks:
            local = size // tp
            mine += range(first + rank * local, first + (rank + 1) * local)
            first += size
        return full[:, mine].reshape(-1)

    def swa_geometry(self, model) -> KVGeometry:
        return KVGeometry(
            num_layers=self.swa_layers,
            total_kv_heads=self.swa_heads,
            head_dim=self.swa_head_dim,
            v_head_dim=self.swa_v_head_dim,
            dtype=model.dtype,
            page_size=model.page_size,
            num_pages=(self.swa_pool_tokens + model.page_size) // model.page_size,
        )


@dataclass
class StateMemory:
    """One rank's state buffers by kind (SWA: K of every layer, then V)."""

    buffers: dict = field(default_factory=dict)
    kv: list = field(default_factory=list)  # the rank's KV buffers (K of every layer, then V)


def attach(model, tp: int, rank: int, args, utils_defs, kv: tuple[list, list] = ([], [])) -> StateMemory:
    """Allocate ``model.state``'s buffers for ``rank`` of ``tp`` (beside its KV buffers ``kv``)
    and fill ``args``'s state fields as ``setup_state_kv_args`` does."""
    import torch

    from tests.integrations.sglang_env import import_sglang_base, local_heads

    base, _ = import_sglang_base()
    s, mem = model.state, StateMemory(kv=[*kv[0], *kv[1]])
    dtype = getattr(torch, model.dtype)
    for name in ("state_types", "state_data_ptrs", "state_data_lens", "state_item_lens", "state_dim_per_tensor"):
        setattr(args, name, [])
    args.state_conv_shard_groups, args.state_slice_outer_counts, args.state_layer_ids = [], [], []
    if model.kv_layout is not None:  # get_contiguous_buf_infos: the compressed pools after the first
        bufs = [torch.zeros((model.pool_tokens // model.page_size + 1, w), dtype=torch.uint8) for w in s.kv_pages]
        mem.buffers["kv_pages"] = bufs
        args.kv_data_ptrs += [b.data_ptr() for b in bufs]
        args.kv_data_lens += [b.nbytes for b in bufs]
        args.kv_item_lens += [b[0].nbytes for b in bufs]
    for tagged in s.kinds:  # ("swa:draft": a DeepSeek-V4 NextN draft's component, after the target's)
        kind, _, tag = tagged.partition(":")
        if model.kv_layout is not None and kind in ("swa", "swa_ring", "c128_state", "request_row"):
            rows = {
                "swa": (s.swa_pool_tokens + model.page_size) // model.page_size,  # SWA pages
                "swa_ring": (s.mamba_slots + 1) * s.dsv4_ring,  # request rows x ring rows
                "c128_state": (s.mamba_slots + 1) * (s.c128_ring // s.c128_ratio),  # request rows x ring pages
                "request_row": s.mamba_slots + 1,
            }[kind]
            widths = {"swa": s.dsv4_swa, "request_row": (s.request_row,)}.get(kind) or getattr(s, kind)
            bufs = [torch.zeros((rows, w), dtype=torch.uint8) for w in widths]
            items, extra = [b[0].nbytes for b in bufs], {}
            mem.buffers[("dsv4_swa" if kind == "swa" else kind) + (f":{tag}" if tag else "")] = bufs
            utils_defs.append_state_component(
                args, base.StateType(kind), [b.data_ptr() for b in bufs], [b.nbytes for b in bufs], items
            )
            continue
        if kind == "swa":
            heads = max(1, s.swa_heads // tp)
            rows = s.swa_pool_tokens + model.page_size
            bufs = [torch.zeros((rows, heads, s.swa_head_dim), dtype=dtype) for _ in range(s.swa_layers)]
            bufs += [torch.zeros((rows, heads, s.swa_v_head_dim), dtype=dtype) for _ in range(s.swa_layers)]
            items = [b[0].nbytes * model.page_size for b in bufs]  # MHATokenToKVPool item_len: one page
            args.swa_kv_cache_layout = "nhd"
            extra: dict = {}
        elif kind == "mamba":
            lay, slots, k = s.mamba_layers, s.mamba_slots + 1, s.mamba_conv_k - 1
            conv_local = s.mamba_conv_dim // tp
            conv = torch.zeros(
                (lay, slots, *((k, conv_local) if s.mamba_kimi else (conv_local, k))), dtype=torch.bfloat16
            )
            ssm = torch.zeros((lay, slots, s.mamba_heads // tp, s.mamba_head_dim, s.mamba_state), dtype=torch.float32)
            tensors = [conv, ssm]
            if s.mamba_replicated:
                tensors.append(torch.zeros((lay, slots, s.mamba_replicated), dtype=torch.uint8))
            bufs = [t[i] for t in tensors for i in range(lay)]
            items = [b[0].nbytes for b in bufs]  # MambaPool: state_tensor[0].nbytes, one slot
            shapes = s.mamba_tensors()
            extra = dict(layer_ids=list(range(s.mamba_first, s.mamba_first + lay)) * len(tensors))
            if s.mamba_dims:  # as MambaPool's get_state_dim_per_tensor / _slice_outer_counts / _conv_shard_groups
                extra.update(
                    dim_per_tensor=[c // tp for c, _, _, _ in shapes for _ in range(lay)],
                    slice_outer_counts=[o for _, o, _, _ in shapes for _ in range(lay)],
                    conv_shard_groups=[list(s.mamba_groups) if t == 0 and s.mamba_groups else None
                                       for t in range(len(shapes)) for _ in range(lay)],
                )  # fmt: skip
        elif kind == "dsa":
            pages = (model.pool_tokens + model.page_size) // model.page_size
            width = model.page_size * s.dsa_index_bytes
            bufs = [
                torch.zeros((0 if i in s.dsa_skip else pages, width), dtype=torch.uint8) for i in range(s.dsa_layers)
            ]
            items = [0 if b.shape[0] == 0 else b[0].nbytes for b in bufs]  # IndexKeyCache._item_len
            extra = {}
        elif kind == "dsa_tail":  # DSATokenToKVPool.get_compress_tail_buf_infos: K rings, then score rings
            shape = (s.mamba_slots + 1, s.tail_ring, s.tail_dim)  # a ring per request slot
            bufs = [torch.zeros((0, *shape[1:]) if i in s.dsa_skip else shape, dtype=torch.bfloat16)
                    for _ in range(2) for i in range(s.dsa_layers)]  # fmt: skip
            items = [b[0].nbytes if b.shape[0] > 0 else 0 for b in bufs]
            extra = {}
        elif kind in ("block_scale", "block_scale_swa"):  # MHATokenToKVPoolMXFP8, flat scale layout
            swa = kind == "block_scale_swa"
            layers = s.swa_layers if swa else model.num_layers
            heads = max(1, (s.swa_heads if swa else model.total_kv_heads) // tp)
            rows = (s.swa_pool_tokens if swa else model.pool_tokens) + model.page_size
            bufs = [torch.zeros((rows, heads * s.scale_bytes), dtype=torch.uint8) for _ in range(2 * layers)]
            items = [b[0].nbytes * model.page_size for b in bufs]  # row_bytes * page_size
            extra = {}
        elif kind == "minimax_index_k":  # MiniMaxSparseKVPool.get_index_k_state_buf_infos
            rows = model.pool_tokens + model.page_size
            bufs = [torch.zeros((rows, 1, s.minimax_index_dim), dtype=dtype) for _ in range(s.minimax_index_layers)]
            items = [b[0].nbytes * model.page_size for b in bufs]
            extra = {}
        elif kind == "minimax_dense_kv":  # get_dense_kv_state_buf_infos: K of every dense layer, then V
            if s.minimax_alias:
                bufs = [kv[0][i] for i in s.minimax_dense] + [kv[1][i] for i in s.minimax_dense]
            else:
                rows, heads = model.pool_tokens + model.page_size, local_heads(model, tp)
                bufs = [torch.zeros((rows, heads, dim), dtype=dtype)
                        for dim in (model.head_dim, model.v_head_dim) for _ in s.minimax_dense]  # fmt: skip
            items = [b[0].nbytes * model.page_size for b in bufs]
            extra = {}
        elif kind == "qsa_pending":  # get_qsa_pending_state_buf_infos: key rings of every layer, RoPE ring
            ring = (s.mamba_slots + 1) * s.qsa_ratio
            bufs = [torch.zeros((ring, 1, s.qsa_dim), dtype=torch.bfloat16) for _ in range(s.qsa_layers)]
            bufs.append(torch.zeros((ring, 3), dtype=torch.int64))
            items = [b[0].nbytes * s.qsa_ratio for b in bufs]
            layers = range(s.qsa_first, s.qsa_first + s.qsa_layers)
            extra = dict(layer_ids=[*layers, (1 << 32) - 2])  # QSA_ROPE_STATE_LAYER_ID
        elif kind == "qsa_compressed":  # get_qsa_compressed_state_buf_infos: one page's groups an item
            rows = -(-(model.pool_tokens + model.page_size) // s.qsa_ratio)
            bufs = [torch.zeros((rows, 1, s.qsa_dim), dtype=torch.bfloat16) for _ in range(s.qsa_layers)]
            items = [b[0].nbytes * (model.page_size // s.qsa_ratio) for b in bufs]
            extra = dict(layer_ids=list(range(s.qsa_first, s.qsa_first + s.qsa_layers)))
        else:  # a type this backend refuses: one row buffer, enough to register
            bufs = [torch.zeros((4, 16), dtype=torch.uint8)]
            items, extra = [16], {}
        mem.buffers[kind] = bufs
        known = kind in {t.value for t in base.StateType}  # (else a str enum of another backend's: Ascend's)
        utils_defs.append_state_component(
            args,
            base.StateType(kind) if known else kind,
            [b.data_ptr() for b in bufs],
            [b.nbytes for b in bufs],
            items,
            **extra,
        )
    return mem


def swa_window(model, tokens: int, prefix: int) -> tuple[int, int]:
    """``(window_start, window tokens)`` of ``_swa_payload`` for a prompt of ``tokens``."""
    start = max(prefix, tokens - model.state.window)
    start = (start // model.page_size) * model.page_size
    return start, tokens - start


def allocate(model, requests, seed: int) -> list[dict]:
    """Per request, this side's state indices: SWA pages of its window (and its token count),
    a mamba slot (disjoint and scattered, as a long-running server's allocators hand them out)."""
    s, ps = model.state, model.page_size
    rng = np.random.default_rng(seed)
    swa_free = rng.permutation(np.arange(1, (s.swa_pool_tokens + ps) // ps))
    slots = rng.permutation(np.arange(s.mamba_slots + 1))
    rows = rng.permutation(np.arange(1, s.mamba_slots + 1))  # request-pool rows (row 0 is never allocated)
    out, at = [], 0
    for i, (_, tokens, *rest) in enumerate(requests):
        _, n = swa_window(model, tokens, rest[0] if rest else 0)
        need = -(-n // ps)
        out.append(
            {
                "swa": swa_free[at : at + need],
                "swa_tokens": n,
                "mamba": int(slots[i]),
                "req": int(rows[i]),
                "tokens": tokens,
            }
        )
        at += need
    return out


def payload(model, alloc: dict, kv_pages: np.ndarray, prefix: int) -> list:
    """``state_indices`` as SGLang's scheduler builds them, one entry per ``state_types``
    entry (None for a type without a payload here)."""
    ps, out = model.page_size, []
    for kind in (k.partition(":")[0] for k in model.state.kinds):
        if kind == "swa":  # kv_to_page_indices(window slots): the window's first slot of each page
            slots = np.repeat(alloc["swa"] * ps, ps) + np.tile(np.arange(ps), len(alloc["swa"]))
            out.append((slots[::ps] // ps).astype(np.int32))
        elif kind == "mamba":  # [translate_mamba_indices(mapping[req_pool_idx]).cpu().numpy()]: a 0-d array
            out.append([np.asarray(alloc["mamba"], dtype=np.int64)])
        elif kind == "dsa":  # suffix_page_indices: the KV pages after the decode's prefix
            out.append(np.asarray(kv_pages[prefix // ps :], dtype=np.int32))
        elif kind == "dsa_tail":  # get_dsa_tail_state_indices: [] when the request's pool is closed
            out.append(tail_index(model, alloc))
        elif kind == "block_scale":  # _full_kv_pages_payload: every KV page from the first token
            out.append(np.asarray(kv_pages, dtype=np.int32))
        elif kind == "block_scale_swa":  # _swa_payload: the window's pages
            out.append(np.asarray(alloc["swa"], dtype=np.int32))
        elif kind == "minimax_index_k":  # _minimax_payload: SGLang's minimax_index_transfer_pages
            out.append(minimax_index(model, alloc, kv_pages, prefix))
        elif kind in ("minimax_dense_kv", "qsa_compressed"):  # _full_kv_pages_payload
            out.append(np.asarray(kv_pages, dtype=np.int32))
        elif kind == "qsa_pending":  # SGLang's get_qsa_pending_state_indices: the request-pool row
            row = _sglang("get_qsa_pending_state_indices")
            out.append(row(SimpleNamespace(kv=SimpleNamespace(req_pool_idx=alloc["req"]))))
        elif kind in ("swa_ring", "c128_state", "request_row"):
            out.append(np.asarray(_dsv4_units(model, kind, alloc), dtype=np.int32))
        else:
            out.append(np.array([1], dtype=np.int32))
    return out


def _entry(model, kind: str, e: int) -> int:
    """The model-wide entry of a ``block_scale``, ``dsa_tail`` or QSA pool's entry ``e`` (K of
    every layer, then V or score; QSA's layers, then the RoPE ring: a PP stage's entries of its
    layers), so rows of another stage's layers are caught; other kinds' ``e`` as it is."""
    s = model.state
    if ":" in kind:  # a draft's component: entries of their own (its rows differ from the target's)
        return 1000 + _entry(model, kind.partition(":")[0], e)
    if kind in DSV4_UNITS:  # (a PP stage's entries: its own layers')
        return 100 * s.dsv4_stage + e
    if kind == "block_scale":
        first, layers, total = s.scale_first, model.num_layers, s.scale_total
    elif kind == "dsa_tail":
        first, layers, total = s.dsa_first, s.dsa_layers, s.dsa_total
    elif kind in ("qsa_pending", "qsa_compressed"):  # (the RoPE ring: one past the model's QSA layers)
        return s.qsa_first + e if e < s.qsa_layers else (s.qsa_total or s.qsa_layers)
    else:
        return e
    half, i = divmod(e, layers)
    return half * (total or layers) + first + i


def _row(room: int, kind: str, entry: int, who: int, position: int, nbytes: int) -> np.ndarray:
    return row_bytes(room ^ SALT[kind], entry, 0, [who], position, 1, nbytes).reshape(-1)


def _view(t):
    import torch

    return t.view(torch.uint8).reshape(t.shape[0], -1)


def fill(
    model, tp: int, rank: int, mem: StateMemory, room: int, alloc: dict, kv_pages, prefix: int, shard=None
) -> None:
    """A prefill rank's forward: the request's state rows in its state buffers. ``shard``
    ``(k, n)`` (--enable-kv-cache-sharding): the DSA rows of the logical KV pages shard rank
    ``k`` of ``n`` holds, at their local ids ``page // n``."""
    import torch

    s = model.state
    if "swa" in mem.buffers:  # window positions [0, swa_tokens) over the window's pages
        place = s.swa_geometry(model).placement(tp, rank)
        swa = mem.buffers["swa"]
        fill_request(place, swa, room ^ SALT["swa"], alloc["swa"], 0, alloc["swa_tokens"], layer_start=s.swa_first)
    if "mamba" in mem.buffers:
        for e, buf in enumerate(mem.buffers["mamba"]):
            _view(buf)[alloc["mamba"]] = torch.from_numpy(s.mamba_row(room, e, tp, rank))
    if "dsa" in mem.buffers:
        for e, buf in enumerate(mem.buffers["dsa"]):
            if buf.shape[0]:
                for j, page in enumerate(kv_pages[prefix // model.page_size :]):
                    if shard is not None:
                        if int(page) % shard[1] != shard[0]:
                            continue
                        page = int(page) // shard[1]
                    _view(buf)[int(page)] = torch.from_numpy(
                        _row(room, "dsa", s.entry_id("dsa", e), 0, j, buf.shape[1])
                    )
    for key, kind in _unit_buffers(model, mem):
        if kind == "kv_pages":  # (written by each chunk's forward: fill_pages)
            continue
        units, n = _units(model, kind, alloc, kv_pages)  # (the prefix's too: the prefill computed them)
        for e, buf in enumerate(mem.buffers[key]):
            for j, unit in enumerate(units):
                row = _row(room, kind, _entry(model, key, e), _who(kind, rank), j, n * _view(buf).shape[1])
                _unit_rows(buf, unit, n)[:] = torch.from_numpy(row.reshape(n, -1))
    if prefix and s.minimax_alias and "minimax_dense_kv" in mem.buffers:
        # the prefill holds the prefix's KV too (it computed or cached it): its dense layers'
        # pages from the first token are sent, over what the decode's radix cache holds
        from tests.integrations.sglang_env import model_geometry

        fill_request(model_geometry(model).placement(tp, rank), mem.kv, room, kv_pages, 0, prefix)
    for e, buf in enumerate(mem.buffers.get("dsa_tail", ())):
        for t, at in _tail_positions(model, alloc) if buf.shape[0] else ():
            buf[alloc["mamba"], at].view(torch.uint8)[:] = torch.from_numpy(
                _row(room, "dsa_tail", _entry(model, "dsa_tail", e), 0, t, 2 * s.tail_dim)
            )


def fill_pages(model, mem: StateMemory, room: int, kv_pages, first: int, stop: int) -> None:
    """A chunk's forward over tokens ``[first, stop)`` on a DeepSeek-V4 prefill rank: the rows
    of its KV pages in every compressed pool after the model's (replicated)."""
    import torch

    ps = model.page_size
    for e, buf in enumerate(mem.buffers.get("kv_pages", ())):
        for j in range(first // ps, -(-stop // ps)):
            row = _row(room, "kv_pages", _entry(model, "kv_pages", e), 0, j, _view(buf).shape[1])
            _unit_rows(buf, int(kv_pages[j]), 1)[:] = torch.from_numpy(row.reshape(1, -1))


@functools.cache
def _sglang(name: str, relpath: str = "disaggregation/utils.py"):
    """SGLang's own definition ``name`` from ``relpath`` (of ``sglang/srt``), with the module
    globals these helpers use (``np``, ``kv_to_page_indices``)."""
    from tests.integrations.sglang_env import load_utils_defs

    module = load_utils_defs((name,), relpath)
    module.np = np
    if name != "kv_to_page_indices":
        module.kv_to_page_indices = _sglang("kv_to_page_indices", "mem_cache/common.py")
    return getattr(module, name)


def tail_index(model, alloc: dict) -> list[int]:
    """SGLang's own ``get_dsa_tail_state_indices`` of this side's ring for the request."""
    s = model.state
    pool = SimpleNamespace(kpool_use_compress=True, index_kpool=s.tail_pool, tail_extra_slots=s.tail_extra)
    return _sglang("get_dsa_tail_state_indices")(pool, alloc["mamba"], alloc["tokens"])


def _tail_positions(model, alloc: dict) -> list[tuple[int, int]]:
    """(live token, ring position) of the request's open pool on this side."""
    s, n = model.state, alloc["tokens"]
    live = n % s.tail_pool
    start = (n - live) % s.tail_ring
    return [(t, (start + t) % s.tail_ring) for t in range(live)]


def minimax_index(model, alloc: dict, kv_pages, prefix: int) -> np.ndarray:
    """SGLang's own ``minimax_index_transfer_pages`` over the request's token slots."""
    import torch

    ps, tokens = model.page_size, alloc["tokens"]
    slots = (np.repeat(np.asarray(kv_pages, dtype=np.int64) * ps, ps) + np.tile(np.arange(ps), len(kv_pages)))[:tokens]
    pages = _sglang("minimax_index_transfer_pages", "disaggregation/minimax.py")
    return pages(torch.from_numpy(slots), page_size=ps, prefix_len=prefix)


def _dsv4_units(model, kind: str, alloc: dict) -> list[int]:
    """A DeepSeek-V4 request's rows of ``kind``: the unified SWA ring rows of its window's
    positions (``_swa_ring_payload``), its C128 ring page (SGLang's own
    ``request_scoped_state_transfer_indices``, offline: none at a block boundary), its request row."""
    s, n, req = model.state, alloc["tokens"], alloc["req"]
    if kind == "swa_ring":
        return [req * s.dsv4_ring + pos % s.dsv4_ring for pos in range(max(0, n - s.window), n)]
    if kind == "c128_state":
        pages = _sglang("request_scoped_state_transfer_indices", "mem_cache/deepseek_v4_compress_state.py")
        return [int(x) for x in pages(req, n, ratio=s.c128_ratio, online=False, ring_size=s.c128_ring)]
    return [req]


def _unit_buffers(model, mem: StateMemory) -> list[tuple[str, str]]:
    """``(buffer key, kind)`` of the rank's ``_unit_kinds`` buffers ("dsv4_swa:draft": a
    draft's component of that kind)."""
    return [(key, key.partition(":")[0]) for key in mem.buffers if key.partition(":")[0] in _unit_kinds(model)]


def _unit_kinds(model) -> tuple[str, ...]:
    """UNIT_KINDS, and MiniMax's dense-layer KV when it has buffers of its own."""
    return (*UNIT_KINDS, *(() if model.state.minimax_alias else ("minimax_dense_kv",)))


def _units(model, kind: str, alloc: dict, kv_pages) -> tuple[list[int], int]:
    """(the request's units, rows of one unit) of a ``_unit_kinds`` buffer: its SWA window's
    pages, its request row's ring, its KV pages' compressed groups, or its KV pages."""
    s, ps = model.state, model.page_size
    if kind == "block_scale_swa":
        return [int(p) for p in alloc["swa"]], ps
    if kind == "qsa_pending":
        return [alloc["req"]], s.qsa_ratio
    if kind == "qsa_compressed":
        return [int(p) for p in kv_pages], ps // s.qsa_ratio
    if kind == "dsv4_swa":  # (one row per SWA page)
        return [int(p) for p in alloc["swa"]], 1
    if kind in ("swa_ring", "c128_state", "request_row"):
        return _dsv4_units(model, kind, alloc), 1
    if kind == "kv_pages":
        return [int(p) for p in kv_pages], 1
    return [int(p) for p in kv_pages], ps


def _who(kind: str, rank: int) -> int:
    """Whose rows a unit holds: the rank's, or every rank's (QSA's one index head)."""
    return 0 if kind.startswith("qsa_") or kind in DSV4_UNITS else rank


def _kept(model, kind: str, prefix: int) -> int:
    """The request's first pages whose ``kind`` rows the decode keeps as its radix cache holds
    them (MiniMax's index keys of the prefix: never sent, so zero here); the others are sent
    from the first page."""
    return prefix // model.page_size if kind in ("minimax_index_k", "kv_pages") else 0


def _unit_rows(buf, unit: int, n: int):
    """The ``n`` rows of ``unit`` of a buffer."""
    return _view(buf)[unit * n : (unit + 1) * n]


def verify(model, tp: int, rank: int, mem: StateMemory, room: int, alloc: dict, kv_pages, prefix: int) -> list[str]:
    """What a decode rank must hold for a request, row by row: its window of every SWA head
    it owns (every byte), its own channels of every mamba sub-block (the replicated rows
    whole), the DSA rows of every KV page after the prefix."""
    s, problems = model.state, []
    if "swa" in mem.buffers:
        place = s.swa_geometry(model).placement(tp, rank)
        problems += [
            f"SWA {p}"
            for p in verify_request(
                place, mem.buffers["swa"], room ^ SALT["swa"], alloc["swa"], alloc["swa_tokens"], s.swa_first
            )
        ]
    if "mamba" in mem.buffers:
        for e, buf in enumerate(mem.buffers["mamba"]):
            got = _view(buf)[alloc["mamba"]].numpy()
            if not np.array_equal(got, s.mamba_row(room, e, tp, rank)):
                bad = int(np.flatnonzero(got != s.mamba_row(room, e, tp, rank))[0])
                problems.append(
                    f"mamba entry {e}: slot {alloc['mamba']} differs from rank {rank} of TP {tp}'s row at byte {bad}"
                )
    if "dsa" in mem.buffers:
        for e, buf in enumerate(mem.buffers["dsa"]):
            for j, page in enumerate(kv_pages[prefix // model.page_size :] if buf.shape[0] else []):
                want = _row(room, "dsa", s.entry_id("dsa", e), 0, j, buf.shape[1])
                if not np.array_equal(_view(buf)[int(page)].numpy(), want):
                    problems.append(f"DSA entry {e}: page {int(page)} (position {j}) differs")
    for key, kind in _unit_buffers(model, mem):
        units, n = _units(model, kind, alloc, kv_pages)
        kept, who = _kept(model, kind, prefix), _who(kind, rank)
        for e, buf in enumerate(mem.buffers[key]):
            for j, unit in enumerate(units):
                want = _row(room, kind, _entry(model, key, e), who, j, n * _view(buf).shape[1])
                got = _unit_rows(buf, unit, n).numpy().reshape(-1)
                if j < kept and got.any():
                    problems.append(f"{key} entry {e}: unit {unit} (position {j}) of the decode's prefix was written")
                elif j >= kept and not np.array_equal(got, want):
                    problems.append(f"{key} entry {e}: unit {unit} (position {j}) differs from rank {who}'s")
    for e, buf in enumerate(mem.buffers.get("dsa_tail", ())):
        for t, at in _tail_positions(model, alloc) if buf.shape[0] else ():
            got = _view(buf[alloc["mamba"], at : at + 1])[0].numpy()
            if not np.array_equal(got, _row(room, "dsa_tail", _entry(model, "dsa_tail", e), 0, t, 2 * s.tail_dim)):
                problems.append(f"dsa_tail entry {e}: live token {t} (ring position {at}) differs")
    return problems


def untouched(model, mem: StateMemory, allocs: list[dict], kv_pages: list) -> list[str]:
    """Every state row no request was given must still be zero (nothing landed elsewhere)."""
    ps, problems = model.page_size, []
    for kind, bufs in mem.buffers.items():
        if kind == "swa":
            used = {int(p) * ps + t for a in allocs for p in a["swa"] for t in range(ps)}
        elif kind in ("mamba", "dsa_tail"):  # (a request's tail ring is in its slot's row)
            used = {a["mamba"] for a in allocs}
        elif kind == "dsa":
            used = {int(p) for pages in kv_pages for p in pages}
        elif kind.partition(":")[0] in _unit_kinds(model):  # the rows of the requests' units
            used = set()
            for a, pages in zip(allocs, kv_pages):
                units, n = _units(model, kind.partition(":")[0], a, pages)
                used |= {u * n + r for u in units for r in range(n)}
        else:
            continue
        for e, buf in enumerate(bufs):
            if buf.numel() == 0:  # a DSA layer without an indexer buffer
                continue
            view = _view(buf).numpy()
            free = np.setdiff1d(np.arange(view.shape[0]), sorted(used))
            if free.size and view[free].any():
                bad = int(free[np.flatnonzero(view[free].any(axis=1))[0]])
                problems.append(f"{kind} entry {e}: row {bad}, given to no request, is not zero")
    return problems
