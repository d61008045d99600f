"""Ports for the servers the tests start: below the kernel's ephemeral range, never handed
out twice by one process.

A port from ``bind(0)`` lies in the ephemeral range, where the kernel also picks the local
port of every outgoing connection and of every later ``bind(0)`` (ZMQ's random ports,
torch's stores, vLLM's ``get_open_port``). Between a test choosing such a port and its
server binding it, another process can take it: CI once saw an SGLang decode server fail to
bind its HTTP port and exit 3. Ports here come from the 2,700 or so just below that range
(above the 22000-29999 that SGLang picks its NCCL ports from), at random, checked free now,
and remembered, so this process never hands one out twice. Pure standard library.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_LOCK = threading.Lock()
_GIVEN: set[int] = set()
_RNG = random.Random()  # its own generator: tests that seed ``random`` must not repeat ports


def port_range() -> range:
    """The ports handed out: ``[max(1024, min(30000, low - 512)), low)``, where ``low`` is the
    first ephemeral port (``/proc/sys/net/ipv4/ip_local_port_range``; 32768 if unreadable)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(max(1024, min(30000, low - 512)), low)


def bindable(port: int) -> bool:
    """Whether ``port`` can be bound on 127.0.0.1 now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(span: int = 1, attempts: int = 500, derived: tuple[int, ...] = ()) -> int:
    """A port ``p`` such that ``p .. p + span - 1`` and ``p + d`` for each ``d`` in ``derived``
    (the ports a server binds at fixed offsets from its own) are free now and were never
    returned by this process before (all of them are remembered)."""
    ports = port_range()
    if not 1 <= span < len(ports):
        raise ValueError(f"span={span} must be in [1, {len(ports)})")
    with _LOCK:
        for _ in range(attempts):
            base = _RNG.randrange(ports.start, ports.stop - span + 1)
            block = [*range(base, base + span), *(base + d for d in derived)]
            if max(block) > 65535 or any(p in _GIVEN for p in block) or not all(bindable(p) for p in block):
                continue
            _GIVEN.update(block)
            return base
    raise RuntimeError(
        f"no {span} free consecutive port(s) in {ports.start}-{ports.stop - 1} after {attempts} tries "
        f"({len(_GIVEN)} handed out already)"
    )
