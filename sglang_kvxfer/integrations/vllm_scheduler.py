"""The scheduler side of the vLLM connector: which requests move, when, and the bootstrap.

Owns ``SchedulerSide``, which lives in vLLM's engine-core process. Must not touch KV memory.

Producer: hosts the bootstrap service the producer's workers register with (the scheduler is
the one process per instance, and the one that writes ``kv_transfer_params``, so the address
it advertises is the one it listens on). A request with ``do_remote_decode`` gets its room
when it is first scheduled: the client's ``room`` (checked: an int in ``[0, 2**63)``, not in
use here), else a random one. When a step's forward completes the request's prompt
(``build_connector_meta`` sees its scheduled tokens reach the prompt length), that step's
metadata opens a **layer-wise** send: each worker hands every layer to the engine as the
forward writes it, so the transfer overlaps the forward (and, when the consumer registered
the room first, runs during it). ``request_finished`` then answers the room, the bootstrap
address and the block ids, keeps the blocks and releases the send. **Whole-request** sends
(the send starts in the step after ``request_finished``) remain for what the layer-wise path
cannot cover: ``layerwise: false``, several KV cache groups, or a request whose prompt
completion this side did not see with its blocks; each reason is logged once.

Consumer: for a request with ``do_remote_prefill``, claims the whole prompt as loaded
asynchronously, and after allocation hands the room, bootstrap and block ids to the workers.

vLLM's rules kept here (as its NIXL push connector keeps them): ``get_num_new_matched_tokens``
has no side effects; ``do_remote_prefill`` is cleared once the receive is staged, so a
rescheduled request does not receive twice; a producer's blocks stay allocated until every
worker reported the send finished (success or failure), and workers report a send only once
its request finished with its blocks held (vLLM frees the blocks of every request id in
``finished_sending``); a request that did not finish normally (aborted, failed) has its send
aborted with the reason, its blocks held until the workers report that send ended; a
preempted request (vLLM frees its blocks itself and recomputes it) has its send dropped
before the next forward and sends again, same room, when its prompt completes again;
``has_pending_work`` keeps vLLM's loop stepping while sends are in flight.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from sglang_kvxfer.integrations.vllm_meta import (
    KVXferConnectorMetadata,
    ParamKeys,
    RecvSpec,
    SendSpec,
    Settings,
    check_room,
)

__all__ = ["SchedulerSide"]

log = logging.getLogger("sglang_kvxfer.vllm")

_NORMAL_FINISH = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")  # vLLM RequestStatus names


def _group0(block_ids: Any) -> list[int]:
    """vLLM's block ids of one request: a list, or a tuple of per-group lists (one group
    supported)."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        groups = [list(g) for g in block_ids]
        if sum(1 for g in groups if g) > 1:
            raise ValueError(
                f"the request has blocks in {len(groups)} KV cache groups; the kvxfer connector moves one group"
            )
        return next((g for g in groups if g), [])
    return list(block_ids or [])


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class _Job:
    """A ``do_remote_decode`` request on the producer, from its first scheduling to the end
    of its send. ``error``: why it moves nothing (bad params; ``room`` is then -1).
    ``streaming``: its open layer-wise send while the request runs. ``held``: it finished, its
    blocks are kept. ``whole``: why it is sent whole (logged)."""

    __slots__ = ("room", "error", "num_tokens", "streaming", "held", "whole")

    def __init__(self, room: int, error: str, num_tokens: int):
        self.room, self.error, self.num_tokens = room, error, num_tokens
        self.streaming: SendSpec | None = None
        self.held = False
        self.whole = ""


class SchedulerSide:
    """See the module docstring. ``num_kv_cache_groups``: vLLM's ``kv_cache_config`` groups
    (the layer-wise path moves one)."""

    def __init__(self, vllm_config: Any, settings: Settings, num_kv_cache_groups: int = 1):
        self.settings = settings
        self.bootstrap_server = None
        if settings.produces:
            from sglang_kvxfer.engine import BootstrapServer

            host, port = settings.bootstrap.rsplit(":", 1)
            self.bootstrap_server = BootstrapServer(host, int(port))
            log.info("kvxfer: bootstrap service on %s", settings.bootstrap)
        self._new_sends: dict[str, SendSpec] = {}
        self._sending: set[str] = set()  # blocks held until every worker reports the send done
        self._new_recvs: dict[str, RecvSpec] = {}
        self._recving: set[str] = set()
        self._new_aborts: dict[str, str] = {}
        self._jobs: dict[str, _Job] = {}
        self._rooms: dict[int, str] = {}  # producer rooms in use -> request id
        self._released: set[str] = set()
        self._send_aborts: dict[str, str] = {}
        self._dropped: dict[str, str] = {}
        self._noted: set[str] = set()
        self.whole_request_reason = ""  # why every send is whole-request ("": layer-wise)
        if not settings.layerwise:
            self.whole_request_reason = "kv_connector_extra_config layerwise=false"
        elif num_kv_cache_groups > 1:
            self.whole_request_reason = f"{num_kv_cache_groups} KV cache groups (the layer-wise path moves one)"
        if settings.produces:
            if self.whole_request_reason:  # a warning where the path is forced, not chosen
                level = logging.INFO if not settings.layerwise else logging.WARNING
                log.log(level, "kvxfer: whole-request sends after each request finishes: %s", self.whole_request_reason)
            else:
                log.info(
                    "kvxfer: layer-wise sends: each layer moves as the forward that completes the prompt writes it"
                )

    def _note_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._noted:
            self._noted.add(key)
            log.warning(msg + " (logged once)", *args)

    # -- consumer ------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not self.settings.consumes or not params or not params.get(ParamKeys.DO_REMOTE_PREFILL):
            return 0, False
        if num_computed_tokens:
            # The producer pushes the whole prompt into pages counted from the first; a local
            # prefix hit would leave fewer pages here than the producer sends. Compute locally.
            log.warning(
                "kvxfer: request %s has %d prompt tokens cached locally; its prompt is computed here "
                "instead of received (disable prefix caching on the consumer to always receive)",
                request.request_id,
                num_computed_tokens,
            )
            return 0, False
        num_tokens = int(params.get(ParamKeys.NUM_TOKENS) or len(request.prompt_token_ids or ()))
        return (num_tokens, True) if num_tokens > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._track(request)
        params = request.kv_transfer_params
        if not params or not params.get(ParamKeys.DO_REMOTE_PREFILL) or num_external_tokens <= 0:
            return
        params[ParamKeys.DO_REMOTE_PREFILL] = False  # staged once, even if rescheduled
        req_id = request.request_id
        try:
            room = check_room(params.get(ParamKeys.ROOM))
            bootstrap = params.get(ParamKeys.BOOTSTRAP)
            if not isinstance(bootstrap, str) or ":" not in bootstrap:
                raise ValueError(f"kv_transfer_params {ParamKeys.BOOTSTRAP}={bootstrap!r} must be 'host:port'")
            block_size = int(params.get(ParamKeys.BLOCK_SIZE, self.settings.block_size))
        except (TypeError, ValueError) as exc:
            # Not params this connector (or a client) should send: the workers fail the receive
            # with the reason, so the request ends with finish_reason "error" (policy "fail").
            room, bootstrap = -1, f"bad kv_transfer_params: {exc}"
        else:
            if block_size != self.settings.block_size:
                # vLLM's CPU attention keeps the rows of a (block, head) tile in an order of its
                # own (per ISA), so only whole blocks of equal size are interchangeable.
                room = -1
                bootstrap = (
                    f"kv_transfer_params block_size={block_size} (producer) differs from this "
                    f"consumer's block_size={self.settings.block_size}; start both with the same --block-size"
                )
        ids = _group0(blocks.get_block_ids())[: _blocks_for(num_external_tokens, self.settings.block_size)]
        self._new_recvs[req_id] = RecvSpec(room, bootstrap, tuple(ids), int(num_external_tokens))
        self._recving.add(req_id)

    # -- producer ------------------------------------------------------------------------------
    def _track(self, request: Any) -> None:
        """Give a ``do_remote_decode`` request its room (once: a preempted request keeps it)."""
        params = request.kv_transfer_params
        req_id = request.request_id
        if not self.settings.produces or not params or not params.get(ParamKeys.DO_REMOTE_DECODE):
            return
        if req_id in self._jobs:
            return
        error = ""
        if params.get(ParamKeys.ROOM) is not None:  # the client's (concurrent mode)
            try:
                room = check_room(params[ParamKeys.ROOM])
            except ValueError as exc:
                room, error = -1, str(exc)
            else:
                owner = self._rooms.get(room)
                if owner is not None:
                    error = (
                        f"kv_transfer_params {ParamKeys.ROOM}={room} is in use by request {owner} on this "
                        "producer; pick a new random room per request"
                    )
                    room = -1
        else:
            room = self._random_room()
        if error:
            log.warning("kvxfer: request %s moves no KV: %s", req_id, error)
        else:
            self._rooms[room] = req_id
        self._jobs[req_id] = _Job(room, error, len(request.prompt_token_ids or ()))

    def _random_room(self) -> int:
        room = secrets.randbits(63)
        while room in self._rooms:
            room = secrets.randbits(63)
        return room

    def _forget(self, req_id: str) -> None:
        job = self._jobs.pop(req_id, None)
        if job is not None and self._rooms.get(job.room) == req_id:
            del self._rooms[job.room]

    def _open_layerwise_sends(self, out: Any) -> None:
        """Drop the sends of requests vLLM preempted (it freed their blocks), then open a
        layer-wise send for every tracked request whose prompt this step's forward completes."""
        for req_id in getattr(out, "preempted_req_ids", None) or ():
            job = self._jobs.get(req_id)
            if job is not None and job.streaming is not None:
                job.streaming = None
                self._dropped[req_id] = (
                    "vLLM preempted the request on the producer and freed its blocks; it is recomputed "
                    "and its KV sent again"
                )
        if self.whole_request_reason:
            return
        before: dict[str, int] = {new.req_id: int(new.num_computed_tokens) for new in out.scheduled_new_reqs}
        first_blocks: dict[str, Any] = {new.req_id: new.block_ids for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        before.update(zip(cached.req_ids, (int(n) for n in cached.num_computed_tokens)))
        block_state = getattr(out, "kv_connector_block_state", None)
        for req_id, num_new in out.num_scheduled_tokens.items():
            job = self._jobs.get(req_id)
            if job is None or job.error or job.streaming is not None or job.held or req_id not in before:
                continue
            done = before[req_id]
            if not done < job.num_tokens <= done + int(num_new):
                continue  # the prompt does not complete in this step
            # The request's blocks: vLLM's block state for connectors, else (older schedulers)
            # those of a request scheduled for the first time, which holds them all.
            raw = block_state.get_block_ids(req_id) if block_state is not None else first_blocks.get(req_id)
            ids, why = self._prompt_blocks(raw, job.num_tokens)
            if why:
                job.whole = why
                self._note_once(
                    "blocks", "kvxfer: request %s is sent whole after it finishes, not layer-wise: %s", req_id, why
                )
                continue
            job.streaming = self._new_sends[req_id] = SendSpec(job.room, ids, job.num_tokens, layerwise=True)

    def _prompt_blocks(self, raw: Any, num_tokens: int) -> tuple[tuple[int, ...], str]:
        """The blocks of a ``num_tokens``-token prompt from vLLM's block ids, or why not."""
        if raw is None:
            return (
                (),
                "its block ids are not in the scheduler output (chunked prefill without kv_connector_block_state)",
            )
        need = _blocks_for(num_tokens, self.settings.block_size)
        try:
            ids = _group0(raw)[:need]
        except ValueError as exc:
            return (), str(exc)
        if len(ids) < need:
            return (), f"{len(ids)} blocks allocated for a {num_tokens}-token prompt ({need} needed)"
        return tuple(int(i) for i in ids), ""

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        req_id = request.request_id
        status = request.status.name
        if req_id in self._new_recvs:  # finished before its receive reached the workers
            del self._new_recvs[req_id]
            self._recving.discard(req_id)
        if req_id in self._recving:
            # Finished (aborted, or failed by its receive) while its KV may still be arriving:
            # vLLM keeps the blocks until the workers report the receive ended; make it end now.
            self._recving.discard(req_id)
            self._new_aborts[req_id] = f"vLLM finished the request ({status}) during its transfer"
            return False, None
        job = self._jobs.get(req_id)
        if not self.settings.produces or not params or not params.get(ParamKeys.DO_REMOTE_DECODE):
            if job is not None:
                self._forget(req_id)
            return False, None
        normal = status in _NORMAL_FINISH
        if job is not None and job.streaming is not None:
            # Its layer-wise send is open: keep the blocks until every worker reports its end.
            spec, job.streaming, job.held = job.streaming, None, True
            self._released.add(req_id)
            self._sending.add(req_id)
            if not normal:
                self._send_aborts[req_id] = f"vLLM finished the request ({status}) on the producer"
                return True, None
            return True, self._answer(spec)
        error = job.error if job is not None else ""
        if not normal or error:
            self._forget(req_id)
            if not normal:
                return False, None  # aborted or failed before its prompt completed: nothing to hand over
            return False, {
                ParamKeys.DO_REMOTE_PREFILL: False,
                ParamKeys.DO_REMOTE_DECODE: False,
                ParamKeys.ERROR: error,
                ParamKeys.ENGINE: "sglang_kvxfer",
            }
        num_tokens = len(request.prompt_token_ids or ())
        ids = _group0(block_ids)[: _blocks_for(num_tokens, self.settings.block_size)]
        if not ids:
            self._forget(req_id)
            return False, None
        if not self.whole_request_reason and (job is None or not job.whole):
            self._note_once(
                "unseen",
                "kvxfer: request %s is sent whole after it finishes, not layer-wise: its prompt completion "
                "was not seen in build_connector_meta",
                req_id,
            )
        if job is None:
            self._jobs[req_id] = job = _Job(self._random_room(), "", num_tokens)
            self._rooms[job.room] = req_id
        job.held = True
        spec = self._new_sends[req_id] = SendSpec(job.room, tuple(ids), num_tokens)
        self._sending.add(req_id)
        return True, self._answer(spec)

    def _answer(self, spec: SendSpec) -> dict[str, Any]:
        return {
            ParamKeys.DO_REMOTE_PREFILL: True,
            ParamKeys.DO_REMOTE_DECODE: False,
            ParamKeys.BOOTSTRAP: self.settings.bootstrap,
            ParamKeys.ROOM: spec.room,
            ParamKeys.BLOCK_IDS: list(spec.block_ids),
            ParamKeys.NUM_TOKENS: spec.num_tokens,
            ParamKeys.TP_SIZE: self.settings.tp_size,
            ParamKeys.BLOCK_SIZE: self.settings.block_size,
            ParamKeys.ENGINE: "sglang_kvxfer",
        }

    # -- both ----------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any = None) -> KVXferConnectorMetadata:
        if scheduler_output is not None and self._jobs:
            self._open_layerwise_sends(scheduler_output)
        meta = KVXferConnectorMetadata(
            sends=self._new_sends,
            recvs=self._new_recvs,
            aborts=self._new_aborts,
            released=self._released,
            send_aborts=self._send_aborts,
            dropped=self._dropped,
        )
        self._new_sends, self._new_recvs, self._new_aborts = {}, {}, {}
        self._released, self._send_aborts, self._dropped = set(), {}, {}
        return meta

    def update_connector_output(self, output: Any) -> None:
        for req_id in output.finished_sending or ():
            self._sending.discard(req_id)
            self._forget(req_id)
        for req_id in output.finished_recving or ():
            self._recving.discard(req_id)

    def has_pending_work(self) -> bool:
        return bool(
            self._new_sends
            or self._sending
            or self._new_recvs
            or self._new_aborts
            or self._released
            or self._send_aborts
            or self._dropped
        )

    def close(self) -> None:
        if self.bootstrap_server is not None:
            self.bootstrap_server.close()
            self.bootstrap_server = None
