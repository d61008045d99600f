"""SGLang's transfer manager and bootstrap server for the kvxfer backend.

Owns ``KVXferKVManager`` (one SGLang rank's manager: an engine manager over SGLang's own KV
pool memory, no copy; a second one over a draft model's pool; one per pool of the model's extra
per-request state (``sglang_state``); on a decode rank facing a prefill of several PP stages,
one per stage's layer range over a layer-slice view of the same pool) and
``KVXferKVBootstrapServer``. The decode side's parallel info
(``try_ensure_parallel_info``, ``prefill_info_table``) and which engine manager serves which
part of a request (``receive_parts``) are decided here; the requests themselves are
``sglang_requests``. Must not: drive a request, or read a pool's bytes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sglang_kvxfer import envs
from sglang_kvxfer.engine.config import EngineConfig, parse_host_port
from sglang_kvxfer.errors import KVXferError
from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.integrations.sglang_args import (
    SglangLayout,
    _not_supported,
    kv_dtype,
    layout_from_kv_args,
    plan_from_server_args,
)
from sglang_kvxfer.integrations.sglang_common import (
    DRAFT,
    BaseKVBootstrapServer,
    BaseKVManager,
    KVArgs,
    KVPoll,
    PrefillInfo,
    draft_problem,
    local_host,
    log,
    resolved,
    role_of,
    seam,
    sglang_timeout,
    transport_name,
)
from sglang_kvxfer.integrations.sglang_pp import (
    PrefillTopology,
    StageStatus,
    TopologyLookup,
    count_problem,
    entry_spans,
    layer_slice,
    pp_rule_problem,
    stage_entries,
    stage_label,
    tiling_problem,
)
from sglang_kvxfer.integrations.sglang_state import (
    MINIMAX_KINDS,
    SCALE_KINDS,
    StatePool,
    describe,
    state_problem,
)

if TYPE_CHECKING:
    from sglang_kvxfer.engine.decode import DecodeManager
    from sglang_kvxfer.engine.manager import RankBase
    from sglang_kvxfer.engine.prefill import PrefillManager
    from sglang_kvxfer.integrations.sglang_requests import KVXferKVReceiver

__all__ = ["KVXferKVManager", "KVXferKVBootstrapServer", "ReceivePart", "StatePart"]

# How long a decode waits for the bootstrap's answer about rooms' DP groups (SGLang's own: 5 s).
DP_QUERY_TIMEOUT_S = 5.0
# This process's decode managers: SGLang's decode asks the class method
# CommonKVReceiver.query_prefill_dp_ranks, not its manager, which prefill placed a room.
_DECODE_MANAGERS: weakref.WeakSet[KVXferKVManager] = weakref.WeakSet()


def install_dp_rank_query() -> None:
    """Let SGLang's ``CommonKVReceiver.query_prefill_dp_ranks`` (an HTTP call to SGLang's own
    bootstrap) answer from our bootstrap for the prefill addresses a kvxfer decode manager of
    this process has looked up; other addresses still go to SGLang's. Once per process. Where
    SGLang's common module cannot be imported (the base classes alone) there is nothing to
    replace: no SGLang decode scheduler runs there."""
    try:
        from sglang.srt.disaggregation.common.conn import CommonKVReceiver
    except ImportError:
        return
    original = CommonKVReceiver.__dict__.get("query_prefill_dp_ranks")
    sglang_query = getattr(original, "__func__", None)
    if sglang_query is None or getattr(sglang_query, "kvxfer", False):
        return

    def query_prefill_dp_ranks(bootstrap_addr: str, bootstrap_rooms: list[int]) -> dict[str, int]:
        for mgr in list(_DECODE_MANAGERS):
            if bootstrap_addr in getattr(mgr, "prefill_info_table", {}):
                return mgr.query_prefill_dp_ranks(bootstrap_addr, list(bootstrap_rooms))
        return sglang_query(bootstrap_addr, bootstrap_rooms)

    query_prefill_dp_ranks.kvxfer = True  # type: ignore[attr-defined]
    CommonKVReceiver.query_prefill_dp_ranks = staticmethod(query_prefill_dp_ranks)


@dataclass(frozen=True)
class ReceivePart:
    """One engine request of a decode request: which engine manager receives which layers
    from which prefill group address; ``ptrs`` are that manager's buffers (for the KV
    checksum); ``aux``: whether the request's metadata slot comes from this part."""

    label: str  # "" for the model's whole pool; "PP stage 1 (layers [16, 32))" for a stage
    engine: DecodeManager
    address: str
    config: EngineConfig
    ptrs: tuple[int, ...]
    aux: bool
    # (CP rank, CP size) of a prefill whose CP ranks each send their share of a request's
    # pages (cp_page_share): this part receives that share; (0, 1): every page
    cp: tuple[int, int] = (0, 1)


def _cp_label(label: str, cp_rank: int, cp_size: int) -> str:
    """A part's label with the prefill CP rank whose share it receives (when CP ranks send)."""
    if cp_size == 1:
        return label
    return f"{label}, CP rank {cp_rank}/{cp_size}" if label else f"CP rank {cp_rank}/{cp_size}"


@dataclass(frozen=True)
class StatePart:
    """One engine request of a decode request's extra per-request state: which engine
    manager receives ``pool``'s rows (all of its entries, or on a decode of PP 1 facing PP
    stages, one stage's entries) from which prefill group address."""

    pool: StatePool
    label: str  # the pool's label, and the stage's when it is one stage's part
    engine: DecodeManager
    address: str
    # a DSA indexer sharded like the KV (--enable-kv-cache-sharding): one part per shard rank,
    # each asked for sparse writes into the request's whole row list
    sparse: bool = False


def _check_dcp(mgr: KVXferKVManager) -> None:
    """A server with ``--dcp-size`` > 1 (SGLang's own rule: an MLA pool, each DCP rank
    holding every dcp_size-th token of a request): what this backend does not move with it
    is refused by name. (The KV checksum is digested per token phase.)"""
    # mamba state is per request slot, its channels split over attention TP as without DCP
    # (Kimi-Linear); DSA indexer rows are not split over DCP ranks either (SGLang replicates
    # them, one row per page_size tokens of the widened id space, and lists a request's rows
    # in order, as a prefill of DCP 1 lists its pages), so they move row for row. SWA pages
    # would be split token by token (SGLang refuses an SWA pool with PD DCP too).
    refused = [p.name for p in mgr.layout.states if p.kind in ("swa", "dsa_tail", *SCALE_KINDS)]
    if refused:
        why = f"extra per-request state ({describe(refused)}) with DCP is not implemented (mamba and DSA state are)"
        raise _not_supported("--dcp-size", mgr.dcp_size, why)


def _check_mxfp8(layout: SglangLayout, kv_cache_dtype_str: Any, draft_dtype: Any) -> None:
    """An MXFP8 KV cache (``--kv-cache-dtype mxfp8``) moves as FP8 E4M3 KV plus its block
    scales (the ``block_scale`` state SGLang registers beside it); KV whose scales SGLang does
    not hand the backend would land without them and decode garbage, so it is refused."""
    target = str(kv_cache_dtype_str or "").lower() == "mxfp8"
    if target and not any(p.kind == "block_scale" for p in layout.states):
        raise _not_supported(
            "KVArgs.kv_cache_dtype_str",
            kv_cache_dtype_str,
            "an MXFP8 KV pool whose block scales are not in KVArgs.state_types (SGLang registers an "
            "MHATokenToKVPoolMXFP8's as 'block_scale'): its KV would land without them",
        )
    draft = str(draft_dtype or "auto").lower()
    if layout.draft is not None and (draft == "mxfp8" or (draft == "auto" and target)):
        raise _not_supported(
            "--speculative-draft-kv-cache-dtype",
            draft_dtype or "auto",
            "an MXFP8 draft KV pool: SGLang registers the target pool's block scales only (KVArgs has none of the "
            "draft's), so the draft's KV would land without them; give the draft another KV dtype",
        )


# state a PP prefill's stage sends to the decode stage of the same PP rank only (its entries: K,
# then V or score, of the stage's layers, with no layer ids)
STAGE_TO_STAGE_KINDS = ("block_scale", "dsa_tail")


class KVXferKVManager(BaseKVManager):
    """One SGLang rank's transfer manager: an engine manager over SGLang's KV pool."""

    supports_host_destination = False
    # --enable-pd-role-switch: on an idle instance SGLang's scheduler calls teardown() and
    # builds a manager of the other role over the same KV pool (POST /pd_role_switch).
    supports_role_switch = True

    def __init__(self, args: KVArgs, disaggregation_mode: Any, server_args: Any, is_mla_backend: bool | None = False):
        from sglang_kvxfer.engine import KVManager, KVPool

        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        # (a hybrid linear-attention pool over an MLA pool, Kimi-Linear: SGLang passes False
        # and sets KVArgs.is_hybrid_mla_backend; its full-attention KV is an MLA latent)
        self.hybrid_mla = bool(getattr(args, "is_hybrid_mla_backend", False))
        self.is_mla_backend = bool(is_mla_backend) or self.hybrid_mla
        self.role = role_of(disaggregation_mode)
        self.plan = plan_from_server_args(resolved(server_args), self.role)
        if self.plan.dcp_size > 1 and not self.is_mla_backend:
            raise _not_supported(
                "--dcp-size",
                self.plan.dcp_size,
                "decode context parallel needs an MLA KV pool (SGLang's own backends require one too)",
            )
        self._dp_query_pool: concurrent.futures.ThreadPoolExecutor | None = None
        if self.role == "decode":
            install_dp_rank_query()  # SGLang's decode asks its bootstrap for placed rooms' groups
            _DECODE_MANAGERS.add(self)
        dtype = kv_dtype(getattr(args, "kv_cache_dtype_str", None), getattr(server_args, "dtype", None))
        draft_dtype = getattr(server_args, "speculative_draft_kv_cache_dtype", None)
        self.layout: SglangLayout = layout_from_kv_args(
            args,
            tp_size=self.plan.attn_tp_size,
            mla=self.is_mla_backend,
            dtype=dtype,
            total_kv_heads=lambda: seam("_model_total_kv_heads")(server_args),
            draft_kv=lambda: seam("_draft_model_kv")(server_args),
            draft_dtype=None if str(draft_dtype or "auto").lower() == "auto" else kv_dtype(draft_dtype),
            swa_kv_heads=lambda: seam("_model_swa_kv_heads")(server_args),
            dsa_index_head_dim=lambda: seam("_model_dsa_index_head_dim")(server_args),
            dcp_size=self.plan.dcp_size,
            cp_tp=self.plan.attn_cp_size if self.plan.cp_tp_sharing else 1,
        )
        _check_mxfp8(self.layout, getattr(args, "kv_cache_dtype_str", None), draft_dtype)
        if self.plan.prefill_complete and any(p.kind != "dsa" for p in self.layout.states):
            kinds = sorted({p.kind for p in self.layout.states if p.kind != "dsa"})
            raise _not_supported(
                "--disaggregation-decode-allocation-policy",
                "prefill_complete",
                f"with {', '.join(kinds)} state (SGLang's prefill_complete supports full-attention and DSA pools only)",
            )
        self.dcp_size, self.dcp_rank = self.plan.dcp_size, self.layout.tp_rank % self.plan.dcp_size
        if self.dcp_size > 1:
            _check_dcp(self)
        self.pp_size, self.pp_rank, layer_start = self._pp_stage(args)
        # state whose entries are not mapped over PP stages here (an SWA sub-pool's scales, whose
        # stages register the whole model's SWA layers). SGLang refuses MiniMax state with PP too.
        # (STAGE_TO_STAGE_KINDS move to a decode of the same PP size: _pp_problem refuses PP 1.)
        for pp_kinds, what, source, entries in (
            (("block_scale_swa",), "MXFP8 SWA KV block scales", "--kv-cache-dtype mxfp8", "scale entries (K, then V"),
            (MINIMAX_KINDS, "MiniMax sparse state", "MiniMaxSparseKVPool", "entries (index keys, dense K then V"),
        ):
            names = [p.name for p in self.layout.states if p.kind in pp_kinds]
            if self.pp_size > 1 and names:
                raise _not_supported(
                    "--pp-size",
                    self.pp_size,
                    f"with {what} ({describe(names)}, {source}): mapping a stage's {entries} of its layers) onto "
                    "the decode's is not implemented by the kvxfer backend",
                )
        if self.layout.kv_layout is not None:  # (DeepSeek-V4: KV moves as whole compressed pages)
            for flag, value, on in (
                ("--attn-cp-size", self.plan.attn_cp_size, self.plan.attn_cp_size > 1),
                ("--enable-kv-cache-sharding", True, self.plan.kv_sharded),
            ):
                if on:
                    raise _not_supported(
                        flag,
                        value,
                        f"with a compressed KV pool (KVArgs.kv_layout={self.layout.kv_layout!r}, DeepSeek-V4): "
                        "mapping its pages and state over CP ranks or shards is not implemented by the kvxfer backend",
                    )
        if self.pp_size > 1 and self.layout.kv_layout is None and any(p.kind == "swa" for p in self.layout.states):
            self.layout, layer_start = self._swa_stage(server_args, layer_start)
        lay = self.layout
        gpu_id = int(getattr(args, "gpu_id", 0) or 0)
        device = "cpu" if self.plan.device == "cpu" else f"cuda:{gpu_id}"
        # SGLang's deadlines where ours are not set (None: ours, as EngineConfig's defaults read them)
        bootstrap_s = sglang_timeout(envs.KVXFER_BOOTSTRAP_TIMEOUT_S, "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT")
        waiting_s = sglang_timeout(envs.KVXFER_WAITING_TIMEOUT_S, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT")
        self.dp_rank = self.plan.dp_rank(int(args.engine_rank), int(getattr(args, "system_dp_rank", 0) or 0))
        draft = lay.draft
        prefill = self.role == "prefill"
        # Prefill attention CP: SGLang materializes the request's KV on every CP rank. By
        # default CP rank 0 of each attention-TP rank sends every page and the others are
        # SGLang's dummy participants (its scheduler reads is_dummy_cp_rank): no engine,
        # nothing registered. With SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER, and always for
        # a hybrid MLA model (SGLang's cp_sharded_prefill), every CP rank registers as CP rank
        # c and sends its share of each request's pages (cp_page_share); the state, the same
        # on every CP rank, comes from CP rank 0.
        # With --enable-cp-tp-group-sharing (the CP group is the TP group), CP rank r holds
        # every KV head and its share of the linear-attention state, and transfers as TP rank r
        # of a CP-1 prefill (the layout says so: all_heads), as SGLang's own backends register it.
        self.cp_rank = self.plan.cp_rank(int(args.engine_rank))
        self.cp_tp_sharing = prefill and self.plan.cp_tp_sharing
        self.cp_sharded = (
            prefill
            and self.plan.attn_cp_size > 1
            and not self.cp_tp_sharing
            and not self.plan.cp_layer_split
            and (self.plan.cp_sharded or self.hybrid_mla)
        )
        if self.cp_sharded and self.dcp_size > 1:
            raise _not_supported(
                "--dcp-size",
                self.dcp_size,
                f"with --attn-cp-size={self.plan.attn_cp_size} every CP rank sends its share of the pages "
                "(SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER, or a hybrid MLA model), and a prefill's own DCP with "
                "it is not implemented (a decode's --dcp-size is; SGLang refuses --dcp-size with --enable-prefill-cp)",
            )
        # (with --enable-dsa-cache-layer-split each CP rank is a stage of its layers: _pp_stage)
        self.is_dummy_cp_rank = (
            prefill and self.cp_rank > 0 and not (self.cp_sharded or self.cp_tp_sharing or self.plan.cp_layer_split)
        )
        self.enable_all_cp_ranks_for_transfer = self.cp_sharded
        # --enable-kv-cache-sharding: logical page l of a request lives on shard rank l % N as
        # its local page l // N (SGLang's page interleave); each shard rank sends the pages it
        # holds at the positions of the decode's page list they take (sparse writes). The shard
        # group is the attention-CP group; without CP (an MLA model) the attention-TP group,
        # whose ranks each hold the whole latent: attention-TP rank t then registers as CP rank
        # t of a prefill of TP 1, so every decode rank reads each shard's pages from it.
        self.kv_sharded = prefill and self.plan.kv_sharded
        self.kv_shard = (0, 1)  # (shard rank, shard size)
        shard_tp = self.kv_sharded and self.plan.attn_cp_size == 1
        if self.kv_sharded:
            if shard_tp and not self.is_mla_backend:
                raise _not_supported(
                    "--enable-kv-cache-sharding",
                    True,
                    "without attention CP it shards an MLA model's latent over attention TP, and this model's KV is "
                    "not MLA (SGLang shards a GQA model's pages over attention CP only)",
                )
            other = [p.label for p in lay.states if p.kind != "dsa"]
            if other:
                raise _not_supported(
                    "--enable-kv-cache-sharding",
                    True,
                    f"with extra per-request state other than a DSA indexer ({', '.join(other)}): sharding it "
                    "is not implemented",
                )
            self.kv_shard = (lay.tp_rank, lay.tp_size) if shard_tp else (self.cp_rank, self.plan.attn_cp_size)
        cp_rank, cp_size = (self.cp_rank, self.plan.attn_cp_size) if self.cp_sharded else (0, 1)
        tp_size, tp_rank = lay.tp_size, lay.tp_rank
        if shard_tp:
            (cp_rank, cp_size), tp_size, tp_rank = self.kv_shard, 1, 0
        self.config = EngineConfig(
            self.role,
            lay.geometry,
            tp_size,
            tp_rank,
            self.plan.bootstrap,
            transport=transport_name(device, self.plan.ib_device, gpu_id),
            host=local_host(),
            device=device,
            bootstrap_timeout_s=envs.KVXFER_BOOTSTRAP_TIMEOUT_S.get() if bootstrap_s is None else bootstrap_s,
            waiting_timeout_s=envs.KVXFER_WAITING_TIMEOUT_S.get() if waiting_s is None else waiting_s,
            dp_rank=self.dp_rank,
            dp_size=self.plan.dp_groups if prefill else 1,
            draft_geometry=draft.geometry if draft is not None and prefill else None,
            state_pools=tuple(p.name for p in lay.states) if prefill else (),
            pp_rank=self.pp_rank if prefill else 0,
            pp_size=self.pp_size if prefill else 1,
            layer_start=layer_start,
            follows_room=self.plan.follows_room if prefill else True,
            api_port=self.plan.api_port if prefill else 0,
            dcp_size=self.dcp_size,
            cp_rank=cp_rank,
            cp_size=cp_size,
            all_heads=lay.all_heads,
            prefill_complete=prefill and self.plan.prefill_complete,
            kv_sharded=self.kv_sharded,
        )
        # The draft model's pool: a manager of its own, registered under kv_pool="draft".
        self.draft_config: EngineConfig | None = None
        if draft is not None:  # (with PP: the last stage's, registered there with the draft's own layers)
            self.draft_config = dataclasses.replace(
                self.config,
                geometry=draft.geometry,
                kv_pool="draft",
                draft_geometry=None,
                state_pools=(),  # (announced with the model's pool: a DSA model's MTP draft has its own KV only)
                layer_start=0,
                all_heads=False,
            )
        self._device = device
        self.engine: RankBase | None = None
        self.draft_engine: RankBase | None = None
        self.stage_status: StageStatus | None = None
        # Extra per-request state: a manager per pool, registered under kv_pool=pool.name.
        self.state_engines: list[tuple[StatePool, RankBase]] = []
        if not self.is_dummy_cp_rank:
            pool = KVPool.from_pointers(self.config.placement, lay.kv_ptrs, lay.kv_lens, device)
            self.engine = KVManager(self.config, pool)
        try:
            if draft is not None and self.draft_config is not None and self.engine is not None:
                draft_pool = KVPool.from_pointers(self.draft_config.placement, draft.kv_ptrs, draft.kv_lens, device)
                self.draft_engine = KVManager(self.draft_config, draft_pool)
            # (with KV cache sharding every shard rank sends its pages of the DSA indexer)
            sends_state = self.engine is not None and (self.kv_sharded or not (self.cp_sharded and self.cp_rank > 0))
            for state in lay.states if sends_state else ():
                config = self._state_config(state.geometry, state.name)
                state_pool = KVPool.from_pointers(config.placement, state.ptrs, state.lens, device)
                self.state_engines.append((state, KVManager(config, state_pool)))
            if prefill and self.plan.pp_size > 1 and self.engine is not None:
                # SGLang's PP prefill asks stage 0 whether a request is bootstrapped on every stage.
                self.stage_status = StageStatus(
                    self.pp_rank,
                    self.pp_size,
                    seam("_pp_exchange")(server_args, args),
                    key=self.config.key,
                    host=self.config.host,
                    session=self.engine.session,
                )
        except BaseException:
            self.close()
            raise
        # --disaggregation-enable-kv-checksum: verified here on CPU pools (per writer); on GPU
        # pools SGLang's scheduler digest covers ranks of the same TP width.
        self.kv_checksum = self.plan.kv_checksum and device == "cpu"
        if self.kv_checksum:
            seam("_defer_sglang_cpu_checksum")()
        elif self.plan.kv_checksum:
            log.info(
                "kvxfer: --disaggregation-enable-kv-checksum: this backend digests CPU pools only; on %s "
                "SGLang's own digest is verified between ranks of the same TP width",
                device,
            )
        self._unverified: set[str] = set()  # prefill addresses whose missing digests were logged
        self.prefill_info_table: dict[str, PrefillInfo] = {}
        self._lookups: dict[str, TopologyLookup] = {}  # decode: the prefill behind each bootstrap
        # decode PP 1 facing PP stages: (engine, config, buffers) per (pool, stage entry range);
        # facing a prefill whose CP ranks each send their share: per CP rank after the first
        self._slices: dict[tuple[str, int, int], tuple[DecodeManager, EngineConfig, tuple[int, ...]]] = {}
        dp, kind = self.plan.dp_groups, "attention DP" if self.plan.attn_dp_size > 1 else "DP replicas"
        where = f" of DP group {self.dp_rank}/{dp}" if prefill and dp > 1 else f" ({kind} {dp})" if dp > 1 else ""
        if self.pp_size > 1 and self.plan.cp_layer_split:  # (a prefill: CP ranks as stages of layers)
            where += f", attention CP rank {self.pp_rank}/{self.pp_size} of a DSA cache layer split"
            where += f", layers [{layer_start}, {layer_start + lay.geometry.num_layers})"
        elif self.pp_size > 1:
            span = f", layers [{layer_start}, {layer_start + lay.geometry.num_layers})" if prefill else ""
            if prefill and lay.states:  # a hybrid model: the KV pool holds some of the stage's layers
                span = f", from layer {layer_start} ({lay.geometry.num_layers} full-attention KV layers)"
            where += f", PP stage {self.pp_rank}/{self.pp_size}{span}"
        if self.plan.attn_cp_size > 1 and not self.plan.cp_layer_split:
            where += f", attention CP rank {self.cp_rank}/{self.plan.attn_cp_size}"
            where += " (sends its share of each request's pages)" if self.cp_sharded and not self.kv_sharded else ""
        if self.kv_sharded:
            rank, size = self.kv_shard
            group = "attention-TP" if shard_tp else "attention-CP"
            where += f", KV cache shard {rank}/{size} over the {group} group (sends the pages it holds)"
            where += " (holds every KV head, sends those of its TP rank)" if self.cp_tp_sharing else ""
        if self.is_dummy_cp_rank:
            log.info(
                "kvxfer prefill rank %d/%d%s: a CP replica, sends nothing (CP rank 0 sends every page)",
                lay.tp_rank,
                lay.tp_size,
                where,
            )
            return
        log.info(
            "kvxfer %s rank %d/%d%s: %s%s over %s%s",
            self.role,
            lay.tp_rank,
            lay.tp_size,
            where,
            lay.geometry,
            f" and draft-model KV {draft.geometry}" if draft is not None else "",
            self.config.transport,
            "; the decode allocates once the prefill's forward finished (prefill_complete)"
            if self.plan.prefill_complete
            else "",
        )
        for state, _ in self.state_engines:
            log.info("kvxfer %s rank %d/%d: %s: %s", self.role, lay.tp_rank, lay.tp_size, state.label, state.geometry)

    def _swa_stage(self, server_args: Any, layer_start: int) -> tuple[SglangLayout, int]:
        """A PP stage of a hybrid sliding-window model: SGLang's ``SWAKVPool`` holds every
        layer of the model on each stage (its KVArgs list the whole model's full-attention and
        SWA entries, ``prefill_start_layer`` 0) while the stage's forward writes its own layers'
        entries only. So this rank's pools become the entries of its stage's layers, and its
        first layer the stage's (``layout, layer_start``); pools that hold the stage's layers
        only are kept."""
        found = seam("_model_swa_stage_layers")(server_args, self.pp_rank, self.pp_size)
        if found is None:
            return self.layout, layer_start
        stage, full, swa = found
        lay, pool = self.layout, next(p for p in self.layout.states if p.kind == "swa")
        n_kv, n_swa = lay.geometry.num_layers, pool.geometry.num_layers
        if (n_kv, n_swa) == (len(full), len(swa)):  # whole-model pools: take the stage's entries
            what = f"the full-attention KV of PP stage {self.pp_rank}"
            geometry, ptrs, lens = layer_slice(lay.geometry, lay.kv_ptrs, lay.kv_lens, stage_entries(full, stage, what))
            part = stage_entries(swa, stage, f"the {pool.label} of PP stage {self.pp_rank}")
            g, p, n = layer_slice(pool.geometry, pool.ptrs, pool.lens, part)
            states = tuple(dataclasses.replace(x, geometry=g, ptrs=p, lens=n) if x is pool else x for x in lay.states)
            layout = dataclasses.replace(lay, geometry=geometry, kv_ptrs=ptrs, kv_lens=lens, states=states)
            return layout, stage.start if self.role == "prefill" else layer_start
        mine = (sum(1 for i in full if i in stage), sum(1 for i in swa if i in stage))
        if (n_kv, n_swa) == mine:  # pools of the stage's layers only
            return self.layout, stage.start if self.role == "prefill" else layer_start
        raise KVXferError(
            f"PP stage {self.pp_rank}/{self.pp_size} of a hybrid sliding-window model: its pools hold {n_kv} "
            f"full-attention and {n_swa} SWA layers; the model has {len(full)} and {len(swa)}, the stage's layers "
            f"[{stage.start}, {stage.stop}) {mine[0]} and {mine[1]}"
        )

    def _state_config(self, geometry: KVGeometry, name: str) -> EngineConfig:
        """The engine config of a state pool's manager (registered under ``kv_pool=name``)."""
        return dataclasses.replace(
            self.config, geometry=geometry, kv_pool=name, draft_geometry=None, state_pools=(), all_heads=False
        )

    def _pp_stage(self, args: KVArgs) -> tuple[int, int, int]:
        """``(pp_size, pp_rank, first layer of this rank's pool)`` from SGLang's ``--pp-size``
        and ``KVArgs.pp_rank`` / ``prefill_start_layer`` (a decode's first layer is not known
        to it, nor needed: its stage talks to the prefill stage of its own rank)."""
        size = self.plan.pp_size
        rank = getattr(args, "pp_rank", 0) or 0
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise KVXferError(f"KVArgs.pp_rank={rank!r} must be an int in [0, --pp-size={size})")
        if self.role == "prefill" and self.plan.cp_layer_split:
            # --enable-dsa-cache-layer-split: each CP rank's pool holds a contiguous share of the
            # layers (KVArgs list those only, from prefill_start_layer, the draft model's on the
            # last CP rank), every page of them: it sends as a PP stage of its layers would.
            size, rank = self.plan.attn_cp_size, self.plan.cp_rank(int(args.engine_rank))
            if self.layout.draft is not None and rank != size - 1:
                raise KVXferError(
                    f"KVArgs of attention CP rank {rank} of {size} with --enable-dsa-cache-layer-split carry a {DRAFT} "
                    f"(num_draft_entries={self.layout.num_draft_entries}): SGLang hands it to the last CP rank only"
                )
        elif size > 1 and self.layout.draft is not None and rank != size - 1:
            # SGLang 0.5.23 runs the draft model on the last PP stage only (EagleWorkerV2's
            # _hosts_draft), so only that stage appends a draft pool to its KVArgs.
            raise KVXferError(
                f"KVArgs of {self.role} PP stage {rank} of --pp-size={size} carry a {DRAFT} "
                f"(num_draft_entries={self.layout.num_draft_entries}): kvxfer moves it from and to the last PP "
                f"stage ({size - 1}), where SGLang runs the draft model"
            )
        if self.role != "prefill" or size == 1:
            return size, rank, 0
        start = getattr(args, "prefill_start_layer", None)
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            what = f"CP rank {rank}, DSA cache layer split" if self.plan.cp_layer_split else f"PP stage {rank}"
            raise KVXferError(f"KVArgs.prefill_start_layer={start!r} must be an int >= 0 ({what})")
        return size, rank, start

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

    @property
    def prefill_draft_engine(self) -> PrefillManager | None:
        """The prefill engine of the draft model's pool (None without a draft model)."""
        from sglang_kvxfer.engine.prefill import PrefillManager

        engine = self.draft_engine
        if engine is not None and not isinstance(engine, PrefillManager):
            raise TypeError(f"the kvxfer {self.role} manager has no prefill draft engine")
        return engine

    @property
    def prefill_state_engines(self) -> list[tuple[StatePool, PrefillManager]]:
        """``(pool, prefill engine)`` of every state pool (empty without state)."""
        from sglang_kvxfer.engine.prefill import PrefillManager

        out = [(p, e) for p, e in self.state_engines if isinstance(e, PrefillManager)]
        if len(out) != len(self.state_engines):
            raise TypeError(f"the kvxfer {self.role} manager has no prefill state engines")
        return out

    @property
    def decode_state_engines(self) -> list[tuple[StatePool, DecodeManager]]:
        """``(pool, decode engine)`` of every state pool (empty without state)."""
        from sglang_kvxfer.engine.decode import DecodeManager

        out = [(p, e) for p, e in self.state_engines if isinstance(e, DecodeManager)]
        if len(out) != len(self.state_engines):
            raise TypeError(f"the kvxfer {self.role} manager has no decode state engines")
        return out

    @property
    def decode_draft_engine(self) -> DecodeManager | None:
        """The decode engine of the draft model's pool (None without a draft model)."""
        from sglang_kvxfer.engine.decode import DecodeManager

        engine = self.draft_engine
        if engine is not None and not isinstance(engine, DecodeManager):
            raise TypeError(f"the kvxfer {self.role} manager has no decode draft engine")
        return engine

    def register_to_bootstrap(self) -> None:
        """Prefill: wait until this rank is registered with the bootstrap (the engine
        registers in the background from construction); raise if that failed or timed out.
        Decode: nothing to register."""
        if self.role == "prefill" and not self.is_dummy_cp_rank:
            self.prefill_engine.wait_registered(self.config.bootstrap_timeout_s)
            draft = self.prefill_draft_engine
            if draft is not None:
                draft.wait_registered(self.config.bootstrap_timeout_s)
            for _, engine in self.prefill_state_engines:
                engine.wait_registered(self.config.bootstrap_timeout_s)

    # -- what SGLang's decode scheduler calls beyond the base class ------------------------------
    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Non-blocking: True once the prefill at ``bootstrap_addr`` is known (or its lookup
        failed: the requests then fail with the reason). Its PP stages are learned first; each
        engine manager that will receive from it then looks up its group (stage)."""

        if self.role != "decode":
            raise ValueError("try_ensure_parallel_info() is a decode-side call")
        try:
            parse_host_port(bootstrap_addr, "bootstrap_addr")
        except ValueError:
            return False
        topo = self._topology(bootstrap_addr)
        if isinstance(topo, str):  # the prefill never registered
            self.prefill_info_table[bootstrap_addr] = PrefillInfo(attn_tp_size=0, problem=topo, routable=False)
            return True
        if topo is None:
            return False
        problem = self._pp_problem(topo)
        if not problem and topo.kv_sharded and self.dcp_size > 1:
            problem = (
                f"--dcp-size={self.dcp_size}: the prefill runs --enable-kv-cache-sharding (its CP ranks hold a "
                "request's pages interleaved), which a decode with DCP does not read (SGLang refuses it too)"
            )
        if not problem and topo.cp_size > 1 and self.dcp_size > 1 and topo.dcp_size != 1:
            problem = (
                f"--dcp-size={self.dcp_size}: the prefill's {topo.cp_size} attention-CP ranks each send their share of "
                f"a request's pages and it runs --dcp-size={topo.dcp_size} itself, which is not implemented (a decode "
                "with DCP reads CP shares from a prefill of --dcp-size 1)"
            )
        if problem:
            info = PrefillInfo(
                attn_tp_size=topo.tp_size,
                dp_size=topo.dp_size,
                problem=problem,
                pp_size=topo.pp_size,
                pp_layers=topo.pp_layers,
                routable=False,
            )
            self.prefill_info_table[bootstrap_addr] = info
            return True
        # Each group's lookup starts here (the receivers wait for it). Only the topology's
        # bootstrap answer is waited for, not the groups' own lookups nor the prefill ranks'
        # acknowledgement of this rank's registration: SGLang gives up on an address after 15
        # calls about a second apart, and a bootstrap or prefill rank starved of CPU can take
        # longer than that to answer (the requests wait for it under the bootstrap timeout and
        # fail with the reason). A group that has already failed fails its requests with its
        # reason, so nothing is checked here then.
        statuses = [
            part.engine.prefill_group_status(part.address) for _, part in self._stage_parts(bootstrap_addr, topo, 0)
        ]
        failed = any(s[0] == "failed" for s in statuses)
        tp_size, geometry = topo.tp_size, topo.geometry  # (stage 0 of DP group 0, as the first group's)
        # The DP groups, draft pool and state pools came with the topology (one bootstrap reply).
        dp_size, dp_groups, draft, states = topo.dp_size, topo.dp_groups, topo.draft_geometry, topo.state_pools
        ours = self.layout.geometry.page_size
        if geometry.page_size != ours:
            # The scheduler counts whole pages on both sides (as SGLang's own backends
            # require): the page sizes must agree.
            problem = (
                f"page_size: prefill={geometry.page_size} decode={ours} (start both servers with the same --page-size)"
            )
        if not failed and not problem:
            # a decode of several PP stages holds the draft pool on its last stage only, as the prefill
            theirs = draft if self.pp_size == 1 or self.pp_rank == self.pp_size - 1 else None
            problem = draft_problem(theirs, self.layout.draft.geometry if self.layout.draft else None)
        if not failed and not problem:
            problem = state_problem(states, self.layout.states, tp_size, self.layout.tp_size)
        if not failed and not problem and topo.dcp_size not in (1, self.dcp_size):
            # SGLang's rule (requires_dcp_relayout): DCP 1 -> N is relaid out, equal sizes move
            # page for page between ranks of the same DCP rank, anything else is refused
            problem = (
                f"--dcp-size: prefill={topo.dcp_size} decode={self.dcp_size} (a decode takes DCP KV from a prefill "
                "of --dcp-size 1 or of its own --dcp-size)"
            )
        self.prefill_info_table[bootstrap_addr] = PrefillInfo(
            attn_tp_size=tp_size,
            dp_size=dp_size,
            problem=problem,
            dp_groups=dp_groups,
            draft_geometry=draft,
            pp_size=topo.pp_size,
            pp_layers=topo.pp_layers,
            state_pools=states,
            follow_bootstrap_room=topo.follows_room,
            prefill_http_port=topo.api_port or None,
            dcp_size=topo.dcp_size,
            all_heads=topo.all_heads,
            kv_sharded=topo.kv_sharded,
        )
        return True

    def _topology(self, bootstrap_addr: str) -> PrefillTopology | str | None:
        """The prefill's stages (None while looked up; the reason if the lookup failed)."""
        lookup = self._lookups.get(bootstrap_addr)
        if lookup is None:
            eng = self.decode_engine
            lookup = self._lookups[bootstrap_addr] = TopologyLookup(
                bootstrap_addr,
                key=self.config.key,
                session=eng.session,
                tp_rank=eng.tp_rank,
                timeout_s=self.config.bootstrap_timeout_s,
                state_pools=[p.name for p in self.layout.states] if self.pp_size == 1 else (),
            )
        if lookup.result is not None:
            return lookup.result
        if lookup.error:  # reported once; the next call looks again (the prefill may start later)
            del self._lookups[bootstrap_addr]
            lookup.close()
            return lookup.error
        return None

    def _pp_problem(self, topo: PrefillTopology) -> str:
        """Why this decode rank cannot receive from the prefill's PP stages ("" if it can)."""
        problem = pp_rule_problem(self.pp_size, topo.pp_size)
        if problem or topo.pp_size == 1:
            return problem
        ours = self.layout.geometry.num_layers
        if self.pp_size == 1 and not self.layout.states:
            return tiling_problem(topo.pp_layers, ours)
        if self.pp_size == 1:  # a hybrid model: the KV pool holds the full-attention layers only
            # (a DeepSeek-V4 pool's every pool: its entries are grouped by compression ratio per stage)
            dsv4 = self.layout.kv_layout is not None
            staged = [p.label for p in self.layout.states if dsv4 or p.kind in STAGE_TO_STAGE_KINDS]
            if staged:
                return (
                    f"{staged[0]}: the prefill's {topo.pp_size} PP stages each send the entries of their own layers "
                    "(K, then V scales or score rings of the stage's layers; DeepSeek-V4's compressed pools and "
                    "state grouped by compression ratio), "
                    "which a decode of PP 1 would need mapped into its own entries; that mapping is not implemented "
                    f"by the kvxfer backend: serve the decode with --pp-size {topo.pp_size}"
                )
            problem = count_problem("the full-attention KV", [len(r) for r in topo.pp_layers], ours)
            counts = dict(topo.state_counts)
            for pool in self.layout.states:
                if problem or pool.name not in counts:  # (a pool the prefill lacks: state_problem says so)
                    continue
                if pool.shared:  # (every stage holds it whole: QSA's RoPE ring)
                    problem = next(
                        (
                            count_problem(f"{pool.label} of PP stage {s}", [n], pool.geometry.num_layers)
                            for s, n in enumerate(counts[pool.name])
                            if n != pool.geometry.num_layers
                        ),
                        "",
                    )
                else:
                    problem = count_problem(pool.label, counts[pool.name], pool.geometry.num_layers)
            return problem
        theirs = topo.pp_layers[self.pp_rank]
        if len(theirs) != ours:
            return (
                f"{stage_label(self.pp_rank, theirs)} of the prefill holds {len(theirs)} layers, this decode's PP "
                f"stage {self.pp_rank} holds {ours}: serve the same model with the same layer split "
                "(SGLANG_PP_LAYER_PARTITION) on both servers"
            )
        return ""

    def _stage_parts(
        self, bootstrap_addr: str, topo: PrefillTopology | None, dp_rank: int
    ) -> list[tuple[int, ReceivePart]]:
        """``(prefill PP stage, part)`` of a request routed to DP group ``dp_rank``: the whole
        pool from the prefill's only stage, or from the stage of this decode's own PP rank;
        with a decode of PP 1 and a prefill of several stages, one part per stage over the
        layers it holds (the last stage's part delivers the metadata slot, as SGLang sends it
        from the last PP rank). A prefill whose CP ranks each send their share of a request's
        pages: one part per CP rank of each of those stages (CP rank 0's delivers the
        metadata slot)."""
        from sglang_kvxfer.engine import bootstrap

        lay = self.layout
        n = topo.cp_size if topo is not None else 1
        if topo is None or topo.pp_size == 1 or self.pp_size == topo.pp_size:
            staged = topo is not None and topo.pp_size > 1
            s = self.pp_rank if staged else 0
            label = ""
            if topo is not None and staged:  # (a hybrid model's: the entries of this stage's pool)
                mine = range(lay.geometry.num_layers) if lay.states else None
                label = stage_label(s, topo.pp_layers[s], mine)
            parts = []
            for c in range(n):
                engine, config, ptrs = self.cp_engine(c)
                address = bootstrap.group_address(bootstrap_addr, dp_rank, s, c)
                parts.append((s, ReceivePart(_cp_label(label, c, n), engine, address, config, ptrs, c == 0, (c, n))))
            return parts
        parts = []
        # a hybrid model's KV pool holds the full-attention layers only: stage by entry counts
        spans = entry_spans([len(r) for r in topo.pp_layers]) if lay.states else topo.pp_layers
        for s, (layers, span) in enumerate(zip(topo.pp_layers, spans)):
            label = stage_label(s, layers, span if lay.states else None)
            for c in range(n):
                engine, config, ptrs = self._slice(span, cp_rank=c)
                address = bootstrap.group_address(bootstrap_addr, dp_rank, s, c)
                aux = s == topo.pp_size - 1 and c == 0
                parts.append((s, ReceivePart(_cp_label(label, c, n), engine, address, config, ptrs, aux, (c, n))))
        return parts

    def state_parts(self, bootstrap_addr: str, dp_rank: int) -> list[StatePart]:
        """The engine requests of a decode request's state (routed to prefill DP group
        ``dp_rank``): each pool from the prefill's only stage or from the stage of this
        decode's PP rank; on a decode of PP 1 facing several stages, each pool's entries of
        each stage (one after another in stage order, by the counts the stages registered)
        from that stage, into that slice of the pool."""
        from sglang_kvxfer.engine import bootstrap

        lookup = self._lookups.get(bootstrap_addr)
        topo = lookup.result if lookup is not None else None
        if topo is None or topo.pp_size == 1 or self.pp_size == topo.pp_size:
            s = self.pp_rank if topo is not None and topo.pp_size > 1 else 0
            if topo is not None and topo.kv_sharded:  # each shard rank's pages of the indexer
                n, parts = topo.cp_size, []
                for pool, engine in self.decode_state_engines:
                    for c in range(n):
                        made = engine if c == 0 else self._slice(range(pool.geometry.num_layers), pool, c)[0]
                        address = bootstrap.group_address(bootstrap_addr, dp_rank, s, c)
                        parts.append(StatePart(pool, _cp_label(pool.label, c, n), made, address, sparse=True))
                return parts
            address = bootstrap.group_address(bootstrap_addr, dp_rank, s)
            return [StatePart(pool, pool.label, engine, address) for pool, engine in self.decode_state_engines]
        counts = dict(topo.state_counts)
        parts = []
        for pool in self.layout.states:
            if pool.name not in counts:
                raise KVXferError(f"{pool.label}: the prefill's PP stages registered no such pool")
            spans = entry_spans(counts[pool.name])
            if pool.shared:  # every stage sends it whole, into the whole pool (the same bytes)
                spans = tuple(range(pool.geometry.num_layers) for _ in counts[pool.name])
            for s, (layers, span) in enumerate(zip(topo.pp_layers, spans)):
                if not len(span):  # this stage has none of the pool's layers
                    continue
                engine, _, _ = self._slice(span, pool, stage=s if pool.shared else None)
                address = bootstrap.group_address(bootstrap_addr, dp_rank, s)
                parts.append(StatePart(pool, f"{pool.label} of {stage_label(s, layers, span)}", engine, address))
        return parts

    def cp_engine(self, cp_rank: int, draft: bool = False) -> tuple[DecodeManager, EngineConfig, tuple[int, ...]]:
        """``(engine manager, config, buffers)`` receiving prefill CP rank ``cp_rank``'s share of
        a request (of the draft model's pool with ``draft``) when every CP rank sends its own:
        an engine manager holds one request per room, so each CP rank after the first gets a
        manager of its own over the same buffers, made once and closed with this manager."""
        from sglang_kvxfer.engine import KVManager, KVPool
        from sglang_kvxfer.engine.decode import DecodeManager

        lay = self.layout
        main, config, ptrs, lens = self.decode_engine, self.config, lay.kv_ptrs, lay.kv_lens
        if draft:
            engine, draft_config = self.decode_draft_engine, self.draft_config
            if engine is None or draft_config is None or lay.draft is None:
                raise KVXferError(f"this decode rank has no {DRAFT}")
            main, config, ptrs, lens = engine, draft_config, lay.draft.kv_ptrs, lay.draft.kv_lens
        if cp_rank == 0:
            return main, config, ptrs
        key = (f"{'draft.' if draft else ''}cp{cp_rank}", 0, 0)
        made = self._slices.get(key)
        if made is None:
            built = KVManager(config, KVPool.from_pointers(config.placement, ptrs, lens, self._device))
            if not isinstance(built, DecodeManager):  # KVManager builds one for a decode config
                raise TypeError(f"expected a decode engine for {key}, got {type(built).__name__}")
            made = self._slices[key] = (built, config, ptrs)
        return made

    def _slice(
        self, entries: range, pool: StatePool | None = None, cp_rank: int = 0, stage: int | None = None
    ) -> tuple[DecodeManager, EngineConfig, tuple[int, ...]]:
        """An engine manager over ``entries`` (layers) of this rank's KV pool, or of its state
        pool ``pool`` (a layer-slice view of SGLang's buffers), made once per pool, range and
        prefill CP rank (each CP rank's share of a request is an engine request of its own,
        and an engine manager holds one request per room), or PP ``stage`` (a ``shared`` pool
        every stage sends whole), and closed with this manager."""
        from sglang_kvxfer.engine import KVManager, KVPool
        from sglang_kvxfer.engine.decode import DecodeManager

        name = "" if pool is None else pool.name
        name = f"{name}.cp{cp_rank}" if cp_rank else name
        key = (f"{name}.pp{stage}" if stage is not None else name, entries.start, entries.stop)
        made = self._slices.get(key)
        if made is None:
            lay = self.layout
            if pool is None:
                geometry, ptrs, lens = layer_slice(lay.geometry, lay.kv_ptrs, lay.kv_lens, entries)
                config = dataclasses.replace(self.config, geometry=geometry)
            else:
                geometry, ptrs, lens = layer_slice(pool.geometry, pool.ptrs, pool.lens, entries)
                config = self._state_config(geometry, pool.name)
            engine = KVManager(config, KVPool.from_pointers(config.placement, ptrs, lens, self._device))
            if not isinstance(engine, DecodeManager):  # KVManager builds one for a decode config
                raise TypeError(f"expected a decode engine for {key}, got {type(engine).__name__}")
            made = self._slices[key] = (engine, config, ptrs)
        return made

    def receive_parts(self, bootstrap_addr: str, dp_rank: int) -> list[ReceivePart]:
        """The engine requests a decode request routed to prefill DP group ``dp_rank`` is made
        of (one over the whole pool from DP group ``dp_rank`` while the prefill's stages are
        not known: a request inited before ``try_ensure_parallel_info`` said True)."""
        lookup = self._lookups.get(bootstrap_addr)
        topo = lookup.result if lookup is not None else None
        return [part for _, part in self._stage_parts(bootstrap_addr, topo, dp_rank)]

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        # A decode rank of another TP width receives a slice of what the prefill digested; a
        # decode of PP 1 receives every stage's layers, where each stage digested its own; a
        # decode DCP rank of a prefill of DCP 1 every N-th token of its pages; a prefill rank
        # of CP-TP group sharing holds (and digests) every head, the decode rank a TP share.
        info = self.prefill_info_table.get(bootstrap_addr)
        return (
            info is not None
            and not info.all_heads
            and info.attn_tp_size == self.layout.tp_size
            and info.pp_size == self.pp_size
            and info.dcp_size == self.dcp_size
        )

    def query_prefill_dp_ranks(self, bootstrap_addr: str, bootstrap_rooms: list[int]) -> dict[str, int]:
        """The prefill DP group of each of ``bootstrap_rooms`` that the prefill behind
        ``bootstrap_addr`` registered (SGLang's ``CommonKVReceiver.query_prefill_dp_ranks``,
        answered by our bootstrap: ``{str(room): dp_rank}``). A bootstrap that does not answer
        is logged and answers nothing: SGLang asks again on its next pass."""
        from sglang_kvxfer.engine import bootstrap

        try:
            found = bootstrap.room_groups(
                bootstrap_addr,
                bootstrap_rooms,
                session=self.decode_engine.session,
                timeout_s=DP_QUERY_TIMEOUT_S,
                key=self.config.key,
            )
        except KVXferError as exc:
            log.warning(
                "kvxfer: asking %s for the DP groups of %d room(s): %s", bootstrap_addr, len(bootstrap_rooms), exc
            )
            return {}
        return {str(room): dp for room, dp in found.items()}

    def _ensure_prefill_recompute_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The pool SGLang's decode runs ``query_prefill_dp_ranks`` on ahead of time (its name
        is SGLang's, which shares one pool with prefill recompute)."""
        if self._dp_query_pool is None:
            self._dp_query_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kvxfer-dp-query")
        return self._dp_query_pool

    def submit_prefill_recompute(self, receiver: KVXferKVReceiver, payload: Any = None) -> None:
        """PD retraction with prefill recompute ("rebootstrap"): SGLang's decode retracted a
        request (``/pause_generation`` with ``mode="retract"``, around a weight update) and,
        on resume, receives its KV again through a new receiver of the same room; this asks
        the prefill server to compute it (``POST /generate`` with SGLang's ``payload``,
        ``max_new_tokens=1``), which then sends it as for any request. Only the leader (rank
        0 of the attention-TP group, first PP stage) asks: the prefill sends to every decode
        rank. The prefill's HTTP port comes from its registration with the bootstrap. A
        failure (no port registered, an HTTP error, no answer within the waiting timeout)
        fails the request with the reason."""
        if self.layout.tp_rank != 0 or self.pp_rank != 0:
            return
        info = self.prefill_info_table.get(receiver.bootstrap_addr)
        port = info.prefill_http_port if info is not None else None
        if not port:
            receiver._fail(
                f"PD retraction's prefill recompute: the prefill behind {receiver.bootstrap_addr} registered no "
                "HTTP port (a kvxfer older than protocol 10, or not yet looked up)"
            )
            return
        host = parse_host_port(receiver.bootstrap_addr)[0].strip("[]")
        url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/generate"
        self._ensure_prefill_recompute_executor().submit(self._recompute, receiver, url, payload or {})

    def _recompute(self, receiver: KVXferKVReceiver, url: str, payload: dict) -> None:
        import json
        import urllib.error
        import urllib.request

        body = json.dumps(payload).encode()
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        timeout = self.config.waiting_timeout_s
        problem = ""
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                answer.read()
        except urllib.error.HTTPError as exc:
            text = exc.read()[:300].decode(errors="replace")
            problem = f"POST {url} answered {exc.code}: {text}"
        except Exception as exc:  # refused, unreachable, timed out
            problem = f"POST {url} failed: {type(exc).__name__}: {exc}"
        engine = receiver._engine
        if problem and not (engine is not None and engine.poll() == KVPoll.Success):  # the KV may have landed
            receiver._fail(f"PD retraction's prefill recompute: {problem}")

    def teardown(self) -> None:
        """Release this role's transfer resources for SGLang's runtime role switch: every
        engine manager's threads, sockets, transport and memory registrations (the KV pool
        is SGLang's and stays), and a prefill rank's entry in the bootstrap it registered
        with, so that bootstrap stops naming it to decode ranks. The manager of the other
        role is then built over the same pool; this one is not used again."""
        self.close()

    def close(self) -> None:
        """Stop the engine managers (threads, sockets, registrations). Idempotent."""
        pool = getattr(self, "_dp_query_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
            self._dp_query_pool = None
        _DECODE_MANAGERS.discard(self)
        for lookup in getattr(self, "_lookups", {}).values():
            lookup.close()
        for engine, _, _ in getattr(self, "_slices", {}).values():
            engine.close()
        if self.stage_status is not None:
            self.stage_status.close()
        for _, engine in getattr(self, "state_engines", []):
            engine.close()
        if self.draft_engine is not None:
            self.draft_engine.close()
        if self.engine is not None:
            self.engine.close()


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
