"""The worker side of the vLLM connector: one engine manager per vLLM TP worker.

Owns ``WorkerSide``: wraps the KV tensors vLLM registers in an engine ``KVPool`` (no copy;
``vllm_layout`` names their geometry), builds a ``PrefillManager`` (producer) and/or a
``DecodeManager`` (consumer) for this TP rank, starts one ``KVSender``/``KVReceiver`` per
request the scheduler hands over, and reports their ends to vLLM. Must not decide which
requests move, or when (the scheduler side does).

A step on a producer worker: ``begin_step`` (vLLM binds the step's metadata, before the
forward) drops and aborts what the scheduler says, and opens this step's layer-wise sends;
``save_kv_layer(layer_name)`` (after each attention layer) hands that layer of every open
send to the engine (layers in model order, the order of ``register_kv_caches``'s tensors, as
``vllm_layout`` sorts them; a layer reported out of order waits for the ones before it);
``finish_step`` (``wait_for_save``, after the forward) hands over the layers
``save_kv_layer`` did not report, then starts the whole-request sends. On a CPU the forward
is synchronous, so a layer's KV is written when ``save_kv_layer`` reports it; on a GPU each
hand-over carries a ``torch.cuda.Event`` recorded on the current stream as ``ready``.

Every wait is the engine's: a room that never gets its peer, or whose peer dies, fails at the
engine's deadline or heartbeat timeout, and its request is then reported finished (sends) or
finished-with-errors (receives: ``failed_recving`` and the block ids through
``get_block_ids_with_load_errors``), so vLLM applies ``kv_load_failure_policy`` and never hangs.
A layer-wise send is reported only once the scheduler released it (its request finished with
its blocks held): vLLM frees the blocks of every request it is told finished sending.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from sglang_kvxfer.engine.config import EngineConfig
from sglang_kvxfer.errors import KVXferError, TransportUnavailableError
from sglang_kvxfer.integrations.vllm_layout import VllmLayout
from sglang_kvxfer.integrations.vllm_meta import KVXferConnectorMetadata, RecvSpec, SendSpec, Settings
from sglang_kvxfer.protocol.state import KVPoll

if TYPE_CHECKING:
    from sglang_kvxfer.engine import DecodeManager, KVReceiver, KVSender, PrefillManager

__all__ = ["WorkerSide", "SendReport"]

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


class _Send:
    """One request's send on this rank. ``next_layer``: the first layer not handed over
    (layer-wise); ``saved``: layers ``save_kv_layer`` reported beyond it."""

    def __init__(self, spec: SendSpec, handle: KVSender | None, reason: str = ""):
        self.spec, self.handle, self.reason = spec, handle, reason
        self.pages = np.asarray(spec.block_ids, dtype=np.int64)
        self.released = not spec.layerwise  # a whole-request send's request has finished already
        self.next_layer = 0
        self.saved: set[int] = set()
        self.groups = 0  # send() calls
        self.layers_streamed = 0  # layers handed over from save_kv_layer
        self.layers_late = 0  # layers handed over at wait_for_save


@dataclass(frozen=True)
class SendReport:
    """How one request's send went on one producer rank (``on_sent``; the engine's own record
    is ``KVSender.record``). ``layer_groups``: ``KVSender.send`` calls (1 for a whole-request
    send); ``layers_streamed``/``layers_late``: layers handed over from ``save_kv_layer`` /
    at ``wait_for_save``."""

    req_id: str
    room: int
    tp_rank: int
    layerwise: bool
    layer_groups: int
    layers_streamed: int
    layers_late: int
    ok: bool
    reason: str
    bytes: int
    ops: int


class WorkerSide:
    """See the module docstring. ``on_received(req_id, block_ids)`` runs when a request's
    KV has arrived, before vLLM hears of it; ``on_sent(report)`` when a send ended."""

    def __init__(
        self,
        vllm_config: Any,
        settings: Settings,
        on_received: Callable[[str, list[int]], None],
        report_block_errors: bool = True,
        on_sent: Callable[[SendReport], None] | None = None,
    ):
        self.vllm_config = vllm_config
        self.report_block_errors = report_block_errors
        self.settings = settings
        self.on_received = on_received
        self.on_sent = on_sent
        self.layout: VllmLayout | None = None
        self.prefill: PrefillManager | None = None
        self.decode: DecodeManager | None = None
        self._sends: dict[str, _Send] = {}
        self._open: list[_Send] = []  # this step's layer-wise sends, expecting layers
        self._layer_index: dict[str, int] = {}
        self._cuda = False
        self._recvs: dict[str, _Recv] = {}
        self._load_errors: set[int] = set()
        self._noted: set[str] = set()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        model = self.vllm_config.model_config
        layout = VllmLayout.from_kv_caches(
            kv_caches,
            total_kv_heads=1 if model.use_mla else model.get_total_num_kv_heads(),
            mla=bool(model.use_mla),
            tp_size=get_tensor_model_parallel_world_size(),
            tp_rank=get_tensor_model_parallel_rank(),
        )
        self.attach(layout)

    def attach(self, lay: VllmLayout) -> None:
        """Build this rank's engine managers over ``lay``'s tensors (``register_kv_caches``
        without vLLM: the unit tests call it)."""
        from sglang_kvxfer.engine import KVManager, KVPool

        self.layout = lay
        self._layer_index = {name: i for i, name in enumerate(lay.layer_names)}
        self._cuda = lay.tensors[0].device.type == "cuda"
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
    def begin_step(self, meta: KVXferConnectorMetadata) -> None:
        """Before the forward: drop and abort sends as the scheduler says, mark released
        ones, and open this step's layer-wise sends."""
        for req_id, reason in meta.dropped.items():
            gone = self._sends.pop(req_id, None)
            if gone is not None and gone.handle is not None:
                gone.handle.abort(reason)
                gone.handle.clear()
        for req_id, reason in meta.send_aborts.items():
            rec = self._sends.get(req_id)
            if rec is not None and rec.handle is not None:
                rec.handle.abort(reason)
        for req_id in meta.released:
            rec = self._sends.get(req_id)
            if rec is not None:
                rec.released = True
        self._open = []
        for req_id, spec in meta.sends.items():
            if spec.layerwise:
                self._supersede(req_id)
                rec = self._sends[req_id] = self._start_send(req_id, spec)
                if rec.handle is not None:
                    self._open.append(rec)

    def _supersede(self, req_id: str) -> None:
        """A new send of a request replaces one still here (the scheduler drops a preempted
        request's send first; this only keeps a stale room from lingering)."""
        old = self._sends.pop(req_id, None)
        if old is not None and old.handle is not None:
            old.handle.abort(f"request {req_id} was sent again (room {old.spec.room} superseded)")
            old.handle.clear()

    def save_kv_layer(self, layer_name: str) -> None:
        """vLLM wrote layer ``layer_name`` of this step's tokens: hand it over."""
        if not self._open:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:  # not a cache this connector registered (e.g. a draft model's)
            return
        ready = None
        for rec in self._open:
            if layer < rec.next_layer or layer in rec.saved:
                continue
            rec.saved.add(layer)
            stop = rec.next_layer
            while stop in rec.saved:
                rec.saved.discard(stop)
                stop += 1
            if stop > rec.next_layer:
                if ready is None:
                    ready = self._ready()
                self._hand_over(rec, stop, ready, late=False)

    def finish_step(self, meta: KVXferConnectorMetadata) -> None:
        """After the forward (``wait_for_save``): hand over the layers of this step's
        layer-wise sends that ``save_kv_layer`` did not report, start the whole-request
        sends, and abort the receives the scheduler says."""
        lay = self.layout
        for rec in self._open:
            num_layers = lay.geometry.num_layers if lay is not None else 0
            if rec.next_layer < num_layers and rec.handle is not None:
                self._note_once(
                    "late",
                    "kvxfer: room %d: save_kv_layer did not report layers [%d, %d); they move after the forward",
                    rec.spec.room,
                    rec.next_layer,
                    num_layers,
                )
                rec.saved.clear()
                self._hand_over(rec, num_layers, self._ready(), late=True)
        self._open = []
        for req_id, spec in meta.sends.items():
            if not spec.layerwise:
                self._supersede(req_id)
                self._sends[req_id] = self._start_send(req_id, spec)
        for req_id, reason in meta.aborts.items():
            rec_in = self._recvs.get(req_id)
            if rec_in is not None and rec_in.handle is not None:  # else: already reported
                rec_in.handle.abort(reason)

    def _ready(self) -> Any:
        """What marks the KV written so far: None on a CPU (the forward is synchronous); on a
        GPU an event recorded on the current stream (unverified: no GPU run yet)."""
        if not self._cuda:
            return None
        import torch

        assert self.layout is not None  # _cuda is set with the layout
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.layout.tensors[0].device))
        return event

    def _hand_over(self, rec: _Send, stop: int, ready: Any, late: bool) -> None:
        """``send`` layers ``[rec.next_layer, stop)``; the last layer ends the request."""
        assert self.layout is not None and rec.handle is not None  # only open sends get here
        start, num_layers = rec.next_layer, self.layout.geometry.num_layers
        try:
            rec.handle.send(rec.pages, last_chunk=stop == num_layers, ready=ready, layers=range(start, stop))
        except (ValueError, TypeError, KVXferError) as exc:
            log.exception("kvxfer: room %d: handing over layers [%d, %d) failed", rec.spec.room, start, stop)
            rec.reason = f"{type(exc).__name__}: {exc}"
            rec.handle.abort(rec.reason)
            rec.next_layer = num_layers  # nothing more goes to this send
            return
        rec.next_layer = stop
        rec.groups += 1
        if late:
            rec.layers_late += stop - start
        else:
            rec.layers_streamed += stop - start

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

    def _start_send(self, req_id: str, spec: SendSpec) -> _Send:
        from sglang_kvxfer.engine import KVSender

        if self.prefill is None:
            log.error("kvxfer: request %s: this vLLM instance is not a kv_producer (kv_role)", req_id)
            return _Send(spec, None, "this vLLM instance is not a kv_producer (kv_role)")
        try:
            sender = KVSender(self.prefill, spec.room)
        except (ValueError, TypeError, KVXferError) as exc:
            log.exception("kvxfer: request %s (room %d): the send did not start", req_id, spec.room)
            return _Send(spec, None, f"{type(exc).__name__}: {exc}")
        rec = _Send(spec, sender)
        if not spec.layerwise:
            try:
                sender.send(rec.pages, last_chunk=True)
                rec.groups = 1
            except (ValueError, TypeError, KVXferError) as exc:
                log.exception("kvxfer: request %s (room %d): the send did not start", req_id, spec.room)
                rec.reason = f"{type(exc).__name__}: {exc}"
                sender.abort(rec.reason)
        return rec

    def poll(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sends, finished receives, failed receives) since the last poll."""
        sent: set[str] = set()
        for req_id, rec in list(self._sends.items()):
            state = KVPoll.Failed if rec.handle is None else rec.handle.poll()
            if state not in (KVPoll.Success, KVPoll.Failed) or not rec.released:
                continue
            reason = rec.reason or (rec.handle.failure_reason if rec.handle is not None else "") or ""
            if state == KVPoll.Failed:
                log.warning("kvxfer: send of request %s (room %d) failed: %s", req_id, rec.spec.room, reason)
            self._report(req_id, rec, state == KVPoll.Success, reason)
            if rec.handle is not None:
                rec.handle.clear()
            del self._sends[req_id]
            sent.add(req_id)
        received: set[str] = set()
        failed: set[str] = set()
        for req_id, rec_in in list(self._recvs.items()):
            reason = rec_in.reason
            state = KVPoll.Failed if rec_in.handle is None or reason else rec_in.handle.poll()
            if state not in (KVPoll.Success, KVPoll.Failed):
                continue
            if state == KVPoll.Success:
                try:
                    self.on_received(req_id, list(rec_in.spec.block_ids))
                except Exception:
                    log.exception("kvxfer: on_received hook failed for request %s", req_id)
            else:
                reason = reason or (rec_in.handle.failure_reason if rec_in.handle is not None else "") or "failed"
                log.warning("kvxfer: receive of request %s (room %d) failed: %s", req_id, rec_in.spec.room, reason)
                failed.add(req_id)
                self._load_errors.update(rec_in.spec.block_ids)
            if rec_in.handle is not None:
                rec_in.handle.clear()
            del self._recvs[req_id]
            received.add(req_id)
        return sent, received, failed

    def _report(self, req_id: str, rec: _Send, ok: bool, reason: str) -> None:
        if self.on_sent is None:
            return
        record = rec.handle.record if rec.handle is not None else None
        report = SendReport(
            req_id=req_id,
            room=rec.spec.room,
            tp_rank=self.layout.tp_rank if self.layout is not None else -1,
            layerwise=rec.spec.layerwise,
            layer_groups=rec.groups,
            layers_streamed=rec.layers_streamed,
            layers_late=rec.layers_late,
            ok=ok,
            reason=reason,
            bytes=record.bytes if record is not None else 0,
            ops=record.ops if record is not None else 0,
        )
        try:
            self.on_sent(report)
        except Exception:
            log.exception("kvxfer: on_sent hook failed for request %s", req_id)

    def _note_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._noted:
            self._noted.add(key)
            log.warning(msg + " (logged once)", *args)

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
