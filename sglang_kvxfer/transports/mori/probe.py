"""Whether MORI-IO can run on this host, decided in a child process.

MORI-IO ends the whole process instead of raising when its hardware is missing: the RDMA
backend ``exit(-1)``s when ROCm-SMI is absent or sees no AMD GPU, and an MR registration
failure ``abort()``s. So ``check`` runs this module as
``python -m sglang_kvxfer.transports.mori.probe`` and reads its verdict; a crash there
costs a child, not the caller. The child checks, in order, and stops at the first miss:

1. ``import mori.io`` works (ROCm 7 userspace libraries, torch);
2. an AMD GPU: ``/dev/kfd`` and a KFD topology node with SIMDs (a GPU, not a CPU node);
3. ROCm SMI (``librocm_smi64.so``), which MORI's topology step loads;
4. an RDMA device port in state ACTIVE (``/sys/class/infiniband/*/ports/*/state``), among
   ``--nics`` when given;
5. an ``IOEngine`` with the RDMA backend can be created.

It prints one JSON line per stage and a final ``{"ok": ..., "missing": ...}``. ``check``
caches verdicts per (nics, root). This module must not import mori in the caller.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import threading

from sglang_kvxfer.errors import TransportUnavailableError

__all__ = ["check", "host_facts"]

_cache: dict[tuple, str | None] = {}
_cache_lock = threading.Lock()
NEEDS = "MORI-IO needs ROCm, an AMD GPU and an RDMA NIC with an active port"


def _path(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def _gpu_nodes(root: str) -> list[str]:
    nodes = []
    for props in sorted(glob.glob(_path(root, "/sys/class/kfd/kfd/topology/nodes/*/properties"))):
        try:
            with open(props) as f:
                fields = dict(line.split(None, 1) for line in f if line.strip())
        except (OSError, ValueError):
            continue
        if int(fields.get("simd_count", "0").strip() or 0) > 0:
            nodes.append(os.path.basename(os.path.dirname(props)))
    return nodes


def _rocm_smi(root: str) -> str | None:
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    dirs += [_path(root, "/opt/rocm/lib"), _path(root, "/opt/rocm/lib64")]
    for d in dirs:
        hits = glob.glob(os.path.join(d, "librocm_smi64.so*"))
        if hits:
            return hits[0]
    if root == "/":
        import ctypes.util

        return ctypes.util.find_library("rocm_smi64")
    return None


def _active_ports(root: str, nics: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(ACTIVE ports, every port seen as 'dev/port: state') among ``nics`` (all if empty)."""
    active, seen = [], []
    wanted = {n.split(":")[0] for n in nics}
    for state_file in sorted(glob.glob(_path(root, "/sys/class/infiniband/*/ports/*/state"))):
        port_dir = os.path.dirname(state_file)
        dev = os.path.basename(os.path.dirname(os.path.dirname(port_dir)))
        if wanted and dev not in wanted:
            continue
        try:
            with open(state_file) as f:
                state = f.read().strip()
        except OSError:
            continue
        name = f"{dev}/{os.path.basename(port_dir)}"
        seen.append(f"{name}: {state}")
        if "ACTIVE" in state:
            active.append(name)
    return active, seen


def host_facts(root: str = "/", nics: tuple[str, ...] = ()) -> str | None:
    """What this host lacks for MORI-IO's RDMA backend (checks 2-4), or None; reads files only."""
    if not os.path.exists(_path(root, "/dev/kfd")):
        return (
            "no AMD GPU: /dev/kfd does not exist (the amdgpu kernel driver is not loaded); "
            f"{NEEDS}, even for host memory"
        )
    if not _gpu_nodes(root):
        return f"no AMD GPU: /dev/kfd exists but no KFD topology node has SIMDs; {NEEDS}, even for host memory"
    if _rocm_smi(root) is None:
        return (
            "ROCm SMI library librocm_smi64.so not found (LD_LIBRARY_PATH, /opt/rocm/lib); "
            "MORI-IO exits the process without it"
        )
    active, seen = _active_ports(root, nics)
    if not active:
        among = f" among nics {','.join(nics)}" if nics else ""
        found = "; ports seen: " + ", ".join(seen) if seen else "; /sys/class/infiniband is empty"
        return f"no RDMA device port in state ACTIVE{among}{found}"
    return None


def _stage(name: str, **extra) -> None:
    print(json.dumps({"stage": name, **extra}), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="MORI-IO availability probe (child process)")
    parser.add_argument("--nics", default="", help="comma-separated RDMA devices")
    parser.add_argument("--root", default="/", help="filesystem root of the facts (tests)")
    parser.add_argument("--no-backend", action="store_true", help="skip creating the backend")
    args = parser.parse_args(argv)
    nics = tuple(n for n in args.nics.split(",") if n)
    _stage("import")
    try:
        import mori.io as mio
    except Exception as exc:  # ImportError, or OSError from a missing ROCm library
        _stage(
            "done",
            ok=False,
            missing=f"mori.io cannot be imported ({type(exc).__name__}: {exc}); {NEEDS} (ROCm 7 userspace and torch)",
        )
        return 0
    _stage("facts")
    missing = host_facts(args.root, nics)
    if missing is not None:
        _stage("done", ok=False, missing=missing)
        return 0
    if not args.no_backend:
        _stage("backend")
        try:
            engine = mio.IOEngine(f"kvxfer-probe-{os.getpid()}", mio.IOEngineConfig("127.0.0.1", 0))
            engine.create_backend(mio.BackendType.RDMA, mio.RdmaBackendConfig(1, -1, -1, mio.PollCqMode.POLLING, False))
        except Exception as exc:
            _stage("done", ok=False, missing=f"creating MORI-IO's RDMA backend failed ({type(exc).__name__}: {exc})")
            return 0
    _stage("done", ok=True, missing=None)
    return 0


def check(nics: tuple[str, ...] = (), *, root: str = "/", timeout_s: float = 60.0) -> None:
    """Raise ``TransportUnavailableError`` saying what is missing unless MORI-IO can run.

    The verdict of each (nics, root) is cached for the life of this process.
    """
    key = (tuple(nics), root)
    with _cache_lock:
        if key not in _cache:
            _cache[key] = _run_child(tuple(nics), root, timeout_s)
        missing = _cache[key]
    if missing is not None:
        raise TransportUnavailableError(f"transport 'mori' cannot run here: {missing}")


def _run_child(nics: tuple[str, ...], root: str, timeout_s: float) -> str | None:
    cmd = [sys.executable, "-m", "sglang_kvxfer.transports.mori.probe", "--root", root]
    env = dict(os.environ)
    if nics:
        cmd += ["--nics", ",".join(nics)]
        env["MORI_RDMA_DEVICES"] = ",".join(nics)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return f"the MORI-IO probe process did not finish within {timeout_s} s"
    stages = []
    for line in out.stdout.splitlines():
        try:
            stages.append(json.loads(line))
        except ValueError:
            continue  # MORI's own log lines
    last = stages[-1] if stages else {"stage": "start"}
    if last.get("stage") == "done":
        return None if last.get("ok") else str(last.get("missing"))
    how = f"was killed by signal {-out.returncode}" if out.returncode < 0 else f"exited with status {out.returncode}"
    tail = (out.stderr.strip().splitlines() or [""])[-1][:300]
    return (
        f"the MORI-IO probe process {how} during stage {last.get('stage')!r} (MORI-IO "
        f"ends the process when ROCm or the RDMA device is unusable){': ' + tail if tail else ''}"
    )


if __name__ == "__main__":
    sys.exit(main())
