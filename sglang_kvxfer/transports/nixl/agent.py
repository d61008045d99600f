"""Creating a NIXL agent with its UCX backend, and leaving a process that has one.

Owns: importing NIXL's Python API (``nixl_cu13``, ``nixl_cu12`` or ``nixl``; see
``api_modules`` for the order) and quieting its stdout
logging; resolving the UCX settings from our options, ``KVXFER_NIXL_*`` and the
environment's ``UCX_*``; creating the agent and backend with ``UCX_TLS`` applied only while
the backend is created; ``exit_process`` for processes that created a backend. It must not
know about regions, peers or tickets (``transports.nixl`` does).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import re
import sys
from dataclasses import dataclass
from typing import NoReturn

from sglang_kvxfer import envs
from sglang_kvxfer.errors import TransportError, TransportUnavailableError
from sglang_kvxfer.transports._common import env_override

__all__ = ["UcxSettings", "api_modules", "create_agent", "exit_process", "import_api", "ucx_backend_created"]

# NIXL's API ships per CUDA major (nixl-cu12, nixl-cu13; the `nixl` meta package can pull
# both) and, in older releases, as `nixl` itself. Without a hint from torch, cu12 goes first:
# its wheels run on drivers older than 580, which CUDA 13 needs.
_API_MODULES = ("nixl_cu12._api", "nixl_cu13._api", "nixl._api")
# UCX transports that only reach peers on this host; UCX has no peer-failure handler for
# them, so the backend must run with ucx_error_handling_mode=none.
_HOST_ONLY_TLS = {"sm", "shm", "cma", "posix", "sysv", "xpmem", "knem", "self"}

_backend_created = False  # set once this process has created a UCX backend


def ucx_backend_created() -> bool:
    """True once this process has created a NIXL UCX backend (see ``exit_process``)."""
    return _backend_created


def exit_process(code: int = 0) -> NoReturn:
    """End this process now with exit status ``code``, after flushing logs and stdio.

    Where rdma-core's ibverbs providers are installed, a process that created a UCX backend
    crashes with SIGSEGV in libnl-route's destructor during normal exit, after all its work. Rank processes, test peers and benchmarks that used ``nixl`` call
    this instead of returning from ``main``; it skips interpreter teardown (atexit handlers,
    library destructors), so call it only when everything worth keeping is written.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is None:  # sys.__stdout__/__stderr__ are None without a console
            continue
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(code)


def _torch_cuda_major() -> int | None:
    """The CUDA major of this process's torch, found without importing torch:
    ``torch.version.cuda`` where torch is imported already, else the installed wheel's local
    version (``2.11.0+cu130`` -> 13). None when unknown: no torch, a CPU or ROCm build, or a
    wheel without the tag (PyPI's default build) that is not imported yet."""
    torch = sys.modules.get("torch")
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    if isinstance(cuda, str):
        major = cuda.partition(".")[0]
        return int(major) if major.isdigit() else None
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    tag = re.search(r"\+cu(\d+)\d$", version)  # the last digit is the minor: cu130, cu128
    return int(tag.group(1)) if tag else None


def api_modules() -> tuple[str, ...]:
    """The modules ``import_api`` tries, in order: the wheel for torch's CUDA major first
    (a cu13 torch needs ``nixl_cu13``), then ``nixl_cu12``, ``nixl_cu13``, ``nixl``."""
    major = _torch_cuda_major()
    first = f"nixl_cu{major}._api"
    if first in _API_MODULES:
        return (first, *(name for name in _API_MODULES if name != first))
    return _API_MODULES


def import_api():
    """NIXL's ``_api`` module, from the first of ``api_modules()`` that imports."""
    errors = []
    for name in api_modules():
        try:
            api = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        if not os.environ.get("NIXL_LOG_LEVEL"):  # NIXL logs INFO lines to stdout by default
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return api
    raise TransportUnavailableError(
        "transport 'nixl' needs 'nixl-cu12' or, with a CUDA 13 torch, 'nixl-cu13' "
        "(pip install --no-deps nixl-cu12): " + "; ".join(errors)
    )


def _name_list(value, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str like 'tcp' or 'sm', got {type(value).__name__}")
    parts = [p.strip() for p in value.split(",")]
    if value.strip() and not all(parts):
        raise ValueError(f"{what}={value!r} has an empty item; give names separated by commas")
    return ",".join(parts) if value.strip() else ""


@dataclass(frozen=True)
class UcxSettings:
    """The UCX side of a transport: what is set, and what follows for ``Caps``."""

    tls: str  # our UCX_TLS, applied while the backend is created ("" = none)
    devices: str  # the backend's ucx_devices ("" = UCX_NET_DEVICES or all)
    error_mode: str | None  # ucx_error_handling_mode, None = NIXL's default (peer)
    host_only: bool  # every allowed UCX transport reaches this host only
    one_sided: bool  # False over tcp only: the target's progress emulates each put

    @classmethod
    def resolve(cls, ucx_tls, ucx_net_devices, ucx_error_handling_mode) -> UcxSettings:
        tls = _name_list(envs.KVXFER_NIXL_UCX_TLS.get() if ucx_tls is None else ucx_tls, "ucx_tls")
        devices = _name_list(
            envs.KVXFER_NIXL_UCX_NET_DEVICES.get() if ucx_net_devices is None else ucx_net_devices, "ucx_net_devices"
        )
        effective = tls or os.environ.get("UCX_TLS", "").strip()
        names = {t.strip().lstrip("^") for t in effective.split(",") if t.strip()}
        host_only = bool(names) and not effective.startswith("^") and names <= _HOST_ONLY_TLS
        mode = ucx_error_handling_mode
        if mode is None:
            mode = "none" if host_only else None
        elif mode not in ("none", "peer"):
            raise ValueError(f"ucx_error_handling_mode must be 'none' or 'peer', got {mode!r}")
        return cls(tls, devices, mode, host_only, names != {"tcp"})

    def describe(self) -> dict:
        """The effective settings, for error messages and ``NixlTransport.ucx_settings``."""
        return {
            "UCX_TLS": self.tls or os.environ.get("UCX_TLS", "").strip() or "(UCX default)",
            "ucx_devices": self.devices or os.environ.get("UCX_NET_DEVICES", "") or "(all)",
            "ucx_error_handling_mode": self.error_mode or "(NIXL default)",
        }


def create_agent(api, name: str, ucx: UcxSettings, num_workers: int | None, progress_thread: bool):
    """A NIXL agent named ``name`` with one UCX backend configured by ``ucx``."""
    global _backend_created
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=progress_thread, backends=[]))
    params = {}
    if ucx.error_mode is not None:
        params["ucx_error_handling_mode"] = ucx.error_mode
    if ucx.devices:
        params["ucx_devices"] = ucx.devices
    if num_workers is not None:
        params["num_workers"] = str(num_workers)
    described = ucx.describe()
    try:
        # UCX reads UCX_TLS when the backend creates its context, and only then.
        with env_override("UCX_TLS", ucx.tls):
            agent.create_backend("UCX", params)
    except Exception as exc:
        raise TransportError(
            f"nixl: creating the UCX backend failed ({type(exc).__name__}: {exc}) with {described}"
        ) from exc
    finally:
        _backend_created = True
    return agent
