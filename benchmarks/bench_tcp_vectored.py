"""Would vectored socket I/O close the `tcp` gap? One loopback stream, three ways, one run.

The staged `tcp` path moves a strided head slice with four copies per byte: the writer's
gather into staging, the kernel's copy into the socket, the kernel's copy out of it, the
reader's scatter. A plain socket makes two. Vectored I/O (``writev``/``readv`` with one
iovec per row, here through ``ctypes``: no Python object per row) would let the kernel read
the rows straight from the writer's pool and write them straight into the reader's pool:
two copies, as a plain socket, but one iovec per row. This measures, between two processes
over loopback TCP, each round moving ``--mib`` MiB of rows of ``--row-bytes`` bytes spaced
``--stride-bytes`` apart in both processes' "pools":

* ``plain``: contiguous 16 MiB ``sendall`` / ``recv_into`` (the same-run baseline);
* ``staged``: a numpy gather into a staging buffer, ``sendall``, ``recv_into`` a staging
  buffer, a numpy scatter (the copies of the staged path, without the engine);
* ``vectored``: ``writev`` of the pool rows, ``readv`` into the pool rows, up to IOV_MAX
  iovecs a call (the ``tcp`` transport's own ``transports/tcp/iov.py``).

Prints one JSON object: GB/s per mode and round, medians, and each mode's median over
``plain``'s. The modes alternate within each round. Linux only.

    python benchmarks/bench_tcp_vectored.py [--rounds 5] [--mib 128] [--row-bytes 1024]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import time

import numpy as np

CHUNK = 16 << 20
MODES = ("plain", "staged", "vectored")


def _plain_send(sock: socket.socket, buf: np.ndarray) -> None:
    view = memoryview(buf)
    for off in range(0, buf.nbytes, CHUNK):
        sock.sendall(view[off : off + CHUNK])


def _plain_recv(sock: socket.socket, buf: np.ndarray) -> None:
    view, got = memoryview(buf), 0
    while got < buf.nbytes:
        n = sock.recv_into(view[got:], min(CHUNK, buf.nbytes - got))
        if not n:
            raise ConnectionError("connection closed")
        got += n


def _side(sock: socket.socket, args, sending: bool, order: list[str], out) -> None:
    """One process's part: its pool and staging, then each (mode) of ``order`` in turn."""
    from sglang_kvxfer.transports.tcp import iov

    if not iov.available():
        raise SystemExit("libc's writev/readv cannot be loaded here")
    rows = (args.mib << 20) // args.row_bytes
    offsets = np.arange(rows, dtype=np.int64) * args.stride_bytes
    sizes = np.full(rows, args.row_bytes, dtype=np.int64)
    pool = np.full(rows * args.stride_bytes, 1 if sending else 0, dtype=np.uint8)
    rows_view = pool.reshape(rows, args.stride_bytes)[:, : args.row_bytes]
    staging = np.zeros(rows * args.row_bytes, dtype=np.uint8)
    sock.setblocking(True)
    times = []
    for mode in order:
        if not sending:
            rows_view[:] = 0
        if sending:  # the receiver is ready (its rows reset) before the clock starts
            sock.recv(1)
        else:
            sock.sendall(b"g")
        t0 = time.perf_counter()
        if mode == "plain":
            (_plain_send if sending else _plain_recv)(sock, staging)
        elif mode == "staged":
            if sending:
                np.copyto(staging.reshape(rows, args.row_bytes), rows_view)
                _plain_send(sock, staging)
            else:
                _plain_recv(sock, staging)
                np.copyto(rows_view, staging.reshape(rows, args.row_bytes))
        else:  # the engine's own vectored calls (sglang_kvxfer.transports.tcp.iov)
            vec = iov.iovecs(pool.ctypes.data, offsets, sizes)
            (iov.send_iov if sending else iov.recv_iov)(sock, vec)
        if sending:
            sock.recv(1)  # the receiver has every byte (and scattered them)
        else:
            sock.sendall(b"k")
        times.append(time.perf_counter() - t0)
        if not sending and mode != "plain" and not bool((rows_view == 1).all()):
            raise AssertionError(f"{mode}: the rows did not arrive")
    out.put((sending, times))


def _sender(port, args, order, out) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    _side(sock, args, True, order, out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mib", type=int, default=128, help="MiB of rows per transfer")
    ap.add_argument("--row-bytes", type=int, default=1024, help="bytes per row (a head slice of one token)")
    ap.add_argument("--stride-bytes", type=int, default=2048, help="bytes from one row to the next in a pool")
    args = ap.parse_args()
    if args.stride_bytes < args.row_bytes:
        ap.error(f"--stride-bytes={args.stride_bytes} must be at least --row-bytes={args.row_bytes}")
    order = ["plain"] + [m for _ in range(args.rounds) for m in MODES]  # first: warm-up
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    out = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=_sender, args=(srv.getsockname()[1], args, order, out))
    proc.start()
    conn, _ = srv.accept()
    _side(conn, args, False, order, out)
    results = dict(out.get(timeout=600) for _ in range(2))
    proc.join(30)
    nbytes = ((args.mib << 20) // args.row_bytes) * args.row_bytes
    # a transfer ends when the receiver has every byte: the sender's clock (send .. ack)
    gbps: dict[str, list[float]] = {m: [] for m in MODES}
    for mode, seconds in list(zip(order, results[True]))[1:]:
        gbps[mode].append(round(nbytes / seconds / 1e9, 3))
    medians = {m: round(statistics.median(v), 3) for m, v in gbps.items()}
    print(
        json.dumps(
            {
                "benchmark": "tcp_vectored",
                "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                "config": vars(args) | {"bytes_per_transfer": nbytes},
                "gbps": gbps,
                "median_gbps": medians,
                "ratio_vs_plain": {m: round(medians[m] / medians["plain"], 3) for m in MODES},
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
