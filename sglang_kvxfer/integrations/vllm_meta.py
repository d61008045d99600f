"""What the vLLM connector's two sides share: settings and the per-step metadata.

Owns ``Settings`` (read once from vLLM's ``kv_transfer_config``), ``SendSpec``/``RecvSpec``
(one request's transfer as the scheduler hands it to the workers), the
``KVXferConnectorMetadata`` vLLM pickles from the scheduler to every worker each step, and
the ``kv_transfer_params`` keys (``ParamKeys``). Must not start anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from sglang_kvxfer.engine.config import parse_host_port

__all__ = ["Settings", "SendSpec", "RecvSpec", "KVXferConnectorMetadata", "ParamKeys"]


class ParamKeys:
    """``kv_transfer_params`` keys. The client sends ``do_remote_decode: True`` to the
    producer; the producer answers the rest, which the client passes to the consumer."""

    DO_REMOTE_DECODE = "do_remote_decode"
    DO_REMOTE_PREFILL = "do_remote_prefill"
    BOOTSTRAP = "bootstrap_addr"  # "host:port" of the producer's bootstrap service
    ROOM = "room"  # the engine's request id, random, chosen by the producer
    BLOCK_IDS = "remote_block_ids"  # the producer's block ids (informative: the push needs none)
    NUM_TOKENS = "remote_num_tokens"  # prompt tokens whose KV moves
    TP_SIZE = "tp_size"  # the producer's TP size
    BLOCK_SIZE = "block_size"  # the producer's block size: the consumer's must be equal
    ENGINE = "engine"  # "sglang_kvxfer": which connector made these params


_ROLES = {"kv_producer": (True, False), "kv_consumer": (False, True), "kv_both": (True, True)}


@dataclass(frozen=True)
class Settings:
    """The connector's settings, from vLLM's ``kv_transfer_config``.

    ``bootstrap``: where this instance's bootstrap service listens (producer) and what it
    advertises in ``kv_transfer_params``: ``kv_connector_extra_config["bootstrap_addr"]``, else
    ``VLLM_HOST_IP`` (or 127.0.0.1) and ``kv_port``. ``transport``: ``extra_config["transport"]``
    (``local``, ``tcp``, ``nixl``, ``mori``; ``auto``: ``local`` for CPU caches). ``host``: the
    address this instance's ranks advertise for their control inboxes.
    """

    produces: bool
    consumes: bool
    bootstrap: str
    host: str
    transport: str = "auto"
    tp_size: int = 1
    block_size: int = 16

    def __post_init__(self) -> None:
        parse_host_port(self.bootstrap, "bootstrap_addr")

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> Settings:
        ktc = vllm_config.kv_transfer_config
        role = ktc.kv_role
        if role not in _ROLES:
            raise ValueError(f"kv_role={role!r} must be one of {', '.join(_ROLES)}")
        extra = dict(ktc.kv_connector_extra_config or {})
        known = {"bootstrap_addr", "transport", "host"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config has unknown key(s) {unknown}; the kvxfer connector reads {sorted(known)}"
            )
        host = str(extra.get("host") or os.environ.get("VLLM_HOST_IP") or "127.0.0.1")
        bootstrap = str(extra.get("bootstrap_addr") or f"{host}:{int(ktc.kv_port)}")
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ValueError(
                f"pipeline_parallel_size={parallel.pipeline_parallel_size}: the kvxfer connector supports "
                "tensor parallelism only"
            )
        produces, consumes = _ROLES[role]
        return cls(
            produces=produces,
            consumes=consumes,
            bootstrap=bootstrap,
            host=host,
            transport=str(extra.get("transport", "auto")).strip().lower(),
            tp_size=int(parallel.tensor_parallel_size),
            block_size=int(vllm_config.cache_config.block_size),
        )


@dataclass(frozen=True)
class SendSpec:
    """Producer: move ``block_ids`` (``num_tokens`` prompt tokens) as room ``room``."""

    room: int
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class RecvSpec:
    """Consumer: receive room ``room`` from the prefill group at ``bootstrap`` into
    ``block_ids`` (``num_tokens`` prompt tokens)."""

    room: int
    bootstrap: str
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass
class KVXferConnectorMetadata(KVConnectorMetadata):
    """One step's work for every worker: new sends, new receives, receives to abort
    (request id -> reason)."""

    sends: dict[str, SendSpec] = field(default_factory=dict)
    recvs: dict[str, RecvSpec] = field(default_factory=dict)
    aborts: dict[str, str] = field(default_factory=dict)
