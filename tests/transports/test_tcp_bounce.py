"""``tcp`` with device memory, on CPU: the pinned bounce-buffer path of ``tcp.bounce``.

``FakeDevice`` is a ``bounce.Copier`` whose "device" memory is host memory registered as
``cuda:0``. Its copies are asynchronous in the way that matters: a posted copy moves its
bytes only when it is waited for, so a sender that sent a buffer before waiting for its
copy, or a receiver that ACKed before its copies landed, delivers wrong bytes and fails
the byte comparisons. It logs every staging copy, so the tests also check the double
buffering (the copy of chunk k+1 is posted before chunk k goes out) and the buffer reuse.
The same paths on a real GPU are in test_tcp_cuda.py.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

from sglang_kvxfer.errors import TransportError
from sglang_kvxfer.transports.tcp import TcpTransport
from sglang_kvxfer.transports.tcp.bounce import plan_chunks

TIMEOUT_S = 10.0
N = 1 << 20
BOUNCE = 16 << 10
SECRET = b"d" * 32


class _Done:
    def __init__(self, kind: str, k: int, run):
        self.kind, self.k, self.run, self.landed = kind, k, run, False


class FakeDevice:
    """A ``bounce.Copier`` over host memory, with deferred copies and a log."""

    def __init__(self):
        self.lock = threading.Lock()
        self.log: list[tuple[str, int]] = []  # ("post"/"wait", copy number), in order
        self.outstanding = self.max_outstanding = 0
        self.posted = 0
        self.pinned_buffers: list[np.ndarray] = []
        self.marks: list[object] = []  # what each to_host was ordered after
        self.fail_on: tuple[str, int] | None = None  # ("to_host"|"to_device", nth call)
        self.calls = {"to_host": 0, "to_device": 0}

    def device_memory(self, ptr, nbytes, device, tensor=None):
        assert device == "cuda:0"
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))

    def pinned(self, nbytes):
        buf = np.zeros(nbytes, np.uint8)
        self.pinned_buffers.append(buf)
        return buf, memoryview(buf)

    def ready(self, dev):
        mark = object()
        self.marks.append(("ready", mark))
        return mark

    def _post(self, kind, run):
        with self.lock:
            self.calls[kind] += 1
            if self.fail_on == (kind, self.calls[kind]):
                raise RuntimeError(f"injected {kind} failure")
            k = self.posted
            self.posted += 1
            self.outstanding += 1
            self.max_outstanding = max(self.max_outstanding, self.outstanding)
            self.log.append(("post", k))
        return _Done(kind, k, run)

    def to_host(self, dev, dev_offsets, host, host_offsets, sizes, after):
        self.marks.append(("to_host", after))
        pieces = list(zip(dev_offsets.tolist(), host_offsets.tolist(), sizes.tolist()))

        def run():
            for d, h, n in pieces:
                host[h : h + n] = dev[d : d + n]

        return self._post("to_host", run)

    def to_device(self, host, host_offsets, dev, dev_offsets, sizes):
        pieces = list(zip(dev_offsets.tolist(), host_offsets.tolist(), sizes.tolist()))
        snapshot = host.copy()  # what the buffer held at post time: a later overwrite must not matter...

        def run():
            for d, h, n in pieces:
                dev[d : d + n] = host[h : h + n]
            # ...unless it came before the copy ran, which a real DMA would read too
            assert np.array_equal(host, snapshot), "a bounce buffer was refilled before its copy landed"

        return self._post("to_device", run)

    def wait(self, done):
        if not done.landed:
            done.run()
            done.landed = True
            with self.lock:
                self.outstanding -= 1
                self.log.append(("wait", done.k))


def _pair(*, sender_conns=1, device_src=True, device_dst=True):
    fs, fr = FakeDevice(), FakeDevice()
    st = TcpTransport(device_copier=fs, bounce_bytes=BOUNCE, num_connections=sender_conns, split_min_bytes=64 << 10)
    rt = TcpTransport(device_copier=fr, bounce_bytes=BOUNCE)
    src = np.random.default_rng(1).integers(0, 256, N, dtype=np.uint8)
    dst = np.random.default_rng(2).integers(0, 256, N, dtype=np.uint8)
    sregion = st.register(src.ctypes.data, N, "cuda:0" if device_src else "cpu")
    rregion = rt.register(dst.ctypes.data, N, "cuda:0" if device_dst else "cpu")
    rt.authorize_peer("s", SECRET, [rregion])
    st.add_peer("r", rt.agent_descriptor(), secret=SECRET)
    remote = st.import_region("r", rregion.descriptor)
    return st, rt, fs, fr, src, dst, sregion, remote


def _batch(seed: int, count: int = 100):
    rng = np.random.default_rng(seed)
    sz = rng.integers(1, 9000, count)
    slots = rng.choice(N // 9000, count, replace=False)
    return rng.integers(0, N - 9000, count), slots * 9000, sz


def _expect(dst, src, lo, ro, sz):
    want = dst.copy()
    for l, r, n in zip(lo, ro, sz):
        want[r : r + n] = src[l : l + n]
    return want


@pytest.mark.parametrize(
    "device_src, device_dst, conns",
    [(True, True, 1), (True, False, 1), (False, True, 1), (True, True, 3)],
    ids=["dev-to-dev", "dev-to-host", "host-to-dev", "dev-to-dev-3conn"],
)
def test_device_bytes_land_byte_exact_through_bounce_buffers(device_src, device_dst, conns):
    st, rt, fs, fr, src, dst, sregion, remote = _pair(sender_conns=conns, device_src=device_src, device_dst=device_dst)
    try:
        for seed in range(3):
            lo, ro, sz = _batch(seed)
            want = _expect(dst, src, lo, ro, sz)
            st.write(sregion, remote, lo, ro, sz).wait(TIMEOUT_S)
            np.testing.assert_array_equal(dst, want)
            src[:] = np.random.default_rng(10 + seed).integers(0, 256, N, dtype=np.uint8)  # new KV each round
        total = int(sz.sum())
        assert total > 10 * BOUNCE  # many chunks, entries cut at chunk boundaries
        # only device ends touch the copier, and each connection end pins its two buffers once
        assert (fs.posted > 0, fr.posted > 0) == (device_src, device_dst)
        assert len(fs.pinned_buffers) == (2 * conns if device_src else 0)
        assert len(fr.pinned_buffers) == (2 * conns if device_dst else 0)
        assert fs.max_outstanding <= 2 * conns and fr.max_outstanding <= 2 * conns  # two per connection end
        assert st.peer_failures() == [] and rt.peer_failures() == []
    finally:
        st.close()
        rt.close()


def test_sender_copies_the_next_chunk_while_the_previous_is_sent():
    st, rt, fs, fr, src, dst, sregion, remote = _pair()
    try:
        st.write(sregion, remote, [0], [0], [8 * BOUNCE]).wait(TIMEOUT_S)
        np.testing.assert_array_equal(dst[: 8 * BOUNCE], src[: 8 * BOUNCE])
        # post 0, post 1, wait 0 (send 0), post 2, wait 1 (send 1), post 3, ...
        want = [("post", 0), ("post", 1)]
        for k in range(8):
            want.append(("wait", k))
            if k + 2 < 8:
                want.append(("post", k + 2))
        assert fs.log == want
        # every copy to the host was ordered after the mark taken when write() was called
        ready = [m for kind, m in fs.marks if kind == "ready"]
        assert len(ready) == 1 and all(m is ready[0] for kind, m in fs.marks if kind == "to_host")
        # the receiver had at most two copies to the device in flight, one per buffer
        assert fr.max_outstanding == 2 and fr.log.count(("wait", 7)) == 1
    finally:
        st.close()
        rt.close()


def test_host_memory_never_touches_the_bounce_path():
    st, rt, fs, fr, src, dst, sregion, remote = _pair(device_src=False, device_dst=False)
    try:
        lo, ro, sz = _batch(5)
        want = _expect(dst, src, lo, ro, sz)
        st.write(sregion, remote, lo, ro, sz).wait(TIMEOUT_S)
        np.testing.assert_array_equal(dst, want)
        assert fs.posted == fr.posted == 0 and not fs.pinned_buffers and not fr.pinned_buffers
    finally:
        st.close()
        rt.close()


def test_a_failed_copy_to_the_device_refuses_the_write_and_the_connection_serves_on():
    st, rt, fs, fr, src, dst, sregion, remote = _pair()
    try:
        fr.fail_on = ("to_device", 2)
        ticket = st.write(sregion, remote, [0], [0], [4 * BOUNCE])
        with pytest.raises(
            TransportError, match="refused the write: copying the bytes to the device failed: RuntimeError: injected"
        ):
            ticket.wait(TIMEOUT_S)
        lo, ro, sz = _batch(7)
        want = _expect(dst, src, lo, ro, sz)
        st.write(sregion, remote, lo, ro, sz).wait(TIMEOUT_S)
        np.testing.assert_array_equal(dst, want)
        assert st.peer_failures() == []
    finally:
        st.close()
        rt.close()


def test_a_failed_copy_from_the_device_fails_the_ticket_not_the_peer():
    st, rt, fs, fr, src, dst, sregion, remote = _pair()
    try:
        fs.fail_on = ("to_host", 2)
        ticket = st.write(sregion, remote, [0], [0], [4 * BOUNCE])
        with pytest.raises(TransportError, match="copying the payload from the device failed: RuntimeError: injected"):
            ticket.wait(TIMEOUT_S)
        assert st.peer_failures() == []  # our device's fault: the peer is not marked gone
        lo, ro, sz = _batch(8)
        want = _expect(dst, src, lo, ro, sz)
        st.write(sregion, remote, lo, ro, sz).wait(TIMEOUT_S)  # a new connection
        np.testing.assert_array_equal(dst, want)
    finally:
        st.close()
        rt.close()


@pytest.mark.parametrize("chunk", [61, 4096, 1 << 20])
def test_plan_chunks_covers_the_payload_in_order(chunk):
    rng = np.random.default_rng(chunk)
    sz = rng.integers(0, 5000, 60)  # zero-size entries too (a raw frame may carry them)
    offs = rng.integers(0, 10**6, 60)
    chunks = plan_chunks(offs, sz, chunk)
    total = int(sz.sum())
    assert [c.nbytes for c in chunks] == [min(chunk, total - k) for k in range(0, total, chunk)]
    device_bytes = []
    for c in chunks:
        assert int(c.sizes.sum()) == c.nbytes and (c.sizes > 0).all()
        # pieces fill the chunk's buffer from 0, back to back
        np.testing.assert_array_equal(c.host_offsets, np.cumsum(c.sizes) - c.sizes)
        device_bytes += [np.arange(d, d + n) for d, n in zip(c.dev_offsets, c.sizes)]
    expected = np.concatenate([np.arange(o, o + s) for o, s in zip(offs, sz)])
    np.testing.assert_array_equal(np.concatenate(device_bytes), expected)
    with pytest.raises(ValueError, match="chunk_bytes must be >= 1, got 0"):
        plan_chunks(offs, sz, 0)
    assert plan_chunks(offs[:0], sz[:0], chunk) == []


def test_device_registration_without_cuda_says_what_is_missing():
    pytest.importorskip("torch")
    from tests.facts import cuda_available

    if cuda_available():
        pytest.skip("CUDA is available here: registration succeeds (test_tcp_cuda.py)")
    with TcpTransport() as t:
        with pytest.raises(
            TransportError, match="tcp moves device memory through pinned host buffers with torch's CUDA, which is not"
        ):
            t.register(0x1000, 64, "cuda:0")
