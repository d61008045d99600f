"""``KVManager``: the manager of a config's role.

Owns only the choice between ``PrefillManager`` and ``DecodeManager``, so that
``manager.py`` (the shared base) never imports the roles that build on it.
Must not: hold state or grow options of its own.
"""

from __future__ import annotations

from sglang_kvxfer.engine.config import EngineConfig
from sglang_kvxfer.engine.decode import DecodeManager
from sglang_kvxfer.engine.manager import RankBase
from sglang_kvxfer.engine.pool import KVPool
from sglang_kvxfer.engine.prefill import PrefillManager

__all__ = ["KVManager"]


def KVManager(config: EngineConfig, pool: KVPool | None = None, **kwargs) -> RankBase:
    """The manager of ``config.role``: a ``PrefillManager`` or a ``DecodeManager``."""
    if config.role == "prefill":
        return PrefillManager(config, pool, **kwargs)
    return DecodeManager(config, pool, **kwargs)
