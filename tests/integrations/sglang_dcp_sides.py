"""The sides of a PD deployment whose decode runs ``--dcp-size N`` (decode context parallel),
driven in SGLang 0.5.23's call order like ``sglang_sides``; a prefill of DCP 1 is
``sglang_sides._prefill`` unchanged, one of DCP N (each rank holding its share, as the
decode's ranks do) is ``_prefill`` here.

What SGLang's DCP decode looks like to a backend (``mem_cache``: the allocator hands out pages
of ``page_size * N`` tokens, ``layers/dcp/layout.py``: token ``t`` of a request lives on DCP
rank ``t % N`` at local row ``t // N``): ``KVArgs.page_size`` is the pool's ``page_size``, every
rank's MLA pool has ``page_size`` rows per page id, and ``send_metadata`` gets the request's
page ids of ``page_size * N`` tokens. A draft pool is not split: its pages hold ``page_size *
N`` token rows (``kv_item_lens`` of that many rows). Each decode rank checks every row it must
hold (token ``t`` at row ``page * page_size + (t % (page_size * N)) // N``) against the content
the prefill's forward wrote, the draft's every row, and that no other page changed; and, as a
control that the check can fail, that its rows do not hold the next DCP rank's tokens.
"""

from __future__ import annotations

import time

import numpy as np

from tests.integrations import sglang_sides as sides
from tests.integrations import sglang_state_env as state_env
from tests.integrations.sglang_env import model_geometry, rank_memory, server_args


def main(spec, out, release) -> None:
    """A prefill of ``spec.dcp_size`` > 1 runs ``_prefill`` (each rank holding its DCP share),
    one of DCP 1 ``sglang_sides._prefill``; the decode ``_decode``."""
    prefill = _prefill if spec.role == "prefill" and spec.dcp_size > 1 else sides._prefill
    sides.serve(spec, out, release, prefill, _decode)


def _own_rows(pages, page_size: int, dcp: int, phase: int, tokens: int, start: int = 0):
    """(tokens, rows): the request's tokens ``[start, tokens)`` DCP rank ``phase`` holds and
    its rows of them (page ids of ``page_size * dcp`` tokens, ``page_size`` rows each)."""
    span = page_size * dcp
    own = np.arange(start + (phase - start) % dcp, tokens, dcp)
    return own, pages[own // span] * page_size + (own % span) // dcp


def _prefill(spec, closers: list) -> dict:
    """The prefill side with ``--dcp-size N``: SGLang's call order as ``sglang_sides._prefill``;
    the forward writes each rank's share of every token (and the draft's every token) into
    its pages, chunks of two DCP pages."""
    backend, defs = sides.setup(spec)
    m, dcp, deadline = spec.model, spec.dcp_size, time.monotonic() + spec.timeout_s
    sa = server_args(
        sides.MODEL_PATH,
        "prefill",
        spec.tp,
        spec.port,
        dcp_size=dcp,
        disaggregation_enable_kv_checksum=spec.kv_checksum,
    )
    boot = backend.KVXferKVBootstrapServer(sa.host, sa.disaggregation_bootstrap_port)
    closers.append(boot.close)
    mems, mgrs = [], []
    for r in range(spec.tp):
        mems.append(dcp_memory(m, spec.tp, r, dcp, "prefill"))
        mgrs.append(backend.KVXferKVManager(mems[r].kv_args, defs.DisaggregationMode.PREFILL, sa, m.is_mla_backend))
        closers.append(mgrs[r].close)
    for mgr in mgrs:
        mgr.register_to_bootstrap()
    span = m.page_size * dcp
    pages = allocate(m, spec.requests, dcp, seed=1)
    states = state_env.allocate(m, spec.requests, seed=11) if m.state is not None else None
    reqs, results = [], {}
    for slot, (room, tokens, *_) in enumerate(spec.requests):
        senders = [
            backend.KVXferKVSender(mgr=mgr, bootstrap_addr=f"{sa.host}:{spec.port}", bootstrap_room=room)
            for mgr in mgrs
        ]
        reqs.append({"room": room, "tokens": tokens, "slot": slot, "senders": senders, "pages": pages[slot]})
        reqs[-1]["state"] = states[slot] if states is not None else None
        reqs[-1]["rows"] = state_rows(m, pages[slot], tokens, dcp)  # (DSA state: rows of page_size tokens)

    def failed(req):
        results[req["room"]] = {"status": "Failed", "reasons": sides._failure(req["senders"])}

    ready = sides._wait(reqs, lambda r: r["senders"], sides.WAITING, deadline, failed)
    for req in ready:
        prefix = req["senders"][0].pop_decode_prefix_len()
        for s in req["senders"][1:]:
            s.pop_decode_prefix_len()
        req["prefix"] = prefix
        for s in req["senders"]:
            s.init(len(req["pages"]) - prefix // span, req["slot"])
    for req in ready:
        ref = _reference(m, req["room"], req["tokens"])
        dref = _reference(m, req["room"], req["tokens"], draft=True) if m.draft is not None else None
        for a in range(req["prefix"], req["tokens"], 2 * span):
            b = min(req["tokens"], a + 2 * span)
            for r, mem in enumerate(mems):  # the chunk's forward
                own, rows = _own_rows(req["pages"], m.page_size, dcp, r % dcp, b, a)
                for buf, want in zip(mem.buffers, ref):
                    buf[rows] = want[own]
                if dref is not None:
                    t = np.arange(a, b)
                    for buf, want in zip(mem.draft_buffers, dref):
                        buf[req["pages"][t // span] * span + t % span] = want[t]
            last = b == req["tokens"]
            state_indices: list | None = [] if last else None
            if last:
                for mem in mems:
                    for name, row in sides.aux_rows(m, req["room"]).items():
                        mem.meta[name][req["slot"]] = row
                if m.state is not None:  # the state rows, final after the last chunk's forward
                    rows, first = req["rows"], req["prefix"]
                    for r, mem in enumerate(mems):
                        state_env.fill(m, len(mems), r, mem.extra["state"], req["room"], req["state"], rows, first)
                    state_indices = state_env.payload(m, req["state"], rows, first)
            chunk = req["pages"][a // span : -(-b // span)].astype(np.int32)
            for s in req["senders"]:
                s.send(chunk, state_indices, num_kv_tokens=b - a)
    for req in sides._wait(ready, lambda r: r["senders"], sides.SUCCESS, deadline, failed):
        results[req["room"]] = {"status": "Success"}
        for s in req["senders"]:
            s.clear()
    return results


def allocate(m, requests, dcp: int, seed: int) -> list:
    """Disjoint page ids of ``page_size * dcp`` tokens, one list per request (page 0 unused)."""
    num_pages = (m.pool_tokens + m.page_size) // m.page_size
    free = np.random.default_rng(seed).permutation(np.arange(1, num_pages))
    out, at = [], 0
    for _, tokens, *_ in requests:
        need = -(-tokens // (m.page_size * dcp))
        out.append(free[at : at + need])
        at += need
    return out


def state_rows(m, pages, tokens: int, dcp: int) -> np.ndarray:
    """A DCP decode's DSA indexer rows of a request, in order: one row per ``page_size``
    tokens of its page ids of ``page_size * dcp`` tokens (SGLang's ``suffix_page_indices`` at
    the pool's page size over the widened id space: row ``page * dcp + j`` for the ``j``-th
    ``page_size`` tokens of a page), as many as the request has ``page_size`` pages."""
    rows = (np.asarray(pages, dtype=np.int64)[:, None] * dcp + np.arange(dcp)).reshape(-1)
    return rows[: -(-tokens // m.page_size)]


def dcp_memory(m, tp: int, rank: int, dcp: int, role: str = "decode"):
    """``rank_memory`` of a DCP rank: the draft pool re-made with pages of ``page_size * dcp``
    rows (SGLang sizes it in virtual token slots); DSA indexer buffers re-made with a row per
    ``page_size`` tokens of the widened id space, replicated on every DCP rank."""
    import torch

    mem = rank_memory(m, tp, rank, role)
    if m.state is not None and "dsa" in m.state.kinds and dcp > 1:
        _widen_dsa(m, mem, dcp)
    if m.draft is None:
        return mem
    dm = m.draft.model(m)
    num_pages = (m.pool_tokens + m.page_size) // m.page_size
    rows = num_pages * m.page_size * dcp
    dtype = getattr(torch, m.dtype)
    heads = 1 if dm.mla else max(1, dm.total_kv_heads // tp)
    mem.draft_k = [torch.zeros((rows, heads, dm.head_dim), dtype=dtype) for _ in range(dm.num_layers)]
    mem.draft_v = (
        [] if dm.mla else [torch.zeros((rows, heads, dm.v_head_dim), dtype=dtype) for _ in range(dm.num_layers)]
    )
    main_entries = len(mem.k) + len(mem.v)
    args = mem.kv_args
    bufs = mem.draft_k + mem.draft_v
    args.kv_data_ptrs = args.kv_data_ptrs[:main_entries] + [t.data_ptr() for t in bufs]
    args.kv_data_lens = args.kv_data_lens[:main_entries] + [t.nbytes for t in bufs]
    args.kv_item_lens = args.kv_item_lens[:main_entries] + [t[0].nbytes * m.page_size * dcp for t in bufs]
    return mem


def _widen_dsa(m, mem, dcp: int) -> None:
    """The DSA entries of ``mem``'s state re-made as SGLang sizes them under DCP (its
    ``(size + page_size) * dcp`` token slots, a row of ``page_size`` tokens each), in place
    in ``KVArgs.state_data_ptrs``/``state_data_lens``."""
    import torch

    args, kind = mem.kv_args, [str(getattr(t, "value", t)) for t in mem.kv_args.state_types].index("dsa")
    rows = (m.pool_tokens + m.page_size) // m.page_size * dcp
    old = mem.extra["state"].buffers["dsa"]
    bufs = [torch.zeros((rows if b.shape[0] else 0, b.shape[1]), dtype=torch.uint8) for b in old]
    mem.extra["state"].buffers["dsa"] = bufs
    args.state_data_ptrs[kind] = [b.data_ptr() for b in bufs]
    args.state_data_lens[kind] = [b.nbytes for b in bufs]


def _reference(m, room: int, tokens: int, draft: bool = False):
    """The content the prefill's forward wrote for tokens ``[0, tokens)``: row ``t`` of
    every layer buffer (a pool of one-token pages filled by the same ``fill_request``)."""
    import dataclasses

    import torch

    from sglang_kvxfer.engine.synthetic import fill_request

    geo = model_geometry(m.draft.model(m) if draft else m)
    geo = dataclasses.replace(geo, page_size=1, num_pages=tokens)
    place = geo.placement(1, 0)
    dtype = getattr(torch, m.dtype)
    bufs = [torch.zeros(place.buffer_shape(b), dtype=dtype) for b in range(geo.num_buffers)]
    fill_request(place, bufs, sides.draft_room(room) if draft else room, np.arange(tokens), 0, tokens)
    return bufs


def _bits(t):
    """A buffer's elements as raw integers of their width."""
    import torch

    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _check_rank(m, mem, dcp: int, phase: int, reqs, label: str) -> list[str]:
    """Every row DCP rank ``phase`` must hold for every request in ``reqs``; no other page
    of its pool written."""
    ps, problems, touched = m.page_size, [], []
    for req in reqs:
        ref = _reference(m, req["room"], req["tokens"])
        own, rows = _own_rows(req["pages"], ps, dcp, phase, req["tokens"])
        for layer, (buf, want) in enumerate(zip(mem.buffers, ref)):
            got, exp = _bits(buf)[rows], _bits(want)[own]  # bits: the content holds NaN patterns
            if not bool((got == exp).all()):
                bad = int(np.flatnonzero((got != exp).flatten(1).any(1).numpy())[0])
                problems.append(f"{label} room {req['room']:#x} layer {layer}: token {int(own[bad])} differs")
        touched.append(req["pages"])
    held = np.concatenate(touched) if touched else np.zeros(0, dtype=np.int64)
    untouched = np.setdiff1d(np.arange(len(mem.buffers[0]) // ps), held)
    rows = (untouched[:, None] * ps + np.arange(ps)).reshape(-1)
    for layer, buf in enumerate(mem.buffers):
        if bool(_bits(buf)[rows].ne(0).any()):
            problems.append(f"{label} layer {layer}: a page no request was given changed")
    return problems


def _check_draft(m, mem, dcp: int, req, label: str) -> list[str]:
    """Every row of the draft pool (not split: pages of ``page_size * dcp`` token rows)."""
    span, problems = m.page_size * dcp, []
    ref = _reference(m, req["room"], req["tokens"], draft=True)
    t = np.arange(req["tokens"])
    rows = req["pages"][t // span] * span + t % span
    for layer, (buf, want) in enumerate(zip(mem.draft_buffers, ref)):
        if not bool((_bits(buf)[rows] == _bits(want)).all()):
            problems.append(f"{label} draft room {req['room']:#x} buffer {layer} differs")
    return problems


def _decode(spec, closers: list) -> dict:
    backend, defs = sides.setup(spec)
    backend._model_total_kv_heads = sides._model_heads(spec.model)
    m, dcp, deadline = spec.model, spec.dcp_size, time.monotonic() + spec.timeout_s
    sa = server_args(
        sides.MODEL_PATH,
        "decode",
        spec.tp,
        spec.port + 1,
        dcp_size=dcp,
        disaggregation_enable_kv_checksum=spec.kv_checksum,
    )
    mems, mgrs = [], []
    for r in range(spec.tp):
        mems.append(dcp_memory(m, spec.tp, r, dcp))
        mgrs.append(backend.KVXferKVManager(mems[r].kv_args, defs.DisaggregationMode.DECODE, sa, m.is_mla_backend))
        closers.append(mgrs[r].close)
    addr = f"127.0.0.1:{spec.port}"
    span = m.page_size * dcp  # tokens of one decode page id
    pages = allocate(m, spec.requests, dcp, seed=2)
    # (mamba: one slot per request, its channels split over attention TP as without DCP; DSA: the
    # request's indexer rows, req['rows'])
    states = state_env.allocate(m, spec.requests, seed=12) if m.state is not None else None
    reqs = []
    for slot, (room, tokens, *rest) in enumerate(spec.requests):
        rxs = [backend.KVXferKVReceiver(mgr=mgr, bootstrap_addr=addr, bootstrap_room=room) for mgr in mgrs]
        prefix = rest[0] if rest else 0
        reqs.append({"room": room, "tokens": tokens, "slot": slot, "rxs": rxs, "pages": pages[slot], "prefix": prefix})
        reqs[-1]["state"] = states[slot] if states is not None else None
        reqs[-1]["rows"] = state_rows(m, pages[slot], tokens, dcp)  # (DSA state: rows of page_size tokens)
    if spec.corrupt:
        _corrupt_first_landing(backend, spec, mgrs, mems, reqs[0])
    sides.wait_parallel_info(mgrs, addr, deadline)
    for req in reqs:
        for rx in req["rxs"]:
            rx.init(0)
    results: dict = {}

    def failed(req):
        results[req["room"]] = {"status": "Failed", "reasons": sides._failure(req["rxs"])}

    ready = sides._wait(reqs, lambda r: r["rxs"], sides.WAITING, deadline, failed)
    for req in ready:
        prefix = req["prefix"]
        if prefix:  # a radix-cache hit: each rank holds its share of the prefix already
            ref = _reference(m, req["room"], prefix)
            for r, mem in enumerate(mems):
                own, rows = _own_rows(req["pages"], m.page_size, dcp, r % dcp, prefix)
                for buf, want in zip(mem.buffers, ref):
                    buf[rows] = want[own]
            if m.draft is not None:
                dref = _reference(m, req["room"], prefix, draft=True)
                t = np.arange(prefix)
                for mem in mems:
                    for buf, want in zip(mem.draft_buffers, dref):
                        buf[req["pages"][t // span] * span + t % span] = want
        after = req["pages"][prefix // span :].astype(np.int32)
        state_indices = [] if m.state is None else state_env.payload(m, req["state"], req["rows"], prefix)
        for rx in req["rxs"]:
            rx.send_metadata(after, req["slot"], state_indices, decode_prefix_len=prefix)

    class Gated:
        def __init__(self, rx, mem, slot):
            self.rx, self.mem, self.slot = rx, mem, slot

        def poll(self):
            p = int(self.rx.poll())
            if p == sides.SUCCESS and int(self.mem.meta["bootstrap_room"][self.slot, 0]) == 0:
                return sides.TRANSFERRING
            return p

    done = sides._wait(
        ready,
        lambda r: [Gated(rx, mems[i], r["slot"]) for i, rx in enumerate(r["rxs"])],
        sides.SUCCESS,
        deadline,
        failed,
    )
    verified: dict = {}  # room -> KV checksum heads compared per decode rank
    for req in done:
        problems = []
        for r, mem in enumerate(mems):
            for name, row in sides.aux_rows(m, req["room"]).items():
                if not bool((mem.meta[name][req["slot"]] == row).all()):
                    problems.append(f"rank {r}: metadata {name} of slot {req['slot']} differs")
            if m.draft is not None:
                problems += _check_draft(m, mem, dcp, req, f"rank {r}")
            if m.state is not None:  # every state row of the request, on every rank
                st = mem.extra["state"]
                got = state_env.verify(m, spec.tp, r, st, req["room"], req["state"], req["rows"], req["prefix"])
                problems += [f"rank {r}: {p}" for p in got]
        results[req["room"]] = {"status": "Success", "problems": problems}
        verified[req["room"]] = [rx.kv_checksum_heads for rx in req["rxs"]]
    landed = [req for req in reqs if results.get(req["room"], {}).get("status") == "Success"]
    pool_problems = [p for r, mem in enumerate(mems) for p in _check_rank(m, mem, dcp, r % dcp, landed, f"rank {r}")]
    control = [p for r, mem in enumerate(mems) for p in _check_rank(m, mem, dcp, (r + 1) % dcp, landed, f"rank {r}")]
    if m.state is not None:  # nothing landed in a state row no request was given
        allocs, kv = [r["state"] for r in reqs], [r["rows"] for r in reqs]
        pool_problems += [
            f"rank {r}: {p}"
            for r, mem in enumerate(mems)
            for p in state_env.untouched(m, mem.extra["state"], allocs, kv)
        ]
    for req in landed:
        for rx in req["rxs"]:
            rx.clear()
    return {
        "requests": results,
        "pool_problems": pool_problems,
        "control_problems": len(control),
        "verified": verified,
    }


def _corrupt_first_landing(backend, spec, mgrs, mems, req) -> None:
    """Flip one byte of decode rank 0's first landed token of ``req`` (its own DCP token in
    the model's first buffer, or the draft's first token), after every writer reported done
    and before the checksum is checked."""
    import torch

    m, dcp = spec.model, spec.dcp_size
    prefix, span = (req["prefix"], m.page_size * dcp)

    def corrupt(rx) -> None:
        if rx.bootstrap_room != req["room"] or rx.kv_mgr is not mgrs[0]:
            return
        if spec.corrupt == "draft":
            row = int(req["pages"][prefix // span]) * span + prefix % span
            mems[0].draft_buffers[0].view(torch.uint8)[row, 0, 0] ^= 0x5A
            return
        _, rows = _own_rows(req["pages"], m.page_size, dcp, 0, req["tokens"], prefix)
        mems[0].buffers[0].view(torch.uint8)[int(rows[0]), 0, 0] ^= 0x5A

    backend.after_kv_landed = corrupt
