"""Raw host-memory helpers for the transports (Linux, ctypes, no torch).

Owns: writable memoryviews over ``(ptr, nbytes)``, batched ``memmove``, cross-process
memory writes (``process_vm_writev``/``readv``) with the checks of whether the OS permits
them (never opening this process to every same-user process unless asked to), and
``SharedBuffer``: memfd-backed shared memory that a peer on this host maps by
``/proc/<pid>/fd/<fd>``. It must not know about peers, descriptors or tickets.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import logging
import mmap
import os
import re
import threading
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from sglang_kvxfer import envs
from sglang_kvxfer.errors import TransportError

if TYPE_CHECKING:
    import torch

__all__ = [
    "view",
    "copy_entries",
    "cma_write",
    "cma_probe",
    "cma_blocker",
    "allow_ptrace_writes",
    "SharedBuffer",
    "alloc_shared",
    "find_shared",
    "huge_page_bytes",
    "hugetlb_pages",
    "memmove_rate",
    "shmem_thp_setting",
]

log = logging.getLogger("sglang_kvxfer.transports.local")

IOV_MAX = 1024  # Linux UIO_MAXIOV: iovecs per process_vm_writev / sendmsg call

_libc = ctypes.CDLL(None, use_errno=True)
_pvw = _libc.process_vm_writev
_pvr = _libc.process_vm_readv
for _fn in (_pvw, _pvr):
    _fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    _fn.restype = ctypes.c_ssize_t
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int
_PR_GET_DUMPABLE = 3
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
_YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"


def view(ptr: int, nbytes: int) -> memoryview:
    """A writable byte memoryview of ``nbytes`` at ``ptr`` (the caller keeps the memory alive)."""
    return memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")


def copy_entries(
    dst_base: int, src_base: int, dst_offsets: np.ndarray, src_offsets: np.ndarray, sizes: np.ndarray
) -> None:
    """``memmove`` entry i: ``sizes[i]`` bytes from ``src_base + src_offsets[i]`` to ``dst_base + ...``.

    ctypes releases the GIL around each memmove, so threads copy concurrently. ``map``
    drives the calls from C (no bytecode per entry): 5-10% less per entry than a ``for``
    loop on a 2-vCPU VM (0.85 vs 0.89 us per 64-byte entry at the median).
    """
    collections.deque(
        map(ctypes.memmove, (dst_offsets + dst_base).tolist(), (src_offsets + src_base).tolist(), sizes.tolist()),
        maxlen=0,
    )


_rate_lock = threading.Lock()
_rate: tuple[float, float] | None = None
_RATE_BYTES = 8 << 20


def memmove_rate() -> tuple[float, float]:
    """``(seconds per entry, bytes per second)`` of ``copy_entries`` on this host: the
    per-entry cost from 256 64-byte entries, the rate from 8 MiB copies, best of 3 each.
    Measured once per process (about 15 ms on a 2-vCPU VM, on the first call: ``local``
    makes it when the first transport is created) and cached;
    clamped to [0.05, 50] us and [0.5, 500] GB/s so that a stalled measurement cannot
    mislead."""
    global _rate
    with _rate_lock:
        if _rate is None:
            a = ctypes.create_string_buffer(_RATE_BYTES)  # zero-filled: resident before timing
            b = ctypes.create_string_buffer(_RATE_BYTES)
            dst, src = ctypes.addressof(a), ctypes.addressof(b)
            one = np.zeros(1, dtype=np.int64)
            small = np.arange(256, dtype=np.int64) * 128
            sizes = np.full(256, 64, dtype=np.int64)
            per_op = bw = float("inf")
            for _ in range(3):
                t = time.perf_counter()
                copy_entries(dst, src, small, small, sizes)
                per_op = min(per_op, (time.perf_counter() - t) / 256)
                t = time.perf_counter()
                copy_entries(dst, src, one, one, one + _RATE_BYTES)
                bw = min(bw, time.perf_counter() - t)
            _rate = (min(max(per_op, 5e-8), 5e-5), min(max(_RATE_BYTES / max(bw, 1e-9), 5e8), 5e11))
        return _rate


# -- cross-process memory (CMA) ---------------------------------------------------------


def _iovecs(bases: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    iov = np.empty((sizes.shape[0], 2), dtype=np.uint64)  # struct iovec {void *base; size_t len}
    iov[:, 0] = bases
    iov[:, 1] = sizes
    return iov


def cma_write(pid: int, local_addrs: np.ndarray, remote_addrs: np.ndarray, sizes: np.ndarray) -> None:
    """Copy ``sizes[i]`` bytes from our ``local_addrs[i]`` to ``remote_addrs[i]`` in ``pid``.

    Up to ``IOV_MAX`` entries per ``process_vm_writev`` call; resumes after partial
    transfers. Raises ``OSError`` with the errno (ESRCH: process gone, EPERM: not permitted,
    EFAULT: an address is not mapped).
    """
    liov, riov, left = _iovecs(local_addrs, sizes), _iovecs(remote_addrs, sizes), sizes.copy()
    i, n = 0, sizes.shape[0]
    while i < n:
        k = min(IOV_MAX, n - i)
        got = _pvw(pid, liov[i:].ctypes.data, k, riov[i:].ctypes.data, k, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_writev into pid {pid}: {os.strerror(err)}")
        if got == 0:
            raise OSError(errno.EFAULT, f"process_vm_writev into pid {pid} made no progress")
        done = np.cumsum(left[i : i + k])
        full = int(np.searchsorted(done, got, side="right"))  # entries completely written
        if full < k:  # partial: advance inside entry i + full and go again
            part = got - (int(done[full - 1]) if full else 0)
            j = i + full
            liov[j, 0] += part
            riov[j, 0] += part
            liov[j, 1] = riov[j, 1] = left[j] = left[j] - part
        i += full


def cma_probe(pid: int, addr: int, nbytes: int) -> None:
    """Read the first and last byte of ``[addr, addr + nbytes)`` in ``pid``; raise ``OSError``."""
    buf = ctypes.create_string_buffer(1)
    local = _iovecs(np.array([ctypes.addressof(buf)]), np.array([1]))
    for at in {addr, addr + nbytes - 1}:
        remote = _iovecs(np.array([at]), np.array([1]))
        if _pvr(pid, local.ctypes.data, 1, remote.ctypes.data, 1, 0) != 1:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv of pid {pid} at {at:#x}: {os.strerror(err)}")


def _yama_scope() -> int | None:
    try:
        with open(_YAMA_SCOPE) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def cma_blocker() -> str | None:
    """Why peers cannot ``process_vm_writev`` into this process, or None if nothing here forbids it."""
    scope = _yama_scope()
    if scope == 3:
        return f"{_YAMA_SCOPE} is 3 (cross-process memory access disabled until reboot)"
    if _prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) == 0:
        return (
            "this process is not dumpable (prctl PR_SET_DUMPABLE=0 or a set-id binary), "
            "so the kernel refuses other processes access to its memory"
        )
    return None


_ptracer_lock = threading.Lock()
_ptracer_set = False
PTRACE_ANY_ENV = "KVXFER_LOCAL_PTRACE_ANY"  # "1": accept PR_SET_PTRACER_ANY (see below)


def allow_ptrace_writes() -> None:
    """Make sure peers may ``process_vm_writev`` into this process's private memory.

    Under Yama ``ptrace_scope=1`` that needs ``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``,
    which opens this process's memory to *every* process of the same user, not only the
    peers (the prctl names one pid or any). It is refused with ``TransportError`` unless
    ``KVXFER_LOCAL_PTRACE_ANY=1`` opts in (logged as a WARNING). Scope 0 or no Yama: nothing
    to do. Shared-memory pools (``alloc_shared``) never need it.
    """
    global _ptracer_set
    with _ptracer_lock:
        if _ptracer_set or _yama_scope() != 1:
            return
        if not envs.KVXFER_LOCAL_PTRACE_ANY.get():
            raise TransportError(
                f"{_YAMA_SCOPE} is 1, so peers could write this process's private memory only "
                "after prctl(PR_SET_PTRACER_ANY), which would open it to every process of this "
                "user; allocate the pool with alloc_shared() (memfd shared memory, no ptrace), "
                f"or run with kernel.yama.ptrace_scope=0, or set {PTRACE_ANY_ENV}=1 to accept "
                "that risk"
            )
        log.warning(
            "local: %s=1: prctl(PR_SET_PTRACER_ANY): every process of this user may "
            "now read and write this process's memory",
            PTRACE_ANY_ENV,
        )
        if _prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise TransportError(f"prctl(PR_SET_PTRACER_ANY) failed: {os.strerror(err)}")
        _ptracer_set = True


# -- shared memory ----------------------------------------------------------------------

_live_buffers: weakref.WeakValueDictionary[int, SharedBuffer] = weakref.WeakValueDictionary()

# Shared mappings are populated when they are made: a pool or staging segment is resident
# and mapped at allocation (and in a peer at import), so the first requests to touch its
# pages do not pay a page fault per 4 KiB inside their transfer window (hundreds of ms for
# a 256 MiB request). Before populating, each mapping asks for transparent huge pages
# (MADV_HUGEPAGE): a private numpy/torch buffer gets 2 MiB pages by default (anon THP
# "madvise"), a memfd only where /sys/kernel/mm/transparent_hugepage/shmem_enabled is
# advise, within_size or always; elsewhere the request is ignored and the pages stay 4 KiB.
_MAP_SHARED_POPULATED = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
_MADV_POPULATE_WRITE = 23  # Linux 5.14; not in the mmap module before Python 3.13
SHMEM_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def _map_shared(fd: int, nbytes: int) -> mmap.mmap:
    """Map ``fd`` shared and writable, huge pages requested, every page faulted in. A
    hugetlbfs file (``MFD_HUGETLB``) is mapped whole pages long (``st_blksize``, the page
    size), as the kernel maps it and as ``munmap`` must release it."""
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    page = os.fstat(fd).st_blksize
    if page > mmap.PAGESIZE:
        nbytes = -(-nbytes // page) * page
    mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, prot)
    try:
        if hasattr(mmap, "MADV_HUGEPAGE"):
            mm.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # no THP in this kernel: 4 KiB pages
        pass
    try:
        mm.madvise(_MADV_POPULATE_WRITE)
    except OSError:  # before Linux 5.14: map it again, populated by mmap itself
        mm.close()
        mm = mmap.mmap(fd, nbytes, _MAP_SHARED_POPULATED, prot)
    return mm


def shmem_thp_setting() -> str:
    """The active value of ``shmem_enabled`` (``never``, ``advise``, ...), or ``unknown``."""
    try:
        with open(SHMEM_THP_SETTING) as f:
            text = f.read()
    except OSError:
        return "unknown"
    picked = re.search(r"\[(\w+)\]", text)
    return picked.group(1) if picked else "unknown"


def huge_page_bytes(addr: int, nbytes: int) -> int:
    """Bytes mapped by huge pages (PMD) in this process's mappings that overlap
    ``[addr, addr + nbytes)``, from ``/proc/self/smaps`` (whole mappings are counted; 0 if
    none, or if smaps cannot be read). ``madvise`` may split one buffer into several."""
    inside, total = False, 0
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if not head.endswith(":"):
                    start, end = (int(x, 16) for x in head.split("-"))
                    inside = start < addr + nbytes and addr < end
                elif inside and head in (
                    "AnonHugePages:",
                    "ShmemPmdMapped:",
                    "FilePmdMapped:",
                    "Shared_Hugetlb:",
                    "Private_Hugetlb:",
                ):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return 0
    return total


HUGETLB_MEMINFO = "/proc/meminfo"


def hugetlb_pages() -> tuple[int, int]:
    """``(page bytes, pages free for a new mapping)`` of the host's reserved huge pages
    (``vm.nr_hugepages``: ``Hugepagesize``, ``HugePages_Free - HugePages_Rsvd``), or
    ``(0, 0)`` where ``/proc/meminfo`` does not say."""
    info: dict[str, int] = {}
    try:
        with open(HUGETLB_MEMINFO) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Hugepagesize", "HugePages_Free", "HugePages_Rsvd"):
                    info[key] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return 0, 0
    if len(info) < 3:
        return 0, 0
    return info["Hugepagesize"] * 1024, max(0, info["HugePages_Free"] - info["HugePages_Rsvd"])


def _shared_memory(nbytes: int) -> tuple[int, mmap.mmap, bool]:
    """``(memfd, its mapping, on huge pages)`` of ``nbytes`` shared bytes, by
    ``KVXFER_SHM_HUGETLB``: the host's reserved huge pages (``MFD_HUGETLB``, the file sized
    to whole pages) where enough are free and allowed (``auto``: for a buffer of at least
    one huge page), else 4 KiB shmem pages (THP asked for, which the kernel gives only under
    ``shmem_enabled`` ``advise`` or above)."""
    mode = envs.KVXFER_SHM_HUGETLB.get()
    flag = getattr(os, "MFD_HUGETLB", 0)
    if mode != "0":
        page, free = hugetlb_pages()
        need = -(-nbytes // page) if page else 0
        if mode == "1" and (not flag or not page or need > free):
            raise MemoryError(
                f"KVXFER_SHM_HUGETLB=1: a shared buffer of {nbytes} bytes needs {need} huge pages of "
                f"{page} bytes, the host has {free} free (vm.nr_hugepages)"
                + ("" if flag else "; this Python has no os.MFD_HUGETLB")
            )
        if flag and page and need <= free and (mode == "1" or nbytes >= page):
            fd = os.memfd_create("kvxfer-pool", os.MFD_CLOEXEC | flag)
            try:
                os.ftruncate(fd, need * page)
                return fd, _map_shared(fd, need * page), True
            except OSError as exc:  # taken meanwhile by another process
                os.close(fd)
                if mode == "1":
                    raise MemoryError(f"KVXFER_SHM_HUGETLB=1: {need} huge pages of {page} bytes: {exc}") from None
                log.debug("huge pages for %d bytes: %s; 4 KiB pages instead", nbytes, exc)
    fd = os.memfd_create("kvxfer-pool", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        return fd, _map_shared(fd, nbytes), False
    except OSError:
        os.close(fd)
        raise


class SharedBuffer:
    """Host memory backed by a memfd, so a peer on this host can map the same pages.

    ``ptr``/``nbytes`` give the address to register; ``path`` (``/proc/<pid>/fd/<fd>``) and
    ``inode`` let a peer open and verify it. ``hugetlb`` says whether the host's reserved
    huge pages back it (``KVXFER_SHM_HUGETLB``). The memory disappears with the last mapping,
    even if this process crashes (no ``/dev/shm`` leftovers). ``close()`` releases it;
    views from ``as_numpy``/``as_tensor`` keep the mapping alive until they are dropped.
    """

    def __init__(self, nbytes: int):
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
            raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        self.nbytes = int(nbytes)
        self._fd, mm, self.hugetlb = _shared_memory(self.nbytes)
        self._mm: mmap.mmap | None = mm  # None once closed
        anchor = ctypes.c_char.from_buffer(mm)  # an export only while we read the address
        self.ptr = ctypes.addressof(anchor)
        del anchor
        self.pid = os.getpid()
        self.fd = self._fd
        self.path = f"/proc/{self.pid}/fd/{self._fd}"
        self.inode = os.fstat(self._fd).st_ino
        self.registrations = 0  # regions a transport holds in this buffer (close() refuses)
        _live_buffers[id(self)] = self

    @property
    def closed(self) -> bool:
        return self._mm is None

    def as_numpy(self) -> np.ndarray:
        """The whole buffer as ``uint8[nbytes]`` (shares memory)."""
        return np.frombuffer(self._check_open(), dtype=np.uint8, count=self.nbytes)

    def as_tensor(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """A CPU torch tensor of ``dtype`` and ``shape`` over the start of the buffer."""
        import torch

        mm = self._check_open()
        numel = 1
        for dim in shape:
            numel *= int(dim)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if numel * itemsize > self.nbytes:
            raise ValueError(
                f"shape {tuple(shape)} of {dtype} needs {numel * itemsize} bytes, buffer has {self.nbytes}"
            )
        return torch.frombuffer(mm, dtype=dtype, count=numel).view(*shape)

    def close(self) -> None:
        """Release the buffer. Idempotent; peers that mapped it keep their pages.

        Raises ``ValueError`` while a transport still has a region registered in it.
        """
        if self._mm is None:
            return
        if self.registrations:
            raise ValueError(
                f"SharedBuffer still holds {self.registrations} registered region(s); deregister them before close()"
            )
        _live_buffers.pop(id(self), None)
        mm, self._mm = self._mm, None
        try:
            mm.close()
        except BufferError:
            pass  # numpy/torch views still alive: the mapping goes when the last one does
        os.close(self._fd)

    def _check_open(self) -> mmap.mmap:
        """The mapping; ``ValueError`` once closed."""
        if self._mm is None:
            raise ValueError("SharedBuffer is closed")
        return self._mm

    def __enter__(self) -> SharedBuffer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._mm is None else f"ptr={self.ptr:#x}"
        return f"SharedBuffer(nbytes={self.nbytes}, {state})"


def alloc_shared(nbytes: int) -> SharedBuffer:
    """Allocate ``nbytes`` of shared host memory for a KV pool the ``local`` transport writes
    into with one copy. Register it with ``register(buf.ptr, buf.nbytes)`` (or a tensor from
    ``buf.as_tensor``); close it after deregistering."""
    return SharedBuffer(nbytes)


def find_shared(ptr: int, nbytes: int) -> SharedBuffer | None:
    """The live SharedBuffer that contains ``[ptr, ptr + nbytes)``, or None."""
    for buf in list(_live_buffers.values()):
        if not buf.closed and buf.ptr <= ptr and ptr + nbytes <= buf.ptr + buf.nbytes:
            return buf
    return None


def open_shared(path: str, inode: int, nbytes: int) -> mmap.mmap:
    """Map a peer's SharedBuffer; raise ``TransportError`` saying why it cannot be mapped."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        raise TransportError(
            f"shared buffer {path} does not exist (the peer closed it or exited, or runs in another pid namespace)"
        ) from None
    except PermissionError:
        raise TransportError(
            f"no permission to open the peer's shared buffer {path} (peers "
            "must run as the same user); use the 'tcp' transport"
        ) from None
    try:
        st = os.fstat(fd)
        if st.st_ino != inode:
            raise TransportError(
                f"{path} is no longer the peer's shared buffer (inode {st.st_ino}, descriptor says {inode})"
            )
        if st.st_size < nbytes:
            raise TransportError(f"peer's shared buffer {path} has {st.st_size} bytes, descriptor says {nbytes}")
        return _map_shared(fd, nbytes)
    finally:
        os.close(fd)


def mapping_address(mm: mmap.mmap) -> int:
    anchor = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor
