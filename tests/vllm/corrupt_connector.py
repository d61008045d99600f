"""The negative control's connector (test tree only): ``KVXferConnector`` plus a hook.

With ``KVXFER_TEST_CORRUPT_FILE`` set, each time a request's KV has arrived on a consumer
worker the file is read; when it holds ``W/P`` (producer TP rank W of P ranks), the KV heads
that producer rank delivered are zeroed in the received blocks before vLLM decodes, as if
that writer had sent zeros. Each zeroing appends a line to the file + ``.log``. Loaded with
``kv_connector_module_path="tests.vllm.corrupt_connector"``.
"""

from __future__ import annotations

import os

from sglang_kvxfer.integrations.vllm import KVXferConnector

CORRUPT_ENV = "KVXFER_TEST_CORRUPT_FILE"


class KVXferTestConnector(KVXferConnector):
    def on_received(self, req_id: str, block_ids: list[int]) -> None:
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
