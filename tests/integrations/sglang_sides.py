"""The prefill and the decode side of a PD deployment, each in its own process, driving our
SGLang classes the way SGLang 0.5.23's event loops drive a transfer backend.

Each side runs every TP rank of its server in one process (one manager per rank, over that
rank's own KV pool and metadata buffers) and reduces the ranks' polls with MIN, as
``poll_and_all_reduce`` does over the attention-TP group. The call order follows
``disaggregation/prefill.py`` and ``decode.py``:

prefill: bootstrap server (``start_disagg_service``); manager per rank, then
``register_to_bootstrap``; ``KVSender(mgr, bootstrap_addr, bootstrap_room)`` per request;
poll until WaitingForInput; ``init(num_pages, metadata_buffer_index)``; forward chunk by
chunk, ``send(page_indices, state_indices, num_kv_tokens)`` after each (the first one early,
before its forward finished, with a wait event as under overlap scheduling; the last after
``set_buf`` filled the metadata slot); poll until Success, then ``clear()``.

decode: manager per rank (its KVArgs carry no head counts); ``KVReceiver(mgr,
bootstrap_addr, bootstrap_room)``; ``try_ensure_parallel_info`` until True, prefill DP rank
from ``prefill_info_table``; ``init(prefill_dp_rank)``; poll until WaitingForInput;
``send_metadata(page_indices, metadata_buffer_index, state_indices, decode_prefix_len)``;
poll through the metadata gate until Success; read the aux slot; ``clear()``.

With a decode prefix (decode radix cache), the decode already holds the prefix's pages (the
script writes their content there first), sends only the later pages with
``decode_prefix_len``, and the prefill, after ``pop_decode_prefix_len()``, inits and sends only
the pages after the prefix. The test checks every KV byte and every metadata byte in the
decode side's own memory, prefix included.

With a draft model (``Model.draft``), every rank's KVArgs carry the draft pool's entries after
the model's (as ``_init_kv_manager`` appends ``draft_token_to_kv_pool``'s), the scripted
forward writes the draft's KV into the same pages (content of its own), and the decode checks
every byte of both pools. ``Spec.kv_checksum`` runs both sides with
``--disaggregation-enable-kv-checksum``; ``Spec.corrupt`` ("kv", "draft", "state:swa",
"state:mamba") flips one landed byte of decode rank 0 in the first request (the backend's
``after_kv_landed`` hook).

With extra per-request state (``Model.state``, ``sglang_state_env``), every rank's KVArgs carry
the state components, the last chunk's forward writes each request's state rows and
``send(..., state_indices)`` carries SGLang's payloads; the decode sends its own with
``send_metadata`` and checks every state row it must hold, and that no other row changed.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field

import numpy as np
import pytest

from tests.integrations import sglang_state_env as state_env
from tests.integrations.sglang_env import (
    Model,
    import_sglang_base,
    load_utils_defs,
    model_geometry,
    rank_memory,
    server_args,
)

FAILED, BOOTSTRAPPING, WAITING, TRANSFERRING, SUCCESS = range(5)
CHUNK_TOKENS = 16  # chunked prefill size (a multiple of the page size)
FORWARD_S = 0.1  # how long the scripted "forward" of the early-sent chunk runs
MODEL_PATH = "kvxfer-test-model"
# Both sides' environment: loopback addresses, short timeouts, a small staging arena.
ENV = {
    "SGLANG_HOST_IP": "127.0.0.1",  # the address SGLang (and so our managers) advertise
    "KVXFER_TCP_HOST": "127.0.0.1",
    "KVXFER_BOOTSTRAP_TIMEOUT_S": "20",
    "KVXFER_WAITING_TIMEOUT_S": "20",
    "KVXFER_TRANSFER_TIMEOUT_S": "20",
    "KVXFER_HEARTBEAT_INTERVAL_S": "0.2",
    "KVXFER_HEARTBEAT_TIMEOUT_S": "3",
    "KVXFER_STAGING_BYTES": str(1 << 20),
    "KVXFER_STAGING_SLOT_BYTES": str(16 << 10),
    "KVXFER_WORKERS": "2",
}


@dataclass
class Spec:
    role: str
    model: Model
    tp: int
    port: int
    requests: list  # [(bootstrap_room, prompt tokens[, decode prefix tokens])]
    env: dict = field(default_factory=dict)
    timeout_s: float = 60.0
    kv_checksum: bool = False  # --disaggregation-enable-kv-checksum on this side
    corrupt: str = (
        ""  # decode: "kv", "draft", "state:swa" or "state:mamba": flip a landed byte of rank 0, first request
    )
    dcp_size: int = 1  # decode: --dcp-size (sglang_dcp_sides)


def draft_room(room: int) -> int:
    """The seed of a request's draft-model KV content: not the model's, so a draft buffer
    holding the model's rows (or the reverse) is caught."""
    return room ^ 0xD2AF_7000_0000_0001


class ScriptEvent:
    """A CUDA-less stand-in for the ``torch.cuda.Event`` SGLang records after a forward:
    ``synchronize()`` returns once the scripted forward has written the chunk."""

    def __init__(self, timeout_s: float):
        self._done = threading.Event()
        self._timeout_s = timeout_s

    def fire(self) -> None:
        self._done.set()

    def synchronize(self) -> None:
        if not self._done.wait(self._timeout_s):
            raise TimeoutError(f"scripted forward did not finish within {self._timeout_s} s")


def aux_rows(model: Model, room: int) -> dict:
    """What ``MetadataBuffers.set_buf`` writes into a request's slot (same on every rank)."""
    import torch

    rows = {
        name: None
        for name in (
            "output_ids",
            "cached_tokens",
            "output_token_logprobs_val",
            "output_token_logprobs_idx",
            "output_top_logprobs_val",
            "output_top_logprobs_idx",
            "output_topk_p",
            "output_topk_index",
            "output_hidden_states",
            "bootstrap_room",
        )
    }
    g = np.random.default_rng(room % (2**32))
    rows["output_ids"] = torch.tensor([int(g.integers(1, 50000))] + [0] * 15, dtype=torch.int32)
    rows["cached_tokens"] = torch.tensor([int(g.integers(0, 64))] * 4 + [0] * 12, dtype=torch.int32)
    rows["output_token_logprobs_val"] = torch.tensor([-float(g.random())] + [0.0] * 15, dtype=torch.float32)
    rows["output_token_logprobs_idx"] = rows["output_ids"].clone()
    rows["output_top_logprobs_val"] = torch.tensor(-g.random(128), dtype=torch.float32)
    rows["output_top_logprobs_idx"] = torch.tensor(g.integers(0, 50000, 128), dtype=torch.int32)
    rows["output_topk_p"] = torch.tensor(g.random(16), dtype=torch.float32)
    rows["output_topk_index"] = torch.tensor(g.integers(0, 50000, 16), dtype=torch.int64)
    rows["output_hidden_states"] = torch.tensor(g.standard_normal(model.hidden_size), dtype=torch.bfloat16)
    rows["bootstrap_room"] = torch.tensor([room] + [0] * 7, dtype=torch.uint64)
    return rows


def _allocate(model: Model, requests, seed: int) -> list[np.ndarray]:
    """Disjoint, scattered page lists, one per request (as a long-running server's free list
    hands them out); page 0 is SGLang's padding page and never handed out."""
    num_pages = (model.pool_tokens + model.page_size) // model.page_size
    free = np.random.default_rng(seed).permutation(np.arange(1, num_pages))
    out, at = [], 0
    for _, tokens, *_ in requests:
        need = -(-tokens // model.page_size)
        if at + need > len(free):
            raise ValueError(f"the test pool of {num_pages} pages cannot hold every request")
        out.append(free[at : at + need])
        at += need
    return out


def _min_poll(pollers) -> int:
    return min(int(p.poll()) for p in pollers)


def _failure(handles) -> list[str]:
    """``failure_exception()`` of every rank, as the scheduler's failure handlers call it."""
    out = []
    for h in handles:
        try:
            h.failure_exception()
        except Exception as exc:
            out.append(
                f"{type(exc).__name__}: {getattr(exc, 'failure_reason', exc)}"
                f"{' [from another rank]' if getattr(exc, 'is_from_another_rank', False) else ''}"
            )
        else:
            out.append("failure_exception() did not raise")
    return out


def run_named_processes(main, specs: list, timeout_s: float, name=lambda spec: spec.role) -> dict:
    """Test side: ``main(spec, out, release)`` in a spawned process per spec; each reports
    ``(name, report)`` on ``out``. Every report is collected by name, then all are released
    to shut down. Fails the test naming a process that did not report in time or crashed."""
    ctx = mp.get_context("spawn")
    out, release = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=main, args=(spec, out, release), daemon=True) for spec in specs]
    for proc in procs:
        proc.start()
    reports: dict = {}
    names = {name(spec) for spec in specs}
    # A side's own deadline counts from after its setup (imports, managers): waiting well past
    # it lets a slow side still report its own timeout, naming the rooms and where they stood.
    slack = 60
    deadline = time.monotonic() + timeout_s + slack
    try:
        while len(reports) < len(names):
            try:
                key, report = out.get(timeout=1.0)
            except queue.Empty:
                dead = [
                    f"{name(s)} (exit code {p.exitcode})"
                    for s, p in zip(specs, procs)
                    if p.exitcode is not None and name(s) not in reports
                ]
                if dead:  # a side that died without reporting (a signal, os._exit) never will
                    pytest.fail(f"{', '.join(dead)} ended without a report")
                if time.monotonic() > deadline:
                    raise
                continue
            reports[key] = report
    except queue.Empty:
        pytest.fail(f"no report from {sorted(names - set(reports))} within {timeout_s + slack} s (stacks: stderr)")
    finally:
        release.set()
        for proc in procs:
            proc.join(20)
            if proc.is_alive():
                proc.kill()
    for key, report in reports.items():
        assert "error" not in report, f"{key} crashed:\n{report['error']}"
    return reports


def run_in_processes(main, specs: list, timeout_s: float) -> tuple[dict, dict]:
    """``run_named_processes`` for a prefill and a decode side: returns (prefill, decode)."""
    reports = run_named_processes(main, specs, timeout_s)
    return reports["prefill"], reports["decode"]


def setup(spec):
    """Child side: the spec's environment, SGLang's base module, our backend and SGLang's
    utils definitions."""
    os.environ.update(spec.env)
    base, reason = import_sglang_base()
    if base is None:
        raise RuntimeError(reason)
    from sglang_kvxfer.integrations import sglang as backend

    backend._draft_model_kv = _draft_heads(spec.model)
    if spec.model.state is not None:  # stands in for the model config's swa_num_key_value_heads
        backend._model_swa_kv_heads = lambda server_args, heads=spec.model.state.swa_heads: heads
        backend._model_dsa_index_head_dim = lambda server_args, dim=spec.model.state.tail_dim: dim
    return backend, load_utils_defs()


def _draft_heads(model: Model):
    def draft_model_kv(server_args) -> tuple[int, bool]:
        # Stands in for the draft model's ModelConfig (--speculative-draft-model-path).
        if model.draft is None:
            raise AssertionError("asked for the draft model's heads of a model without a draft")
        return model.draft.total_kv_heads, model.draft.mla

    return draft_model_kv


def serve(spec, out, release, prefill, decode) -> None:
    """Process entry point: run one side (``prefill`` or ``decode`` by ``spec.role``), report,
    keep the managers up until released."""
    closers: list = []
    # A side that hangs prints every thread's stack (to the test's captured stderr) shortly
    # before the test stops waiting for its report, so the failure shows where it stood.
    faulthandler.dump_traceback_later(spec.timeout_s + 45)
    try:
        run = prefill if spec.role == "prefill" else decode
        out.put((spec.role, run(spec, closers)))
    except BaseException:
        out.put((spec.role, {"error": traceback.format_exc()}))
    finally:
        faulthandler.cancel_dump_traceback_later()
        release.wait(spec.timeout_s)  # a peer may still be reading our memory or our messages
        for close in reversed(closers):
            close()


def main(spec: Spec, out, release) -> None:
    serve(spec, out, release, _prefill, _decode)


def _wait(reqs, pollers_of, want, deadline, on_failed) -> list:
    """Poll (MIN over ranks) until every request reaches ``want`` or fails."""
    pending, reached = list(reqs), []
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rooms {[r['room'] for r in pending]} stuck at {[_min_poll(pollers_of(r)) for r in pending]}"
            )
        for req in list(pending):
            poll = _min_poll(pollers_of(req))
            if poll == FAILED:
                on_failed(req)
                pending.remove(req)
            elif poll >= want:
                reached.append(req)
                pending.remove(req)
        time.sleep(0.002)
    return reached


def start_ranks(spec, backend, defs, sa, closers: list) -> tuple[list, list]:
    """Every TP rank of one side: its memory and its manager (a prefill also starts the
    bootstrap server first and registers each rank): ``(memories, managers)``."""
    prefill = spec.role == "prefill"
    if prefill:
        boot = backend.KVXferKVBootstrapServer(sa.host, sa.disaggregation_bootstrap_port)
        closers.append(boot.close)
    mode = defs.DisaggregationMode.PREFILL if prefill else defs.DisaggregationMode.DECODE
    mems, mgrs = [], []
    for r in range(spec.tp):
        mems.append(rank_memory(spec.model, spec.tp, r, spec.role))
        mgrs.append(backend.KVXferKVManager(mems[r].kv_args, mode, sa, spec.model.is_mla_backend))
        closers.append(mgrs[r].close)
    if prefill:
        for mgr in mgrs:
            mgr.register_to_bootstrap()
    return mems, mgrs


def wait_parallel_info(mgrs, addr: str, deadline: float) -> None:
    """``_resolve_pending_reqs`` -> ``_ensure_prefill_info`` on every rank, retried."""
    while not all(mgr.try_ensure_parallel_info(addr) for mgr in mgrs):
        if time.monotonic() > deadline:
            raise TimeoutError(f"prefill parallel info for {addr} never arrived")
        time.sleep(0.02)


def _prefill(spec: Spec, closers: list) -> dict:
    backend, defs = setup(spec)
    m, deadline = spec.model, time.monotonic() + spec.timeout_s
    sa = server_args(MODEL_PATH, "prefill", spec.tp, spec.port, disaggregation_enable_kv_checksum=spec.kv_checksum)
    mems, mgrs = start_ranks(spec, backend, defs, sa, closers)
    geo = model_geometry(m)
    places = [geo.placement(spec.tp, r) for r in range(spec.tp)]
    if m.draft is not None:
        dgeo = model_geometry(m.draft.model(m))
        places = [(p, dgeo.placement(spec.tp, r)) for r, p in enumerate(places)]
    results: dict = {}
    reqs = []
    pages = _allocate(m, spec.requests, seed=1)
    states = state_env.allocate(m, spec.requests, seed=11) if m.state is not None else None
    for slot, (room, tokens, *_) in enumerate(spec.requests):
        senders = [
            backend.KVXferKVSender(mgr=mgr, bootstrap_addr=f"{sa.host}:{spec.port}", bootstrap_room=room)
            for mgr in mgrs
        ]
        reqs.append({"room": room, "tokens": tokens, "slot": slot, "senders": senders, "pages": pages[slot]})
        reqs[-1]["state"] = states[slot] if states is not None else None

    def failed(req):
        results[req["room"]] = {"status": "Failed", "reasons": _failure(req["senders"])}

    ready = _wait(reqs, lambda r: r["senders"], WAITING, deadline, failed)  # pop_bootstrapped
    for req in ready:  # finalize_bootstrap: the decode's prefix, then the pages after it
        prefixes = [s.pop_decode_prefix_len() for s in req["senders"]]
        req["prefix"] = prefixes[0]
        req["prefixes"] = prefixes
        for s in req["senders"]:
            s.init(len(req["pages"]) - req["prefix"] // m.page_size, req["slot"])
    for req in ready:
        _forward_and_send(req, m, mems, places)
    for req in _wait(ready, lambda r: r["senders"], SUCCESS, deadline, failed):  # inflight queue
        results[req["room"]] = {
            "status": "Success",
            "bytes": [s.get_transfer_metric().transfer_total_bytes for s in req["senders"]],
            "prefixes": req["prefixes"],
        }
        for s in req["senders"]:
            s.clear()
    return results


def _forward_and_send(req: dict, m: Model, mems, places) -> None:
    """The scheduler's chunked prefill: each chunk's forward writes its KV, then
    ``send_kv_chunk`` hands the chunk's pages to every rank's sender."""
    from sglang_kvxfer.engine.synthetic import fill_request

    ps, tokens, pages = m.page_size, req["tokens"], req["pages"]
    first = req["prefix"]  # page-aligned: the decode holds [0, first) already
    if first >= tokens:  # the decode holds the whole prompt: an empty last chunk carries the aux
        for mem in mems:
            for name, row in aux_rows(m, req["room"]).items():
                mem.meta[name][req["slot"]] = row
        for s in req["senders"]:
            if s.should_send_kv_chunk(0, True):
                s.send(np.zeros(0, dtype=np.int32), [], num_kv_tokens=0)
        return
    for a in range(first, tokens, CHUNK_TOKENS):
        b = min(tokens, a + CHUNK_TOKENS)
        last = b == tokens
        chunk_pages = pages[a // ps : -(-b // ps)].astype(np.int32)
        early = ScriptEvent(timeout_s=30.0) if a == first and not last else None

        def forward(a=a, b=b):  # bound now: an early forward runs after the loop moved on
            for r, mem in enumerate(mems):
                if m.kv_layout is not None:  # (DeepSeek-V4: its other compressed pools' pages too)
                    state_env.fill_pages(m, mem.extra["state"], req["room"], pages, a, b)
                if m.draft is None:
                    fill_request(places[r], mem.buffers, req["room"], pages, a, b - a)
                else:  # the target's forward and the draft model's extend over the same pages
                    fill_request(places[r][0], mem.buffers, req["room"], pages, a, b - a)
                    fill_request(places[r][1], mem.draft_buffers, draft_room(req["room"]), pages, a, b - a)

        if early is None:
            forward()
        state_indices: list | None = [] if last else None
        if last:  # set_buf: the first output token & co. go into the metadata slot
            for mem in mems:
                for name, row in aux_rows(m, req["room"]).items():
                    mem.meta[name][req["slot"]] = row
            if m.state is not None:  # the state rows are final once the last chunk's forward ran
                for r, mem in enumerate(mems):
                    state_env.fill(m, len(mems), r, mem.extra["state"], req["room"], req["state"], pages, first)
                state_indices = state_env.payload(m, req["state"], pages, first)
        for s in req["senders"]:
            if early is not None:
                s._early_send_wait_event = early
            if s.should_send_kv_chunk(len(chunk_pages), last):
                s.send(chunk_pages, state_indices, num_kv_tokens=b - a)
        if early is not None:  # the forward was still running when the chunk was sent
            time.sleep(FORWARD_S)
            forward()
            early.fire()


def _model_heads(model: Model):
    def total_kv_heads(server_args) -> int:
        # Stands in for SGLang's ModelConfig.from_server_args(...).get_total_num_kv_heads()
        # (it needs transformers and the model's config.json).
        if server_args.model_path != MODEL_PATH:
            raise AssertionError(f"asked for the heads of {server_args.model_path!r}")
        return model.total_kv_heads

    return total_kv_heads


def _decode(spec: Spec, closers: list) -> dict:
    from sglang_kvxfer.engine.synthetic import fill_request, verify_request

    backend, defs = setup(spec)
    backend._model_total_kv_heads = _model_heads(spec.model)
    m, deadline = spec.model, time.monotonic() + spec.timeout_s
    sa = server_args(MODEL_PATH, "decode", spec.tp, spec.port + 1, disaggregation_enable_kv_checksum=spec.kv_checksum)
    mems, mgrs = start_ranks(spec, backend, defs, sa, closers)
    addr = f"127.0.0.1:{spec.port}"  # the request's bootstrap_host:bootstrap_port (router)
    results: dict = {}
    reqs = []
    pages = _allocate(m, spec.requests, seed=2)
    states = state_env.allocate(m, spec.requests, seed=12) if m.state is not None else None
    for slot, (room, tokens, *rest) in enumerate(spec.requests):
        rxs = [backend.KVXferKVReceiver(mgr=mgr, bootstrap_addr=addr, bootstrap_room=room) for mgr in mgrs]
        prefix = rest[0] if rest else 0
        reqs.append({"room": room, "tokens": tokens, "slot": slot, "rxs": rxs, "pages": pages[slot], "prefix": prefix})
        reqs[-1]["state"] = states[slot] if states is not None else None
    wait_parallel_info(mgrs, addr, deadline)
    info = mgrs[0].prefill_info_table[addr]
    prefill_dp_rank = 0 if info.dp_size == 1 else None  # _resolve_prefill_dp_rank
    for req in reqs:
        for rx in req["rxs"]:
            rx.init(prefill_dp_rank)

    def failed(req):
        results[req["room"]] = {"status": "Failed", "reasons": _failure(req["rxs"])}

    ready = _wait(reqs, lambda r: r["rxs"], WAITING, deadline, failed)  # _update_handshake_waiters
    geo = model_geometry(m)
    dgeo = model_geometry(m.draft.model(m)) if m.draft is not None else None
    if spec.corrupt:
        _corrupt_first_landing(backend, spec, mgrs, mems, reqs[0])
    for req in ready:  # pop_preallocated: a radix-cache hit holds the prefix's pages already
        prefix = req["prefix"]
        if prefix:
            for r, mem in enumerate(mems):
                fill_request(geo.placement(spec.tp, r), mem.buffers, req["room"], req["pages"], 0, prefix)
                if dgeo is not None:
                    place = dgeo.placement(spec.tp, r)
                    fill_request(place, mem.draft_buffers, draft_room(req["room"]), req["pages"], 0, prefix)
        after = req["pages"][prefix // m.page_size :].astype(np.int32)
        state_indices = [] if m.state is None else state_env.payload(m, req["state"], req["pages"], prefix)
        for rx in req["rxs"]:
            rx.send_metadata(after, req["slot"], state_indices, decode_prefix_len=prefix)

    class Gated:  # _apply_metadata_gate: Success counts once the slot shows the room
        def __init__(self, rx, mem, slot):
            self.rx, self.mem, self.slot = rx, mem, slot

        def poll(self):
            p = int(self.rx.poll())
            if p == SUCCESS and int(self.mem.meta["bootstrap_room"][self.slot, 0]) == 0:
                return TRANSFERRING
            return p

    gated = lambda r: [Gated(rx, mems[i], r["slot"]) for i, rx in enumerate(r["rxs"])]  # noqa: E731
    for req in _wait(ready, gated, SUCCESS, deadline, failed):  # pop_transferred
        problems = []
        for r, mem in enumerate(mems):
            problems += [
                f"rank {r}: {p}"
                for p in verify_request(
                    geo.placement(spec.tp, r), mem.buffers, req["room"], req["pages"], req["tokens"]
                )
            ]
            if dgeo is not None:  # every byte of the draft model's KV too
                place = dgeo.placement(spec.tp, r)
                problems += [
                    f"rank {r} draft: {p}"
                    for p in verify_request(
                        place, mem.draft_buffers, draft_room(req["room"]), req["pages"], req["tokens"]
                    )
                ]
            for name, row in aux_rows(m, req["room"]).items():
                if not bool((mem.meta[name][req["slot"]] == row).all()):
                    problems.append(f"rank {r}: metadata {name} of slot {req['slot']} differs")
            if m.state is not None:  # every state row of the request, on every rank
                st = mem.extra["state"]
                got = state_env.verify(m, spec.tp, r, st, req["room"], req["state"], req["pages"], req["prefix"])
                problems += [f"rank {r}: {p}" for p in got]
        verified = [rx.kv_checksum_heads for rx in req["rxs"]]
        parts = [dict(rx.checksum_parts) for rx in req["rxs"]]
        results[req["room"]] = {"status": "Success", "problems": problems, "verified": verified, "parts": parts}
        for rx in req["rxs"]:
            rx.clear()
    if m.state is not None:  # nothing landed in a state row no request was given
        allocs, kv = [r["state"] for r in reqs], [r["pages"] for r in reqs]
        stray = [
            f"rank {r}: {p}"
            for r, mem in enumerate(mems)
            for p in state_env.untouched(m, mem.extra["state"], allocs, kv)
        ]
        for report in results.values():
            if report["status"] == "Success":
                report["problems"] += stray
    return results


def _corrupt_first_landing(backend, spec: Spec, mgrs, mems, req) -> None:
    """Flip one byte of decode rank 0's first landed token in ``req`` (the model's K of layer
    0, or the draft's), after every writer reported done and before the checksum is checked:
    what a corrupting transport or a stray write would leave behind."""
    import torch

    def corrupt(rx) -> None:
        if rx.bootstrap_room != req["room"] or rx.kv_mgr is not mgrs[0]:
            return
        if spec.corrupt.startswith("state:"):  # the first row of the request in that state pool
            kind = spec.corrupt.split(":", 1)[1]
            buf = mems[0].extra["state"].buffers[kind][0]
            alloc = req["state"]
            row = int(alloc["swa"][0]) * spec.model.page_size if kind == "swa" else int(alloc["mamba"])
            buf.view(torch.uint8).reshape(buf.shape[0], -1)[row, 0] ^= 0x5A
            return
        buf = (mems[0].draft_k if spec.corrupt == "draft" else mems[0].k)[0]
        row = int(req["pages"][req["prefix"] // spec.model.page_size]) * spec.model.page_size
        buf.view(torch.uint8)[row, 0, 0] ^= 0x5A

    backend.after_kv_landed = corrupt
