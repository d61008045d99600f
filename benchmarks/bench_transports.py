"""Benchmark the transports between two processes on this host; print JSON.

For each transport and workload, a spawned target process registers a 64 MiB destination
region and this process writes batches into it from a 64 MiB source region, one batch in
flight at a time (``write`` + ``wait``). Measured in the same run, interleaved with the
transport's repeats, is its baseline on the same bytes and entries:

* ``local``: a plain copy, one ``ctypes.memmove`` per entry into a buffer of this process;
* ``tcp``: a plain Python socket pair, one connection (``TCP_NODELAY`` like the transport),
  ``sendall`` per entry and ``recv_into`` the destination slot, with a 1-byte ACK per batch
  (the completion a ticket reports).

Every workload's bytes are verified (blake2b of the destination entries) before timing.
Values are medians over repeats with [min, max]; GB/s is decimal.

    python benchmarks/bench_transports.py [--quick] [--transport local,tcp]
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import time

import numpy as np

REGION = 64 << 20
TIMEOUT_S = 60.0
WORKLOADS = {  # name -> (entry size or None for the KV mix, number of entries)
    "4KiB_x1024": (4 << 10, 1024),
    "64KiB_x1024": (64 << 10, 1024),
    "1MiB_x64": (1 << 20, 64),
    "16MiB_x4": (16 << 20, 4),
    "kv_4096x1-8KiB": (None, 4096),
}
# variant -> (transport, options, target memory); the local variants differ by memory kind
VARIANTS = {
    "local": ("local", {}, "shm"),
    "local_cma": ("local", {}, "private"),
    "tcp": ("tcp", {}, "private"),
}


def make_entries(workload: str, seed: int = 0):
    size, count = WORKLOADS[workload]
    rng = np.random.default_rng(seed)
    slot = size or 8192
    lo = rng.permutation(REGION // slot)[:count] * slot
    ro = rng.permutation(REGION // slot)[:count] * slot
    sz = np.full(count, size) if size else rng.integers(1, 9, count) * 1024
    return lo.astype(np.int64), ro.astype(np.int64), sz.astype(np.int64)


def digest(arr: np.ndarray, offsets, sizes) -> str:
    h = hashlib.blake2b(digest_size=16)
    for o, n in zip(offsets.tolist(), sizes.tolist()):
        h.update(arr[o:o + n])
    return h.hexdigest()


# -- the target process -------------------------------------------------------------------


def target_main(conn, name: str, options: dict, memory: str) -> None:
    from sglang_kvxfer.transports import get_transport
    from sglang_kvxfer.transports.local import alloc_shared

    transport = get_transport(name, **options)
    if memory == "shm":
        buf = alloc_shared(REGION)
        dst = buf.as_numpy()
    else:
        dst = np.empty(REGION, np.uint8)
    dst[:] = 0  # fault the pages in before timing
    region = transport.register(dst.ctypes.data, REGION)
    plain_dst = np.zeros(REGION, np.uint8)  # the plain-socket baseline lands here
    listener = socket.create_server(("127.0.0.1", 0))
    conn.send((transport.agent_descriptor(), region.descriptor, listener.getsockname()[1]))
    plain = None
    while conn.poll(600):
        cmd, *args = conn.recv()
        if cmd == "zero":
            dst[:] = 0
            plain_dst[:] = 0
            conn.send(None)
        elif cmd == "digest":
            conn.send(digest(plain_dst if args[0] else dst, args[1], args[2]))
        elif cmd == "plain_serve":  # serve plain-socket batches until the sender says 'E'
            if plain is None:
                plain, _ = listener.accept()
                plain.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            views = [memoryview(plain_dst)[o:o + n] for o, n in zip(args[0].tolist(),
                                                                      args[1].tolist())]
            while plain.recv(1) == b"B":
                for v in views:
                    got = 0
                    while got < v.nbytes:
                        got += plain.recv_into(v[got:])
                plain.sendall(b"A")
            conn.send(None)
        elif cmd == "exit":
            transport.close()
            conn.send(None)
            return


class Target:
    def __init__(self, name: str, options: dict, memory: str):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target_main, args=(child, name, options, memory),
                                daemon=True)
        self.proc.start()
        self.agent, self.region, self.plain_port = self.call_reply()
        self.plain_sock = None

    def call_reply(self):
        if not self.conn.poll(TIMEOUT_S):
            raise TimeoutError("benchmark target did not answer")
        return self.conn.recv()

    def call(self, *cmd):
        self.conn.send(cmd)
        return self.call_reply()

    def close(self):
        if self.plain_sock is not None:
            self.plain_sock.close()
        self.call("exit")
        self.proc.join(TIMEOUT_S)


# -- timed loops --------------------------------------------------------------------------


def timed(fn, min_time_s: float) -> float:
    """Seconds per call of ``fn``: run it until ``min_time_s`` has passed (at least 3 times)."""
    fn()
    calls, start = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - start < min_time_s:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def plain_copy_batch(dst_base: int, src_base: int, lo, ro, sz):
    pairs = list(zip((ro + dst_base).tolist(), (lo + src_base).tolist(), sz.tolist()))
    move = ctypes.memmove

    def run():
        for d, s, n in pairs:
            move(d, s, n)
    return run


def plain_socket_batch(sock: socket.socket, src: np.ndarray, lo, sz):
    views = [memoryview(src)[o:o + n] for o, n in zip(lo.tolist(), sz.tolist())]
    ack = bytearray(1)

    def run():
        sock.sendall(b"B")
        for v in views:
            sock.sendall(v)
        if sock.recv_into(ack) != 1:
            raise ConnectionError("plain-socket receiver closed")
    return run


def summarize(seconds: list[float], nbytes: int, entries: int) -> dict:
    gbps = [nbytes / s / 1e9 for s in seconds]
    ops = [entries / s for s in seconds]
    return {"gbps": round(statistics.median(gbps), 3),
            "gbps_range": [round(min(gbps), 3), round(max(gbps), 3)],
            "ops_per_s": round(statistics.median(ops)),
            "ms_per_batch": round(statistics.median(seconds) * 1e3, 3)}


def bench_variant(variant: str, args) -> list[dict]:
    from sglang_kvxfer.transports import get_transport

    name, options, memory = VARIANTS[variant]
    if name == "tcp" and args.tcp_connections:
        options = dict(options, num_connections=args.tcp_connections)
    target = Target(name, options, memory)
    transport = get_transport(name, **options)
    src = np.random.default_rng(1).integers(0, 256, REGION, dtype=np.uint8)
    local = transport.register(src.ctypes.data, REGION)
    transport.add_peer("target", target.agent)
    remote = transport.import_region("target", target.region)
    plain_dst = np.zeros(REGION, np.uint8)
    results = []
    try:
        for workload in args.workloads:
            lo, ro, sz = make_entries(workload)
            nbytes, want = int(sz.sum()), digest(src, lo, sz)

            def write(lo=lo, ro=ro, sz=sz):
                transport.write(local, remote, lo, ro, sz).wait(TIMEOUT_S)

            target.call("zero")
            write()
            verified = target.call("digest", False, ro, sz) == want
            if name == "local":
                base_name = "memmove"
                baseline = plain_copy_batch(plain_dst.ctypes.data, src.ctypes.data, lo, ro, sz)
                baseline()
                base_ok = digest(plain_dst, ro, sz) == want
            else:
                base_name = "python_socket"
                target.conn.send(("plain_serve", ro, sz))
                if target.plain_sock is None:
                    target.plain_sock = socket.create_connection(("127.0.0.1", target.plain_port))
                    target.plain_sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                baseline = plain_socket_batch(target.plain_sock, src, lo, sz)
                baseline()
            own, base = [], []
            for _ in range(args.repeats):  # interleaved, so drift hits both alike
                own.append(timed(write, args.min_time))
                base.append(timed(baseline, args.min_time))
            if name == "tcp":
                target.plain_sock.sendall(b"E")
                target.call_reply()
                base_ok = target.call("digest", True, ro, sz) == want
            row = {"transport": name, "variant": variant, "memory": memory,
                   "workload": workload, "entries": len(sz), "bytes": nbytes,
                   "verified": bool(verified), **summarize(own, nbytes, len(sz)),
                   "baseline": {"name": base_name, "verified": bool(base_ok),
                                **summarize(base, nbytes, len(sz))}}
            row["ratio"] = round(row["gbps"] / row["baseline"]["gbps"], 3)
            results.append(row)
            print(f"{variant:10s} {workload:16s} {row['gbps']:7.2f} GB/s  baseline "
                  f"{row['baseline']['gbps']:7.2f}  ratio {row['ratio']:.2f}", file=sys.stderr)
    finally:
        transport.close()
        target.close()
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 short repeats per workload")
    parser.add_argument("--transport", default="local,tcp",
                        help="comma-separated: local, tcp (local also runs local_cma)")
    parser.add_argument("--workload", default=",".join(WORKLOADS),
                        help=f"comma-separated subset of {', '.join(WORKLOADS)}")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per workload")
    parser.add_argument("--min-time", type=float, default=None, help="seconds per repeat")
    parser.add_argument("--tcp-connections", type=int, default=None,
                        help="tcp connections per peer (default KVXFER_TCP_CONNECTIONS)")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (3 if args.quick else 7)
    args.min_time = args.min_time or (0.05 if args.quick else 0.3)
    args.workloads = args.workload.split(",")
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad:
        parser.error(f"unknown workload(s) {bad}; choose from {list(WORKLOADS)}")
    names = args.transport.split(",")
    variants = [v for v, (t, _, _) in VARIANTS.items() if t in names]
    if not variants:
        parser.error(f"--transport {args.transport!r}: choose from local, tcp")
    results = [row for v in variants for row in bench_variant(v, args)]

    def ratios(variant, workloads):
        return [r["ratio"] for r in results if r["variant"] == variant and r["workload"] in workloads]

    big = ("1MiB_x64", "16MiB_x4")
    checks = {}
    if "local" in variants:
        checks["local_min_ratio_1MiB_plus"] = min(ratios("local", big), default=None)
    if "tcp" in variants:
        checks["tcp_ratio_16MiB"] = min(ratios("tcp", ("16MiB_x4",)), default=None)
    report = {
        "benchmark": "bench_transports",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "config": {"region_bytes": REGION, "repeats": args.repeats,
                   "min_time_s": args.min_time, "quick": args.quick},
        "results": results,
        "targets": {"needed_ratio": 0.8, **checks,
                    "all_verified": all(r["verified"] and r["baseline"]["verified"]
                                        for r in results)},
    }
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0 if report["targets"]["all_verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
