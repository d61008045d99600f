"""CUDA IPC peers of the ``local`` transport on CPU: GPUs named by identity, not index, and
no write into the memory of a peer that has exited.

CUDA itself cannot run here, so ``FakeGpus`` stands in for ``local.cuda_ipc``'s probes
and copies: each "process" sees its own list of GPU identities (as with different
``CUDA_VISIBLE_DEVICES``), an exported region is a CPU tensor found again by its handle,
and the copier moves the real bytes and records each post. Everything else (descriptors,
peer tracking, liveness checks, tickets) is the transport's own code. The same paths on a
real GPU are in test_local_cuda.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types

import numpy as np
import pytest

from sglang_kvxfer.errors import PeerGoneError, TransportError
from sglang_kvxfer.transports import TicketState
from sglang_kvxfer.transports._common import pack_descriptor, unpack_descriptor
from sglang_kvxfer.transports.local import LocalTransport
from sglang_kvxfer.transports.local import transport as local_transport

torch = pytest.importorskip("torch")
from sglang_kvxfer.transports.local import cuda_ipc  # noqa: E402  (imports torch)

TIMEOUT_S = 10.0
N = 1 << 16


class FakeCudaTensor:
    """Real bytes in a CPU tensor that call themselves ``cuda:<index>``."""

    def __init__(self, data, index: int, handle: bytes):
        self.data, self.index, self.handle = data, index, handle
        self.device = types.SimpleNamespace(type="cuda", index=index)

    def __getattr__(self, name):  # data_ptr, numel, element_size, reshape, ...
        return getattr(self.data, name)

    def is_contiguous(self):
        return True

    def untyped_storage(self):
        nbytes = self.data.numel() * self.data.element_size()
        share = (self.index, self.handle, nbytes, 0, b"ref", 0, b"", False)
        return types.SimpleNamespace(_share_cuda_=lambda: share)


class FakeGpus:
    """Stands in for cuda_ipc's probes, IPC opening and copier."""

    def __init__(self, monkeypatch):
        self.visible: tuple[str, ...] = ()
        self.exported: dict[bytes, object] = {}  # handle -> the exporter's CPU bytes
        self.opened: list[tuple[str, int]] = []  # (gpu identity, device index opened on)
        self.posts: list[int] = []  # entries per post
        self.landed = True  # what a post's completion poll reports
        monkeypatch.setattr(cuda_ipc, "visible_gpus", lambda: self.visible)
        monkeypatch.setattr(cuda_ipc, "current_device", lambda: 0)
        monkeypatch.setattr(cuda_ipc, "import_tensor", self._import)
        monkeypatch.setattr(cuda_ipc, "CudaCopier", lambda: self)
        real_memory = local_transport.tensor_memory
        monkeypatch.setattr(
            local_transport,
            "tensor_memory",
            lambda t: (t.data_ptr(), t.numel(), f"cuda:{t.index}") if isinstance(t, FakeCudaTensor) else real_memory(t),
        )

    def tensor(self, index: int, seed: int) -> FakeCudaTensor:
        data = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, N, dtype=np.uint8))
        handle = os.urandom(64)
        self.exported[handle] = data
        return FakeCudaTensor(data, index, handle)

    def _import(self, desc, device):
        cuda_ipc.check_ipc(desc)
        self.opened.append((desc["gpu"], device))
        return self.exported[desc["handle"]]

    # -- the CudaCopier interface -------------------------------------------------------
    def post(self, src, dst, lo, ro, sz):
        self.posts.append(len(sz))
        for s, d, n in zip(lo.tolist(), ro.tolist(), sz.tolist()):
            dst[d : d + n] = src[s : s + n]
        return lambda: self.landed

    def synchronize(self):
        pass


@pytest.fixture
def gpus(monkeypatch):
    return FakeGpus(monkeypatch)


def _export(gpus: FakeGpus, t: LocalTransport, sees: tuple[str, ...], index: int, seed: int):
    """Register a fake CUDA tensor as a process that sees ``sees`` would."""
    gpus.visible = sees
    tensor = gpus.tensor(index, seed)
    return t.register_tensor(tensor), tensor


def test_export_names_the_gpu_by_identity_not_index(gpus):
    with LocalTransport() as exporter:
        region, _ = _export(gpus, exporter, ("GPU-b", "GPU-c"), 1, seed=1)
        ipc = unpack_descriptor(region.descriptor, "local", "region", {"ipc": dict})["ipc"]
        assert (ipc["gpu"], ipc["device"], region.device) == ("GPU-c", 1, "cuda:1")


def test_importer_maps_the_exporters_gpu_on_its_own_index(gpus):
    # exporter: CUDA_VISIBLE_DEVICES=2 (its cuda:0 is GPU-b); importer sees GPU-a, GPU-b
    with LocalTransport() as exporter, LocalTransport() as importer:
        region, dst = _export(gpus, exporter, ("GPU-b",), 0, seed=1)
        src_region, src = _export(gpus, importer, ("GPU-a", "GPU-b"), 1, seed=2)
        importer.add_peer("p", exporter.agent_descriptor())
        remote = importer.import_region("p", region.descriptor)
        assert gpus.opened == [("GPU-b", 1)] and remote.device == "cuda:1"
        with importer.remote_view(remote, 100, 50) as view:
            assert view is not None  # the same GPU is visible here: the engine may gather in place
            view.copy_(torch.arange(50, dtype=torch.uint8))
        want = dst.data.clone()
        importer.write(src_region, remote, [0, 9000], [4096, 30000], [1000, 2000]).wait(TIMEOUT_S)
        want[100:150] = torch.arange(50, dtype=torch.uint8)
        want[4096:5096], want[30000:32000] = src.data[0:1000], src.data[9000:11000]
        assert torch.equal(dst.data, want)


def test_gpu_not_visible_here_is_opened_on_the_current_device_and_not_viewed(gpus):
    with LocalTransport() as exporter, LocalTransport() as importer:
        region, dst = _export(gpus, exporter, ("GPU-b",), 0, seed=1)
        src_region, src = _export(gpus, importer, ("GPU-a", "GPU-c"), 0, seed=2)
        importer.add_peer("p", exporter.agent_descriptor())
        remote = importer.import_region("p", region.descriptor)
        assert gpus.opened == [("GPU-b", 0)] and remote.device == "cuda:0"
        with importer.remote_view(remote, 0, 64) as view:
            assert view is None  # its label (cuda:0) is not where the bytes are: use write()
        importer.write(src_region, remote, [5], [7], [300]).wait(TIMEOUT_S)
        assert torch.equal(dst.data[7:307], src.data[5:305])


@pytest.fixture
def short_lived():
    """A process to stand in for a peer that will exit (killed by the test)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait(TIMEOUT_S)


def _peer_agent(pid: int, *, pidns_delta: int = 0) -> bytes:
    boot_id, pidns = local_transport._host_identity()
    return pack_descriptor("local", "agent", agent="doomed", boot_id=boot_id, pidns=pidns + pidns_delta, pid=pid)


def _doomed_region(gpus: FakeGpus, seed: int = 3):
    """A CUDA region descriptor of agent 'doomed', exported from a GPU the importer sees."""
    with LocalTransport(agent_id="doomed") as exporter:
        region, dst = _export(gpus, exporter, ("GPU-a",), 0, seed=seed)
        return region.descriptor, dst


def _kill(proc) -> None:
    proc.kill()
    proc.wait(TIMEOUT_S)


def test_write_to_a_peer_that_exited_is_refused_before_any_byte(gpus, short_lived):
    descriptor, dst = _doomed_region(gpus)
    before = dst.data.clone()
    with LocalTransport() as t:
        src_region, _ = _export(gpus, t, ("GPU-a",), 0, seed=4)
        t.add_peer("p", _peer_agent(short_lived.pid))
        remote = t.import_region("p", descriptor)
        _kill(short_lived)
        ticket = t.write(src_region, remote, [0], [0], [4096])
        assert ticket.poll() is TicketState.FAILED
        with pytest.raises(
            PeerGoneError,
            match=rf"peer 'p' \(pid {short_lived.pid}\) has exited; nothing was written to its CUDA IPC memory",
        ):
            ticket.wait(TIMEOUT_S)
        assert gpus.posts == [] and torch.equal(dst.data, before)
        with pytest.raises(PeerGoneError, match=rf"peer 'p' \(pid {short_lived.pid}\) has exited"):
            with t.remote_view(remote, 0, 64):
                pass
        assert [f.peer_id for f in t.peer_failures()] == ["p"]


def test_peer_that_exited_before_import_is_not_opened(gpus, short_lived):
    descriptor, _ = _doomed_region(gpus)
    with LocalTransport() as t:
        t.add_peer("p", _peer_agent(short_lived.pid))
        _kill(short_lived)
        with pytest.raises(PeerGoneError, match="has exited; its CUDA region is not opened"):
            t.import_region("p", descriptor)
        assert gpus.opened == []


def test_peer_that_exits_while_the_copy_runs_fails_the_ticket(gpus, short_lived):
    descriptor, _ = _doomed_region(gpus)
    with LocalTransport() as t:
        src_region, _ = _export(gpus, t, ("GPU-a",), 0, seed=4)
        t.add_peer("p", _peer_agent(short_lived.pid))
        remote = t.import_region("p", descriptor)
        gpus.landed = False
        ticket = t.write(src_region, remote, [0], [0], [4096])
        assert ticket.poll() is TicketState.PENDING and gpus.posts == [1]
        _kill(short_lived)
        gpus.landed = True
        with pytest.raises(PeerGoneError, match=rf"peer 'p' \(pid {short_lived.pid}\) has exited"):
            ticket.wait(TIMEOUT_S)


def test_peer_in_another_pid_namespace_is_refused_cuda_ipc(gpus):
    descriptor, _ = _doomed_region(gpus)
    with LocalTransport() as t:
        t.add_peer("p", _peer_agent(os.getpid(), pidns_delta=1))
        with pytest.raises(TransportError, match="peer 'p' runs in another pid namespace, so this process cannot see"):
            t.import_region("p", descriptor)
        assert gpus.opened == []


def test_liveness_costs_one_pidfd_poll_per_post_not_per_entry(gpus, monkeypatch):
    polls = []
    real = LocalTransport._exited
    monkeypatch.setattr(LocalTransport, "_exited", staticmethod(lambda peer: polls.append(1) or real(peer)))
    with LocalTransport() as exporter, LocalTransport() as t:
        region, dst = _export(gpus, exporter, ("GPU-a",), 0, seed=1)
        src_region, src = _export(gpus, t, ("GPU-a",), 0, seed=2)
        t.add_peer("p", exporter.agent_descriptor())
        remote = t.import_region("p", region.descriptor)
        polls.clear()
        lo = np.arange(1000, dtype=np.int64) * 64
        ro = lo[::-1].copy()  # reversed: nothing coalesces, 1000 entries reach the copier
        t.write(src_region, remote, lo, ro, np.full(1000, 32)).wait(TIMEOUT_S)
        assert gpus.posts == [1000]
        assert len(polls) == 2  # one before the post, one when the copy has landed
        for l, r in zip(lo, ro):
            assert torch.equal(dst.data[r : r + 32], src.data[l : l + 32])
    peer = local_transport._Peer("x", os.getpid(), os.pidfd_open(os.getpid()))
    try:
        t0 = time.perf_counter()
        for _ in range(1000):
            assert not real(peer)
        assert time.perf_counter() - t0 < 0.5  # about a microsecond each; loose for shared CPUs
    finally:
        os.close(peer.pidfd)


def test_gpu_identity_prefers_the_uuid_then_the_pci_bus_id(monkeypatch):
    props = {
        0: types.SimpleNamespace(name="A", uuid="1b2c-77", pci_domain_id=0, pci_bus_id=0x41, pci_device_id=0),
        1: types.SimpleNamespace(name="B", uuid="00000000-0000", pci_domain_id=1, pci_bus_id=0x81, pci_device_id=2),
        2: types.SimpleNamespace(name="C"),
    }
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    assert cuda_ipc.gpu_identity(0) == "GPU-1b2c-77"
    assert cuda_ipc.gpu_identity(1) == "pci:0001:81:02"  # an all-zero UUID names nothing
    with pytest.raises(RuntimeError, match="neither a UUID nor a PCI bus id for cuda:2 \\(C\\)"):
        cuda_ipc.gpu_identity(2)
