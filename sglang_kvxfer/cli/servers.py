"""``kvxfer prefill`` and ``kvxfer decode``: a TP group of rank servers behind one port.

The launcher spawns one process per TP rank (``RankGroup``), optionally hosts the bootstrap
service (prefill), and serves clients on ``--port`` (ZMQ ROUTER, msgpack): ``info`` returns
the group's role, TP size, geometry, transport and each rank's pid and state; ``transfer``
runs one synthetic request on every rank and returns the per-rank results (every field is
range-checked first; past ``--concurrency`` jobs the answer is a "busy" result at once);
``abort`` aborts a room on every rank. A rank process that dies fails its jobs at once and
is started again (``--restart-ranks``); the launcher keeps serving. Ctrl-C or SIGTERM stops
the group cleanly.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import math
import os
import queue
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from sglang_kvxfer import auth
from sglang_kvxfer.cli.common import (
    COMMON_RANGES,
    MAX_CHUNK_DELAY_S,
    PORT,
    add_deadline_args,
    add_model_args,
    add_side_args,
    check_ranges,
    engine_options,
    side_geometry,
)
from sglang_kvxfer.engine.config import parse_host_port
from sglang_kvxfer.errors import AuthenticationError, KVXferError
from sglang_kvxfer.protocol import envelope

log = logging.getLogger("sglang_kvxfer.server")

MAX_REQUEST_BYTES = 1 << 20
MAX_AUX_BYTES = 64 << 10  # a first token id and a little metadata; well below the protocol's limit


def add_arguments(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument("--tp", type=int, default=1, help="TP size of this group: one process per rank (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind and advertise (default 127.0.0.1)")
    p.add_argument(
        "--port", type=int, default=30000 if role == "prefill" else 30001, help="client port of this group (1-65535)"
    )
    if role == "prefill":
        p.add_argument(
            "--bootstrap-port", type=int, default=8998, help="host the bootstrap service on this port (default 8998)"
        )
        p.add_argument(
            "--bootstrap", default=None, help="use an existing bootstrap service at host:port instead of hosting one"
        )
    else:
        p.add_argument("--bootstrap", required=True, help="the prefill group's bootstrap service, host:port")
    p.add_argument(
        "--transport",
        default="auto",
        help="local, tcp, nixl, mori or auto (default: prefill picks local on a loopback "
        "address and tcp otherwise; decode follows the prefill group)",
    )
    p.add_argument(
        "--devices", default="cpu", help="pool device per rank: cpu, or a comma list like cuda:0,cuda:1 (default cpu)"
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="requests the group runs at once; one more is answered 'busy' (default 8)",
    )
    p.add_argument(
        "--restart-ranks",
        type=int,
        default=3,
        help="start a rank process that died again, up to N times in a row with backoff "
        "0.5 s doubling to 8 s; the count resets after 30 s healthy (default 3; 0: off)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus metrics: rank r on PORT+r at --host (needs prometheus_client; default 0: off)",
    )
    p.add_argument("--log-level", default="INFO", help="log level (default INFO)")
    add_model_args(p)
    add_side_args(p, both=False)
    add_deadline_args(p)


def resolve_transport(args: argparse.Namespace, role: str, bootstrap: str) -> str:
    if args.transport != "auto":
        return args.transport
    if role == "prefill":
        host = args.host
        try:
            loop = ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except (OSError, ValueError):
            loop = False
        from sglang_kvxfer.transports import choose_transport

        return choose_transport(args.devices.split(","), same_host=loop)
    from sglang_kvxfer.engine import bootstrap as boot
    from sglang_kvxfer.protocol.messages import BootstrapQuery

    reply = boot.request(
        bootstrap, BootstrapQuery(session=f"decode-launcher-{os.getpid()}", tp_rank=0), timeout_s=args.bootstrap_timeout
    )
    if not reply.transport:
        raise ValueError(
            f"bootstrap {bootstrap} knows no prefill group yet ({reply.reason}); "
            f"start the prefill group first or pass --transport"
        )
    from sglang_kvxfer.transports import check_serves_devices

    check_serves_devices(reply.transport, args.devices.split(","))  # decode pools may sit elsewhere
    return reply.transport


def _devices(text: str, tp: int) -> list[str]:
    devs = [d.strip() for d in text.split(",") if d.strip()]
    if len(devs) == 1:
        devs = devs * tp
    if len(devs) != tp:
        raise ValueError(f"--devices lists {len(devs)} device(s) for --tp {tp}")
    return devs


class _ClientPort:
    """The launcher's client socket: one thread owns it; replies come back through a queue."""

    SENDER = "launcher"

    def __init__(self, host: str, port: int, key: bytes):
        # Requests and replies travel in the authenticated envelope, like the bootstrap's:
        # a request must carry a valid tag and be fresh; a reply is bound to its request.
        self._key, self._fresh = key, envelope.FreshnessGuard()
        self._seqs: dict[tuple[bytes, object], int] = {}
        self.dropped = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        try:
            self._sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self._sock.close(0)
            self._ctx.term()
            raise KVXferError(f"cannot listen for clients on {host}:{port}: {exc}") from None
        self.handler: Callable[[bytes, dict], None] | None = None
        self._replies: queue.Queue = queue.Queue()
        from sglang_kvxfer.cluster.group import StopFlag

        self._stop = StopFlag()  # set from signal handlers: no locks

    def reply(self, ident: bytes, obj: dict) -> None:
        seq = self._seqs.pop((ident, obj.get("id")), 0)
        self._replies.put((ident, envelope.seal(self._key, self.SENDER, seq, msgpack.packb(obj, use_bin_type=True))))

    def serve(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(50):
                try:
                    ident, _, data = self._sock.recv_multipart(zmq.NOBLOCK)
                    sender, seq, payload = envelope.open_frame(self._key, data)
                    stale = self._fresh.accept(sender, seq, time.time())
                    if stale:
                        raise AuthenticationError(stale)
                    req = msgpack.unpackb(payload, raw=False)
                    if not isinstance(req, dict):
                        raise ValueError("a request must be a map")
                except (ValueError, zmq.ZMQError, msgpack.UnpackException, AuthenticationError) as exc:
                    self.dropped += 1
                    if self.dropped <= 10 or self.dropped % 1000 == 0:
                        log.warning("dropped a client request (%d so far): %s", self.dropped, exc)
                else:
                    if len(self._seqs) < 100_000:  # replies bound to requests; bounded
                        self._seqs[(ident, req.get("id"))] = seq
                    handler = self.handler
                    if handler is None:
                        raise RuntimeError("_ClientPort.serve: set .handler before serving")
                    handler(ident, req)
            while True:
                try:
                    ident, data = self._replies.get_nowait()
                except queue.Empty:
                    break
                self._sock.send_multipart([ident, b"", data])

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()


def serve(args: argparse.Namespace, role: str) -> int:
    from sglang_kvxfer.cluster.group import RankGroup, make_spec
    from sglang_kvxfer.engine import BootstrapServer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_ranges(
        args, {**COMMON_RANGES, "tp": (1, 1024), "port": PORT, "bootstrap_port": PORT, "restart_ranks": (0, 1000)}
    )
    geometry = side_geometry(args, None, args.num_pages or 512)
    geometry.placement(args.tp, 0)
    key = auth.resolve_key(args.host)  # none usable (a non-loopback --host without one): one line, exit 2
    if args.transport != "auto":
        from sglang_kvxfer.transports import check_transport

        check_transport(args.transport)  # before the bootstrap service starts: one line, exit 2
    boot = None
    if role == "prefill" and not args.bootstrap:
        boot = BootstrapServer(args.host, args.bootstrap_port)
        bootstrap = boot.address
        log.info("bootstrap service on %s", bootstrap)
    else:
        parse_host_port(args.bootstrap)
        bootstrap = args.bootstrap
    try:
        transport = resolve_transport(args, role, bootstrap)
        spec = make_spec(
            role,
            geometry,
            args.tp,
            bootstrap,
            transport,
            host=args.host,
            devices=_devices(args.devices, args.tp),
            options=engine_options(args),
            concurrency=args.concurrency,
            log_level=args.log_level.upper(),
            metrics_port=args.metrics_port,
        )
        log.info("starting %d %s rank(s), transport %s", args.tp, role, transport)
        info = {
            "op": "info",
            "role": role,
            "tp_size": args.tp,
            "geometry": geometry.to_dict(),
            "transport": transport,
            "bootstrap": bootstrap,
        }
        port = _ClientPort(args.host, args.port, key)  # bind first: a busy port fails before any spawn
        try:
            with RankGroup(spec, max_restarts=args.restart_ranks, max_jobs=args.concurrency) as group:

                def handle(ident: bytes, req: dict) -> None:
                    op = req.get("op")
                    if op == "info":
                        port.reply(
                            ident,
                            dict(info, id=req.get("id"), pids=group.pids, states=group.states, restarts=group.restarts),
                        )
                    elif op == "transfer":
                        try:
                            job = _job(req, geometry, role)
                        except ValueError as exc:
                            port.reply(ident, {"op": "error", "id": req.get("id"), "reason": str(exc)})
                            return
                        group.submit(job).add_done_callback(
                            lambda f: port.reply(ident, {"op": "result", "id": req.get("id"), "ranks": f.result()})
                        )
                    elif op == "abort" and isinstance(req.get("room"), int) and not isinstance(req["room"], bool):
                        group.abort(req["room"], str(req.get("reason") or "aborted by the client")[:500])
                        port.reply(ident, {"op": "aborted", "id": req.get("id")})
                    else:
                        port.reply(ident, {"op": "error", "id": req.get("id"), "reason": f"unknown op {op!r}"})

                port.handler = handle
                stop = lambda *_: port.stop()  # noqa: E731
                signal.signal(signal.SIGINT, stop)
                signal.signal(signal.SIGTERM, stop)
                metrics = "".join(f", metrics http://{args.host}:{p}/metrics" for p in group.metrics_ports if p)
                print(
                    f"kvxfer {role}: TP {args.tp} ready on tcp://{args.host}:{args.port} "
                    f"(bootstrap {bootstrap}, transport {transport}{metrics}); Ctrl-C stops",
                    file=sys.stderr,
                    flush=True,
                )
                port.serve()
        finally:
            port.close()
    finally:
        if boot is not None:
            boot.close()
    return 0


_JOB_FIELDS: dict[str, type | tuple[type, ...]] = {
    "room": int,
    "tokens": int,
    "chunk_tokens": int,
    "aux": bytes,
    "verify": bool,
    "chunk_delay_s": (int, float),
}


def _job(req: dict, geometry, role: str) -> dict:
    """The job of a ``transfer`` request, every field type- and range-checked (ValueError
    names the field, its value and the limit)."""
    job: dict[str, Any] = {}  # each value type-checked against _JOB_FIELDS below
    for name, kind in _JOB_FIELDS.items():
        if name not in req:
            raise ValueError(f"transfer request is missing {name!r}")
        value = req[name]
        if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            raise ValueError(f"transfer request field {name}={value!r} has the wrong type")
        job[name] = value
    capacity = geometry.num_pages * geometry.page_size
    delay = job["chunk_delay_s"]
    if not 0 <= job["room"] < 2**64:
        raise ValueError(f"transfer request room={job['room']} must be in 0..2**64-1")
    if not 1 <= job["tokens"] <= capacity:
        raise ValueError(
            f"transfer request tokens={job['tokens']} must be in 1..{capacity}: the {role} pool holds "
            f"{geometry.num_pages} pages of {geometry.page_size} tokens = {capacity} tokens"
        )
    if not 0 <= job["chunk_tokens"] < 2**31:
        raise ValueError(f"transfer request chunk_tokens={job['chunk_tokens']} must be in 0..2**31-1 (0: one chunk)")
    if not (math.isfinite(delay) and 0 <= delay <= MAX_CHUNK_DELAY_S):
        raise ValueError(f"transfer request chunk_delay_s={delay!r} must be in 0..{MAX_CHUNK_DELAY_S:g} s")
    if len(job["aux"]) > MAX_AUX_BYTES:
        raise ValueError(f"transfer request aux of {len(job['aux'])} bytes is over the limit of {MAX_AUX_BYTES}")
    return job


class PrefillCommand:
    @staticmethod
    def add_arguments(p):
        add_arguments(p, "prefill")

    @staticmethod
    def run(args):
        return serve(args, "prefill")


class DecodeCommand:
    @staticmethod
    def add_arguments(p):
        add_arguments(p, "decode")

    @staticmethod
    def run(args):
        return serve(args, "decode")
