"""Benchmark the transports between two processes on this host; print JSON.

For each transport and workload, a spawned target process registers a 64 MiB destination
region and this process writes batches into it from a 64 MiB source region, one batch in
flight at a time (``write`` + ``wait``). Measured in the same run, interleaved with the
transport's repeats, is its baseline on the same bytes and entries:

* ``local``: a plain copy, one ``ctypes.memmove`` per entry into a buffer of this process
  (numpy memory: 2 MiB transparent huge pages where the kernel gives them); for shared
  memory also ``memmove_shm``, the same copy into an ``alloc_shared`` buffer of this process
  (the transport's kind of page), and each row's ``huge_page_bytes`` of both destinations;
* ``tcp``: a plain Python socket pair, one connection (``TCP_NODELAY`` like the transport),
  ``sendall`` per entry and ``recv_into`` the destination slot, with a 1-byte ACK per batch
  (the completion a ticket reports);
* ``nixl`` / ``mori``: ``process_vm_writev`` of the same entries (1024 per call) into a
  second buffer of the target: the kernel copy a same-host zero-copy engine can reach.

``nixl`` and ``mori`` run when installed (``mori`` only where its probe passes). For them
the staging comparison also runs on the KV-like batch (4096 scattered 1-8 KiB entries):
(a) the 4096 entries posted to the transport directly as one batch, against (b) our staged
path: gather the entries into a registered staging buffer (``process_vm_writev`` to this
process, 1024 entries a call), one write per chunk into the target's staging buffer, and
the target scatters each chunk into place (the same way) and acknowledges it. Two staging
slots of ``--stage-chunk`` bytes let gather, wire and scatter of consecutive chunks overlap,
as the engine's staged path does. The staged time runs from the first gather to the last
scatter's acknowledgement; gather and scatter times are reported too.

Every workload's bytes are verified (blake2b of the destination entries) before timing.
Values are medians over repeats with [min, max]; GB/s is decimal.

    python benchmarks/bench_transports.py [--quick] [--transport local,tcp,nixl,mori]
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
import struct
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
    "nixl": ("nixl", {}, "private"),  # UCX's choice: cma on one host
    "nixl_tcp": ("nixl", {"ucx_tls": "tcp"}, "private"),  # the path between hosts without RDMA
    "mori": ("mori", {}, "private"),
}
WRITER_OPTIONS: dict = {}  # extra options of the writing side, per transport
BASELINES = {"local": "memmove", "tcp": "python_socket", "nixl": "cma_writev", "mori": "cma_writev"}
STAGE_SLOTS = 2


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
        h.update(arr[o : o + n])
    return h.hexdigest()


# -- the target process -------------------------------------------------------------------


def leave(code: int) -> None:
    """Exit; a process that created a UCX backend leaves through nixl.exit_process."""
    nixl = sys.modules.get("sglang_kvxfer.transports.nixl")
    if nixl is not None and nixl.ucx_backend_created():
        nixl.exit_process(code)
    sys.exit(code)


def target_main(conn, name: str, options: dict, memory: str, stage_bytes: int) -> None:
    from sglang_kvxfer.transports import _memory, get_transport
    from sglang_kvxfer.transports.local import alloc_shared

    transport = get_transport(name, **options)
    if memory == "shm":
        buf = alloc_shared(REGION)
        dst = buf.as_numpy()
    else:
        dst = np.empty(REGION, np.uint8)
    dst[:] = 0  # fault the pages in before timing
    region = transport.register(dst.ctypes.data, REGION)
    stage = np.zeros(max(stage_bytes, 1), np.uint8)
    stage_region = transport.register(stage.ctypes.data, stage.nbytes) if stage_bytes else None
    plain_dst = np.zeros(REGION, np.uint8)  # the baselines land here
    if name in ("nixl", "mori"):
        _memory.allow_ptrace_writes()  # the process_vm_writev baseline writes plain_dst
    listener = socket.create_server(("127.0.0.1", 0))
    conn.send(
        (
            transport.agent_descriptor(),
            region.descriptor,
            stage_region.descriptor if stage_region else None,
            listener.getsockname()[1],
            os.getpid(),
            plain_dst.ctypes.data,
        )
    )
    plain = None
    while conn.poll(600):
        cmd, *args = conn.recv()
        if cmd == "zero":
            dst[:] = 0
            plain_dst[:] = 0
            conn.send(None)
        elif cmd == "huge":  # bytes of the destination region mapped by huge pages here
            conn.send(_memory.huge_page_bytes(dst.ctypes.data, REGION))
        elif cmd == "digest":
            conn.send(digest(plain_dst if args[0] else dst, args[1], args[2]))
        elif cmd == "plain_serve":  # serve plain-socket batches until the sender says 'E'
            if plain is None:
                plain, _ = listener.accept()
                plain.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            views = [memoryview(plain_dst)[o : o + n] for o, n in zip(args[0].tolist(), args[1].tolist())]
            while plain.recv(1) == b"B":
                for v in views:
                    got = 0
                    while got < v.nbytes:
                        got += plain.recv_into(v[got:])
                plain.sendall(b"A")
            conn.send(None)
        elif cmd == "stage_serve":  # scatter staged chunks until told chunk -1
            conn.send(stage_serve(conn, stage, dst, args[0]))
        elif cmd == "grant":  # the writer proves this secret (tcp refuses unauthenticated writers)
            transport.authorize_peer("bench-writer", args[0], [r for r in (region, stage_region) if r is not None])
            conn.send(None)
        elif cmd == "exit":
            transport.close()
            conn.send(None)
            leave(0)


def _rows(offsets: np.ndarray, sizes: np.ndarray, row: int) -> np.ndarray:
    """Indices of the ``row``-byte rows that entries ``(offsets, sizes)`` cover, in order."""
    counts = sizes // row
    ends = np.cumsum(counts)
    return np.repeat(offsets // row - (ends - counts), counts) + np.arange(int(ends[-1]))


def gather(slot: np.ndarray, src: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> int:
    """Pack entries ``src[offsets[i]:+sizes[i]]`` back to back at the start of ``slot``: one
    numpy row gather over rows of ``g`` bytes (g = gcd of offsets, sizes and lengths), or a
    ``memmove`` per entry when entries share no row size of 64 bytes or more. Returns bytes."""
    used = int(sizes.sum())
    row = int(np.gcd.reduce(np.concatenate((offsets, sizes, [src.nbytes, slot.nbytes]))))
    if row < 64:
        plain_copy_batch(slot.ctypes.data, src.ctypes.data, offsets, np.cumsum(sizes) - sizes, sizes)()
    else:
        np.take(src.reshape(-1, row), _rows(offsets, sizes, row), axis=0, out=slot[:used].reshape(-1, row))
    return used


def scatter(dst: np.ndarray, slot: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> None:
    """The inverse of ``gather``: entries packed in ``slot`` go to ``dst[offsets[i]:]``."""
    used = int(sizes.sum())
    row = int(np.gcd.reduce(np.concatenate((offsets, sizes, [dst.nbytes, slot.nbytes]))))
    if row < 64:
        plain_copy_batch(dst.ctypes.data, slot.ctypes.data, np.cumsum(sizes) - sizes, offsets, sizes)()
    else:
        dst.reshape(-1, row)[_rows(offsets, sizes, row)] = slot[:used].reshape(-1, row)


def stage_serve(conn, stage: np.ndarray, dst: np.ndarray, chunks: list) -> float:
    """Scatter chunk i from staging slot i % STAGE_SLOTS on message i; ack it. Returns the
    seconds spent scattering."""
    spent = 0.0
    slot_bytes = stage.nbytes // STAGE_SLOTS
    while True:
        (i,) = struct.unpack("<i", conn.recv_bytes())
        if i < 0:
            return spent
        t = time.perf_counter()
        remote_offsets, sizes = chunks[i]
        base = (i % STAGE_SLOTS) * slot_bytes
        scatter(dst, stage[base : base + slot_bytes], remote_offsets, sizes)
        spent += time.perf_counter() - t
        conn.send_bytes(struct.pack("<i", i))


class Target:
    def __init__(self, name: str, options: dict, memory: str, stage_bytes: int = 0):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target_main, args=(child, name, options, memory, stage_bytes), daemon=True)
        self.proc.start()
        (self.agent, self.region, self.stage_region, self.plain_port, self.pid, self.plain_addr) = self.call_reply()
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
    views = [memoryview(src)[o : o + n] for o, n in zip(lo.tolist(), sz.tolist())]
    ack = bytearray(1)

    def run():
        sock.sendall(b"B")
        for v in views:
            sock.sendall(v)
        if sock.recv_into(ack) != 1:
            raise ConnectionError("plain-socket receiver closed")

    return run


def cma_batch(pid: int, dst_addr: int, src: np.ndarray, lo, ro, sz):
    from sglang_kvxfer.transports._memory import cma_write

    def run():
        cma_write(pid, src.ctypes.data + lo, dst_addr + ro, sz)

    return run


def summarize(seconds: list[float], nbytes: int, entries: int) -> dict:
    gbps = [nbytes / s / 1e9 for s in seconds]
    ops = [entries / s for s in seconds]
    return {
        "gbps": round(statistics.median(gbps), 3),
        "gbps_range": [round(min(gbps), 3), round(max(gbps), 3)],
        "ops_per_s": round(statistics.median(ops)),
        "ms_per_batch": round(statistics.median(seconds) * 1e3, 3),
    }


def bench_variant(variant: str, args) -> tuple[list[dict], dict | None]:
    from sglang_kvxfer.transports import _memory, get_transport

    name, options, memory = VARIANTS[variant]
    if name == "tcp" and args.tcp_connections:
        options = dict(options, num_connections=args.tcp_connections)
    staging = name in ("nixl", "mori") and "kv_4096x1-8KiB" in args.workloads
    target = Target(name, options, memory, STAGE_SLOTS * args.stage_chunk if staging else 0)
    transport = get_transport(name, **{**options, **WRITER_OPTIONS.get(name, {})})
    src = np.random.default_rng(1).integers(0, 256, REGION, dtype=np.uint8)
    local = transport.register(src.ctypes.data, REGION)
    secret = os.urandom(32)
    target.call("grant", secret)
    transport.add_peer("target", target.agent, secret=secret)
    remote = transport.import_region("target", target.region)
    plain_dst = np.zeros(REGION, np.uint8)
    plain_dst[:] = 0  # fault in before timing (numpy asks for huge pages: see huge_page_bytes)
    base_huge = _memory.huge_page_bytes(plain_dst.ctypes.data, REGION)
    shm_dst = _memory.alloc_shared(REGION) if name == "local" and memory == "shm" else None
    results, stage_row = [], None
    try:
        for workload in args.workloads:
            lo, ro, sz = make_entries(workload)
            nbytes, want = int(sz.sum()), digest(src, lo, sz)

            def write(lo=lo, ro=ro, sz=sz):
                transport.write(local, remote, lo, ro, sz).wait(TIMEOUT_S)

            target.call("zero")
            write()
            verified = target.call("digest", False, ro, sz) == want
            base_name = BASELINES[name]
            if name == "local":
                baseline = plain_copy_batch(plain_dst.ctypes.data, src.ctypes.data, lo, ro, sz)
                baseline()
                base_ok = digest(plain_dst, ro, sz) == want
            elif name == "tcp":
                target.conn.send(("plain_serve", ro, sz))
                if target.plain_sock is None:
                    target.plain_sock = socket.create_connection(("127.0.0.1", target.plain_port))
                    target.plain_sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                baseline = plain_socket_batch(target.plain_sock, src, lo, sz)
                baseline()
            else:
                baseline = cma_batch(target.pid, target.plain_addr, src, lo, ro, sz)
                baseline()
                base_ok = target.call("digest", True, ro, sz) == want
            # local into shared memory: also a memmove into a memfd of this process (the
            # transport's kind of page), to tell page effects from transport overhead
            shm_base = None
            if name == "local" and memory == "shm":
                shm_base = plain_copy_batch(shm_dst.ptr, src.ctypes.data, lo, ro, sz)
                shm_base()
                shm_ok = digest(shm_dst.as_numpy(), ro, sz) == want
            own, base, base_shm = [], [], []
            for _ in range(args.repeats):  # interleaved, so drift hits all alike
                own.append(timed(write, args.min_time))
                base.append(timed(baseline, args.min_time))
                if shm_base is not None:
                    base_shm.append(timed(shm_base, args.min_time))
            if name == "tcp":
                target.plain_sock.sendall(b"E")
                target.call_reply()
                base_ok = target.call("digest", True, ro, sz) == want
            row = {
                "transport": name,
                "variant": variant,
                "memory": memory,
                "workload": workload,
                "entries": len(sz),
                "bytes": nbytes,
                "verified": bool(verified),
                **summarize(own, nbytes, len(sz)),
                "baseline": {"name": base_name, "verified": bool(base_ok), **summarize(base, nbytes, len(sz))},
            }
            row["ratio"] = round(row["gbps"] / row["baseline"]["gbps"], 3)
            if name == "local":
                row["huge_page_bytes"] = {"destination": target.call("huge"), "baseline": base_huge}
            if shm_base is not None:
                row["baseline_shm"] = {
                    "name": "memmove_shm",
                    "verified": bool(shm_ok),
                    "huge_page_bytes": _memory.huge_page_bytes(shm_dst.ptr, REGION),
                    **summarize(base_shm, nbytes, len(sz)),
                }
                row["ratio_vs_shm"] = round(row["gbps"] / row["baseline_shm"]["gbps"], 3)
            results.append(row)
            vs_shm = f"  memmove_shm {row['baseline_shm']['gbps']:7.2f}" if shm_base is not None else ""
            print(
                f"{variant:10s} {workload:16s} {row['gbps']:7.2f} GB/s  baseline "
                f"{row['baseline']['gbps']:7.2f}  ratio {row['ratio']:.2f}{vs_shm}",
                file=sys.stderr,
            )
        if staging:
            stage_row = bench_staging(variant, transport, local, remote, src, target, args)
    finally:
        transport.close()
        target.close()
        if shm_dst is not None:
            shm_dst.close()
    return results, stage_row


def chunk_plan(lo, ro, sz, chunk_bytes: int) -> list[tuple]:
    """Cut a batch into chunks of whole entries, each at most ``chunk_bytes``: per chunk the
    source offsets, destination offsets and sizes."""
    if int(sz.max()) > chunk_bytes:
        raise ValueError(f"--stage-chunk {chunk_bytes} is smaller than an entry ({sz.max()})")
    plan, start = [], 0
    ends = np.cumsum(sz)
    while start < sz.shape[0]:
        base = int(ends[start] - sz[start])
        stop = int(np.searchsorted(ends, base + chunk_bytes, side="right"))
        plan.append((lo[start:stop], ro[start:stop], sz[start:stop]))
        start = stop
    return plan


def bench_staging(variant, transport, local, remote, src, target, args) -> dict:
    """(a) the KV batch posted directly vs (b) gather -> chunked writes -> scatter."""
    lo, ro, sz = make_entries("kv_4096x1-8KiB")
    nbytes, want = int(sz.sum()), digest(src, lo, sz)
    slot = args.stage_chunk
    stage = np.zeros(STAGE_SLOTS * slot, np.uint8)
    stage_local = transport.register(stage.ctypes.data, stage.nbytes)
    stage_remote = transport.import_region("target", target.stage_region)
    plan = chunk_plan(lo, ro, sz, slot)
    gather_s, runs = [0.0], [0]

    def direct():
        transport.write(local, remote, lo, ro, sz).wait(TIMEOUT_S)

    def staged():
        """Chunk i: gather into local slot i % SLOTS while chunk i - 1 is on the wire; once
        that write is done the target may scatter it; write i waits for the target to have
        scattered chunk i - SLOTS out of the slot it lands in."""
        conn, acked, sent = target.conn, 0, None
        for i, (c_lo, _, c_sz) in enumerate(plan):
            t = time.perf_counter()
            base = (i % STAGE_SLOTS) * slot
            used = gather(stage[base : base + slot], src, c_lo, c_sz)
            gather_s[0] += time.perf_counter() - t
            if sent is not None:
                sent[1].wait(TIMEOUT_S)
                conn.send_bytes(struct.pack("<i", sent[0]))
            if i >= STAGE_SLOTS:
                struct.unpack("<i", conn.recv_bytes())
                acked += 1
            sent = (i, transport.write(stage_local, stage_remote, [base], [base], [used]))
        sent[1].wait(TIMEOUT_S)
        conn.send_bytes(struct.pack("<i", sent[0]))
        for _ in range(len(plan) - acked):
            struct.unpack("<i", conn.recv_bytes())
        runs[0] += 1

    try:
        target.call("zero")
        direct()
        direct_ok = target.call("digest", False, ro, sz) == want
        target.call("zero")
        target.conn.send(("stage_serve", [(c_ro, c_sz) for _, c_ro, c_sz in plan]))
        staged()
        direct_s, staged_s = [], []
        for _ in range(args.repeats):  # interleaved, so drift hits both alike
            direct_s.append(timed(direct, args.min_time))
            staged_s.append(timed(staged, args.min_time))
        target.conn.send_bytes(struct.pack("<i", -1))
        scatter_total = target.call_reply()
        staged_ok = target.call("digest", False, ro, sz) == want
    finally:
        transport.deregister(stage_local)
    row = {
        "transport": VARIANTS[variant][0],
        "variant": variant,
        "options": VARIANTS[variant][1],
        "workload": "kv_4096x1-8KiB",
        "entries": len(sz),
        "bytes": nbytes,
        "chunk_bytes": slot,
        "chunks": len(plan),
        "slots": STAGE_SLOTS,
        "direct": {"verified": bool(direct_ok), **summarize(direct_s, nbytes, len(sz))},
        "staged": {
            "verified": bool(staged_ok),
            **summarize(staged_s, nbytes, len(sz)),
            "gather_ms": round(gather_s[0] / runs[0] * 1e3, 3),
            "scatter_ms": round(scatter_total / runs[0] * 1e3, 3),
        },
    }
    row["speedup"] = round(row["staged"]["gbps"] / row["direct"]["gbps"], 3)
    print(
        f"{variant:10s} staged kv       {row['staged']['gbps']:7.2f} GB/s  direct "
        f"{row['direct']['gbps']:7.2f}  speedup {row['speedup']:.2f}",
        file=sys.stderr,
    )
    return row


def pick_variants(wanted: list[str], explicit: bool, parser) -> tuple[list[str], dict]:
    """The variants to run, and why a wanted transport is skipped (only when not explicit)."""
    from sglang_kvxfer.errors import TransportUnavailableError
    from sglang_kvxfer.transports import available_transports
    from sglang_kvxfer.transports.mori import probe as mori_probe

    skipped = {}
    for name in ("nixl", "mori"):
        if name not in wanted:
            continue
        if name not in available_transports():
            skipped[name] = f"{name} is not installed (pip install -e '.[{name}]')"
        elif name == "mori":
            try:
                mori_probe.check()
            except TransportUnavailableError as exc:
                skipped[name] = str(exc)
    if explicit and skipped:
        parser.error("; ".join(skipped.values()))
    unknown = set(wanted) - {t for t, _, _ in VARIANTS.values()}
    if unknown:
        parser.error(f"--transport: unknown {sorted(unknown)}; choose from local, tcp, nixl, mori")
    return [v for v, (t, _, _) in VARIANTS.items() if t in wanted and t not in skipped], skipped


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 short repeats per workload")
    parser.add_argument(
        "--transport",
        default=None,
        help="comma-separated: local, tcp, nixl, mori (local also runs local_cma; default: every one installed)",
    )
    parser.add_argument(
        "--workload", default=",".join(WORKLOADS), help=f"comma-separated subset of {', '.join(WORKLOADS)}"
    )
    parser.add_argument("--repeats", type=int, default=None, help="repeats per workload")
    parser.add_argument("--min-time", type=float, default=None, help="seconds per repeat")
    parser.add_argument(
        "--tcp-connections", type=int, default=None, help="tcp connections per peer (default KVXFER_TCP_CONNECTIONS)"
    )
    parser.add_argument(
        "--stage-chunk", type=int, default=2 << 20, help="bytes per staging slot in the staged KV comparison"
    )
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (3 if args.quick else 7)
    args.min_time = args.min_time or (0.05 if args.quick else 0.3)
    args.workloads = args.workload.split(",")
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad:
        parser.error(f"unknown workload(s) {bad}; choose from {list(WORKLOADS)}")
    wanted = (args.transport or "local,tcp,nixl,mori").split(",")
    variants, skipped = pick_variants(wanted, args.transport is not None, parser)
    from sglang_kvxfer import envs
    from sglang_kvxfer.transports._memory import hugetlb_pages, shmem_thp_setting

    results, staging = [], []
    for variant in variants:
        rows, stage_row = bench_variant(variant, args)
        results += rows
        staging += [stage_row] if stage_row else []

    def ratios(variant, workloads):
        return [r["ratio"] for r in results if r["variant"] == variant and r["workload"] in workloads]

    big = ("1MiB_x64", "16MiB_x4")
    checks = {}
    if "local" in variants:
        checks["local_min_ratio_1MiB_plus"] = min(ratios("local", big), default=None)
    if "tcp" in variants:
        checks["tcp_ratio_16MiB"] = min(ratios("tcp", ("16MiB_x4",)), default=None)
    for row in staging:
        checks[f"{row['variant']}_staged_speedup_kv"] = row["speedup"]
    report = {
        "benchmark": "bench_transports",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "shmem_thp": shmem_thp_setting(),
            # the host's reserved huge pages free after the runs (KVXFER_SHM_HUGETLB puts pools there)
            "hugetlb_free_pages": hugetlb_pages()[1],
            "shm_hugetlb": envs.KVXFER_SHM_HUGETLB.get(),
        },
        "config": {
            "region_bytes": REGION,
            "repeats": args.repeats,
            "min_time_s": args.min_time,
            "quick": args.quick,
            "stage_chunk_bytes": args.stage_chunk,
            "skipped": skipped,
        },
        "results": results,
        "staging": staging,
        "targets": {
            "needed_ratio": 0.8,
            "needed_staged_speedup": 5.0,
            **checks,
            "all_verified": all(
                r["verified"] and r["baseline"]["verified"] and r.get("baseline_shm", {}).get("verified", True)
                for r in results
            )
            and all(r["direct"]["verified"] and r["staged"]["verified"] for r in staging),
        },
    }
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0 if report["targets"]["all_verified"] else 1


if __name__ == "__main__":
    leave(main())
