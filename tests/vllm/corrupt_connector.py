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
Loaded with ``kv_connector_module_path="tests.vllm.corrupt_connector"``.
"""

from __future__ import annotations

import dataclasses
import json
import os

from sglang_kvxfer.integrations.vllm import KVXferConnector

CORRUPT_ENV = "KVXFER_TEST_CORRUPT_FILE"
DUMP_ENV = "KVXFER_TEST_DUMP_DIR"
RECORD_ENV = "KVXFER_TEST_RECORD_FILE"


def _record(event: dict) -> None:
    path = os.environ.get(RECORD_ENV)
    if path:
        with open(path, "a") as f:  # one short line per write: appends from several ranks stay whole
            f.write(json.dumps(event) + "\n")


class KVXferTestConnector(KVXferConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._dumped: dict[str, int] = {}

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
