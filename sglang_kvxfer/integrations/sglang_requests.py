"""SGLang's per-request sender and receiver for the kvxfer backend.

Owns ``KVXferKVSender`` (prefill) and ``KVXferKVReceiver`` (decode), what they share
(``_Request``: the monotonic status and the failure record) and ``_Parts``: the engine
requests one SGLang request drives. A request is one engine request per part: the model's KV,
a draft model's KV over the same pages, one per pool of the model's extra per-request state
over that pool's own indices (``state_indices``, ``sglang_state``), and on a decode of PP 1
facing a prefill of several PP stages, one per stage over the layers it holds. It succeeds
only when every part did; the first failure fails it and aborts the others.

SGLang's contract kept here: polls return ``KVPoll`` ints, move forward only, and ``Failed``
is terminal; ``failure_exception()`` raises an error with ``failure_reason`` and
``is_from_another_rank``; a bad call from the scheduler fails that request with the reason
instead of raising into the event loop; on the decode side the aux (metadata) slot is written
before ``Success`` is reported, so SGLang's metadata gate sees the request's
``bootstrap_room``. Must not: build engine managers (``sglang_manager``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from sglang_kvxfer import envs
from sglang_kvxfer.engine.config import EngineConfig, parse_host_port
from sglang_kvxfer.errors import KVXferError
from sglang_kvxfer.integrations import sglang_checksum as checksum
from sglang_kvxfer.integrations.sglang_args import cp_page_share
from sglang_kvxfer.integrations.sglang_common import (
    DRAFT,
    BaseKVReceiver,
    BaseKVSender,
    KVPoll,
    KVTransferMetric,
    KVXferTransferError,
    Synchronizable,
    log,
    page_array,
    prefix_tokens,
    seam,
)
from sglang_kvxfer.integrations.sglang_manager import KVXferKVManager
from sglang_kvxfer.integrations.sglang_state import KV_PAGES, StatePool, state_pages

if TYPE_CHECKING:
    from sglang_kvxfer.engine import KVReceiver, KVSender
    from sglang_kvxfer.metrics import RequestRecord

__all__ = ["KVXferKVSender", "KVXferKVReceiver"]


def _buffer_ptrs(engine) -> tuple[int, ...]:
    """The addresses of an engine manager's pool buffers (a state pool's, or its slice)."""
    return tuple(int(b.data_ptr()) for b in engine.pool.buffers)


def engine_digests(engine, rows: np.ndarray) -> dict[int, int]:
    """The KV checksums of ``rows`` of an engine manager's pool, per global head it owns."""
    return checksum.head_digests(engine.placement, _buffer_ptrs(engine), rows)


class _Parts:
    """The engine requests of one SGLang request, each with a label ("" for the model's
    whole pool). It succeeds only when every part did; the first failure fails it (its
    reason names the part) and aborts the others."""

    def __init__(self, parts: list[tuple[str, KVSender | KVReceiver]]):
        if not parts:
            raise ValueError("a request needs at least one engine request")
        self.parts = parts

    def poll(self) -> int:
        states = [int(h.poll()) for _, h in self.parts]
        if KVPoll.Failed in states:
            reason = self.failure_reason or "the transfer failed"
            for (_, h), st in zip(self.parts, states):
                if st not in (KVPoll.Failed, KVPoll.Success):
                    h.abort(reason)
            return int(KVPoll.Failed)
        if all(st == KVPoll.Success for st in states):
            return int(KVPoll.Success)
        return min(st for st in states if st != KVPoll.Success)

    def state(self) -> int:
        """The lowest status of the parts, without acting on a failure."""
        return min(int(h.poll()) for _, h in self.parts)

    @property
    def failure_reason(self) -> str | None:
        for what, h in self.parts:
            reason = h.failure_reason
            if reason is not None and int(h.poll()) == KVPoll.Failed:
                return f"{what}: {reason}" if what else reason
        return None

    def abort(self, reason: str) -> None:
        for _, h in self.parts:
            h.abort(reason)

    def clear(self) -> None:
        for _, h in self.parts:
            h.clear()

    @property
    def record(self) -> _PartsRecord:
        return _PartsRecord(tuple((what, h.record) for what, h in self.parts))


@dataclass(frozen=True)
class _PartsRecord:
    """The transfer record of a request: its first part's, with every part's bytes and ops
    added; a draft model's also shown apart (``draft_bytes``/``draft_ops``), each PP stage's
    in ``pp_stages``, each prefill CP rank's share in ``cp_ranks``, each state pool's in
    ``state``."""

    parts: tuple[tuple[str, RequestRecord], ...]

    def to_dict(self) -> dict:
        (first_label, first), rest = self.parts[0], self.parts[1:]
        line = first.to_dict()
        stages = [(first_label, first)] if first_label.startswith(STAGE) else []
        shares = [(first_label, first)] if first_label.startswith(CP_RANK) else []
        states: list[dict[str, Any]] = []
        for what, d in rest:
            line.update(bytes=line["bytes"] + d.bytes, ops=line["ops"] + d.ops)
            if what.startswith(DRAFT):  # (one per CP rank when each sends its share)
                line.update(
                    draft_bytes=line.get("draft_bytes", 0) + d.bytes, draft_ops=line.get("draft_ops", 0) + d.ops
                )
            elif what.startswith(STAGE):
                stages.append((what, d))
            elif what.startswith(CP_RANK):
                shares.append((what, d))
            else:  # a state pool
                states.append({"pool": what, "bytes": d.bytes, "ops": d.ops, "ok": d.ok})
            if not d.ok and line.get("ok"):
                line.update(ok=False, reason=f"{what}: {d.reason}")
        if stages:
            line["pp_stages"] = [{"stage": what, "bytes": d.bytes, "ops": d.ops, "ok": d.ok} for what, d in stages]
        if shares:
            line["cp_ranks"] = [{"cp_rank": what, "bytes": d.bytes, "ops": d.ops, "ok": d.ok} for what, d in shares]
        if states:
            line.update(state=states, state_bytes=sum(x["bytes"] for x in states))
        return line


STAGE = "PP stage "  # how sglang_pp.stage_label starts
CP_RANK = "CP rank "  # how a prefill CP rank's share is labelled (sglang_manager._stage_parts)


class _Request:
    """What a sender and a receiver share: the monotonic status and the failure record."""

    def _setup(self, room: Any) -> None:
        if isinstance(room, bool) or not isinstance(room, (int, np.integer)):
            raise ValueError(f"bootstrap_room={room!r} must be an int")
        self.bootstrap_room = int(room)
        self.conclude_state: int | None = None
        self._status = KVPoll.Bootstrapping
        self._reason: str | None = None
        self._engine: _Parts | None = None  # the engine's requests, once made

    def _observe(self, state: int) -> int:
        if state == KVPoll.Failed or state == KVPoll.Success:
            self.conclude_state = int(state)
            self._write_record()
            return self.conclude_state
        self._status = max(self._status, int(state))
        return self._status

    def _fail(self, reason: str) -> None:
        """Fail this request here and tell the peers (no-op once concluded)."""
        if self.conclude_state is not None:
            return
        self._reason = reason
        self.conclude_state = KVPoll.Failed
        if self._engine is not None:
            self._engine.abort(reason)
        log.warning("kvxfer room %d failed: %s", self.bootstrap_room, reason)
        self._write_record()

    def _write_record(self) -> None:
        """Append this request's record to ``KVXFER_RECORDS_FILE`` (once; never raises)."""
        path = envs.KVXFER_RECORDS_FILE.get()
        if not path or self._engine is None or getattr(self, "_recorded", False):
            return
        self._recorded = True
        try:
            line = self._engine.record.to_dict()
            if self._reason and not line.get("reason"):
                line.update(ok=False, reason=self._reason)
            mgr = getattr(self, "kv_mgr", None)
            if mgr is not None and mgr.pp_size > 1:  # this rank's PP stage
                line.update(pp_rank=mgr.pp_rank, pp_size=mgr.pp_size)
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")
        except Exception:
            log.warning("kvxfer room %d: could not append its record to %s", self.bootstrap_room, path, exc_info=True)

    def _fail_from(self, where: str, exc: Exception) -> None:
        """A scheduler call failed: fail this request with why, never raise into the loop."""
        if isinstance(exc, (ValueError, TypeError, KVXferError)):
            return self._fail(f"{where}: {exc}")
        log.exception("kvxfer room %d: unexpected error in %s", self.bootstrap_room, where)
        self._fail(f"{where}: {type(exc).__name__}: {exc}")

    def failure_exception(self):
        """Raise the reason this request failed (SGLang calls it after a Failed poll)."""
        own = self._reason or (self._engine.failure_reason if self._engine is not None else None)
        if own is None:  # Failed came from another TP rank through the all-reduce
            self._fail("another TP rank failed this request")
            self.clear()
            raise KVXferTransferError(
                self.bootstrap_room, "Failed due to an unknown reason from another rank", is_from_another_rank=True
            )
        self.conclude_state = KVPoll.Failed
        self.clear()
        raise KVXferTransferError(self.bootstrap_room, own)

    def abort(self) -> None:
        self._fail("aborted by SGLang (AbortReq)")

    def clear(self) -> None:
        if self._engine is not None:
            self._engine.clear()


class KVXferKVSender(_Request, BaseKVSender):
    """Prefill side of one request (on a CP replica rank: a ``CPReplicaSender``)."""

    def __new__(cls, mgr: KVXferKVManager, *args: Any, **kwargs: Any):
        if cls is KVXferKVSender and getattr(mgr, "is_dummy_cp_rank", False):
            cls = CPReplicaSender
        return super().__new__(cls)

    def __init__(
        self,
        mgr: KVXferKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ):
        from sglang_kvxfer.engine import KVSender

        if not isinstance(mgr, KVXferKVManager) or mgr.role != "prefill":
            raise TypeError(f"mgr must be a prefill KVXferKVManager, got {mgr!r}")
        self._setup(bootstrap_room)
        self.kv_mgr = mgr
        self.bootstrap_server_url = bootstrap_addr
        self.num_kv_indices: int | None = None
        self.aux_index: int | None = None
        self.curr_idx = 0
        self._early_send_wait_event = None  # set by SGLang's early (prefix) send under overlap
        self._started: float | None = None
        self._latency: float | None = None
        self._sender = KVSender(mgr.prefill_engine, self.bootstrap_room)
        parts: list[tuple[str, KVSender | KVReceiver]] = [("", self._sender)]
        draft = mgr.prefill_draft_engine
        self._draft: KVSender | None = None
        if draft is not None:
            self._draft = KVSender(draft, self.bootstrap_room)
            parts.append((DRAFT, self._draft))
        # extra per-request state: one engine request per pool, sent with the last chunk
        self._states = [(pool, KVSender(engine, self.bootstrap_room)) for pool, engine in mgr.prefill_state_engines]
        parts += [(pool.label, sender) for pool, sender in self._states]
        self._engine = self._pair = _Parts(parts)
        self._pages: list[np.ndarray] = []  # the pages of every chunk sent, in order (KV checksum)
        dp_size = mgr.plan.dp_groups
        if dp_size > 1 and not req_has_disagg_prefill_dp_rank and not mgr.plan.follows_room:
            # SGLang's load balancer placed the request in this DP group: the decode asks the
            # bootstrap which (SGLang's CommonKVSender registers it the same way). One rank of
            # the group tells it: the group's first attention-TP rank of PP stage 0.
            if mgr.layout.tp_rank == 0 and mgr.pp_rank == 0:
                try:
                    mgr.prefill_engine.route_room(self.bootstrap_room)
                except KVXferError as exc:
                    self._fail(str(exc))
        elif dp_size > 1 and not req_has_disagg_prefill_dp_rank and self.bootstrap_room % dp_size != mgr.dp_rank:
            # The decode looks for this request in DP group bootstrap_room % dp_size
            # (SGLang's follow_bootstrap_room); serving it here would never be found.
            self._fail(
                f"prefill DP group {mgr.dp_rank} was given bootstrap_room={self.bootstrap_room}, which "
                f"follow_bootstrap_room routes to DP group {self.bootstrap_room % dp_size} "
                f"(bootstrap_room % dp_size, dp_size={dp_size}); the decode looks for it there"
            )
        if mgr.stage_status is not None:  # a later PP stage: stage 0 waits for this one too
            mgr.stage_status.watch(self.bootstrap_room, self._bootstrap_state)

    def _bootstrap_state(self) -> int:
        """This request's status without acting on it (read by the PP status thread)."""
        concluded = self.conclude_state
        return concluded if concluded is not None else self._pair.state()

    def init(self, num_kv_indices: int, aux_index: int | None = None):
        """The request's page count (its last page may be partial) and metadata slot."""
        if isinstance(num_kv_indices, bool) or not isinstance(num_kv_indices, (int, np.integer)) or num_kv_indices < 0:
            return self._fail(f"init(): num_kv_indices={num_kv_indices!r} must be an int >= 0")
        if aux_index is not None:
            try:
                self.kv_mgr.layout.aux.check_slot(aux_index)
            except ValueError as exc:
                return self._fail(f"init(): {exc}")
        self.num_kv_indices, self.aux_index = int(num_kv_indices), aux_index

    def mark_prefill_complete(self) -> None:
        """SGLang's ``prefill_complete`` policy: this request's forward finished (its KV is in
        the pools) before the decode allocated anything. Each engine request of it says so:
        the decode rank that watches the room allocates now, and the wait for its metadata
        (the bootstrap deadline) starts again. Idempotent; nothing under the ``early`` policy."""
        from sglang_kvxfer.engine import KVSender

        if self.conclude_state is not None or not self.kv_mgr.plan.prefill_complete:
            return
        try:
            for _, part in self._pair.parts:  # (a sender's parts are engine senders)
                if isinstance(part, KVSender):
                    part.mark_prefill_complete()
        except Exception as exc:
            self._fail_from("mark_prefill_complete()", exc)

    def pop_decode_prefix_len(self) -> int:
        """The prefix the decode already holds (0 without a decode radix cache). SGLang asks
        once the poll reached WaitingForInput, before ``init``: by then every decode rank's
        request has arrived. A length this prefill cannot page-align fails the request."""
        try:
            prefix = self._sender.decode_prefix_tokens
            if prefix is None:
                raise ValueError("asked before the decode's request arrived (poll is not WaitingForInput)")
            if self._draft is not None:
                draft = self._draft.decode_prefix_tokens
                if draft is None:
                    raise ValueError(f"asked before the decode's request for the {DRAFT} arrived")
                if draft != prefix:
                    raise ValueError(
                        f"the decode sent decode_prefix_len={prefix} for the model's KV and {draft} for the {DRAFT}"
                    )
            return prefix_tokens(prefix, self.kv_mgr.layout.geometry.page_size, "prefill")
        except Exception as exc:
            self._fail_from("pop_decode_prefix_len()", exc)
            return 0

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk  # an empty last chunk still ends the request

    def send(
        self,
        kv_indices,
        state_indices: list | None = None,
        num_kv_tokens: int | None = None,
        indices_event: Synchronizable | None = None,
    ):
        """Hand over the next chunk of pages. The chunk covers the decode page list slice
        ``[curr_idx, curr_idx + len(kv_indices))`` (SGLang's ``index_slice``); the one that
        reaches ``num_kv_indices`` is the last and carries the aux slot (every PP stage sends
        its own: a decode stage takes it from the prefill stage of its rank, a decode of PP 1
        from the last stage) and ``state_indices``: each state pool's indices (SGLang's payload
        per ``state_types`` entry), moved by that pool's engine request."""
        wait, self._early_send_wait_event = self._early_send_wait_event, None
        if self.conclude_state is not None:
            return
        try:
            if indices_event is not None:
                indices_event.synchronize()  # the D2H copy of the indices must have landed
            pages = page_array(kv_indices)
            index_slice = self._chunk_slice(pages)
            last = index_slice.stop == self.num_kv_indices
            positions = None
            if self.kv_mgr.kv_sharded:
                pages, positions = self._shard_pages(pages, index_slice)
                if not pages.size and not last:  # none of this chunk's pages lives on this shard rank
                    self.curr_idx = index_slice.stop
                    return
            elif self.kv_mgr.cp_sharded:
                pages = self._cp_share(pages, index_slice)
                if not pages.size and not last:  # none of this chunk is this CP rank's to send
                    self.curr_idx = index_slice.stop
                    return
            if last:
                pages = self._dcp_padded(pages)
            if not last and state_indices and any(s is not None for s in state_indices):
                raise ValueError("state_indices came with a chunk that is not the request's last")
            # (every CP rank holds the same state; with every CP rank sending, CP rank 0 sends it;
            # with KV cache sharding the state is a DSA indexer's pages, sharded like the KV)
            sharded = self.kv_mgr.kv_sharded
            replica = not sharded and self.kv_mgr.cp_sharded and self.kv_mgr.cp_rank > 0
            state = []
            if last and not replica:  # (a kv_layout pool's other KV runs: every page the request sent)
                sent = np.concatenate([*self._pages, pages]) if self._pages else pages
                state = state_pages([pool for pool, _ in self._states], state_indices, sent)
            where: list[np.ndarray | None] = [None] * len(state)
            if sharded:  # each indexer's pages this shard rank holds, at their positions
                owned = [self._shard_pages(rows, slice(0, len(rows))) for rows in state]
                state, where = [rows for rows, _ in owned], [at for _, at in owned]
            aux = self.kv_mgr.layout.aux.read(self.aux_index) if last and self.aux_index is not None else b""
            self._started = self._started or time.perf_counter()
            self._pages.append(pages)
            draft_aux = b""
            state_aux = [b""] * len(state)
            if last and self.kv_mgr.kv_checksum:
                if wait is not None:
                    wait.synchronize()  # the digest reads this chunk's KV and state
                aux, draft_aux = self._digests(aux)
                state_aux = [
                    checksum.attach(b"", engine_digests(sender.mgr, rows))
                    for (_, sender), rows in zip(self._states, state)
                ]
            self._sender.send(pages, last_chunk=last, aux=aux, ready=wait, positions=positions)
            if self._draft is not None:  # (SGLang's draft pool shares the model's logical pages)
                self._draft.send(pages, last_chunk=last, aux=draft_aux, ready=wait, positions=positions)
            if not last:  # a kv_layout pool's other KV runs move chunk by chunk with the model's pool
                for pool, sender in self._states:
                    if pool.kind == KV_PAGES:
                        sender.send(pages, last_chunk=False, ready=wait)
            for (pool, sender), rows, digests, at in zip(self._states, state, state_aux, where):
                # (the last chunk of a KV run: its own pages; the digests cover every page it sent)
                sent = pages if pool.kind == KV_PAGES else rows
                sender.send(sent, last_chunk=True, aux=digests, ready=wait, positions=at)
            self.curr_idx = index_slice.stop
        except Exception as exc:
            self._fail_from("send()", exc)

    def _dcp_padded(self, pages: np.ndarray) -> np.ndarray:
        """The last chunk's pages, completed for a decode with ``--dcp-size N``: its pages
        hold ``page_size * N`` tokens, so it counts up to N - 1 pages more than this request
        fills here. Those tokens lie past the request's end; the last page is sent again for
        them (into rows of the decode's last page that decoding overwrites before it reads
        them), so every page of the decode's list is written."""
        told = self._sender.decode_tokens
        if told is None or told[1] == 1:
            return pages
        tokens, stride = told
        page_size = self.kv_mgr.layout.geometry.page_size
        have = self._pages_sent()  # SGLang counts them after the decode's prefix
        extra = -(-tokens // page_size) - have
        if not 0 <= extra < stride:
            raise ValueError(
                f"the decode's DCP pages (token_stride {stride}) hold {tokens} tokens after its prefix; "
                f"this request fills {have} page(s) of {page_size}, which needs between "
                f"{have * page_size - page_size + 1} and {(have + stride - 1) * page_size} there"
            )
        if not extra:
            return pages
        tail = pages[-1:] if pages.size else np.concatenate(self._pages)[-1:]
        return np.concatenate([pages, np.repeat(tail, extra)])

    def _shard_pages(self, pages: np.ndarray, index_slice: slice) -> tuple[np.ndarray, np.ndarray]:
        """``(local page ids, positions)`` of the pages of a chunk (``index_slice`` of the
        request's page list) that live on this shard rank under --enable-kv-cache-sharding:
        logical page ``l`` on shard rank ``l % N`` as its local page ``l // N`` (SGLang's
        ``filter_kv_indices_for_shard_rank``), each at its position in the decode's list."""
        rank, size = self.kv_mgr.kv_shard
        owned = pages % size == rank
        return pages[owned] // size, np.arange(index_slice.start, index_slice.stop, dtype=np.int64)[owned]

    def _cp_share(self, pages: np.ndarray, index_slice: slice) -> np.ndarray:
        """The pages of a chunk (``index_slice`` of the request's page list) that lie in this
        CP rank's share of the request (``_share``)."""
        share = self._share()
        start = max(share.start, index_slice.start) - index_slice.start
        stop = min(share.stop, index_slice.stop) - index_slice.start
        return pages[start : max(start, stop)]

    def _share(self) -> slice:
        """The request's pages this CP rank sends when every CP rank sends its share: SGLang's
        split (``cp_page_share``) of the page list, which the decode splits the same way.
        Toward a decode with ``--dcp-size N`` (told ``token_stride`` N), whose pages hold
        ``page_size * N`` tokens, the decode's page list is split instead and each share is
        its pages' tokens here (N pages per decode page; the decode does not know how many
        pages the request fills here, this side knows how many it fills there)."""
        mgr, pages = self.kv_mgr, self.num_kv_indices or 0
        told = self._sender.decode_tokens
        if told is None:
            raise ValueError("send() came before the decode's request arrived (poll is not WaitingForInput)")
        stride = told[1]
        if stride == 1:
            return cp_page_share(pages, mgr.cp_rank, mgr.plan.attn_cp_size)
        theirs = cp_page_share(-(-pages // stride), mgr.cp_rank, mgr.plan.attn_cp_size)
        return slice(min(pages, theirs.start * stride), min(pages, theirs.stop * stride))

    def _pages_sent(self) -> int:
        """How many of the request's pages this rank sends: all, or its CP share's."""
        if not self.kv_mgr.cp_sharded:
            return self.num_kv_indices or 0
        share = self._share()
        return share.stop - share.start

    def _chunk_slice(self, pages: np.ndarray) -> slice:
        """The slice of the request's page list that ``pages``, the next chunk, covers."""
        if self.num_kv_indices is None:
            raise ValueError("send() came before init()")
        index_slice = slice(self.curr_idx, self.curr_idx + len(pages))
        if index_slice.stop > self.num_kv_indices:
            raise ValueError(
                f"pages [{index_slice.start}, {index_slice.stop}) run past "
                f"num_kv_indices={self.num_kv_indices} given to init()"
            )
        return index_slice

    def _digests(self, aux: bytes) -> tuple[bytes, bytes]:
        """``aux`` and the draft's (empty) aux with this rank's KV checksums in front: each
        head it owns over every page of the request it sent. Toward a decode with
        ``--dcp-size N`` (told ``token_stride`` N), over the tokens of its pages instead, one
        set per token phase (what each DCP rank holds), the draft's over its tokens in order
        (its decode pages hold ``page_size * N`` tokens)."""
        mgr = self.kv_mgr
        pages = np.concatenate(self._pages) if self._pages else np.zeros(0, dtype=np.int64)
        draft, config = mgr.layout.draft, mgr.draft_config
        told = self._sender.decode_tokens
        if told is not None and told[1] > 1:
            have = self._pages_sent()  # (the pages after it repeat the last for the DCP decode)
            tokens, place = have * mgr.layout.geometry.page_size, mgr.config.placement
            aux = checksum.attach_tokens(
                aux, checksum.token_digests(place, mgr.layout.kv_ptrs, pages[:have], tokens, told[1])
            )
            if draft is None or config is None:
                return aux, b""
            digests = checksum.token_digests(config.placement, draft.kv_ptrs, pages[:have], tokens, 1)
            return aux, checksum.attach_tokens(b"", digests)
        aux = checksum.attach(aux, checksum.head_digests(mgr.config.placement, mgr.layout.kv_ptrs, pages))
        if draft is None or config is None:
            return aux, b""
        return aux, checksum.attach(b"", checksum.head_digests(config.placement, draft.kv_ptrs, pages))

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        state = self._observe(self._pair.poll())
        if state == KVPoll.Success and self._started is not None:
            self._latency = time.perf_counter() - self._started
        return state

    def poll_pp_consensus(self) -> int:
        """SGLang's PP prefill polls its bootstrap queue here, on PP stage 0 only, and hands
        the result to the later stages: the lowest status of this request over every stage
        (a stage that has not reported it counts as Bootstrapping), so each stage has the
        decode's request when SGLang asks it for the decode's prefix and inits its sender."""
        own = self.poll()
        stages = self.kv_mgr.stage_status
        if stages is None or own in (KVPoll.Failed, KVPoll.Success):
            return own
        state, failed = stages.consensus(self.bootstrap_room, own)
        if failed:
            self._fail(f"PP stage {failed[0]} failed this request (its scheduler reports why)")
            return KVPoll.Failed
        return state

    def get_transfer_metric(self) -> KVTransferMetric:
        total = self._sender.bytes_sent + (self._draft.bytes_sent if self._draft is not None else 0)
        total += sum(sender.bytes_sent for _, sender in self._states)
        return KVTransferMetric(transfer_latency_s=self._latency, transfer_total_bytes=total)

    def clear(self) -> None:
        stages = self.kv_mgr.stage_status
        if stages is not None:
            stages.forget(self.bootstrap_room)
        super().clear()


class CPReplicaSender(KVXferKVSender):
    """The sender of a prefill attention-CP rank other than 0 (SGLang's dummy CP
    participant): CP rank 0 of the same attention-TP rank sends every page, so this one moves
    nothing. WaitingForInput at once, Success once its last chunk is handed over, Failed only
    when aborted or failed elsewhere (SGLang's poll consensus then fails it on every rank)."""

    def __init__(
        self,
        mgr: KVXferKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ):
        if not isinstance(mgr, KVXferKVManager) or not mgr.is_dummy_cp_rank:
            raise TypeError(f"mgr must be the KVXferKVManager of a prefill CP replica rank, got {mgr!r}")
        self._setup(bootstrap_room)
        self.kv_mgr = mgr
        self.bootstrap_server_url = bootstrap_addr
        self.num_kv_indices = None
        self.aux_index = None
        self.curr_idx = 0
        self._early_send_wait_event = None
        self._status = KVPoll.WaitingForInput

    def pop_decode_prefix_len(self) -> int:
        return 0  # the decode's request goes to CP rank 0 only

    def mark_prefill_complete(self) -> None:
        pass  # (CP rank 0 tells the decode; SGLang refuses prefill_complete with CP anyway)

    def send(
        self,
        kv_indices,
        state_indices: list | None = None,
        num_kv_tokens: int | None = None,
        indices_event: Synchronizable | None = None,
    ):
        self._early_send_wait_event = None
        if self.conclude_state is not None:
            return
        try:
            index_slice = self._chunk_slice(page_array(kv_indices))
            self.curr_idx = index_slice.stop
            if index_slice.stop == self.num_kv_indices:
                self.conclude_state = KVPoll.Success
        except Exception as exc:
            self._fail_from("send()", exc)

    def poll(self) -> int:
        return self.conclude_state if self.conclude_state is not None else self._status

    def get_transfer_metric(self) -> KVTransferMetric:
        return KVTransferMetric(transfer_latency_s=None, transfer_total_bytes=0)

    def clear(self) -> None:
        pass


@dataclass(frozen=True)
class _Rx:
    """One engine request of a decode request, with what its landing is checked against."""

    label: str
    rx: KVReceiver
    config: EngineConfig
    ptrs: tuple[int, ...]  # the buffers it lands in (K of its layers, then V)
    aux: bool  # the request's metadata slot comes with this part
    draft: bool = False  # the draft model's KV (the same page ids in its pool)
    cp: tuple[int, int] = (0, 1)  # (CP rank, CP size): the share of the pages it receives
    # the prefill's CP ranks hold the pages interleaved (--enable-kv-cache-sharding): this part
    # asks its CP rank for sparse writes into the whole page list, the writers name the pages
    sparse: bool = False

    def ask(self, pages: np.ndarray) -> np.ndarray:
        """The pages this part tells its writers: all (sparse writes pick theirs), or its
        prefill CP rank's share."""
        return pages if self.cp[1] == 1 or self.sparse else pages[cp_page_share(len(pages), *self.cp)]

    def share(self, pages: np.ndarray) -> np.ndarray:
        """The request's pages this part received: all, its prefill CP rank's share, or the
        pages its sparse writers named (once they are done)."""
        if self.sparse:
            return pages[self.rx.positions] if self.rx.positions is not None else pages[:0]
        return self.ask(pages)


class KVXferKVReceiver(_Request, BaseKVReceiver):
    """Decode side of one request."""

    def __init__(self, mgr: KVXferKVManager, bootstrap_addr: str, bootstrap_room: int | None = None):
        if not isinstance(mgr, KVXferKVManager) or mgr.role != "decode":
            raise TypeError(f"mgr must be a decode KVXferKVManager, got {mgr!r}")
        self._setup(bootstrap_room)
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.abort_notified = False
        self.require_staging = False  # SGLang's own staging buffers are not used
        self.bootstrap_infos = None  # read by SGLang only for deferred releases (not offered)
        self.aux_index: int | None = None
        self._inited = False
        self.prefill_dp_rank: int | None = None  # the prefill DP group, from init()
        self._dp_size = 1
        # The engine's requests, made by init() once the prefill DP group is known; empty
        # before that, or when the request failed first.
        self._rxs: list[_Rx] = []
        # one per state pool (per pool and PP stage on a decode of PP 1 facing stages), made by init()
        self._states: list[tuple[StatePool, str, KVReceiver]] = []
        self._sparse_states: set[str] = set()  # labels of the state parts a sharded prefill writes sparsely
        self._pages: np.ndarray | None = None  # this rank's pages of the request (KV checksum)
        self._state_rows: dict[str, np.ndarray] = {}  # each state pool's rows of the request (checksum)
        self._prefix = 0  # decode_prefix_len in tokens (a DCP rank's token phase, for the checksum)
        self.kv_checksum_heads = 0  # heads (of every part) whose checksum was compared on landing
        self.checksum_parts: dict[str, int] = {}  # the same, per part's label ("" the model's KV)
        try:
            parse_host_port(bootstrap_addr, "bootstrap_addr")
        except ValueError as exc:
            self._fail(str(exc))

    @property
    def _rx(self) -> KVReceiver:
        """The engine request that brings the metadata slot."""
        for part in self._rxs:
            if part.aux:
                return part.rx
        raise KVXferError(f"kvxfer room {self.bootstrap_room} has no engine request: {self._reason}")

    def init(self, prefill_dp_rank: int):
        """Route this request to prefill DP group ``prefill_dp_rank`` (SGLang's
        ``_resolve_prefill_dp_rank``: the router's rank, else ``bootstrap_room % dp_size``)
        and start the engine's requests against that group's ranks (one per PP stage on a
        decode of PP 1 facing a prefill of several)."""
        from sglang_kvxfer.engine import KVReceiver, bootstrap

        if self.conclude_state is not None or self._rxs:
            return
        mgr = self.kv_mgr
        info = mgr.prefill_info_table.get(self.bootstrap_addr)
        dp_size, groups = (info.dp_size, info.dp_groups) if info is not None else (1, (0,))
        if isinstance(prefill_dp_rank, bool) or not isinstance(prefill_dp_rank, (int, np.integer)):
            return self._fail(f"init(): prefill_dp_rank={prefill_dp_rank!r} must be an int")
        if not 0 <= prefill_dp_rank < dp_size:
            return self._fail(
                f"init(): prefill_dp_rank={prefill_dp_rank} names no DP group of the prefill at "
                f"{self.bootstrap_addr}: it registered dp_size={dp_size}, so ranks 0..{dp_size - 1} "
                f"(DP groups registered when this decode read its info: {list(groups)})"
            )
        self.prefill_dp_rank, self._dp_size = int(prefill_dp_rank), dp_size
        if info is not None and info.problem and not info.routable:
            self._tell_stages(info)  # no engine request can move the KV: the stages still hear why
            return self._fail(info.problem)
        try:
            cp, sparse = 1, info is not None and info.kv_sharded
            for part in mgr.receive_parts(self.bootstrap_addr, self.prefill_dp_rank):
                # prefill_complete: the part that brings the metadata slot waits for the prefill's
                # forward (SGLang allocates once poll() says WaitingForInput, and only then)
                watch = mgr.plan.prefill_complete and part.aux
                rx = KVReceiver(part.engine, self.bootstrap_room, part.address, watch_prefill=watch)
                self._rxs.append(_Rx(part.label, rx, part.config, part.ptrs, part.aux, cp=part.cp, sparse=sparse))
                cp = part.cp[1]
            draft, draft_config, draft_layout = mgr.decode_draft_engine, mgr.draft_config, mgr.layout.draft
            if draft is not None and draft_config is not None and draft_layout is not None:
                if not (info is not None and info.problem):
                    # the draft model's pool is the prefill's last PP stage's (SGLang runs the draft
                    # there); with every prefill CP rank sending, each sends its share of it too
                    last = max(info.pp_size, 1) - 1 if info is not None else 0
                    for c in range(cp):
                        group = bootstrap.group_address(self.bootstrap_addr, self.prefill_dp_rank, last, c)
                        rx = KVReceiver(mgr.cp_engine(c, draft=True)[0], self.bootstrap_room, group)
                        label = DRAFT if cp == 1 else f"{DRAFT} of CP rank {c}/{cp}"
                        self._rxs.append(
                            _Rx(
                                label,
                                rx,
                                draft_config,
                                draft_layout.kv_ptrs,
                                False,
                                draft=True,
                                cp=(c, cp),
                                sparse=sparse,
                            )
                        )
            if not (info is not None and info.problem):
                for state in mgr.state_parts(self.bootstrap_addr, self.prefill_dp_rank):
                    rx = KVReceiver(state.engine, self.bootstrap_room, state.address)
                    self._states.append((state.pool, state.label, rx))
                    if state.sparse:
                        self._sparse_states.add(state.label)
        except Exception as exc:
            if self._rxs:
                self._engine = self._parts()
            return self._fail_from("init()", exc)
        self._engine = self._parts()
        if info is not None and info.problem:  # after the engine's requests: their groups hear it
            return self._fail(info.problem)
        self._inited = True

    def _tell_stages(self, info) -> None:
        """An engine request toward PP stage 0 of the routed DP group of a prefill this decode
        refused (its stages known), failed at once by ``_fail``: it tells that stage's ranks the
        reason once they are known (they refuse this rank's registration, yet hear it), so the
        prefill fails the request with it instead of waiting out its bootstrap deadline. Stage 0
        decides the bootstrap for every stage of SGLang's PP prefill (``poll_pp_consensus``), so
        the later stages fail it with it. (A prefill that never registered has no one to tell.)"""
        from sglang_kvxfer.engine import KVReceiver, bootstrap

        if not info.pp_layers:
            return
        address = bootstrap.group_address(self.bootstrap_addr, int(self.prefill_dp_rank or 0), 0)
        try:
            rx = KVReceiver(self.kv_mgr.decode_engine, self.bootstrap_room, address)
        except Exception as exc:  # (best effort: the decode's own failure stands)
            log.warning("kvxfer room %d: could not tell PP stage 0 why: %s", self.bootstrap_room, exc)
            return
        self._rxs.append(_Rx("PP stage 0", rx, self.kv_mgr.config, (), False))
        self._engine = self._parts()

    def _parts(self) -> _Parts:
        parts: list[tuple[str, KVSender | KVReceiver]] = [(p.label, p.rx) for p in self._rxs]
        return _Parts(parts + [(label, rx) for _, label, rx in self._states])

    def failure_exception(self):
        try:
            super().failure_exception()
        except KVXferTransferError as exc:
            if self._dp_size > 1 and not exc.is_from_another_rank:  # name the group it was routed to
                raise KVXferTransferError(
                    self.bootstrap_room,
                    f"{exc.failure_reason} [prefill DP group {self.prefill_dp_rank} of dp_size={self._dp_size} "
                    f"at {self.bootstrap_addr}]",
                ) from None
            raise

    def send_metadata(
        self,
        kv_indices,
        aux_index: int | None = None,
        state_indices: list | None = None,
        decode_prefix_len: int | None = None,
        destination: Any = "device",
        **kwargs,
    ):
        """Tell the prefill writers where this request's KV goes. SGLang hands over whole
        pages (the last may be partial on both sides), so the engine moves
        ``len(kv_indices) * page_size`` token rows: both sides count the same pages. Every
        part (PP stage, draft pool) gets the same pages.

        ``decode_prefix_len`` (decode radix cache): the page-aligned prefix this decode
        already holds. ``kv_indices`` then cover only the tokens after it, the prefill learns
        the length through ``pop_decode_prefix_len`` and sends only those tokens' pages, so
        both page lists count from the same token.

        ``state_indices`` (one entry per ``state_types`` entry): where each state pool's rows
        go (SWA: the window's pages after the prefix; mamba: the request's slot), each pool's
        engine request told with its own indices."""
        if self.conclude_state is not None:
            return
        try:
            if str(getattr(destination, "value", destination)) != "device":
                raise ValueError(f"destination={destination!r}: only device KV destinations are supported")
            page_size = self.kv_mgr.layout.geometry.page_size
            prefix = prefix_tokens(decode_prefix_len, page_size, "decode")
            pages = page_array(kv_indices)
            state = state_pages(self.kv_mgr.layout.states, state_indices, pages)
            if kwargs:
                raise ValueError(f"unsupported argument(s) {sorted(kwargs)}")
            if aux_index is not None:
                self.kv_mgr.layout.aux.check_slot(aux_index)
            if not self._rxs:
                raise KVXferError(f"kvxfer room {self.bootstrap_room} has no engine request: {self._reason}")
            # --dcp-size N: kv_indices are pages of page_size * N tokens, of which this rank
            # holds every N-th token (phase: its DCP rank) in its page of page_size rows; the
            # draft pool is not split and has pages of page_size * N tokens. From a prefill of
            # DCP 1 this rank reads its tokens (token_stride N); from one of DCP N, whose
            # rank of the same DCP rank holds the same tokens, its rows page for page.
            dcp, dcp_rank = self.kv_mgr.dcp_size, self.kv_mgr.dcp_rank
            if prefix % (page_size * dcp):
                raise ValueError(
                    f"decode_prefix_len={decode_prefix_len} is not a whole number of DCP pages "
                    f"(page_size {page_size} x dcp_size {dcp})"
                )
            info = self.kv_mgr.prefill_info_table.get(self.bootstrap_addr)
            relayout = dcp > 1 and (info is None or info.dcp_size == 1)
            for part in self._rxs:  # the draft's: the same page ids in the draft model's pool
                slot = -1 if aux_index is None or part.draft else int(aux_index)
                stride = dcp if relayout and not part.draft else 1
                share = part.ask(pages)  # (num_tokens=0 for an empty share: the aux data only)
                part.rx.send_metadata(
                    share,
                    aux_slot=slot,
                    num_tokens=len(share) * page_size * (dcp if part.draft or relayout else 1),
                    prefix_tokens=prefix,
                    token_stride=stride,
                    token_phase=(dcp_rank - prefix) % stride,
                    sparse=part.sparse,
                )
            rows_of = {pool.name: rows for pool, rows in zip(self.kv_mgr.layout.states, state)}
            for pool, label, rx in self._states:  # the indices already skip the prefix; a pool's stages share them
                rows = rows_of[pool.name]
                rx.send_metadata(
                    rows,
                    aux_slot=-1,
                    num_tokens=len(rows) * pool.geometry.page_size,
                    prefix_tokens=0,
                    sparse=label in self._sparse_states,
                )
            self.aux_index, self._pages, self._state_rows, self._prefix = aux_index, pages, rows_of, prefix
        except Exception as exc:
            self._fail_from("send_metadata()", exc)

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        if not self._rxs or self._engine is None:
            return self._observe(KVPoll.Bootstrapping)  # init() has not routed it yet
        state = self._engine.poll()
        if state == KVPoll.Success and not self._landed():
            return KVPoll.Failed
        if not self._inited and state in (KVPoll.WaitingForInput, KVPoll.Transferring):
            state = KVPoll.Bootstrapping  # SGLang sends metadata only after init()
        if state == KVPoll.WaitingForInput and self.kv_mgr.plan.prefill_complete and not self._prefill_ready():
            state = KVPoll.Bootstrapping  # prefill_complete: SGLang allocates once this says WaitingForInput
        return self._observe(state)

    def _prefill_ready(self) -> bool:
        """prefill_complete: the prefill's forward of this request finished (every watched part)."""
        return all(part.rx.prefill_ready for part in self._rxs if part.aux)

    def _landed(self) -> bool:
        """Every writer of every part is done: verify the KV checksums (when on), then write
        the prefill's aux slot into ours, before Success is reported. False: it failed."""
        hook = seam("after_kv_landed")
        if hook is not None:
            hook(self)
        problem = self._sharded_coverage()
        if problem:
            self._fail(problem)
            return False
        try:
            problem = self._verify_checksums()
        except (ValueError, KVXferError) as exc:
            problem = f"KV checksum (--disaggregation-enable-kv-checksum): {exc}"
        if problem:
            self._fail(problem)
            return False
        return self._deliver_aux()

    def _state_part_rows(self, pool: StatePool, label: str, rx: KVReceiver) -> np.ndarray:
        """The rows of ``pool`` a state part received: all of the request's, or the ones its
        sparse writers named (a DSA indexer sharded like the KV)."""
        rows = self._state_rows[pool.name]
        if label not in self._sparse_states:
            return rows
        return rows[rx.positions] if rx.positions is not None else rows[:0]

    def _sharded_coverage(self) -> str:
        """Under --enable-kv-cache-sharding: why the pages the prefill's shard ranks named do
        not cover this rank's list once each, per pool ("" if they do). Each shard rank wrote
        the pages it holds; together they must be the request."""
        if self._pages is None:
            return ""
        groups: list[tuple[str, int, list[tuple[str, KVReceiver]]]] = []
        # the shards of one pool's layers land in the same buffers (a PP stage's, on a decode
        # of PP 1 facing several: each stage's shards cover the pages apart)
        by_buffers: dict[tuple[bool, tuple[int, ...]], list[_Rx]] = {}
        for p in self._rxs:
            if p.sparse:
                by_buffers.setdefault((p.draft, p.ptrs), []).append(p)
        for (draft, _), rxs in by_buffers.items():
            parts = [(p.label, p.rx) for p in rxs]
            groups.append((DRAFT if draft else "model KV", len(self._pages), parts))
        for pool in self.kv_mgr.layout.states:
            parts = [(label, rx) for q, label, rx in self._states if q is pool and label in self._sparse_states]
            groups.append((pool.label, len(self._state_rows.get(pool.name, ())), parts))
        for what, n, parts in groups:
            if not parts:
                continue
            named = [rx.positions if rx.positions is not None else np.zeros(0, np.int64) for _, rx in parts]
            counts = np.bincount(np.concatenate(named).astype(np.int64), minlength=n)[:n]
            if (counts != 1).any():
                missing, twice = np.flatnonzero(counts == 0), np.flatnonzero(counts > 1)
                by = ", ".join(f"{label}: {len(x)}" for (label, _), x in zip(parts, named))
                return (
                    f"the prefill's KV cache shards (--enable-kv-cache-sharding) named {sum(map(len, named))} of this "
                    f"rank's {n} pages of the {what} ({by}); positions {missing[:8].tolist()} came from no shard, "
                    f"{twice[:8].tolist()} from more than one"
                )
        return ""

    def _verify_checksums(self) -> str:
        """Why the landed KV differs from what its writers digested ("" if it does not, or
        when no digests are expected or came)."""
        mgr = self.kv_mgr
        if not mgr.kv_checksum or not self._rxs or self._pages is None:
            return ""
        parts = [(p.label, p.rx, p.config.placement, p.ptrs, p.share(self._pages)) for p in self._rxs]
        # state pools: each engine's own placement and (on a decode of PP 1, sliced) buffers
        parts += [
            (label, rx, rx.mgr.placement, _buffer_ptrs(rx.mgr), self._state_part_rows(pool, label, rx))
            for pool, label, rx in self._states
        ]
        for label, rx, placement, ptrs, rows in parts:
            sent = {p: checksum.detach(b)[0] for p, b in rx.writer_aux.items()}
            if all(d is None for d in sent.values()):
                if self.bootstrap_addr not in mgr._unverified:
                    mgr._unverified.add(self.bootstrap_addr)
                    log.warning(
                        "kvxfer: the prefill at %s sends no KV checksums (its pools are not CPU memory, or it "
                        "runs without --disaggregation-enable-kv-checksum): its requests are not verified",
                        self.bootstrap_addr,
                    )
                return ""
            writers: dict[int, Mapping[int, int] | None]
            if any(isinstance(d, checksum.TokenDigests) for d in sent.values()):
                # toward this rank's DCP tokens: the writers' digests of its phase over its rows
                writers, mine = self._token_digests(label, sent, placement, ptrs, rows)
            else:
                writers = {p: d for p, d in sent.items() if not isinstance(d, checksum.TokenDigests)}
                mine = checksum.head_digests(placement, ptrs, rows)
            compared = sum(len(set(d) & set(mine)) for d in writers.values() if d is not None)
            self.kv_checksum_heads += compared
            self.checksum_parts[label] = self.checksum_parts.get(label, 0) + compared
            bad = checksum.mismatches(writers, mine)
            if bad:
                rank, head, theirs, ours = bad[0]
                more = f"; {len(bad)} heads differ" if len(bad) > 1 else ""
                where = f" in the {label}" if label else ""
                return (
                    f"KV checksum mismatch (--disaggregation-enable-kv-checksum){where}: "
                    f"KV head {head} written by prefill rank {rank}: prefill crc32={theirs:#010x}, decode "
                    f"crc32={ours:#010x} (the KV that landed on decode rank {mgr.layout.tp_rank} is not what the "
                    f"prefill sent){more}"
                )
        return ""

    def _token_digests(
        self, label: str, writers: Mapping[int, Any], placement, ptrs, pages
    ) -> tuple[dict[int, Mapping[int, int] | None], dict[int, int]]:
        """``(each writer's digests of this rank's tokens, this rank's)`` of a part whose writers
        digested token phases (toward a decode with ``--dcp-size``): the model's KV holds the
        tokens of this rank's phase, the draft model's every token (stride 1)."""
        mgr, where = self.kv_mgr, f" of the {label}" if label else ""
        first = next(d for d in writers.values() if isinstance(d, checksum.TokenDigests))
        phase = (mgr.dcp_rank - self._prefix) % first.stride
        out: dict[int, Mapping[int, int] | None] = {}
        for rank, d in writers.items():
            if not isinstance(d, checksum.TokenDigests) or (d.tokens, d.stride) != (first.tokens, first.stride):
                did = "whole pages" if d is not None else "nothing"
                if isinstance(d, checksum.TokenDigests):
                    did = f"{d.tokens} tokens with stride {d.stride}"
                raise ValueError(
                    f"prefill rank {rank} digested {did}{where}, another of its writers {first.tokens} tokens "
                    f"with stride {first.stride}: the writers of one part must agree"
                )
            out[rank] = d.of_phase(phase)
        if first.stride not in (1, mgr.dcp_size):
            raise ValueError(
                f"the prefill digested{where} token stride {first.stride}, this decode rank holds every "
                f"{mgr.dcp_size}-th token (--dcp-size={mgr.dcp_size})"
            )
        return out, checksum.phase_digests(placement, ptrs, pages, first, phase)

    def _deliver_aux(self) -> bool:
        """Write the prefill's aux slot into ours before Success is reported."""
        if self.aux_index is None:
            return True
        try:
            _, payload = checksum.detach(self._rx.aux_payload)
            if not payload:
                raise ValueError("the prefill sent no aux data")
            self.kv_mgr.layout.aux.write(self.aux_index, payload)
        except ValueError as exc:
            self._fail(f"aux slot {self.aux_index}: {exc}")
            return False
        return True

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """Tell the prefill ranks once (the engine already did if the request failed)."""
        if not self.abort_notified:
            self.abort_notified = True
            self._fail("aborted by the decode scheduler")

    def abort(self) -> None:
        self.abort_notified = True
        super().abort()
