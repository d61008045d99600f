"""The ``tcp`` transport beyond the shared contract: the receiver's own checks (forged
descriptors, raw malformed frames), connection loss, stalls, splitting over connections."""
from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from sglang_kvxfer.errors import PeerGoneError, TransferTimeoutError, TransportError
from sglang_kvxfer.transports import TicketState
from sglang_kvxfer.transports._common import pack_descriptor, unpack_descriptor
from sglang_kvxfer.transports.base import Entries
from sglang_kvxfer.transports._tcp_conn import (ACK, HEADER, HELLO, HELLO_REPLY, MAGIC,
                                                T_WRITE, WIRE_VERSION, _recv_exact)
from sglang_kvxfer.transports.tcp import TcpTransport, _split
from transport_peer import wait_until

TIMEOUT_S = 10.0
N = 1 << 20


@pytest.fixture
def receiver():
    t = TcpTransport()
    mem = np.random.default_rng(1).integers(0, 256, N, dtype=np.uint8)
    region = t.register(mem.ctypes.data, N)
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
    return pack_descriptor("tcp", what, **{k: v for k, v in desc.items()
                                           if k not in ("transport", "what", "version")})


def test_receiver_refuses_a_write_past_its_region_and_keeps_serving(receiver, sender):
    rt, mem, rregion = receiver
    st, src, sregion = sender
    before = mem.copy()
    st.add_peer("r", rt.agent_descriptor())
    inflated = st.import_region("r", _forge(rregion.descriptor, "region", nbytes=4 * N))
    ticket = st.write(sregion, inflated, np.array([0]), np.array([N - 10]), np.array([100]))
    with pytest.raises(TransportError, match=f"refused the write: entry 0: offset {N - 10} \\+ "
                                             f"size 100 = {N + 90} exceeds region "
                                             f"{rregion.region_id} of {N} bytes"):
        ticket.wait(TIMEOUT_S)
    np.testing.assert_array_equal(mem, before)
    st.write(sregion, inflated, np.array([5]), np.array([0]), np.array([64])).wait(TIMEOUT_S)
    np.testing.assert_array_equal(mem[:64], src[5:69])
    assert st.peer_failures() == []  # a refusal is not a peer failure


def test_write_to_a_deregistered_region_is_refused_by_the_receiver(receiver, sender):
    rt, mem, rregion = receiver
    st, _, sregion = sender
    st.add_peer("r", rt.agent_descriptor())
    remote = st.import_region("r", rregion.descriptor)
    rt.deregister(rregion)
    before = mem.copy()
    ticket = st.write(sregion, remote, np.array([0]), np.array([0]), np.array([64]))
    with pytest.raises(TransportError, match=f"unknown region {rregion.region_id} \\(not "
                                             "registered with agent"):
        ticket.wait(TIMEOUT_S)
    np.testing.assert_array_equal(mem, before)


def _raw_connect(t: TcpTransport, agent: str | None = None) -> socket.socket:
    sock = socket.create_connection(t.address, timeout=TIMEOUT_S)
    me, them = b"raw-test", (agent or t._agent).encode()
    sock.sendall(HELLO.pack(MAGIC, WIRE_VERSION, len(me), len(them)) + me + them)
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
    sock.sendall(HEADER.pack(T_WRITE, len(table), xfer_id, region_id, total) + table.tobytes()
                 + payload)


def test_raw_out_of_range_frame_is_acked_as_refused_and_not_performed(receiver):
    rt, mem, rregion = receiver
    before = mem.copy()
    with _raw_connect(rt) as sock:
        assert HELLO_REPLY.unpack(_recv_exact(sock, HELLO_REPLY.size))[2] == 0
        # entry 1 runs past the end: the whole frame is refused, entry 0 is not performed
        _write_frame(sock, 41, rregion.region_id, [(0, 4), (N - 2, 4)], b"\xaa" * 8)
        assert _read_ack(sock) == (1, 41, f"entry 1: offset {N - 2} + size 4 = {N + 2} exceeds "
                                          f"region {rregion.region_id} of {N} bytes")
        _write_frame(sock, 42, 999, [(0, 4)], b"\xbb" * 4)
        status, xfer_id, reason = _read_ack(sock)
        assert (status, xfer_id) == (1, 42) and "unknown region 999" in reason
        np.testing.assert_array_equal(mem, before)
        _write_frame(sock, 43, rregion.region_id, [(100, 3), (7, 2)], b"xyzuv")
        assert _read_ack(sock) == (0, 43, "")
        assert mem[100:103].tobytes() == b"xyz" and mem[7:9].tobytes() == b"uv"


def test_raw_frame_whose_sizes_do_not_add_up_closes_the_connection(receiver):
    rt, _, rregion = receiver
    with _raw_connect(rt) as sock:
        _recv_exact(sock, HELLO_REPLY.size)
        _write_frame(sock, 1, rregion.region_id, [(0, 4)], b"", total=9)
        assert _closed_by_peer(sock)
    failures = []
    assert wait_until(lambda: failures.extend(rt.peer_failures()) or failures, TIMEOUT_S)
    assert failures[0].peer_id == "raw-test" and "do not add up to 9 bytes" in failures[0].reason


def test_bad_magic_is_dropped_and_the_listener_keeps_serving(receiver, sender):
    rt, mem, rregion = receiver
    with socket.create_connection(rt.address, timeout=TIMEOUT_S) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert _closed_by_peer(sock)
    st, src, sregion = sender
    st.add_peer("r", rt.agent_descriptor())
    remote = st.import_region("r", rregion.descriptor)
    st.write(sregion, remote, np.array([0]), np.array([0]), np.array([32])).wait(TIMEOUT_S)
    np.testing.assert_array_equal(mem[:32], src[:32])
    assert any("bad HELLO" in f.reason for f in rt.peer_failures())


def test_hello_for_another_agent_is_refused_with_a_reason(receiver):
    rt, _, _ = receiver
    with _raw_connect(rt, agent="someone-else") as sock:
        magic, _, status, n = HELLO_REPLY.unpack(_recv_exact(sock, HELLO_REPLY.size))
        assert (magic, status) == (MAGIC, 1)
        assert _recv_exact(sock, n).decode() == f"this is agent {rt._agent!r}, not 'someone-else'"


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
        magic, version, n1, n2 = HELLO.unpack(_recv_exact(sock, HELLO.size))
        _recv_exact(sock, n1 + n2)
        sock.sendall(HELLO_REPLY.pack(MAGIC, WIRE_VERSION, 0, 0))

    def descriptor(self) -> bytes:
        return pack_descriptor("tcp", "agent", agent="staller", host="127.0.0.1",
                               port=self.server.getsockname()[1])

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
        st.add_peer("s", staller.descriptor())
        remote = st.import_region("s", pack_descriptor("tcp", "region", agent="staller",
                                                       region=1, nbytes=N, device="cpu"))
        tickets = [st.write(region, remote, *_big_batch()) for _ in range(16)]  # > socket buffers
        with pytest.raises(PeerGoneError, match="connection 0 to peer 's' at 127.0.0.1:.* lost: "
                                                "(timed out|no progress)"):
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
        st.add_peer("s", staller.descriptor())
        remote = st.import_region("s", pack_descriptor("tcp", "region", agent="staller",
                                                       region=1, nbytes=N, device="cpu"))
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
    st.add_peer("gone", pack_descriptor("tcp", "agent", agent="x", host="127.0.0.1", port=port))
    remote = st.import_region("gone", pack_descriptor("tcp", "region", agent="x", region=1,
                                                      nbytes=N, device="cpu"))
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
        st.add_peer("r", rt.agent_descriptor())
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
        sock = connect(rt)
        _recv_exact(sock, HELLO_REPLY.size)
        sock.sendall(HEADER.pack(T_WRITE, 1, 1, rregion.region_id, 4096)
                     + np.array([[0, 4096]], "<u8").tobytes() + b"\x01" * 100)
        assert wait_until(lambda: any(c.region_id == rregion.region_id for c in rt._inbound),
                          TIMEOUT_S)
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


def test_share_with_more_entries_than_a_frame_holds_goes_as_several_frames(receiver, sender,
                                                                          monkeypatch):
    from sglang_kvxfer.transports import tcp

    monkeypatch.setattr(tcp, "_FRAME_ENTRIES", 7)
    rt, mem, rregion = receiver
    st, src, sregion = sender
    st.add_peer("r", rt.agent_descriptor())
    remote = st.import_region("r", rregion.descriptor)
    ro = np.arange(50, dtype=np.int64) * 100  # 50 entries that cannot be merged: 8 frames
    lo = ro[::-1].copy()
    before = next(st._xfer_ids)
    ticket = st.write(sregion, remote, lo, ro, np.full(50, 64))
    assert next(st._xfer_ids) - before - 1 == 8  # frames posted
    ticket.wait(TIMEOUT_S)
    for l, r in zip(lo, ro):
        np.testing.assert_array_equal(mem[r:r + 64], src[l:l + 64])


@pytest.mark.parametrize("shares", [2, 3, 7])
def test_split_covers_the_batch_in_order_with_even_shares(shares):
    rng = np.random.default_rng(shares)
    sz = rng.integers(1, 5000, 40)
    e = Entries(rng.integers(0, 10**6, 40), np.cumsum(sz) - sz + 17, sz)
    parts = _split(e, shares)
    assert len(parts) == shares
    joined = [np.concatenate([getattr(p, f) for p in parts])
              for f in ("local_offsets", "remote_offsets", "sizes")]
    # the pieces, in order, cover exactly the original bytes (local and remote alike)
    expand = lambda offs, sizes: np.concatenate([np.arange(o, o + s) for o, s in zip(offs, sizes)])
    np.testing.assert_array_equal(expand(joined[0], joined[2]),
                                  expand(e.local_offsets, e.sizes))
    np.testing.assert_array_equal(expand(joined[1], joined[2]),
                                  expand(e.remote_offsets, e.sizes))
    total = e.total_bytes
    assert all(abs(p.total_bytes - total / shares) <= 1 for p in parts)


def test_constructor_and_register_checks():
    with pytest.raises(ValueError, match="host='0.0.0.0' cannot be advertised"):
        TcpTransport(host="0.0.0.0")
    with pytest.raises(ValueError, match=r"num_connections must be an int in \[1, 64\], got 0"):
        TcpTransport(num_connections=0)
    with pytest.raises(ValueError, match="io_timeout_s must be > 0, got -1"):
        TcpTransport(io_timeout_s=-1)
    with TcpTransport() as t:
        with pytest.raises(TransportError, match="tcp moves host memory only, got device "
                                                 "'cuda:0'"):
            t.register(0x1000, 64, "cuda:0")
        with pytest.raises(ValueError, match="region 5 is not registered here"):
            from sglang_kvxfer.transports.base import Region

            t.deregister(Region(5, 0x1000, 64, "cpu", b""))
