"""``--disaggregation-decode-allocation-policy prefill_complete`` driven the way SGLang
0.5.23's event loops drive it (``prefill.py``, ``decode.py``), prefill and decode in separate
processes over our real SGLang classes:

prefill: ``KVSender`` per request; its poll says Bootstrapping, and the request is prefilled
anyway (``can_prefill_before_bootstrap``: every chunk's forward runs, nothing is sent,
``pending_bootstrap``); after the last chunk ``mark_prefill_complete()``; the request stays
parked until the poll says WaitingForInput (the decode's metadata came), then
``finalize_bootstrap`` (``pop_decode_prefix_len``, ``init``) and one ``send`` of every page
with the last chunk; Success, ``clear()``.

decode: ``KVReceiver``, ``init(prefill_dp_rank)``; the poll stays Bootstrapping until the
prefill's forward finished, only then WaitingForInput: ``pop_preallocated`` allocates and
``send_metadata``; Success through the metadata gate.

Every KV byte and the metadata slot are compared in the decode's own memory. The prefill
sets a cross-process event right before it marks a request complete; the decode records
whether it was set when its poll first said WaitingForInput. The negative control: a decode
of the ``early`` policy against the same prefill reaches WaitingForInput before the forward
(and still receives every byte)."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import time
from typing import Any

import numpy as np
import pytest

from tests.integrations import sglang_sides as sides
from tests.integrations.sglang_env import Model, import_sglang_base, model_geometry, rank_memory, server_args
from tests.ports import free_port

_base, _reason = import_sglang_base()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_base is None, reason=_reason)]

REQUESTS = [(0x5EED_0003_F00D, 37), (0x7A11_0004_CAFE, 9)]
HOLD_S = 1.0  # the prefill's queue and forward: the decode is told only after it
POLICY = "disaggregation_decode_allocation_policy"


@dataclasses.dataclass
class Side(sides.Spec):
    policy: str = "prefill_complete"
    forward_done: Any = None  # a multiprocessing Event per request slot, set before mark_prefill_complete


def main(spec: Side, out, release) -> None:
    sides.serve(spec, out, release, _prefill, _decode)


def _prefill(spec: Side, closers: list) -> dict:
    from sglang_kvxfer.engine.synthetic import fill_request

    backend, defs = sides.setup(spec)
    m, deadline = spec.model, time.monotonic() + spec.timeout_s
    sa = server_args(sides.MODEL_PATH, "prefill", spec.tp, spec.port, **{POLICY: spec.policy})
    mems, mgrs = sides.start_ranks(spec, backend, defs, sa, closers)
    geo = model_geometry(m)
    pages = sides._allocate(m, spec.requests, seed=1)
    results: dict = {}
    reqs = []
    for slot, (room, tokens) in enumerate(spec.requests):
        senders = [
            backend.KVXferKVSender(mgr=mgr, bootstrap_addr=f"{sa.host}:{spec.port}", bootstrap_room=room)
            for mgr in mgrs
        ]
        reqs.append({"room": room, "tokens": tokens, "slot": slot, "senders": senders, "pages": pages[slot]})

    def failed(req):
        results[req["room"]] = {"status": "Failed", "reasons": sides._failure(req["senders"])}

    time.sleep(HOLD_S)  # the request waits in the prefill's queue
    polls = {r["room"]: sides._min_poll(r["senders"]) for r in reqs}  # pop_bootstrapped
    for req in reqs:  # Bootstrapping: optimistic prefill, every chunk computed and kept (WaitingForInput:
        if polls[req["room"]] == sides.FAILED:  # an early decode's metadata is in; SGLang computes it and sends)
            failed(req)
            continue
        for a in range(0, req["tokens"], sides.CHUNK_TOKENS):
            b = min(req["tokens"], a + sides.CHUNK_TOKENS)
            for r, mem in enumerate(mems):
                fill_request(geo.placement(spec.tp, r), mem.buffers, req["room"], req["pages"], a, b - a)
        for mem in mems:  # set_buf: the first output token & co.
            for name, row in sides.aux_rows(m, req["room"]).items():
                mem.meta[name][req["slot"]] = row
        spec.forward_done[req["slot"]].set()
        for s in req["senders"]:
            s.mark_prefill_complete()
    parked = [r for r in reqs if r["room"] not in results]
    ready = sides._wait(parked, lambda r: r["senders"], sides.WAITING, deadline, failed)  # handle_pending_bootstrap
    for req in ready:  # finalize_bootstrap, then send_kv_chunk(last_chunk=True): every page at once
        prefix = req["senders"][0].pop_decode_prefix_len()
        for s in req["senders"][1:]:
            s.pop_decode_prefix_len()
        req["prefix"] = prefix
        for s in req["senders"]:
            s.init(len(req["pages"]), req["slot"])
            s.send(req["pages"].astype(np.int32), [], num_kv_tokens=req["tokens"])
    for req in sides._wait(ready, lambda r: r["senders"], sides.SUCCESS, deadline, failed):
        results[req["room"]] = {"status": "Success", "prefix": req["prefix"]}
        for s in req["senders"]:
            s.clear()
    return results


def _decode(spec: Side, closers: list) -> dict:
    from sglang_kvxfer.engine.synthetic import verify_request

    backend, defs = sides.setup(spec)
    backend._model_total_kv_heads = sides._model_heads(spec.model)
    m, deadline = spec.model, time.monotonic() + spec.timeout_s
    sa = server_args(sides.MODEL_PATH, "decode", spec.tp, spec.port + 1, **{POLICY: spec.policy})
    mems, mgrs = sides.start_ranks(spec, backend, defs, sa, closers)
    addr = f"127.0.0.1:{spec.port}"
    pages = sides._allocate(m, spec.requests, seed=2)
    results: dict = {}
    reqs = []
    for slot, (room, tokens) in enumerate(spec.requests):
        rxs = [backend.KVXferKVReceiver(mgr=mgr, bootstrap_addr=addr, bootstrap_room=room) for mgr in mgrs]
        reqs.append({"room": room, "tokens": tokens, "slot": slot, "rxs": rxs, "pages": pages[slot]})
    sides.wait_parallel_info(mgrs, addr, deadline)
    for req in reqs:
        for rx in req["rxs"]:
            rx.init(0)

    def failed(req):
        results[req["room"]] = {"status": "Failed", "reasons": sides._failure(req["rxs"])}

    # _update_handshake_waiters: each request is allocated as soon as its poll says so
    pending, ready = list(reqs), []
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rooms {[r['room'] for r in pending]} never reached WaitingForInput")
        for req in list(pending):
            poll = sides._min_poll(req["rxs"])
            if poll == sides.FAILED:
                failed(req)
                pending.remove(req)
            elif poll >= sides.WAITING:
                req["forward_done_first"] = spec.forward_done[req["slot"]].is_set()
                for rx in req["rxs"]:  # pop_preallocated: allocate, then send_metadata
                    rx.send_metadata(req["pages"].astype(np.int32), req["slot"], [], decode_prefix_len=0)
                ready.append(req)
                pending.remove(req)
        time.sleep(0.002)
    geo = model_geometry(m)
    for req in sides._wait(ready, lambda r: r["rxs"], sides.SUCCESS, deadline, failed):
        problems = []
        for r, mem in enumerate(mems):
            place = geo.placement(spec.tp, r)
            problems += [
                f"rank {r}: {p}" for p in verify_request(place, mem.buffers, req["room"], req["pages"], req["tokens"])
            ]
            for name, row in sides.aux_rows(m, req["room"]).items():
                if not bool((mem.meta[name][req["slot"]] == row).all()):
                    problems.append(f"rank {r}: metadata {name} of slot {req['slot']} differs")
        results[req["room"]] = {
            "status": "Success",
            "problems": problems,
            "forward_done_first": req["forward_done_first"],
        }
        for rx in req["rxs"]:
            rx.clear()
    return results


def _run(prefill_policy="prefill_complete", decode_policy="prefill_complete", p=1, d=1, heads=4, timeout_s=60.0):
    ctx = mp.get_context("spawn")
    done = [ctx.Event() for _ in REQUESTS]
    port = free_port()
    model = Model(total_kv_heads=heads)
    specs = [
        Side(role, model, tp, port, REQUESTS, dict(sides.ENV), timeout_s, policy=policy, forward_done=done)
        for role, tp, policy in (("prefill", p, prefill_policy), ("decode", d, decode_policy))
    ]
    return sides.run_in_processes(main, specs, timeout_s)


def test_the_decode_allocates_only_after_the_prefills_forward_and_every_byte_lands():
    prefill, decode = _run()
    for room, _ in REQUESTS:
        assert prefill[room] == {"status": "Success", "prefix": 0}, prefill[room]
        assert decode[room]["status"] == "Success", decode[room]
        assert decode[room]["problems"] == [], decode[room]["problems"]
        assert decode[room]["forward_done_first"] is True  # WaitingForInput came after the forward


def test_negative_control_a_decode_of_the_early_policy_is_ready_before_the_forward():
    prefill, decode = _run(decode_policy="early")
    for room, _ in REQUESTS:
        assert prefill[room]["status"] == "Success", prefill[room]
        assert decode[room]["status"] == "Success" and decode[room]["problems"] == [], decode[room]
        assert decode[room]["forward_done_first"] is False  # it allocated while the prefill still held it


def test_a_decode_waiting_for_a_prefill_of_the_early_policy_fails_both_naming_the_policy():
    prefill, decode = _run(prefill_policy="early", timeout_s=30.0)
    for room, _ in REQUESTS:
        assert decode[room]["status"] == "Failed", decode[room]
        assert any("set the same policy on both servers" in r for r in decode[room]["reasons"]), decode[room]
        assert prefill[room]["status"] == "Failed", prefill[room]
        assert any("prefill_complete" in r for r in prefill[room]["reasons"]), prefill[room]


@pytest.mark.parametrize("kinds, refused", [(("swa",), "swa"), (("mamba",), "mamba"), (("dsa",), None)])
def test_state_other_than_dsa_is_refused_with_prefill_complete_as_sglang_refuses_it(monkeypatch, kinds, refused):
    from sglang_kvxfer.errors import KVXferError
    from sglang_kvxfer.integrations import sglang as backend
    from tests.integrations.sglang_env import load_utils_defs
    from tests.integrations.sglang_state_env import StateModel

    for name, value in sides.ENV.items():
        monkeypatch.setenv(name, value)
    model = Model(total_kv_heads=4, kv_cache_dtype_str="bfloat16", mla="dsa" in kinds, state=StateModel(kinds=kinds))
    monkeypatch.setattr(backend, "_model_swa_kv_heads", lambda server_args: model.state.swa_heads)
    mem = rank_memory(model, 1, 0, "prefill")
    sa = server_args(sides.MODEL_PATH, "prefill", 1, free_port(), **{POLICY: "prefill_complete"})
    mode = load_utils_defs().DisaggregationMode.PREFILL
    if refused:
        with pytest.raises(KVXferError, match=f"prefill_complete'.*with {refused} state"):
            backend.KVXferKVManager(mem.kv_args, mode, sa, model.is_mla_backend)
    else:
        mgr = backend.KVXferKVManager(mem.kv_args, mode, sa, model.is_mla_backend)
        try:
            assert mgr.plan.prefill_complete and [p.kind for p in mgr.layout.states] == ["dsa"]
        finally:
            mgr.close()
