"""The ``tcp`` transport: writes into a peer's registered host memory over TCP, no RDMA.

``transport`` has ``TcpTransport`` (peers, grants, regions, splitting, lifetime); ``conn``
has the two connection ends and ``ConnOwner``, the narrow interface through which they
reach the transport; ``wire`` has the frame layouts and the handshake proof. Importing this
package must not import torch.
"""

from sglang_kvxfer.transports.tcp.transport import TcpTransport

__all__ = ["TcpTransport"]
