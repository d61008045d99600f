"""Adds the ``kvxfer`` transfer backend to SGLang's backend lookup, in this process.

SGLang picks its KV transfer backend by name from three fixed places (0.5.23): the
``--disaggregation-transfer-backend`` choices (``arg_groups/choices.py``), the
``TransferBackend`` enum and ``get_kv_class`` (``disaggregation/utils.py``). ``install()``
extends all three, idempotently: the name ``kvxfer`` then selects the classes of
``integrations.sglang``, and every other backend resolves exactly as before.

SGLang 0.5.23 also refuses ``--disaggregation-decode-allocation-policy prefill_complete``
for every backend but mooncake, by name, before any backend is built
(``arg_groups/pd_disaggregation_hook._validate_prefill_complete``). ``install()`` wraps that
check so that ``kvxfer`` passes it as ``mooncake`` does: every other rule of it still applies
(attention TP, PP and CP of 1, no decode radix cache, ...), and other backends are refused as
before. Its check of ``--enable-kv-cache-sharding`` (``arg_groups/kv_shard_hook``, mooncake and
nixl only) is let through the same way, through SGLang's own override point for that step
(``register_resolution_hook("handle_kv_cache_sharding")``).

SGLang spawns its scheduler processes, so a patch made in the launching process alone does
not reach them. ``plugin()`` is the same ``install()``, registered as an SGLang general
plugin (entry point group ``sglang.srt.plugins``, name ``kvxfer``): SGLang's
``load_plugins()`` runs it first thing in every process it starts. ``SGLANG_PLUGINS`` (a
comma list of plugin names) can leave it out. This module must not import SGLang at import
time.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any

__all__ = ["BACKEND", "install", "plugin", "add_enum_member"]

BACKEND = "kvxfer"
_MEMBER = "KVXFER"
# KVClassType value -> class name in sglang_kvxfer.integrations.sglang
_CLASSES = {
    "manager": "KVXferKVManager",
    "sender": "KVXferKVSender",
    "receiver": "KVXferKVReceiver",
    "bootstrap_server": "KVXferKVBootstrapServer",
}


def add_enum_member(enum_cls: Any, name: str, value: Any) -> Any:
    """Add ``name = value`` to an existing ``enum.Enum`` class (or return the member that
    already has ``value``). Lookups by value and by name, iteration and identity then work
    as for a member declared in the class body."""
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    if name in enum_cls._member_map_:
        raise ValueError(
            f"{enum_cls.__name__}.{name} already exists with value {enum_cls._member_map_[name].value!r}, not {value!r}"
        )
    member = object.__new__(enum_cls)
    member._name_, member._value_ = name, value
    member.__objclass__ = enum_cls
    member._sort_order_ = len(enum_cls._member_names_)  # read by Python >= 3.12
    enum_cls._member_names_.append(name)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    # EnumType.__setattr__ refuses to bind a name that is a member; bind it underneath.
    type.__setattr__(enum_cls, name, member)
    return member


def _wrap_get_kv_class(utils: Any, member: Any) -> None:
    original = utils.get_kv_class
    if getattr(original, "__kvxfer_original__", None) is not None:
        return  # already installed

    @functools.wraps(original)
    def get_kv_class(transfer_backend, class_type):
        if transfer_backend is member and class_type != utils.KVClassType.KVARGS:
            from sglang_kvxfer.integrations import sglang as backend

            return getattr(backend, _CLASSES[class_type.value])
        return original(transfer_backend, class_type)

    get_kv_class.__kvxfer_original__ = original  # type: ignore[attr-defined]  # functions take attributes
    utils.get_kv_class = get_kv_class
    # Modules that did `from ...utils import get_kv_class` before now hold the original;
    # rebind those too (modules imported later pick up the wrapper from utils).
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get("get_kv_class") is original:
            namespace["get_kv_class"] = get_kv_class


class _AsMooncake:
    """``ServerArgs`` as SGLang's mooncake-only checks read it, naming the backend
    ``mooncake`` (every other field, and every resolution declared so far, as they are; what
    a check declares or sets lands on the real ``ServerArgs``)."""

    def __init__(self, server_args: Any):
        object.__setattr__(self, "_server_args", server_args)

    def __getattr__(self, name: str) -> Any:
        if name == "disaggregation_transfer_backend":
            return "mooncake"
        return getattr(self._server_args, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._server_args, name, value)


_KV_SHARD_STEP = "handle_kv_cache_sharding"


def _kv_shard_as_mooncake(server_args: Any, previous: Any) -> None:
    """SGLang's ``--enable-kv-cache-sharding`` resolution, with kvxfer passing its backend
    check as mooncake does (every other rule of it applies as it is)."""
    if getattr(server_args, "disaggregation_transfer_backend", None) == BACKEND:
        return previous(_AsMooncake(server_args))
    return previous(server_args)


def _register_kv_shard_hook(hooks: Any) -> None:
    if _KV_SHARD_STEP not in getattr(hooks, "_OVERRIDABLE_HOOKS", ()):
        return  # another SGLang version without the step, or without overrides for it
    if any(fn is _kv_shard_as_mooncake for fn in hooks._HOOKS.get(_KV_SHARD_STEP, ())):
        return  # already installed
    hooks.register_resolution_hook(_KV_SHARD_STEP)(_kv_shard_as_mooncake)


def _wrap_prefill_complete_check(hook: Any) -> None:
    original = getattr(hook, "_validate_prefill_complete", None)
    if original is None or getattr(original, "__kvxfer_original__", None) is not None:
        return  # another SGLang version without the check, or already installed

    @functools.wraps(original)
    def _validate_prefill_complete(server_args):
        # (a declaration of the backend wins over the field in SGLang's view; none names kvxfer)
        if getattr(server_args, "disaggregation_transfer_backend", None) == BACKEND:
            return original(_AsMooncake(server_args))
        return original(server_args)

    _validate_prefill_complete.__kvxfer_original__ = original  # type: ignore[attr-defined]
    hook._validate_prefill_complete = _validate_prefill_complete


def install(utils: Any = None, choices: Any = None, hook: Any = None, resolution: Any = None) -> Any:
    """Make ``--disaggregation-transfer-backend kvxfer`` select this engine, in this
    process. ``utils``/``choices``/``hook``/``resolution`` default to SGLang's
    ``disaggregation.utils``, ``arg_groups.choices``, ``arg_groups.pd_disaggregation_hook``
    and ``arg_groups.resolution_hooks`` modules (the last two skipped where they do not
    import). Returns the new ``TransferBackend`` member."""
    if utils is None:
        utils = importlib.import_module("sglang.srt.disaggregation.utils")
    if choices is None:
        choices = importlib.import_module("sglang.srt.arg_groups.choices")
    if hook is None:
        try:
            hook = importlib.import_module("sglang.srt.arg_groups.pd_disaggregation_hook")
        except ImportError:  # (an SGLang without it has no prefill_complete check to pass)
            hook = None
    if resolution is None:
        try:
            resolution = importlib.import_module("sglang.srt.arg_groups.resolution_hooks")
        except ImportError:  # (an SGLang without resolution overrides has no sharding step to pass)
            resolution = None
    if BACKEND not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        # The list argparse validates against, extended in place (SGLang's own hook).
        choices.DISAGG_TRANSFER_BACKEND_CHOICES.append(BACKEND)
    member = add_enum_member(utils.TransferBackend, _MEMBER, BACKEND)
    _wrap_get_kv_class(utils, member)
    if hook is not None:
        _wrap_prefill_complete_check(hook)
    if resolution is not None:
        _register_kv_shard_hook(resolution)
    return member


def plugin() -> None:
    """SGLang general-plugin entry point (``sglang.srt.plugins``): ``install()``."""
    install()
