"""What the vLLM connector's two sides share: settings and the per-step metadata.

Owns ``Settings`` (read once from vLLM's ``kv_transfer_config``), ``SendSpec``/``RecvSpec``
(one request's transfer as the scheduler hands it to the workers), the
``KVXferConnectorMetadata`` vLLM pickles from the scheduler to every worker each step, the
``kv_transfer_params`` keys (``ParamKeys``) and the check of a client-given room
(``check_room``). Must not start anything.

Imports without vLLM (the scheduler and worker sides are unit-tested without it); with vLLM
the metadata is a ``KVConnectorMetadata``, as vLLM requires.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from sglang_kvxfer.engine.config import parse_host_port

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
except ImportError:  # unit tests; the connector itself (integrations.vllm) refuses to load without vLLM

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """Stands in for vLLM's (an empty abstract class) where vLLM is not installed."""


__all__ = ["Settings", "SendSpec", "RecvSpec", "KVXferConnectorMetadata", "ParamKeys", "check_room", "ROOM_LIMIT"]

ROOM_LIMIT = 2**63  # rooms are engine request ids: int64, non-negative


class ParamKeys:
    """``kv_transfer_params`` keys. The client sends ``do_remote_decode: True`` to the
    producer; the producer answers the rest, which the client passes to the consumer."""

    DO_REMOTE_DECODE = "do_remote_decode"
    DO_REMOTE_PREFILL = "do_remote_prefill"
    BOOTSTRAP = "bootstrap_addr"  # "host:port" of the producer's bootstrap service
    ROOM = "room"  # the engine's request id: random, chosen by the producer or the client
    BLOCK_IDS = "remote_block_ids"  # the producer's block ids (informative: the push needs none)
    NUM_TOKENS = "remote_num_tokens"  # prompt tokens whose KV moves
    TP_SIZE = "tp_size"  # the producer's TP size
    BLOCK_SIZE = "block_size"  # the producer's block size: the consumer's must be equal
    ENGINE = "engine"  # "sglang_kvxfer": which connector made these params
    ERROR = "error"  # producer: why it moved nothing for this request (bad params)


def check_room(value: Any) -> int:
    """A room from ``kv_transfer_params`` (a client's or a producer's): an int in
    ``[0, 2**63)``. Raises ``ValueError`` naming the field and the value."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < ROOM_LIMIT:
        raise ValueError(
            f"kv_transfer_params {ParamKeys.ROOM}={value!r} ({type(value).__name__}) must be an int "
            f"with 0 <= {ParamKeys.ROOM} < 2**63"
        )
    return int(value)


_ROLES = {"kv_producer": (True, False), "kv_consumer": (False, True), "kv_both": (True, True)}


@dataclass(frozen=True)
class Settings:
    """The connector's settings, from vLLM's ``kv_transfer_config``.

    ``bootstrap``: where this instance's bootstrap service listens (producer) and what it
    advertises in ``kv_transfer_params``: ``kv_connector_extra_config["bootstrap_addr"]``, else
    ``VLLM_HOST_IP`` (or 127.0.0.1) and ``kv_port``. ``transport``: ``extra_config["transport"]``
    (``local``, ``tcp``, ``nixl``, ``mori``; ``auto``: ``local`` for CPU caches). ``host``: the
    address this instance's ranks advertise for their control inboxes. ``layerwise``:
    ``extra_config["layerwise"]`` (default True): a producer hands each layer to the engine as
    the forward pass finishes it; False: whole-request sends after the request finished.
    """

    produces: bool
    consumes: bool
    bootstrap: str
    host: str
    transport: str = "auto"
    tp_size: int = 1
    block_size: int = 16
    layerwise: bool = True

    def __post_init__(self) -> None:
        parse_host_port(self.bootstrap, "bootstrap_addr")

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> Settings:
        ktc = vllm_config.kv_transfer_config
        role = ktc.kv_role
        if role not in _ROLES:
            raise ValueError(f"kv_role={role!r} must be one of {', '.join(_ROLES)}")
        extra = dict(ktc.kv_connector_extra_config or {})
        known = {"bootstrap_addr", "transport", "host", "layerwise"}
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
        layerwise = extra.get("layerwise", True)
        if not isinstance(layerwise, bool):
            raise ValueError(
                f"kv_connector_extra_config layerwise={layerwise!r} ({type(layerwise).__name__}) must be true or false"
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
            layerwise=layerwise,
        )


@dataclass(frozen=True)
class SendSpec:
    """Producer: move ``block_ids`` (``num_tokens`` prompt tokens) as room ``room``.

    ``layerwise``: the request's prompt completes in this step's forward; each worker opens
    the send before it and hands over every layer as ``save_kv_layer`` reports it written. The
    request still runs, so its end is reported only once the scheduler released it
    (``KVXferConnectorMetadata.released``). Otherwise the request has finished and its
    blocks are held: the whole request moves at once.
    """

    room: int
    block_ids: tuple[int, ...]
    num_tokens: int
    layerwise: bool = False


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
    """One step's work for every worker (request ids; reasons are the engine's abort reasons).

    ``sends``: new sends. ``recvs``: new receives. ``aborts``: receives to abort.
    ``released``: layer-wise sends whose request finished with its blocks held: report their
    end. ``send_aborts``: sends to abort (their request did not finish normally); reported
    once released. ``dropped``: layer-wise sends to abort and forget without a report (vLLM
    preempted the request and freed its blocks itself; it is recomputed and sends again).
    """

    sends: dict[str, SendSpec] = field(default_factory=dict)
    recvs: dict[str, RecvSpec] = field(default_factory=dict)
    aborts: dict[str, str] = field(default_factory=dict)
    released: set[str] = field(default_factory=set)
    send_aborts: dict[str, str] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
