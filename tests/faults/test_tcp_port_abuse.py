"""Abuse of a live ``tcp`` reader's data port, and the ``local`` transport's ptrace opt-in.

A reader transport with two registered regions granted to two writers ("A" and "B") is
probed from raw sockets: garbage, forged HELLOs, silence, and a flood of silent
connections. Each probe must be closed within the handshake deadline after receiving
nothing but the challenge (no agent name, no reason), and the registered memory must stay
byte-for-byte unchanged. Authorized writers are real ``TcpTransport`` instances.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import numpy as np
import pytest

from sglang_kvxfer.errors import TransportError
from sglang_kvxfer.transports import _memory
from sglang_kvxfer.transports.local import LocalTransport, alloc_shared
from sglang_kvxfer.transports.tcp import TcpTransport
from sglang_kvxfer.transports.tcp.wire import CHALLENGE, HELLO, MAGIC, WIRE_VERSION, hello_mac, key_id

N = 64 << 10
HANDSHAKE_S = 1.0
SLACK_S = 2.0  # a loaded 2-core machine: scheduling delay on top of a deadline
TIMEOUT_S = 10.0
SECRET_A, SECRET_B = b"A" * 32, b"B" * 32


class Reader:
    """The victim: a live tcp reader with region ``a`` granted to "A" and ``b`` to "B"."""

    def __init__(self, **options):
        self.t = TcpTransport(handshake_timeout_s=HANDSHAKE_S, **options)
        rng = np.random.default_rng(11)
        self.mem_a = rng.integers(0, 256, N, dtype=np.uint8)
        self.mem_b = rng.integers(0, 256, N, dtype=np.uint8)
        self.a = self.t.register(self.mem_a.ctypes.data, N)
        self.b = self.t.register(self.mem_b.ctypes.data, N)
        self.t.authorize_peer("A", SECRET_A, [self.a])
        self.t.authorize_peer("B", SECRET_B, [self.b])
        self.before = (self.mem_a.copy(), self.mem_b.copy())

    def assert_unchanged(self) -> None:
        np.testing.assert_array_equal(self.mem_a, self.before[0])
        np.testing.assert_array_equal(self.mem_b, self.before[1])

    def close(self) -> None:
        self.t.close()


class Writer:
    """A legitimate writer transport that proves ``secret`` to the reader."""

    def __init__(self, reader: Reader, secret: bytes):
        self.t = TcpTransport()
        self.src = np.random.default_rng(12).integers(0, 256, N, dtype=np.uint8)
        self.local = self.t.register(self.src.ctypes.data, N)
        self.t.add_peer("reader", reader.t.agent_descriptor(), secret=secret)

    def write(self, remote, lo, ro, sz):
        return self.t.write(self.local, remote, np.array(lo), np.array(ro), np.array(sz))

    def close(self) -> None:
        self.t.close()


@pytest.fixture
def reader():
    r = Reader()
    yield r
    r.close()


def _probe(reader: Reader, payload: bytes | None) -> tuple[bytes, float]:
    """Connect, read the challenge, send ``payload`` (None: stay silent), then read until
    the reader closes. Returns every byte received and the seconds until the close."""
    start = time.monotonic()
    received = b""
    with socket.create_connection(reader.t.address, timeout=TIMEOUT_S) as sock:
        while len(received) < CHALLENGE.size:
            chunk = sock.recv(CHALLENGE.size - len(received))
            assert chunk, "closed before the challenge"
            received += chunk
        if payload is not None:
            sock.sendall(payload)
        sock.settimeout(HANDSHAKE_S + SLACK_S)
        try:
            while True:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                received += chunk
        except ConnectionResetError:
            pass
        except TimeoutError:
            pytest.fail(f"the reader held a refused connection past {HANDSHAKE_S + SLACK_S} s")
    return received, time.monotonic() - start


def _assert_refused_silently(reader: Reader, received: bytes, elapsed: float) -> None:
    assert elapsed < HANDSHAKE_S + SLACK_S
    magic, version, _ = CHALLENGE.unpack(received[: CHALLENGE.size])
    assert (magic, version) == (MAGIC, WIRE_VERSION)
    assert len(received) == CHALLENGE.size  # nothing after the challenge: no reply, no reason
    assert reader.t._agent.encode() not in received
    reader.assert_unchanged()


def test_garbage_is_closed_without_a_word(reader):
    received, elapsed = _probe(reader, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\x00" * 64)
    _assert_refused_silently(reader, received, elapsed)
    received, elapsed = _probe(reader, b"\x17garbage")  # too short: waits for the deadline
    _assert_refused_silently(reader, received, elapsed)
    assert reader.t.refused_connections == 2
    assert reader.t.peer_failures() == []


def test_hello_with_a_wrong_mac_is_closed_without_a_word(reader):
    bogus = HELLO.pack(MAGIC, WIRE_VERSION, os.urandom(16), os.urandom(32), 7)
    received, elapsed = _probe(reader, bogus)
    _assert_refused_silently(reader, received, elapsed)
    assert reader.t.refused_connections == 1


def test_hello_naming_a_real_key_id_with_a_wrong_mac_is_closed_without_a_word(reader):
    kid = key_id(SECRET_A)  # the key id is public; only the MAC proves the secret
    forged = HELLO.pack(MAGIC, WIRE_VERSION, kid, hello_mac(b"x" * 32, bytes(32), "?", kid, 7), 7)
    received, elapsed = _probe(reader, forged)
    _assert_refused_silently(reader, received, elapsed)
    assert reader.t.refused_connections == 1


def test_silent_connection_is_closed_by_the_handshake_deadline(reader):
    received, elapsed = _probe(reader, None)
    _assert_refused_silently(reader, received, elapsed)
    assert elapsed >= HANDSHAKE_S * 0.9  # it was the deadline that closed it
    assert reader.t.refused_connections == 1


def test_authorized_peer_cannot_write_a_region_granted_to_another(reader):
    writer = Writer(reader, SECRET_A)
    try:
        stolen = writer.t.import_region("reader", reader.b.descriptor)  # B's region, known to A
        ticket = writer.write(stolen, [0], [0], [4096])
        with pytest.raises(TransportError, match=f"region {reader.b.region_id} is not open to this writer"):
            ticket.wait(TIMEOUT_S)
        reader.assert_unchanged()
        own = writer.t.import_region("reader", reader.a.descriptor)  # A still writes its own
        writer.write(own, [0], [100], [64]).wait(TIMEOUT_S)
        np.testing.assert_array_equal(reader.mem_a[100:164], writer.src[:64])
        np.testing.assert_array_equal(reader.mem_b, reader.before[1])
    finally:
        writer.close()


def test_idle_connection_is_closed_and_the_writer_reconnects():
    reader = Reader(idle_timeout_s=0.3)
    writer = Writer(reader, SECRET_A)
    try:
        remote = writer.t.import_region("reader", reader.a.descriptor)
        writer.write(remote, [0], [0], [64]).wait(TIMEOUT_S)
        assert len(reader.t._inbound) == 1
        deadline = time.monotonic() + 0.3 + SLACK_S
        while reader.t._inbound and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not reader.t._inbound, "the idle connection was not closed"
        writer.write(remote, [64], [64], [64]).wait(TIMEOUT_S)  # reconnects
        np.testing.assert_array_equal(reader.mem_a[:128], writer.src[:128])
        assert writer.t.peer_failures() == [] and reader.t.peer_failures() == []
    finally:
        writer.close()
        reader.close()


def test_flood_of_silent_connections_does_not_grow_threads():
    cap = 16
    reader = Reader(max_handshakes=cap)
    before = threading.active_count()
    socks, peak = [], before
    try:
        for _ in range(200):
            socks.append(socket.create_connection(reader.t.address, timeout=TIMEOUT_S))
            peak = max(peak, threading.active_count())
        time.sleep(0.2)
        peak = max(peak, threading.active_count())
        assert peak - before <= cap + 32, f"{peak - before} threads for 200 silent connections"
        deadline = time.monotonic() + HANDSHAKE_S + SLACK_S
        for sock in socks:  # every one is closed by the reader: evicted or past its deadline
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                while sock.recv(4096):
                    pass
            except ConnectionResetError:
                pass
        settled = time.monotonic() + SLACK_S
        while threading.active_count() > before + 2 and time.monotonic() < settled:
            time.sleep(0.05)
        assert threading.active_count() <= before + 2
        assert reader.t.refused_connections == 200
        writer = Writer(reader, SECRET_A)  # the port still serves its writers
        try:
            remote = writer.t.import_region("reader", reader.a.descriptor)
            writer.write(remote, [0], [0], [64]).wait(TIMEOUT_S)
        finally:
            writer.close()
        np.testing.assert_array_equal(reader.mem_b, reader.before[1])
    finally:
        for sock in socks:
            sock.close()
        reader.close()


# -- local: no PR_SET_PTRACER_ANY behind the user's back ----------------------------------


@pytest.fixture
def yama_scope_1(monkeypatch):
    """Pretend Yama ptrace_scope is 1 and record prctl calls instead of making them."""
    calls = []

    def fake_prctl(option, *args):
        calls.append((option, *args))
        return 1 if option == _memory._PR_GET_DUMPABLE else 0

    monkeypatch.setattr(_memory, "_yama_scope", lambda: 1)
    monkeypatch.setattr(_memory, "_prctl", fake_prctl)
    monkeypatch.setattr(_memory, "_ptracer_set", False)
    monkeypatch.delenv(_memory.PTRACE_ANY_ENV, raising=False)
    return calls


def _ptracer_calls(calls):
    return [c for c in calls if c[0] == _memory._PR_SET_PTRACER]


def test_local_private_memory_under_yama_1_is_refused_with_the_fix(yama_scope_1):
    private = np.zeros(4096, np.uint8)
    with LocalTransport() as t:
        with pytest.raises(TransportError) as info:
            t.register(private.ctypes.data, 4096)
        shared = alloc_shared(4096)  # memfd pools need no ptrace at all
        region = t.register(shared.ptr, 4096)
        t.deregister(region)
        shared.close()
    msg = str(info.value)
    assert "private memory" in msg and "PR_SET_PTRACER_ANY" in msg
    assert "alloc_shared()" in msg and "ptrace_scope=0" in msg
    assert "KVXFER_LOCAL_PTRACE_ANY=1" in msg
    assert _ptracer_calls(yama_scope_1) == []


def test_local_ptrace_any_only_when_opted_in_and_logged(yama_scope_1, monkeypatch, caplog):
    monkeypatch.setenv(_memory.PTRACE_ANY_ENV, "1")
    private = np.zeros(4096, np.uint8)
    with caplog.at_level(logging.WARNING, logger="sglang_kvxfer.transports.local"):
        with LocalTransport() as t:
            t.register(private.ctypes.data, 4096)
    assert _ptracer_calls(yama_scope_1) == [(_memory._PR_SET_PTRACER, _memory._PR_SET_PTRACER_ANY, 0, 0, 0)]
    assert any("every process of this user" in r.getMessage() for r in caplog.records)
