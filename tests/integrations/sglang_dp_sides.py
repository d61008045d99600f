"""Attention-DP deployments for the scripted scheduler: several prefill DP groups behind one
bootstrap, one or several decode DP groups, each side in its own process, driving our SGLang
classes in SGLang 0.5.23's call order (see ``sglang_sides`` for the per-request order).

What DP adds to that order, from SGLang's own code:

* prefill (``--tp T --dp-size D --enable-dp-attention``): ``T / D`` ranks per DP group, each
  rank's ``KVArgs.engine_rank`` its global TP rank (``prefill.py``); the data-parallel
  controller hands a request to one DP group only: the router's ``data_parallel_rank``
  (the sender then gets ``req_has_disagg_prefill_dp_rank=True``), else
  ``bootstrap_room % D`` (``follow_bootstrap_room``, the prefill default), or where another
  ``--load-balance-method`` puts it (the senders then register the room's group with the
  bootstrap). Polls are reduced (MIN) over that group's attention-TP ranks.
* prefill attention CP (``--attn-cp-size C``): ``T / (D * C)`` attention-TP ranks, each
  ``C`` times; ``engine_rank = (dp * C + cp) * attn_tp + attn_tp_rank``
  (``derive_attention_ranks``). Every CP rank holds the request's KV; CP rank 0 sends it and
  the others are dummy participants whose polls join the MIN. Here the CP replicas' pools
  hold a poison of their own and are never written, so a byte taken from one shows. With
  ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER`` (``cp_sharded``) every CP rank sends its
  share of a request's pages (SGLang's ``_get_cp_rank_page_bounds``, read from its source):
  here each CP rank's pool holds the request's KV in its own share's pages only, and its
  poison elsewhere, so every decode byte matching the oracle shows each page came from the
  CP rank whose share it is. Toward a decode with ``--dcp-size N`` (``dcp``), whose pages hold
  ``page_size * N`` tokens, kvxfer splits the decode's page list that way instead and each
  CP rank sends its share's tokens (N prefill pages per decode page); the pools here follow.
  With ``--enable-cp-tp-group-sharing`` (``cp_tp``: ``--tp C --attn-cp-size C``, attention
  TP 1) CP rank c holds every KV head and its TP share of the linear-attention state, and
  transfers as TP rank c of C: here its pool holds the oracle in the heads TP rank c of C owns
  and its own poison in the others, so every decode byte matching the oracle shows each head
  came from its owner (SGLang's forward writes every head on every CP rank).
  With ``--enable-dsa-cache-layer-split`` (``cp_layer_split``, MLA) CP rank c's pools hold a
  contiguous share of the layers (SGLang's ``get_layer_shard_range``; ``KVArgs`` list those
  only, from ``prefill_start_layer``), latent and DSA indexer, every page of them; its
  poison elsewhere shows a byte taken from another CP rank.
  With ``--enable-kv-cache-sharding`` (``kv_sharded``) a request's page ids are logical: page
  ``l`` lives on shard rank ``l % N`` as its local page ``l // N`` (SGLang's page interleave),
  the shard group being the CP group (``cp > 1``) or, for MLA without CP, the attention-TP
  group. The logical ids here are drawn at random from ``N`` pools' worth (SGLang's allocator
  makes owners cyclic per request; correctness must not rest on it), every shard rank's pool
  holds the KV of the pages it owns at their local ids and its own poison elsewhere, and every
  sender gets the logical page lists, as SGLang's scheduler hands them over.
* decode: ``engine_rank = tp_rank % attn_tp``; each decode DP group serves the requests its
  own controller gives it; ``_resolve_prefill_dp_rank`` picks the prefill group: the
  router's rank, else ``0`` for ``dp_size == 1``, else ``bootstrap_room % dp_size`` (read from
  ``prefill_info_table``), else (a prefill that does not follow bootstrap_room) the request
  waits until ``query_prefill_dp_ranks`` names its group; then ``init(prefill_dp_rank)``.

The oracle (``DpOracle``) is independent of the engine: every (room, prefill DP group) has
its own random full KV (every layer, K/V, token row of every page, head, byte); a prefill
rank writes its owned heads of it into its pages, the unused rows of the last page hold the
group's poison byte; what a decode rank must hold afterwards is computed here by placing the
decode rank's owned heads of the served group's full KV into its pages, and every byte of
every decode buffer is compared (pages no request used must still hold the sentinel).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import numpy as np

from tests.integrations import sglang_dcp_sides as dcps
from tests.integrations import sglang_sides as sides
from tests.integrations import sglang_state_env as state_env
from tests.integrations.sglang_env import Model, load_utils_defs, rank_memory, server_args

FAILED, BOOTSTRAPPING, WAITING, TRANSFERRING, SUCCESS = range(5)
SENTINEL = 0xA5  # decode bytes no request may touch
CHUNK_TOKENS = 16


@dataclass
class DpRequest:
    room: int
    tokens: int
    prefill_groups: tuple = ()  # groups that prefill it; () = SGLang's rule (room % dp)
    explicit: bool = False  # the router chose the prefill DP rank (data_parallel_rank)
    route: int | None = None  # the decode's prefill_dp_rank; None = SGLang's rule
    decode_group: int = 0  # which decode DP group serves it


@dataclass
class DpSpec:
    role: str
    model: Model
    attn_tp: int
    dp: int
    port: int
    requests: list
    env: dict = field(default_factory=dict)
    timeout_s: float = 60.0
    cp: int = 1  # prefill attention CP
    cp_sharded: bool = False  # every CP rank sends its share (SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER)
    kv_checksum: bool = False  # --disaggregation-enable-kv-checksum on this side
    corrupt_room: int | None = None  # decode: flip a byte of this room's last page on rank 0 once landed
    system: bool = False  # DP replicas (--dp-size without --enable-dp-attention), not attention DP
    load_balance: str = "auto"  # the prefill's --load-balance-method
    # the decode's --dcp-size (MLA: each DCP rank holds every dcp-th token in pages of
    # page_size * dcp tokens); on the prefill side, the decode's, which decides the CP shares
    dcp: int = 1
    cp_tp: bool = False  # prefill --enable-cp-tp-group-sharing (attn_tp 1, cp = tp)
    cp_layer_split: bool = False  # prefill --enable-dsa-cache-layer-split (MLA: each CP rank its layers)
    kv_sharded: bool = False  # prefill --enable-kv-cache-sharding (logical pages interleaved over shards)

    @property
    def shards(self) -> int:
        """The shard group's size under --enable-kv-cache-sharding: CP, else attention TP."""
        return self.cp if self.cp > 1 else self.attn_tp

    def shard_rank(self, cp_rank: int, rank: int) -> int:
        return cp_rank if self.cp > 1 else rank


def poison(group: int) -> int:
    return 0x10 + group


def replica_poison(group: int, cp_rank: int) -> int:
    """What a CP replica's pool holds (never written by the forward here)."""
    return 0x60 + 8 * group + cp_rank


@functools.cache
def _sglang_layer_shard_range():
    return load_utils_defs(("get_layer_shard_range",), "layers/cp/utils.py").get_layer_shard_range


def split_model(model: Model, cp: int, cp_rank: int) -> tuple[Model, int]:
    """``(the model as CP rank cp_rank's pools hold it, its first layer)`` under
    --enable-dsa-cache-layer-split: SGLang's contiguous share of the layers (the first
    ``layers % cp`` ranks one more), the DSA indexer entries of the same layers."""
    import dataclasses

    start, stop = _sglang_layer_shard_range()(cp_rank, cp, model.num_layers)
    state = model.state
    if state is not None:
        assert state.kinds == ("dsa",) and state.dsa_layers == model.num_layers, "a DSA model: an indexer per layer"
        skip = tuple(i - start for i in state.dsa_skip if start <= i < stop)
        state = dataclasses.replace(state, dsa_layers=stop - start, dsa_first=start, dsa_skip=skip)
    return dataclasses.replace(model, num_layers=stop - start, state=state), start


def heads_of(model: Model, attn_tp: int, rank: int) -> list[int]:
    """Global KV heads a rank owns (DESIGN.md's rule; MLA: the one latent head)."""
    if model.mla:
        return [0]
    h = model.total_kv_heads
    if attn_tp <= h:
        return list(range(rank * h // attn_tp, (rank + 1) * h // attn_tp))
    return [rank // (attn_tp // h)]


def buffer_dims(model: Model) -> list[int]:
    """Byte width of one head row in each buffer (K of every layer, then V)."""
    item = 2  # bfloat16
    dims = [model.head_dim] * model.num_layers + ([] if model.mla else [model.v_head_dim] * model.num_layers)
    return [d * item for d in dims]


class DpOracle:
    """The full KV of one request as prefilled on one DP group: ``rows[b]`` is
    ``uint8 [pages * page_size, heads, dim_bytes]`` for buffer ``b``."""

    def __init__(self, model: Model, room: int, group: int, tokens: int):
        pages = -(-tokens // model.page_size)
        n = pages * model.page_size
        heads = 1 if model.mla else model.total_kv_heads
        rng = np.random.default_rng([room & 0xFFFFFFFF, room >> 32, group])
        self.rows = []
        for dim in buffer_dims(model):
            full = rng.integers(0, 256, size=(n, heads, dim), dtype=np.uint8)
            full[tokens:] = poison(group)  # the last page's unused rows: what the prefill pool holds
            self.rows.append(full)


def byte_views(mem) -> list:
    import torch

    return [t.view(torch.uint8) for t in mem.buffers]


DRAFT_SALT = 0xD4AF7  # a draft model's KV content: seeded apart from the model's


def pools_of(model: Model, mem) -> list[tuple[Model, list, int]]:
    """``(shape, byte views, oracle salt)`` of each KV pool of a rank: the model's, then a
    speculative decoding draft model's (``Model.draft``: the same pages, its own heads)."""
    import torch

    out = [(model, byte_views(mem), 0)]
    if model.draft is not None:
        out.append((model.draft.model(model), [t.view(torch.uint8) for t in mem.draft_buffers], DRAFT_SALT))
    return out


def place(model: Model, views, heads: list[int], oracle: DpOracle, pages) -> None:
    """Write ``heads`` of every page row of ``oracle`` into ``pages`` of ``views``."""
    import torch

    ps = model.page_size
    rows = (np.asarray(pages, dtype=np.int64)[:, None] * ps + np.arange(ps)).reshape(-1)
    for view, full in zip(views, oracle.rows):
        view[torch.from_numpy(rows)] = torch.from_numpy(np.ascontiguousarray(full[:, heads, :]))


def compare(model: Model, views, expected: list[np.ndarray], label: str) -> list[str]:
    problems = []
    for b, (view, want) in enumerate(zip(views, expected)):
        got = view.numpy()
        if not np.array_equal(got, want):
            row, head, byte = (int(x) for x in np.argwhere(got != want)[0])
            problems.append(
                f"{label} buffer {b}: page {row // model.page_size} row {row % model.page_size} local head {head} "
                f"byte {byte} is {int(got[row, head, byte])}, expected {int(want[row, head, byte])}"
            )
    return problems


def main(spec: DpSpec, out, release) -> None:
    sides.serve(spec, out, release, _prefill, _decode)


def _dp_server_args(spec: DpSpec, port: int):
    cp = spec.cp if spec.role == "prefill" else 1
    lb = dict(load_balance_method=spec.load_balance) if spec.role == "prefill" else {}
    if spec.system:  # each replica a whole TP group: tp_size is one replica's
        return server_args(sides.MODEL_PATH, spec.role, spec.attn_tp, port, dp_size=spec.dp, **lb)
    extra: dict = dict(dp_size=spec.dp, enable_dp_attention=True, **lb) if spec.dp > 1 else {}
    if spec.kv_checksum:
        extra["disaggregation_enable_kv_checksum"] = True
    if cp > 1:
        extra["attn_cp_size"] = cp
    if spec.cp_tp and spec.role == "prefill":
        extra["enable_cp_tp_group_sharing"] = True
    if spec.cp_layer_split and spec.role == "prefill":
        extra["enable_dsa_cache_layer_split"] = True
    if spec.kv_sharded and spec.role == "prefill":
        extra["enable_kv_cache_sharding"] = True
    if spec.role == "decode" and spec.dcp > 1:
        extra["dcp_size"] = spec.dcp
    return server_args(sides.MODEL_PATH, spec.role, spec.attn_tp * spec.dp * cp, port, **extra)


def _place_rank(spec: DpSpec, kv_args, group: int, cp_rank: int, rank: int) -> None:
    """``KVArgs`` of rank ``rank`` of CP rank ``cp_rank`` of DP group ``group``, as SGLang
    sets them: with attention DP the prefill's global TP rank, laid out (dp, cp, tp), and the
    decode's ``tp_rank % attn_tp``; a DP replica's ranks count from 0 in every replica, which
    ``system_dp_rank`` (SGLang's ``dp_rank``) tells apart."""
    if spec.system:
        kv_args.engine_rank, kv_args.system_dp_rank = rank, group
    elif spec.role == "prefill":
        kv_args.engine_rank = (group * spec.cp + cp_rank) * spec.attn_tp + rank


def _prefill_groups(req: DpRequest, dp: int) -> tuple:
    return req.prefill_groups or (req.room % dp,)


def _prefill(spec: DpSpec, closers: list) -> dict:
    backend, defs = sides.setup(spec)
    m, deadline = spec.model, time.monotonic() + spec.timeout_s
    sa = _dp_server_args(spec, spec.port)
    boot = backend.KVXferKVBootstrapServer(sa.host, sa.disaggregation_bootstrap_port)
    closers.append(boot.close)
    groups = []  # per DP group: (each CP rank's memories, the managers of every CP rank)
    for g in range(spec.dp):
        mems: list[list] = [[] for _ in range(spec.cp)]
        mgrs = []
        for c in range(spec.cp):
            for r in range(spec.attn_tp):
                pm, start = split_model(m, spec.cp, c) if spec.cp_layer_split else (m, 0)
                mem = rank_memory(pm, spec.attn_tp, r, "prefill", state_tp=(spec.cp, c) if spec.cp_tp else None)
                _place_rank(spec, mem.kv_args, g, c, r)
                if spec.cp_layer_split:  # (LayerSplitDSATokenToKVPool's KVArgs: its layers only)
                    mem.kv_args.prefill_start_layer, mem.kv_args.prefill_end_layer = start, start + pm.num_layers
                for _, views, _ in pools_of(pm, mem):
                    for view in views:
                        shard = spec.shard_rank(c, r) if spec.kv_sharded else c  # (its own poison)
                        view.fill_(poison(g) if shard == 0 else replica_poison(g, shard))
                mems[c].append(mem)
                mgrs.append(backend.KVXferKVManager(mem.kv_args, defs.DisaggregationMode.PREFILL, sa, m.is_mla_backend))
                closers.append(mgrs[-1].close)
        groups.append((mems, mgrs))
    for _, mgrs in groups:
        for mgr in mgrs:
            mgr.register_to_bootstrap()
    pages = sides._allocate(m, [(r.room, r.tokens) for r in spec.requests], seed=1)
    if spec.kv_sharded:  # logical page ids over every shard's pool (page 0 stays SGLang's padding)
        local = (m.pool_tokens + m.page_size) // m.page_size
        free = np.random.default_rng(1).permutation(np.arange(spec.shards, spec.shards * local))
        bounds = np.cumsum([0] + [len(p) for p in pages])
        pages = [free[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    # extra per-request state (mamba: one slot a request), written by CP rank 0's forward only
    states = state_env.allocate(m, [(r.room, r.tokens) for r in spec.requests], seed=11) if m.state else None
    work = []
    for slot, req in enumerate(spec.requests):
        for g in _prefill_groups(req, spec.dp):
            mems, mgrs = groups[g]
            senders = [
                backend.KVXferKVSender(
                    mgr, f"{sa.host}:{spec.port}", req.room, req_has_disagg_prefill_dp_rank=req.explicit
                )
                for mgr in mgrs
            ]
            work.append(
                {"room": req.room, "group": g, "req": req, "slot": slot, "senders": senders, "pages": pages[slot]}
            )
            work[-1]["state"] = states[slot] if states is not None else None
    results: dict = {}

    def failed(w):
        results[(w["room"], w["group"])] = {"status": "Failed", "reasons": sides._failure(w["senders"])}

    def bootstrapped(w):  # pop_bootstrapped, then the forward and send_kv_chunk
        for s in w["senders"]:
            s.pop_decode_prefix_len()
            s.init(len(w["pages"]), w["slot"])
        _forward_and_send(spec, w, groups[w["group"]][0])

    def done(w):
        sent = [s.get_transfer_metric().transfer_total_bytes for s in w["senders"]]  # (cp, tp) order
        results[(w["room"], w["group"])] = {"status": "Success", "bytes": sent}
        if spec.kv_sharded:  # the request's pages each shard rank holds
            owners = np.asarray(w["pages"]) % spec.shards
            results[(w["room"], w["group"])]["shard_pages"] = [int((owners == k).sum()) for k in range(spec.shards)]
        for s in w["senders"]:
            s.clear()

    _event_loop(work, lambda w: w["senders"], bootstrapped, done, failed, deadline)
    return results


def _event_loop(work, pollers_of, on_waiting, on_success, on_failed, deadline) -> None:
    """Each request on its own, as the scheduler's queues move them: the bootstrap queue
    (until WaitingForInput), then the inflight queue (until Success); Failed from either."""
    bootstrapping, inflight = list(work), []
    while bootstrapping or inflight:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rooms {[w['room'] for w in bootstrapping + inflight]} never concluded")
        for w in list(bootstrapping):
            poll = sides._min_poll(pollers_of(w))
            if poll == FAILED:
                bootstrapping.remove(w)
                on_failed(w)
            elif poll >= WAITING:
                bootstrapping.remove(w)
                inflight.append(w)
                on_waiting(w)
        for w in list(inflight):
            poll = sides._min_poll(pollers_of(w))
            if poll == FAILED:
                inflight.remove(w)
                on_failed(w)
            elif poll == SUCCESS:
                inflight.remove(w)
                on_success(w)
        time.sleep(0.002)


@functools.cache
def _sglang_cp_bounds():
    return load_utils_defs(("_get_cp_rank_page_bounds",))._get_cp_rank_page_bounds


def cp_share(num_pages: int, cp_rank: int, cp_size: int, dcp: int = 1) -> range:
    """The request pages CP rank ``cp_rank`` sends when every CP rank sends: SGLang 0.5.23's
    own ``_get_cp_rank_page_bounds``, taken from its source (independent of ours); toward a
    decode of ``--dcp-size`` ``dcp``, its share of the decode's pages (of ``dcp`` pages here
    each) cut at this request's end."""
    if dcp == 1:
        return range(*_sglang_cp_bounds()(num_pages, cp_rank, cp_size))
    start, stop = _sglang_cp_bounds()(-(-num_pages // dcp), cp_rank, cp_size)
    return range(min(num_pages, start * dcp), min(num_pages, stop * dcp))


def _forward_and_send(spec: DpSpec, w: dict, cp_mems) -> None:
    m, req = spec.model, w["req"]
    oracles = [DpOracle(pm, req.room ^ salt, w["group"], req.tokens) for pm, _, salt in pools_of(m, cp_mems[0][0])]
    ps = m.page_size
    for a in range(0, req.tokens, CHUNK_TOKENS):
        b = min(req.tokens, a + CHUNK_TOKENS)
        last = b == req.tokens
        first = a // ps
        # this chunk's forward: its pages' rows of the group's KV, on CP rank 0 (the replicas
        # keep their poison) or, with every CP rank sending, on each CP rank in its share only
        every = spec.cp_sharded or spec.cp_tp or spec.cp_layer_split or spec.kv_sharded
        for c, mems in enumerate(cp_mems if every else cp_mems[:1]):
            sm, first_layer = split_model(m, spec.cp, c) if spec.cp_layer_split else (m, 0)
            held = range(first, -(-b // ps))
            if spec.kv_sharded:  # each shard rank holds the chunk's pages it owns, at their local ids
                for r, mem in enumerate(mems):
                    at = np.arange(held.start, held.stop)
                    logical = np.asarray(w["pages"])[at]
                    mine = logical % spec.shards == spec.shard_rank(c, r)
                    for (pm, views, _), oracle in zip(pools_of(m, mem), oracles):
                        sub = DpOracle.__new__(DpOracle)
                        rows = (at[mine][:, None] * ps + np.arange(ps)).reshape(-1)
                        sub.rows = [full[rows] for full in oracle.rows]
                        if mine.any():
                            place(pm, views, heads_of(pm, spec.attn_tp, r), sub, logical[mine] // spec.shards)
                    if last and c == 0:
                        for name, row in sides.aux_rows(m, req.room).items():
                            mem.meta[name][w["slot"]] = row
                    if last and m.state is not None:  # a DSA indexer: its rows of the pages it holds
                        shard = (spec.shard_rank(c, r), spec.shards)
                        st = mem.extra["state"]
                        state_env.fill(m, spec.attn_tp, r, st, req.room, w["state"], w["pages"], 0, shard=shard)
                continue
            if spec.cp_sharded:
                share = cp_share(len(w["pages"]), c, spec.cp, spec.dcp)
                held = range(max(held.start, share.start), min(held.stop, share.stop))
            for r, mem in enumerate(mems):
                for (pm, views, _), oracle in zip(pools_of(m, mem), oracles):
                    sub = DpOracle.__new__(DpOracle)
                    sub.rows = [full[held.start * ps : held.stop * ps] for full in oracle.rows]
                    heads = heads_of(pm, spec.attn_tp, r)
                    if spec.cp_layer_split:  # its layers' latents (MLA: a buffer per layer), every page
                        sub.rows = sub.rows[first_layer : first_layer + sm.num_layers]
                    if spec.cp_tp:  # (a pool of every head: the oracle in TP rank c's, at their places)
                        heads = heads_of(pm, spec.cp, c)
                        sub.rows = [np.zeros_like(x) + replica_poison(w["group"], c) for x in sub.rows]
                        for x, full in zip(sub.rows, oracle.rows):
                            x[:, heads] = full[held.start * ps : held.stop * ps][:, heads]
                        heads = list(range(views[0].shape[1]))
                    if len(held):
                        place(pm, views, heads, sub, w["pages"][held.start : held.stop])
                if last and (c == 0 or spec.cp_tp or spec.cp_layer_split):
                    for name, row in sides.aux_rows(m, req.room).items():
                        mem.meta[name][w["slot"]] = row
                    if m.state is not None:  # (CP replicas' state rows stay zero here; CP-TP: its shard)
                        tp, rank = (spec.cp, c) if spec.cp_tp else (spec.attn_tp, r)
                        state_env.fill(sm, tp, rank, mem.extra["state"], req.room, w["state"], w["pages"], 0)
        chunk = w["pages"][first : -(-b // ps)]
        state_indices = None
        if last:
            state_indices = [] if m.state is None else state_env.payload(m, w["state"], w["pages"], 0)
        for s in w["senders"]:
            if s.should_send_kv_chunk(len(chunk), last):
                s.send(np.asarray(chunk, dtype=np.int32), state_indices, num_kv_tokens=b - a)


def _landing(m: Model, dcp: int, rank: int, w: dict, draft: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tokens, rows, loose)`` of a served request on decode rank ``rank``: which token of
    the request each of ``rows`` must hold, and the rows whose content is free. Without DCP
    every row of its pages (the last page's unused rows hold the prefill's poison, as sent).
    With ``--dcp-size`` ``dcp``: the tokens of the rank's DCP phase (``rank % dcp``) in its
    pages of ``page_size * dcp`` tokens, ``page_size`` rows each (a draft pool, not split:
    every token, ``page_size * dcp`` rows a page); the rest of the last page is loose (the
    prefill fills the decode's last page with a copy of its last page, rows the decode
    overwrites before it reads them)."""
    ps, pages = m.page_size, np.asarray(w["pages"], dtype=np.int64)
    if dcp == 1:
        rows = (pages[:, None] * ps + np.arange(ps)).reshape(-1)
        return np.arange(rows.size), rows, rows[:0]
    span, n = ps * dcp, w["req"].tokens
    if draft:
        t = np.arange(n)
        rows, per_page = pages[t // span] * span + t % span, span
    else:
        t = np.arange(rank % dcp, n, dcp)
        rows, per_page = pages[t // span] * ps + (t % span) // dcp, ps
    last = pages[-1] * per_page + np.arange(per_page)
    return t, rows, np.setdiff1d(last, rows)


def _decode(spec: DpSpec, closers: list) -> dict:
    backend, defs = sides.setup(spec)
    backend._model_total_kv_heads = sides._model_heads(spec.model)
    m, deadline = spec.model, time.monotonic() + spec.timeout_s
    sa = _dp_server_args(spec, spec.port + 1)
    addr = f"127.0.0.1:{spec.port}"
    groups = []
    for g in range(spec.dp):
        mems, mgrs = [], []
        for r in range(spec.attn_tp):
            # engine_rank = tp_rank % attn_tp; with DCP a draft pool of page_size * dcp rows a page
            mem = (
                rank_memory(m, spec.attn_tp, r, "decode")
                if spec.dcp == 1
                else dcps.dcp_memory(m, spec.attn_tp, r, spec.dcp)
            )
            _place_rank(spec, mem.kv_args, g, 0, r)
            for _, views, _ in pools_of(m, mem):
                for view in views:
                    view.fill_(SENTINEL)
            mems.append(mem)
            mgrs.append(backend.KVXferKVManager(mem.kv_args, defs.DisaggregationMode.DECODE, sa, m.is_mla_backend))
            closers.append(mgrs[-1].close)
        groups.append((mems, mgrs))
    asked = [(r.room, r.tokens) for r in spec.requests]
    pages = sides._allocate(m, asked, seed=2) if spec.dcp == 1 else dcps.allocate(m, asked, spec.dcp, seed=2)
    if spec.corrupt_room is not None:  # after every writer is done, before the KV checksum
        slot = next(i for i, r in enumerate(spec.requests) if r.room == spec.corrupt_room)
        row = int(pages[slot][-1]) * m.page_size

        def corrupt(rx) -> None:
            if rx.bootstrap_room == spec.corrupt_room and rx.kv_mgr is groups[0][1][0]:
                byte_views(groups[0][0][0])[0][row, 0, 0] ^= 0x5A

        backend.after_kv_landed = corrupt
    states = state_env.allocate(m, asked, seed=12) if m.state is not None else None
    work = []
    for slot, req in enumerate(spec.requests):
        mems, mgrs = groups[req.decode_group]
        rxs = [backend.KVXferKVReceiver(mgr, addr, req.room) for mgr in mgrs]
        work.append({"room": req.room, "req": req, "slot": slot, "rxs": rxs, "pages": pages[slot]})
        work[-1]["state"] = states[slot] if states is not None else None
    every = [mgr for _, mgrs in groups for mgr in mgrs]
    while not all(mgr.try_ensure_parallel_info(addr) for mgr in every):
        if time.monotonic() > deadline:
            raise TimeoutError(f"prefill parallel info for {addr} never arrived")
        time.sleep(0.02)
    info = every[0].prefill_info_table[addr]
    results: dict = {"info": {"attn_tp_size": info.attn_tp_size, "dp_size": info.dp_size}}
    results["follows_room"] = info.follow_bootstrap_room
    pending = []
    for w in work:  # _resolve_prefill_dp_rank, then _init_receiver
        req = w["req"]
        if req.route is not None:
            rank = req.route  # the router's data_parallel_rank
        elif info.dp_size == 1:
            rank = 0
        elif info.follow_bootstrap_room:
            rank = req.room % info.dp_size
        else:  # the prefill's load balancer placed it: pending until the bootstrap knows
            pending.append(w)
            continue
        w["route"] = rank
        for rx in w["rxs"]:
            rx.init(rank)
    # _resolve_pending_reqs, pass after pass: SGLang asks CommonKVReceiver.query_prefill_dp_ranks
    # (answered by our manager, whose method this calls) on the manager's executor
    asker = every[0]
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rooms {[w['room'] for w in pending]}: the bootstrap never named their DP group")
        rooms = [w["room"] for w in pending]
        found = asker._ensure_prefill_recompute_executor().submit(asker.query_prefill_dp_ranks, addr, rooms).result()
        for w in list(pending):
            rank = found.get(str(w["room"]))
            if rank is not None:
                pending.remove(w)
                w["route"] = int(rank)
                for rx in w["rxs"]:
                    rx.init(int(rank))
        time.sleep(0.02)

    def failed(w):
        results[w["room"]] = {"status": "Failed", "reasons": sides._failure(w["rxs"]), "route": w["route"]}

    def handshaken(w):  # _update_handshake_waiters -> pop_preallocated
        state_indices = [] if m.state is None else state_env.payload(m, w["state"], w["pages"], 0)
        for rx in w["rxs"]:
            rx.send_metadata(np.asarray(w["pages"], dtype=np.int32), w["slot"], state_indices, decode_prefix_len=0)

    served = []

    def transferred(w):  # pop_transferred (the metadata gate is the room in the slot)
        mems = groups[w["req"].decode_group][0]
        aux = [
            f"rank {r}: metadata {name} differs"
            for r, mem in enumerate(mems)
            for name, row in sides.aux_rows(m, w["room"]).items()
            if not bool((mem.meta[name][w["slot"]] == row).all())
        ]
        if m.state is not None:  # every state row of the request each rank must hold
            for r, mem in enumerate(mems):
                st = mem.extra["state"]
                got = state_env.verify(m, spec.attn_tp, r, st, w["room"], w["state"], w["pages"], 0)
                aux += [f"rank {r}: {p}" for p in got]
        results[w["room"]] = {"status": "Success", "route": w["route"], "problems": aux}
        results[w["room"]]["checksum_parts"] = [dict(rx.checksum_parts) for rx in w["rxs"]]
        # each prefill CP rank's share, as decode rank 0's record shows it (when each sends one)
        shares = w["rxs"][0]._engine.record.to_dict().get("cp_ranks", [])
        results[w["room"]]["cp_ranks"] = [(d["cp_rank"], d["bytes"], d["ok"]) for d in shares]
        served.append(w)
        for rx in w["rxs"]:
            rx.clear()

    _event_loop(work, lambda w: w["rxs"], handshaken, transferred, failed, deadline)
    # Every byte of every decode buffer against the oracle of what it must hold.
    problems = []
    for g, (mems, _) in enumerate(groups):
        for r, mem in enumerate(mems):
            for pm, views, salt in pools_of(m, mem):
                expected = [np.full(tuple(v.shape), SENTINEL, dtype=np.uint8) for v in views]
                heads = heads_of(pm, spec.attn_tp, r)
                for w in served:
                    if w["req"].decode_group != g:
                        continue
                    oracle = DpOracle(pm, w["room"] ^ salt, w["route"], w["req"].tokens)
                    tokens, rows, loose = _landing(m, spec.dcp, r, w, draft=bool(salt))
                    for want, full, view in zip(expected, oracle.rows, views):
                        want[rows] = full[tokens][:, heads, :]
                        want[loose] = view.numpy()[loose]
                label = f"decode DP group {g} rank {r}" + (" draft" if salt else "")
                problems += compare(pm, views, expected, label)
    if m.state is not None:  # nothing landed in a state row no request was given
        allocs, kv = [w["state"] for w in work], [w["pages"] for w in work]
        for g, (mems, _) in enumerate(groups):
            for r, mem in enumerate(mems):
                problems += [
                    f"decode DP group {g} rank {r}: {p}" for p in state_env.untouched(m, mem.extra["state"], allocs, kv)
                ]
    results["pool_problems"] = problems
    return results
