"""The ``local`` transport: one-sided writes between processes on the same host.

How bytes move, by the kind of the destination region:

* ``shm``: CPU memory from ``alloc_shared`` (a memfd). The writer maps the peer's buffer
  once at ``import_region`` and copies with one ``memmove`` per coalesced entry.
* ``cma``: CPU memory the peer allocated privately. The writer calls ``process_vm_writev``
  (up to 1024 entries a call). Registration fails if this host forbids it; ``import_region``
  probes it with a 1-byte read and says why it is refused.
* ``cuda``: a CUDA tensor shared by CUDA IPC (``local.cuda_ipc``); a write is an async device
  copy on a side stream and the ticket completes on a CUDA event. The descriptor names the
  exporter's GPU by UUID, so the importer maps it on its own index of that GPU whatever
  either process's ``CUDA_VISIBLE_DEVICES`` (``remote_view`` hands out no view of a GPU
  this process cannot see: such writes go through ``write()``).

``mapped_device`` / ``remote_view`` (the optional capability of ``transports.base``): shared
memory and CUDA IPC regions of a visible GPU are mapped here, so a producer (the engine's
gather into a reader's staging slot, or its fused pool -> pool copy) writes them in place.

CPU writes complete inside ``write()`` on the caller's thread (no receiver thread exists).
A peer's exit is seen through a pidfd: writes after it fail with ``PeerGoneError``. Memory
mapped by CUDA IPC is never written once its exporter has exited (that can corrupt this
process's CUDA context): every CUDA post and every ``remote_view`` first polls the
peer's pidfd (one non-blocking ``select``, about a microsecond per batch, not per entry),
and a view polls it again when its block ends (a peer gone meanwhile fails the block),
and a peer in another pid namespace, whose exit cannot be seen, is refused CUDA IPC.

Trust boundary: the Unix user. Any process of the same user can open ``/proc/<pid>/fd/<n>``
of a shared pool, ``process_vm_writev`` private memory where the kernel allows it, and open
CUDA IPC handles it learns; ``authorize_peer`` is recorded but the kernel, not this module,
decides. It never calls ``PR_SET_PTRACER_ANY`` unless ``KVXFER_LOCAL_PTRACE_ANY=1``.
This module must not open sockets or import torch unless a CUDA region is used.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import os
import secrets
import select
import socket
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sglang_kvxfer.errors import PeerGoneError, TransportError
from sglang_kvxfer.transports import _memory
from sglang_kvxfer.transports._common import UseTable, pack_descriptor, unpack_descriptor
from sglang_kvxfer.transports._memory import SharedBuffer, alloc_shared
from sglang_kvxfer.transports.base import (
    Caps,
    Entries,
    PeerFailure,
    Region,
    RemoteRegion,
    Ticket,
    Transport,
    check_secret,
    parse_device,
    tensor_memory,
)

if TYPE_CHECKING:
    from sglang_kvxfer.transports.local.cuda_ipc import CudaCopier

__all__ = ["LocalTransport", "SharedBuffer", "alloc_shared"]

_NAME = "local"
_AGENT_FIELDS = {"agent": str, "boot_id": str, "pidns": int, "pid": int}
_REGION_FIELDS = {"agent": str, "region": int, "nbytes": int, "device": str, "kind": str}
_KIND_FIELDS: dict[str, dict[str, type]] = {
    "shm": {"path": str, "inode": int, "map_bytes": int, "offset": int},
    "cma": {"pid": int, "addr": int},
    "cuda": {"ipc": dict},
}


def _host_identity() -> tuple[str, int]:
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot_id = f.read().strip()
    return boot_id, os.stat("/proc/self/ns/pid").st_ino


@dataclass
class _Peer:
    agent: str
    pid: int
    pidfd: int | None  # None when the peer is in another pid namespace
    failed: str | None = None


@dataclass
class _LocalRegion:
    region: Region
    kind: str
    keepalive: object = None  # the SharedBuffer or the CUDA tensor the region lives in


@dataclass
class _Target:
    """Where an imported remote region is reachable from this process."""

    kind: str
    nbytes: int
    device: str
    base: int = 0  # shm: address of the region in our mapping; cma: in the peer
    mapping: Any = None  # shm: the mmap; cuda: the uint8 tensor
    gpu: str = ""  # cuda: the exporter's GPU identity (cuda_ipc.gpu_identity)
    gpu_visible: bool = False  # cuda: that GPU is visible here, as ``device``


class LocalTransport(Transport):
    """Same-host transport (shared memory, cross-process writes, CUDA IPC).

    Parameters
    ----------
    agent_id : name of this agent in descriptors (default: host, pid and a random tag).
    allow_cma : register privately allocated CPU memory for ``process_vm_writev``; when
        False only ``alloc_shared`` memory can be registered.
    deregister_timeout_s : how long ``deregister``/``remove_peer`` wait for writes in flight.
    """

    name = _NAME
    caps = Caps(mem_kinds=frozenset({"cpu", "cuda"}), same_host_only=True, read_supported=False, one_sided=True)

    def __init__(self, *, agent_id: str | None = None, allow_cma: bool = True, deregister_timeout_s: float = 5.0):
        super().__init__()
        self._agent = agent_id or f"local-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._boot_id, self._pidns = _host_identity()
        self._allow_cma = allow_cma
        self._timeout_s = deregister_timeout_s
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._regions = UseTable()  # region_id -> _LocalRegion
        self._targets = UseTable()  # (peer_id, region_id) -> _Target
        self._peers: dict[str, _Peer] = {}
        self._grants: dict[str, frozenset] = {}  # recorded only: see the module docstring
        # The copy cost ``path_cost`` reports, measured now, in the creating thread, once per
        # process: measured later it would run on a rank's I/O thread at its first request,
        # where a host process spinning on the GIL (vLLM's workers busy-poll) once stretched
        # its ~800 GIL hand-overs to 27 s without heartbeats.
        _memory.memmove_rate()
        self._failures: list[PeerFailure] = []
        self._cuda: CudaCopier | None = None  # created on first CUDA write

    # -- descriptors and peers ----------------------------------------------------------
    def agent_descriptor(self) -> bytes:
        return pack_descriptor(
            _NAME, "agent", agent=self._agent, boot_id=self._boot_id, pidns=self._pidns, pid=os.getpid()
        )

    def add_peer(self, peer_id: str, descriptor: bytes, secret: bytes | None = None) -> None:
        """``secret`` is checked and not used (the kernel decides who may write, see the
        module docstring). An existing ``peer_id`` is removed first, then re-added."""
        self._check_open()
        check_secret(secret, optional=True)
        _check_peer_id(peer_id)
        desc = unpack_descriptor(descriptor, _NAME, "agent", _AGENT_FIELDS)
        if desc["boot_id"] != self._boot_id:
            raise TransportError(
                f"peer {peer_id!r} runs on another host (boot_id "
                f"{desc['boot_id']}, ours {self._boot_id}); 'local' is "
                "same-host only: use the 'tcp' transport"
            )
        pidfd = None
        if desc["pidns"] == self._pidns:
            try:
                pidfd = os.pidfd_open(desc["pid"])
            except ProcessLookupError:
                raise PeerGoneError(f"peer {peer_id!r} (pid {desc['pid']}) has exited") from None
        if peer_id in self._peers:
            try:
                self.remove_peer(peer_id)
            except ValueError:  # removed concurrently: nothing to replace
                pass
        with self._lock:
            old = self._peers.get(peer_id)
            self._peers[peer_id] = _Peer(desc["agent"], desc["pid"], pidfd)
        if old is not None and old.pidfd is not None:  # a concurrent add_peer won the race
            os.close(old.pidfd)

    def remove_peer(self, peer_id: str) -> None:
        with self._lock:
            peer = self._peers.pop(peer_id, None)
        if peer is None:
            raise ValueError(f"unknown peer {peer_id!r}")
        if self._cuda is not None:
            self._cuda.synchronize()
        try:
            for key, _ in self._targets.items():
                if key[0] == peer_id:
                    _release_target(self._targets.remove(key, self._timeout_s))
        finally:
            if peer.pidfd is not None:
                os.close(peer.pidfd)

    def authorize_peer(self, peer_id: str, secret: bytes, regions) -> None:
        """Recorded only: same-user processes reach this memory whatever is granted."""
        _, regions = self._check_grant_args(peer_id, secret, regions)
        with self._lock:
            self._grants[peer_id] = frozenset(r.region_id for r in regions)

    def revoke_peer(self, peer_id: str) -> None:
        with self._lock:
            self._grants.pop(peer_id, None)

    def _peer(self, peer_id: str) -> _Peer:
        peer = self._peers.get(peer_id)
        if peer is None:
            raise ValueError(f"unknown peer {peer_id!r} (add_peer it first)")
        return peer

    # -- regions ------------------------------------------------------------------------
    def register(self, ptr: int, nbytes: int, device: str = "cpu") -> Region:
        self._check_open()
        self._check_register_args(ptr, nbytes)
        kind, _ = parse_device(device)
        if kind == "cuda":
            raise TypeError(
                "local: register CUDA memory with register_tensor(t): the CUDA IPC handle comes from torch's allocator"
            )
        buf = _memory.find_shared(ptr, nbytes)
        region_id = next(self._ids)
        if buf is not None:
            extra = dict(kind="shm", path=buf.path, inode=buf.inode, map_bytes=buf.nbytes, offset=ptr - buf.ptr)
        else:
            self._check_cma_allowed(ptr, nbytes)
            try:
                _memory.allow_ptrace_writes()
            except TransportError as exc:
                raise TransportError(f"local: region at {ptr:#x} ({nbytes} bytes) is private memory: {exc}") from None
            extra = dict(kind="cma", pid=os.getpid(), addr=ptr)
        return self._add_region(region_id, ptr, nbytes, "cpu", extra, keepalive=buf)

    def register_tensor(self, tensor) -> Region:
        ptr, nbytes, device = tensor_memory(tensor)
        if not device.startswith("cuda"):
            return self.register(ptr, nbytes, device)
        from sglang_kvxfer.transports.local import cuda_ipc as _cuda_ipc

        self._check_open()
        extra = dict(kind="cuda", ipc=_cuda_ipc.export_tensor(tensor))
        return self._add_region(
            next(self._ids), ptr, nbytes, f"cuda:{tensor.device.index}", extra, keepalive=_cuda_ipc.flat_bytes(tensor)
        )

    def _check_cma_allowed(self, ptr: int, nbytes: int) -> None:
        where = f"region at {ptr:#x} ({nbytes} bytes) is private memory"
        if not self._allow_cma:
            raise TransportError(
                f"local: {where} and allow_cma=False; allocate it with alloc_shared() or use the 'tcp' transport"
            )
        blocker = _memory.cma_blocker()
        if blocker is not None:
            raise TransportError(
                f"local: {where}, which peers would write with "
                f"process_vm_writev, but {blocker}; allocate it with "
                "alloc_shared() or use the 'tcp' transport"
            )

    def _add_region(self, region_id, ptr, nbytes, device, extra, keepalive) -> Region:
        descriptor = pack_descriptor(
            _NAME, "region", agent=self._agent, region=region_id, nbytes=nbytes, device=device, **extra
        )
        region = Region(region_id, ptr, nbytes, device, descriptor)
        self._regions.add(region_id, _LocalRegion(region, extra["kind"], keepalive))
        if isinstance(keepalive, SharedBuffer):
            keepalive.registrations += 1
        return region

    def deregister(self, region: Region) -> None:
        if self._cuda is not None and region.device != "cpu":
            self._cuda.synchronize()
        entry = self._regions.remove(region.region_id, self._timeout_s)
        if entry is None:
            raise ValueError(f"region {region.region_id} is not registered here")
        if isinstance(entry.keepalive, SharedBuffer):
            entry.keepalive.registrations -= 1

    def import_region(self, peer_id: str, descriptor: bytes) -> RemoteRegion:
        self._check_open()
        peer = self._peer(peer_id)
        desc = unpack_descriptor(descriptor, _NAME, "region", _REGION_FIELDS)
        kind = desc["kind"]
        if kind not in _KIND_FIELDS:
            raise ValueError(f"local region descriptor: unknown kind {kind!r}")
        desc = unpack_descriptor(descriptor, _NAME, "region", _KIND_FIELDS[kind])
        if desc["agent"] != peer.agent:
            raise ValueError(
                f"region descriptor belongs to agent {desc['agent']!r}, but peer {peer_id!r} is agent {peer.agent!r}"
            )
        target = self._open_target(peer_id, peer, kind, desc)
        # a CUDA region is named by where it is mapped here, not by the exporter's index
        device = target.device if kind == "cuda" else desc["device"]
        remote = RemoteRegion(peer_id, desc["region"], desc["nbytes"], device)
        try:
            self._targets.add((peer_id, remote.region_id), target)
        except ValueError:
            _release_target(target)
            raise ValueError(f"region {remote.region_id} of peer {peer_id!r} is already imported") from None
        return remote

    def _open_target(self, peer_id: str, peer: _Peer, kind: str, desc: dict) -> _Target:
        nbytes = desc["nbytes"]
        if kind == "shm":
            if desc["offset"] < 0 or desc["offset"] + nbytes > desc["map_bytes"]:
                raise ValueError(
                    f"local region descriptor: offset {desc['offset']} + nbytes "
                    f"{nbytes} exceeds the shared buffer's {desc['map_bytes']} bytes"
                )
            mm = _memory.open_shared(desc["path"], desc["inode"], desc["map_bytes"])
            return _Target("shm", nbytes, "cpu", _memory.mapping_address(mm) + desc["offset"], mm)
        if kind == "cma":
            if peer.pidfd is None:
                raise TransportError(
                    f"peer {peer_id!r} runs in another pid namespace, so its "
                    "private memory cannot be written with process_vm_writev; "
                    "it should allocate with alloc_shared() or use 'tcp'"
                )
            try:
                _memory.cma_probe(desc["pid"], desc["addr"], nbytes)
            except OSError as exc:
                raise _cma_error(peer_id, exc, probing=True) from None
            return _Target("cma", nbytes, "cpu", desc["addr"])
        return self._open_cuda_target(peer_id, peer, nbytes, desc["ipc"])

    def _open_cuda_target(self, peer_id: str, peer: _Peer, nbytes: int, ipc: object) -> _Target:
        from sglang_kvxfer.transports.local import cuda_ipc as _cuda_ipc

        ipc = _cuda_ipc.check_ipc(ipc)
        if peer.pidfd is None:
            raise TransportError(
                f"peer {peer_id!r} runs in another pid namespace, so this process cannot see "
                "it exit, and writing CUDA IPC memory of an exited exporter can corrupt this "
                "process's CUDA context; run both in one pid namespace, or use 'tcp' or 'nixl'"
            )
        if self._exited(peer):
            raise PeerGoneError(f"peer {peer_id!r} (pid {peer.pid}) has exited; its CUDA region is not opened")
        try:
            index = _cuda_ipc.local_index(ipc["gpu"])
            # an invisible GPU is reached by peer access from the current device (CUDA IPC
            # opens handles of devices outside CUDA_VISIBLE_DEVICES since CUDA 10.1)
            device = index if index is not None else _cuda_ipc.current_device()
            tensor = _cuda_ipc.import_tensor(ipc, device)
        except ValueError:
            raise
        except Exception as exc:  # torch raises RuntimeError/AssertionError without CUDA
            raise TransportError(
                f"cannot open peer {peer_id!r}'s CUDA region ({ipc['gpu']}) by CUDA IPC: {type(exc).__name__}: {exc}"
            ) from exc
        return _Target("cuda", nbytes, f"cuda:{device}", mapping=tensor, gpu=ipc["gpu"], gpu_visible=index is not None)

    def path_cost(self, device: str = "cpu"):
        """CPU: one ``memmove`` per entry, measured on this host once per process
        (``_memory.memmove_rate``; the staged path's gather and scatter copy at the same
        rate). CUDA: declared, not measured: an entry is one async device copy call (about
        10 us of CPU), copies run at device-memory speed."""
        from sglang_kvxfer.planning.byteplan import PathCost

        kind, _ = parse_device(device)
        if kind == "cuda":
            return PathCost(10e-6, 100e9, 500e9, source="local cost, declared: CUDA IPC, one device copy per op")
        per_op, rate = _memory.memmove_rate()
        return PathCost(per_op, rate, rate, source="local cost, measured: one memmove per op")

    # -- writes -------------------------------------------------------------------------
    def _write(self, local: Region, remote: RemoteRegion, entries: Entries) -> Ticket:
        label = f"local write {local.region_id}->{remote.peer_id}:{remote.region_id}"
        peer = self._peer(remote.peer_id)
        src = self._regions.acquire(local.region_id)
        if src is None:
            raise ValueError(f"local region {local.region_id} is not registered here")
        try:
            dst = self._targets.acquire((remote.peer_id, remote.region_id))
            if dst is None:
                raise ValueError(
                    f"remote region {remote.region_id} of peer {remote.peer_id!r} "
                    "is not imported (import_region it first)"
                )
            try:
                return self._copy(label, peer, remote.peer_id, src.value, dst.value, entries)
            finally:
                self._targets.release(dst)
        finally:
            self._regions.release(src)

    def _mapped_device(self, remote: RemoteRegion) -> str | None:
        """Shared memory: ``cpu``; CUDA IPC of a GPU visible here: its device; private
        (CMA) memory, and CUDA IPC reached by peer access from another device: None."""
        lease = self._targets.acquire((remote.peer_id, remote.region_id))
        if lease is None:
            raise ValueError(
                f"remote region {remote.region_id} of peer {remote.peer_id!r} is not imported (import_region it first)"
            )
        try:
            target = lease.value
            if target.kind == "shm" or (target.kind == "cuda" and target.gpu_visible):
                return target.device
            return None
        finally:
            self._targets.release(lease)

    @contextlib.contextmanager
    def _remote_view(self, remote: RemoteRegion, offset: int, nbytes: int):
        """Shared memory and CUDA IPC regions are mapped here: hand out a view (leased, so
        the mapping outlives it); private (CMA) regions are not. The peer's pidfd is polled
        before (a CUDA IPC mapping of an exited exporter must not be written) and, for a
        view handed out, after the block: a peer that exited meanwhile fails it."""
        peer = self._peer(remote.peer_id)
        if peer.failed is not None:
            raise PeerGoneError(peer.failed)
        lease = self._targets.acquire((remote.peer_id, remote.region_id))
        if lease is None:
            raise ValueError(
                f"remote region {remote.region_id} of peer {remote.peer_id!r} is not imported (import_region it first)"
            )
        try:
            target = lease.value
            mapped = (target.kind == "cuda" and target.gpu_visible) or (target.kind == "shm" and nbytes > 0)
            if not mapped:
                yield None
                return
            gone = self._gone(remote.peer_id, peer)
            if gone is not None:
                raise PeerGoneError(f"{gone}; nothing was written to its memory")
            if target.kind == "cuda":
                yield target.mapping[offset : offset + nbytes]
            else:
                import torch

                raw = (ctypes.c_char * nbytes).from_address(target.base + offset)
                yield torch.frombuffer(raw, dtype=torch.uint8, count=nbytes)
            gone = self._gone(remote.peer_id, peer)  # the block ended: did the bytes reach a live peer?
            if gone is not None:
                raise PeerGoneError(f"{gone} while its memory was written through a mapped view")
        finally:
            self._targets.release(lease)

    def _copy(self, label, peer: _Peer, peer_id: str, src: _LocalRegion, dst: _Target, entries: Entries) -> Ticket:
        if (src.region.device == "cpu") != (dst.device == "cpu"):
            raise ValueError(
                f"local writes need both regions in the same kind of memory: local "
                f"region {src.region.region_id} is {src.region.device}, the remote "
                f"region is {dst.device}"
            )
        if peer.failed is not None:
            return Ticket.failed(label, PeerGoneError(peer.failed))
        if entries.num_entries == 0:
            return Ticket.completed(label)
        lo, ro, sz = entries.local_offsets, entries.remote_offsets, entries.sizes
        if dst.kind == "cuda":
            gone = self._gone(peer_id, peer)  # before a byte goes into its mapped memory
            if gone is not None:
                return Ticket.failed(label, PeerGoneError(f"{gone}; nothing was written to its CUDA IPC memory"))
            if self._cuda is None:
                from sglang_kvxfer.transports.local.cuda_ipc import CudaCopier

                self._cuda = CudaCopier()
            import torch  # loaded with cuda_ipc: a CUDA write comes from a registered tensor

            if not isinstance(src.keepalive, torch.Tensor):
                raise TransportError(f"local region {src.region.region_id} is not backed by a CUDA tensor")
            landed = self._cuda.post(src.keepalive, dst.mapping, lo, ro, sz)

            def poll() -> bool:
                if not landed():
                    return False
                gone = self._gone(peer_id, peer)  # exited meanwhile: the bytes are lost with it
                if gone is not None:
                    ticket._fail(PeerGoneError(gone))  # raised here, it would become a TransportError
                    return False
                return True

            ticket = Ticket(label, progress=poll)
            return ticket
        try:
            if dst.kind == "shm":
                _memory.copy_entries(dst.base, src.region.ptr, ro, lo, sz)
            else:
                _memory.cma_write(peer.pid, lo + src.region.ptr, ro + dst.base, sz)
        except OSError as exc:
            error = _cma_error(peer_id, exc, probing=False)
            if isinstance(error, PeerGoneError):
                self._mark_failed(peer_id, peer, str(error))
            return Ticket.failed(label, error)
        if self._exited(peer):
            reason = f"peer {peer_id!r} (pid {peer.pid}) has exited"
            self._mark_failed(peer_id, peer, reason)
            return Ticket.failed(label, PeerGoneError(reason))
        return Ticket.completed(label)

    # -- failures and lifetime ----------------------------------------------------------
    @staticmethod
    def _exited(peer: _Peer) -> bool:
        if peer.pidfd is None:
            return False
        return bool(select.select([peer.pidfd], [], [], 0)[0])  # readable once it exits

    def _gone(self, peer_id: str, peer: _Peer) -> str | None:
        """Why ``peer`` must not be written any more (marked failed, or exited now: then it
        is marked failed), or None. One pidfd poll: the cost per CUDA post."""
        if peer.failed is None and self._exited(peer):
            self._mark_failed(peer_id, peer, f"peer {peer_id!r} (pid {peer.pid}) has exited")
        return peer.failed

    def _mark_failed(self, peer_id: str, peer: _Peer, reason: str) -> None:
        with self._lock:
            if peer.failed is None:
                peer.failed = reason
                self._failures.append(PeerFailure(peer_id, reason))

    def peer_failures(self) -> list[PeerFailure]:
        for peer_id, peer in list(self._peers.items()):
            if peer.failed is None and self._exited(peer):
                self._mark_failed(peer_id, peer, f"peer {peer_id!r} (pid {peer.pid}) has exited")
        with self._lock:
            out, self._failures = self._failures, []
        return out

    def _close(self) -> None:
        for peer_id in list(self._peers):
            self.remove_peer(peer_id)
        for _, entry in self._regions.items():
            self.deregister(entry.region)


def _check_peer_id(peer_id) -> None:
    if not isinstance(peer_id, str) or not peer_id:
        raise ValueError(f"peer_id must be a non-empty str, got {peer_id!r}")


def _release_target(target: _Target | None) -> None:
    if target is not None and target.kind == "shm":
        target.mapping.close()


def _cma_error(peer_id: str, exc: OSError, *, probing: bool) -> TransportError:
    if exc.errno == errno.ESRCH:
        return PeerGoneError(f"peer {peer_id!r} has exited ({exc.strerror})")
    if exc.errno == errno.EPERM:
        return TransportError(
            f"the kernel does not permit process_vm_writev into peer {peer_id!r} ({exc}): it "
            "needs the same user, ptrace permission (kernel.yama.ptrace_scope <= 1) and a "
            "dumpable peer; have the peer allocate with alloc_shared() or use the 'tcp' transport"
        )
    what = "probing" if probing else "writing"
    return TransportError(
        f"{what} peer {peer_id!r}'s private memory failed: {exc} (is the region still registered and mapped?)"
    )
