"""SGLang's ``KVArgs`` and ``ServerArgs`` -> this engine's geometry, placement and buffers.

Owns the translation of the attribute bag SGLang hands every transfer backend into a full ``KVGeometry`` with the buffer addresses, the aux
(metadata) buffer layout and the packing of one aux slot, and the reading of the few
``ServerArgs`` fields that decide the attention TP and DP sizes and the bootstrap address.
Every feature this backend does not carry (a state type it does not move, a ``kv_layout``
pool over DCP ranks...) is refused here with a message that names the setting; extra
per-request state, and a DeepSeek-V4 ``kv_layout`` pool's compressed KV pages, are translated
in ``sglang_state``.

Head counts are never inferred from byte lengths: the total comes from
``KVArgs.total_kv_head_num`` (or the model config, through the caller), the per-rank count
from the ownership rule; byte lengths only yield head_dim, with an exact-division check per
buffer. The same holds for a speculative draft model's KV (``num_draft_entries`` trailing
entries of ``kv_data_ptrs``): its own geometry, its head count from the draft model's config
(through the caller). Must not import sglang or torch: it reads attributes by name.
"""

from __future__ import annotations

import ctypes
import json
import numbers
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sglang_kvxfer.errors import GeometryError, KVXferError
from sglang_kvxfer.geometry import DTYPE_ITEMSIZE, KVGeometry, Layout, normalize_dtype, owned_heads

if TYPE_CHECKING:
    from sglang_kvxfer.integrations.sglang_state import StatePool

__all__ = [
    "KVARGS_FIELDS",
    "SERVER_ARGS_FIELDS",
    "ServerPlan",
    "AuxLayout",
    "DraftLayout",
    "SglangLayout",
    "plan_from_server_args",
    "cp_page_share",
    "pp_layer_split",
    "kv_dtype",
    "nic_list",
    "layout_from_kv_args",
]

# Every KVArgs attribute read here: a test checks them against SGLang's own class.
KVARGS_FIELDS = (
    "engine_rank",
    "system_dp_rank",
    "pp_rank",
    "prefill_start_layer",
    "kv_data_ptrs",
    "kv_data_lens",
    "kv_item_lens",
    "kv_cache_dtype_str",
    "kv_layout",
    "aux_data_ptrs",
    "aux_data_lens",
    "aux_item_lens",
    "state_types",
    "state_data_ptrs",
    "state_data_lens",
    "state_item_lens",
    "swa_kv_cache_layout",
    "is_hybrid_mla_backend",
    "kv_head_num",
    "total_kv_head_num",
    "page_size",
    "num_draft_entries",
    "ib_device",
    "gpu_id",
)
# ServerArgs fields read by plan_from_server_args (also checked against SGLang's class).
SERVER_ARGS_FIELDS = (
    "tp_size",
    "attn_dp_size",
    "attn_cp_size",
    "dp_size",
    "pp_size",
    "dcp_size",
    "enable_cp_tp_group_sharing",
    "enable_dsa_cache_layer_split",
    "enable_kv_cache_sharding",
    "device",
    "host",
    "dist_init_addr",
    "disaggregation_bootstrap_port",
    "port",
    "disaggregation_ib_device",
    "disaggregation_decode_allocation_policy",
    "disaggregation_decode_enable_radix_cache",
    "enable_pd_role_switch",
    "dtype",
    "enable_dp_attention",
    "load_balance_method",
    "disaggregation_enable_kv_checksum",
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_draft_model_revision",
    "speculative_draft_kv_cache_dtype",
)

_PR_TOTAL_HEADS = (
    "SGLang added KVArgs.total_kv_head_num in PR #19086 (Feb 2026; sglang 0.5.23 sets it on "
    "the prefill side); upgrade SGLang to 0.5.23 or newer"
)


def _get(obj: Any, name: str, default: Any = None) -> Any:
    # KVArgs declares its fields as class annotations without values: an unset one is absent.
    return getattr(obj, name, default)


def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise GeometryError(f"{name}={value!r} must be an integer >= {minimum}")
    return value


# -- ServerArgs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerPlan:
    """What one SGLang server's arguments mean for this backend."""

    role: str  # "prefill" or "decode"
    attn_tp_size: int  # the TP size KV heads are sharded over
    bootstrap: str  # "host:port" where the prefill ranks register
    device: str  # "cpu" or "cuda" (the kind of memory the KV pool is in)
    ib_device: str  # --disaggregation-ib-device ("" when unset)
    attn_dp_size: int = 1  # attention-DP groups (--dp-size with --enable-dp-attention)
    kv_checksum: bool = False  # --disaggregation-enable-kv-checksum
    pp_size: int = 1  # pipeline-parallel stages (--pp-size); each stage's ranks hold its layers
    attn_cp_size: int = 1  # prefill attention context parallel (--attn-cp-size)
    system_dp_size: int = 1  # data-parallel replicas (--dp-size without --enable-dp-attention)
    # a prefill of several DP groups: requests placed by bootstrap_room % dp_size (else by
    # SGLang's load balancer, each room's group registered with the bootstrap)
    follows_room: bool = True
    # decode context parallel (--dcp-size): the MLA KV is interleaved over DCP ranks token by
    # token, each rank holding every dcp_size-th token in its own pages
    dcp_size: int = 1
    api_port: int = 0  # the server's HTTP port (--port): a prefill registers it with its bootstrap
    # a prefill of --attn-cp-size > 1 with SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER: every CP
    # rank sends its share of a request's pages (else CP rank 0 sends every page)
    cp_sharded: bool = False
    # a prefill of --enable-cp-tp-group-sharing (the CP group is the TP group, attention TP 1):
    # CP rank r holds every KV head and transfers as TP rank r of attn_cp_size
    cp_tp_sharing: bool = False
    # a prefill of --enable-dsa-cache-layer-split: each CP rank holds a contiguous share of the
    # layers (KV and DSA indexer), every page of them, and sends them as a PP stage would
    cp_layer_split: bool = False
    # --disaggregation-decode-allocation-policy prefill_complete: the decode allocates a
    # request's pages only once the prefill's forward of it finished (the prefill runs it
    # before the decode's metadata came; it tells the decode, which then sends its pages)
    prefill_complete: bool = False
    # a prefill of --enable-kv-cache-sharding: logical page l of a request lives on shard rank
    # l % N as its local page l // N, the shard group being the attention-CP group (CP > 1)
    # or, for an MLA model without CP, the attention-TP group; each shard rank sends the
    # pages it holds, at the positions of the decode's page list they take
    kv_sharded: bool = False

    @property
    def dp_groups(self) -> int:
        """The DP groups behind one bootstrap: attention-DP groups, or full TP replicas
        (system DP). SGLang's bootstrap counts them the same way (``system_dp_size`` when it
        is above 1, else ``attn_dp_size``); at most one of the two is above 1."""
        return self.system_dp_size if self.system_dp_size > 1 else self.attn_dp_size

    def dp_rank(self, engine_rank: int, system_dp_rank: int = 0) -> int:
        """The DP group of the prefill rank with ``KVArgs.engine_rank`` and
        ``KVArgs.system_dp_rank``. With attention DP, SGLang's prefill passes its global TP
        rank as ``engine_rank``, laid out (dp, cp, tp) with tp fastest, so the group is
        ``engine_rank // (attn_tp_size * attn_cp_size)`` (SGLang's ``derive_attention_ranks``).
        A system-DP replica is a whole TP group whose ranks count from 0: its group is
        ``system_dp_rank`` (SGLang's ``dp_rank``). SGLang's decode passes
        ``tp_rank % attn_tp_size``: its group is not needed for a transfer."""
        if self.role != "prefill":
            return 0
        if self.system_dp_size > 1:
            if not 0 <= system_dp_rank < self.system_dp_size:
                raise GeometryError(
                    f"KVArgs.system_dp_rank={system_dp_rank} names no replica of --dp-size={self.system_dp_size}"
                )
            return system_dp_rank
        return engine_rank // (self.attn_tp_size * self.attn_cp_size)

    def cp_rank(self, engine_rank: int) -> int:
        """The attention-CP rank of the prefill rank with ``KVArgs.engine_rank`` (0 on a
        decode, whose attention CP is 1)."""
        return (engine_rank // self.attn_tp_size) % self.attn_cp_size if self.role == "prefill" else 0


def _not_supported(flag: str, value: Any, why: str) -> KVXferError:
    return KVXferError(
        f"the kvxfer transfer backend does not support {flag}={value!r}: {why}; "
        "use another --disaggregation-transfer-backend for this setup"
    )


def plan_from_server_args(server_args: Any, role: str) -> ServerPlan:
    """Read ``ServerArgs`` (any object with its field names) for ``role``.

    Raises ``KVXferError`` naming the flag for every setting this backend cannot serve.
    """
    if role not in ("prefill", "decode"):
        raise ValueError(f"role={role!r} must be 'prefill' or 'decode'")
    tp = _get(server_args, "tp_size", 1)
    dp = _get(server_args, "dp_size", 1) or 1
    attn_dp = _get(server_args, "attn_dp_size", 1) or 1
    if attn_dp == 1 and dp > 1 and _get(server_args, "enable_dp_attention", False):
        attn_dp = dp  # not yet resolved: SGLang turns --enable-dp-attention into attn_dp_size=dp_size
    attn_cp = _int("ServerArgs.attn_cp_size", _get(server_args, "attn_cp_size", 1) or 1, 1)
    checks = (
        (
            "--attn-cp-size",
            attn_cp if role == "decode" else 1,
            "a decode's attention CP must be 1 (SGLang's own backends assert the same)",
        ),
    )
    for flag, value, why in checks:
        if value != 1:
            raise _not_supported(flag, value, why)
    kv_sharded = bool(_get(server_args, "enable_kv_cache_sharding", False))
    if kv_sharded and role != "prefill":
        raise _not_supported(
            "--enable-kv-cache-sharding", True, "it is for a prefill only (SGLang refuses it on a decode too)"
        )
    # every CP rank sends: its share of the pages, or with KV cache sharding the pages it holds
    cp_sharded = attn_cp > 1 and (_check_cp(server_args) or kv_sharded)
    cp_tp = role == "prefill" and attn_cp > 1 and bool(_get(server_args, "enable_cp_tp_group_sharing", False))
    if cp_tp:
        cp_sharded = False  # (SGLang: CP-TP group sharing is not its all-CP-ranks transfer)
    split = role == "prefill" and attn_cp > 1 and bool(_get(server_args, "enable_dsa_cache_layer_split", False))
    if attn_dp > 1 and dp not in (1, attn_dp):
        raise _not_supported("--dp-size", dp, f"it must equal the attention-DP size {attn_dp} or be 1")
    # --dp-size without --enable-dp-attention: full TP replicas, each a DP group of its own
    system_dp = _int("ServerArgs.dp_size", dp, 1) if attn_dp == 1 else 1
    # A prefill's DP groups follow bootstrap_room % dp_size under SGLang's prefill default
    # ("auto" resolves to follow_bootstrap_room there); another load balancer places requests
    # itself and each room's group is registered with the bootstrap, as it is with
    # SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK (SGLang's CommonKVSender does the same).
    lb = _get(server_args, "load_balance_method", "auto") or "auto"
    follows_room = lb in ("auto", "follow_bootstrap_room") and not force_query_prefill_dp_rank()
    policy = _get(server_args, "disaggregation_decode_allocation_policy", "early") or "early"
    if policy not in ("early", "prefill_complete"):
        raise _not_supported(
            "--disaggregation-decode-allocation-policy", policy, "SGLang 0.5.23 knows 'early' and 'prefill_complete'"
        )
    tp = _int("ServerArgs.tp_size", tp, 1)
    attn_dp = _int("ServerArgs.attn_dp_size", attn_dp, 1)
    pp = _int("ServerArgs.pp_size", _get(server_args, "pp_size", 1) or 1, 1)
    if tp % (attn_dp * attn_cp):
        cp = f" times the attention-CP size {attn_cp}" if attn_cp > 1 else ""
        raise GeometryError(f"ServerArgs.tp_size={tp} is not a multiple of the attention-DP size {attn_dp}{cp}")
    dcp = _int("ServerArgs.dcp_size", _get(server_args, "dcp_size", 1) or 1, 1)
    if (tp // attn_dp // attn_cp) % dcp:
        raise GeometryError(
            f"ServerArgs.dcp_size={dcp} does not divide the attention TP size {tp // attn_dp // attn_cp} "
            "(each attention-TP rank is DCP rank tp_rank % dcp_size)"
        )
    if cp_tp:  # SGLang's own rules for it (cp_tp_group_sharing_hook), in case they were bypassed
        if attn_cp != tp:
            raise _not_supported(
                "--enable-cp-tp-group-sharing",
                True,
                f"it needs --attn-cp-size == --tp-size (the CP group is the TP group), got attn_cp_size={attn_cp}, "
                f"tp_size={tp}",
            )
        if pp > 1:  # (--dcp-size > 1 cannot divide its attention TP of 1: refused above)
            raise _not_supported("--pp-size", pp, "with --enable-cp-tp-group-sharing (SGLang refuses it too)")
    if kv_sharded:  # SGLang's own rules for it (kv_shard_hook), in case they were bypassed
        for flag, value, refused in (
            ("--dcp-size", dcp, dcp > 1),
            ("--enable-dsa-cache-layer-split", True, split),
            ("--enable-cp-tp-group-sharing", True, cp_tp),
            ("--attn-dp-size", attn_dp, attn_cp == 1 and attn_dp > 1),
        ):
            if refused:
                raise _not_supported(flag, value, "with --enable-kv-cache-sharding (SGLang refuses it too)")
        if attn_cp == 1 and tp // attn_dp < 2:
            raise _not_supported(
                "--enable-kv-cache-sharding",
                True,
                f"it shards pages over attention CP (--attn-cp-size > 1) or, for an MLA model, over attention "
                f"TP > 1; got attn_cp_size=1, tp_size={tp} (SGLang refuses it too)",
            )
    if policy == "prefill_complete":  # SGLang's own rules for it (_validate_prefill_complete), if bypassed
        radix = role == "decode" and bool(_get(server_args, "disaggregation_decode_enable_radix_cache", False))
        for flag, value, refused in (
            ("--pp-size", pp, pp > 1),
            ("--attn-cp-size", attn_cp, attn_cp > 1),
            ("--tp-size", tp, tp != attn_dp),  # (so --dcp-size > 1, which must divide attention TP 1, is refused above)
            ("--disaggregation-decode-enable-radix-cache", radix, radix),
            ("--enable-pd-role-switch", True, bool(_get(server_args, "enable_pd_role_switch", False))),
        ):
            if refused:
                raise _not_supported(
                    flag,
                    value,
                    "with --disaggregation-decode-allocation-policy prefill_complete, which needs attention TP, "
                    "PP and CP of 1, no decode radix cache and no role switch (SGLang refuses it too)",
                )
    if split:  # SGLang's own rules for it (model_hook), in case they were bypassed
        for flag, value, refused in (("--pp-size", pp, pp > 1), ("--enable-cp-tp-group-sharing", cp_tp, cp_tp)):
            if refused:
                raise _not_supported(flag, value, "with --enable-dsa-cache-layer-split (SGLang refuses it too)")
        cp_sharded = False  # every CP rank sends every page of its layers
    device = _get(server_args, "device", None) or "cuda"  # None: SGLang auto-detects a GPU
    if device not in ("cpu", "cuda"):
        raise _not_supported("--device", device, "KV pools must be CPU or CUDA/ROCm GPU memory")
    port = _int("ServerArgs.disaggregation_bootstrap_port", _get(server_args, "disaggregation_bootstrap_port", 8998), 1)
    dist = _get(server_args, "dist_init_addr", None)
    if dist:  # multi-node: SGLang's bootstrap runs next to the rank-0 node
        host = str(dist).rpartition(":")[0].strip("[]") or str(dist)
    else:  # a wildcard bind address is not an address to connect to
        host = str(_get(server_args, "host", "127.0.0.1"))
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return ServerPlan(
        role=role,
        attn_tp_size=tp // attn_dp // attn_cp,
        bootstrap=f"{host}:{port}",
        device=device,
        ib_device=str(_get(server_args, "disaggregation_ib_device", "") or ""),
        attn_dp_size=attn_dp,
        kv_checksum=bool(_get(server_args, "disaggregation_enable_kv_checksum", False)),
        pp_size=pp,
        attn_cp_size=attn_cp,
        system_dp_size=system_dp,
        follows_room=follows_room,
        dcp_size=dcp,
        api_port=_int("ServerArgs.port", _get(server_args, "port", 0) or 0, 0),
        cp_sharded=cp_sharded,
        cp_tp_sharing=cp_tp,
        cp_layer_split=split,
        prefill_complete=policy == "prefill_complete",
        kv_sharded=kv_sharded,
    )


def force_query_prefill_dp_rank() -> bool:
    """``SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK`` (SGLang's reading of a boolean):
    every request's prefill DP group is registered and looked up, whatever the load balancer."""
    return os.environ.get("SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK", "").strip().lower() in (
        "1",
        "true",
        "yes",
        "on",
    )


def _check_cp(server_args: Any) -> bool:
    """Prefill attention CP: CP materializes the request's KV in global token order on every
    CP rank. By default CP rank 0 of each attention-TP rank sends it (the other CP ranks are
    SGLang's dummy participants); with ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER`` every
    CP rank sends its share of the request's pages (returns True). With ``--pp-size``, each PP
    stage does so for its layers. (With ``--enable-kv-cache-sharding`` each CP rank holds
    some of the pages and every CP rank sends those: ``kv_sharded``.)"""
    env = os.environ.get("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", "").strip().lower()
    return env in ("1", "true", "yes", "on")


def cp_page_share(num_pages: int, cp_rank: int, cp_size: int) -> slice:
    """The pages ``[start, stop)`` of a request of ``num_pages`` pages that prefill CP rank
    ``cp_rank`` of ``cp_size`` sends when every CP rank sends (SGLang's split, which both
    sides compute from the same page count): consecutive shares in CP rank order, the first
    ``num_pages % cp_size`` ranks one page more than the others."""
    base, extra = divmod(num_pages, cp_size)
    start = cp_rank * base + min(cp_rank, extra)
    return slice(start, start + base + (cp_rank < extra))


def pp_layer_split(num_layers: int, pp_size: int, partition: str | None = None) -> list[range]:
    """The layers of each PP stage as SGLang assigns them (``get_pp_indices``): with a
    partition (``SGLANG_PP_LAYER_PARTITION``, a comma list of layer counts per stage), those
    counts in stage order; otherwise an even split with the remainder given to the last
    stages, one layer each. ``ValueError`` names what does not fit."""
    _int("num_layers", num_layers, 1)
    _int("pp_size", pp_size, 1)
    if partition is not None and pp_size > 1:  # SGLang ignores a partition without PP
        try:
            counts = [int(x) for x in str(partition).split(",")]
        except ValueError:
            raise ValueError(f"layer partition {partition!r} must be a comma list of integers") from None
        if len(counts) != pp_size or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(
                f"layer partition {partition!r} must give each of the {pp_size} PP stages at least one layer, "
                f"{num_layers} layers in all"
            )
    else:
        if num_layers < pp_size:
            raise ValueError(f"{num_layers} layers cannot be split over {pp_size} PP stages")
        base, extra = divmod(num_layers, pp_size)
        counts = [base + (1 if s >= pp_size - extra else 0) for s in range(pp_size)]
    return list(entry_spans(counts))


def entry_spans(counts) -> tuple[range, ...]:
    """Consecutive ranges of ``counts`` items, one after another from 0: each PP stage's
    layers of a split, or where each stage's entries of a pool lie in a decode pool of every
    stage's entries (stages hold consecutive layers; a pool lists its layers' entries in layer
    order)."""
    out, at = [], 0
    for n in counts:
        out.append(range(at, at + n))
        at += n
    return tuple(out)


def kv_dtype(kv_cache_dtype_str: Any, model_dtype: Any = None) -> str:
    """The pool's element type from SGLang's ``kv_cache_dtype_str``.

    ``"auto"`` means "the model's dtype", which KVArgs does not carry: ``model_dtype``
    (``--dtype``) decides when it is explicit; otherwise the pool is described in bytes
    (``uint8``, head_dim counted in bytes), which both sides then agree on as long as they
    run the same model with the same flags. ``"mxfp8"`` (an MXFP8 pool) holds FP8 E4M3
    elements; its block scales are a state pool of their own (``block_scale``). The FP4 KV
    dtypes (``nvfp4``, ``fp4_mx_block16``) are refused: SGLang's FP4 pools keep their block
    scales beside the packed K and V and hand a backend only the packed buffers.
    """
    text = str(kv_cache_dtype_str).strip() if kv_cache_dtype_str is not None else "auto"
    if text.lower() == "mxfp8":
        return "float8_e4m3fn"
    if text.lower() in ("nvfp4", "fp4_mx_block16"):
        raise _not_supported(
            "--kv-cache-dtype",
            text,
            "SGLang 0.5.23's FP4 KV pools (MHATokenToKVPoolFP4, MLATokenToKVPoolFP4) keep each layer's block "
            "scales in buffers of their own and register only the packed K and V in KVArgs, so the KV would land "
            "without its scales and decode garbage; serve FP8 or MXFP8 KV (whose scales are registered) instead",
        )
    if text.lower() in ("", "auto"):
        text = str(model_dtype).strip() if model_dtype is not None else "auto"
        if text.lower() in ("", "auto"):
            return "uint8"
    try:
        return normalize_dtype(text)
    except GeometryError as exc:
        raise GeometryError(f"KVArgs.kv_cache_dtype_str={kv_cache_dtype_str!r}: {exc}") from None


def nic_list(ib_device: Any, gpu_id: int) -> list[str]:
    """``--disaggregation-ib-device`` as the RDMA NICs of GPU ``gpu_id``.

    SGLang's three forms: a comma list (``"mlx5_0,mlx5_1"``, every GPU), a JSON object
    mapping GPU ids to such a list, or the path of a ``.json`` file holding that object.
    Empty or unset: ``[]`` (the RDMA library picks).
    """
    text = str(ib_device or "").strip()
    if not text:
        return []
    if text.endswith(".json"):
        try:
            with open(text, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ValueError(f"--disaggregation-ib-device={ib_device!r}: cannot read it: {exc}") from None
    if text.lstrip().startswith("{"):
        try:
            mapping = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--disaggregation-ib-device={ib_device!r} is not valid JSON: {exc}") from None
        if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
            raise ValueError(f"--disaggregation-ib-device={ib_device!r} must map GPU ids to NIC lists")
        entry = {str(k).strip(): v for k, v in mapping.items()}.get(str(gpu_id))
        if entry is None:
            raise ValueError(f"--disaggregation-ib-device={ib_device!r} names no NIC for GPU {gpu_id}")
        text = entry
    return [name.strip() for name in text.split(",") if name.strip()]


# -- aux (metadata) buffers ------------------------------------------------------------------------

_AUX_MAGIC = b"KVXA"
_AUX_HEAD = struct.Struct("<4sHH")  # magic, version, number of buffers; then one u32 length each


@dataclass(frozen=True)
class AuxLayout:
    """SGLang's metadata buffers: one item per request slot in each (CPU memory).

    ``read(slot)`` packs slot ``slot`` of every buffer into one payload (with the item
    lengths, so the reader can check its buffers have the same layout); ``write`` checks
    and unpacks it into this side's buffers.
    """

    ptrs: tuple[int, ...]
    lens: tuple[int, ...]
    item_lens: tuple[int, ...]

    def __post_init__(self) -> None:
        if not len(self.ptrs) == len(self.lens) == len(self.item_lens):
            raise GeometryError(
                f"aux_data_ptrs/aux_data_lens/aux_item_lens have {len(self.ptrs)}/"
                f"{len(self.lens)}/{len(self.item_lens)} entries; they must match"
            )
        for i, (p, n, item) in enumerate(zip(self.ptrs, self.lens, self.item_lens)):
            _int(f"aux_item_lens[{i}]", item, 1)
            _int(f"aux_data_ptrs[{i}]", p, 1)
            if _int(f"aux_data_lens[{i}]", n, 0) < item:
                raise GeometryError(f"aux_data_lens[{i}]={n} holds no item of aux_item_lens[{i}]={item}")

    @property
    def num_slots(self) -> int:
        return min((n // item for n, item in zip(self.lens, self.item_lens)), default=0)

    def check_slot(self, slot: Any) -> int:
        if isinstance(slot, bool) or not isinstance(slot, numbers.Integral) or not 0 <= int(slot) < self.num_slots:
            raise ValueError(f"aux_index={slot!r} must be a slot in [0, {self.num_slots})")
        return int(slot)

    def read(self, slot: int) -> bytes:
        slot = self.check_slot(slot)
        head = _AUX_HEAD.pack(_AUX_MAGIC, 1, len(self.ptrs)) + struct.pack(f"<{len(self.ptrs)}I", *self.item_lens)
        body = b"".join(ctypes.string_at(p + slot * item, item) for p, item in zip(self.ptrs, self.item_lens))
        return head + body

    def write(self, slot: int, payload: bytes) -> None:
        """Unpack ``payload`` (from ``read`` on the peer) into slot ``slot``; nothing is
        written unless the whole payload matches this side's layout."""
        slot = self.check_slot(slot)
        if len(payload) < _AUX_HEAD.size:
            raise ValueError(f"aux payload of {len(payload)} bytes is too short")
        magic, version, count = _AUX_HEAD.unpack_from(payload)
        if magic != _AUX_MAGIC or version != 1:
            raise ValueError(f"aux payload has magic {magic!r} version {version}; expected {_AUX_MAGIC!r} 1")
        if count != len(self.ptrs):
            raise ValueError(
                f"aux payload carries {count} metadata buffers; this decode rank has "
                f"{len(self.ptrs)} (run both servers with the same SGLang version and "
                "metadata options)"
            )
        lens = struct.unpack_from(f"<{count}I", payload, _AUX_HEAD.size)
        for i, (theirs, mine) in enumerate(zip(lens, self.item_lens)):
            if theirs != mine:
                raise ValueError(
                    f"aux buffer {i}: prefill sent {theirs} bytes per slot, this decode "
                    f"rank holds {mine} (run both servers with the same SGLang version "
                    "and metadata options)"
                )
        body = memoryview(payload)[_AUX_HEAD.size + 4 * count :]
        if len(body) != sum(self.item_lens):
            raise ValueError(f"aux payload body is {len(body)} bytes; {sum(self.item_lens)} expected")
        at = 0
        for p, item in zip(self.ptrs, self.item_lens):
            ctypes.memmove(p + slot * item, bytes(body[at : at + item]), item)
            at += item


# -- KV buffers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftLayout:
    """The speculative draft model's KV pool on one rank (the trailing ``num_draft_entries``
    entries of ``kv_data_ptrs``): its own geometry, the same page ids as the model's pool."""

    geometry: KVGeometry
    kv_ptrs: tuple[int, ...]  # K of every draft layer, then V (MLA: one each)
    kv_lens: tuple[int, ...]


@dataclass(frozen=True)
class SglangLayout:
    """One SGLang rank's KV pool as this engine sees it."""

    geometry: KVGeometry
    tp_size: int
    tp_rank: int
    kv_ptrs: tuple[int, ...]  # the geometry's buffers: K of every layer, then V (MLA: one each)
    kv_lens: tuple[int, ...]
    aux: AuxLayout
    num_draft_entries: int  # trailing draft-model entries of kv_data_ptrs (``draft``)
    draft: DraftLayout | None = None  # None without a draft model
    states: tuple[StatePool, ...] = ()  # extra per-request state (KVArgs.state_types), a pool each
    # the KV pool holds every KV head while the rank transfers as TP rank tp_rank of tp_size
    # (--enable-cp-tp-group-sharing; RankPlacement.all_heads)
    all_heads: bool = False
    # KVArgs.kv_layout (a DeepSeek-V4 pool): the geometry's rows are whole KV pages of its first
    # run of one page size; the other runs are KV_PAGES pools in ``states`` (None: a plain pool)
    kv_layout: str | None = None


def _per_entry_dim(
    name: str, i: int, item_len: int, page_size: int, heads: int, itemsize: int, field: str = "kv_item_lens"
) -> int:
    unit = page_size * heads * itemsize
    if item_len <= 0 or item_len % unit:
        raise GeometryError(
            f"{field}[{i}]={item_len} ({name}) is not a whole number of heads: one page of "
            f"{page_size} tokens x {heads} head(s) x {itemsize}-byte elements is {unit} bytes per "
            f"unit of head_dim"
        )
    return item_len // unit


def _same(name: str, values: list[int], first: int) -> int:
    bad = [(first + i, v) for i, v in enumerate(values) if v != values[0]]
    if bad:
        raise GeometryError(
            f"{name} differs between KV entries: entry {first} has {values[0]}, "
            + ", ".join(f"entry {i} has {v}" for i, v in bad[:4])
        )
    return values[0]


def _pool_geometry(
    what: str,
    first: int,
    items: list[int],
    lens: list[int],
    *,
    mla: bool,
    heads_total: int,
    local: int,
    page_size: int,
    dtype: str,
    items_field: str = "kv_item_lens",
    lens_field: str = "kv_data_lens",
) -> KVGeometry:
    """The geometry of the KV entries ``[first, first + len(items))`` of ``kv_data_ptrs``
    (K of every layer then V; MLA: one per layer). ``what`` names the pool in errors, the
    ``*_field`` names the KVArgs fields the entries come from."""
    itemsize = DTYPE_ITEMSIZE[dtype]
    n = len(items)
    layers = n if mla else n // 2
    k_dims = [
        _per_entry_dim(f"{what}K", first + i, items[i], page_size, local, itemsize, items_field) for i in range(layers)
    ]
    head_dim = _same(f"head_dim ({what}K)", k_dims, first)
    v_head_dim = None
    if not mla:
        v_dims = [
            _per_entry_dim(f"{what}V", first + i, items[i], page_size, local, itemsize, items_field)
            for i in range(layers, n)
        ]
        v_head_dim = _same(f"head_dim ({what}V)", v_dims, first + layers)
    pages = [lens[i] // items[i] for i in range(n)]
    num_pages = _same(f"pages per buffer ({what}{lens_field} // {items_field})", pages, first)
    return KVGeometry(
        num_layers=layers,
        total_kv_heads=heads_total,
        head_dim=head_dim,
        dtype=dtype,
        page_size=page_size,
        layout=Layout.NHD,
        mla=mla,
        v_head_dim=v_head_dim,
        num_pages=_int(f"pages per {what}buffer", num_pages, 1),
    )


def _draft_layout(
    ptrs: list[int],
    lens: list[int],
    items: list[int],
    first: int,
    *,
    tp_size: int,
    rank: int,
    page_size: int,
    dtype: str,
    draft_kv: Callable[[], tuple[int, bool]] | None,
) -> DraftLayout:
    """The draft model's pool from entries ``[first, len(ptrs))``: its head count and
    attention type from ``draft_kv()`` (the draft model's config), never from bytes."""
    num = len(ptrs) - first
    if draft_kv is None:
        raise GeometryError(
            f"KVArgs.num_draft_entries={num}: the draft model's KV head count is needed to describe its "
            "KV entries, and no draft model config was given"
        )
    try:
        heads_total, mla = draft_kv()
    except Exception as exc:
        raise GeometryError(
            f"KVArgs.num_draft_entries={num}: the draft model's config (--speculative-draft-model-path) "
            f"could not supply its KV head count ({type(exc).__name__}: {exc})"
        ) from exc
    if not mla and num % 2:
        raise GeometryError(
            f"KVArgs.num_draft_entries={num}: the draft model has MHA attention, so its entries must be K "
            "and V of every draft layer (an even count)"
        )
    if mla:
        heads_total, local = 1, 1
    else:
        heads_total = _int("the draft model's total KV heads", heads_total, 1)
        try:
            local = len(owned_heads(heads_total, tp_size, rank))
        except GeometryError as exc:
            raise GeometryError(f"the draft model's KV heads on attention TP {tp_size}: {exc}") from None
    geometry = _pool_geometry(
        "draft ",
        first,
        items[first:],
        lens[first:],
        mla=bool(mla),
        heads_total=heads_total,
        local=local,
        page_size=page_size,
        dtype=dtype,
    )
    return DraftLayout(geometry, tuple(ptrs[first:]), tuple(lens[first:]))


def _paged_layout(
    args: Any,
    kv_layout: str,
    ptrs: list,
    lens: list,
    items: list,
    tp_size: int,
    mla: bool,
    cp_tp: int,
    dcp: int,
) -> SglangLayout:
    """A DeepSeek-V4 pool (``KVArgs.kv_layout`` set: ``DeepSeekV4TokenToKVPool``): its KV entries
    move as whole pages (``sglang_state.kv_page_pools``), its state as rows."""
    from sglang_kvxfer.integrations.sglang_state import kv_page_pools, states_from_kv_args

    for flag, value, why in (
        (
            "KVArgs.kv_layout",
            kv_layout,
            "" if mla else "a kv_layout pool that is not an MLA one (SGLang's is_mla_backend)",
        ),
        ("--enable-cp-tp-group-sharing", cp_tp, "with a kv_layout pool" if cp_tp > 1 else ""),
        (
            "--dcp-size",
            dcp,
            "with a kv_layout pool (whole compressed pages are not split over DCP ranks)" if dcp > 1 else "",
        ),
    ):
        if why:
            raise _not_supported(flag, value, f"{why} is not implemented by the kvxfer backend")
    # (a draft's compressed KV entries, if any, share the target's page ids: more runs of pages; a
    # DeepSeek-V4 NextN draft has SWA layers only and comes as state components of its own)
    geometry, kv_ptrs, kv_lens, pages = kv_page_pools(kv_layout, ptrs, lens, items)
    page_size = _int("KVArgs.page_size", _get(args, "page_size", None), 1)
    rank = _int("KVArgs.engine_rank", _get(args, "engine_rank", None), 0) % tp_size
    states = states_from_kv_args(args, tp_size=tp_size, rank=rank, mla=True, dtype="uint8", page_size=page_size)
    return SglangLayout(
        geometry,
        tp_size,
        rank,
        tuple(kv_ptrs),
        tuple(kv_lens),
        _aux(args),
        0,
        None,
        (*pages, *states),
        kv_layout=kv_layout,
    )


def _aux(args: Any) -> AuxLayout:
    return AuxLayout(*(tuple(_get(args, n, None) or ()) for n in ("aux_data_ptrs", "aux_data_lens", "aux_item_lens")))


def layout_from_kv_args(
    args: Any,
    *,
    tp_size: int,
    mla: bool,
    dtype: str,
    total_kv_heads: Callable[[], int] | None = None,
    draft_kv: Callable[[], tuple[int, bool]] | None = None,
    draft_dtype: str | None = None,
    swa_kv_heads: Callable[[], int] | None = None,
    dcp_size: int = 1,
    cp_tp: int = 1,
    dsa_index_head_dim: Callable[[], int] | None = None,
) -> SglangLayout:
    """Translate ``KVArgs`` into a geometry, this rank's placement and its buffers.

    Args:
        args: SGLang's ``KVArgs`` (any object with its attribute names).
        tp_size: the attention TP size of this side (``plan_from_server_args``).
        mla: SGLang's ``is_mla_backend`` (``KVArgs.is_hybrid_mla_backend`` counts too).
        dtype: the pool's element type (``kv_dtype``).
        total_kv_heads: called for the model's un-sharded KV head count when
            ``KVArgs.total_kv_head_num`` is unset (SGLang's decode side sets it only with
            staging on); None: an unset field is an error.
        draft_kv: with ``num_draft_entries > 0``, called for the draft model's
            ``(un-sharded KV heads, MLA)`` (its config; KVArgs carries neither).
        draft_dtype: the draft pool's element type (None: ``dtype``).
        swa_kv_heads: with a ``swa`` entry in ``state_types``, called for the SWA layers'
            un-sharded KV head count (the model's config).
        dcp_size: a decode's ``--dcp-size``: its draft pool is not split over DCP ranks and
            has pages of ``page_size * dcp_size`` tokens (SGLang's virtual page).
        cp_tp: a prefill's CP ranks under ``--enable-cp-tp-group-sharing`` (1: off): the KV
            pool holds every KV head (attention TP ``tp_size`` is 1), and the rank transfers
            as TP rank ``engine_rank % cp_tp`` of ``cp_tp`` (``all_heads``), its extra state
            sharded over that TP group (linear attention keeps its TP partition).
        dsa_index_head_dim: with a ``dsa_tail`` entry in ``state_types``, called for the DSA
            indexer's head dim (the model's config): a tail token's width.

    Extra per-request state (``state_types`` of ``sglang_state.HANDLED_STATE_TYPES``) becomes
    ``states``, a pool each (``sglang_state``); any other type is refused naming it. A
    DeepSeek-V4 pool (``KVArgs.kv_layout`` set) moves its KV as whole pages: the geometry is
    its first run of one page size, the other runs are ``KV_PAGES`` pools in ``states``.

    Raises ``GeometryError`` naming the KVArgs field for anything inconsistent.
    """
    # A hybrid linear-attention model over an MLA pool (Kimi-Linear): SGLang passes
    # is_mla_backend=False for its HybridLinearKVPool and says so here; its full-attention KV
    # is an MLA latent (one buffer per layer), as SGLang's own backends read it.
    mla = bool(mla) or bool(_get(args, "is_hybrid_mla_backend", False))
    kv_layout = _get(args, "kv_layout", None)
    ptrs, lens, items = (list(_get(args, n, None) or []) for n in ("kv_data_ptrs", "kv_data_lens", "kv_item_lens"))
    if not ptrs or not len(ptrs) == len(lens) == len(items):
        raise GeometryError(
            f"kv_data_ptrs/kv_data_lens/kv_item_lens have {len(ptrs)}/{len(lens)}/"
            f"{len(items)} entries; they must match and be non-empty"
        )
    draft = _int("KVArgs.num_draft_entries", _get(args, "num_draft_entries", 0) or 0, 0)
    if kv_layout is not None:
        return _paged_layout(args, str(kv_layout), ptrs, lens, items, tp_size, mla, cp_tp, dcp_size)
    main = len(ptrs) - draft
    if main < 1 or (not mla and main % 2):
        raise GeometryError(
            f"kv_data_ptrs has {len(ptrs)} entries with num_draft_entries={draft}: "
            f"{main} main entries, expected {'one per layer' if mla else 'K and V of every layer (an even count)'}"
        )
    page_size = _int("KVArgs.page_size", _get(args, "page_size", None), 1)
    engine_rank = _int("KVArgs.engine_rank", _get(args, "engine_rank", None), 0)
    rank = engine_rank % tp_size
    if cp_tp > 1:
        if tp_size != 1:
            raise GeometryError(
                f"--enable-cp-tp-group-sharing over {cp_tp} CP ranks needs an attention TP size of 1, got {tp_size}"
            )
        if draft:
            raise _not_supported(
                "KVArgs.num_draft_entries",
                draft,
                "a draft model's KV with --enable-cp-tp-group-sharing is not implemented (SGLang refuses "
                "--speculative-algorithm with it for every model that can use another backend)",
            )
    if mla:
        heads_total, local = 1, 1
    else:
        heads_total = _get(args, "total_kv_head_num", None)
        if not heads_total:
            if total_kv_heads is None:
                raise GeometryError(f"KVArgs.total_kv_head_num is not set: {_PR_TOTAL_HEADS}")
            try:
                heads_total = total_kv_heads()
            except Exception as exc:
                raise GeometryError(
                    f"KVArgs.total_kv_head_num is not set and the model config could "
                    f"not supply it ({type(exc).__name__}: {exc}); {_PR_TOTAL_HEADS}"
                ) from exc
        heads_total = _int("KVArgs.total_kv_head_num", heads_total, 1)
        local = len(owned_heads(heads_total, tp_size, rank))
        given = _get(args, "kv_head_num", None)
        if given is not None and given != local:
            raise GeometryError(
                f"KVArgs.kv_head_num={given!r} but rank {rank} of an attention TP group of "
                f"{tp_size} owns {local} of total_kv_head_num={heads_total} heads"
            )
    geometry = _pool_geometry(
        "",
        0,
        items[:main],
        lens[:main],
        mla=mla,
        heads_total=heads_total,
        local=local,
        page_size=page_size,
        dtype=dtype,
    )
    draft_layout = None
    if draft:
        draft_layout = _draft_layout(
            ptrs,
            lens,
            items,
            main,
            tp_size=tp_size,
            rank=rank,
            page_size=page_size * dcp_size,
            dtype=draft_dtype or dtype,
            draft_kv=draft_kv,
        )
    from sglang_kvxfer.integrations.sglang_state import states_from_kv_args  # it builds on this module

    if cp_tp > 1:  # transfers as TP rank engine_rank % cp_tp, its pool holding every head
        tp_size, rank = cp_tp, engine_rank % cp_tp
    states = states_from_kv_args(
        args,
        tp_size=tp_size,
        rank=rank,
        mla=mla,
        dtype=dtype,
        page_size=page_size,
        swa_kv_heads=swa_kv_heads,
        dsa_index_head_dim=dsa_index_head_dim,
    )
    return SglangLayout(
        geometry,
        tp_size,
        rank,
        tuple(ptrs[:main]),
        tuple(lens[:main]),
        _aux(args),
        draft,
        draft_layout,
        states,
        all_heads=cp_tp > 1,
    )
