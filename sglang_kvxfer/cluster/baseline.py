"""Plain movers of the benchmark's bytes, measured in the same run as the engine.

Owns ``measure_baseline(method, items, streams)``: moves a list of byte counts (the bytes
each prefill rank wrote for each request, taken from the engine's own records, so both
move the same bytes in the same pieces) over ``streams`` parallel plain movers, and
returns GB/s (decimal). Items go to the streams round-robin. Methods:

* ``copy`` (``local`` transport, CPU pools): one thread per stream, one ``numpy.copyto``
  per item between two pre-faulted buffers (numpy releases the GIL while copying).
* ``socket`` (``tcp``): one loopback TCP connection per stream (``TCP_NODELAY``, as the
  transport), a sender thread ``sendall``s each item and a receiver thread ``recv_into``s
  it; a stream ends when its receiver has every byte and acknowledged with one byte.
* ``d2d`` (CUDA pools): ``copy_`` of each item from a buffer on a prefill device to one
  on a decode device, one CUDA stream per mover, timed between device synchronizations.

Items above 64 MiB move in 64 MiB pieces and a mover's buffers hold at most 64 MiB,
with consecutive pieces at consecutive offsets. After timing, every destination buffer is
compared with its source (the pieces cover it), so a mover that lost bytes raises. Every wait has a
deadline. Must not start engine processes or import the engine, parse command-line
arguments or print.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np

__all__ = ["METHODS", "measure_baseline"]

METHODS = ("copy", "socket", "d2d")
_PIECE = 64 << 20


def _buffer_bytes(lane: list[int]) -> int:
    return min(_PIECE, sum(lane))


def _pieces(items: list[int]):
    """(offset, nbytes) of each piece in a buffer of ``_buffer_bytes(items)``: consecutive
    pieces sit at consecutive offsets, like requests in a pool, so a small item is not
    copied from cache-hot bytes again and again. A piece that reaches the buffer's end is
    split there and goes on at offset 0, so the pieces cover every byte of the buffer
    (whatever the item sizes) and the check after timing compares written bytes only."""
    size, off = _buffer_bytes(items), 0
    for n in items:
        while n > 0:
            k = min(n, size - off)
            yield off, k
            off = (off + k) % size
            n -= k


def _buffers(size: int) -> tuple[np.ndarray, np.ndarray]:
    """A patterned source and a destination of another value, both written (faulted in)."""
    src = (np.arange(size, dtype=np.uint32) % 251).astype(np.uint8)
    return src, np.full(size, 0xEE, dtype=np.uint8)


def _check(pairs) -> None:
    for i, (src, dst) in enumerate(pairs):
        if not np.array_equal(src, dst):
            raise RuntimeError(f"baseline mover {i} did not deliver its bytes (destination differs from source)")


def _timed_threads(targets: list, timeout_s: float) -> float:
    """Run the callables on threads released together; seconds until the last ends."""
    errors: list[BaseException] = []
    gate = threading.Barrier(len(targets) + 1, timeout=timeout_s)

    def wrap(fn):
        try:
            gate.wait()
            fn()
        except BaseException as exc:  # re-raised on the caller's thread
            errors.append(exc)

    threads = [
        threading.Thread(target=wrap, args=(fn,), daemon=True, name=f"kvxfer-baseline{i}")
        for i, fn in enumerate(targets)
    ]
    for th in threads:
        th.start()
    gate.wait()
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    seconds = time.perf_counter() - t0
    if any(th.is_alive() for th in threads):
        raise TimeoutError(f"baseline movers still running after {timeout_s:.0f} s")
    if errors:
        raise errors[0]
    return seconds


def _copy(lanes: list[list[int]], timeout_s: float) -> float:
    pairs = [_buffers(_buffer_bytes(lane)) for lane in lanes]

    def mover(lane, src, dst):
        def run():
            for off, n in _pieces(lane):
                np.copyto(dst[off : off + n], src[off : off + n])

        return run

    seconds = _timed_threads([mover(lane, *pair) for lane, pair in zip(lanes, pairs)], timeout_s)
    _check(pairs)
    return seconds


def _socket(lanes: list[list[int]], timeout_s: float) -> float:
    listener = socket.create_server(("127.0.0.1", 0))
    socks: list[socket.socket] = [listener]
    pairs = [_buffers(_buffer_bytes(lane)) for lane in lanes]
    try:
        targets = []
        for lane, (src_arr, dst_arr) in zip(lanes, pairs):
            out = socket.create_connection(listener.getsockname(), timeout=timeout_s)
            socks.append(out)
            inp, _ = listener.accept()
            socks.append(inp)
            for s in (out, inp):
                s.settimeout(timeout_s)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            src, dst = src_arr.data, dst_arr.data  # memoryviews of the (1-D uint8) arrays

            def send(lane=lane, out=out, src=src):
                for off, n in _pieces(lane):
                    out.sendall(src[off : off + n])
                if out.recv(1) != b"A":
                    raise ConnectionError("baseline receiver closed before acknowledging")

            def recv(lane=lane, inp=inp, dst=dst):
                for off, n in _pieces(lane):
                    got = 0
                    while got < n:
                        k = inp.recv_into(dst[off + got : off + n])
                        if k == 0:
                            raise ConnectionError("baseline sender closed mid-item")
                        got += k
                inp.sendall(b"A")

            targets += [send, recv]
        seconds = _timed_threads(targets, timeout_s)
    finally:
        for s in socks:
            s.close()
    _check(pairs)
    return seconds


def _d2d(lanes: list[list[int]], timeout_s: float, prefill_devices: list[str], decode_devices: list[str]) -> float:
    import torch

    movers = []
    for i, lane in enumerate(lanes):
        src, dst = (torch.from_numpy(a) for a in _buffers(_buffer_bytes(lane)))
        src = src.to(prefill_devices[i % len(prefill_devices)])
        dst = dst.to(decode_devices[i % len(decode_devices)])
        movers.append((lane, src, dst, torch.cuda.Stream(device=src.device)))
    devices = sorted({str(t.device) for _, s, d, _ in movers for t in (s, d)})
    for dev in devices:
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for lane, src, dst, stream in movers:
        with torch.cuda.stream(stream):
            for off, n in _pieces(lane):
                dst[off : off + n].copy_(src[off : off + n], non_blocking=True)
    for dev in devices:  # a device copy cannot be given a deadline; it ends or raises
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    _check([(src.cpu().numpy(), dst.cpu().numpy()) for _, src, dst, _ in movers])
    return seconds


def measure_baseline(
    method: str,
    items: list[int],
    streams: int,
    timeout_s: float = 300.0,
    prefill_devices: list[str] | None = None,
    decode_devices: list[str] | None = None,
) -> float:
    """GB/s of moving ``items`` (byte counts) with ``streams`` parallel plain movers.

    Args:
        method: ``"copy"``, ``"socket"`` or ``"d2d"`` (see the module docstring).
        items: bytes per piece of work (per request and prefill rank), moved in order.
        streams: parallel movers (threads, connections or CUDA streams), at least 1.
        prefill_devices, decode_devices: CUDA devices for ``d2d`` (mover i copies from
            ``prefill_devices[i % P]`` to ``decode_devices[i % D]``).
    """
    if method not in METHODS:
        raise ValueError(f"baseline method={method!r} must be one of {', '.join(METHODS)}")
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise ValueError(f"baseline streams={streams!r} must be a positive integer")
    items = [int(n) for n in items]
    if not items or min(items) < 0 or sum(items) == 0:
        raise ValueError(f"baseline items must be non-negative byte counts with a positive total, got {items[:8]}")
    lanes = [lane for lane in (items[i::streams] for i in range(streams)) if sum(lane)]
    lanes = [[n for n in lane if n] for lane in lanes]
    if method == "copy":
        seconds = _copy(lanes, timeout_s)
    elif method == "socket":
        seconds = _socket(lanes, timeout_s)
    else:
        if not (prefill_devices and decode_devices):
            raise ValueError("the d2d baseline needs prefill_devices and decode_devices")
        seconds = _d2d(lanes, timeout_s, prefill_devices, decode_devices)
    return sum(items) / max(seconds, 1e-9) / 1e9
