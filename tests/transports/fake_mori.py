"""A stand-in for MORI-IO (``mori``, ``mori.io``, ``mori.cpp``) that follows its documented
contract, so the ``mori`` transport's logic is tested without ROCm, an AMD GPU or a NIC.

What it keeps from MORI:
* the Python surface: ``IOEngine`` (snake_case wrapper), ``IOEngineSession``,
  ``TransferStatus`` (CamelCase methods), the config classes and enums with MORI's values;
* descriptors as the same msgpack arrays (``EngineDesc``: 6 fields, ``MemoryDesc``: 15),
  ``unpack`` of garbage raising ``RuntimeError('std::bad_cast')``;
* one status per (local, remote) memory pair, set IN_PROGRESS before the call returns and
  completed later by another thread; errors are sticky (``Update`` ignores later codes);
  an entry over UINT32_MAX or outside either region fails the status with ERR_INVALID_ARGS
  before the call returns; ``wait_all`` returns the first error, IN_PROGRESS on timeout,
  INIT for a status never submitted, SUCCESS for an empty list;
* ``create_session`` returns None without a backend and raises ``RuntimeError`` for an
  unregistered remote engine, an unknown remote memory or a size mismatch, which it learns
  by asking the remote engine's control plane over TCP (``EngineDesc.host:port``), as MORI
  fetches remote memory keys; memory registered before the backend exists is unknown to it;
* ``pop_peer_failure`` (wheel 1.2.4) only when installed with ``peer_failure_api=True``.

How bytes move: the "RDMA write" is ``process_vm_writev`` into the remote engine's process
(``EngineDesc.pid``) at ``MemoryDesc.data + offset``: one-sided, real bytes. A vanished
process fails the status with ERR_RDMA_OP and queues a PEER_UNREACHABLE failure event.

Test knobs live on ``engine.fake``: ``gate`` (clear it to hold completions), ``raise_on_submit``
(the next submit raises ``RuntimeError`` with that text), ``fail_next`` ((code, message)
for the next transfer) and ``events`` (queued ``PeerFailureEvent``s).
"""

from __future__ import annotations

import enum
import errno
import importlib.machinery
import itertools
import os
import queue
import socket
import struct
import sys
import threading
import time
import types
import weakref
from collections import deque

import msgpack
import numpy as np

from sglang_kvxfer.transports._memory import allow_ptrace_writes, cma_write

UINT32_MAX = 2**32 - 1


class BackendType(enum.IntEnum):
    Unknown, XGMI, RDMA, TCP, FABRIC = 0, 1, 2, 3, 4


class MemoryLocationType(enum.IntEnum):
    Unknown, CPU, GPU = 0, 1, 2


class StatusCode(enum.IntEnum):
    SUCCESS, INIT, IN_PROGRESS = 0, 1, 2
    ERR_INVALID_ARGS, ERR_NOT_FOUND, ERR_RDMA_OP, ERR_BAD_STATE, ERR_GPU_OP = 11, 12, 13, 14, 15


class PollCqMode(enum.IntEnum):
    POLLING, EVENT = 0, 1


class PeerFailureReason(enum.IntEnum):
    UNKNOWN, PEER_UNREACHABLE, LOCAL_QP_ERROR, LOCAL_PORT_DOWN = 0, 1, 2, 3
    LOCAL_DEVICE_FATAL, LOCAL_CQ_ERROR = 4, 5


class IOEngineConfig:
    def __init__(self, host: str = "", port: int = 0):
        self.host, self.port = host, port


class RdmaBackendConfig:
    def __init__(
        self,
        qp_per_transfer=1,
        post_batch_size=-1,
        num_worker_threads=-1,
        poll_cq_mode=PollCqMode.POLLING,
        enable_notification=True,
        notif_per_qp=1024,
        enable_transfer_chunking=False,
        chunk_bytes=65536,
        max_chunks_per_transfer=64,
        num_nics_per_transfer=1,
    ):
        self.qp_per_transfer, self.post_batch_size = qp_per_transfer, post_batch_size
        self.num_worker_threads, self.poll_cq_mode = num_worker_threads, poll_cq_mode
        self.enable_notification, self.notif_per_qp = enable_notification, notif_per_qp
        self.enable_transfer_chunking, self.chunk_bytes = enable_transfer_chunking, chunk_bytes
        self.max_chunks_per_transfer = max_chunks_per_transfer
        self.num_nics_per_transfer = num_nics_per_transfer


class XgmiBackendConfig:
    def __init__(self, num_streams=64, num_events=64):
        self.num_streams, self.num_events = num_streams, num_events


def _unpack_array(blob, n: int, defaults: list) -> list:
    try:
        obj = msgpack.unpackb(bytes(blob), raw=False)
    except Exception:
        raise RuntimeError("std::bad_cast") from None
    if not isinstance(obj, list) or len(obj) > n:
        raise RuntimeError("std::bad_cast")
    obj = obj + defaults[len(obj) :]  # MORI accepts a short array, defaulting the rest
    for value, default in zip(obj, defaults):
        if type(value) is not type(default) and not (isinstance(default, int) and isinstance(value, int)):
            raise RuntimeError("std::bad_cast")
    return obj


class EngineDesc:
    """``[key, node_id, hostname, host, port, pid]``; read-only, no public constructor."""

    _DEFAULTS = ["", "", "", "", 0, 0]

    def __init__(self, *_):
        raise TypeError("mori.cpp.EngineDesc: No constructor defined!")

    @classmethod
    def _make(cls, fields):
        self = object.__new__(cls)
        self._f = list(fields)
        return self

    key = property(lambda s: s._f[0])
    node_id = property(lambda s: s._f[1])
    hostname = property(lambda s: s._f[2])
    host = property(lambda s: s._f[3])
    port = property(lambda s: s._f[4])
    pid = property(lambda s: s._f[5])

    def pack(self) -> bytes:
        return msgpack.packb(self._f, use_bin_type=True)

    @staticmethod
    def unpack(blob) -> EngineDesc:
        return EngineDesc._make(_unpack_array(blob, 6, EngineDesc._DEFAULTS))

    def __eq__(self, other):
        return isinstance(other, EngineDesc) and self._f == other._f


class MemoryDesc:
    """``[engine_key, id, device_id, device_bus_id, data, size, loc, ipc_handle, numa_node,
    ipc_offset, fabric_handle, vpod_id, vpod_ppod_id, fabric_offset, fabric_alloc_size]``."""

    _DEFAULTS = ["", 0, -1, "", 0, 0, 0, bytes(64), -1, 0, bytes(64), -1, "", 0, 0]
    _NAMES = ("engine_key", "id", "device_id", "device_bus_id", "data", "size", "loc", "ipc_handle", "numa_node")

    def __init__(self):
        self._f = list(self._DEFAULTS)

    @classmethod
    def _make(cls, **fields):
        self = cls()
        for name, value in fields.items():
            self._f[cls._NAMES.index(name)] = value
        return self

    def __getattr__(self, name):
        if name in MemoryDesc._NAMES:
            return self._f[MemoryDesc._NAMES.index(name)]
        raise AttributeError(name)

    def pack(self) -> bytes:
        return msgpack.packb(self._f, use_bin_type=True)

    @staticmethod
    def unpack(blob) -> MemoryDesc:
        desc = MemoryDesc()
        desc._f = _unpack_array(blob, 15, MemoryDesc._DEFAULTS)
        return desc

    def __eq__(self, other):  # MORI compares the first 9 logical fields
        return isinstance(other, MemoryDesc) and self._f[:9] == other._f[:9]


class PeerFailureEvent:
    def __init__(self, remote_engine_key, reason, qp_num=0, port_num=1, device_name="fake0", detail=""):
        self.remote_engine_key, self.reason, self.qp_num = remote_engine_key, reason, qp_num
        self.port_num, self.device_name, self.detail = port_num, device_name, detail


class TransferStatus:
    """INIT -> IN_PROGRESS -> SUCCESS | ERR_*; ``Update`` never overwrites an error."""

    def __init__(self):
        self._code, self._msg, self._cond = StatusCode.INIT, "", threading.Condition()

    def Code(self):
        return self._code

    def Message(self):
        return self._msg

    def Init(self):
        return self._code == StatusCode.INIT

    def InProgress(self):
        return self._code == StatusCode.IN_PROGRESS

    def Succeeded(self):
        return self._code == StatusCode.SUCCESS

    def Failed(self):
        return self._code > 10

    def Update(self, code, message):
        with self._cond:
            if self._code > 10:
                return
            self._code, self._msg = StatusCode(code), message
            self._cond.notify_all()

    def SetCode(self, code):
        with self._cond:
            self._code = StatusCode(code)
            self._cond.notify_all()

    def SetMessage(self, message):
        self._msg = message

    def Wait(self):
        self.WaitFor(-1)

    def WaitFor(self, timeout_ms=-1):
        with self._cond:
            if self._code == StatusCode.IN_PROGRESS and timeout_ms != 0:
                self._cond.wait_for(
                    lambda: self._code != StatusCode.IN_PROGRESS, None if timeout_ms < 0 else timeout_ms / 1000
                )
            return self._code


class _Knobs:
    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()
        self.raise_on_submit: str | None = None
        self.fail_next: tuple | None = None
        self.events: deque = deque()
        self.submits: list = []  # (local offsets, remote offsets, sizes) per batch_write call
        self.sessions_created = 0
        self.rdma_devices = None  # MORI_RDMA_DEVICES as the RDMA backend saw it


def _frame_send(sock, obj):
    data = msgpack.packb(obj, use_bin_type=True)
    sock.sendall(struct.pack("<I", len(data)) + data)


def _frame_recv(sock):
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        if not chunk:
            raise ConnectionError("control plane closed")
        head += chunk
    (n,), body = struct.unpack("<I", head), b""
    while len(body) < n:
        chunk = sock.recv(n - len(body))
        if not chunk:
            raise ConnectionError("control plane closed")
        body += chunk
    return msgpack.unpackb(body, raw=False)


# (engine key, memory id) of every region registered with a fake engine of this process and
# not deregistered yet: a completion never writes into memory that was deregistered (and may
# since be freed), as real MORI drops a region's MRs on deregister_memory.
_LIVE_MEMORY: set = set()
_IN_PROCESS: set = set()  # keys of the engines created in this process (their memory is checked)
_LIVE_LOCK = threading.Lock()


class _Engine:
    """``mori.io.IOEngine`` as of the source tree (no ``pop_peer_failure``)."""

    def __init__(self, key: str, config: IOEngineConfig):
        with open("/proc/sys/kernel/random/boot_id") as f:
            node_id = f.read().strip()
        self._desc = [key, node_id, socket.gethostname(), config.host, config.port, os.getpid()]
        with _LIVE_LOCK:
            _IN_PROCESS.add(key)
        self.fake = _Knobs()
        self.backends: dict = {}
        self._mems: dict[int, tuple] = {}  # id -> (MemoryDesc, visible to the backend)
        self._remotes: dict[str, EngineDesc] = {}
        self._mem_ids, self._uids = itertools.count(0), itertools.count(0)
        self._jobs: queue.Queue = queue.Queue()
        self._server = None
        self._servers: list = []
        # The threads hold only a weak reference, so dropping the engine (MoriTransport.close)
        # stops them, as MORI's destructor stops its own: a test run leaks no threads.
        threading.Thread(target=_complete_loop, args=(weakref.ref(self), self._jobs), daemon=True).start()
        weakref.finalize(self, _shut_down, self._jobs, self._servers)

    def get_engine_desc(self) -> EngineDesc:
        return EngineDesc._make(self._desc)

    def create_backend(self, type, config=None):
        if type == BackendType.TCP:
            raise NotImplementedError("backend not implemented yet")
        if type == BackendType.RDMA:
            self.fake.rdma_devices = os.environ.get("MORI_RDMA_DEVICES")
            self._server = socket.create_server((self._desc[3], self._desc[4]))
            self._servers.append(self._server)
            self._desc[4] = self._server.getsockname()[1]
            threading.Thread(target=_serve_control, args=(weakref.ref(self), self._server), daemon=True).start()
        self.backends[BackendType(type)] = config or RdmaBackendConfig()

    def register_remote_engine(self, desc: EngineDesc):
        self._remotes[desc.key] = desc

    def deregister_remote_engine(self, desc: EngineDesc):
        self._remotes.pop(desc.key, None)

    def register_memory(self, ptr: int, size: int, device_id: int, mem_loc):
        allow_ptrace_writes()  # lets peers "RDMA write" here with process_vm_writev
        gpu = mem_loc == MemoryLocationType.GPU
        desc = MemoryDesc._make(
            engine_key=self._desc[0],
            id=next(self._mem_ids),
            device_id=device_id,
            data=ptr,
            size=size,
            loc=int(mem_loc),
            device_bus_id=f"0000:{device_id + 1:02x}:00.0" if gpu else "",
            numa_node=-1 if gpu else 0,
        )
        self._mems[desc.id] = (desc, BackendType.RDMA in self.backends)
        with _LIVE_LOCK:
            _LIVE_MEMORY.add((desc.engine_key, desc.id))
        return desc

    def deregister_memory(self, desc: MemoryDesc):
        self._mems.pop(desc.id, None)
        with _LIVE_LOCK:
            _LIVE_MEMORY.discard((desc.engine_key, desc.id))

    def allocate_transfer_uid(self) -> int:
        return next(self._uids)

    def create_session(self, local_mem: MemoryDesc, remote_mem: MemoryDesc):
        if BackendType.RDMA not in self.backends:
            return None
        remote = self._remotes.get(remote_mem.engine_key)
        if remote is None:
            raise RuntimeError(f"BuildRdmaConn: remote engine {remote_mem.engine_key} is not registered")
        local = self._mems.get(local_mem.id)
        if local is None or not local[1] or local[0] != local_mem:
            raise RuntimeError("RdmaBackend::CreateSession: no local RDMA candidate found")
        try:
            with socket.create_connection((remote.host, remote.port), timeout=5) as sock:
                _frame_send(sock, ["ask", remote_mem.id])
                found, size = _frame_recv(sock)
        except OSError as exc:
            raise RuntimeError(f"TCP connect to {remote.host}:{remote.port} failed: {exc}") from None
        if not found or size != remote_mem.size:
            raise RuntimeError(
                f"RdmaBackend::CreateSession: remote MR size mismatch for engine "
                f"{remote.key} (id {remote_mem.id}: {size} vs {remote_mem.size})"
            )
        self.fake.sessions_created += 1
        return IOEngineSession(self, local_mem, remote_mem, remote.pid)

    def batch_write(self, local_mds, local_offs, remote_mds, remote_offs, sizes, uids):
        statuses = []
        for lmd, lo, rmd, ro, sz, uid in zip(local_mds, local_offs, remote_mds, remote_offs, sizes, uids):
            session = self.create_session(lmd, rmd)
            statuses.append(session.batch_write(lo, ro, sz, uid))
        return statuses

    def pop_inbound_transfer_status(self, remote_key, transfer_uid):
        return None  # notifications are off in the transport

    def wait_all(self, statuses, timeout_ms: int = -1):
        if not statuses:
            return StatusCode.SUCCESS
        deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
        first_error = StatusCode.SUCCESS
        for status in statuses:  # MORI waits on each in turn; the first error wins
            left = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if deadline is not None and left == 0 and status.InProgress():
                return first_error if first_error != StatusCode.SUCCESS else StatusCode.IN_PROGRESS
            code = status.WaitFor(left)
            if code == StatusCode.IN_PROGRESS:
                return first_error if first_error != StatusCode.SUCCESS else code
            if code != StatusCode.SUCCESS and first_error == StatusCode.SUCCESS:
                first_error = code
        return first_error

    # -- the fake's machinery -----------------------------------------------------------
    def _submit(self, session, lo, ro, sz, status: TransferStatus) -> None:
        self.fake.submits.append((list(lo), list(ro), list(sz)))
        if self.fake.raise_on_submit is not None:
            text, self.fake.raise_on_submit = self.fake.raise_on_submit, None
            raise RuntimeError(text)
        status.SetCode(StatusCode.IN_PROGRESS)
        lo, ro, sz = (np.asarray(v, dtype=np.int64) for v in (lo, ro, sz))
        if not lo.shape == ro.shape == sz.shape:
            raise RuntimeError("assertion failed: localOffsets.size() == remoteOffsets.size()")
        for i in range(sz.shape[0]):
            if sz[i] > UINT32_MAX:
                status.Update(
                    StatusCode.ERR_INVALID_ARGS,
                    f"single request size {sz[i]} exceeds UINT32_MAX; split it before submitting",
                )
                return
            if lo[i] + sz[i] > session.local.size or ro[i] + sz[i] > session.remote.size:
                status.Update(StatusCode.ERR_INVALID_ARGS, "length out of range")
                return
        order = np.argsort(ro, kind="stable")  # MORI sorts by remote offset before posting
        self._jobs.put((session, lo[order], ro[order], sz[order], status))

    def _complete(self, job) -> None:
        session, lo, ro, sz, status = job
        self.fake.gate.wait()
        if self.fake.fail_next is not None:
            (code, message), self.fake.fail_next = self.fake.fail_next, None
            status.Update(code, message)
            return
        # The check and the write under one lock: deregister_memory takes it, so a region
        # of this process cannot be deregistered (and freed) between them, as real MORI's
        # deregistration drops the MR before the memory can go. Status updates come after.
        failure: OSError | None = None
        with _LIVE_LOCK:
            gone = [
                m
                for m in (session.local, session.remote)
                if (m.engine_key, m.id) not in _LIVE_MEMORY and m.engine_key in _IN_PROCESS
            ]
            if not gone:
                try:
                    cma_write(session.remote_pid, session.local.data + lo, session.remote.data + ro, sz)
                except OSError as exc:
                    failure = exc
        if gone:
            status.Update(StatusCode.ERR_NOT_FOUND, "memory region was deregistered")
        elif failure is None:
            status.Update(StatusCode.SUCCESS, "")
        else:
            if failure.errno == errno.ESRCH:
                self.fake.events.append(
                    PeerFailureEvent(
                        session.remote.engine_key,
                        PeerFailureReason.PEER_UNREACHABLE,
                        detail="RETRY_EXC_ERR: remote process gone",
                    )
                )
            status.Update(StatusCode.ERR_RDMA_OP, f"ibv_post_send/CQE error: {failure}")

    def _answer(self, sock) -> None:
        try:
            _, mem_id = _frame_recv(sock)
            entry = self._mems.get(mem_id)
            _frame_send(sock, [entry is not None and entry[1], entry[0].size if entry else 0])
        except (OSError, ConnectionError, ValueError):
            pass


def _shut_down(jobs: queue.Queue, servers: list) -> None:
    jobs.put(None)
    for server in servers:
        try:
            server.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        except OSError:
            pass
        server.close()


def _complete_loop(engine_ref, jobs: queue.Queue) -> None:
    """Completes posted batches in order (the fake's CQ thread)."""
    while True:
        job = jobs.get()
        engine = engine_ref() if job is not None else None
        if engine is None:
            return
        engine._complete(job)
        del engine, job  # like MORI's completion path, keep no reference once done


def _serve_control(engine_ref, server) -> None:
    """Answers memory-region questions from peers (the fake's control plane)."""
    while True:
        try:
            sock, _ = server.accept()
        except OSError:
            return
        with sock:
            engine = engine_ref()
            if engine is None:
                return
            engine._answer(sock)
            del engine


class IOEngine124(_Engine):
    """``mori.io.IOEngine`` of wheel 1.2.4, which adds ``pop_peer_failure``."""

    def pop_peer_failure(self):
        """The next observed peer failure, or None ("nothing observed", not "healthy")."""
        return self.fake.events.popleft() if self.fake.events else None


class IOEngineSession:
    def __init__(self, engine, local, remote, remote_pid):
        self._engine, self.local, self.remote, self.remote_pid = engine, local, remote, remote_pid

    def allocate_transfer_uid(self) -> int:
        return self._engine.allocate_transfer_uid()

    def batch_write(self, local_offsets, remote_offsets, sizes, transfer_uid):
        status = TransferStatus()
        self._engine._submit(self, local_offsets, remote_offsets, sizes, status)
        return status

    def write(self, local_offset, remote_offset, size, transfer_uid):
        return self.batch_write([local_offset], [remote_offset], [size], transfer_uid)

    def alive(self) -> bool:
        return True  # always True for RDMA


def install(peer_failure_api: bool = True):
    """Put the fake in ``sys.modules`` as ``mori``, ``mori.cpp`` and ``mori.io``.

    Returns a function that restores what was there before (a real MORI, or nothing).
    """
    saved = {name: sys.modules.get(name) for name in ("mori", "mori.cpp", "mori.io")}
    pkg, cpp, io = (types.ModuleType(n) for n in ("mori", "mori.cpp", "mori.io"))
    pkg.__path__ = []
    for module in (pkg, cpp, io):
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None, is_package=module is pkg)
    shared = dict(
        IOEngineConfig=IOEngineConfig,
        StatusCode=StatusCode,
        BackendType=BackendType,
        EngineDesc=EngineDesc,
        MemoryDesc=MemoryDesc,
        MemoryLocationType=MemoryLocationType,
        PollCqMode=PollCqMode,
        RdmaBackendConfig=RdmaBackendConfig,
        XgmiBackendConfig=XgmiBackendConfig,
    )
    if peer_failure_api:
        shared.update(PeerFailureEvent=PeerFailureEvent, PeerFailureReason=PeerFailureReason)
    vars(cpp).update(shared, TransferStatus=TransferStatus)
    vars(io).update(shared, IOEngine=IOEngine124 if peer_failure_api else _Engine, IOEngineSession=IOEngineSession)
    pkg.cpp, pkg.io = cpp, io
    sys.modules.update({"mori": pkg, "mori.cpp": cpp, "mori.io": io})

    def undo():
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module

    return undo
