"""The control channel of one rank: a ZMQ PULL inbox and PUSH sockets to peers.

Owns the sockets and the I/O thread. The thread feeds every decoded message, with the
authenticated session of its sender, to a handler and calls a tick function every
``tick_s``. Every frame travels in the authenticated envelope (``protocol/envelope.py``):
a frame whose tag does not verify, that replays or reorders an earlier frame of its
sender, or whose message names another session than the envelope's is dropped and
counted before its payload is decoded or handled; a malformed frame is counted too; none
is fatal. Sends never block: a peer whose queue is full or that is gone makes ``send``
return False (deadlines and heartbeats take it from there). Must not interpret messages.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

import zmq

from sglang_kvxfer.errors import AuthenticationError, ProtocolError
from sglang_kvxfer.protocol import codec, envelope
from sglang_kvxfer.protocol.fields import MAX_FRAME_BYTES

__all__ = ["ControlChannel"]

log = logging.getLogger("sglang_kvxfer.control")
SLOW_HANDLER_S = 1.0  # a control handler (or tick) longer than this is logged


class ControlChannel:
    """Inbox + outboxes + I/O thread.

    Args:
        host: address to bind and advertise.
        on_message: called on the I/O thread as ``on_message(message, sender)`` with each
            authenticated, decoded message and its sender's session id.
        on_tick: called on the I/O thread with ``time.monotonic()`` every ``tick_s``.
        name: for thread names and logs.
        session: this process's session id (the sender of every frame it sends).
        key: the 32-byte shared key, or ``b""`` with authentication off.
    """

    def __init__(
        self,
        host: str,
        on_message: Callable,
        on_tick: Callable[[float], None],
        name: str,
        *,
        session: str,
        key: bytes,
        tick_s: float = 0.05,
    ):
        self._session, self._key = session, key
        self._seq = 0
        self._guard = envelope.SequenceGuard()
        self.dropped: dict[str, int] = {"unauthenticated": 0, "replayed": 0, "spoofed": 0, "malformed": 0}
        self._ctx = zmq.Context()
        self._inbox = self._ctx.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._inbox.setsockopt(zmq.LINGER, 0)
        port = self._inbox.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._out: dict[str, zmq.Socket] = {}
        self._out_lock = threading.Lock()
        self._on_message, self._on_tick, self._tick_s = on_message, on_tick, tick_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"kvxfer-io-{name}", daemon=True)
        self._thread.start()

    def send(self, endpoint: str, message) -> bool:
        """Queue ``message`` for ``endpoint``; False if it could not be queued now."""
        payload = codec.encode(message)
        with self._out_lock:  # numbering and sending under one lock: each stream stays ordered
            if self._stop.is_set():
                return False
            self._seq += 1
            frame = envelope.seal(self._key, self._session, self._seq, payload, endpoint)
            sock = self._out.get(endpoint)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 100_000)
                sock.connect(endpoint)
                self._out[endpoint] = sock
            try:
                sock.send(frame, zmq.NOBLOCK)
                return True
            except zmq.Again:
                log.warning("control queue to %s is full; dropping %s", endpoint, type(message).__name__)
                return False

    def forget(self, endpoint: str) -> None:
        """Close the outbox to a peer that is gone."""
        with self._out_lock:
            sock = self._out.pop(endpoint, None)
            if sock is not None:
                sock.close(0)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._inbox, zmq.POLLIN)
        next_tick = time.monotonic()
        while not self._stop.is_set():
            # Rounded up: a wait cut to 0 ms would spin (and take the GIL from the data
            # path's threads) for the last millisecond before every tick.
            timeout_ms = math.ceil(max(0.0, next_tick - time.monotonic()) * 1000)
            try:
                ready = dict(poller.poll(timeout_ms))
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise
            if ready.get(self._inbox):
                for _ in range(256):  # drain a burst, but keep ticking under load
                    try:
                        frame = self._inbox.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._dispatch(frame.buffer)
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + self._tick_s
                try:
                    self._on_tick(now)
                except Exception:  # a bug in a tick must not kill the rank's I/O
                    log.exception("control tick failed")
                self._check_slow("a tick", now)

    @property
    def bad_frames(self) -> int:
        """Frames dropped for any reason (see ``dropped`` for the reasons)."""
        return sum(self.dropped.values())

    def _drop(self, kind: str, why: str) -> None:
        self.dropped[kind] += 1
        count = self.dropped[kind]
        if count <= 10 or count % 1000 == 0:  # a flood must not flood the log too
            log.warning("%s dropped a control frame (%s, %d so far): %s", self.endpoint, kind, count, why)

    def _dispatch(self, data) -> None:
        try:
            sender, seq, payload = envelope.open_frame(self._key, data, self.endpoint)
        except AuthenticationError as exc:
            return self._drop("unauthenticated", str(exc))
        if not self._guard.accept(sender, seq):
            return self._drop("replayed", f"sequence {seq} of sender {sender} is not newer than the last one")
        try:
            message = codec.decode(payload)
        except ProtocolError as exc:
            return self._drop("malformed", str(exc))
        claimed = getattr(message, "session", sender)
        if claimed != sender:
            return self._drop("spoofed", f"{type(message).__name__} names session {claimed} but came from {sender}")
        t0 = time.monotonic()
        try:
            self._on_message(message, sender)
        except Exception:
            log.exception("handling %s failed", type(message).__name__)
        self._check_slow(type(message).__name__, t0)

    def _check_slow(self, what: str, t0: float) -> None:
        """Warn when one handler held the I/O thread long: meanwhile this rank sent no
        heartbeats, and a peer that waits for them long enough declares it dead."""
        took = time.monotonic() - t0
        if took > SLOW_HANDLER_S:
            log.warning(
                "%s: handling %s took %.1f s on the I/O thread (no heartbeats meanwhile)", self.endpoint, what, took
            )

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the I/O thread (bounded join) and close every socket. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        with self._out_lock:
            for sock in self._out.values():
                sock.close(0)
            self._out.clear()
        self._inbox.close(0)
        self._ctx.term()
