"""What the modules of the SGLang backend share: SGLang's base classes, the failure type,
the parallel info a decode scheduler reads, and small helpers.

Owns the import of SGLang's base module (``sglang.srt.disaggregation.base.conn``; without it
this raises ``TransportUnavailableError`` naming the package to install),
``KVXferTransferError``, ``PrefillInfo``, the translation of SGLang's environment and server
arguments this backend reads at run time (deadlines, the advertised address, the transport,
the model's, its SWA layers' and the draft model's KV heads), the draft-pool comparison, the CPU checksum
hand-over, and ``seam``: how the other modules find the test seams that tests replace on the
public module ``integrations.sglang``. Must not build managers or requests (``sglang_manager``,
``sglang_requests``).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from sglang_kvxfer import envs
from sglang_kvxfer.errors import TransferFailedError, TransportUnavailableError
from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.integrations.sglang_args import nic_list

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
    "BaseKVBootstrapServer",
    "BaseKVManager",
    "BaseKVReceiver",
    "BaseKVSender",
    "KVArgs",
    "KVPoll",
    "KVTransferMetric",
    "KVXferTransferError",
    "PrefillInfo",
    "DRAFT",
    "log",
    "seam",
]

log = logging.getLogger("sglang_kvxfer.sglang")

DRAFT = "draft-model KV (speculative decoding)"
PUBLIC_MODULE = "sglang_kvxfer.integrations.sglang"


def seam(name: str) -> Any:
    """The attribute ``name`` of the public module ``integrations.sglang``, read at call time:
    the hooks tests replace there (the model's head count, the draft model's config, the PP
    group's exchange, ``after_kv_landed``) reach the modules that call them."""
    return getattr(sys.modules[PUBLIC_MODULE], name)


class Synchronizable(Protocol):
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
    # True: SGLang's decode picks a request's DP group as bootstrap_room % dp_size; False
    # (the prefill's load balancer places requests): it asks ``query_prefill_dp_ranks``
    follow_bootstrap_room: bool = True
    problem: str = ""  # why requests to this prefill cannot work ("" if they can)
    dp_groups: tuple[int, ...] = (0,)  # the DP groups registered when this was read
    draft_geometry: KVGeometry | None = None  # the prefill's draft-model pool (None: none)
    pp_size: int = 1  # the prefill's pipeline-parallel stages
    # the layers of each prefill PP stage, in stage order (one range without PP)
    pp_layers: tuple[range, ...] = ()
    # False when ``problem`` is about the prefill's stages themselves (unknown, refused by the
    # PP rule, not tiling this decode's layers): no engine request can be made toward them
    routable: bool = True
    state_pools: tuple[str, ...] = ()  # the prefill's extra per-request state pools (sglang_state)
    prefill_http_port: int | None = None  # the prefill server's --port (PD retraction's recompute)
    dcp_size: int = 1  # the prefill's --dcp-size (1, or this decode's: page for page)
    # the prefill's ranks hold every KV head and each sends those of its TP rank
    # (--enable-cp-tp-group-sharing): a rank's digest covers more than its TP rank's heads
    all_heads: bool = False
    # the prefill's CP ranks hold a request's pages interleaved (--enable-kv-cache-sharding):
    # each writes those it holds at the positions it names, into this rank's whole page list
    kv_sharded: bool = False


def role_of(mode: Any) -> str:
    value = str(getattr(mode, "value", mode)).lower()
    if value not in ("prefill", "decode"):
        raise ValueError(f"disaggregation_mode={mode!r} must be PREFILL or DECODE")
    return value


def page_array(indices: Any, name: str = "kv_indices") -> np.ndarray:
    """SGLang's page indices (numpy int32, or a CPU tensor) as int64."""
    if hasattr(indices, "cpu"):
        indices = indices.cpu().numpy()
    arr = np.asarray(indices)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def prefix_tokens(value: Any, page_size: int, side: str) -> int:
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


def sglang_timeout(ours: envs.EnvVar, theirs: str) -> float | None:
    """A deadline from SGLang's env var when ours is not set (ours wins)."""
    if ours.is_set():
        return None
    raw = os.environ.get(theirs, "").strip()
    try:
        return float(raw) if raw else 300.0  # SGLang's default for both
    except ValueError:
        raise ValueError(f"environment variable {theirs}={raw!r} is not a number") from None


def local_host() -> str:
    """The address peers reach this rank's control inbox at: SGLang's own choice
    (``SGLANG_HOST_IP``, then the NICs), as its backends advertise ``rank_ip``."""
    try:
        from sglang.srt.utils.network import get_local_ip_auto
    except ImportError:
        return "127.0.0.1"
    return get_local_ip_auto("127.0.0.1")


def transport_name(device: str, ib_device: str, gpu_id: int) -> str:
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


def resolved(server_args: Any) -> Any:
    """``server_args`` as SGLang's resolution decided them (``--enable-dp-attention`` becomes
    ``attn_dp_size``, ``load_balance_method=auto`` a method): the running server's schedulers
    receive the record with the declarations beside the fields."""
    try:
        from sglang.srt.arg_groups.model_override_base import resolving_view
    except ImportError:
        return server_args
    return resolving_view(server_args)


def model_total_kv_heads(server_args: Any) -> int:
    """The model's un-sharded KV head count, read as SGLang's scheduler reads it."""
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig.from_server_args(server_args).get_total_num_kv_heads()


def model_swa_kv_heads(server_args: Any) -> int:
    """The un-sharded KV head count SGLang sizes a hybrid model's SWA sub-pool with (its
    ``kv_cache_configurator``: ``swa_num_key_value_heads`` for the models it builds with their
    own SWA heads, ``is_hybrid_swa_compress``; otherwise the model's)."""
    from sglang.srt.configs.model_config import ModelConfig

    cfg = ModelConfig.from_server_args(server_args)
    if getattr(cfg, "is_hybrid_swa_compress", False):
        return int(cfg.hf_text_config.swa_num_key_value_heads)
    return cfg.get_total_num_kv_heads()


def model_dsa_index_head_dim(server_args: Any) -> int:
    """The DSA indexer's head dim (``index_head_dim``), as SGLang sizes its kpool-compression
    tails with it."""
    from sglang.srt.configs.model_config import ModelConfig

    hf = ModelConfig.from_server_args(server_args).hf_config
    dim = getattr(hf, "index_head_dim", None)
    if dim is None:
        raise ValueError(f"the model config ({type(hf).__name__}) has no index_head_dim")
    return int(dim)


def model_swa_stage_layers(server_args: Any, pp_rank: int, pp_size: int) -> tuple[range, tuple, tuple] | None:
    """``(PP stage pp_rank's model layers, full-attention layer ids, SWA layer ids)`` of a
    hybrid sliding-window model, as SGLang splits the layers (``get_pp_indices``, which reads
    ``SGLANG_PP_LAYER_PARTITION``) and its ``SWAKVPool`` maps them; None for other models."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.utils import get_pp_indices

    cfg = ModelConfig.from_server_args(server_args)
    full, swa = getattr(cfg, "full_attention_layer_ids", None), getattr(cfg, "swa_attention_layer_ids", None)
    if not full or swa is None:
        return None
    start, end = get_pp_indices(cfg.num_hidden_layers, pp_rank, pp_size)
    return range(start, end), tuple(full), tuple(swa)


def draft_model_kv(server_args: Any) -> tuple[int, bool]:
    """The draft model's ``(un-sharded KV heads, MLA)``, from its config as SGLang's draft
    worker reads it (``--speculative-draft-model-path``)."""
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig

    cfg = ModelConfig.from_server_args(
        server_args,
        model_path=getattr(server_args, "speculative_draft_model_path", None),
        model_revision=getattr(server_args, "speculative_draft_model_revision", None),
        is_draft_model=True,
    )
    return cfg.get_total_num_kv_heads(), cfg.attention_arch == AttentionArch.MLA


def pp_exchange(server_args: Any, kv_args: Any):
    """How the prefill PP stages of one pipeline share a value: SGLang's PP group broadcast
    from stage 0 (``pp_group.broadcast_object``, a collective every stage's scheduler calls
    while it builds its transfer manager, as SGLang's own backends do)."""
    from sglang.srt.runtime_context import get_parallel

    group = get_parallel().pp_group
    return lambda value: group.broadcast_object(value, src=0)


def describe(g: KVGeometry | None) -> str:
    """A draft pool's geometry in a failure reason (``none`` without one)."""
    if g is None:
        return "none (num_draft_entries=0)"
    heads = "1 latent head" if g.mla else f"{g.total_kv_heads} KV heads"
    dims = f"head_dim {g.head_dim}" + ("" if g.mla else f"/{g.v_head_dim}")
    return f"{g.num_layers} layer(s), {heads}, {dims}, {g.dtype}"


def draft_problem(prefill: KVGeometry | None, decode: KVGeometry | None) -> str:
    """Why the two sides cannot exchange a request's KV because one has a draft-model pool
    and the other has none ("" otherwise). Two draft pools are compared field by field when
    the decode's draft manager registers with the prefill's, like the model's pools."""
    if (prefill is None) == (decode is None):
        return ""
    return (
        f"{DRAFT}: prefill={describe(prefill)} decode={describe(decode)}; one server has a draft "
        "model's KV pool and the other has none (start both with the same --speculative-algorithm "
        "and --speculative-draft-model-path)"
    )


def defer_sglang_cpu_checksum() -> None:
    """Let SGLang's own KV digest stand aside on CPU pools, where this backend verifies.

    SGLang 0.5.23 digests a request's pages in its scheduler (``KvChecksumComputer``, a CUDA
    kernel) and asserts CUDA index tensors, so on a CPU server
    ``--disaggregation-enable-kv-checksum`` kills the prefill scheduler at its first request.
    Its ``compute`` is wrapped to return 0 for CPU index tensors: SGLang's "no digest", which
    its decode admits without its own check (CUDA tensors still take SGLang's path). Only in
    a process whose kvxfer manager verifies CPU pools itself; the module is imported by
    SGLang's prefill and decode schedulers before they build their transfer manager."""
    cls = getattr(sys.modules.get("sglang.srt.disaggregation.checksum"), "KvChecksumComputer", None)
    original = getattr(cls, "compute", None)
    if cls is None or original is None or getattr(original, "__kvxfer_original__", None) is not None:
        return

    @functools.wraps(original)
    def compute(self: Any, kv_page_indices_gpu: Any, state_indices_gpu: Any = None) -> int:
        if getattr(kv_page_indices_gpu, "is_cuda", True):
            return original(self, kv_page_indices_gpu, state_indices_gpu)
        return 0

    compute.__kvxfer_original__ = original  # type: ignore[attr-defined]  # functions take attributes
    cls.compute = compute
    log.info(
        "kvxfer: --disaggregation-enable-kv-checksum on CPU pools: SGLang's own digest needs CUDA, so this "
        "backend verifies each request's KV itself (per writer) and SGLang's digest is left empty"
    )
