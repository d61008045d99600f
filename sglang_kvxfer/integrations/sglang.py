"""SGLang's KV transfer backend interface, implemented on this engine.

Owns ``KVXferKVManager``, ``KVXferKVSender``, ``KVXferKVReceiver`` and
``KVXferKVBootstrapServer``: subclasses of SGLang's real base classes
(``sglang.srt.disaggregation.base.conn``) that SGLang's prefill and decode event loops drive
exactly as they drive mooncake or mori. Each SGLang rank's
manager wraps one engine ``PrefillManager``/``DecodeManager`` over SGLang's own KV pool
memory (no copy); senders and receivers wrap the engine's ``KVSender``/``KVReceiver``.

SGLang's contract kept here: polls return ``KVPoll`` ints, move forward only, and
``Failed`` is terminal; ``failure_exception()`` raises an error with ``failure_reason`` and
``is_from_another_rank``; a bad call from the scheduler fails that request with the reason
instead of raising into the event loop; on the decode side the aux (metadata) slot is
written before ``Success`` is reported, so SGLang's metadata gate sees the request's
``bootstrap_room``. KVArgs/ServerArgs translation lives in ``sglang_args``; the backend
lookup patch in ``sglang_install``. Importing this module imports SGLang's base module.

Attention DP (``--enable-dp-attention``): every prefill DP group registers with the one
bootstrap under its DP rank; a decode rank learns the groups with the parallel info, and a
receiver routed to DP group N (SGLang's rule: the router's ``data_parallel_rank``, else
``bootstrap_room % dp_size``) plans against that group only, known to the engine as a prefill
group of its own (``bootstrap.group_address``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from sglang_kvxfer import envs
from sglang_kvxfer.engine.config import EngineConfig, parse_host_port
from sglang_kvxfer.errors import KVXferError, TransferFailedError, TransportUnavailableError
from sglang_kvxfer.integrations.sglang_args import (
    SglangLayout,
    kv_dtype,
    layout_from_kv_args,
    nic_list,
    plan_from_server_args,
)

try:
    from sglang.srt.disaggregation.base.conn import (
        BaseKVBootstrapServer,
        BaseKVManager,
        BaseKVReceiver,
        BaseKVSender,
        KVArgs,
        KVPoll,
        KVTransferMetric,
    )
except ImportError as exc:  # pragma: no cover - exercised in a process without sglang
    raise TransportUnavailableError(
        f"sglang_kvxfer.integrations.sglang needs SGLang's disaggregation base classes, which "
        f"do not import here ({type(exc).__name__}: {exc}); pip install 'sglang==0.5.23' "
        "(or pip install 'sglang_kvxfer[sglang]')"
    ) from exc

__all__ = [
    "KVXferKVManager",
    "KVXferKVSender",
    "KVXferKVReceiver",
    "KVXferKVBootstrapServer",
    "KVXferTransferError",
    "PrefillInfo",
]

if TYPE_CHECKING:
    from sglang_kvxfer.engine import KVReceiver, KVSender
    from sglang_kvxfer.engine.decode import DecodeManager
    from sglang_kvxfer.engine.manager import RankBase
    from sglang_kvxfer.engine.prefill import PrefillManager

log = logging.getLogger("sglang_kvxfer.sglang")


class _Synchronizable(Protocol):
    """What SGLang passes as ``indices_event`` (a ``torch.cuda.Event``)."""

    def synchronize(self) -> None: ...


class KVXferTransferError(TransferFailedError):
    """What ``failure_exception()`` raises; SGLang's scheduler reads ``failure_reason`` and
    ``is_from_another_rank`` (a failure seen only through the TP all-reduce)."""

    def __init__(self, bootstrap_room: int, failure_reason: str, is_from_another_rank: bool = False):
        super().__init__(failure_reason, bootstrap_room)
        self.bootstrap_room = bootstrap_room
        self.failure_reason = failure_reason
        self.is_from_another_rank = is_from_another_rank


@dataclass(frozen=True)
class PrefillInfo:
    """What SGLang's decode scheduler reads from ``kv_manager.prefill_info_table[addr]``."""

    attn_tp_size: int
    dp_size: int = 1  # prefill attention-DP groups behind the bootstrap
    # The decode picks a request's DP group as bootstrap_room % dp_size: a kvxfer prefill
    # refuses any other load balancing (sglang_args), so this is always True.
    follow_bootstrap_room: bool = True
    problem: str = ""  # why requests to this prefill cannot work ("" if they can)
    dp_groups: tuple[int, ...] = (0,)  # the DP groups registered when this was read


def _role(mode: Any) -> str:
    value = str(getattr(mode, "value", mode)).lower()
    if value not in ("prefill", "decode"):
        raise ValueError(f"disaggregation_mode={mode!r} must be PREFILL or DECODE")
    return value


def _page_array(indices: Any, name: str = "kv_indices") -> np.ndarray:
    """SGLang's page indices (numpy int32, or a CPU tensor) as int64."""
    if hasattr(indices, "cpu"):
        indices = indices.cpu().numpy()
    arr = np.asarray(indices)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _sglang_timeout(ours: envs.EnvVar, theirs: str) -> float | None:
    """A deadline from SGLang's env var when ours is not set (ours wins)."""
    if ours.is_set():
        return None
    raw = os.environ.get(theirs, "").strip()
    try:
        return float(raw) if raw else 300.0  # SGLang's default for both
    except ValueError:
        raise ValueError(f"environment variable {theirs}={raw!r} is not a number") from None


def _local_host() -> str:
    """The address peers reach this rank's control inbox at: SGLang's own choice
    (``SGLANG_HOST_IP``, then the NICs), as its backends advertise ``rank_ip``."""
    try:
        from sglang.srt.utils.network import get_local_ip_auto
    except ImportError:
        return "127.0.0.1"
    return get_local_ip_auto("127.0.0.1")


def _transport(device: str, ib_device: str, gpu_id: int) -> str:
    """``KVXFER_SGLANG_TRANSPORT``, or for ``auto``: CPU pools -> ``local``; GPU pools ->
    ``mori``, else ``nixl``, whichever is installed. ``--disaggregation-ib-device`` becomes the
    RDMA library's NIC list, as SGLang's own mori backend does."""
    from sglang_kvxfer.transports import available_transports

    name = envs.KVXFER_SGLANG_TRANSPORT.get()
    if name == "auto":
        if device == "cpu":
            name = "local"
        else:
            rdma = [t for t in ("mori", "nixl") if t in available_transports()]
            if not rdma:
                raise TransportUnavailableError(
                    "SGLang's KV pool is GPU memory, and no GPU transport that registers raw device "
                    "memory (mori or nixl) is installed here; install one (pip install "
                    "'sglang_kvxfer[nixl]' or '[mori]') or set KVXFER_SGLANG_TRANSPORT"
                )
            name = rdma[0]
    nics = nic_list(ib_device, gpu_id)
    if nics and name == "mori":
        os.environ.setdefault("MORI_RDMA_DEVICES", ",".join(nics))
    elif nics and name == "nixl":
        os.environ.setdefault("UCX_NET_DEVICES", ",".join(n if ":" in n else f"{n}:1" for n in nics))
    return name


def _resolved(server_args: Any) -> Any:
    """``server_args`` as SGLang's resolution decided them (``--enable-dp-attention`` becomes
    ``attn_dp_size``, ``load_balance_method=auto`` a method): the running server's schedulers
    receive the record with the declarations beside the fields."""
    try:
        from sglang.srt.arg_groups.model_override_base import resolving_view
    except ImportError:
        return server_args
    return resolving_view(server_args)


def _model_total_kv_heads(server_args: Any) -> int:
    """The model's un-sharded KV head count, read as SGLang's scheduler reads it."""
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig.from_server_args(server_args).get_total_num_kv_heads()


class KVXferKVManager(BaseKVManager):
    """One SGLang rank's transfer manager: an engine manager over SGLang's KV pool."""

    supports_host_destination = False

    def __init__(self, args: KVArgs, disaggregation_mode: Any, server_args: Any, is_mla_backend: bool | None = False):
        from sglang_kvxfer.engine import KVManager, KVPool

        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.role = _role(disaggregation_mode)
        self.plan = plan_from_server_args(_resolved(server_args), self.role)
        if self.role == "decode" and os.environ.get(
            "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK", ""
        ).strip().lower() in ("1", "true", "yes", "on"):
            raise KVXferError(
                "the kvxfer transfer backend does not support SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK: "
                "its bootstrap has no per-request DP rank registry; the decode routes by the router's "
                "data_parallel_rank or bootstrap_room % dp_size"
            )
        dtype = kv_dtype(getattr(args, "kv_cache_dtype_str", None), getattr(server_args, "dtype", None))
        self.layout: SglangLayout = layout_from_kv_args(
            args,
            tp_size=self.plan.attn_tp_size,
            mla=self.is_mla_backend,
            dtype=dtype,
            total_kv_heads=lambda: _model_total_kv_heads(server_args),
        )
        if self.layout.num_draft_entries:
            log.warning(
                "kvxfer: the %d draft-model KV entries (speculative decoding) are not "
                "transferred; the decode's draft KV for the prompt is not filled",
                self.layout.num_draft_entries,
            )
        gpu_id = int(getattr(args, "gpu_id", 0) or 0)
        device = "cpu" if self.plan.device == "cpu" else f"cuda:{gpu_id}"
        # SGLang's deadlines where ours are not set (None: ours, as EngineConfig's defaults read them)
        bootstrap_s = _sglang_timeout(envs.KVXFER_BOOTSTRAP_TIMEOUT_S, "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT")
        waiting_s = _sglang_timeout(envs.KVXFER_WAITING_TIMEOUT_S, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT")
        lay = self.layout
        self.dp_rank = self.plan.dp_rank(int(args.engine_rank))
        self.config = EngineConfig(
            self.role,
            lay.geometry,
            lay.tp_size,
            lay.tp_rank,
            self.plan.bootstrap,
            transport=_transport(device, self.plan.ib_device, gpu_id),
            host=_local_host(),
            device=device,
            bootstrap_timeout_s=envs.KVXFER_BOOTSTRAP_TIMEOUT_S.get() if bootstrap_s is None else bootstrap_s,
            waiting_timeout_s=envs.KVXFER_WAITING_TIMEOUT_S.get() if waiting_s is None else waiting_s,
            dp_rank=self.dp_rank,
            dp_size=self.plan.attn_dp_size if self.role == "prefill" else 1,
        )
        pool = KVPool.from_pointers(self.config.placement, lay.kv_ptrs, lay.kv_lens, device)
        self.engine: RankBase = KVManager(self.config, pool)
        self.prefill_info_table: dict[str, PrefillInfo] = {}
        dp = self.plan.attn_dp_size
        where = f" of DP group {self.dp_rank}/{dp}" if self.role == "prefill" else f" (attention DP {dp})"
        log.info(
            "kvxfer %s rank %d/%d%s: %s over %s",
            self.role,
            lay.tp_rank,
            lay.tp_size,
            where if dp > 1 else "",
            lay.geometry,
            self.config.transport,
        )

    @property
    def prefill_engine(self) -> PrefillManager:
        """``engine`` of a prefill manager (TypeError on a decode one)."""
        from sglang_kvxfer.engine.prefill import PrefillManager

        engine = self.engine
        if not isinstance(engine, PrefillManager):
            raise TypeError(f"the kvxfer {self.role} manager has no prefill engine")
        return engine

    @property
    def decode_engine(self) -> DecodeManager:
        """``engine`` of a decode manager (TypeError on a prefill one)."""
        from sglang_kvxfer.engine.decode import DecodeManager

        engine = self.engine
        if not isinstance(engine, DecodeManager):
            raise TypeError(f"the kvxfer {self.role} manager has no decode engine")
        return engine

    def register_to_bootstrap(self) -> None:
        """Prefill: wait until this rank is registered with the bootstrap (the engine
        registers in the background from construction); raise if that failed or timed out.
        Decode: nothing to register."""
        if self.role == "prefill":
            self.prefill_engine.wait_registered(self.config.bootstrap_timeout_s)

    # -- what SGLang's decode scheduler calls beyond the base class ------------------------------
    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Non-blocking: True once the prefill group at ``bootstrap_addr`` is known (or its
        lookup failed: the requests then fail with the reason)."""
        if self.role != "decode":
            raise ValueError("try_ensure_parallel_info() is a decode-side call")
        try:
            parse_host_port(bootstrap_addr, "bootstrap_addr")
        except ValueError:
            return False
        status, _, tp_size, geometry = self.decode_engine.prefill_group_status(bootstrap_addr)
        if status not in ("ready", "failed"):
            return False
        dp_size = 1
        dp_groups: tuple[int, ...] = (0,)  # a prefill without attention DP
        if status == "ready":  # DP group 0 is registered: ask how many groups there are
            try:
                dp_size, dp_groups = self._prefill_dp_groups(bootstrap_addr)
            except KVXferError as exc:
                log.warning("kvxfer: the DP groups behind bootstrap %s: %s (asking again)", bootstrap_addr, exc)
                return False
        problem = ""
        ours = self.layout.geometry.page_size
        if geometry is not None and geometry.page_size != ours:
            # The scheduler counts whole pages on both sides (as SGLang's own backends
            # require): the page sizes must agree.
            problem = (
                f"page_size: prefill={geometry.page_size} decode={ours} (start both servers with the same --page-size)"
            )
        self.prefill_info_table[bootstrap_addr] = PrefillInfo(
            attn_tp_size=tp_size, dp_size=dp_size, problem=problem, dp_groups=dp_groups
        )
        return True

    def _prefill_dp_groups(self, bootstrap_addr: str) -> tuple[int, tuple[int, ...]]:
        """``(dp_size, registered DP groups)`` of the prefill behind ``bootstrap_addr``: one
        query (the bootstrap just answered this rank's engine), under a session of its own."""
        from sglang_kvxfer.engine import bootstrap
        from sglang_kvxfer.protocol.messages import BootstrapQuery

        eng = self.decode_engine
        query = BootstrapQuery(session=f"{eng.session}.dp", tp_rank=eng.tp_rank)
        reply = bootstrap.request(bootstrap_addr, query, timeout_s=2.0, key=self.config.key)
        return max(reply.dp_size, 1), tuple(reply.dp_groups) or (0,)

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        # A decode rank of another TP width receives a slice of what the prefill digested.
        info = self.prefill_info_table.get(bootstrap_addr)
        return info is not None and info.attn_tp_size == self.layout.tp_size

    def submit_prefill_recompute(self, receiver: KVXferKVReceiver, payload: Any = None) -> None:
        receiver._fail(
            "PD retraction with prefill recompute (rebootstrap) is not supported by the kvxfer transfer backend"
        )

    def close(self) -> None:
        """Stop the engine manager (threads, sockets, registrations). Idempotent."""
        self.engine.close()


class _Request:
    """What a sender and a receiver share: the monotonic status and the failure record."""

    def _setup(self, room: Any) -> None:
        if isinstance(room, bool) or not isinstance(room, (int, np.integer)):
            raise ValueError(f"bootstrap_room={room!r} must be an int")
        self.bootstrap_room = int(room)
        self.conclude_state: int | None = None
        self._status = KVPoll.Bootstrapping
        self._reason: str | None = None
        self._engine: KVSender | KVReceiver | None = None  # the engine's request, once made

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


def _prefix_tokens(value: Any, page_size: int, side: str) -> int:
    """``decode_prefix_len`` checked: an int >= 0 that is a whole number of ``side``'s pages."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"decode_prefix_len={value!r} must be an int >= 0")
    if value % page_size:
        raise ValueError(
            f"decode_prefix_len={value} is not a whole number of {side} pages (page_size={page_size}); "
            "prefill and decode page lists must start at the same token"
        )
    return int(value)


class KVXferKVSender(_Request, BaseKVSender):
    """Prefill side of one request."""

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
        self._engine = self._sender = KVSender(mgr.prefill_engine, self.bootstrap_room)
        dp_size = mgr.plan.attn_dp_size
        if dp_size > 1 and not req_has_disagg_prefill_dp_rank and self.bootstrap_room % dp_size != mgr.dp_rank:
            # The decode looks for this request in DP group bootstrap_room % dp_size
            # (SGLang's follow_bootstrap_room); serving it here would never be found.
            self._fail(
                f"prefill DP group {mgr.dp_rank} was given bootstrap_room={self.bootstrap_room}, which "
                f"follow_bootstrap_room routes to DP group {self.bootstrap_room % dp_size} "
                f"(bootstrap_room % dp_size, dp_size={dp_size}); the decode looks for it there"
            )

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

    def pop_decode_prefix_len(self) -> int:
        """The prefix the decode already holds (0 without a decode radix cache). SGLang asks
        once the poll reached WaitingForInput, before ``init``: by then every decode rank's
        request has arrived. A length this prefill cannot page-align fails the request."""
        try:
            prefix = self._sender.decode_prefix_tokens
            if prefix is None:
                raise ValueError("asked before the decode's request arrived (poll is not WaitingForInput)")
            return _prefix_tokens(prefix, self.kv_mgr.layout.geometry.page_size, "prefill")
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
        indices_event: _Synchronizable | None = None,
    ):
        """Hand over the next chunk of pages. The chunk covers the decode page list slice
        ``[curr_idx, curr_idx + len(kv_indices))`` (SGLang's ``index_slice``); the one that
        reaches ``num_kv_indices`` is the last and carries the aux slot."""
        wait, self._early_send_wait_event = self._early_send_wait_event, None
        if self.conclude_state is not None:
            return
        try:
            if indices_event is not None:
                indices_event.synchronize()  # the D2H copy of the indices must have landed
            pages = _page_array(kv_indices)
            if self.num_kv_indices is None:
                raise ValueError("send() came before init()")
            index_slice = slice(self.curr_idx, self.curr_idx + len(pages))
            if index_slice.stop > self.num_kv_indices:
                raise ValueError(
                    f"pages [{index_slice.start}, {index_slice.stop}) run past "
                    f"num_kv_indices={self.num_kv_indices} given to init()"
                )
            if state_indices and any(s is not None and len(s) for s in state_indices):
                raise ValueError("state_indices were given, but this backend transfers no per-request state")
            last = index_slice.stop == self.num_kv_indices
            aux = self.kv_mgr.layout.aux.read(self.aux_index) if last and self.aux_index is not None else b""
            self._started = self._started or time.perf_counter()
            self._sender.send(pages, last_chunk=last, aux=aux, ready=wait)
            self.curr_idx = index_slice.stop
        except Exception as exc:
            self._fail_from("send()", exc)

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        state = self._observe(int(self._sender.poll()))
        if state == KVPoll.Success and self._started is not None:
            self._latency = time.perf_counter() - self._started
        return state

    def get_transfer_metric(self) -> KVTransferMetric:
        return KVTransferMetric(transfer_latency_s=self._latency, transfer_total_bytes=self._sender.bytes_sent)


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
        # The engine's request is made by init(), once the prefill DP group is known; None
        # before that, or when the request failed first.
        self._receiver: KVReceiver | None = None
        try:
            parse_host_port(bootstrap_addr, "bootstrap_addr")
        except ValueError as exc:
            self._fail(str(exc))

    @property
    def _rx(self) -> KVReceiver:
        rx = self._receiver
        if rx is None:
            raise KVXferError(f"kvxfer room {self.bootstrap_room} has no engine request: {self._reason}")
        return rx

    def init(self, prefill_dp_rank: int):
        """Route this request to prefill DP group ``prefill_dp_rank`` (SGLang's
        ``_resolve_prefill_dp_rank``: the router's rank, else ``bootstrap_room % dp_size``)
        and start the engine's request against that group's ranks."""
        from sglang_kvxfer.engine import KVReceiver, bootstrap

        if self.conclude_state is not None or self._receiver is not None:
            return
        info = self.kv_mgr.prefill_info_table.get(self.bootstrap_addr)
        dp_size, groups = (info.dp_size, info.dp_groups) if info is not None else (1, (0,))
        if isinstance(prefill_dp_rank, bool) or not isinstance(prefill_dp_rank, (int, np.integer)):
            return self._fail(f"init(): prefill_dp_rank={prefill_dp_rank!r} must be an int")
        if not 0 <= prefill_dp_rank < dp_size:
            return self._fail(
                f"init(): prefill_dp_rank={prefill_dp_rank} names no DP group of the prefill at "
                f"{self.bootstrap_addr}: it registered dp_size={dp_size} (DP groups {list(groups)})"
            )
        self.prefill_dp_rank, self._dp_size = int(prefill_dp_rank), dp_size
        try:
            group = bootstrap.group_address(self.bootstrap_addr, self.prefill_dp_rank)
            self._engine = self._receiver = KVReceiver(self.kv_mgr.decode_engine, self.bootstrap_room, group)
        except Exception as exc:
            return self._fail_from("init()", exc)
        if info is not None and info.problem:  # after the engine's request: its group hears it
            return self._fail(info.problem)
        self._inited = True

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
        ``len(kv_indices) * page_size`` token rows: both sides count the same pages.

        ``decode_prefix_len`` (decode radix cache): the page-aligned prefix this decode
        already holds. ``kv_indices`` then cover only the tokens after it, the prefill learns
        the length through ``pop_decode_prefix_len`` and sends only those tokens' pages, so
        both page lists count from the same token."""
        if self.conclude_state is not None:
            return
        try:
            if str(getattr(destination, "value", destination)) != "device":
                raise ValueError(f"destination={destination!r}: only device KV destinations are supported")
            prefix = _prefix_tokens(decode_prefix_len, self.kv_mgr.layout.geometry.page_size, "decode")
            if state_indices and any(s is not None and len(s) for s in state_indices):
                raise ValueError("state_indices were given, but this backend transfers no per-request state")
            if kwargs:
                raise ValueError(f"unsupported argument(s) {sorted(kwargs)}")
            if aux_index is not None:
                self.kv_mgr.layout.aux.check_slot(aux_index)
            pages = _page_array(kv_indices)
            page_size = self.kv_mgr.layout.geometry.page_size
            self._rx.send_metadata(
                pages,
                aux_slot=-1 if aux_index is None else int(aux_index),
                num_tokens=len(pages) * page_size,
                prefix_tokens=prefix,
            )
            self.aux_index = aux_index
        except Exception as exc:
            self._fail_from("send_metadata()", exc)

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        if self._receiver is None:
            return self._observe(KVPoll.Bootstrapping)  # init() has not routed it yet
        state = int(self._rx.poll())
        if state == KVPoll.Success and not self._deliver_aux():
            return KVPoll.Failed
        if not self._inited and state in (KVPoll.WaitingForInput, KVPoll.Transferring):
            state = KVPoll.Bootstrapping  # SGLang sends metadata only after init()
        return self._observe(state)

    def _deliver_aux(self) -> bool:
        """Write the prefill's aux slot into ours before Success is reported."""
        if self.aux_index is None:
            return True
        payload = self._rx.aux_payload
        try:
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


class KVXferKVBootstrapServer(BaseKVBootstrapServer):
    """SGLang starts one on the prefill node at ``--disaggregation-bootstrap-port``; the
    prefill ranks register there and decode ranks look them up (IPv4)."""

    def __init__(self, host: str, port: int):
        from sglang_kvxfer.engine import BootstrapServer

        self.host, self.port = host, port
        bind = "0.0.0.0" if host in ("", "0.0.0.0", "::", "*") else host
        self.server = BootstrapServer(bind, int(port))

    def close(self) -> None:
        self.server.close()
