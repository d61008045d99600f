"""The worker side of the vLLM connector: one engine manager per vLLM TP worker.

Owns ``WorkerSide``: wraps the KV tensors vLLM registers in an engine ``KVPool`` (no copy;
``vllm_layout`` names their geometry), builds a ``PrefillManager`` (producer) and/or a
``DecodeManager`` (consumer) for this TP rank, starts one ``KVSender``/``KVReceiver`` per
request the scheduler hands over, and reports their ends to vLLM. Must not decide which
requests move (the scheduler side does).

Every wait is the engine's: a room that never gets its peer, or whose peer dies, fails at the
engine's deadline or heartbeat timeout, and its request is then reported finished (sends) or
finished-with-errors (receives: ``failed_recving`` and the block ids through
``get_block_ids_with_load_errors``), so vLLM applies ``kv_load_failure_policy`` and never hangs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from sglang_kvxfer.engine.config import EngineConfig
from sglang_kvxfer.errors import KVXferError, TransportUnavailableError
from sglang_kvxfer.integrations.vllm_layout import VllmLayout
from sglang_kvxfer.integrations.vllm_meta import KVXferConnectorMetadata, RecvSpec, SendSpec, Settings
from sglang_kvxfer.protocol.state import KVPoll

if TYPE_CHECKING:
    from sglang_kvxfer.engine import DecodeManager, KVReceiver, KVSender, PrefillManager

__all__ = ["WorkerSide"]

log = logging.getLogger("sglang_kvxfer.vllm")


def _transport(name: str, device: str) -> str:
    if name != "auto":
        return name
    if device == "cpu":
        return "local"
    from sglang_kvxfer.transports import available_transports

    rdma = [t for t in ("mori", "nixl") if t in available_transports()]
    if not rdma:
        raise TransportUnavailableError(
            "vLLM's KV cache is GPU memory and neither mori nor nixl is installed; install one or set "
            'kv_connector_extra_config={"transport": ...}'
        )
    return rdma[0]


class _Recv:
    def __init__(self, spec: RecvSpec, handle: KVReceiver | None, reason: str = ""):
        self.spec, self.handle, self.reason = spec, handle, reason


class WorkerSide:
    """See the module docstring. ``on_received(req_id, block_ids)`` runs when a request's
    KV has arrived, before vLLM hears of it."""

    def __init__(
        self,
        vllm_config: Any,
        settings: Settings,
        on_received: Callable[[str, list[int]], None],
        report_block_errors: bool = True,
    ):
        self.vllm_config = vllm_config
        self.report_block_errors = report_block_errors
        self.settings = settings
        self.on_received = on_received
        self.layout: VllmLayout | None = None
        self.prefill: PrefillManager | None = None
        self.decode: DecodeManager | None = None
        self._sends: dict[str, KVSender | None] = {}  # None: failed to start (reported next poll)
        self._recvs: dict[str, _Recv] = {}
        self._load_errors: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        from sglang_kvxfer.engine import KVManager, KVPool

        model = self.vllm_config.model_config
        self.layout = lay = VllmLayout.from_kv_caches(
            kv_caches,
            total_kv_heads=1 if model.use_mla else model.get_total_num_kv_heads(),
            mla=bool(model.use_mla),
            tp_size=get_tensor_model_parallel_world_size(),
            tp_rank=get_tensor_model_parallel_rank(),
        )
        device = str(lay.tensors[0].device)
        transport = _transport(self.settings.transport, device)
        for role in ("prefill", "decode"):
            if not (self.settings.produces if role == "prefill" else self.settings.consumes):
                continue
            config = EngineConfig(
                role,
                lay.geometry,
                lay.tp_size,
                lay.tp_rank,
                self.settings.bootstrap,
                transport=transport,
                host=self.settings.host,
                device=device,
            )
            manager = KVManager(config, KVPool.wrap(config.placement, list(lay.tensors)))
            if role == "prefill":
                self.prefill = manager  # type: ignore[assignment]
            else:
                self.decode = manager  # type: ignore[assignment]
        log.info("kvxfer vLLM worker rank %d/%d: %s over %s", lay.tp_rank, lay.tp_size, lay.geometry, transport)

    # -- per step ------------------------------------------------------------------------------
    def start_recvs(self, meta: KVXferConnectorMetadata) -> None:
        for req_id, spec in meta.recvs.items():
            self._recvs[req_id] = self._start_recv(spec)

    def _start_recv(self, spec: RecvSpec) -> _Recv:
        from sglang_kvxfer.engine import KVReceiver

        if self.decode is None:
            return _Recv(spec, None, "this vLLM instance is not a kv_consumer (kv_role)")
        if spec.room < 0:
            return _Recv(spec, None, spec.bootstrap)
        handle = None
        try:
            handle = KVReceiver(self.decode, spec.room, spec.bootstrap)
            # Whole pages, as the producer hands them over: a page's (page, head) tiles move
            # as they are, whatever order vLLM's kernel keeps rows in inside a tile.
            pages = np.asarray(spec.block_ids, dtype=np.int64)
            handle.send_metadata(pages, num_tokens=len(pages) * self.decode.config.geometry.page_size)
            return _Recv(spec, handle)
        except (ValueError, TypeError, KVXferError) as exc:
            if handle is not None:
                handle.abort(str(exc))
            return _Recv(spec, handle, f"{type(exc).__name__}: {exc}")

    def start_sends(self, meta: KVXferConnectorMetadata) -> None:
        for req_id, spec in meta.sends.items():
            self._sends[req_id] = self._start_send(req_id, spec)
        for req_id, reason in meta.aborts.items():
            rec = self._recvs.get(req_id)
            if rec is not None and rec.handle is not None:  # else: already reported
                rec.handle.abort(reason)

    def _start_send(self, req_id: str, spec: SendSpec) -> KVSender | None:
        from sglang_kvxfer.engine import KVSender

        if self.prefill is None:
            log.error("kvxfer: request %s: this vLLM instance is not a kv_producer (kv_role)", req_id)
            return None
        try:
            sender = KVSender(self.prefill, spec.room)
            sender.send(np.asarray(spec.block_ids, dtype=np.int64), last_chunk=True)
            return sender
        except (ValueError, TypeError, KVXferError):
            log.exception("kvxfer: request %s (room %d): the send did not start", req_id, spec.room)
            return None

    def poll(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sends, finished receives, failed receives) since the last poll."""
        sent: set[str] = set()
        for req_id, sender in list(self._sends.items()):
            state = KVPoll.Failed if sender is None else sender.poll()
            if state in (KVPoll.Success, KVPoll.Failed):
                if sender is not None:
                    if state == KVPoll.Failed:
                        log.warning("kvxfer: send of request %s failed: %s", req_id, sender.failure_reason)
                    sender.clear()
                del self._sends[req_id]
                sent.add(req_id)
        received: set[str] = set()
        failed: set[str] = set()
        for req_id, rec in list(self._recvs.items()):
            reason = rec.reason
            state = KVPoll.Failed if rec.handle is None or reason else rec.handle.poll()
            if state not in (KVPoll.Success, KVPoll.Failed):
                continue
            if state == KVPoll.Success:
                try:
                    self.on_received(req_id, list(rec.spec.block_ids))
                except Exception:
                    log.exception("kvxfer: on_received hook failed for request %s", req_id)
            else:
                reason = reason or (rec.handle.failure_reason if rec.handle is not None else "") or "failed"
                log.warning("kvxfer: receive of request %s (room %d) failed: %s", req_id, rec.spec.room, reason)
                failed.add(req_id)
                self._load_errors.update(rec.spec.block_ids)
            if rec.handle is not None:
                rec.handle.clear()
            del self._recvs[req_id]
            received.add(req_id)
        return sent, received, failed

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        # Block ids are unique only within a KV cache group: with several groups vLLM refuses
        # block-level errors, and ``failed_recving`` alone reports the failure.
        return errors if self.report_block_errors else set()

    def close(self) -> None:
        for mgr in (self.prefill, self.decode):
            if mgr is not None:
                mgr.close()
        self.prefill = self.decode = None
