"""``tcp`` with CUDA regions through pinned bounce buffers (needs a CUDA device; skips
itself without one). The bounce logic itself is tested on CPU in test_tcp_bounce.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests.facts import needs_cuda

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, needs_cuda]

TIMEOUT_S = 30.0
N = 8 << 20
SECRET = b"g" * 32


def _pair(src, dst):
    from sglang_kvxfer.transports.tcp import TcpTransport

    st, rt = TcpTransport(bounce_bytes=256 << 10), TcpTransport(bounce_bytes=256 << 10)
    sregion, rregion = st.register_tensor(src), rt.register_tensor(dst)
    rt.authorize_peer("s", SECRET, [rregion])
    st.add_peer("r", rt.agent_descriptor(), secret=SECRET)
    return st, rt, sregion, st.import_region("r", rregion.descriptor)


@pytest.mark.parametrize("where", ["cuda-cuda", "cuda-cpu", "cpu-cuda"])
def test_cuda_regions_move_byte_exact(where):
    src_dev, dst_dev = where.split("-")
    src = torch.randint(0, 256, (N,), dtype=torch.uint8, device=src_dev)
    dst = torch.zeros(N, dtype=torch.uint8, device=dst_dev)
    st, rt, sregion, remote = _pair(src, dst)
    try:
        assert sregion.device == ("cuda:0" if src_dev == "cuda" else "cpu")
        rng = np.random.default_rng(0)
        slots = rng.choice(N // 65536, 100, replace=False)
        sz = rng.integers(1, 65537, 100)
        lo, ro = rng.integers(0, N - 65536, 100), slots * 65536
        st.write(sregion, remote, lo, ro, sz).wait(TIMEOUT_S)
        got, host = dst.cpu().numpy(), src.cpu().numpy()
        want = np.zeros(N, np.uint8)
        for l, r, s in zip(lo, ro, sz):
            want[r : r + s] = host[l : l + s]
        np.testing.assert_array_equal(got, want)
    finally:
        st.close()
        rt.close()


def test_write_sees_kv_queued_on_the_current_stream_before_it():
    src = torch.zeros(N, dtype=torch.uint8, device="cuda")
    dst = torch.zeros(N, dtype=torch.uint8, device="cuda")
    st, rt, sregion, remote = _pair(src, dst)
    try:
        torch.cuda._sleep(200_000_000)  # the fill below runs well after write() returns
        src.fill_(7)
        st.write(sregion, remote, [0], [0], [N]).wait(TIMEOUT_S)
        assert bool((dst == 7).all())
    finally:
        st.close()
        rt.close()


@pytest.mark.parametrize("where", ["cuda-cuda", "cpu-cuda"])
def test_receipts_say_landed_once_the_bytes_are_in_device_memory(where):
    """The reader counts a device frame served only after its host -> device copies ended,
    so a receipt that says landed means the bytes are readable on the GPU."""
    src_dev, dst_dev = where.split("-")
    src = torch.randint(0, 256, (N,), dtype=torch.uint8, device=src_dev)
    dst = torch.zeros(N, dtype=torch.uint8, device=dst_dev)
    st, rt, sregion, remote = _pair(src, dst)
    try:
        ticket = st.write(sregion, remote, [0], [0], [N])
        assert ticket.receipts is not None
        rt.wait_landed("s", ticket.receipts, TIMEOUT_S)  # before the writer's ticket
        assert torch.equal(dst.cpu(), src.cpu())
        ticket.wait(TIMEOUT_S)
    finally:
        st.close()
        rt.close()
