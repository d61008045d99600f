"""The negative control's connector (test tree only): ``KVXferConnector`` plus a hook.

With ``KVXFER_TEST_CORRUPT_FILE`` set, each time a request's KV has arrived on a consumer
worker the file is read; when it holds ``W/P`` (producer TP rank W of P ranks), the KV heads
that producer rank delivered are zeroed in the received blocks before vLLM decodes, as if
that writer had sent zeros. Each zeroing appends a line to the file + ``.log``.

With ``KVXFER_TEST_DUMP_DIR`` set, each rank writes the raw bytes of the blocks a request
sends (producer, just before the send starts) or received (consumer, before vLLM is told and
before any zeroing) to ``DIR/<side>-rank<R>-<n>.bin`` (``n`` counts that rank's requests from
0), all layers in model order, the blocks in the request's order: what the byte-level tests
compare. Loaded with ``kv_connector_module_path="tests.vllm.corrupt_connector"``.
"""

from __future__ import annotations

import os

from sglang_kvxfer.integrations.vllm import KVXferConnector

CORRUPT_ENV = "KVXFER_TEST_CORRUPT_FILE"
DUMP_ENV = "KVXFER_TEST_DUMP_DIR"


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
