"""The decode side of a PD deployment whose decode runs ``--dcp-size N`` (decode context
parallel), driven in SGLang 0.5.23's call order like ``sglang_sides._decode``; the prefill side
is ``sglang_sides._prefill`` unchanged.

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
from tests.integrations.sglang_env import model_geometry, rank_memory, server_args


def main(spec, out, release) -> None:
    sides.serve(spec, out, release, sides._prefill, _decode)


def _dcp_memory(m, tp: int, rank: int, dcp: int):
    """``rank_memory`` of a DCP decode rank: the draft pool re-made with pages of
    ``page_size * dcp`` rows (SGLang sizes it in virtual token slots)."""
    import torch

    mem = rank_memory(m, tp, rank, "decode")
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
        own = np.arange(phase, req["tokens"], dcp)
        rows = req["pages"][own // (ps * dcp)] * ps + (own % (ps * dcp)) // dcp
        for layer, (buf, want) in enumerate(zip(mem.buffers, ref)):
            got, exp = _bits(buf)[rows], _bits(want)[own]  # bits: the content holds NaN patterns
            if not bool((got == exp).all()):
                bad = int(np.flatnonzero((got != exp).flatten(1).any(1).numpy())[0])
                problems.append(f"{label} room {req['room']:#x} layer {layer}: token {int(own[bad])} differs")
        touched.append(req["pages"])
    untouched = np.setdiff1d(np.arange(len(mem.buffers[0]) // ps), np.concatenate(touched))
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
    sa = server_args(sides.MODEL_PATH, "decode", spec.tp, spec.port + 1, dcp_size=dcp)
    mems, mgrs = [], []
    for r in range(spec.tp):
        mems.append(_dcp_memory(m, spec.tp, r, dcp))
        mgrs.append(backend.KVXferKVManager(mems[r].kv_args, defs.DisaggregationMode.DECODE, sa, m.mla))
        closers.append(mgrs[r].close)
    addr = f"127.0.0.1:{spec.port}"
    span = m.page_size * dcp  # tokens of one decode page id
    num_pages = (m.pool_tokens + m.page_size) // m.page_size
    free = np.random.default_rng(2).permutation(np.arange(1, num_pages))
    reqs, at = [], 0
    for slot, (room, tokens, *rest) in enumerate(spec.requests):
        need = -(-tokens // span)
        rxs = [backend.KVXferKVReceiver(mgr=mgr, bootstrap_addr=addr, bootstrap_room=room) for mgr in mgrs]
        prefix = rest[0] if rest else 0
        reqs.append(
            {"room": room, "tokens": tokens, "slot": slot, "rxs": rxs, "pages": free[at : at + need], "prefix": prefix}
        )
        at += need
    while not all(mgr.try_ensure_parallel_info(addr) for mgr in mgrs):
        if time.monotonic() > deadline:
            raise TimeoutError(f"prefill parallel info for {addr} never arrived")
        time.sleep(0.02)
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
                own = np.arange(r % dcp, prefix, dcp)
                rows = req["pages"][own // span] * m.page_size + (own % span) // dcp
                for buf, want in zip(mem.buffers, ref):
                    buf[rows] = want[own]
            if m.draft is not None:
                dref = _reference(m, req["room"], prefix, draft=True)
                t = np.arange(prefix)
                for mem in mems:
                    for buf, want in zip(mem.draft_buffers, dref):
                        buf[req["pages"][t // span] * span + t % span] = want
        after = req["pages"][prefix // span :].astype(np.int32)
        for rx in req["rxs"]:
            rx.send_metadata(after, req["slot"], [], decode_prefix_len=prefix)

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
    for req in done:
        problems = []
        for r, mem in enumerate(mems):
            for name, row in sides.aux_rows(m, req["room"]).items():
                if not bool((mem.meta[name][req["slot"]] == row).all()):
                    problems.append(f"rank {r}: metadata {name} of slot {req['slot']} differs")
            if m.draft is not None:
                problems += _check_draft(m, mem, dcp, req, f"rank {r}")
        results[req["room"]] = {"status": "Success", "problems": problems}
    landed = [req for req in reqs if results.get(req["room"], {}).get("status") == "Success"]
    pool_problems = [p for r, mem in enumerate(mems) for p in _check_rank(m, mem, dcp, r % dcp, landed, f"rank {r}")]
    control = [p for r, mem in enumerate(mems) for p in _check_rank(m, mem, dcp, (r + 1) % dcp, landed, f"rank {r}")]
    for req in landed:
        for rx in req["rxs"]:
            rx.clear()
    return {"requests": results, "pool_problems": pool_problems, "control_problems": len(control)}
