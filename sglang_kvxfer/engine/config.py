"""Engine configuration: one frozen dataclass, validated on construction.

Defaults come from ``envs`` (``KVXFER_*``); every field can be given explicitly. Must not
start anything.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from sglang_kvxfer import auth, envs
from sglang_kvxfer.geometry import KVGeometry, RankPlacement
from sglang_kvxfer.protocol.messages import STATE_POOL_PATTERN

__all__ = ["EngineConfig", "parse_host_port"]

ENGINE_VERSION = "sglang_kvxfer-0.1"
_STATE_POOL = re.compile(STATE_POOL_PATTERN)


def parse_host_port(text: str, name: str = "bootstrap") -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; a clear ``ValueError`` otherwise."""
    if not isinstance(text, str) or ":" not in text:
        raise ValueError(f"{name}={text!r} must look like 'host:port'")
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name}={text!r} must look like 'host:port' with a port in 1..65535")
    return host, int(port)


def config_key(value, bind_host: str) -> bytes:
    """The 32-byte key (or ``b""`` for off) of an ``auth_key`` argument; see ``EngineConfig``."""
    if value is None:
        return auth.resolve_key(bind_host)
    if isinstance(value, str) and value.strip().lower() == "off":
        return auth.OFF
    if isinstance(value, (bytes, bytearray)) and len(value) == 32:
        return bytes(value)
    if isinstance(value, str):
        return auth.key_from_secret(value)
    if isinstance(value, (bytes, bytearray)):
        return auth.key_from_secret(bytes(value))
    raise ValueError(f"auth_key must be None, 'off', a secret text or 32 key bytes, got {type(value).__name__}")


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive number")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one rank's ``KVManager`` needs.

    Args:
        role: ``"prefill"`` or ``"decode"``.
        geometry: this rank's pool geometry (its page size and layout may differ from the
            peer's; model fields must match).
        tp_size, tp_rank: this rank's TP placement.
        dp_rank, dp_size: a prefill rank's attention-DP group and the number of groups
            behind its bootstrap (SGLang ``--enable-dp-attention``; each group is a TP group
            of ``tp_size`` ranks). Registered with the bootstrap; 0 and 1 without DP.
        bootstrap: ``"host:port"`` of the bootstrap service (prefill registers there;
            decode looks prefill up there).
        transport: transport name (``local``, ``tcp``, ``nixl``, ``mori``).
        transport_options: keyword options of that transport.
        host: address this rank advertises for its control inbox.
        device: ``"cpu"`` or ``"cuda:N"`` for pools allocated by the engine.
        data_path: ``auto``, ``direct``, ``staged``, ``fused`` or ``per_token`` for every (writer,
            reader) pair (``KVXFER_DATA_PATH``); direct_min_op_bytes: ``auto``'s fixed rule,
            the smallest average direct op (``KVXFER_DIRECT_MIN_OP_BYTES``); None (unset):
            the cost rule, from the transport's ``path_cost``.
        auth_key: the shared secret that authenticates control frames (see ``auth.py``);
            None takes it from the environment or the per-user key file.
        kv_pool: which of the rank's KV pools this manager moves: ``""`` the model's,
            ``"draft"`` a speculative decoding draft model's, ``"state:<kind>[.<n>]"`` a
            component of the model's extra per-request state (each its own geometry;
            registered and looked up at the bootstrap separately, by a manager of its own).
        draft_geometry: a prefill manager of the model's pool: the geometry of the draft
            pool the same rank serves (announced with its registration), None if none.
        state_pools: a prefill manager of the model's pool: the names of the state pools
            the same rank serves (announced with its registration), empty if none.
        pp_rank, pp_size, layer_start: a prefill rank's pipeline-parallel stage, the number
            of stages, and the first model layer its pool holds (the geometry's
            ``num_layers`` is the stage's layer count). Registered with the bootstrap; 0, 1
            and 0 without PP.
        follows_room: a prefill rank with several DP groups: True when a request's group
            is ``bootstrap_room % dp_size`` (SGLang's ``follow_bootstrap_room``); False when
            SGLang's load balancer places requests and the group registers each room with
            the bootstrap (``PrefillManager.route_room``). Registered with the bootstrap.
        api_port: a prefill rank's server's HTTP port (0: none), registered with the
            bootstrap so a decode can ask that server to compute a request again (SGLang's
            PD retraction with prefill recompute).
        dcp_size: a prefill rank's decode-context-parallel size: rank r holds the tokens
            ``t % dcp_size == r % dcp_size`` of a request in its pages (registered with the
            bootstrap; a decode of the same size reads them page for page).
        cp_rank, cp_size: a prefill rank's attention-CP rank and the number of CP ranks that
            send, each its share of a request's pages (SGLang's sharded prefill CP;
            registered with the bootstrap, a decode reads each share from its CP rank); 0 and
            1 where one rank per attention-TP rank sends every page.
        all_heads: a prefill rank whose pool holds every KV head of the model while it sends
            the heads of TP rank ``tp_rank`` of ``tp_size`` (SGLang's CP-TP group sharing:
            CP rank r holds the whole KV and transfers as TP rank r). Registered with the
            bootstrap, so a decode addresses the heads in that pool.
        kv_sharded: a prefill whose ``cp_size`` CP ranks hold a request's pages interleaved
            (SGLang's KV cache sharding: logical page l on CP rank ``l % cp_size`` as its
            local page ``l // cp_size``): each sends the pages it holds at the positions of
            the decode's page list it names (``KVSender.send(positions=)``). Registered with
            the bootstrap, so a decode asks each CP rank for sparse writes of its whole list.
        prefill_complete: a prefill rank that tells a decode rank watching a room
            (``RoomWatch``) once the room's forward finished (``KVSender.mark_prefill_complete``;
            SGLang's ``--disaggregation-decode-allocation-policy prefill_complete``, where the
            decode allocates only then). A rank without it fails a watched room at once,
            naming the policy (its forwards never say so: the decode would wait in vain).
    """

    role: str
    geometry: KVGeometry
    tp_size: int
    tp_rank: int
    bootstrap: str
    transport: str = "local"
    transport_options: dict = field(default_factory=dict)
    host: str = "127.0.0.1"
    device: str = "cpu"
    bootstrap_timeout_s: float = field(default_factory=envs.KVXFER_BOOTSTRAP_TIMEOUT_S.get)
    waiting_timeout_s: float = field(default_factory=envs.KVXFER_WAITING_TIMEOUT_S.get)
    transfer_timeout_s: float = field(default_factory=envs.KVXFER_TRANSFER_TIMEOUT_S.get)
    heartbeat_interval_s: float = field(default_factory=envs.KVXFER_HEARTBEAT_INTERVAL_S.get)
    heartbeat_timeout_s: float = field(default_factory=envs.KVXFER_HEARTBEAT_TIMEOUT_S.get)
    heartbeat_starved_grace_s: float = field(default_factory=envs.KVXFER_HEARTBEAT_STARVED_GRACE_S.get)
    staging_bytes: int = field(default_factory=envs.KVXFER_STAGING_BYTES.get)
    staging_slot_bytes: int = field(default_factory=envs.KVXFER_STAGING_SLOT_BYTES.get)
    num_workers: int = field(default_factory=envs.KVXFER_WORKERS.get)
    data_path: str = field(default_factory=envs.KVXFER_DATA_PATH.get)
    direct_min_op_bytes: int | None = field(default_factory=envs.KVXFER_DIRECT_MIN_OP_BYTES.get)
    # None: from the environment (auth.resolve_key); "off": no authentication; a secret
    # text, or 32 raw key bytes. Always 32 bytes, or b"" (off), after construction.
    auth_key: bytes | str | None = field(default=None, repr=False, compare=False)
    dp_rank: int = 0
    dp_size: int = 1
    kv_pool: str = ""
    draft_geometry: KVGeometry | None = None
    state_pools: tuple[str, ...] = ()
    pp_rank: int = 0
    pp_size: int = 1
    layer_start: int = 0
    follows_room: bool = True
    api_port: int = 0
    dcp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    all_heads: bool = False
    prefill_complete: bool = False
    kv_sharded: bool = False

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role={self.role!r} must be 'prefill' or 'decode'")
        if not isinstance(self.geometry, KVGeometry):
            raise ValueError(f"geometry must be a KVGeometry, got {type(self.geometry).__name__}")
        if not isinstance(self.all_heads, bool) or (self.all_heads and self.role != "prefill"):
            raise ValueError(
                f"all_heads={self.all_heads!r} must be a bool, and True only on a prefill (role={self.role!r})"
            )
        if not isinstance(self.prefill_complete, bool) or (self.prefill_complete and self.role != "prefill"):
            raise ValueError(
                f"prefill_complete={self.prefill_complete!r} must be a bool, and True only on a prefill "
                f"(role={self.role!r}: a decode watches a room per request, KVReceiver(watch_prefill=True))"
            )
        if not isinstance(self.kv_sharded, bool) or (self.kv_sharded and self.role != "prefill"):
            raise ValueError(
                f"kv_sharded={self.kv_sharded!r} must be a bool, and True only on a prefill (role={self.role!r})"
            )
        self.geometry.placement(self.tp_size, self.tp_rank)  # validates (H, T) and the rank
        parse_host_port(self.bootstrap)
        for name in (
            "bootstrap_timeout_s",
            "waiting_timeout_s",
            "transfer_timeout_s",
            "heartbeat_interval_s",
            "heartbeat_timeout_s",
        ):
            _positive(name, getattr(self, name))
        if isinstance(self.heartbeat_starved_grace_s, bool) or not (
            isinstance(self.heartbeat_starved_grace_s, (int, float)) and self.heartbeat_starved_grace_s >= 0
        ):
            raise ValueError(f"heartbeat_starved_grace_s={self.heartbeat_starved_grace_s!r} must be a number >= 0")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s={self.heartbeat_timeout_s} must exceed "
                f"heartbeat_interval_s={self.heartbeat_interval_s}"
            )
        if self.data_path not in ("auto", "direct", "staged", "per_token", "fused"):
            raise ValueError(f"data_path={self.data_path!r} must be one of auto, direct, staged, per_token, fused")
        for name in ("staging_bytes", "staging_slot_bytes", "num_workers", "direct_min_op_bytes"):
            value = getattr(self, name)
            if value is None and name == "direct_min_op_bytes":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if 2 * self.staging_slot_bytes > self.staging_bytes:
            raise ValueError(
                f"staging_bytes={self.staging_bytes} must hold at least two slots of "
                f"staging_slot_bytes={self.staging_slot_bytes}"
            )
        for name in ("dp_rank", "dp_size", "pp_rank", "pp_size", "cp_rank", "cp_size", "layer_start"):
            value, least = getattr(self, name), int(name.endswith("_size"))
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name}={value!r} must be an integer >= {least}")
        for kind in ("dp", "pp", "cp"):
            rank, size = getattr(self, f"{kind}_rank"), getattr(self, f"{kind}_size")
            if rank >= size:
                raise ValueError(f"{kind}_rank={rank} must be < {kind}_size={size}")
        if self.kv_sharded and self.cp_size < 2:
            raise ValueError(f"kv_sharded=True needs the pages sharded over cp_size >= 2 CP ranks, got {self.cp_size}")
        if self.pp_size == 1 and self.layer_start:
            raise ValueError(f"layer_start={self.layer_start} must be 0 without pipeline parallelism (pp_size=1)")
        if self.kv_pool not in ("", "draft") and not _STATE_POOL.fullmatch(self.kv_pool):
            raise ValueError(f"kv_pool={self.kv_pool!r} must be '' (the model's KV), 'draft' or 'state:<kind>[.<n>]'")
        if self.state_pools and (self.kv_pool or self.role != "prefill"):
            raise ValueError(
                "state_pools are announced by a prefill manager of the model's pool only "
                f"(role={self.role!r}, kv_pool={self.kv_pool!r})"
            )
        bad = [p for p in self.state_pools if not isinstance(p, str) or not _STATE_POOL.fullmatch(p)]
        if bad or len(set(self.state_pools)) != len(self.state_pools):
            raise ValueError(f"state_pools={self.state_pools!r} must be distinct 'state:<kind>[.<n>]' names")
        if self.draft_geometry is not None and (
            not isinstance(self.draft_geometry, KVGeometry) or self.kv_pool or self.role != "prefill"
        ):
            raise ValueError(
                "draft_geometry must be a KVGeometry, and only for a prefill manager of the model's pool "
                f"(role={self.role!r}, kv_pool={self.kv_pool!r})"
            )
        if self.device != "cpu" and not str(self.device).startswith("cuda"):
            raise ValueError(f"device={self.device!r} must be 'cpu' or 'cuda[:N]'")
        object.__setattr__(self, "auth_key", config_key(self.auth_key, self.host))

    @property
    def key(self) -> bytes:
        """``auth_key`` as ``__post_init__`` resolved it: 32 key bytes, or ``b""`` (off)."""
        key = self.auth_key
        if not isinstance(key, bytes):  # only a bypass of __post_init__ leaves it unresolved
            raise TypeError(f"EngineConfig.auth_key was not resolved to bytes (got {type(key).__name__})")
        return key

    @property
    def placement(self) -> RankPlacement:
        return self.geometry.placement(self.tp_size, self.tp_rank, self.all_heads)
