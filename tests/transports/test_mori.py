"""The ``mori`` transport's logic against ``fake_mori``, which follows MORI-IO's documented
contract: descriptor layouts, backend configuration, sessions made when a pair first exists,
one MORI call per batch, statuses kept alive, status codes mapped to our errors, failure-wins
waiting, peer-failure events, and the subprocess probe with its messages.

Two transports in this process write to each other: the fake's "RDMA" is process_vm_writev
to the engine's own pid here, so real bytes move and are compared.
"""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import textwrap
import weakref

import msgpack
import numpy as np
import pytest

from sglang_kvxfer import transports
from sglang_kvxfer.errors import PeerGoneError, TransferTimeoutError, TransportError, TransportUnavailableError
from sglang_kvxfer.transports import TicketState, get_transport
from sglang_kvxfer.transports.mori import MoriTransport
from sglang_kvxfer.transports.mori import probe as _mori_probe
from sglang_kvxfer.transports.mori import transport as mori
from tests.transports import fake_mori

TIMEOUT_S = 10.0
SC = fake_mori.StatusCode
FAKE = {"probe": False, "host": "127.0.0.1"}


@pytest.fixture(autouse=True)
def fake():
    undo = fake_mori.install()
    yield
    undo()


class Pair:
    """Writer ``a`` and target ``b``, each a MoriTransport on the fake, ``b`` zeroed."""

    def __init__(self, nbytes: int = 1 << 20, **options):
        self.a = MoriTransport(**FAKE, **options)
        self.b = MoriTransport(**FAKE)
        self.src = np.random.default_rng(3).integers(0, 256, nbytes, dtype=np.uint8)
        self.dst = np.zeros(nbytes, np.uint8)
        self.local = self.a.register(self.src.ctypes.data, nbytes)
        self.target = self.b.register(self.dst.ctypes.data, nbytes)
        self.a.add_peer("b", self.b.agent_descriptor())
        self.remote = self.a.import_region("b", self.target.descriptor)
        self.engine = self.a._engine

    def post(self, lo, ro, sz):
        return self.a.write(self.local, self.remote, *(np.asarray(v, dtype=np.int64) for v in (lo, ro, sz)))

    def landed(self, lo, ro, sz) -> bool:
        return all((self.dst[r : r + n] == self.src[l : l + n]).all() for l, r, n in zip(lo, ro, sz))

    def close(self):
        self.engine.fake.gate.set()
        self.a.close()
        self.b.close()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


# -- registry, options, descriptors --------------------------------------------------------


def test_missing_mori_names_the_package(monkeypatch):
    monkeypatch.setattr(transports, "_importable", lambda module: False)
    with pytest.raises(
        TransportUnavailableError,
        match=r"'amd-mori' \(module 'mori'\).*"
        "pip install amd-mori",
    ):
        get_transport("mori")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"host": "0.0.0.0"}, "host='0.0.0.0' cannot be advertised to peers"),
        ({"nics": "mlx5_0,,"}, None),  # empty items are dropped: valid
        ({"nics": [""]}, r"nics must be RDMA device names like \['mlx5_0', 'mlx5_1'\]"),
        ({"qp_per_transfer": 0}, "qp_per_transfer must be an int >= 1, got 0"),
        ({"num_worker_threads": 0}, "num_worker_threads must be an int >= 1 or -1, got 0"),
        ({"post_batch_size": -2}, "post_batch_size must be an int >= 1 or -1, got -2"),
        ({"max_entry_bytes": 2**32}, "max_entry_bytes must be <= 4294967295"),
    ],
)
def test_options_are_checked(options, message):
    if message is None:
        MoriTransport(**{**FAKE, **options}).close()
        return
    with pytest.raises(ValueError, match=message):
        MoriTransport(**{**FAKE, **options})


def test_backend_config_maps_our_options_and_nics(monkeypatch):
    monkeypatch.delenv("MORI_RDMA_DEVICES", raising=False)
    with MoriTransport(**FAKE) as t:  # defaults: SGLang's 4 QPs, 4 workers, auto batch
        cfg = t._engine.backends[fake_mori.BackendType.RDMA]
        assert (cfg.qp_per_transfer, cfg.post_batch_size, cfg.num_worker_threads) == (4, -1, 4)
        assert cfg.poll_cq_mode == fake_mori.PollCqMode.POLLING
        assert cfg.enable_notification is False  # completion travels on our own channel
        assert t._engine.fake.rdma_devices is None
    monkeypatch.setenv("KVXFER_MORI_QP_PER_TRANSFER", "8")
    with MoriTransport(**FAKE, nics=["mlx5_0", "mlx5_3"], num_worker_threads=2, post_batch_size=16) as t:
        cfg = t._engine.backends[fake_mori.BackendType.RDMA]
        assert (cfg.qp_per_transfer, cfg.post_batch_size, cfg.num_worker_threads) == (8, 16, 2)
        assert t._engine.fake.rdma_devices == "mlx5_0,mlx5_3"  # seen by the backend...
        assert "MORI_RDMA_DEVICES" not in os.environ  # ...and not left behind


def test_descriptors_carry_mori_packed_arrays(pair):
    agent = msgpack.unpackb(pair.a.agent_descriptor(), raw=False)
    assert agent["transport"] == "mori" and agent["what"] == "agent"
    desc = msgpack.unpackb(agent["desc"], raw=False)  # EngineDesc.pack(): 6 fields
    assert len(desc) == 6
    key, node_id, hostname, host, port, pid = desc
    assert key == agent["engine"] and host == "127.0.0.1" and port > 0 and pid == os.getpid()
    region = msgpack.unpackb(pair.local.descriptor, raw=False)
    md = msgpack.unpackb(region["md"], raw=False)  # MemoryDesc.pack(): 15 fields
    assert len(md) == 15
    assert (md[0], md[2], md[4], md[5], md[6]) == (key, -1, pair.src.ctypes.data, pair.src.nbytes, 1)  # CPU, device -1
    gpu = pair.a.register(pair.src.ctypes.data, 4096, "cuda:1")
    md = msgpack.unpackb(msgpack.unpackb(gpu.descriptor, raw=False)["md"], raw=False)
    assert (md[2], md[6], gpu.device) == (1, 2, "cuda:1")  # device 1, GPU


def test_bad_descriptors_are_refused(pair):
    env = msgpack.unpackb(pair.target.descriptor, raw=False)
    env["md"] = b"\xc1garbage"
    with pytest.raises(
        ValueError,
        match=r"region .* of peer 'b': not a MORI MemoryDesc "
        r"\(std::bad_cast\)",
    ):
        pair.a.import_region("b", msgpack.packb(env, use_bin_type=True))
    with pytest.raises(ValueError, match="region descriptor belongs to engine 'kvxfer-.*', but peer 'b' is engine"):
        pair.a.import_region("b", pair.local.descriptor)
    with pytest.raises(ValueError, match="already imported"):
        pair.a.import_region("b", pair.target.descriptor)
    agent = msgpack.unpackb(pair.b.agent_descriptor(), raw=False)
    fields = msgpack.unpackb(agent["desc"], raw=False)
    fields[4] = 0  # no control-plane port
    agent["desc"] = msgpack.packb(fields)
    with pytest.raises(ValueError, match="port=0 is not a reachable engine"):
        pair.a.add_peer("c", msgpack.packb(agent, use_bin_type=True))
    with pytest.raises(ValueError, match="peer 'self' is this engine itself"):
        pair.a.add_peer("self", pair.a.agent_descriptor())


# -- sessions, posting, statuses -----------------------------------------------------------


def test_sessions_are_made_when_a_pair_first_exists(pair):
    fake = pair.engine.fake
    assert fake.sessions_created == 1  # import_region warmed (local, remote) up
    extra = pair.a.register(pair.src.ctypes.data, 4096)
    assert fake.sessions_created == 2  # so does a region registered later
    pair.post([0], [0], [64]).wait(TIMEOUT_S)
    pair.a.write(extra, pair.remote, [0], [100], [64]).wait(TIMEOUT_S)
    assert fake.sessions_created == 2  # writes reuse them
    lazy = Pair(warmup=False)
    try:
        assert lazy.engine.fake.sessions_created == 0
        lazy.post([0], [0], [64]).wait(TIMEOUT_S)
        lazy.post([64], [64], [64]).wait(TIMEOUT_S)
        assert lazy.engine.fake.sessions_created == 1
    finally:
        lazy.close()


def test_a_batch_is_one_mori_call_with_coalesced_lists(pair):
    rng = np.random.default_rng(4)
    slots = rng.choice(512, size=300, replace=False)  # distinct 2 KiB slots, never adjacent
    lo, ro, sz = slots * 2048 + 7, slots * 2048, rng.integers(1, 2041, 300)
    pair.post(lo, ro, sz).wait(TIMEOUT_S)
    assert pair.landed(lo, ro, sz)
    ((got_lo, got_ro, got_sz),) = pair.engine.fake.submits
    assert len(got_sz) == 300 and sorted(got_ro) == got_ro  # sorted by remote offset
    pair.post([0, 4096, 8192], [0, 4096, 8192], [4096, 4096, 4096]).wait(TIMEOUT_S)
    assert pair.engine.fake.submits[-1] == ([0], [0], [12288])  # contiguous: one entry


def test_entries_over_the_limit_are_split():
    p = Pair(max_entry_bytes=1000)
    try:
        p.post([10], [20], [4096]).wait(TIMEOUT_S)
        assert p.engine.fake.submits[-1] == (
            [10, 1010, 2010, 3010, 4010],
            [20, 1020, 2020, 3020, 4020],
            [1000, 1000, 1000, 1000, 96],
        )
        assert p.landed([10], [20], [4096])
    finally:
        p.close()


def test_statuses_stay_referenced_until_terminal(pair):
    pair.engine.fake.gate.clear()  # completions held: the status stays IN_PROGRESS
    ticket = pair.post([0], [0], [4096])
    assert ticket.poll() is TicketState.PENDING
    status = weakref.ref(ticket._progress.status)
    del ticket
    gc.collect()
    assert status() is not None  # MORI holds a raw pointer: we must keep it
    pair.engine.fake.gate.set()
    assert status().WaitFor(5000) == SC.SUCCESS
    pair.a.peer_failures()  # any later call reaps ended writes
    gc.collect()
    assert status() is None and pair.a._inflight == set()
    assert pair.landed([0], [0], [4096])


@pytest.mark.parametrize(
    "code, error, text",
    [
        (SC.ERR_BAD_STATE, TransportError, "the write to peer 'b' failed: ERR_BAD_STATE: no route"),
        (SC.ERR_GPU_OP, TransportError, "ERR_GPU_OP: no route"),
        (
            SC.ERR_RDMA_OP,
            PeerGoneError,
            "RDMA write to peer 'b' failed (ERR_RDMA_OP: no route); the peer is unreachable or gone",
        ),
    ],
)
def test_status_codes_become_our_errors(pair, code, error, text):
    pair.engine.fake.fail_next = (code, "no route")
    ticket = pair.post([0], [0], [64])
    with pytest.raises(error) as info:
        ticket.wait(TIMEOUT_S)
    assert text in str(info.value) and type(info.value) is error
    assert not pair.landed([0], [0], [64])
    failures = pair.a.peer_failures()
    if code == SC.ERR_RDMA_OP:  # the peer stays failed until remove_peer/add_peer
        assert [f.peer_id for f in failures] == ["b"] and text in failures[0].reason
        with pytest.raises(PeerGoneError, match="peer 'b'"):
            pair.post([0], [0], [64]).wait(TIMEOUT_S)
        pair.a.remove_peer("b")
        pair.a.add_peer("b", pair.b.agent_descriptor())
        pair.remote = pair.a.import_region("b", pair.target.descriptor)
    else:
        assert failures == []
    pair.post([0], [0], [64]).wait(TIMEOUT_S)
    assert pair.landed([0], [0], [64])


def test_errors_found_at_submission_fail_the_ticket_at_once(pair):
    # Past our own validation (a caller of _write), MORI's bound check is the last line.
    entries = transports.base.Entries(np.array([0]), np.array([(1 << 20) - 10]), np.array([64]))
    ticket = pair.a._write(pair.local, pair.remote, entries)
    assert ticket.poll() is TicketState.FAILED
    assert "ERR_INVALID_ARGS: length out of range" in ticket.reason


def test_an_exception_on_submit_is_a_failed_ticket(pair):
    pair.engine.fake.raise_on_submit = "SQ full"
    ticket = pair.post([0], [0], [64])
    assert ticket.poll() is TicketState.FAILED
    assert ticket.reason == "mori: posting the write to peer 'b' raised RuntimeError: SQ full"
    pair.a.deregister(pair.local)  # the failed post released its source region at once


def test_wait_all_lets_failure_win_and_keeps_the_deadline(pair):
    pair.engine.fake.gate.clear()
    pending = pair.post([0], [0], [64])
    pair.engine.fake.raise_on_submit = "boom"
    failed = pair.post([64], [64], [64])
    with pytest.raises(TransportError, match="raised RuntimeError: boom"):
        pair.a.wait_all([pending, failed], timeout_s=TIMEOUT_S)
    with pytest.raises(TransferTimeoutError, match="1 of 1 tickets not complete after 0.2 s"):
        pair.a.wait_all([pending], timeout_s=0.2)
    pair.engine.fake.gate.set()
    pair.a.wait_all([pending], timeout_s=TIMEOUT_S)
    assert pending.poll() is TicketState.DONE and pair.landed([0], [0], [64])


def test_peer_failure_events_are_drained(pair):
    key = pair.b._key
    pair.engine.fake.events.append(
        fake_mori.PeerFailureEvent(key, fake_mori.PeerFailureReason.PEER_UNREACHABLE, qp_num=7, detail="retry exceeded")
    )
    pair.engine.fake.events.append(
        fake_mori.PeerFailureEvent("", fake_mori.PeerFailureReason.LOCAL_PORT_DOWN, detail="link down")
    )
    failures = pair.a.peer_failures()
    assert [f.peer_id for f in failures] == ["b", "(local device)"]
    assert "PEER_UNREACHABLE on fake0 port 1 qp 7: retry exceeded" in failures[0].reason
    assert "LOCAL_PORT_DOWN" in failures[1].reason
    assert pair.a.peer_failures() == [] and not pair.engine.fake.events  # drained
    ticket = pair.post([0], [0], [64])
    assert ticket.poll() is TicketState.FAILED and "PEER_UNREACHABLE" in ticket.reason


def test_a_pending_write_fails_when_its_peer_fails(pair):
    pair.engine.fake.gate.clear()
    ticket = pair.post([0], [0], [64])
    pair.engine.fake.events.append(fake_mori.PeerFailureEvent(pair.b._key, fake_mori.PeerFailureReason.LOCAL_QP_ERROR))
    with pytest.raises(PeerGoneError, match="LOCAL_QP_ERROR"):
        ticket.wait(TIMEOUT_S)
    assert len(pair.a._inflight) == 1  # its status is still referenced, not yet terminal
    pair.engine.fake.gate.set()
    pair.a._inflight.copy().pop().status.WaitFor(5000)
    pair.a.peer_failures()
    assert pair.a._inflight == set()


def test_works_without_pop_peer_failure():
    fake_mori.install(peer_failure_api=False)  # the autouse fixture restores the modules
    p = Pair()
    try:
        assert not hasattr(p.engine, "pop_peer_failure")
        p.post([0], [0], [4096]).wait(TIMEOUT_S)
        assert p.landed([0], [0], [4096]) and p.a.peer_failures() == []
    finally:
        p.close()


def test_remove_peer_and_close_with_a_write_pending():
    p = Pair(close_timeout_s=0.2)
    p.engine.fake.gate.clear()
    try:
        first = p.post([0], [0], [64])
        p.a.remove_peer("b")
        assert first.poll() is TicketState.FAILED
        assert "peer 'b' was removed with the write pending" in first.reason
        assert first._progress.status in mori._abandoned  # MORI may still complete it
        p.a.add_peer("b", p.b.agent_descriptor())
        p.remote = p.a.import_region("b", p.target.descriptor)
        second = p.post([0], [0], [64])
        p.a.close()
        assert "the mori transport was closed with the write pending" in second.reason
    finally:
        p.close()


def test_unreachable_peer_fails_import_region(pair):
    other = MoriTransport(**FAKE)
    region = other.register(pair.dst.ctypes.data, 4096)
    pair.a.add_peer("gone", other.agent_descriptor())
    server = other._engine._server  # its control plane stops answering
    server.shutdown(socket.SHUT_RDWR)
    server.close()
    try:
        with pytest.raises(
            TransportError, match="cannot open a session from local region 1 to region 1 of peer 'gone'"
        ):
            pair.a.import_region("gone", region.descriptor)
        assert pair.a._peers["gone"].regions == {}  # nothing half-imported
    finally:
        other.close()


# -- the probe ------------------------------------------------------------------------------


def _tree(root, *, kfd=True, gpu=True, smi=True, ports=()):
    if kfd:
        (root / "dev").mkdir(parents=True)
        (root / "dev/kfd").write_text("")
    node = root / "sys/class/kfd/kfd/topology/nodes/1"
    node.mkdir(parents=True)
    (node / "properties").write_text(f"cpu_cores_count 0\nsimd_count {256 if gpu else 0}\n")
    if smi:
        (root / "opt/rocm/lib").mkdir(parents=True)
        (root / "opt/rocm/lib/librocm_smi64.so.7").write_text("")
    for dev, port, state in ports:
        d = root / f"sys/class/infiniband/{dev}/ports/{port}"
        d.mkdir(parents=True)
        (d / "state").write_text(state + "\n")
    return str(root)


@pytest.mark.parametrize(
    "tree, nics, text",
    [
        ({"kfd": False}, (), "no AMD GPU: /dev/kfd does not exist"),
        ({"gpu": False}, (), "no AMD GPU: /dev/kfd exists but no KFD topology node has SIMDs"),
        ({"smi": False}, (), "ROCm SMI library librocm_smi64.so not found"),
        ({}, (), "no RDMA device port in state ACTIVE; /sys/class/infiniband is empty"),
        ({"ports": [("mlx5_0", 1, "1: DOWN")]}, (), "ports seen: mlx5_0/1: 1: DOWN"),
        ({"ports": [("mlx5_0", 1, "4: ACTIVE")]}, ("mlx5_1",), "no RDMA device port in state ACTIVE among nics mlx5_1"),
        ({"ports": [("mlx5_0", 1, "4: ACTIVE")]}, ("mlx5_0",), None),
    ],
)
def test_host_facts_say_what_is_missing(tmp_path, monkeypatch, tree, nics, text):
    monkeypatch.setenv("LD_LIBRARY_PATH", "")
    missing = _mori_probe.host_facts(_tree(tmp_path, **tree), nics)
    assert missing is None if text is None else text in missing


def _shim(tmp_path, create_backend: str):
    """A ``mori`` package whose RDMA backend creation does ``create_backend``."""
    pkg = tmp_path / "shim/mori"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "io.py").write_text(
        textwrap.dedent(f"""
        import os
        class BackendType: RDMA = 2
        class PollCqMode: POLLING = 0
        class IOEngineConfig:
            def __init__(self, host, port): pass
        class RdmaBackendConfig:
            def __init__(self, *args): pass
        class IOEngine:
            def __init__(self, key, config): pass
            def create_backend(self, kind, config):
                {create_backend}
    """)
    )
    return str(tmp_path / "shim")


@pytest.mark.parametrize(
    "create_backend, text",
    [
        ("os._exit(255)", "the MORI-IO probe process exited with status 255 during stage 'backend'"),
        ("os.abort()", "the MORI-IO probe process was killed by signal 6 during stage 'backend'"),
        (
            "raise RuntimeError('no active RDMA device on this host')",
            "creating MORI-IO's RDMA backend failed (RuntimeError: no active RDMA device on this host)",
        ),
        ("pass", None),
    ],
)
def test_probe_child_survives_what_mori_does(tmp_path, monkeypatch, create_backend, text):
    root = _tree(tmp_path / "root", ports=[("mlx5_0", 1, "4: ACTIVE")])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([_shim(tmp_path, create_backend), *sys.path]))
    missing = _mori_probe._run_child((), root, 60)
    assert missing is None if text is None else text in missing


def test_probe_reports_mori_missing_and_caches_its_verdict(tmp_path, monkeypatch):
    monkeypatch.setattr(_mori_probe, "_cache", {})
    runs = []
    real = _mori_probe._run_child
    monkeypatch.setattr(_mori_probe, "_run_child", lambda *a: runs.append(a) or real(*a))
    for _ in range(2):
        with pytest.raises(
            TransportUnavailableError, match="transport 'mori' cannot run here: mori.io cannot be imported"
        ):
            MoriTransport(host="127.0.0.1")  # probe=True: the child has no fake mori
    assert len(runs) == 1


def test_probe_runs_as_a_module(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "sglang_kvxfer.transports.mori.probe", "--root", str(tmp_path), "--no-backend"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0
    assert '"stage": "done", "ok": false' in out.stdout.splitlines()[-1]


def test_importing_the_module_loads_no_mori_and_no_torch():
    code = (
        "import sys, sglang_kvxfer.transports.mori;print([m for m in ('mori', 'mori.io', 'torch') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_adding_a_peer_again_replaces_it(pair):
    pair.a.add_peer("b", pair.b.agent_descriptor(), secret=bytes(32))  # not "already added"
    pair.remote = pair.a.import_region("b", pair.target.descriptor)
    pair.post([0], [0], [64]).wait(TIMEOUT_S)
    assert pair.landed([0], [0], [64])
