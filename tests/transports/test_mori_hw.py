"""The ``mori`` transport on real MORI-IO: host and GPU memory over an RDMA NIC.

Runs only where ``mori`` (amd-mori) is installed and the subprocess probe finds an AMD GPU
and an ACTIVE RDMA port (the probe runs in a child, so a host without them cannot kill
pytest); otherwise every test skips with the probe's reason. The writer is this process,
the target a spawned peer with its own engine, as in the contract suite.
"""

from __future__ import annotations

import numpy as np
import pytest

from sglang_kvxfer.errors import TransportError
from sglang_kvxfer.transports import TicketState, get_transport
from tests.facts import needs_cuda, needs_mori_hw
from tests.transports.transport_peer import PeerProcess

REGION_BYTES = 8 << 20
TIMEOUT_S = 30.0  # MORI's own retry budget (QP timeout x retries) is a few seconds


pytestmark = [pytest.mark.mori_hw, needs_mori_hw]


@pytest.fixture
def peer():
    proc = PeerProcess("mori", {}, "private", REGION_BYTES)
    assert proc.setup_error is None, proc.setup_error
    yield proc
    proc.close()


@pytest.fixture
def writer():
    t = get_transport("mori")
    yield t
    t.close()


def test_host_memory_batches_land_byte_exact(writer, peer):
    src = np.random.default_rng(1).integers(0, 256, REGION_BYTES, dtype=np.uint8)
    local = writer.register(src.ctypes.data, REGION_BYTES)
    writer.add_peer("peer", peer.agent)
    remote = writer.import_region("peer", peer.region)
    model = peer.fill(2)
    rng = np.random.default_rng(3)
    tickets, batches = [], []
    for n in (1, 64, 4096):
        slots = rng.choice(REGION_BYTES // 2048, size=n, replace=False)
        sz = rng.integers(1, 2049, n)
        lo, ro = rng.integers(0, REGION_BYTES - 2048, n), slots * 2048
        tickets.append(writer.write(local, remote, lo, ro, sz))
        batches.append((lo, ro, sz))
    writer.wait_all(tickets, TIMEOUT_S)  # engine.wait_all in slices
    for lo, ro, sz in batches:
        for l, r, k in zip(lo, ro, sz):
            model[r : r + k] = src[l : l + k]
    np.testing.assert_array_equal(peer.read(), model)


@needs_cuda  # ROCm builds of torch expose HIP devices as "cuda"
def test_gpu_memory_is_written_into_host_memory(writer, peer):
    import torch

    src = torch.randint(0, 256, (REGION_BYTES,), dtype=torch.uint8, device="cuda:0")
    local = writer.register_tensor(src)
    assert local.device == "cuda:0"
    writer.add_peer("peer", peer.agent)
    remote = writer.import_region("peer", peer.region)
    model = peer.fill(4)
    writer.write(local, remote, [0, 1 << 20], [4096, 3 << 20], [65536, 1 << 20]).wait(TIMEOUT_S)
    host = src.cpu().numpy()
    model[4096 : 4096 + 65536] = host[:65536]
    model[3 << 20 : 4 << 20] = host[1 << 20 : 2 << 20]
    np.testing.assert_array_equal(peer.read(), model)


def test_a_killed_peer_fails_writes_within_the_deadline(writer, peer):
    src = np.ones(REGION_BYTES, np.uint8)
    local = writer.register(src.ctypes.data, REGION_BYTES)
    writer.add_peer("peer", peer.agent)
    remote = writer.import_region("peer", peer.region)
    writer.write(local, remote, [0], [0], [4096]).wait(TIMEOUT_S)
    peer.kill()
    ticket = writer.write(local, remote, [0], [0], [1 << 20])
    with pytest.raises(TransportError):
        ticket.wait(TIMEOUT_S)
    assert ticket.poll() is TicketState.FAILED and "peer 'peer'" in ticket.reason
