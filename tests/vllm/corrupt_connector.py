"""The negative control's connector (test tree only): ``KVXferConnector`` plus a hook.

With ``KVXFER_TEST_CORRUPT_FILE`` set, each time a request's KV has arrived on a consumer
worker the file is read; when it holds ``W/P`` (producer TP rank W of P ranks), the KV heads
that producer rank delivered are zeroed in the received blocks before vLLM decodes, as if
that writer had sent zeros. Each zeroing appends a line to the file + ``.log``.

With ``KVXFER_TEST_DUMP_DIR`` set, each rank writes the raw bytes of the blocks a request
sends (producer, at the end of the forward of the step that hands the send over, when its
KV is written) or received (consumer, before vLLM is told and before any zeroing) to
``DIR/<side>-rank<R>-<n>.bin`` (``n`` counts that rank's requests from 0), all layers in
model order, the blocks in the request's order: what the byte-level tests compare.

With ``KVXFER_TEST_RECORD_FILE`` set, each rank appends one JSON line per event: a producer
rank's ended send (``{"event": "sent", ...}``, the connector's ``SendReport``: layer-wise or
whole, how many layer groups went to the engine, bytes) and a consumer rank's started receive
(``{"event": "recv_started", "room": R, ...}``, once its metadata is on its way).
With ``KVXFER_TEST_WATCHDOG_S=S`` set, each worker runs a watchdog thread that, once per
second, checks how late it woke itself and how long ago each engine rank's I/O thread ticked
(every 50 ms when it runs). When either passes S seconds it prints one ``kvxfer: watchdog:``
line per stall to stderr: the lag, then every thread's kernel state (``R`` running, ``S``
sleeping, ``D`` in I/O), its CPU seconds and its innermost Python frames. The engine's own
"did not run for" report comes after the stall and cannot say what held the thread.
Loaded with ``kv_connector_module_path="tests.vllm.corrupt_connector"``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
import traceback

from sglang_kvxfer.integrations.vllm import KVXferConnector

CORRUPT_ENV = "KVXFER_TEST_CORRUPT_FILE"
DUMP_ENV = "KVXFER_TEST_DUMP_DIR"
RECORD_ENV = "KVXFER_TEST_RECORD_FILE"
WATCHDOG_ENV = "KVXFER_TEST_WATCHDOG_S"
WATCH_PERIOD_S = 1.0


def _thread_states() -> str:
    """Every thread of this process: name, kernel state, CPU seconds, innermost frames."""
    frames = sys._current_frames()
    tick = os.sysconf("SC_CLK_TCK")
    out = []
    for t in threading.enumerate():
        state, cpu = "?", -1.0
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            state, cpu = fields[0], (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError, TypeError):
            pass
        frame = frames.get(t.ident) if t.ident is not None else None
        where = (
            " <- ".join(
                f"{os.path.basename(fs.filename)}:{fs.lineno} {fs.name}"
                for fs in reversed(traceback.extract_stack(frame)[-4:])
            )
            if frame is not None
            else "-"
        )
        out.append(f"[{t.name} {state} {cpu:.1f}s cpu: {where}]")
    return " ".join(out)


def _watch(connector: KVXferConnector, limit_s: float) -> None:
    """See the module docstring: report stalls of this process and of its engine I/O threads."""
    last = time.monotonic()
    stalled: set[str] = set()
    while True:
        time.sleep(WATCH_PERIOD_S)
        now = time.monotonic()
        late, last = now - last - WATCH_PERIOD_S, now
        try:
            found = []
            if late > limit_s:
                found.append(("self", f"the watchdog woke {late:.1f} s late"))
            side = connector.worker_side
            for mgr in (side.prefill, side.decode):
                tick = getattr(mgr, "_last_tick", None)
                if tick is not None and now - tick > limit_s:
                    found.append(
                        (
                            f"{mgr.side.value}{mgr.tp_rank}",
                            f"{mgr.side.value} rank {mgr.tp_rank}'s I/O thread has not ticked for {now - tick:.1f} s",
                        )
                    )
            for key, what in found:
                if key not in stalled:
                    print(f"kvxfer: watchdog: {what}; threads: {_thread_states()}", file=sys.stderr, flush=True)
            stalled = {key for key, _ in found}
        except Exception as exc:  # a diagnostic must not take the worker down
            print(f"kvxfer: watchdog: check failed: {exc!r}", file=sys.stderr, flush=True)


def _record(event: dict) -> None:
    path = os.environ.get(RECORD_ENV)
    if path:
        with open(path, "a") as f:  # one short line per write: appends from several ranks stay whole
            f.write(json.dumps(event) + "\n")


class KVXferTestConnector(KVXferConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._dumped: dict[str, int] = {}

    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        limit = os.environ.get(WATCHDOG_ENV)
        if limit:
            threading.Thread(target=_watch, args=(self, float(limit)), name="kvxfer-watchdog", daemon=True).start()

    def _dump(self, side: str, block_ids: list[int]) -> None:
        out = os.environ.get(DUMP_ENV)
        if not out:
            return
        lay = self.worker_side.layout
        assert lay is not None
        n = self._dumped.get(side, 0)
        self._dumped[side] = n + 1
        pages = lay.geometry.num_pages
        with open(os.path.join(out, f"{side}-rank{lay.tp_rank}-{n}.bin"), "wb") as f:
            for t in lay.tensors:  # every layout vLLM has is page-major: [pages, ...]
                f.write(t.reshape(pages, -1)[list(block_ids)].contiguous().numpy().tobytes())

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        for spec in getattr(meta, "sends", {}).values():
            self._dump("producer", list(spec.block_ids))
        super().wait_for_save()

    def start_load_kv(self, forward_context, **kwargs) -> None:
        super().start_load_kv(forward_context, **kwargs)
        lay = self.worker_side.layout
        for req_id, spec in getattr(self._connector_metadata, "recvs", {}).items():
            _record(
                {"event": "recv_started", "req_id": req_id, "room": spec.room, "tp_rank": lay.tp_rank if lay else -1}
            )

    def on_sent(self, report) -> None:
        _record(dict(dataclasses.asdict(report), event="sent"))

    def on_received(self, req_id: str, block_ids: list[int]) -> None:
        self._dump("consumer", block_ids)
        path = os.environ.get(CORRUPT_ENV)
        if not path:
            return
        try:
            with open(path) as f:
                spec = f.read().strip()
        except FileNotFoundError:
            return
        if not spec:
            return
        writer, prefill_tp = (int(x) for x in spec.split("/"))
        lay = self.worker_side.layout
        assert lay is not None
        heads = lay.geometry.total_kv_heads
        local = lay.heads_slice(writer * heads // prefill_tp, (writer + 1) * heads // prefill_tp)
        if local.start >= local.stop:
            what = f"decode rank {lay.tp_rank}: no heads from writer {writer}/{prefill_tp}"
        else:
            for t in lay.tensors:
                t[list(block_ids), local] = 0
            what = f"decode rank {lay.tp_rank}: zeroed local heads {local.start}..{local.stop - 1} of {len(block_ids)} blocks"
        with open(path + ".log", "a") as f:
            f.write(f"{req_id}: {what}\n")
