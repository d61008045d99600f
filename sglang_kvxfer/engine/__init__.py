"""The engine: bootstrap, prefill and decode managers, senders and receivers.

``KVManager(EngineConfig(...))`` builds a ``PrefillManager`` or ``DecodeManager`` for one
TP rank; ``KVSender`` / ``KVReceiver`` drive one request on each side, with SGLang's
``KVPoll`` states. See ``prefill.py`` and ``decode.py`` for the flow.
"""
from sglang_kvxfer.engine.bootstrap import BootstrapServer  # noqa: F401
from sglang_kvxfer.engine.config import EngineConfig  # noqa: F401
from sglang_kvxfer.engine.decode import DecodeManager, KVReceiver  # noqa: F401
from sglang_kvxfer.engine.manager import KVManager  # noqa: F401
from sglang_kvxfer.engine.pool import KVPool, PageAllocator, StagingArena  # noqa: F401
from sglang_kvxfer.engine.prefill import KVSender, PrefillManager  # noqa: F401
from sglang_kvxfer.protocol.state import KVPoll  # noqa: F401
