"""Creating the MORI-IO engine of a ``mori`` transport from our options.

Owns: checking the options (each error names the option and its value), mapping them onto
MORI (``IOEngineConfig(host, port)``, ``RdmaBackendConfig(qp_per_transfer,
post_batch_size, num_worker_threads, POLLING, enable_notification=False)``, the NIC list
as ``MORI_RDMA_DEVICES`` while the backend is created), importing ``mori.io`` after the
subprocess probe, and creating the engine with its RDMA backend before any memory is
registered. It must not know about regions, peers or tickets (``transports.mori`` does).
"""

from __future__ import annotations

import importlib
import os
import socket
from dataclasses import dataclass

from sglang_kvxfer import envs
from sglang_kvxfer.errors import TransportError, TransportUnavailableError
from sglang_kvxfer.transports._common import env_override

__all__ = ["EngineSettings", "create_engine", "int_option", "UINT32_MAX"]

UINT32_MAX = 2**32 - 1  # MORI refuses a single entry above this (ERR_INVALID_ARGS)


def int_option(name, value, low, allow=()):
    if isinstance(value, bool) or not isinstance(value, int) or (value < low and value not in allow):
        extra = f" or {allow[0]}" if allow else ""
        raise ValueError(f"{name} must be an int >= {low}{extra}, got {value!r}")
    return value


def _nic_list(nics) -> tuple[str, ...]:
    if isinstance(nics, str):
        nics = [n.strip() for n in nics.split(",") if n.strip()]
    if not isinstance(nics, (list, tuple)) or not all(isinstance(n, str) and n and "," not in n for n in nics):
        raise ValueError(f"nics must be RDMA device names like ['mlx5_0', 'mlx5_1'] or 'mlx5_0,mlx5_1', got {nics!r}")
    return tuple(nics)


@dataclass(frozen=True)
class EngineSettings:
    """Checked options of one MORI engine (see ``MoriTransport`` for their meaning)."""

    host: str
    port: int
    nics: tuple[str, ...]
    qp_per_transfer: int
    num_worker_threads: int
    post_batch_size: int

    @classmethod
    def resolve(cls, host, port, nics, qp_per_transfer, num_worker_threads, post_batch_size) -> EngineSettings:
        host = envs.KVXFER_MORI_HOST.get() if host is None else host
        if host == "":
            host = socket.gethostbyname(socket.gethostname())
        if not isinstance(host, str) or host in ("0.0.0.0", "::"):
            raise ValueError(
                f"host={host!r} cannot be advertised to peers; give the address "
                "peers should connect to (KVXFER_MORI_HOST)"
            )
        return cls(
            host,
            int_option("port", port, 0),
            _nic_list(envs.KVXFER_MORI_NICS.get() if nics is None else nics),
            int_option(
                "qp_per_transfer",
                envs.KVXFER_MORI_QP_PER_TRANSFER.get() if qp_per_transfer is None else qp_per_transfer,
                1,
            ),
            int_option(
                "num_worker_threads",
                envs.KVXFER_MORI_WORKERS.get() if num_worker_threads is None else num_worker_threads,
                1,
                (-1,),
            ),
            int_option(
                "post_batch_size",
                envs.KVXFER_MORI_POST_BATCH_SIZE.get() if post_batch_size is None else post_batch_size,
                1,
                (-1,),
            ),
        )

    def describe(self) -> dict:
        return {
            "host": self.host,
            "port": self.port,
            "MORI_RDMA_DEVICES": ",".join(self.nics) or os.environ.get("MORI_RDMA_DEVICES", "") or "(all)",
            "qp_per_transfer": self.qp_per_transfer,
            "num_worker_threads": self.num_worker_threads,
            "post_batch_size": self.post_batch_size,
            "poll_cq_mode": "POLLING",
            "enable_notification": False,
        }


def create_engine(key: str, settings: EngineSettings, probe: bool):
    """``(mori.io, engine)``: the engine ``key`` with its RDMA backend, after the probe."""
    if probe:
        # imported here, not at the top: the package must not load ``probe`` before
        # ``python -m sglang_kvxfer.transports.mori.probe`` runs it (runpy warns)
        from sglang_kvxfer.transports.mori import probe as mori_probe

        mori_probe.check(settings.nics)
    try:
        io = importlib.import_module("mori.io")
    except ImportError as exc:
        raise TransportUnavailableError(f"transport 'mori' needs 'amd-mori' (module 'mori.io'): {exc}") from exc
    engine = io.IOEngine(key, io.IOEngineConfig(settings.host, settings.port))
    # MORI reads MORI_RDMA_DEVICES when the RDMA backend discovers devices.
    try:
        with env_override("MORI_RDMA_DEVICES", ",".join(settings.nics or ())):
            # Notification off: completion travels on the engine's own control channel.
            engine.create_backend(
                io.BackendType.RDMA,
                io.RdmaBackendConfig(
                    settings.qp_per_transfer,
                    settings.post_batch_size,
                    settings.num_worker_threads,
                    io.PollCqMode.POLLING,
                    False,
                ),
            )
    except Exception as exc:
        raise TransportError(
            f"mori: creating the RDMA backend failed ({type(exc).__name__}: {exc}) with {settings.describe()}"
        ) from exc
    desc = engine.get_engine_desc()
    if desc.port <= 0:
        raise TransportError(
            f"mori: the engine has no control-plane port ({desc.port}) after creating the RDMA backend"
        )
    return io, engine
