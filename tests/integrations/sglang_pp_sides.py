"""Pipeline-parallel deployments for the scripted scheduler: a prefill of several PP stages,
each stage in its own process (all of its TP ranks, of every attention-DP group), and a
decode of PP 1 (one process) or of the prefill's PP size (one process per stage), driving our
SGLang classes in SGLang 0.5.23's call order (see ``sglang_sides`` for the per-request order).

What PP adds to that order, from SGLang's own code:

* prefill (``--pp-size P``): every stage's ``KVArgs`` carry only its layers' buffers, with
  ``pp_rank`` and ``prefill_start_layer`` (``disaggregation/prefill.py``); each stage builds its
  transfer manager at start-up, where the PP group's broadcast from stage 0 happens (here a
  file per PP group stands in for ``pp_group.broadcast_object``). The bootstrap queue is polled
  on stage 0 only, through ``poll_pp_consensus()`` (MIN over its attention-TP ranks), and that
  status is handed to the later stages (``poll_and_all_reduce_prefill_pp``; here a queue per
  stage): on WaitingForInput every stage pops the decode's prefix and inits its senders, then
  sends its layers' pages chunk by chunk; each stage polls its own senders until Success
  (``_pp_pd_get_prefill_transferred_ids``).
* decode: PP 1 holds every layer; PP equal to the prefill's gives each decode stage its own
  layers (``kv_args.pp_rank``), and it receives from the prefill stage of its rank.
* prefill attention CP on every stage (``--attn-cp-size C``): each stage process holds
  ``dp * C * tp`` ranks, ``engine_rank = (dp * C + cp) * tp + tp_rank``; stage 0's consensus
  is the lowest status over the attention-TP and CP ranks (SGLang's
  ``poll_and_all_reduce_prefill_pp`` reduces over both groups). By default CP rank 0 writes
  the KV and the CP replicas keep their own poison (they send nothing); with
  ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER`` (``cp_sharded``) each CP rank holds the KV
  (and the draft model's) only in its share of the request's pages (SGLang's own
  ``_get_cp_rank_page_bounds``) and its poison elsewhere, so a decode byte that came from the
  wrong CP rank is that rank's poison. The state is written on CP rank 0 only.

The oracle (``PpOracle``) is independent of the engine: every (room, DP group, layer, K/V)
has its own random rows; the unused rows of a request's last page hold the poison byte of the
prefill stage that holds the layer, so every decode byte says which stage it came from. What a
decode rank must hold is computed here from its owned heads, and every byte of every decode
buffer is compared (rows no request used must still hold the sentinel).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import queue
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tests.integrations import sglang_sides as sides
from tests.integrations import sglang_state_env as state_env
from tests.integrations.sglang_dp_sides import cp_share, heads_of
from tests.integrations.sglang_env import Model, model_geometry, rank_memory, server_args

FAILED, BOOTSTRAPPING, WAITING, TRANSFERRING, SUCCESS = range(5)
SENTINEL = 0xA5  # decode bytes no request may touch
CHUNK_TOKENS = 16


def poison(stage: int) -> int:
    return 0x30 + stage


def cp_poison(stage: int, cp_rank: int) -> int:
    """What a prefill CP rank's pools hold where it writes no KV (CP rank 0: the stage's poison)."""
    return poison(stage) if cp_rank == 0 else 0x60 + 8 * stage + cp_rank


def pp_layers(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """SGLang's default split (``get_pp_indices``): even, the last stages one layer more."""
    base, extra = divmod(num_layers, pp_size)
    out, at = [], 0
    for s in range(pp_size):
        n = base + (1 if s >= pp_size - extra else 0)
        out.append((at, at + n))
        at += n
    return out


@dataclass
class PpSpec:
    role: str  # "prefill" or "decode"
    name: str  # the report's key
    model: Model  # the whole model (every layer)
    tp: int  # attention-TP ranks of each DP group of each stage
    dp: int
    pp_size: int
    pp_rank: int
    layers: tuple[int, int]  # this process's layers
    port: int
    requests: list  # [(room, tokens)]
    exchange_dir: str
    env: dict = field(default_factory=dict)
    timeout_s: float = 60.0
    stage_layers: list = field(default_factory=list)  # prefill: every stage's layers (the oracle's poison)
    decisions: Any = None  # prefill: stage 0 gets every later stage's queue, a later stage its own
    die: bool = False  # prefill stage > 0: exit once the first request is bootstrapped, before sending
    kv_checksum: bool = False  # --disaggregation-enable-kv-checksum on this side
    corrupt_stage: int | None = None  # decode: flip a landed byte of this prefill stage's first layer
    cp: int = 1  # prefill attention CP of every stage
    cp_sharded: bool = False  # every CP rank sends its share (SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER)
    # prefill --enable-kv-cache-sharding over the CP ranks: the page ids are logical, page l on
    # CP rank l % cp at its local id l // cp (every CP rank of every stage the same ownership)
    kv_sharded: bool = False


def stage_state(state, pp_size: int, pp_rank: int):
    """A stage's part of the model's extra per-request state (``sglang_state_env.StateModel``):
    each kind's layers split over the stages as SGLang splits layers, every row's content
    still that of its model-wide entry (None: no state)."""
    if state is None or pp_size == 1:
        return state
    sw, ma, ds, qs = (
        pp_layers(n, pp_size)[pp_rank]
        for n in (state.swa_layers, state.mamba_layers, state.dsa_layers, state.qsa_layers)
    )
    return dataclasses.replace(
        state,
        swa_layers=sw[1] - sw[0],
        swa_first=sw[0],
        mamba_layers=ma[1] - ma[0],
        mamba_first=ma[0],
        mamba_total=state.mamba_layers,
        dsa_layers=ds[1] - ds[0],
        dsa_first=ds[0],
        dsa_total=state.dsa_layers,
        qsa_layers=qs[1] - qs[0],
        qsa_first=qs[0],
        qsa_total=state.qsa_layers,
        dsa_skip=tuple(i - ds[0] for i in state.dsa_skip if ds[0] <= i < ds[1]),
        dsv4_stage=pp_rank,
    )


def stage_model(spec: PpSpec) -> Model:
    """The model as this process's pools hold it: its layers, its part of the state, and the
    draft model's pool on the last stage only (SGLang runs the draft model there)."""
    a, b = spec.layers
    state = stage_state(spec.model.state, spec.pp_size, spec.pp_rank)
    if state is not None and spec.pp_size > 1:  # (MXFP8 block scales: one K and one V entry per KV layer)
        state = dataclasses.replace(state, scale_first=a, scale_total=spec.model.num_layers)
    return dataclasses.replace(
        spec.model,
        num_layers=b - a,
        state=state,
        draft=spec.model.draft if spec.pp_rank == spec.pp_size - 1 else None,
    )


def draft_places(spec: PpSpec) -> list | None:
    """Each attention-TP rank's placement in the draft model's pool (None: this process has none)."""
    part = stage_model(spec)
    if part.draft is None:
        return None
    geo = model_geometry(part.draft.model(part))
    return [geo.placement(spec.tp, r) for r in range(spec.tp)]


def stage_of(stage_layers, layer: int) -> int:
    return next(s for s, (a, b) in enumerate(stage_layers) if a <= layer < b)


class PpOracle:
    """The full KV of one request as prefilled on one DP group, one buffer at a time:
    ``rows(layer, kind)`` is ``uint8 [pages * page_size, heads, dim_bytes]``."""

    def __init__(self, model: Model, room: int, group: int, tokens: int, stage_layers):
        self.model, self.room, self.group, self.tokens = model, room, group, tokens
        self.stage_layers = stage_layers
        self.rows_n = -(-tokens // model.page_size) * model.page_size

    def rows(self, layer: int, kind: int) -> np.ndarray:
        m = self.model
        heads = 1 if m.mla else m.total_kv_heads
        dim = (m.head_dim if kind == 0 else m.v_head_dim) * np.dtype(_NP_DTYPE.get(m.dtype, m.dtype)).itemsize
        rng = np.random.default_rng([self.room & 0xFFFFFFFF, self.room >> 32, self.group, layer, kind])
        full = rng.integers(0, 256, size=(self.rows_n, heads, dim), dtype=np.uint8)
        full[self.tokens :] = poison(stage_of(self.stage_layers, layer))
        return full


_NP_DTYPE = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}  # (numpy lacks them)


def draft_seed(room: int, group: int) -> int:
    """The seed of a request's draft-model KV on one DP group (not the model's)."""
    return sides.draft_room(room) ^ (group << 40)


def buffers_of(model: Model, layers: tuple[int, int]) -> list[tuple[int, int]]:
    """(layer, K|V) of each buffer of a pool holding ``layers`` (K of every layer, then V)."""
    a, b = layers
    return [(layer, 0) for layer in range(a, b)] + ([] if model.mla else [(layer, 1) for layer in range(a, b)])


def byte_views(mem) -> list:
    import torch

    return [t.view(torch.uint8) for t in mem.buffers]


def page_rows(model: Model, pages) -> np.ndarray:
    ps = model.page_size
    return (np.asarray(pages, dtype=np.int64)[:, None] * ps + np.arange(ps)).reshape(-1)


def file_exchange(directory: str, timeout_s: float = 30.0):
    """Stands in for ``_pp_exchange``: the PP group of a rank (one rank of every stage with
    the same ``engine_rank``) shares stage 0's value through a file."""

    def make(server_args, kv_args):
        path = os.path.join(directory, f"pp-group-{kv_args.engine_rank}.json")

        def exchange(value):
            if value is not None:
                with open(path + ".tmp", "w") as f:
                    json.dump(value, f)
                os.replace(path + ".tmp", path)
                return value
            deadline = time.monotonic() + timeout_s
            while not os.path.exists(path):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"PP stage 0 never published {path}")
                time.sleep(0.01)
            with open(path) as f:
                return json.load(f)

        return exchange

    return make


def run_pp(specs: list[PpSpec], timeout_s: float) -> dict:
    """Test side: each spec in a spawned process of its own (``sides.run_named_processes``),
    reports by spec name; the later prefill stages get the queues they tell stage 0 their
    requests' status on."""
    ctx = mp.get_context("spawn")
    later = [s for s in specs if s.role == "prefill" and s.pp_rank > 0]
    queues = {s.pp_rank: ctx.Queue() for s in later}
    for s in specs:
        if s.role == "prefill":
            s.decisions = queues if s.pp_rank == 0 else queues[s.pp_rank]
    return sides.run_named_processes(_main, specs, timeout_s, name=lambda spec: spec.name)


def _main(spec: PpSpec, out, release) -> None:
    closers: list = []
    try:
        run = _prefill if spec.role == "prefill" else _decode
        out.put((spec.name, run(spec, closers, out)))
    except BaseException:
        out.put((spec.name, {"error": traceback.format_exc()}))
    finally:
        release.wait(spec.timeout_s)
        for close in reversed(closers):
            close()


def _server_args(spec: PpSpec, port: int):
    extra: dict = dict(
        pp_size=spec.pp_size, disable_overlap_schedule=True, disaggregation_enable_kv_checksum=spec.kv_checksum
    )
    if spec.dp > 1:
        extra.update(dp_size=spec.dp, enable_dp_attention=True)
    if spec.cp > 1:
        extra["attn_cp_size"] = spec.cp
    if spec.kv_sharded and spec.role == "prefill":
        extra["enable_kv_cache_sharding"] = True
    return server_args(sides.MODEL_PATH, spec.role, spec.tp * spec.dp * spec.cp, port, **extra)


def _memories(spec: PpSpec, fill: int):
    """Every rank of this process (DP group by DP group; in a group, CP rank by CP rank): its
    memory over this process's layers, as SGLang's ``_init_kv_manager`` fills KVArgs for a PP
    stage; a prefill CP rank's filled with ``cp_poison``."""
    import torch

    a, b = spec.layers
    part = stage_model(spec)
    groups = []
    for g in range(spec.dp):
        mems = []
        for i in range(spec.cp * spec.tp):
            c, r = divmod(i, spec.tp)
            mem = rank_memory(part, spec.tp, r, spec.role)
            args = mem.kv_args
            args.engine_rank = (g * spec.cp + c) * spec.tp + r if spec.role == "prefill" else r
            args.pp_rank = spec.pp_rank
            args.prefill_start_layer, args.prefill_end_layer = (a, b) if spec.role == "prefill" else (0, b - a)
            if spec.role == "prefill" and part.state is not None:
                # a hybrid model: its KV pool holds the full-attention layers only, so a stage's
                # first model layer is not its first KV entry (here: one other layer before each)
                args.prefill_start_layer, args.prefill_end_layer = 2 * a, 2 * b
            for view in byte_views(mem):
                view.fill_(fill if c == 0 else cp_poison(spec.pp_rank, c))
            for buf in mem.draft_buffers if c else ():
                buf.view(torch.uint8).fill_(cp_poison(spec.pp_rank, c))
            mems.append(mem)
        groups.append(mems)
    return groups


def _setup(spec: PpSpec):
    """``sides.setup``, and no model config: these stages' state pools hold their own layers
    only (SGLang's SWAKVPool holding every layer on each stage is the real-server test's)."""
    backend, defs = sides.setup(spec)
    backend._model_swa_stage_layers = lambda server_args, pp_rank, pp_size: None
    return backend, defs


def _prefill(spec: PpSpec, closers: list, out) -> dict:
    backend, defs = _setup(spec)
    backend._pp_exchange = file_exchange(spec.exchange_dir)
    m, deadline = spec.model, time.monotonic() + spec.timeout_s
    sa = _server_args(spec, spec.port)
    if spec.pp_rank == 0:  # the prefill server's bootstrap (one per server)
        boot = backend.KVXferKVBootstrapServer(sa.host, sa.disaggregation_bootstrap_port)
        closers.append(boot.close)
    groups = _memories(spec, poison(spec.pp_rank))
    mgrs = []
    for mems in groups:
        mgrs.append(
            [
                backend.KVXferKVManager(mem.kv_args, defs.DisaggregationMode.PREFILL, sa, m.is_mla_backend)
                for mem in mems
            ]
        )
        closers.extend(mgr.close for mgr in mgrs[-1])
    for row in mgrs:
        for mgr in row:
            mgr.register_to_bootstrap()
    pages = sides._allocate(m, spec.requests, seed=1)
    if spec.kv_sharded:  # logical page ids over every CP rank's pool, the same on every stage
        local = (m.pool_tokens + m.page_size) // m.page_size
        free = np.random.default_rng(1).permutation(np.arange(spec.cp, spec.cp * local))
        bounds = np.cumsum([0] + [len(p) for p in pages])
        pages = [free[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    states = state_env.allocate(m, spec.requests, seed=11) if m.state is not None else None
    work = []
    for slot, (room, tokens) in enumerate(spec.requests):
        g = room % spec.dp
        senders = [backend.KVXferKVSender(mgr, f"{sa.host}:{spec.port}", room) for mgr in mgrs[g]]
        work.append(
            {"room": room, "tokens": tokens, "group": g, "slot": slot, "senders": senders, "pages": pages[slot]}
        )
        work[-1]["state"] = states[slot] if states is not None else None
    results: dict = {}

    def failed(w):
        results[w["room"]] = {"status": "Failed", "reasons": sides._failure(w["senders"])}

    def bootstrapped(w):  # finalize_bootstrap on every stage, then this stage's forward
        w["prefixes"] = [s.pop_decode_prefix_len() for s in w["senders"]]
        for s in w["senders"]:
            s.init(len(w["pages"]), w["slot"])
        _forward_and_send(spec, w, groups[w["group"]])

    bootstrapping, inflight = list(work), []
    while bootstrapping or inflight:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rooms {[w['room'] for w in bootstrapping + inflight]} never concluded")
        for w in list(bootstrapping):
            if spec.pp_rank == 0:  # poll_and_all_reduce_prefill_pp: stage 0 decides for every stage
                poll = min(int(s.poll_pp_consensus()) for s in w["senders"])
                if poll not in (FAILED, WAITING):
                    continue
                for q in spec.decisions.values():
                    q.put((w["room"], poll))
            else:
                try:
                    room, poll = spec.decisions.get(timeout=0.001)
                except queue.Empty:
                    break
                w = next(x for x in bootstrapping if x["room"] == room)
            bootstrapping.remove(w)
            if poll == FAILED:
                failed(w)
                continue
            if spec.die:  # this stage's process dies before it sends anything
                out.put((spec.name, {"died": w["room"]}))
                out.close()
                out.join_thread()  # the report is out before the process ends
                os._exit(0)
            bootstrapped(w)
            inflight.append(w)
        for w in list(inflight):
            poll = sides._min_poll(w["senders"])
            if poll in (FAILED, SUCCESS):
                inflight.remove(w)
                if poll == FAILED:
                    failed(w)
                else:
                    results[w["room"]] = {"status": "Success", "prefixes": w["prefixes"]}
                    results[w["room"]]["bytes"] = [s.get_transfer_metric().transfer_total_bytes for s in w["senders"]]
                    if spec.kv_sharded:  # the request's pages each CP rank holds
                        owners = np.asarray(w["pages"]) % spec.cp
                        results[w["room"]]["shard_pages"] = [int((owners == c).sum()) for c in range(spec.cp)]
                    for s in w["senders"]:
                        s.clear()
        time.sleep(0.002)
    return results


def _forward_and_send(spec: PpSpec, w: dict, mems) -> None:
    """This stage's forward of each chunk writes its layers' rows of the group's KV (each
    rank its heads), then ``send_kv_chunk`` hands the chunk's pages to every rank's sender."""
    import torch

    from sglang_kvxfer.engine.synthetic import fill_request

    m, part = spec.model, stage_model(spec)
    oracle = PpOracle(m, w["room"], w["group"], w["tokens"], spec.stage_layers)
    full = [oracle.rows(layer, kind) for layer, kind in buffers_of(m, spec.layers)]
    ps = m.page_size
    drafts = draft_places(spec)
    for a in range(0, w["tokens"], CHUNK_TOKENS):
        b = min(w["tokens"], a + CHUNK_TOKENS)
        last = b == w["tokens"]
        chunk = w["pages"][a // ps : -(-b // ps)]
        rows = torch.from_numpy(page_rows(m, chunk))
        lo = (a // ps) * ps
        for i, mem in enumerate(mems):
            c, r = divmod(i, spec.tp)
            # the chunk's pages this rank holds the KV of (by their index in the request)
            held = np.arange(a // ps, a // ps + len(chunk))
            here = rows  # where this rank holds those pages' rows
            if spec.kv_sharded:  # the chunk's logical pages on this CP rank, at their local ids
                held = held[np.asarray(chunk) % spec.cp == c]
                here = torch.from_numpy(page_rows(m, np.asarray(chunk) // spec.cp))
            elif c and not spec.cp_sharded:
                held = held[:0]  # a CP replica: CP rank 0 sends every page
            elif spec.cp > 1 and spec.cp_sharded:
                share = cp_share(len(w["pages"]), c, spec.cp)
                held = held[(held >= share.start) & (held < share.stop)]
            keep = torch.from_numpy(np.isin(np.arange(len(chunk)), held - a // ps).repeat(ps))
            heads, rows_held = heads_of(m, spec.tp, r), here[keep]
            for view, want in zip(byte_views(mem), full):
                written = torch.from_numpy(np.ascontiguousarray(want[lo : lo + len(chunk) * ps][:, heads, :]))
                view[rows_held] = written[keep]
            if drafts is not None and len(held):  # the last stage's draft model extends over the same pages
                pages = np.asarray(w["pages"], dtype=np.int64)
                fill_request(drafts[r], mem.draft_buffers, draft_seed(w["room"], w["group"]), pages, a, b - a)
                for buf in mem.draft_buffers if not bool(keep.all()) else ():  # not its share: its poison
                    buf.view(torch.uint8)[rows[~keep]] = cp_poison(spec.pp_rank, c)
            if part.kv_layout is not None and c == 0:  # DeepSeek-V4: the chunk's pages of its other compressed pools
                state_env.fill_pages(part, mem.extra["state"], w["room"], w["pages"], a, b)
            if last:  # set_buf on every stage (the outputs reach every stage's scheduler)
                for name, row in sides.aux_rows(m, w["room"]).items():
                    mem.meta[name][w["slot"]] = row
            if last and part.state is not None and c == 0:  # this stage's layers' state rows, final after its forward
                state_env.fill(part, spec.tp, r, mem.extra["state"], w["room"], w["state"], w["pages"], 0)
        state_indices = [] if last else None
        if last and part.state is not None:
            state_indices = state_env.payload(part, w["state"], w["pages"], 0)
        for s in w["senders"]:
            if s.should_send_kv_chunk(len(chunk), last):
                s.send(np.asarray(chunk, dtype=np.int32), state_indices, num_kv_tokens=b - a)


def _decode(spec: PpSpec, closers: list, out) -> dict:
    import torch

    from sglang_kvxfer.engine.synthetic import verify_request

    backend, defs = _setup(spec)
    backend._model_total_kv_heads = sides._model_heads(spec.model)
    m, deadline = spec.model, time.monotonic() + spec.timeout_s
    sa = _server_args(spec, spec.port + 1 + spec.pp_rank)
    addr = f"127.0.0.1:{spec.port}"
    groups = _memories(spec, SENTINEL)
    mgrs = []
    for mems in groups:
        mgrs.append(
            [backend.KVXferKVManager(mem.kv_args, defs.DisaggregationMode.DECODE, sa, m.is_mla_backend) for mem in mems]
        )
        closers.extend(mgr.close for mgr in mgrs[-1])
    every = [mgr for row in mgrs for mgr in row]
    pages = sides._allocate(m, spec.requests, seed=2)
    part = stage_model(spec)
    drafts = draft_places(spec)
    states = state_env.allocate(m, spec.requests, seed=12) if m.state is not None else None
    if spec.corrupt_stage is not None:
        _corrupt_first_landing(backend, spec, groups[0][0], every[0], spec.requests[0][0], pages[0])
    work = []
    for slot, (room, tokens) in enumerate(spec.requests):
        g = slot % spec.dp  # the decode DP group serving it
        rxs = [backend.KVXferKVReceiver(mgr, addr, room) for mgr in mgrs[g]]
        work.append({"room": room, "tokens": tokens, "group": g, "slot": slot, "rxs": rxs, "pages": pages[slot]})
        work[-1]["state"] = states[slot] if states is not None else None
    while not all(mgr.try_ensure_parallel_info(addr) for mgr in every):
        if time.monotonic() > deadline:
            raise TimeoutError(f"prefill parallel info for {addr} never arrived")
        time.sleep(0.02)
    info = every[0].prefill_info_table[addr]
    results: dict = {
        "info": {
            "attn_tp_size": info.attn_tp_size,
            "dp_size": info.dp_size,
            "pp_size": info.pp_size,
            "pp_layers": [[r.start, r.stop] for r in info.pp_layers],
            "problem": info.problem,
        }
    }
    for w in work:  # _resolve_prefill_dp_rank, then init
        w["route"] = 0 if info.dp_size == 1 else w["room"] % info.dp_size
        for rx in w["rxs"]:
            rx.init(w["route"])

    def failed(w):
        results[w["room"]] = {"status": "Failed", "reasons": sides._failure(w["rxs"])}

    served = []
    waiting, transferring = list(work), []
    while waiting or transferring:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rooms {[w['room'] for w in waiting + transferring]} never concluded")
        for w in list(waiting):
            poll = sides._min_poll(w["rxs"])
            if poll == FAILED:
                waiting.remove(w)
                failed(w)
            elif poll >= WAITING:
                waiting.remove(w)
                transferring.append(w)
                state_indices = [] if part.state is None else state_env.payload(part, w["state"], w["pages"], 0)
                for rx in w["rxs"]:
                    rx.send_metadata(
                        np.asarray(w["pages"], dtype=np.int32), w["slot"], state_indices, decode_prefix_len=0
                    )
        for w in list(transferring):
            poll = sides._min_poll(w["rxs"])
            if poll == FAILED:
                transferring.remove(w)
                failed(w)
            elif poll == SUCCESS:
                transferring.remove(w)
                mems = groups[w["group"]]
                aux = [
                    f"rank {r}: metadata {name} differs"
                    for r, mem in enumerate(mems)
                    for name, row in sides.aux_rows(m, w["room"]).items()
                    if not bool((mem.meta[name][w["slot"]] == row).all())
                ]
                if part.state is not None:  # every state row of the request, on every rank
                    for r, mem in enumerate(mems):
                        got = state_env.verify(
                            part, spec.tp, r, mem.extra["state"], w["room"], w["state"], w["pages"], 0
                        )
                        aux += [f"rank {r}: {p}" for p in got]
                if drafts is not None:  # every byte of the draft model's KV of the request
                    for r, mem in enumerate(mems):
                        seed, pages = draft_seed(w["room"], w["route"]), np.asarray(w["pages"], dtype=np.int64)
                        got = verify_request(drafts[r], mem.draft_buffers, seed, pages, w["tokens"])
                        aux += [f"rank {r} draft: {p}" for p in got]
                verified = [rx.kv_checksum_heads for rx in w["rxs"]]
                parts = [dict(rx.checksum_parts) for rx in w["rxs"]]
                results[w["room"]] = {
                    "status": "Success",
                    "problems": aux,
                    "route": w["route"],
                    "verified": verified,
                    "parts": parts,
                }
                served.append(w)
                for rx in w["rxs"]:
                    rx.clear()
        time.sleep(0.002)
    # Every byte of every decode buffer against the oracle of what it must hold (the rows of
    # a failed request may hold what landed before it failed: they are not compared).
    failed_rows = np.concatenate([page_rows(m, w["pages"]) for w in work if w not in served] or [np.zeros(0, int)])
    problems = []
    for g, mems in enumerate(groups):
        for r, mem in enumerate(mems):
            views = byte_views(mem)
            expected = [np.full(tuple(v.shape), SENTINEL, dtype=np.uint8) for v in views]
            heads = heads_of(m, spec.tp, r)
            for w in served:
                if w["group"] != g:
                    continue
                oracle = PpOracle(m, w["room"], w["route"], w["tokens"], spec.stage_layers)
                rows = page_rows(m, w["pages"])
                for want, (layer, kind) in zip(expected, buffers_of(m, spec.layers)):
                    want[rows] = oracle.rows(layer, kind)[:, heads, :]
            for b, (view, want, (layer, kind)) in enumerate(zip(views, expected, buffers_of(m, spec.layers))):
                got = view.numpy()
                want[failed_rows] = got[failed_rows]
                if not np.array_equal(got, want):
                    row, head, byte = (int(x) for x in np.argwhere(got != want)[0])
                    problems.append(
                        f"decode DP group {g} rank {r} buffer {b} ({'KV'[kind]} of layer {layer}): page "
                        f"{row // m.page_size} row {row % m.page_size} local head {head} byte {byte} is "
                        f"{int(got[row, head, byte])}, expected {int(want[row, head, byte])}"
                    )
    if drafts is not None:  # nothing landed in a draft row no request was given
        for g, mems in enumerate(groups):
            used = [page_rows(m, w["pages"]) for w in work if w["group"] == g]
            for r, mem in enumerate(mems):
                for b, buf in enumerate(mem.draft_buffers):
                    rest = np.ones(buf.shape[0], dtype=bool)
                    rest[np.concatenate(used)] = False
                    if buf.view(torch.uint8)[torch.from_numpy(rest)].any():
                        problems.append(
                            f"decode DP group {g} rank {r} draft buffer {b}: a row no request used was written"
                        )
    if part.state is not None:  # nothing landed in a state row no request was given
        allocs, kv = [w["state"] for w in work], [w["pages"] for w in work]
        for g, mems in enumerate(groups):
            for r, mem in enumerate(mems):
                problems += [
                    f"decode DP group {g} rank {r}: {p}"
                    for p in state_env.untouched(part, mem.extra["state"], allocs, kv)
                ]
    results["pool_problems"] = problems
    return results


def _corrupt_first_landing(backend, spec: PpSpec, mem, mgr, room: int, pages) -> None:
    """Flip one byte of decode rank 0's first token row of ``room`` in the K buffer of the
    first layer of prefill stage ``corrupt_stage``, after every writer reported done and
    before the KV checksum is checked."""
    import torch

    first_layer = spec.stage_layers[spec.corrupt_stage][0]
    index = first_layer - spec.layers[0]

    def corrupt(rx) -> None:
        if rx.bootstrap_room == room and rx.kv_mgr is mgr:
            mem.k[index].view(torch.uint8)[int(pages[0]) * spec.model.page_size, 0, 0] ^= 0x5A

    backend.after_kv_landed = corrupt


def check_decoded(reports: dict, decode_pp: int, requests: list) -> None:
    """Every decode stage served every request with no problem, and every byte of its pools
    matches the oracle."""
    for s in range(decode_pp):
        dec = reports[f"decode pp{s}"]
        for room, _ in requests:
            assert dec[room]["status"] == "Success", dec[room]
            assert dec[room]["problems"] == [], dec[room]["problems"]
        assert dec["pool_problems"] == [], dec["pool_problems"]


def deployment(
    model: Model,
    prefill: tuple,  # (attn tp, dp, pp)
    decode: tuple,  # (attn tp, dp, pp)
    requests: list,
    exchange_dir: str,
    port: int,
    *,
    env: dict | None = None,
    timeout_s: float = 60.0,
    prefill_layers: list | None = None,  # every prefill stage's layers (default: SGLang's split)
    decode_model: Model | None = None,
    die_stage: int | None = None,
    kv_checksum: bool = False,
    corrupt_stage: int | None = None,
    prefill_cp: int = 1,
    cp_sharded: bool = False,
    kv_sharded: bool = False,
) -> list[PpSpec]:
    """The specs of one deployment: a process per prefill stage and per decode stage (with
    ``cp_sharded``, the prefill's alone get ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER``:
    the decode learns it from the bootstrap)."""
    env = {**sides.ENV, "KVXFER_SGLANG_TRANSPORT": "local", **(env or {})}
    p_env = {**env, "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": "1"} if cp_sharded else env
    p_tp, p_dp, p_pp = prefill
    d_tp, d_dp, d_pp = decode
    stages = prefill_layers or pp_layers(model.num_layers, p_pp)
    dm = decode_model or model
    d_stages = pp_layers(dm.num_layers, d_pp)
    specs = [
        PpSpec(
            "prefill",
            f"prefill pp{s}",
            model,
            p_tp,
            p_dp,
            p_pp,
            s,
            tuple(stages[s]),
            port,
            requests,
            exchange_dir,
            p_env,
            timeout_s,
            stage_layers=stages,
            die=s == die_stage,
            kv_checksum=kv_checksum,
            cp=prefill_cp,
            cp_sharded=cp_sharded,
            kv_sharded=kv_sharded,
        )
        for s in range(p_pp)
    ]
    specs += [
        PpSpec(
            "decode",
            f"decode pp{s}",
            dm,
            d_tp,
            d_dp,
            d_pp,
            s,
            tuple(d_stages[s]),
            port,
            requests,
            exchange_dir,
            env,
            timeout_s,
            stage_layers=stages,
            kv_checksum=kv_checksum,
            corrupt_stage=corrupt_stage,
        )
        for s in range(d_pp)
    ]
    return specs
