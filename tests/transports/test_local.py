"""The ``local`` transport beyond the shared contract: shared buffers, CMA permission
errors, same-host checks, forged descriptors."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os

import numpy as np
import pytest

from sglang_kvxfer.errors import PeerGoneError, TransportError
from sglang_kvxfer.transports import _memory
from sglang_kvxfer.transports._common import pack_descriptor, unpack_descriptor
from sglang_kvxfer.transports.local import LocalTransport, alloc_shared
from tests.facts import needs_root
from tests.transports.transport_peer import PeerProcess

TIMEOUT_S = 10.0


def test_shared_buffer_views_share_memory_and_close_releases_it():
    torch = pytest.importorskip("torch")
    buf = alloc_shared(1 << 16)
    arr = buf.as_numpy()
    t = buf.as_tensor(torch.float32, (16, 1024))
    t[0, 0] = 1.5
    assert np.frombuffer(arr[:4].tobytes(), np.float32)[0] == 1.5
    assert t.data_ptr() == buf.ptr == arr.ctypes.data
    assert os.path.exists(buf.path)
    assert _memory.find_shared(buf.ptr + 100, 10) is buf
    buf.close()
    buf.close()  # idempotent
    assert _memory.find_shared(buf.ptr + 100, 10) is None
    arr[0] = 7  # a live view keeps its pages mapped after close()
    assert arr[0] == 7
    with pytest.raises(ValueError, match="SharedBuffer is closed"):
        buf.as_numpy()


def test_shared_buffer_rejects_bad_sizes():
    with pytest.raises(ValueError, match="nbytes must be > 0, got 0"):
        alloc_shared(0)
    with pytest.raises(TypeError, match="nbytes must be an int, got float"):
        alloc_shared(1.5)
    torch = pytest.importorskip("torch")
    with alloc_shared(64) as buf:
        with pytest.raises(
            ValueError,
            match=r"shape \(4, 4\) of torch.float64 needs 128 bytes, "
            r"buffer has 64",
        ):
            buf.as_tensor(torch.float64, (4, 4))


def test_region_inside_a_shared_buffer_is_shm_kind():
    with alloc_shared(1 << 20) as buf, LocalTransport() as t:
        region = t.register(buf.ptr + 4096, 8192)
        desc = unpack_descriptor(region.descriptor, "local", "region", {})
        assert desc["kind"] == "shm" and desc["offset"] == 4096 and desc["path"] == buf.path
        with pytest.raises(ValueError, match="still holds 1 registered region\\(s\\); deregister them before close"):
            buf.close()
        t.deregister(region)
        buf.close()
        assert buf.closed
        private = np.zeros(100, np.uint8)
        assert (
            unpack_descriptor(t.register(private.ctypes.data, 100).descriptor, "local", "region", {})["kind"] == "cma"
        )


def test_register_tensor_of_a_shared_buffer_is_shm_kind():
    torch = pytest.importorskip("torch")
    with alloc_shared(1 << 16) as buf, LocalTransport() as t:
        pool = buf.as_tensor(torch.bfloat16, (2, 8, 4, 64))[1]  # [page, head, dim] of layer 1
        region = t.register_tensor(pool)
        assert (region.ptr, region.nbytes, region.device) == (buf.ptr + 4096, 4096, "cpu")
        desc = unpack_descriptor(region.descriptor, "local", "region", {})
        assert (desc["kind"], desc["offset"]) == ("shm", 4096)


def test_private_memory_with_cma_disabled_fails_at_registration():
    private = np.zeros(100, np.uint8)
    with LocalTransport(allow_cma=False) as t:
        with pytest.raises(
            TransportError,
            match="private memory and allow_cma=False; allocate it with alloc_shared\\(\\) or use the 'tcp'",
        ):
            t.register(private.ctypes.data, 100)


def test_register_rejects_cuda_pointer_and_bad_args():
    with LocalTransport() as t:
        with pytest.raises(TypeError, match="register CUDA memory with register_tensor"):
            t.register(0x1000, 64, "cuda:0")
        with pytest.raises(ValueError, match="nbytes must be > 0, got 0"):
            t.register(0x1000, 0)
        with pytest.raises(TypeError, match="ptr must be an int, got str"):
            t.register("0x1000", 10)


def _non_dumpable_peer(conn):
    import ctypes

    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0
    private = np.zeros(4096, np.uint8)
    try:
        LocalTransport().register(private.ctypes.data, 4096)
        conn.send("registered")
    except TransportError as exc:
        conn.send(str(exc))


def test_non_dumpable_process_cannot_register_private_memory():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_non_dumpable_peer, args=(child,))
    proc.start()
    assert parent.poll(TIMEOUT_S)
    msg = parent.recv()
    proc.join(TIMEOUT_S)
    assert "not dumpable" in msg and "alloc_shared()" in msg and "'tcp'" in msg


def _unprivileged_writer(conn, agent, region):
    import msgpack  # noqa: F401  (imported while its files are still readable)

    t = LocalTransport()
    os.setgid(65534)
    os.setuid(65534)  # another user: the kernel must refuse process_vm_writev into the peer
    try:
        t.add_peer("peer", agent)
        t.import_region("peer", region)
        conn.send("imported")
    except Exception as exc:
        conn.send(f"{type(exc).__name__}: {exc}")


@needs_root
def test_cma_refused_by_the_kernel_says_why_and_suggests_tcp():
    peer = PeerProcess("local", {}, "private", 4096)
    try:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_unprivileged_writer, args=(child, peer.agent, peer.region))
        proc.start()
        assert parent.poll(TIMEOUT_S)
        msg = parent.recv()
        proc.join(TIMEOUT_S)
        assert msg.startswith("TransportError: the kernel does not permit process_vm_writev into peer 'peer'"), msg
        assert "Operation not permitted" in msg and "'tcp' transport" in msg
    finally:
        peer.close()


def test_peer_on_another_host_is_refused():
    with LocalTransport() as t:
        desc = unpack_descriptor(t.agent_descriptor(), "local", "agent", {})
        desc.update(boot_id="00000000-other-host")
        forged = pack_descriptor(
            "local", "agent", **{k: v for k, v in desc.items() if k not in ("transport", "what", "version")}
        )
        with pytest.raises(TransportError, match="runs on another host .*use the 'tcp' transport"):
            t.add_peer("far", forged)


def test_peer_already_exited_at_add_peer():
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=os.getpid)
    proc.start()
    proc.join(TIMEOUT_S)
    with LocalTransport() as t:
        desc = unpack_descriptor(t.agent_descriptor(), "local", "agent", {})
        fields = {k: v for k, v in desc.items() if k not in ("transport", "what", "version")}
        fields["pid"] = proc.pid
        with pytest.raises(PeerGoneError, match=f"pid {proc.pid}\\) has exited"):
            t.add_peer("gone", pack_descriptor("local", "agent", **fields))


def test_tcp_descriptor_is_refused_by_local():
    from sglang_kvxfer.transports.tcp import TcpTransport

    with LocalTransport() as t, TcpTransport() as other:
        with pytest.raises(ValueError, match="descriptor is for transport 'tcp'; transport 'local' cannot use it"):
            t.add_peer("p", other.agent_descriptor())


def _forge_region(descriptor: bytes, **changes) -> bytes:
    desc = unpack_descriptor(descriptor, "local", "region", {})
    desc.update(changes)
    return pack_descriptor(
        "local", "region", **{k: v for k, v in desc.items() if k not in ("transport", "what", "version")}
    )


@pytest.fixture(scope="module")
def shm_peer():
    """A peer whose region is a 1 MiB shared buffer of 4 KiB pages (a file of exactly its
    size, even on a host with reserved huge pages, where the file would be 2 MiB)."""
    old = os.environ.get("KVXFER_SHM_HUGETLB")
    os.environ["KVXFER_SHM_HUGETLB"] = "0"
    try:
        peer = PeerProcess("local", {}, "shm", 1 << 20)
    finally:
        if old is None:
            del os.environ["KVXFER_SHM_HUGETLB"]
        else:
            os.environ["KVXFER_SHM_HUGETLB"] = old
    yield peer
    peer.close()


def test_forged_shm_descriptor_larger_than_the_buffer_is_refused(shm_peer):
    with LocalTransport() as t:
        t.add_peer("p", shm_peer.agent)
        with pytest.raises(
            ValueError,
            match=r"offset 0 \+ nbytes 2097152 exceeds the shared "
            r"buffer's 1048576 bytes",
        ):
            t.import_region("p", _forge_region(shm_peer.region, nbytes=2 << 20))
        with pytest.raises(TransportError, match="has 1048576 bytes, descriptor says 2097152"):
            t.import_region("p", _forge_region(shm_peer.region, nbytes=2 << 20, map_bytes=2 << 20))
        with pytest.raises(TransportError, match="is no longer the peer's shared buffer"):
            t.import_region("p", _forge_region(shm_peer.region, inode=1))


def test_region_of_another_agent_is_refused(shm_peer):
    with LocalTransport() as t, LocalTransport() as other:
        t.add_peer("p", other.agent_descriptor())
        with pytest.raises(ValueError, match="belongs to agent .* but peer 'p' is agent"):
            t.import_region("p", shm_peer.region)


def test_adding_a_peer_again_replaces_it(shm_peer):
    with LocalTransport() as t:
        t.add_peer("p", shm_peer.agent)
        t.import_region("p", shm_peer.region)
        t.add_peer("p", shm_peer.agent)  # a restarted peer is not refused as a duplicate
        assert list(t._peers) == ["p"] and t._targets.items() == []  # old imports dropped
        t.import_region("p", shm_peer.region)
        with pytest.raises(ValueError, match="unknown peer 'q'"):
            t.remove_peer("q")


def test_local_records_grants_and_checks_secrets(shm_peer):
    with LocalTransport() as t:
        with pytest.raises(ValueError, match="secret must be 32 bytes, got 3"):
            t.add_peer("p", shm_peer.agent, secret=b"abc")
        t.add_peer("p", shm_peer.agent, secret=b"x" * 32)
        assert not t.caps.authenticates_peers  # the trust boundary is the Unix user
        buf = alloc_shared(4096)
        region = t.register(buf.ptr, 4096)
        t.authorize_peer("w", b"y" * 32, [region])
        assert t._grants == {"w": frozenset({region.region_id})}
        t.revoke_peer("w")
        t.revoke_peer("never-seen")
        assert t._grants == {}
        t.deregister(region)
        buf.close()


def test_cpu_and_cuda_regions_cannot_be_mixed(shm_peer):
    # A remote region that claims to be CUDA is refused at write time before anything moves.
    from sglang_kvxfer.transports.base import RemoteRegion
    from sglang_kvxfer.transports.local.transport import _Target

    src = np.zeros(64, np.uint8)
    with LocalTransport() as t:
        t.add_peer("p", shm_peer.agent)
        region = t.register(src.ctypes.data, 64)
        t._targets.add(("p", 77), _Target("cuda", 64, "cuda:0"))
        remote = RemoteRegion("p", 77, 64, "cuda:0")
        with pytest.raises(ValueError, match="same kind of memory: local region 1 is cpu, the remote region is cuda:0"):
            t.write(region, remote, np.array([0]), np.array([0]), np.array([8]))


def _cuda_region(agent: str, **ipc_changes) -> bytes:
    ipc = {
        "gpu": "GPU-00000000-0000-0000-0000-000000000001",
        "device": 0,
        "handle": b"\0" * 64,
        "storage_bytes": 4096,
        "storage_offset": 0,
        "ref_handle": b"x",
        "ref_offset": 0,
        "event_handle": b"\0" * 64,
        "event_sync": False,
        "byte_offset": 0,
        "nbytes": 4096,
    }
    ipc.update(ipc_changes)
    return pack_descriptor("local", "region", agent=agent, region=1, nbytes=4096, device="cuda:0", kind="cuda", ipc=ipc)


def test_malformed_cuda_descriptor_names_the_field(shm_peer):
    pytest.importorskip("torch")
    agent = unpack_descriptor(shm_peer.agent, "local", "agent", {})["agent"]
    with LocalTransport() as t:
        t.add_peer("p", shm_peer.agent)
        with pytest.raises(ValueError, match="ipc field 'handle' is 'abc', expected bytes"):
            t.import_region("p", _cuda_region(agent, handle="abc"))


def test_cuda_region_that_cannot_be_opened_is_a_transport_error(shm_peer):
    pytest.importorskip("torch")
    agent = unpack_descriptor(shm_peer.agent, "local", "agent", {})["agent"]
    with LocalTransport() as t:
        t.add_peer("p", shm_peer.agent)
        # no CUDA here, or (on a GPU machine) a handle of zeros: either way it cannot open
        with pytest.raises(
            TransportError, match=r"cannot open peer 'p'.s CUDA region \(GPU-0+-0000-0000-0000-0+1\) by CUDA IPC"
        ):
            t.import_region("p", _cuda_region(agent))


def test_remote_view_writes_land_in_the_peers_shared_memory(shm_peer):
    import torch

    shm_peer.fill(3)
    before = shm_peer.read()
    with LocalTransport() as t:
        t.add_peer("p", shm_peer.agent)
        remote = t.import_region("p", shm_peer.region)
        with t.remote_view(remote, 4096, 1000) as view:
            assert view.dtype == torch.uint8 and view.numel() == 1000
            view.copy_(torch.arange(1000, dtype=torch.int64).remainder(251).to(torch.uint8))
        with pytest.raises(ValueError, match=r"remote_view \[1048000, 1049000\) is outside remote region"):
            with t.remote_view(remote, 1048000, 1000):
                pass
    after = shm_peer.read()
    expected = before.copy()
    expected[4096:5096] = (np.arange(1000) % 251).astype(np.uint8)
    assert np.array_equal(after, expected)  # those bytes, and nothing else


def test_remote_view_of_private_memory_is_none():
    peer = PeerProcess("local", {}, "private", 1 << 16)
    try:
        with LocalTransport() as t:
            t.add_peer("p", peer.agent)
            remote = t.import_region("p", peer.region)
            with t.remote_view(remote, 0, 16) as view:
                assert view is None  # CMA targets are not mapped here: callers use write()
    finally:
        peer.close()


def _rss_bytes(addr: int) -> int:
    """Resident bytes of this process's mapping that contains ``addr`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= addr < end
            elif inside and head in ("Rss:", "Shared_Hugetlb:", "Private_Hugetlb:") and int(line.split()[1]):
                return int(line.split()[1]) * 1024  # (hugetlb pages are not counted in Rss)
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not hasattr(mmap, "MAP_POPULATE"), reason="needs MAP_POPULATE (Linux)")
def test_shared_buffers_and_their_imports_are_resident_before_the_first_write():
    """No transfer pays a page fault per 4 KiB of a fresh pool: the pages are mapped when
    the buffer is allocated and when a peer maps it."""
    from sglang_kvxfer.transports._memory import mapping_address, open_shared

    nbytes = 8 << 20
    with alloc_shared(nbytes) as buf:
        assert _rss_bytes(buf.ptr) == nbytes
        peer_view = open_shared(buf.path, buf.inode, nbytes)
        try:
            assert _rss_bytes(mapping_address(peer_view)) == nbytes
        finally:
            peer_view.close()


def test_shmem_thp_setting_is_the_bracketed_choice():
    try:
        with open(_memory.SHMEM_THP_SETTING) as f:
            choices = f.read().split()
    except OSError:
        assert _memory.shmem_thp_setting() == "unknown"
        return
    picked = [c.strip("[]") for c in choices if c.startswith("[")]
    assert [_memory.shmem_thp_setting()] == picked


@pytest.mark.skipif(
    _memory.shmem_thp_setting() not in ("advise", "within_size", "always"),
    reason="the kernel gives shared memory no transparent huge pages (shmem_enabled is not advise/within_size/always)",
)
def test_shared_buffers_get_huge_pages_where_the_kernel_allows_them():
    with alloc_shared(8 << 20) as buf:
        assert _memory.huge_page_bytes(buf.ptr, buf.nbytes) >= 2 << 20


def test_huge_page_bytes_of_a_4k_mapping_is_zero_and_counts_nothing_outside():
    mm = mmap.mmap(-1, 4 << 20, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(mmap.MADV_NOHUGEPAGE)
        mm.write(b"x" * (4 << 20))
        addr = _memory.mapping_address(mm)
        assert _memory.huge_page_bytes(addr, 4 << 20) == 0
        assert _rss_bytes(addr) == 4 << 20  # the helper reads the same smaps entries
    finally:
        mm.close()


def test_memmove_rate_is_measured_once_and_prices_the_local_path_cost():
    per_op, rate = _memory.memmove_rate()
    assert 5e-8 <= per_op <= 5e-5 and 5e8 <= rate <= 5e11
    assert _memory.memmove_rate() == (per_op, rate)  # cached: no second measurement
    t = LocalTransport()
    try:
        cost = t.path_cost()
        assert (cost.per_op_s, cost.bytes_per_s, cost.copy_bytes_per_s) == (per_op, rate, rate)
    finally:
        t.close()


def _read_nr_hugepages() -> int:
    with open("/proc/sys/vm/nr_hugepages") as f:
        return int(f.read())


@pytest.fixture
def reserved_huge_pages():
    """At least 8 free 2 MiB huge pages for the test: the host's own, or (as root) the host's
    reservation raised by 8 for the test and put back after it."""
    page, free = _memory.hugetlb_pages()
    if page != 2 << 20 or not hasattr(os, "MFD_HUGETLB"):
        pytest.skip(f"no 2 MiB hugetlb pages on this host (Hugepagesize {page} bytes)")
    if free >= 8:
        yield page
        return
    if os.geteuid() != 0:
        pytest.skip(f"{free} free huge pages and no root to reserve more (sysctl vm.nr_hugepages)")
    before = _read_nr_hugepages()
    with open("/proc/sys/vm/nr_hugepages", "w") as f:
        f.write(str(before + 8))
    try:
        if _memory.hugetlb_pages()[1] < 8:
            pytest.skip("the kernel could not reserve 8 huge pages (memory fragmented)")
        yield page
    finally:
        with open("/proc/sys/vm/nr_hugepages", "w") as f:
            f.write(str(before))


def _peer_writes_the_tail(path: str, inode: int, nbytes: int, out) -> None:
    mm = _memory.open_shared(path, inode, nbytes)
    mm[nbytes - 3 : nbytes] = b"end"
    mm[:5] = b"start"
    out.put(len(mm))
    mm.close()


def test_a_shared_buffer_on_reserved_huge_pages_is_mapped_by_a_peer_and_given_back(monkeypatch, reserved_huge_pages):
    """``KVXFER_SHM_HUGETLB=auto`` on a host with free huge pages: the buffer is a hugetlb memfd
    of whole pages (3 MiB + 5 bytes: two pages), resident from the start, exactly ``nbytes``
    long to its user; a peer process maps it by its path and writes both ends; closing it gives
    the pages back. A forged size past the file's whole pages is refused."""
    page = reserved_huge_pages
    monkeypatch.setenv("KVXFER_SHM_HUGETLB", "auto")
    nbytes = 3 * (1 << 20) + 5
    _, free_before = _memory.hugetlb_pages()
    buf = alloc_shared(nbytes)
    try:
        assert buf.hugetlb
        assert os.fstat(buf.fd).st_size == 2 * page and os.fstat(buf.fd).st_blksize == page
        assert _memory.hugetlb_pages()[1] == free_before - 2
        assert _memory.huge_page_bytes(buf.ptr, buf.nbytes) == 2 * page
        assert _rss_bytes(buf.ptr) == 2 * page  # faulted in at allocation
        assert len(buf.as_numpy()) == nbytes
        out = mp.get_context("spawn").Queue()
        child = mp.get_context("spawn").Process(target=_peer_writes_the_tail, args=(buf.path, buf.inode, nbytes, out))
        child.start()
        mapped = out.get(timeout=TIMEOUT_S)
        child.join(TIMEOUT_S)
        assert child.exitcode == 0 and mapped == 2 * page
        arr = buf.as_numpy()
        assert bytes(arr[:5]) == b"start" and bytes(arr[-3:]) == b"end"
        del arr
        with pytest.raises(TransportError, match=f"has {2 * page} bytes, descriptor says {3 * page}"):
            _memory.open_shared(buf.path, buf.inode, 3 * page)
    finally:
        buf.close()
    assert _memory.hugetlb_pages()[1] == free_before


def test_huge_pages_are_taken_only_where_enough_are_free_or_required_naming_the_counts(monkeypatch):
    """``auto`` falls back to 4 KiB pages when too few huge pages are free or the buffer is
    smaller than one, ``0`` never takes them, ``1`` fails naming the pages needed and free;
    the 4 KiB buffer still works."""
    monkeypatch.setattr(_memory, "hugetlb_pages", lambda: (2 << 20, 1))
    monkeypatch.setenv("KVXFER_SHM_HUGETLB", "auto")
    with alloc_shared(3 << 20) as buf:  # needs 2
        assert not buf.hugetlb and os.fstat(buf.fd).st_size == 3 << 20
        buf.as_numpy()[-1] = 9
        assert buf.as_numpy()[-1] == 9
    monkeypatch.setenv("KVXFER_SHM_HUGETLB", "1")
    with pytest.raises(
        MemoryError,
        match=r"KVXFER_SHM_HUGETLB=1: a shared buffer of 3145728 bytes needs 2 huge "
        r"pages of 2097152 bytes, the host has 1 free \(vm.nr_hugepages\)",
    ):
        alloc_shared(3 << 20)
    monkeypatch.setattr(_memory, "hugetlb_pages", lambda: (2 << 20, 1 << 20))
    monkeypatch.setenv("KVXFER_SHM_HUGETLB", "auto")
    with alloc_shared(1 << 20) as buf:  # auto: under one huge page, 4 KiB pages (no page half wasted)
        assert not buf.hugetlb and os.fstat(buf.fd).st_size == 1 << 20
    monkeypatch.setenv("KVXFER_SHM_HUGETLB", "0")
    with alloc_shared(1 << 20) as buf:
        assert not buf.hugetlb and os.fstat(buf.fd).st_size == 1 << 20
    monkeypatch.setenv("KVXFER_SHM_HUGETLB", "sometimes")
    with pytest.raises(ValueError, match="KVXFER_SHM_HUGETLB='sometimes' is invalid"):
        alloc_shared(1 << 20)
