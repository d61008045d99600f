"""Vectored socket I/O for frames of many entries: ``writev``/``readv`` over an iovec array.

Owns ``iovecs`` (the ``struct iovec`` array of a frame's entries, built by numpy from a
region's address, the entries' offsets and sizes) and ``send_iov``/``recv_iov`` (move every
byte of it, ``IOV_MAX`` iovecs a call through ``ctypes``, which drops the GIL during the
call). ``sendmsg``/``recvmsg_into`` need a Python buffer object per entry, and the loops
that resume a partial call walk the entries in Python: for a frame of many small entries
(a strided head slice's rows) that costs more than the copy. Here nothing per entry is a
Python object. ``available()`` is False where libc's ``writev``/``readv`` cannot be loaded
(``conn`` then keeps ``sendmsg``/``recvmsg_into``). The memory must stay mapped until the
call returns: callers hold the region's lease, as for the views they replace.
Must not: check entries against regions (``transport.admit_write`` does) or know frames.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import select
import socket
import threading
from collections.abc import Callable

import numpy as np

from sglang_kvxfer.transports._memory import IOV_MAX

__all__ = ["MIN_ENTRIES", "available", "iovecs", "recv_iov", "send_iov"]

# A frame with fewer entries keeps sendmsg/recvmsg_into: a few views cost nothing.
MIN_ENTRIES = 16

_lock = threading.Lock()
_calls: tuple | None = None


def _load() -> tuple:
    """(writev, readv) of libc, or () where they cannot be loaded."""
    global _calls
    with _lock:
        if _calls is None:
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
                calls = []
                for name in ("writev", "readv"):
                    fn = getattr(libc, name)
                    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
                    fn.restype = ctypes.c_ssize_t
                    calls.append(fn)
                _calls = tuple(calls)
            except (OSError, AttributeError):
                _calls = ()
        return _calls


def available() -> bool:
    return bool(_load())


def iovecs(base: int, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``struct iovec[n]`` (pointer, length) of entries at ``base + offsets``."""
    iov = np.empty((len(offsets), 2), dtype=np.uint64)
    iov[:, 0] = np.uint64(base) + offsets.astype(np.uint64)
    iov[:, 1] = sizes
    return iov


def send_iov(sock: socket.socket, iov: np.ndarray, on_progress: Callable[[], None] | None = None) -> None:
    """Send every byte ``iov`` points at, in order (``iov`` is consumed)."""
    _move(sock, iov, True, on_progress)


def recv_iov(sock: socket.socket, iov: np.ndarray) -> None:
    """Fill every byte ``iov`` points at from ``sock`` (``iov`` is consumed). A close before
    the end raises ``ConnectionError`` (a torn frame)."""
    _move(sock, iov, False, None)


def _move(sock: socket.socket, iov: np.ndarray, writing: bool, on_progress) -> None:
    writev, readv = _load()
    call = writev if writing else readv
    fd, timeout = sock.fileno(), sock.gettimeout()
    poller = None
    i, n = 0, len(iov)
    while i < n and iov[i, 1] == 0:
        i += 1
    while i < n:
        # Each call asks the socket for its descriptor again, as Python's own socket calls
        # do: once another thread closed it, its number may already name another file.
        if sock.fileno() != fd:
            raise OSError(errno.EBADF, "the socket was closed in the middle of a frame")
        k = min(IOV_MAX, n - i)
        got = call(fd, iov[i:].ctypes.data, k)
        if got < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err not in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise OSError(err, os.strerror(err))
            if poller is None:  # a socket with a timeout is non-blocking underneath
                poller = select.poll()
                poller.register(fd, select.POLLOUT if writing else select.POLLIN)
            if not poller.poll(None if timeout is None else timeout * 1000):
                raise TimeoutError("timed out")
            continue
        if got == 0:
            raise ConnectionError("connection closed in the middle of a frame")
        if on_progress is not None:
            on_progress()
        ends = np.cumsum(iov[i : i + k, 1])
        full = int(np.searchsorted(ends, got, side="right"))
        partial = got - (int(ends[full - 1]) if full else 0)
        i += full
        if partial:
            iov[i, 0] += np.uint64(partial)
            iov[i, 1] -= np.uint64(partial)
        while i < n and iov[i, 1] == 0:
            i += 1
