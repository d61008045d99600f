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
