"""The ``nixl`` transport: one-sided RDMA writes through NVIDIA NIXL (UCX).

``transport`` has ``NixlTransport``; ``agent`` imports NIXL and creates its agent, and
has ``exit_process`` for processes that created a UCX backend. Importing this package
must not import nixl or torch (NIXL is imported when the first transport is created).
"""

from sglang_kvxfer.transports.nixl.agent import exit_process, ucx_backend_created
from sglang_kvxfer.transports.nixl.transport import NixlTransport

__all__ = ["NixlTransport", "exit_process", "ucx_backend_created"]
