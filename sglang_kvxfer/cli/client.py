"""``kvxfer client``: drive a running prefill server and decode server with requests.

Acts as the router: every request goes to both servers at once (same room), each runs it on
all of its ranks, and the client combines the per-rank results, checks that the decode ranks
verified every byte, and prints the same summary as ``kvxfer demo``. Room ids are random
63-bit numbers; when one side fails a request the client aborts it on the other side, so a
dead rank costs a failed request within about a second, not a deadline. Flags are
range-checked and a request larger than either server's pool is refused up front.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import secrets
import threading
import time
from concurrent.futures import Future

import msgpack
import zmq

from sglang_kvxfer import auth
from sglang_kvxfer.cli.common import (
    COMMON_RANGES,
    check_pool_fits,
    check_ranges,
    parse_tokens,
    summary_shape,
)
from sglang_kvxfer.cli.demo import render
from sglang_kvxfer.cli.progress import Progress
from sglang_kvxfer.cluster.workload import make_requests, run_workload, summarize
from sglang_kvxfer.engine.config import parse_host_port
from sglang_kvxfer.errors import AuthenticationError, TransferTimeoutError
from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.protocol import envelope

log = logging.getLogger("sglang_kvxfer.client")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", required=True, help="prefill server host:port")
    p.add_argument("--decode", required=True, help="decode server host:port")
    p.add_argument("--requests", type=int, default=16, help="requests to run (default 16)")
    p.add_argument("--tokens", default="256,2048,512,1024", help="request lengths, cycled")
    p.add_argument("--chunk-tokens", type=int, default=512, help="prefill chunk size in tokens (0: one chunk)")
    p.add_argument("--chunk-delay-ms", type=float, default=0.0, help="pause before each later chunk")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    p.add_argument("--no-verify", action="store_true", help="skip filling and checking the bytes")
    p.add_argument(
        "--seed", type=int, default=0, help="unused: room ids are random 63-bit numbers so that runs never share a room"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for one request (default 600)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--quiet", action="store_true", help="no progress line")


class RemoteGroup:
    """A server's client port: ``submit(job) -> Future[list of per-rank results]``.

    Requests are sealed with the shared key (``key``; None: from the environment) and a
    fresh sequence number; a reply counts only if it verifies and answers that number."""

    def __init__(self, address: str, key: bytes | None = None):
        host, port = parse_host_port(address, "server")
        self.address = address
        self._key = auth.resolve_key() if key is None else key
        self._session = f"client-{os.getpid()}-{secrets.token_hex(4)}"
        self._seqs: dict[int, int] = {}
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(f"tcp://{host}:{port}")
        self._ids = itertools.count()
        self._pending: dict[int, Future] = {}
        self._outbox: list[bytes] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"kvxfer-client-{address}", daemon=True)
        self._thread.start()

    def _request(self, obj: dict) -> Future:
        fut: Future = Future()
        with self._lock:
            rid = next(self._ids)
            self._pending[rid] = fut
            seq = self._seqs[rid] = envelope.fresh_seq(time.time())
            self._outbox.append(
                envelope.seal(self._key, self._session, seq, msgpack.packb(dict(obj, id=rid), use_bin_type=True))
            )
        return fut

    def info(self, timeout_s: float) -> dict:
        try:
            return self._request({"op": "info"}).result(timeout_s)
        except TimeoutError:
            raise TransferTimeoutError(f"server {self.address} did not answer within {timeout_s:.0f} s") from None

    def submit(self, job: dict) -> Future:
        outer: Future = Future()

        def done(f: Future) -> None:
            reply = f.result()
            if reply.get("op") == "result":
                outer.set_result(reply["ranks"])
            else:
                outer.set_result([{"ok": False, "rank": -1, "reason": f"{self.address}: {reply.get('reason')}"}])

        self._request(dict(job, op="transfer")).add_done_callback(done)
        return outer

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                out, self._outbox = self._outbox, []
            for data in out:
                self._sock.send_multipart([b"", data])
            if self._sock.poll(20):
                try:
                    sender, seq, payload = envelope.open_frame(self._key, self._sock.recv_multipart()[-1])
                    reply = msgpack.unpackb(payload, raw=False)
                    rid = reply.get("id")
                except (AuthenticationError, ValueError, msgpack.UnpackException, AttributeError) as exc:
                    log.warning("dropped a reply from %s: %s", self.address, exc)
                    continue
                with self._lock:
                    if sender != "launcher" or self._seqs.get(rid) != seq:
                        log.warning("dropped a reply from %s that answers no request of this client", self.address)
                        continue
                    self._seqs.pop(rid, None)
                    fut = self._pending.pop(rid, None)
                if fut is not None:
                    fut.set_result(reply)

    def abort(self, room: int, reason: str) -> None:
        """Abort ``room`` on every rank of the server (fire and forget)."""
        self._request({"op": "abort", "room": room, "reason": reason})

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close(0)
        self._ctx.term()


def run(args: argparse.Namespace) -> int:
    check_ranges(args, {k: COMMON_RANGES[k] for k in ("requests", "chunk_tokens", "chunk_delay_ms", "concurrency")})
    check_ranges(args, {"timeout": (1e-3, 1e6)})
    tokens = parse_tokens(args.tokens)
    pre, dec = RemoteGroup(args.prefill), RemoteGroup(args.decode)
    try:
        ip, idc = pre.info(30), dec.info(30)
        for got, want, addr in ((ip, "prefill", args.prefill), (idc, "decode", args.decode)):
            if got.get("role") != want:
                raise ValueError(f"{addr} is a {got.get('role')} server, expected {want}")
        gp, gd = KVGeometry.from_dict(ip["geometry"]), KVGeometry.from_dict(idc["geometry"])
        check_pool_fits(max(tokens), gp, f"prefill server's ({args.prefill})")
        check_pool_fits(max(tokens), gd, f"decode server's ({args.decode})")
        jobs = make_requests(
            args.requests, tokens, args.chunk_tokens, gp.page_size, None, not args.no_verify, args.chunk_delay_ms / 1e3
        )
        results, wall = run_workload(
            pre, dec, jobs, args.concurrency, args.timeout, progress=Progress(len(jobs), not args.quiet)
        )
    finally:
        pre.close()
        dec.close()
    summary = summarize(
        results,
        wall,
        prefill_tp=ip["tp_size"],
        decode_tp=idc["tp_size"],
        transport=ip["transport"],
        **summary_shape(gp, gd),
        verify=not args.no_verify,
    )
    print(json.dumps(summary) if args.json else render(summary))
    ok = summary["succeeded_requests"] == summary["requests"]
    return 0 if ok and (args.no_verify or summary["verified_requests"] == summary["requests"]) else 1
