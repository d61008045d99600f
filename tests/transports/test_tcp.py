"""The ``tcp`` transport beyond the shared contract: the receiver's own checks (forged
descriptors, raw malformed frames, grants), connection loss, stalls, splitting over
connections. Attacks on the listening port are in tests/faults/test_tcp_port_abuse.py."""

from __future__ import annotations

import secrets
import socket
import threading
import time

import numpy as np
import pytest

from sglang_kvxfer.errors import PeerGoneError, TransferTimeoutError, TransportError
from sglang_kvxfer.transports import TicketState
from sglang_kvxfer.transports._common import pack_descriptor, unpack_descriptor
from sglang_kvxfer.transports.base import Entries
from sglang_kvxfer.transports.tcp import TcpTransport
from sglang_kvxfer.transports.tcp.conn import _recv_exact
from sglang_kvxfer.transports.tcp.transport import _split
from sglang_kvxfer.transports.tcp.wire import (
    ACK,
    CHALLENGE,
    HEADER,
    HELLO,
    HELLO_OK,
    MAGIC,
    T_BYE,
    T_WRITE,
    WIRE_VERSION,
    hello_mac,
    key_id,
)
from tests.transports.transport_peer import wait_until

TIMEOUT_S = 10.0
N = 1 << 20
SECRET, RAW_SECRET = b"s" * 32, b"r" * 32  # what the receiver grants "s" and "raw-test"


@pytest.fixture
def receiver():
    t = TcpTransport()
    mem = np.random.default_rng(1).integers(0, 256, N, dtype=np.uint8)
    region = t.register(mem.ctypes.data, N)
    t.authorize_peer("s", SECRET, [region])
    t.authorize_peer("raw-test", RAW_SECRET, [region])
    yield t, mem, region
    t.close()


@pytest.fixture
def sender():
    t = TcpTransport()
    src = np.random.default_rng(2).integers(0, 256, N, dtype=np.uint8)
    region = t.register(src.ctypes.data, N)
    yield t, src, region
    t.close()


def _forge(descriptor: bytes, what: str, **changes) -> bytes:
    desc = unpack_descriptor(descriptor, "tcp", what, {})
    desc.update(changes)
    return pack_descriptor("tcp", what, **{k: v for k, v in desc.items() if k not in ("transport", "what", "version")})


def test_receiver_refuses_a_write_past_its_region_and_keeps_serving(receiver, sender):
    rt, mem, rregion = receiver
    st, src, sregion = sender
    before = mem.copy()
    st.add_peer("r", rt.agent_descriptor(), secret=SECRET)
    inflated = st.import_region("r", _forge(rregion.descriptor, "region", nbytes=4 * N))
    ticket = st.write(sregion, inflated, np.array([0]), np.array([N - 10]), np.array([100]))
    with pytest.raises(
        TransportError,
        match=f"refused the write: entry 0: offset {N - 10} \\+ "
        f"size 100 = {N + 90} exceeds region "
        f"{rregion.region_id} of {N} bytes",
    ):
        ticket.wait(TIMEOUT_S)
    np.testing.assert_array_equal(mem, before)
    st.write(sregion, inflated, np.array([5]), np.array([0]), np.array([64])).wait(TIMEOUT_S)
    np.testing.assert_array_equal(mem[:64], src[5:69])
    assert st.peer_failures() == []  # a refusal is not a peer failure


def test_write_to_a_deregistered_region_is_refused_by_the_receiver(receiver, sender):
    rt, mem, rregion = receiver
    st, _, sregion = sender
    st.add_peer("r", rt.agent_descriptor(), secret=SECRET)
    remote = st.import_region("r", rregion.descriptor)
    rt.deregister(rregion)
    before = mem.copy()
    ticket = st.write(sregion, remote, np.array([0]), np.array([0]), np.array([64]))
    with pytest.raises(TransportError, match=f"region {rregion.region_id} is not open to this writer"):
        ticket.wait(TIMEOUT_S)
    np.testing.assert_array_equal(mem, before)


def _raw_connect(t: TcpTransport, secret: bytes = RAW_SECRET, conn_id: int | None = None) -> socket.socket:
    """A raw connection past the handshake, as the writer granted ``secret``, naming itself
    ``conn_id`` (default: a fresh random id, as a writer does)."""
    conn_id = secrets.randbits(63) + 1 if conn_id is None else conn_id
    sock = socket.create_connection(t.address, timeout=TIMEOUT_S)
    magic, version, nonce = CHALLENGE.unpack(_recv_exact(sock, CHALLENGE.size))
    assert (magic, version) == (MAGIC, WIRE_VERSION)
    kid = key_id(secret)
    sock.sendall(HELLO.pack(MAGIC, WIRE_VERSION, kid, hello_mac(secret, nonce, t._agent, kid, conn_id), conn_id))
    assert HELLO_OK.unpack(_recv_exact(sock, HELLO_OK.size)) == (MAGIC, WIRE_VERSION)
    return sock


def _read_ack(sock) -> tuple[int, int, str]:
    _, status, n, xfer_id = ACK.unpack(_recv_exact(sock, ACK.size))
    return status, xfer_id, _recv_exact(sock, n).decode()


def _closed_by_peer(sock) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:  # closed with our unread bytes in its buffer
        return True


def _write_frame(sock, xfer_id, region_id, pairs, payload: bytes, total=None):
    table = np.array(pairs, dtype="<u8").reshape(-1, 2)
    total = len(payload) if total is None else total
    sock.sendall(HEADER.pack(T_WRITE, len(table), xfer_id, region_id, total) + table.tobytes() + payload)


def test_raw_out_of_range_frame_is_acked_as_refused_and_not_performed(receiver):
    rt, mem, rregion = receiver
    before = mem.copy()
    with _raw_connect(rt) as sock:
        # entry 1 runs past the end: the whole frame is refused, entry 0 is not performed
        _write_frame(sock, 41, rregion.region_id, [(0, 4), (N - 2, 4)], b"\xaa" * 8)
        assert _read_ack(sock) == (
            1,
            41,
            f"entry 1: offset {N - 2} + size 4 = {N + 2} exceeds region {rregion.region_id} of {N} bytes",
        )
        _write_frame(sock, 42, 999, [(0, 4)], b"\xbb" * 4)
        status, xfer_id, reason = _read_ack(sock)
        assert (status, xfer_id) == (1, 42) and "region 999 is not open to this writer" in reason
        np.testing.assert_array_equal(mem, before)
        _write_frame(sock, 43, rregion.region_id, [(100, 3), (7, 2)], b"xyzuv")
        assert _read_ack(sock) == (0, 43, "")
        assert mem[100:103].tobytes() == b"xyz" and mem[7:9].tobytes() == b"uv"


def test_raw_frame_whose_sizes_do_not_add_up_closes_the_connection(receiver):
    rt, _, rregion = receiver
    with _raw_connect(rt) as sock:
        _write_frame(sock, 1, rregion.region_id, [(0, 4)], b"", total=9)
        assert _closed_by_peer(sock)
    failures = []
    assert wait_until(lambda: failures.extend(rt.peer_failures()) or failures, TIMEOUT_S)
    assert failures[0].peer_id == "raw-test" and "do not add up to 9 bytes" in failures[0].reason


def test_bad_magic_is_dropped_and_the_listener_keeps_serving(receiver, sender):
    rt, mem, rregion = receiver
    with socket.create_connection(rt.address, timeout=TIMEOUT_S) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"x" * (HELLO.size - 18))
        _recv_exact(sock, CHALLENGE.size)
        assert _closed_by_peer(sock)
    st, src, sregion = sender
    st.add_peer("r", rt.agent_descriptor(), secret=SECRET)
    remote = st.import_region("r", rregion.descriptor)
    st.write(sregion, remote, np.array([0]), np.array([0]), np.array([32])).wait(TIMEOUT_S)
    np.testing.assert_array_equal(mem[:32], src[:32])
    assert rt.refused_connections == 1
    assert rt.peer_failures() == []  # a refused stranger is not a peer failure


def test_writer_with_a_wrong_secret_is_refused_and_told_why_locally(receiver, sender):
    rt, mem, rregion = receiver
    st, _, sregion = sender
    before = mem.copy()
    st.add_peer("r", rt.agent_descriptor(), secret=b"w" * 32)
    remote = st.import_region("r", rregion.descriptor)
    ticket = st.write(sregion, remote, np.array([0]), np.array([0]), np.array([64]))
    with pytest.raises(
        PeerGoneError, match="closed the connection at the handshake: it has no grant for this writer's secret"
    ):
        ticket.wait(TIMEOUT_S)
    assert wait_until(lambda: rt.refused_connections == 1, TIMEOUT_S)
    np.testing.assert_array_equal(mem, before)


def test_add_peer_needs_a_secret_of_32_bytes(sender):
    st, _, _ = sender
    with TcpTransport() as rt:
        with pytest.raises(ValueError, match="add_peer\\('r'\\) needs secret="):
            st.add_peer("r", rt.agent_descriptor())
        with pytest.raises(ValueError, match="secret must be 32 bytes, got 5"):
            st.add_peer("r", rt.agent_descriptor(), secret=b"short")
        with pytest.raises(TypeError, match="secret must be 32 bytes, got str"):
            st.add_peer("r", rt.agent_descriptor(), secret="x" * 32)


def test_authorize_peer_checks_its_arguments(receiver):
    rt, mem, rregion = receiver
    with pytest.raises(ValueError, match="already granted to peer 's'; each writer needs"):
        rt.authorize_peer("other", SECRET, [rregion])
    with pytest.raises(ValueError, match="region 77 is not registered here"):
        from sglang_kvxfer.transports.base import Region

        rt.authorize_peer("other", b"o" * 32, [Region(77, mem.ctypes.data, 8, "cpu", b"")])
    with pytest.raises(TypeError, match="regions must hold Region objects, got int"):
        rt.authorize_peer("other", b"o" * 32, [rregion.region_id])
    rt.authorize_peer("s", SECRET, [rregion])  # the same grant again: replaced, no error
    rt.revoke_peer("nobody")  # unknown: no error


def test_revoke_peer_closes_its_connections_and_refuses_reconnects(receiver, sender):
    rt, mem, rregion = receiver
    st, src, sregion = sender
    st.add_peer("r", rt.agent_descriptor(), secret=SECRET)
    remote = st.import_region("r", rregion.descriptor)
    st.write(sregion, remote, np.array([0]), np.array([0]), np.array([64])).wait(TIMEOUT_S)
    rt.revoke_peer("s")
    assert wait_until(lambda: not rt._inbound, TIMEOUT_S)
    before = mem.copy()
    st.remove_peer("r")
    st.add_peer("r", rt.agent_descriptor(), secret=SECRET)
    remote = st.import_region("r", rregion.descriptor)
    with pytest.raises(PeerGoneError, match="no grant for this writer's secret"):
        st.write(sregion, remote, np.array([0]), np.array([0]), np.array([64])).wait(TIMEOUT_S)
    np.testing.assert_array_equal(mem, before)
    assert rt.peer_failures() == []  # closing a revoked peer is not a failure of it


def test_secret_changed_by_authorize_peer_cuts_old_connections(receiver):
    rt, _, rregion = receiver
    with _raw_connect(rt) as sock:
        rt.authorize_peer("raw-test", b"n" * 32, [rregion])
        assert _closed_by_peer(sock)
    with _raw_connect(rt, b"n" * 32) as sock:  # the new secret works
        _write_frame(sock, 5, rregion.region_id, [(0, 2)], b"ok")
        assert _read_ack(sock) == (0, 5, "")


def test_idle_connection_gets_bye_and_the_writer_reconnects():
    mem, src = np.zeros(N, np.uint8), np.random.default_rng(3).integers(0, 256, N, np.uint8)
    with TcpTransport(idle_timeout_s=0.3) as rt, TcpTransport() as st:
        rregion = rt.register(mem.ctypes.data, N)
        rt.authorize_peer("s", SECRET, [rregion])
        rt.authorize_peer("raw-test", RAW_SECRET, [rregion])
        sregion = st.register(src.ctypes.data, N)
        st.add_peer("r", rt.agent_descriptor(), secret=SECRET)
        remote = st.import_region("r", rregion.descriptor)
        st.write(sregion, remote, np.array([0]), np.array([0]), np.array([64])).wait(TIMEOUT_S)
        with _raw_connect(rt) as sock:  # a raw writer sees the BYE frame itself
            assert ACK.unpack(_recv_exact(sock, ACK.size)) == (T_BYE, 0, 0, 0)
        assert wait_until(lambda: not rt._inbound, TIMEOUT_S)  # both closed
        st.write(sregion, remote, np.array([64]), np.array([64]), np.array([64])).wait(TIMEOUT_S)
        np.testing.assert_array_equal(mem[:128], src[:128])
        assert st.peer_failures() == [] and rt.peer_failures() == []


class _StallingReceiver:
    """Accepts one tcp connection, answers HELLO, then never reads again."""

    def __init__(self):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.conns = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            sock, _ = self.server.accept()
        except OSError:
            return
        self.conns.append(sock)
        sock.sendall(CHALLENGE.pack(MAGIC, WIRE_VERSION, bytes(32)))
        _recv_exact(sock, HELLO.size)
        sock.sendall(HELLO_OK.pack(MAGIC, WIRE_VERSION))

    def descriptor(self) -> bytes:
        return pack_descriptor("tcp", "agent", agent="staller", host="127.0.0.1", port=self.server.getsockname()[1])

    def close(self):
        self.server.close()
        for c in self.conns:
            c.close()


def _big_batch():
    offsets = np.arange(16, dtype=np.int64) * (N // 16)
    return offsets, offsets, np.full(16, N // 16)


def test_stalled_peer_fails_the_connection_after_io_timeout(sender):
    staller = _StallingReceiver()
    st = TcpTransport(io_timeout_s=0.3)
    src = np.zeros(N, np.uint8)
    try:
        region = st.register(src.ctypes.data, N)
        st.add_peer("s", staller.descriptor(), secret=SECRET)
        remote = st.import_region(
            "s", pack_descriptor("tcp", "region", agent="staller", region=1, nbytes=N, device="cpu")
        )
        tickets = [st.write(region, remote, *_big_batch()) for _ in range(16)]  # > socket buffers
        with pytest.raises(
            PeerGoneError, match="connection 0 to peer 's' at 127.0.0.1:.* lost: (timed out|no progress)"
        ):
            tickets[-1].wait(TIMEOUT_S)
        assert all(t.poll() is TicketState.FAILED for t in tickets)
        assert [f.peer_id for f in st.peer_failures()] == ["s"]
    finally:
        st.close()
        staller.close()


def test_close_fails_pending_tickets_in_bounded_time():
    staller = _StallingReceiver()
    st = TcpTransport(close_timeout_s=0.5)
    src = np.zeros(N, np.uint8)
    try:
        region = st.register(src.ctypes.data, N)
        st.add_peer("s", staller.descriptor(), secret=SECRET)
        remote = st.import_region(
            "s", pack_descriptor("tcp", "region", agent="staller", region=1, nbytes=N, device="cpu")
        )
        tickets = [st.write(region, remote, *_big_batch()) for _ in range(16)]
        with pytest.raises(TransferTimeoutError):
            tickets[0].wait(0.1)
        start = time.monotonic()
        st.close()
        assert time.monotonic() - start < 5
        with pytest.raises(TransportError, match="closed with the write pending"):
            tickets[-1].wait(TIMEOUT_S)
        assert st.peer_failures() == []  # closing is not a peer failure
    finally:
        st.close()
        staller.close()


def test_unreachable_peer_fails_the_ticket_and_is_reported(sender):
    st, _, sregion = sender
    dead = socket.create_server(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there now
    st.add_peer("gone", pack_descriptor("tcp", "agent", agent="x", host="127.0.0.1", port=port), secret=SECRET)
    remote = st.import_region("gone", pack_descriptor("tcp", "region", agent="x", region=1, nbytes=N, device="cpu"))
    ticket = st.write(sregion, remote, np.array([0]), np.array([0]), np.array([8]))
    with pytest.raises(PeerGoneError, match=f"peer 'gone' at 127.0.0.1:{port} lost: .*refused"):
        ticket.wait(TIMEOUT_S)
    assert [f.peer_id for f in st.peer_failures()] == ["gone"]
    again = st.write(sregion, remote, np.array([0]), np.array([0]), np.array([8]))
    assert again.poll() is TicketState.FAILED and "refused" in again.reason  # sticky


def test_batch_is_split_over_connections_and_lands(receiver):
    rt, mem, rregion = receiver
    st = TcpTransport(num_connections=3, split_min_bytes=64 << 10)
    src = np.random.default_rng(5).integers(0, 256, N, dtype=np.uint8)
    try:
        region = st.register(src.ctypes.data, N)
        st.add_peer("r", rt.agent_descriptor(), secret=SECRET)
        remote = st.import_region("r", rregion.descriptor)
        st.write(region, remote, np.array([0]), np.array([0]), np.array([N])).wait(TIMEOUT_S)
        np.testing.assert_array_equal(mem, src)
        assert len(rt._inbound) == 3  # one 1 MiB entry went over all three connections
        st.remove_peer("r")  # graceful: BYE on each connection
        assert wait_until(lambda: not rt._inbound, TIMEOUT_S)
        assert rt.peer_failures() == []
    finally:
        st.close()


def test_deregister_during_a_torn_frame_stops_the_receive():
    mem = np.zeros(N, np.uint8)
    with TcpTransport(close_timeout_s=0.2) as rt, _raw_connect_later() as connect:
        rregion = rt.register(mem.ctypes.data, N)
        rt.authorize_peer("raw-test", RAW_SECRET, [rregion])
        sock = connect(rt)
        sock.sendall(
            HEADER.pack(T_WRITE, 1, 1, rregion.region_id, 4096) + np.array([[0, 4096]], "<u8").tobytes() + b"\x01" * 100
        )
        assert wait_until(lambda: any(c.region_id == rregion.region_id for c in rt._inbound), TIMEOUT_S)
        start = time.monotonic()
        rt.deregister(rregion)  # the receive into the region is cut off, then it returns
        assert time.monotonic() - start < 5
        assert _closed_by_peer(sock)


class _raw_connect_later:
    """Context manager handing out raw connections and closing them at exit."""

    def __enter__(self):
        self.socks = []
        return lambda t: self.socks.append(_raw_connect(t)) or self.socks[-1]

    def __exit__(self, *exc_info):
        for s in self.socks:
            s.close()


def test_share_with_more_entries_than_a_frame_holds_goes_as_several_frames(receiver, sender, monkeypatch):
    from sglang_kvxfer.transports.tcp import transport as tcp

    monkeypatch.setattr(tcp, "_FRAME_ENTRIES", 7)
    rt, mem, rregion = receiver
    st, src, sregion = sender
    st.add_peer("r", rt.agent_descriptor(), secret=SECRET)
    remote = st.import_region("r", rregion.descriptor)
    ro = np.arange(50, dtype=np.int64) * 100  # 50 entries that cannot be merged: 8 frames
    lo = ro[::-1].copy()
    before = next(st._xfer_ids)
    ticket = st.write(sregion, remote, lo, ro, np.full(50, 64))
    assert next(st._xfer_ids) - before - 1 == 8  # frames posted
    ticket.wait(TIMEOUT_S)
    for l, r in zip(lo, ro):
        np.testing.assert_array_equal(mem[r : r + 64], src[l : l + 64])


@pytest.mark.parametrize("shares", [2, 3, 7])
def test_split_covers_the_batch_in_order_with_even_shares(shares):
    rng = np.random.default_rng(shares)
    sz = rng.integers(1, 5000, 40)
    e = Entries(rng.integers(0, 10**6, 40), np.cumsum(sz) - sz + 17, sz)
    parts = _split(e, shares)
    assert len(parts) == shares
    joined = [np.concatenate([getattr(p, f) for p in parts]) for f in ("local_offsets", "remote_offsets", "sizes")]

    # the pieces, in order, cover exactly the original bytes (local and remote alike)
    def expand(offs, sizes):
        return np.concatenate([np.arange(o, o + s) for o, s in zip(offs, sizes)])

    np.testing.assert_array_equal(expand(joined[0], joined[2]), expand(e.local_offsets, e.sizes))
    np.testing.assert_array_equal(expand(joined[1], joined[2]), expand(e.remote_offsets, e.sizes))
    total = e.total_bytes
    assert all(abs(p.total_bytes - total / shares) <= 1 for p in parts)


def test_constructor_and_register_checks():
    with pytest.raises(ValueError, match="host='0.0.0.0' cannot be advertised"):
        TcpTransport(host="0.0.0.0")
    with pytest.raises(ValueError, match=r"num_connections must be an int in \[1, 64\], got 0"):
        TcpTransport(num_connections=0)
    with pytest.raises(ValueError, match="io_timeout_s must be > 0, got -1"):
        TcpTransport(io_timeout_s=-1)
    with pytest.raises(ValueError, match="handshake_timeout_s must be > 0, got 0"):
        TcpTransport(handshake_timeout_s=0)
    with pytest.raises(ValueError, match="idle_timeout_s must be > 0, got -2"):
        TcpTransport(idle_timeout_s=-2)
    with pytest.raises(ValueError, match="max_handshakes must be an int >= 1, got 0"):
        TcpTransport(max_handshakes=0)
    with pytest.raises(ValueError, match=r"bounce_bytes must be an int in \[4096, 2\*\*30\], got 100"):
        TcpTransport(bounce_bytes=100)
    with TcpTransport() as t:
        # no CUDA here: refused as such; on a GPU machine 0x1000 is no device memory
        with pytest.raises(TransportError, match=r"not usable here|cannot register 64 bytes of cuda:0 at 0x1000"):
            t.register(0x1000, 64, "cuda:0")
        with pytest.raises(ValueError, match="region 5 is not registered here"):
            from sglang_kvxfer.transports.base import Region

            t.deregister(Region(5, 0x1000, 64, "cpu", b""))


def test_small_writes_to_an_idle_connection_go_from_the_callers_thread_and_the_stream_stays_whole(
    receiver, monkeypatch
):
    from sglang_kvxfer.transports.tcp.conn import _Conn
    from sglang_kvxfer.transports.tcp.transport import INLINE_SEND_BYTES

    rt, mem, rregion = receiver
    senders = []
    real = _Conn.send_claimed

    def spy(self, job):
        senders.append(threading.current_thread())
        real(self, job)

    monkeypatch.setattr(_Conn, "send_claimed", spy)
    st = TcpTransport()
    src = np.random.default_rng(7).integers(0, 256, N, dtype=np.uint8)
    try:
        region = st.register(src.ctypes.data, N)
        st.add_peer("s", rt.agent_descriptor(), secret=SECRET)
        remote = st.import_region("s", rregion.descriptor)
        st.write(region, remote, np.array([0]), np.array([0]), np.array([64])).wait(TIMEOUT_S)  # connects
        assert senders == []  # the first write went to the sender thread, which connected
        st.write(region, remote, np.array([64]), np.array([64]), np.array([4096])).wait(TIMEOUT_S)
        assert senders == [threading.current_thread()]  # idle and connected: sent right here
        written = np.zeros(N, bool)
        written[: 64 + 4096] = True
        lock = threading.Lock()

        def writer(seed, small):  # small ones one at a time (inline when idle), large ones queued
            rng = np.random.default_rng(seed)
            tickets = []
            for _ in range(40 if small else 10):
                size = int(rng.integers(1, 4096)) if small else int(rng.integers(INLINE_SEND_BYTES + 1, N // 2))
                off = int(rng.integers(0, N - size))
                with lock:
                    written[off : off + size] = True
                tickets.append(st.write(region, remote, np.array([off]), np.array([off]), np.array([size])))
                if small:
                    tickets[-1].wait(TIMEOUT_S)
            for t in tickets:
                t.wait(TIMEOUT_S)

        threads = [threading.Thread(target=writer, args=(s, s % 2 == 0)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S * 3)
        np.testing.assert_array_equal(mem[written], src[written])
        assert rt.peer_failures() == [] and st.peer_failures() == []
    finally:
        st.close()


@pytest.mark.parametrize("vectored", [True, False], ids=["writev-readv", "sendmsg-recvmsg"])
def test_many_small_scattered_entries_land_byte_exact_through_either_path(receiver, sender, monkeypatch, vectored):
    """A frame of thousands of small, scattered entries (a strided head slice's rows), with a
    few large ones among them so that calls return partway: over ``writev``/``readv`` (one
    iovec per entry, ``iov.py``), or, where libc's cannot be loaded, ``sendmsg``/
    ``recvmsg_into``. Every entry lands where it was sent, nothing else changes."""
    from sglang_kvxfer.transports.tcp import conn, iov

    if not vectored:
        monkeypatch.setattr(iov, "_calls", ())
    elif not iov.available():
        pytest.fail("libc's writev/readv could not be loaded on this machine")
    calls = {"send": 0, "recv": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(conn, "send_iov", counted("send", conn.send_iov))
    monkeypatch.setattr(conn, "recv_iov", counted("recv", conn.recv_iov))
    rt, mem, rregion = receiver
    st, src, sregion = sender
    st.add_peer("r", rt.agent_descriptor(), secret=SECRET)
    remote = st.import_region("r", rregion.descriptor)
    rng = np.random.default_rng(11)
    sizes = rng.integers(1, 200, 3000)
    sizes[[10, 1500, 2990]] = [150_000, 200_000, 120_000]  # beyond a socket buffer each
    ro = np.concatenate([[0], np.cumsum(sizes + 17)[:-1]])  # gaps of 17 B stay as they were
    perm = rng.permutation(len(sizes))  # source runs disjoint, in another order than the targets
    lo = np.empty_like(sizes)
    lo[perm] = np.concatenate([[0], np.cumsum(sizes[perm])[:-1]])
    assert int(ro[-1] + sizes[-1]) <= N and int(lo.max() + sizes.max()) <= N
    before = mem.copy()
    st.write(sregion, remote, lo, ro, sizes).wait(TIMEOUT_S)
    expect = before.copy()
    for l, r, n in zip(lo.tolist(), ro.tolist(), sizes.tolist()):
        expect[r : r + n] = src[l : l + n]
    np.testing.assert_array_equal(mem, expect)
    assert calls == ({"send": 1, "recv": 1} if vectored else {"send": 0, "recv": 0}), calls


# -- landing receipts --------------------------------------------------------------------


@pytest.mark.parametrize("nbytes, connections", [(4096, 1), (N, 3)], ids=["one frame", "split over 3 connections"])
def test_receipts_say_landed_once_the_bytes_are_in_the_readers_memory(receiver, nbytes, connections):
    rt, mem, rregion = receiver
    st = TcpTransport(num_connections=connections, split_min_bytes=4096)
    src = np.random.default_rng(5).integers(0, 256, N, dtype=np.uint8)
    sregion = st.register(src.ctypes.data, N)
    try:
        assert st.caps.receipts and rt.caps.receipts
        st.add_peer("r", rt.agent_descriptor(), secret=SECRET)
        remote = st.import_region("r", rregion.descriptor)
        ticket = st.write(sregion, remote, np.array([0]), np.array([0]), np.array([nbytes]))
        assert ticket.receipts is not None and len(ticket.receipts) == (1 if nbytes < N else connections)
        assert len({cid for cid, _ in ticket.receipts}) == len(ticket.receipts)  # one frame per connection
        rt.wait_landed("s", ticket.receipts, TIMEOUT_S)  # before the writer's ticket is looked at
        np.testing.assert_array_equal(mem[:nbytes], src[:nbytes])
        assert rt.landed("s", ticket.receipts)
        ticket.wait(TIMEOUT_S)
        second = st.write(sregion, remote, np.array([0]), np.array([0]), np.array([64]))
        assert second.receipts is not None
        assert {s for _, s in second.receipts} == {2}  # the next frame on its connection
        rt.wait_landed("s", second.receipts, TIMEOUT_S)
    finally:
        st.close()


def test_a_receipt_is_pending_until_its_frame_is_read_whole(receiver):
    rt, mem, rregion = receiver
    cid = 0xC0FFEE
    assert not rt.landed("raw-test", [(cid, 1)])  # not connected yet: may still come
    with _raw_connect(rt, conn_id=cid) as sock:
        table = np.array([(0, 8)], dtype="<u8")
        sock.sendall(HEADER.pack(T_WRITE, 1, 7, rregion.region_id, 8) + table.tobytes() + b"half")
        time.sleep(0.2)
        assert not rt.landed("raw-test", [(cid, 1)])
        with pytest.raises(TransferTimeoutError, match="not landed after 0.1 s"):
            rt.wait_landed("raw-test", [(cid, 1)], 0.1)
        sock.sendall(b"HALF")
        rt.wait_landed("raw-test", [(cid, 1)], TIMEOUT_S)
        assert mem[:8].tobytes() == b"halfHALF"
        assert not rt.landed("raw-test", [(cid, 1), (cid, 2)])  # frame 2 was never sent
        assert _read_ack(sock) == (0, 7, "")


def test_a_refused_frame_fails_its_receipt_with_the_reason(receiver):
    rt, _, rregion = receiver
    cid = 0xBAD
    with _raw_connect(rt, conn_id=cid) as sock:
        _write_frame(sock, 1, 999, [(0, 4)], b"\xbb" * 4)  # not a region of this writer
        _write_frame(sock, 2, rregion.region_id, [(0, 4)], b"good")
        assert _read_ack(sock)[0] == 1 and _read_ack(sock)[0] == 0
        with pytest.raises(TransportError, match="frame 1 of peer 'raw-test' was refused here: region 999 is not open"):
            rt.landed("raw-test", [(cid, 1), (cid, 2)])
        assert rt.landed("raw-test", [(cid, 2)])  # the frame after it landed


def test_a_receipt_past_the_end_of_a_closed_connection_fails(receiver):
    rt, _, rregion = receiver
    cid = 0x1057
    with _raw_connect(rt, conn_id=cid) as sock:
        _write_frame(sock, 1, rregion.region_id, [(0, 4)], b"good")
        assert _read_ack(sock) == (0, 1, "")
        table = np.array([(0, 8)], dtype="<u8")
        sock.sendall(HEADER.pack(T_WRITE, 1, 2, rregion.region_id, 8) + table.tobytes() + b"torn")
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="ended after 1 frame\\(s\\), before frame 2: connection closed"):
        rt.wait_landed("raw-test", [(cid, 2)], TIMEOUT_S)
    assert time.monotonic() - t0 < TIMEOUT_S / 2  # the end wakes the waiter, not the deadline
    assert rt.landed("raw-test", [(cid, 1)])  # an ended connection still answers for what landed


def test_a_receipt_naming_another_writers_connection_is_refused(receiver, sender):
    rt, _, rregion = receiver
    st, _, sregion = sender
    st.add_peer("r", rt.agent_descriptor(), secret=SECRET)
    remote = st.import_region("r", rregion.descriptor)
    ticket = st.write(sregion, remote, np.array([0]), np.array([0]), np.array([64]))
    ticket.wait(TIMEOUT_S)
    assert ticket.receipts is not None
    with pytest.raises(TransportError, match="names connection .* which is another writer's"):
        rt.landed("raw-test", ticket.receipts)


def test_a_second_connection_naming_a_taken_id_is_refused(receiver):
    rt, _, _ = receiver
    with _raw_connect(rt, conn_id=0xD0D0):
        sock = socket.create_connection(rt.address, timeout=TIMEOUT_S)
        with sock:
            _, _, nonce = CHALLENGE.unpack(_recv_exact(sock, CHALLENGE.size))
            kid = key_id(RAW_SECRET)
            sock.sendall(
                HELLO.pack(MAGIC, WIRE_VERSION, kid, hello_mac(RAW_SECRET, nonce, rt._agent, kid, 0xD0D0), 0xD0D0)
            )
            assert _closed_by_peer(sock)
    assert rt.refused_connections == 1


def test_a_reader_that_closes_says_bye_and_its_writers_count_no_lost_peer(caplog):
    """An orderly close of the reader's transport tells every connected writer BYE: the
    writer sends what it queued, says BYE and retires the connection, so neither side
    records a lost peer or logs one. A write after that finds the reader gone and fails
    naming it. (A reader that dies says nothing: see the connection-loss tests.)"""
    mem, src = np.zeros(N, np.uint8), np.random.default_rng(5).integers(0, 256, N, np.uint8)
    with TcpTransport(num_connections=2, split_min_bytes=N // 4) as st:
        sregion = st.register(src.ctypes.data, N)
        rt = TcpTransport()
        rregion = rt.register(mem.ctypes.data, N)
        rt.authorize_peer("s", SECRET, [rregion])
        st.add_peer("r", rt.agent_descriptor(), secret=SECRET)
        remote = st.import_region("r", rregion.descriptor)
        offsets = np.arange(4, dtype=np.int64) * (N // 4)
        st.write(sregion, remote, offsets, offsets, np.full(4, N // 4)).wait(TIMEOUT_S)  # over two connections
        np.testing.assert_array_equal(mem, src)
        conns = list(st._peers["r"].conns)
        assert sum(c.connected for c in conns) == 2
        with caplog.at_level("WARNING", logger="sglang_kvxfer"):
            rt.close()
            assert wait_until(lambda: all(c.dead is not None for c in conns if c.connected), TIMEOUT_S)
        assert [c.dead for c in conns if c.connected] == ["retired after the reader's BYE"] * 2
        assert st.peer_failures() == [] and rt.peer_failures() == []
        assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
        late = st.write(sregion, remote, np.array([0]), np.array([0]), np.array([64]))
        with pytest.raises((PeerGoneError, TransportError)):
            late.wait(TIMEOUT_S)
