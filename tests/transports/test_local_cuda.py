"""CUDA IPC writes of the ``local`` transport between two processes (needs a CUDA device;
skips itself without one)."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from tests.facts import needs_cuda

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    needs_cuda,
]

TIMEOUT_S = 30.0
N = 4 << 20


def _cuda_peer(conn, device: int):
    import torch

    from sglang_kvxfer.transports.local import LocalTransport

    t = LocalTransport()
    pool = torch.zeros(N, dtype=torch.uint8, device=f"cuda:{device}")
    region = t.register_tensor(pool.view(torch.float16).view(-1, 1024))  # any dtype/shape
    conn.send((t.agent_descriptor(), region.descriptor))
    while conn.poll(TIMEOUT_S):
        cmd = conn.recv()
        if cmd == "read":
            torch.cuda.synchronize(device)
            conn.send(pool.cpu().numpy().tobytes())
        else:
            t.close()
            conn.send(None)
            return


@pytest.fixture
def cuda_peer():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    device = torch.cuda.device_count() - 1  # another GPU when there is one
    proc = ctx.Process(target=_cuda_peer, args=(child, device))
    proc.start()
    assert parent.poll(TIMEOUT_S), "CUDA peer did not start"
    agent, region = parent.recv()
    yield parent, agent, region
    parent.send("exit")
    parent.poll(TIMEOUT_S)
    proc.join(TIMEOUT_S)


def test_cuda_ipc_write_lands_byte_exact(cuda_peer):
    import numpy as np

    from sglang_kvxfer.transports import TicketState
    from sglang_kvxfer.transports.local import LocalTransport

    conn, agent, region_desc = cuda_peer
    with LocalTransport() as t:
        src = torch.randint(0, 256, (N,), dtype=torch.uint8, device="cuda:0")
        local = t.register_tensor(src)
        assert local.device == "cuda:0"
        t.add_peer("p", agent)
        remote = t.import_region("p", region_desc)
        assert remote.device.startswith("cuda")
        rng = np.random.default_rng(0)
        slots = rng.choice(N // 8192, 300, replace=False)
        sz = rng.integers(0, 8193, 300)
        ro = slots * 8192
        lo = rng.integers(0, N - 8192, 300)
        ticket = t.write(local, remote, lo, ro, sz)
        ticket.wait(TIMEOUT_S)
        assert ticket.poll() is TicketState.DONE
        conn.send("read")
        assert conn.poll(TIMEOUT_S)
        got = np.frombuffer(conn.recv(), dtype=np.uint8)
        want = np.zeros(N, dtype=np.uint8)
        host = src.cpu().numpy()
        for l, r, s in zip(lo, ro, sz):
            want[r : r + s] = host[l : l + s]
        np.testing.assert_array_equal(got, want)


def test_cuda_to_cpu_region_is_refused(cuda_peer):
    import numpy as np

    from sglang_kvxfer.transports.local import LocalTransport, alloc_shared

    conn, agent, region_desc = cuda_peer
    # the buffer outlives the transport that registered it (closed in the reverse order)
    with alloc_shared(4096) as buf, LocalTransport() as t:
        local = t.register(buf.ptr, 4096)
        t.add_peer("p", agent)
        remote = t.import_region("p", region_desc)
        with pytest.raises(ValueError, match="same kind of memory: local region .* is cpu"):
            t.write(local, remote, np.array([0]), np.array([0]), np.array([8]))
