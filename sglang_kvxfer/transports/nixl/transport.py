"""The ``nixl`` transport: one-sided writes through NIXL's Python agent API over UCX.

One NIXL agent per transport instance (one per process), with one UCX backend. Memory is
registered as ``DRAM`` or ``VRAM``; the agent descriptor carries NIXL's agent metadata (the
UCX connection info) and each region descriptor carries NIXL's partial metadata of that
region (its remote keys), both as bytes inside our own tagged msgpack envelope. A batch is
posted as one transfer request (``make_prepped_xfer`` with numpy index arrays) and one
``transfer`` call; its ticket polls ``check_xfer_state`` from its progress hook and
releases the request once it ends.

Descriptor lists: NIXL addresses memory by descriptor, not by byte offset. When every
offset and size of a batch is a multiple of a block size ``g`` (the engine's page-sized
entries), each region's descriptor list at granularity ``g`` is prepared once and reused
by every later batch, which then only passes index arrays. Otherwise the batch's own lists
are prepared from Nx3 arrays and released with it (both cost about the same per
descriptor here, see the README).

Lifetime: ``close`` releases every request, list and registration, then drops the agent,
so UCX tears its workers down then, not at some later garbage collection. A request NIXL
could not cancel is never released behind UCX's back: its handle and the agent stay
referenced (``_KEPT``) until the process exits, and ``close`` says so.

Progress: NIXL's own progress thread busy-polls a core, so by default a thread of this
transport progresses UCX every millisecond instead (and every poll progresses too).

``nixl.agent`` creates the agent (UCX settings from options and environment, ``UCX_TLS``
applied only while the backend is created) and has ``exit_process``, which processes that
created a UCX backend leave through (a libnl destructor can crash them at exit).
This module owns regions, peers, prepared lists and writes; NIXL is imported when the
first transport is created. It must not import torch.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sglang_kvxfer.errors import PeerGoneError, TransportError
from sglang_kvxfer.transports._common import UseTable, open_write, pack_descriptor, unpack_descriptor
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
)
from sglang_kvxfer.transports.nixl.agent import UcxSettings, create_agent, exit_process, import_api, ucx_backend_created

__all__ = ["NixlTransport", "exit_process", "ucx_backend_created"]

log = logging.getLogger("sglang_kvxfer.transports.nixl")
# (agent, request handles) of closed transports with requests NIXL could not cancel
_KEPT: list[tuple[Any, list]] = []

_NAME = "nixl"
_MAX_BLOCK_SIZES = 4  # prepared descriptor lists kept per region (one per block size)
_MAX_BLOCKS_PER_ENTRY = 8  # prepared lists are used while entries span at most this on average
_AGENT_FIELDS = {"agent": str, "md": bytes}
_REGION_FIELDS = {
    "agent": str,
    "region": int,
    "addr": int,
    "nbytes": int,
    "device": str,
    "mem": str,
    "dev_id": int,
    "md": bytes,
}


@dataclass
class _NixlRegion:
    region: Region
    reg: object  # NIXL's registration list, for deregister_memory
    mem: str  # "DRAM" | "VRAM"
    dev_id: int


@dataclass(frozen=True)
class _Target:
    remote: RemoteRegion
    addr: int
    mem: str
    dev_id: int


@dataclass
class _Peer:
    agent: str
    regions: dict[int, _Target] = field(default_factory=dict)  # region_id -> _Target
    failed: str | None = None


class _Xfer:
    """One posted batch: its NIXL request, the lists made for it, the lease on its source,
    and the ticket it is the progress hook of (returned once NIXL has taken the request)."""

    __slots__ = ("transport", "peer_id", "handle", "extra", "lease", "ticket", "succeeded")

    def __init__(
        self,
        transport: NixlTransport,
        peer_id: str,
        handle: Any,
        extra: tuple[Any, ...],
        lease: UseTable.Lease | None,
        label: str,
    ):
        self.transport, self.peer_id = transport, peer_id
        self.handle, self.extra, self.lease = handle, extra, lease
        self.ticket = Ticket(label, progress=self)
        self.succeeded = False  # set when NIXL reported DONE

    def __call__(self) -> bool:  # the ticket's progress hook
        return self.transport._progress(self)


class NixlTransport(Transport):
    """One-sided writes through a NIXL agent with the UCX backend (InfiniBand/RoCE, NVLink
    via cuda_ipc, shared memory or TCP, as UCX chooses).

    Parameters
    ----------
    agent_id : NIXL agent name, unique among peers (default: host, pid and a random tag).
    ucx_tls : UCX transports (``UCX_TLS``), e.g. ``"tcp"`` or ``"sm"``; default
        ``KVXFER_NIXL_UCX_TLS``; empty keeps the environment's ``UCX_TLS`` or UCX's choice.
    ucx_net_devices : devices UCX may use (backend parameter ``ucx_devices``); default
        ``KVXFER_NIXL_UCX_NET_DEVICES``; empty keeps ``UCX_NET_DEVICES`` or all devices.
    ucx_error_handling_mode : ``"peer"`` or ``"none"``; default ``"none"`` when every UCX
        transport is host-only (``sm``, ``cma``...), which UCX requires, else NIXL's ``peer``.
    num_workers : UCX workers of the backend (default: NIXL's, 1).
    progress_thread : run NIXL's own progress thread. It busy-polls a core (NIXL's Python
        API fixes its delay at 0), so by default (False) a thread of this transport
        progresses UCX every ``progress_interval_s`` instead; polls progress it too. The
        target of writes needs one or the other (UCX connection setup, tcp puts).
    progress_interval_s : period of that thread (ignored with ``progress_thread=True``).
    max_prepped_descs : largest descriptor list prepared once per region and block size; a
        batch whose block size would need more is posted with lists of its own.
    close_timeout_s : how long ``deregister``/``remove_peer``/``close`` drive writes in flight.
    """

    name = _NAME
    # The default UCX choice; an instance refines it from its UCX settings (tcp only: not
    # one-sided; host-only transports: same host only).
    caps = Caps(mem_kinds=frozenset({"cpu", "cuda"}), same_host_only=False, read_supported=False, one_sided=True)

    def __init__(
        self,
        *,
        agent_id: str | None = None,
        ucx_tls: str | None = None,
        ucx_net_devices: str | None = None,
        ucx_error_handling_mode: str | None = None,
        num_workers: int | None = None,
        progress_thread: bool = False,
        progress_interval_s: float = 0.001,
        max_prepped_descs: int = 1 << 18,
        close_timeout_s: float = 5.0,
    ):
        super().__init__()
        ucx = UcxSettings.resolve(ucx_tls, ucx_net_devices, ucx_error_handling_mode)
        if num_workers is not None and (
            isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1
        ):
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if not progress_thread and (
            isinstance(progress_interval_s, bool)
            or not isinstance(progress_interval_s, (int, float))
            or not 0 < progress_interval_s <= 1
        ):
            raise ValueError(f"progress_interval_s must be in (0, 1] seconds, got {progress_interval_s!r}")
        if (
            isinstance(max_prepped_descs, bool)
            or not isinstance(max_prepped_descs, int)
            or not 1 <= max_prepped_descs < 2**31
        ):
            raise ValueError(f"max_prepped_descs must be an int in [1, 2**31), got {max_prepped_descs!r}")
        self.caps = Caps(
            mem_kinds=frozenset({"cpu", "cuda"}),
            same_host_only=ucx.host_only,
            read_supported=False,
            one_sided=ucx.one_sided,
        )
        self.ucx_settings = ucx.describe()
        self._max_descs, self._close_timeout_s = max_prepped_descs, close_timeout_s
        self._name = agent_id or f"nixl-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._agent = create_agent(import_api(), self._name, ucx, num_workers, progress_thread)
        self._lock = threading.RLock()  # every agent call and table change happens under it
        self._ids = itertools.count(1)
        self._regions = UseTable()  # region_id -> _NixlRegion
        self._peers: dict[str, _Peer] = {}
        self._dlists: dict[tuple, dict] = {}  # ("local", rid) | (peer, rid) -> {block: handle}
        self._inflight: set[_Xfer] = set()
        self._unreleased: list = []  # request handles NIXL refused to release (not cancellable)
        self._failures: list[PeerFailure] = []
        self.path_counts = {"prepped": 0, "per_batch": 0}  # how batches were posted
        self._stop = threading.Event()
        self._pump = None
        if not progress_thread:
            self._pump = threading.Thread(
                target=self._progress_loop,
                args=(progress_interval_s,),
                daemon=True,
                name=f"kvxfer-nixl-progress-{self._name}",
            )
            self._pump.start()

    def _progress_loop(self, interval_s: float) -> None:
        """Progress UCX now and then: NIXL progresses its workers when asked for
        notifications (we use none, so nothing is lost by taking them)."""
        while not self._stop.wait(interval_s):
            with self._lock:
                if self._closed:
                    return
                try:
                    self._agent.get_new_notifs()
                except Exception as exc:  # progress errors also show on the transfers
                    log.debug("nixl: progress: %s", exc)

    # -- descriptors and peers ----------------------------------------------------------
    def agent_descriptor(self) -> bytes:
        self._check_open()
        with self._lock:
            md = self._agent.get_agent_metadata()
        return pack_descriptor(_NAME, "agent", agent=self._name, md=bytes(md))

    def add_peer(self, peer_id: str, descriptor: bytes, secret: bytes | None = None) -> None:
        """``secret`` is checked and not used: NIXL does not authenticate writers (any
        agent that loaded this agent's metadata may write its registered memory; see
        docs/trust-model-transports.md). An existing ``peer_id`` is removed first (its
        pending writes fail), then re-added."""
        self._check_open()
        check_secret(secret, optional=True)
        if not isinstance(peer_id, str) or not peer_id:
            raise ValueError(f"peer_id must be a non-empty str, got {peer_id!r}")
        desc = unpack_descriptor(descriptor, _NAME, "agent", _AGENT_FIELDS)
        if peer_id in self._peers:  # a restarted or re-registered peer replaces its record
            try:
                self.remove_peer(peer_id)
            except ValueError:  # removed concurrently
                pass
        with self._lock:
            if peer_id in self._peers:
                raise ValueError(f"peer {peer_id!r} was added concurrently")
            if desc["agent"] == self._name:
                raise ValueError(f"peer {peer_id!r} is this agent itself ({self._name!r})")
            self._load_md(desc["md"], desc["agent"], f"agent descriptor of peer {peer_id!r}")
            self._peers[peer_id] = _Peer(desc["agent"])

    def _load_md(self, md: bytes, agent: str, what: str) -> None:
        try:
            loaded = self._agent.add_remote_agent(md)
        except Exception as exc:
            raise TransportError(f"nixl: NIXL refused the {what} ({type(exc).__name__})") from exc
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != agent:
            raise ValueError(f"{what}: metadata is for agent {loaded!r}, not {agent!r}")

    def remove_peer(self, peer_id: str) -> None:
        with self._lock:
            peer = self._peers.pop(peer_id, None)
        if peer is None:
            raise ValueError(f"unknown peer {peer_id!r}")
        self._settle(lambda x: x.peer_id == peer_id, f"peer {peer_id!r} was removed with the write pending")
        with self._lock:
            for rid in peer.regions:
                self._release_dlists((peer_id, rid))
            try:
                self._agent.remove_remote_agent(peer.agent)
            except Exception as exc:  # already disconnected: nothing left to undo
                log.debug("nixl: remove_remote_agent(%s): %s", peer.agent, exc)

    # -- regions ------------------------------------------------------------------------
    def register(self, ptr: int, nbytes: int, device: str = "cpu") -> Region:
        self._check_open()
        self._check_register_args(ptr, nbytes)
        kind, index = parse_device(device)
        mem, dev_id, device = ("DRAM", 0, "cpu") if kind == "cpu" else ("VRAM", index, f"cuda:{index}")
        with self._lock:
            try:
                reg = self._agent.register_memory([(ptr, nbytes, dev_id, "")], mem)
                md = self._agent.get_partial_agent_metadata(reg, inc_conn_info=False)
            except Exception as exc:
                raise TransportError(
                    f"nixl: registering {nbytes} bytes at {ptr:#x} as {mem} failed ({type(exc).__name__}: {exc})"
                ) from exc
            region_id = next(self._ids)
            descriptor = pack_descriptor(
                _NAME,
                "region",
                agent=self._name,
                region=region_id,
                addr=ptr,
                nbytes=nbytes,
                device=device,
                mem=mem,
                dev_id=dev_id,
                md=bytes(md),
            )
            region = Region(region_id, ptr, nbytes, device, descriptor)
            self._regions.add(region_id, _NixlRegion(region, reg, mem, dev_id))
        return region

    def deregister(self, region: Region) -> None:
        rid = region.region_id
        if self._regions.get(rid) is None:
            raise ValueError(f"region {rid} is not registered here")
        self._settle(lambda x: x.lease.key == rid, f"local region {rid} was deregistered while being sent")
        entry = self._regions.remove(rid, self._close_timeout_s)
        with self._lock:
            self._release_dlists(("local", rid))
            self._agent.deregister_memory(entry.reg)

    def import_region(self, peer_id: str, descriptor: bytes) -> RemoteRegion:
        self._check_open()
        desc = unpack_descriptor(descriptor, _NAME, "region", _REGION_FIELDS)
        with self._lock:
            peer = self._peers.get(peer_id)
            if peer is None:
                raise ValueError(f"unknown peer {peer_id!r} (add_peer it first)")
            if desc["agent"] != peer.agent:
                raise ValueError(
                    f"region descriptor belongs to agent {desc['agent']!r}, but "
                    f"peer {peer_id!r} is agent {peer.agent!r}"
                )
            if desc["mem"] not in ("DRAM", "VRAM") or desc["nbytes"] <= 0:
                raise ValueError(
                    f"nixl region descriptor: mem={desc['mem']!r} (DRAM or VRAM) "
                    f"and nbytes={desc['nbytes']} (> 0) expected"
                )
            if desc["region"] in peer.regions:
                raise ValueError(f"region {desc['region']} of peer {peer_id!r} is already imported")
            self._load_md(desc["md"], peer.agent, f"region {desc['region']} of peer {peer_id!r}")
            remote = RemoteRegion(peer_id, desc["region"], desc["nbytes"], desc["device"])
            peer.regions[remote.region_id] = _Target(remote, desc["addr"], desc["mem"], desc["dev_id"])
        return remote

    # -- writes -------------------------------------------------------------------------
    def _write(self, local: Region, remote: RemoteRegion, entries: Entries) -> Ticket:
        label = f"nixl write {local.region_id}->{remote.peer_id}:{remote.region_id}"
        with self._lock:
            self._check_open()
            peer = self._peers.get(remote.peer_id)
            target = peer.regions.get(remote.region_id) if peer is not None else None
            opened = open_write(
                label, peer, target.remote if target is not None else None, remote, self._regions, local, entries
            )
            if isinstance(opened, Ticket):
                return opened
            peer, lease = opened
            if target is None:  # open_write raises for a region that is not imported
                raise ValueError(
                    f"remote region {remote.region_id} of peer {remote.peer_id!r} "
                    "is not imported (import_region it first)"
                )
            xfer = _Xfer(self, remote.peer_id, None, (), lease, label)
            try:
                xfer.handle, xfer.extra = self._request(lease.value, peer, target, entries)
                state = self._agent.transfer(xfer.handle)
            except Exception as exc:
                error = self._error(exc, remote.peer_id, "posting")
                self._finish(xfer)
                return Ticket.failed(label, error)
            if state == "DONE":
                self._finish(xfer)
                return Ticket.completed(label)
            if state != "PROC":
                self._finish(xfer)
                return Ticket.failed(
                    label, TransportError(f"nixl: posting a write to peer {remote.peer_id!r} returned {state!r}")
                )
            self._inflight.add(xfer)
            return xfer.ticket

    def _request(self, src: _NixlRegion, peer: _Peer, target: _Target, entries: Entries):
        """A NIXL transfer request for ``entries`` and the lists to release with it."""
        lo, ro, sz = entries.local_offsets, entries.remote_offsets, entries.sizes
        block = int(np.gcd.reduce(np.concatenate((lo, ro, sz))))
        local_key, remote_key = ("local", src.region.region_id), (target.remote.peer_id, target.remote.region_id)
        # Prepared lists pay off for page-sized entries; entries of many blocks each would
        # make NIXL walk (and merge) many descriptors, so those get lists of their own.
        if (
            max(src.region.nbytes, target.remote.nbytes) // block <= self._max_descs
            and entries.total_bytes // block <= _MAX_BLOCKS_PER_ENTRY * sz.shape[0]
        ):
            lh = self._prepped(
                local_key, block, "NIXL_INIT_AGENT", src.region.ptr, src.region.nbytes, src.mem, src.dev_id
            )
            rh = self._prepped(
                remote_key, block, peer.agent, target.addr, target.remote.nbytes, target.mem, target.dev_id
            )
            if lh is not None and rh is not None:
                self.path_counts["prepped"] += 1
                handle = self._agent.make_prepped_xfer(
                    "WRITE", lh, _block_indices(lo, sz, block), rh, _block_indices(ro, sz, block)
                )
                return handle, ()
        self.path_counts["per_batch"] += 1
        lh = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", _rows(src.region.ptr + lo, sz, src.dev_id), src.mem)
        try:
            rh = self._agent.prep_xfer_dlist(peer.agent, _rows(target.addr + ro, sz, target.dev_id), target.mem)
        except Exception:
            lh.release()
            raise
        index = np.arange(sz.shape[0], dtype=np.int32)
        try:
            return self._agent.make_prepped_xfer("WRITE", lh, index, rh, index), (lh, rh)
        except Exception:
            lh.release()
            rh.release()
            raise

    def _prepped(self, key, block, agent, addr, nbytes, mem, dev_id):
        """The list of ``key``'s region cut into ``block``-byte descriptors, made once."""
        lists = self._dlists.setdefault(key, {})
        handle = lists.get(block)
        if handle is None and len(lists) < _MAX_BLOCK_SIZES:
            count = nbytes // block
            handle = self._agent.prep_xfer_dlist(
                agent,
                _rows(addr + block * np.arange(count, dtype=np.int64), np.full(count, block, dtype=np.int64), dev_id),
                mem,
            )
            lists[block] = handle
        return handle

    def _progress(self, xfer: _Xfer) -> bool:
        with self._lock:
            if xfer.handle is None:  # another thread finished it (its ticket is set, or is
                return xfer.succeeded  # about to be set to DONE by that thread)
            try:
                state = self._agent.check_xfer_state(xfer.handle)
            except Exception as exc:
                xfer.ticket._fail(self._error(exc, xfer.peer_id, "checking"))
                self._finish(xfer)
                return False
            if state == "PROC":
                return False
            if state == "DONE":
                xfer.succeeded = True
            else:
                xfer.ticket._fail(TransportError(f"nixl: the write to peer {xfer.peer_id!r} ended in state {state!r}"))
            self._finish(xfer)
            return xfer.succeeded

    def _finish(self, xfer: _Xfer) -> None:
        """Release a request that has ended (or must be abandoned); under ``_lock``."""
        self._inflight.discard(xfer)
        for handle in (xfer.handle, *xfer.extra):
            if handle is not None:
                try:
                    handle.release()
                except Exception as exc:  # NIXL keeps a request it cannot cancel: so do we
                    log.warning("nixl: releasing %r failed: %s", handle, exc)
                    self._unreleased.append(handle)
        xfer.handle, xfer.extra = None, ()
        if xfer.lease is not None:
            self._regions.release(xfer.lease)
            xfer.lease = None

    def _error(self, exc: Exception, peer_id: str, doing: str) -> TransportError:
        """The one place NIXL's exceptions become ours; a disconnect fails the peer."""
        kind = type(exc).__name__
        if kind != "nixlRemoteDisconnectError":
            return TransportError(f"nixl: {doing} a write to peer {peer_id!r} failed ({kind}: {exc})")
        reason = f"nixl: peer {peer_id!r} disconnected ({kind} while {doing} a write)"
        peer = self._peers.get(peer_id)
        if peer is not None and peer.failed is None:
            peer.failed = reason
            self._failures.append(PeerFailure(peer_id, reason))
            log.warning("%s", reason)
        return PeerGoneError(reason)

    def _settle(self, which, reason: str) -> None:
        """Drive the matching writes in flight until they end or time runs out; fail the rest."""
        deadline = time.monotonic() + self._close_timeout_s
        while True:
            with self._lock:
                pending = [x for x in self._inflight if which(x)]
            for xfer in pending:
                xfer.ticket.poll()
            if not pending:
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(0.001)
        with self._lock:
            for xfer in pending:
                if xfer.handle is not None:
                    xfer.ticket._fail(TransportError(f"nixl: {reason}"))
                    self._finish(xfer)

    def _release_dlists(self, key) -> None:
        for handle in self._dlists.pop(key, {}).values():
            handle.release()

    # -- failures and lifetime ----------------------------------------------------------
    def peer_failures(self) -> list[PeerFailure]:
        with self._lock:
            out, self._failures = self._failures, []
        return out

    def _close(self) -> None:
        self._settle(lambda x: True, "the nixl transport was closed with the write pending")
        self._stop.set()
        if self._pump is not None:
            self._pump.join(self._close_timeout_s)
        with self._lock:
            for key in list(self._dlists):
                self._release_dlists(key)
            for peer in self._peers.values():
                try:
                    self._agent.remove_remote_agent(peer.agent)
                except Exception as exc:
                    log.debug("nixl: remove_remote_agent(%s): %s", peer.agent, exc)
            self._peers.clear()
            for rid, entry in self._regions.items():
                self._regions.remove(rid, 0)
                self._agent.deregister_memory(entry.reg)
            kept = []
            for handle in self._unreleased:  # (ended since, or abortable now)
                try:
                    handle.release()
                except Exception:
                    kept.append(handle)
            self._unreleased = []
            pumping = self._pump is not None and self._pump.is_alive()
            if pumping or kept:
                # Destroying the agent would free what UCX may still touch: keep it.
                _KEPT.append((self._agent, kept))
                log.warning(
                    "nixl: agent %s kept alive until the process exits (%d transfer request(s) NIXL "
                    "could not cancel%s)",
                    self._name,
                    len(kept),
                    ", its progress thread did not stop" if pumping else "",
                )
            self._agent = None  # the last reference here: UCX's workers go now, not at a later GC


def _rows(addrs: np.ndarray, sizes: np.ndarray, dev_id: int) -> np.ndarray:
    """NIXL's Nx3 descriptor array: ``(address, length, device id)`` per row, uint64."""
    rows = np.empty((sizes.shape[0], 3), dtype=np.uint64)
    rows[:, 0], rows[:, 1], rows[:, 2] = addrs, sizes, dev_id
    return rows


def _block_indices(offsets: np.ndarray, sizes: np.ndarray, block: int) -> np.ndarray:
    """Indices of the ``block``-sized descriptors that entries ``(offsets, sizes)`` cover.

    Entry i covers descriptors ``offsets[i] // block`` ... ``+ sizes[i] // block - 1``;
    NIXL merges consecutive descriptors back into one operation.
    """
    counts = sizes // block
    ends = np.cumsum(counts)
    first = np.repeat(offsets // block - (ends - counts), counts)
    return (first + np.arange(int(ends[-1]), dtype=np.int64)).astype(np.int32)
