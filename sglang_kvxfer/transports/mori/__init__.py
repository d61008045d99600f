"""The ``mori`` transport: one-sided RDMA writes through AMD MORI-IO.

``transport`` has ``MoriTransport``; ``engine`` checks options and creates the MORI-IO
engine; ``probe`` decides in a child process (``python -m
sglang_kvxfer.transports.mori.probe``) whether MORI-IO can run here. Importing this package
must not import mori, torch or ``probe`` (runpy warns when the module it runs is already
imported by its package).
"""

from sglang_kvxfer.transports.mori.transport import MoriTransport

__all__ = ["MoriTransport"]
