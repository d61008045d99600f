"""sglang_kvxfer: a KV-cache transfer engine for prefill/decode disaggregated serving.

Importing this package is cheap and needs no GPU, compiler, mori or nixl: heavy and
optional parts (torch ops, native kernels, RDMA transports) load lazily on first use.
"""

from __future__ import annotations

from sglang_kvxfer.errors import (  # noqa: F401
    GeometryError,
    IncompatibleGeometryError,
    KVXferError,
    PlanError,
    ProtocolError,
    TransferFailedError,
    TransferTimeoutError,
    TransportError,
    TransportUnavailableError,
)

__version__ = "0.1.0"


def _apply_log_level() -> None:
    """``KVXFER_LOG_LEVEL``, when set: the level of the ``sglang_kvxfer`` logger, with a
    stderr handler of its own, because the servers that host this package (SGLang, vLLM)
    configure only their own loggers and the root's fallback shows warnings alone."""
    import logging

    from sglang_kvxfer.envs import KVXFER_LOG_LEVEL

    if not KVXFER_LOG_LEVEL.is_set():
        return
    logger = logging.getLogger("sglang_kvxfer")
    logger.setLevel(KVXFER_LOG_LEVEL.get())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False  # the host's handlers would print each line a second time


_apply_log_level()
