"""nixl-specific behaviour: options and UCX settings, descriptors, prepared descriptor lists,
removal with writes pending, the exit helper. The shared behaviour is in test_contract.py.

Two transports in this process write to each other (UCX loopback); tests that need a
process to stop use a peer process. A NIXL agent in this process is covered by the exit
guard in tests/conftest.py.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types

import msgpack
import numpy as np
import pytest

from sglang_kvxfer import transports
from sglang_kvxfer.errors import TransportError, TransportUnavailableError
from sglang_kvxfer.transports import TicketState, get_transport
from sglang_kvxfer.transports.nixl import agent
from tests.facts import needs_nixl
from tests.transports.transport_peer import PeerProcess

TIMEOUT_S = 10.0


def test_missing_nixl_names_the_package(monkeypatch):
    monkeypatch.setattr(transports, "_importable", lambda module: False)
    with pytest.raises(TransportUnavailableError) as info:
        get_transport("nixl")
    assert "'nixl-cu12' (module 'nixl_cu12' or 'nixl_cu13' or 'nixl')" in str(info.value)
    assert "pip install nixl-cu12" in str(info.value)


@pytest.fixture
def fake_nixl_cu13(tmp_path, monkeypatch):
    """A stand-in ``nixl_cu13`` package (``_api`` only) first on ``sys.path``; the real
    ``nixl_cu12`` and ``nixl``, where installed, are hidden from the registry's probe."""
    pkg = tmp_path / "nixl_cu13"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_api.py").write_text("FAKE = 'nixl_cu13'\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # also invalidates the import system's caches
    probe = transports._importable
    monkeypatch.setattr(transports, "_importable", lambda mod: mod not in ("nixl_cu12", "nixl") and probe(mod))
    yield
    for name in ("nixl_cu13._api", "nixl_cu13"):
        sys.modules.pop(name, None)


def test_cuda13_wheel_alone_makes_nixl_available(fake_nixl_cu13):
    importlib.invalidate_caches()
    assert "nixl" in transports.available_transports()
    assert "nixl_cu13" not in sys.modules  # probing imports nothing


def test_import_api_takes_the_cuda13_wheel(fake_nixl_cu13, monkeypatch):
    monkeypatch.setattr(agent, "_torch_cuda_major", lambda: 13)
    assert agent.import_api().FAKE == "nixl_cu13"


@pytest.mark.parametrize(
    "major, first",
    [(13, "nixl_cu13._api"), (12, "nixl_cu12._api"), (None, "nixl_cu12._api"), (11, "nixl_cu12._api")],
)
def test_api_modules_put_torchs_cuda_major_first(monkeypatch, major, first):
    monkeypatch.setattr(agent, "_torch_cuda_major", lambda: major)
    names = agent.api_modules()
    assert names[0] == first
    assert sorted(names) == ["nixl._api", "nixl_cu12._api", "nixl_cu13._api"]


@pytest.mark.parametrize(
    "cuda, version, major",
    [("13.0", "2.11.0+cu130", 13), (None, "2.11.0+cu130", 13), (None, "2.9.0+cu128", 12), (None, "2.9.0", None)],
)
def test_torch_cuda_major_without_importing_torch(monkeypatch, cuda, version, major):
    fake_torch = types.SimpleNamespace(version=types.SimpleNamespace(cuda=cuda))
    monkeypatch.setitem(sys.modules, "torch", fake_torch if cuda else None)
    monkeypatch.setattr(agent.importlib.metadata, "version", lambda dist: version)
    assert agent._torch_cuda_major() == major


@needs_nixl
@pytest.mark.parametrize(
    "options, message",
    [
        ({"ucx_error_handling_mode": "always"}, "ucx_error_handling_mode must be 'none' or 'peer', got 'always'"),
        ({"ucx_tls": "tcp,,sm"}, "ucx_tls='tcp,,sm' has an empty item"),
        ({"ucx_tls": 5}, "ucx_tls must be a str like 'tcp' or 'sm', got int"),
        ({"num_workers": 0}, "num_workers must be an int >= 1, got 0"),
        ({"max_prepped_descs": 0}, r"max_prepped_descs must be an int in \[1, 2\*\*31\), got 0"),
        ({"progress_interval_s": 0}, r"progress_interval_s must be in \(0, 1\] seconds, got 0"),
    ],
)
def test_bad_options_are_refused_with_their_value(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        get_transport("nixl", **options)


@needs_nixl
def test_ucx_tls_applies_while_the_backend_is_created_only(monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    with get_transport("nixl", ucx_tls="tcp") as t:
        assert "UCX_TLS" not in os.environ
        assert t.ucx_settings["UCX_TLS"] == "tcp"
        assert t.ucx_settings["ucx_error_handling_mode"] == "(NIXL default)"
        assert not t.caps.one_sided and not t.caps.same_host_only  # tcp puts need the target
    monkeypatch.setenv("UCX_TLS", "sm")  # the environment is respected without the option
    with get_transport("nixl") as t:
        assert os.environ["UCX_TLS"] == "sm"
        assert t.ucx_settings["UCX_TLS"] == "sm"
        assert t.ucx_settings["ucx_error_handling_mode"] == "none"  # UCX requires it for sm
        assert t.caps.one_sided and t.caps.same_host_only


class Pair:
    """Writer ``a`` and target ``b`` in this process, ``b`` holding a zeroed region."""

    def __init__(self, nbytes: int = 1 << 20, **options):
        self.a, self.b = get_transport("nixl", **options), get_transport("nixl", **options)
        self.src = np.random.default_rng(5).integers(0, 256, nbytes, dtype=np.uint8)
        self.dst = np.zeros(nbytes, np.uint8)
        self.local = self.a.register(self.src.ctypes.data, nbytes)
        self.target = self.b.register(self.dst.ctypes.data, nbytes)
        self.a.add_peer("b", self.b.agent_descriptor())
        self.remote = self.a.import_region("b", self.target.descriptor)

    def write(self, lo, ro, sz):
        lo, ro, sz = (np.asarray(v, dtype=np.int64) for v in (lo, ro, sz))
        self.a.write(self.local, self.remote, lo, ro, sz).wait(TIMEOUT_S)
        for l, r, n in zip(lo, ro, sz):
            np.testing.assert_array_equal(self.dst[r : r + n], self.src[l : l + n])

    def close(self):
        self.a.close()
        self.b.close()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


@needs_nixl
def test_page_sized_batches_reuse_the_prepared_lists(pair):
    rng = np.random.default_rng(1)
    for _ in range(3):  # 4 KiB pages at page-aligned slots: prepared once, indexed after
        pages = rng.choice(256, size=40, replace=False)
        pair.write(rng.choice(256, size=40, replace=False) * 4096, pages * 4096, np.full(40, 4096))
    assert pair.a.path_counts == {"prepped": 3, "per_batch": 0}
    assert list(pair.a._dlists[("local", pair.local.region_id)]) == [4096]
    assert list(pair.a._dlists[("b", pair.remote.region_id)]) == [4096]
    pair.write([1, 5000], [7, 90001], [333, 17])  # byte offsets: lists of its own
    assert pair.a.path_counts == {"prepped": 3, "per_batch": 1}
    pair.write([4096], [8192], [1 << 16])  # one entry of 16 4-KiB blocks: lists of its own
    assert pair.a.path_counts == {"prepped": 3, "per_batch": 2}


@needs_nixl
def test_descriptors_are_checked(pair):
    tcp = get_transport("tcp")
    try:
        with pytest.raises(ValueError, match="descriptor is for transport 'tcp'; transport 'nixl' cannot use it"):
            pair.a.add_peer("t", tcp.agent_descriptor())
    finally:
        tcp.close()
    with pytest.raises(ValueError, match="peer 'me' is this agent itself"):
        pair.a.add_peer("me", pair.a.agent_descriptor())
    own = pair.a.register(pair.src.ctypes.data, 4096)  # a's region, offered as b's
    with pytest.raises(ValueError, match="region descriptor belongs to agent 'nixl-.*', but peer 'b' is agent"):
        pair.a.import_region("b", own.descriptor)
    desc = msgpack.unpackb(pair.target.descriptor, raw=False)
    desc["mem"] = "FILE"
    with pytest.raises(ValueError, match="mem='FILE' \\(DRAM or VRAM\\)"):
        pair.a.import_region("b", msgpack.packb(desc, use_bin_type=True))
    desc.update(mem="DRAM", md=b"\x00not nixl metadata", region=99)
    with pytest.raises(TransportError, match="NIXL refused the region 99 of peer 'b'"):
        pair.a.import_region("b", msgpack.packb(desc, use_bin_type=True))


@needs_nixl
def test_deregister_and_close_release_everything(pair):
    pair.write([0], [0], [4096])
    pair.a.deregister(pair.local)
    assert ("local", pair.local.region_id) not in pair.a._dlists
    with pytest.raises(ValueError, match=f"region {pair.local.region_id} is not registered"):
        pair.a.deregister(pair.local)
    pair.a.close()
    assert pair.a._dlists == {} and pair.a._inflight == set()
    with pytest.raises(TransportError, match="transport 'nixl' is closed"):
        pair.a.add_peer("x", pair.b.agent_descriptor())


@needs_nixl
def test_close_destroys_the_agent_then_not_at_a_later_collection(pair):
    import gc
    import weakref

    pair.write([0, 8192], [4096, 0], [4096, 4096])
    agent_ref = weakref.ref(pair.a._agent)
    gc.disable()  # only reference counting may free it: close() must drop the last reference
    try:
        pair.a.close()
        assert agent_ref() is None, gc.get_referrers(agent_ref())
    finally:
        gc.enable()


@needs_nixl
def test_a_request_nixl_cannot_cancel_keeps_its_agent_alive(pair, caplog):
    from sglang_kvxfer.transports.nixl import transport as nixl_transport

    class Stuck:  # what NIXL's handle does for a request it cannot cancel
        def release(self):
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")

    stuck, agent = Stuck(), pair.a._agent
    pair.a._unreleased.append(stuck)
    try:
        with caplog.at_level("WARNING", logger="sglang_kvxfer.transports.nixl"):
            pair.a.close()
        assert (agent, [stuck]) in nixl_transport._KEPT
        assert "kept alive until the process exits (1 transfer request(s) NIXL could not cancel" in caplog.text
    finally:
        nixl_transport._KEPT[:] = [k for k in nixl_transport._KEPT if k[0] is not agent]


@needs_nixl
def test_remove_peer_fails_a_write_the_stopped_peer_cannot_finish():
    peer = PeerProcess("nixl", {"ucx_tls": "tcp"}, "private", 1 << 20)
    assert peer.setup_error is None, peer.setup_error
    t = get_transport("nixl", ucx_tls="tcp", close_timeout_s=0.3)
    src = np.ones(1 << 20, np.uint8)
    try:
        local = t.register(src.ctypes.data, src.nbytes)
        t.add_peer("p", peer.agent)
        remote = t.import_region("p", peer.region)
        t.write(local, remote, [0], [0], [4096]).wait(TIMEOUT_S)  # connected
        peer.stop()  # over tcp the target's progress must take part: the write stays pending
        ticket = t.write(local, remote, [0], [0], [1 << 20])
        assert ticket.poll() is TicketState.PENDING
        t.remove_peer("p")
        assert ticket.poll() is TicketState.FAILED
        assert "peer 'p' was removed with the write pending" in ticket.reason
        t.deregister(local)  # the write no longer holds the region
    finally:
        peer.kill()
        t.close()
        peer.close()


def test_exit_process_flushes_and_keeps_the_status():
    code = (
        "import sys; from sglang_kvxfer.transports.nixl import exit_process;"
        "print('written'); sys.stderr.write('also'); exit_process(3)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 3
    assert out.stdout == "written\n" and out.stderr == "also"


def test_importing_the_module_loads_no_nixl_and_no_torch():
    code = (
        "import sys, sglang_kvxfer.transports.nixl;"
        "print([m for m in ('nixl_cu12', 'nixl', 'torch') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


@needs_nixl
def test_adding_a_peer_again_replaces_it(pair):
    pair.write([0], [0], [64])
    pair.a.add_peer("b", pair.b.agent_descriptor(), secret=bytes(32))  # not "already added"
    with pytest.raises(ValueError, match="not imported"):  # the old record's imports are gone
        pair.write([0], [0], [64])
    pair.remote = pair.a.import_region("b", pair.target.descriptor)
    pair.write([64], [128], [64])
