"""Every environment variable sglang_kvxfer reads, in one place.

Each variable is declared once here with its default and effect; the README's table is
checked against this list by a test. Code reads values through ``<VAR>.get()`` so an
unset or malformed value never surprises a caller: a malformed value raises ``ValueError``
naming the variable.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

__all__ = ["EnvVar", "all_vars", "parse_archs"]

_REGISTRY: dict[str, EnvVar] = {}


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    default: T
    parse: Callable[[str], T]
    doc: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"environment variable {self.name}={raw!r} is invalid: {exc}") from None

    def is_set(self) -> bool:
        return os.environ.get(self.name, "") != ""


def _bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected one of 1/0/true/false/yes/no/on/off")


def _choice(*options: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        val = raw.strip().lower()
        if val not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return val

    return parse


def _upper_choice(*options: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        val = raw.strip().upper()
        if val not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return val

    return parse


def _define(name: str, default, parse, doc: str) -> EnvVar:
    if not name.startswith("KVXFER_"):
        raise AssertionError(f"environment variables must start with KVXFER_: {name}")
    var = EnvVar(name, default, parse, doc)
    _REGISTRY[name] = var
    return var


def all_vars() -> list[EnvVar]:
    """All declared variables, in declaration order."""
    return list(_REGISTRY.values())


KVXFER_LOG_LEVEL = _define(
    "KVXFER_LOG_LEVEL",
    "WARNING",
    _upper_choice("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
    "Log level of the `sglang_kvxfer` logger (DEBUG, INFO, WARNING, ERROR), applied when the "
    "package is imported. Set, it wins over the host's logging set-up (an SGLang or vLLM "
    "server, `--log-level`): the logger gets its own stderr handler. Unset, the host decides.",
)
KVXFER_DATA_PATH = _define(
    "KVXFER_DATA_PATH",
    "auto",
    _choice("auto", "direct", "staged", "per_token", "fused"),
    "Force the data path of every (writer, reader) pair: `direct` page runs (only where the "
    "bytes are contiguous on both sides), `staged` gather -> one write -> scatter, `fused` "
    "one pool -> pool copy into the reader's pool (only where the writer's process maps it: "
    "`local` shared memory, CUDA IPC; elsewhere what `auto` picks of the others), `auto` "
    "(the planner's cost rule over all three, and for a pair whose bytes are not contiguous "
    "also one write per token row where the transport's cost says that is cheaper than "
    "staging), or `per_token` (one write per token row, SGLang's pattern, for every pair "
    "that can be addressed so).",
)
KVXFER_DIRECT_MIN_OP_BYTES = _define(
    "KVXFER_DIRECT_MIN_OP_BYTES",
    None,
    int,
    "`auto` data path, a fixed rule instead of the cost rule: a contiguous pair goes direct "
    "when its average op is at least this many bytes, or when it needs no more than 4 ops per "
    "KV buffer; otherwise it is staged. Unset: the engine weighs the transport's declared cost "
    "(`Transport.path_cost`: per-op cost and bandwidth against two copies), and applies the "
    "fixed rule at 64 KiB only for a transport that declares none (nixl, mori).",
)

KVXFER_BOOTSTRAP_TIMEOUT_S = _define(
    "KVXFER_BOOTSTRAP_TIMEOUT_S",
    60.0,
    float,
    "Deadline of a request in Bootstrapping (peers found, registered, metadata exchanged).",
)
KVXFER_WAITING_TIMEOUT_S = _define(
    "KVXFER_WAITING_TIMEOUT_S",
    300.0,
    float,
    "Deadline of a request in WaitingForInput (prefill has not started sending).",
)
KVXFER_TRANSFER_TIMEOUT_S = _define(
    "KVXFER_TRANSFER_TIMEOUT_S",
    120.0,
    float,
    "Deadline of a request in Transferring without progress (no chunk, no writer done).",
)
KVXFER_HEARTBEAT_INTERVAL_S = _define(
    "KVXFER_HEARTBEAT_INTERVAL_S",
    1.0,
    float,
    "Seconds between heartbeats a rank sends to each peer it is registered with.",
)
KVXFER_HEARTBEAT_TIMEOUT_S = _define(
    "KVXFER_HEARTBEAT_TIMEOUT_S",
    5.0,
    float,
    "A peer silent for this long is declared dead: its in-flight requests fail and its "
    "registration is dropped (a restarted peer registers again).",
)
KVXFER_HEARTBEAT_STARVED_GRACE_S = _define(
    "KVXFER_HEARTBEAT_STARVED_GRACE_S",
    60.0,
    float,
    "A silent peer on this host whose process the kernel still schedules (its threads run or "
    "wait for a CPU: starved, not dead) is declared dead only after the heartbeat timeout plus "
    "this long; 0 turns that off. A peer process on this host that exited is declared dead at "
    "once, a stopped one at the heartbeat timeout.",
)
KVXFER_STAGING_BYTES = _define(
    "KVXFER_STAGING_BYTES",
    512 << 20,
    int,
    "Cap of each rank's staging arena (prefill: gather buffers; decode: windows lent to "
    "writers). Nothing is allocated until a transfer is staged; the arena then grows on "
    "demand, in registered segments, up to this many bytes.",
)
KVXFER_STAGING_SLOT_BYTES = _define(
    "KVXFER_STAGING_SLOT_BYTES",
    32 << 20,
    int,
    "Size of one staging slot; a decode rank lends each staged writer two slots per request, "
    "so gather, wire and scatter of consecutive slots overlap.",
)
KVXFER_WORKERS = _define(
    "KVXFER_WORKERS",
    2,
    int,
    "Transfer worker threads per rank (requests are spread over them by room id).",
)

KVXFER_AUTH = _define(
    "KVXFER_AUTH",
    "on",
    _choice("on", "off"),
    "`on`: every control frame and bootstrap message carries an HMAC-SHA256 tag from the "
    "shared key, and frames without a valid tag are dropped. `off` disables authentication "
    "(logged at WARNING); only for closed test networks.",
)
KVXFER_AUTH_KEY = _define(
    "KVXFER_AUTH_KEY",
    "",
    str,
    "The shared secret (at least 16 characters), the same on every prefill and decode "
    "process, SGLang servers included. Needed when any process binds a non-loopback address. "
    "Unset: `KVXFER_AUTH_KEY_FILE`, else the per-user key file.",
)
KVXFER_AUTH_KEY_FILE = _define(
    "KVXFER_AUTH_KEY_FILE",
    "",
    lambda s: s.strip(),
    "A file holding the shared secret (mode 0600, owned by this user). Unset: the per-user "
    "key file `~/.config/kvxfer/auth_key`, created with mode 0600 on first use (loopback only).",
)

KVXFER_TCP_HOST = _define(
    "KVXFER_TCP_HOST",
    "127.0.0.1",
    lambda s: s.strip(),
    "`tcp` transport: the address it listens on and advertises to peers (must be reachable "
    "by them; `0.0.0.0` is refused).",
)
KVXFER_TCP_CONNECTIONS = _define(
    "KVXFER_TCP_CONNECTIONS",
    1,
    int,
    "`tcp` transport: connections per peer; a batch of at least 1 MiB per connection is split over them.",
)
KVXFER_TCP_IO_TIMEOUT_S = _define(
    "KVXFER_TCP_IO_TIMEOUT_S",
    30.0,
    float,
    "`tcp` transport: a connection with writes pending that makes no progress (bytes sent or "
    "ACK received) for this many seconds is failed, and so are its tickets.",
)
KVXFER_TCP_BOUNCE_BYTES = _define(
    "KVXFER_TCP_BOUNCE_BYTES",
    4 << 20,
    int,
    "`tcp` transport, GPU regions: bytes of each of the two pinned host buffers per "
    "connection end that device memory moves through (the copy of one chunk overlaps the "
    "wire of the previous one); 4096 to 2^30.",
)

KVXFER_LOCAL_PTRACE_ANY = _define(
    "KVXFER_LOCAL_PTRACE_ANY",
    False,
    _bool,
    "`local` transport under Yama `ptrace_scope=1`: `1` lets any same-user process write "
    "private (non-shared) memory this process registers (`PR_SET_PTRACER_ANY`, logged at "
    "WARNING). Unset: such a registration is refused; engine-allocated pools are shared "
    "memory and need no ptrace.",
)

KVXFER_SHM_HUGETLB = _define(
    "KVXFER_SHM_HUGETLB",
    "auto",
    lambda s: _tristate(s),
    "Shared-memory pools (`alloc_shared`, the `local` transport's one-copy destination): "
    "`auto` backs each pool of at least one huge page with the host's reserved 2 MiB huge "
    "pages (`vm.nr_hugepages`, `MFD_HUGETLB`) while enough are free, else 4 KiB pages; `1` "
    "requires them for every pool (the allocation fails naming the pages needed and free); "
    "`0` never uses them.",
)

KVXFER_SGLANG_TRANSPORT = _define(
    "KVXFER_SGLANG_TRANSPORT",
    "auto",
    lambda s: s.strip().lower(),
    "SGLang backend (`--disaggregation-transfer-backend kvxfer`): the transport both sides "
    "use (`local`, `tcp`, `nixl`, `mori`); `auto` takes `local` for CPU KV pools and the "
    "installed RDMA transport (`mori`, then `nixl`) for GPU pools. Set the same on prefill "
    "and decode.",
)

KVXFER_RECORDS_FILE = _define(
    "KVXFER_RECORDS_FILE",
    "",
    lambda s: s.strip(),
    "SGLang backend: append one JSON line per finished request and rank to this file "
    "(room, side, tp_rank, ok, reason, bytes, ops, phases, transfer_s, tail_s; times are "
    "that rank's monotonic seconds). Unset: no file.",
)


def _tristate(raw: str) -> str:
    low = raw.strip().lower()
    if low == "auto":
        return "auto"
    return "1" if _bool(low) else "0"


def _non_negative_int(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def parse_archs(text: str) -> list[str]:
    """``"80,90"`` -> ``["80", "90"]``; each entry a compute capability like ``90`` or ``90a``."""
    archs = [a.strip() for a in text.replace(";", ",").split(",") if a.strip()]
    if not archs:
        raise ValueError("expected a comma-separated list such as 80,90")
    for arch in archs:
        if not re.fullmatch(r"\d{2,3}[af]?", arch):
            raise ValueError(f"{arch!r} is not a compute capability such as 80 or 90a")
    return archs


def _archs(raw: str) -> str:
    return ",".join(parse_archs(raw))


KVXFER_DISABLE_NATIVE = _define(
    "KVXFER_DISABLE_NATIVE",
    False,
    _bool,
    "`1`: never load the compiled gather/scatter libraries; `sglang_kvxfer.ops` uses its "
    "pure-torch reference on every device.",
)
KVXFER_REQUIRE_NATIVE = _define(
    "KVXFER_REQUIRE_NATIVE",
    False,
    _bool,
    "`1`: an engine whose KV pools are on a CUDA device refuses to start when the native "
    "CUDA gather/scatter library is not loaded, naming why (no nvcc, a driver older than its "
    "runtime, ...). Unset: it starts, logs the reason at ERROR once and uses the torch reference.",
)
KVXFER_BUILD_CUDA = _define(
    "KVXFER_BUILD_CUDA",
    "auto",
    _tristate,
    "Install time: `auto` builds `libkvxfer_cuda.so` when `nvcc` is found (a failure is a "
    "warning), `1` requires it (a failure fails the install), `0` skips it.",
)
KVXFER_CUDA_ARCHS = _define(
    "KVXFER_CUDA_ARCHS",
    "80,90",
    _archs,
    "Compute capabilities the CUDA library is built for (SASS for each, plus PTX of the "
    "newest for later GPUs), e.g. `80,90,100`.",
)
KVXFER_CPU_THREADS = _define(
    "KVXFER_CPU_THREADS",
    0,
    _non_negative_int,
    "Threads of one CPU gather/scatter call; `0` picks min(usable cores, 1 per MiB moved).",
)
KVXFER_CACHE_DIR = _define(
    "KVXFER_CACHE_DIR",
    "",
    str,
    "Where native libraries built on first use are cached (default "
    "`$XDG_CACHE_HOME/sglang_kvxfer`, else `~/.cache/sglang_kvxfer`).",
)

KVXFER_NIXL_UCX_TLS = _define(
    "KVXFER_NIXL_UCX_TLS",
    "",
    lambda s: s.strip(),
    "`nixl` transport: UCX transports to allow (set as `UCX_TLS` while the UCX backend is "
    "created, e.g. `tcp`, `sm`, `rc,cuda_ipc`). Empty: keep `UCX_TLS` from the environment, "
    "or UCX's own choice (cma on one host, RDMA where a NIC is active, else tcp).",
)
KVXFER_NIXL_UCX_NET_DEVICES = _define(
    "KVXFER_NIXL_UCX_NET_DEVICES",
    "",
    lambda s: s.strip(),
    "`nixl` transport: network devices UCX may use (the backend's `ucx_devices`, e.g. "
    "`mlx5_0:1` or `lo`). Empty: keep `UCX_NET_DEVICES` from the environment, or all.",
)

KVXFER_MORI_HOST = _define(
    "KVXFER_MORI_HOST",
    "",
    lambda s: s.strip(),
    "`mori` transport: the address MORI-IO's control plane listens on and advertises (peers "
    "connect to it for RDMA keys; `0.0.0.0` is refused). Empty: the address this host's name "
    "resolves to.",
)
KVXFER_MORI_NICS = _define(
    "KVXFER_MORI_NICS",
    "",
    lambda s: s.strip(),
    "`mori` transport: comma-separated RDMA devices MORI-IO may use (set as "
    "`MORI_RDMA_DEVICES` before its backend is created). Empty: keep `MORI_RDMA_DEVICES`, or all.",
)
KVXFER_MORI_QP_PER_TRANSFER = _define(
    "KVXFER_MORI_QP_PER_TRANSFER",
    4,
    int,
    "`mori` transport: RC queue pairs per (peer, memory pair) route "
    "(`RdmaBackendConfig.qp_per_transfer`; `MORI_IO_QP_PER_TRANSFER` overrides it).",
)
KVXFER_MORI_WORKERS = _define(
    "KVXFER_MORI_WORKERS",
    4,
    int,
    "`mori` transport: MORI-IO threads that post work requests "
    "(`RdmaBackendConfig.num_worker_threads`; `MORI_IO_NUM_WORKER_THREADS` overrides it).",
)
KVXFER_MORI_POST_BATCH_SIZE = _define(
    "KVXFER_MORI_POST_BATCH_SIZE",
    -1,
    int,
    "`mori` transport: work requests chained per post, -1 = MORI's choice "
    "(`RdmaBackendConfig.post_batch_size`; `MORI_IO_POST_BATCH_SIZE` overrides it).",
)


def markdown_table() -> str:
    """The README's table of environment variables (kept in sync by a test)."""
    rows = ["| variable | default | effect |", "|---|---|---|"]
    for var in all_vars():
        default = "unset" if var.default is None else f"`{var.default}`"
        rows.append(f"| `{var.name}` | {default} | {var.doc} |")
    return "\n".join(rows)


if __name__ == "__main__":  # python -m sglang_kvxfer.envs: print the README table
    print(markdown_table())
