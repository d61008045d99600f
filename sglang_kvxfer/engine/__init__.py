"""The engine: bootstrap, prefill and decode managers, senders and receivers.

``KVManager(EngineConfig(...))`` builds a ``PrefillManager`` or ``DecodeManager`` for one
TP rank; ``KVSender`` / ``KVReceiver`` drive one request on each side, with SGLang's
``KVPoll`` states. See ``prefill.py`` and ``decode.py`` for the flow.

Layout: ``manager.py`` (``RankBase``: what both roles share, with abstract role hooks),
``prefill.py`` (registration, messages, room ownership, failures; ``KVSender``),
``prefill_rooms.py`` (room records and the capped room table), ``prefill_datapath.py``
(direct and staged writes), ``decode.py`` (``DecodeManager``, ``KVReceiver``),
``decode_rooms.py`` (decode room and prefill-group records), ``factory.py``
(``KVManager``).
"""

from sglang_kvxfer.engine.bootstrap import BootstrapServer  # noqa: F401
from sglang_kvxfer.engine.config import EngineConfig  # noqa: F401
from sglang_kvxfer.engine.decode import DecodeManager, KVReceiver  # noqa: F401
from sglang_kvxfer.engine.factory import KVManager  # noqa: F401
from sglang_kvxfer.engine.pool import KVPool, PageAllocator, StagingArena  # noqa: F401
from sglang_kvxfer.engine.prefill import KVSender, PrefillManager  # noqa: F401
from sglang_kvxfer.protocol.state import KVPoll  # noqa: F401
