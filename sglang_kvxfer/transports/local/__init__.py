"""The ``local`` transport: same-host writes by process_vm_writev (host memory) or CUDA
IPC (device memory).

``transport`` has ``LocalTransport``; ``cuda_ipc`` (imported only when a CUDA region is
used) exports and copies device memory. Shared host memory (``alloc_shared``) lives in
``transports._memory``, which ``tcp`` and the engine use too. Importing this package must
not import torch.
"""

from sglang_kvxfer.transports.local.transport import LocalTransport, SharedBuffer, alloc_shared

__all__ = ["LocalTransport", "SharedBuffer", "alloc_shared"]
