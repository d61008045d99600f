"""Transports: move bytes between registered memory regions of two processes.

This package owns the registry that maps a transport name to the module that implements
it, imported lazily: ``get_transport("tcp")`` imports ``transports.tcp`` only then, and a
transport whose package is missing raises ``TransportUnavailableError`` naming it. Adding a
backend is one ``register_transport`` line. The interface lives in ``transports.base``.
This module must not import any transport module (or torch) at import time.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

from sglang_kvxfer.errors import TransportUnavailableError
from sglang_kvxfer.transports.base import Caps, PeerFailure, Region, RemoteRegion, Transport, parse_device
from sglang_kvxfer.transports.ticket import Ticket, TicketState, wait_all

__all__ = [
    "get_transport",
    "check_transport",
    "available_transports",
    "registered_transports",
    "register_transport",
    "choose_transport",
    "check_serves_devices",
    "Transport",
    "Caps",
    "Region",
    "RemoteRegion",
    "PeerFailure",
    "Ticket",
    "TicketState",
    "wait_all",
]


@dataclass(frozen=True)
class _Entry:
    target: str  # "package.module:ClassName"
    requires: tuple[tuple[str, str], ...]  # (importable module, pip package that provides it)


_REGISTRY: dict[str, _Entry] = {}


def register_transport(name: str, target: str, requires: dict[str, str] | None = None) -> None:
    """Declare transport ``name``, implemented by ``target`` ("package.module:ClassName").

    ``requires`` maps each module the transport imports to the pip package that provides
    it, e.g. ``{"nixl_cu12": "nixl-cu12"}``; a missing one makes ``get_transport`` raise
    ``TransportUnavailableError`` naming the package. A key ``"a|b"`` is satisfied by either
    module (the same API shipped under two names).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"transport name must be a non-empty str, got {name!r}")
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"target must look like 'package.module:ClassName', got {target!r}")
    _REGISTRY[name] = _Entry(target, tuple((requires or {}).items()))


def registered_transports() -> list[str]:
    """Every registered name, installed or not."""
    return sorted(_REGISTRY)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails, or a module without spec
        return False


def _missing(entry: _Entry) -> list[tuple[str, str]]:
    return [(mods, pkg) for mods, pkg in entry.requires if not any(_importable(mod) for mod in mods.split("|"))]


def available_transports() -> list[str]:
    """Registered names whose required packages are importable here (nothing is imported)."""
    return [name for name in sorted(_REGISTRY) if not _missing(_REGISTRY[name])]


def check_transport(name: str) -> _Entry:
    """Raise what ``get_transport(name)`` would for an unknown name or a missing package,
    importing nothing: a launcher calls it before it starts rank processes, so a typo fails
    once, in one line, instead of once per rank."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"unknown transport {name!r}; registered: {', '.join(registered_transports())}")
    missing = _missing(entry)
    if missing:
        needs = ", ".join(f"'{pkg}' (module {' or '.join(repr(m) for m in mods.split('|'))})" for mods, pkg in missing)
        raise TransportUnavailableError(
            f"transport {name!r} needs {needs}, which is not installed; "
            f"pip install {' '.join(pkg for _, pkg in missing)}"
        )
    return entry


def get_transport(name: str, **options) -> Transport:
    """Create transport ``name`` with its keyword ``options`` (see each class's docstring).

    Raises ``ValueError`` for an unknown name (listing the registered ones) and
    ``TransportUnavailableError`` when a package it needs is not installed.
    """
    entry = check_transport(name)
    module_name, _, attr = entry.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TransportUnavailableError(f"transport {name!r} could not be imported from {module_name}: {exc}") from exc
    return getattr(module, attr)(**options)


def _transport_class(name: str) -> type[Transport]:
    entry = _REGISTRY[name]
    module_name, _, attr = entry.target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


# the transports whose modules import no library and no torch: their caps can be read here
_BUILT_IN = ("local", "tcp")


def check_serves_devices(name: str, devices: Sequence[str]) -> None:
    """Raise ``TransportUnavailableError`` when built-in transport ``name`` cannot register
    memory of every one of ``devices`` (``"cpu"``, ``"cuda:N"``); other transports are
    not imported for this and pass."""
    if name not in _BUILT_IN:
        return
    kinds = sorted({parse_device(d)[0] for d in devices})
    caps = _transport_class(name).caps
    missing = [k for k in kinds if k not in caps.mem_kinds]
    if missing:
        raise TransportUnavailableError(
            f"transport {name!r} cannot move {' or '.join(missing)} memory (it moves "
            f"{', '.join(sorted(caps.mem_kinds))}); pick a transport that can"
        )


def choose_transport(devices: Sequence[str], *, same_host: bool) -> str:
    """What ``--transport auto`` means for KV pools on ``devices``: ``local`` when every
    peer runs on this host (shared memory, CUDA IPC), else ``tcp`` (host memory directly,
    GPU memory through pinned host bounce buffers). RDMA transports are never picked
    here: ask for ``nixl`` or ``mori`` by name. Raises ``TransportUnavailableError`` when
    the pick cannot move memory of one of the devices."""
    name = "local" if same_host else "tcp"
    check_serves_devices(name, devices)
    return name


register_transport("local", "sglang_kvxfer.transports.local:LocalTransport")
register_transport("tcp", "sglang_kvxfer.transports.tcp:TcpTransport")
# nixl-cu12 / nixl-cu13 ship the modules nixl_cu12 / nixl_cu13 (the `nixl` meta package
# installs them); older `nixl` releases have the same API as `nixl`. Which one is used:
# transports.nixl.agent.api_modules.
register_transport(
    "nixl", "sglang_kvxfer.transports.nixl:NixlTransport", requires={"nixl_cu12|nixl_cu13|nixl": "nixl-cu12"}
)
register_transport("mori", "sglang_kvxfer.transports.mori:MoriTransport", requires={"mori": "amd-mori"})
