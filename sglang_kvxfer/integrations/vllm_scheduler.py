"""The scheduler side of the vLLM connector: which requests move, and the bootstrap.

Owns ``SchedulerSide``, which lives in vLLM's engine-core process. Producer: hosts the
bootstrap service the producer's workers register with (the scheduler is the one process
per instance, and the one that writes ``kv_transfer_params``, so the address it advertises is
the one it listens on); when a request with ``do_remote_decode`` finishes, keeps its blocks,
picks a random room and answers the room, the bootstrap address and the block ids. Consumer:
for a request with ``do_remote_prefill``, claims the whole prompt as loaded asynchronously,
and after allocation hands the block ids to the workers. Must not touch KV memory.

vLLM's rules kept here (as its NIXL push connector keeps them): ``get_num_new_matched_tokens``
has no side effects; ``do_remote_prefill`` is cleared once the receive is staged, so a
rescheduled request does not receive twice; a producer's blocks stay allocated until every
worker reported the send finished (success or failure); ``has_pending_work`` keeps vLLM's
loop stepping while sends are in flight.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from sglang_kvxfer.integrations.vllm_meta import KVXferConnectorMetadata, ParamKeys, RecvSpec, SendSpec, Settings

__all__ = ["SchedulerSide"]

log = logging.getLogger("sglang_kvxfer.vllm")


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


class SchedulerSide:
    """See the module docstring."""

    def __init__(self, vllm_config: Any, settings: Settings):
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
        params = request.kv_transfer_params
        if not params or not params.get(ParamKeys.DO_REMOTE_PREFILL) or num_external_tokens <= 0:
            return
        params[ParamKeys.DO_REMOTE_PREFILL] = False  # staged once, even if rescheduled
        req_id = request.request_id
        try:
            room = int(params[ParamKeys.ROOM])
            bootstrap = str(params[ParamKeys.BOOTSTRAP])
            block_size = int(params.get(ParamKeys.BLOCK_SIZE, self.settings.block_size))
        except (KeyError, TypeError, ValueError) as exc:
            # Not params this connector made: the workers fail the receive with the reason.
            room, bootstrap = -1, f"bad kv_transfer_params ({type(exc).__name__}: {exc})"
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

    # -- both ----------------------------------------------------------------------------------
    def build_connector_meta(self) -> KVXferConnectorMetadata:
        meta = KVXferConnectorMetadata(self._new_sends, self._new_recvs, self._new_aborts)
        self._new_sends, self._new_recvs, self._new_aborts = {}, {}, {}
        return meta

    def update_connector_output(self, output: Any) -> None:
        for req_id in output.finished_sending or ():
            self._sending.discard(req_id)
        for req_id in output.finished_recving or ():
            self._recving.discard(req_id)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        req_id = request.request_id
        if req_id in self._new_recvs:  # finished before its receive reached the workers
            del self._new_recvs[req_id]
            self._recving.discard(req_id)
        if req_id in self._recving:
            # Finished (aborted, or failed by its receive) while its KV may still be arriving:
            # vLLM keeps the blocks until the workers report the receive ended; make it end now.
            self._recving.discard(req_id)
            self._new_aborts[req_id] = f"vLLM finished the request ({request.status.name}) during its transfer"
            return False, None
        if not self.settings.produces or not params or not params.get(ParamKeys.DO_REMOTE_DECODE):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted or failed: nothing to hand over
        num_tokens = len(request.prompt_token_ids or ())
        ids = _group0(block_ids)[: _blocks_for(num_tokens, self.settings.block_size)]
        if not ids:
            return False, None
        room = secrets.randbits(63)
        self._new_sends[req_id] = SendSpec(room, tuple(ids), num_tokens)
        self._sending.add(req_id)
        return True, {
            ParamKeys.DO_REMOTE_PREFILL: True,
            ParamKeys.DO_REMOTE_DECODE: False,
            ParamKeys.BOOTSTRAP: self.settings.bootstrap,
            ParamKeys.ROOM: room,
            ParamKeys.BLOCK_IDS: list(ids),
            ParamKeys.NUM_TOKENS: num_tokens,
            ParamKeys.TP_SIZE: self.settings.tp_size,
            ParamKeys.BLOCK_SIZE: self.settings.block_size,
            ParamKeys.ENGINE: "sglang_kvxfer",
        }

    def has_pending_work(self) -> bool:
        return bool(self._new_sends or self._sending or self._new_recvs or self._new_aborts)

    def close(self) -> None:
        if self.bootstrap_server is not None:
            self.bootstrap_server.close()
            self.bootstrap_server = None
