"""Fixtures of the transport contract suite: which transports run, peers, writers.

``--transport NAME[,NAME]`` (declared in ``tests/conftest.py``) picks transports (default:
every available one). Each case is (transport, options, memory kind of the peer's region);
a new backend adds its cases to ``CASES``. A case in ``HOOKS`` runs against a stand-in that
its hook installs in this process and in each peer (``mori`` against ``fake_mori``), so it
runs whether or not the real package is installed. Peers are spawned once per module and
case; writers are fresh per test.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from sglang_kvxfer.transports import available_transports, get_transport
from tests.transports.transport_peer import WRITER_SECRET, PeerProcess

REGION_BYTES = 4 << 20

# case id -> (transport name, options, peer memory: "shm" from alloc_shared or "private")
CASES = {
    "local-shm": ("local", {}, "shm"),
    "local-cma": ("local", {}, "private"),
    "tcp": ("tcp", {}, "private"),
    "tcp-3conn": ("tcp", {"num_connections": 3, "split_min_bytes": 64 << 10}, "private"),
    # UCX picks cma here (one process_vm_writev per descriptor); tcp is the cross-host path
    "nixl": ("nixl", {}, "private"),
    "nixl-tcp": ("nixl", {"ucx_tls": "tcp"}, "private"),
    "mori-fake": ("mori", {"probe": False, "host": "127.0.0.1"}, "private"),
}
# case id -> "module:function" that installs a stand-in and returns a function undoing it
HOOKS = {"mori-fake": "tests.transports.fake_mori:install"}


def selected_cases(config) -> list[str]:
    wanted = config.getoption("--transport", default=None)
    names = wanted.split(",") if wanted else [t for t, _, _ in CASES.values()]
    unknown = set(names) - {t for t, _, _ in CASES.values()}
    if unknown:
        raise pytest.UsageError(f"--transport: no contract cases for {sorted(unknown)}")
    available = set(available_transports())
    return [case for case, (t, _, _) in CASES.items() if t in names and (t in available or case in HOOKS)]


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", selected_cases(metafunc.config), scope="module")


@pytest.fixture(scope="module")
def stand_in(case):
    """Installs the case's stand-in (if any) in this process for the module's tests."""
    hook = HOOKS.get(case)
    if hook is None:
        yield None
        return
    module, _, func = hook.partition(":")
    undo = getattr(importlib.import_module(module), func)()
    yield hook
    undo()


@pytest.fixture(scope="module")
def peer(case, stand_in):
    name, options, memory = CASES[case]
    proc = PeerProcess(name, options, memory, REGION_BYTES, stand_in)
    assert proc.setup_error is None, proc.setup_error
    yield proc
    proc.close()


@pytest.fixture
def fresh_peer(case, stand_in):
    """A peer of its own, for tests that stop or kill it."""
    name, options, memory = CASES[case]
    proc = PeerProcess(name, options, memory, REGION_BYTES, stand_in)
    assert proc.setup_error is None, proc.setup_error
    yield proc
    proc.close()


class Writer:
    """The test side: a transport with a random source region, connected to a peer."""

    def __init__(self, case: str, peer: PeerProcess, src_bytes: int = REGION_BYTES):
        name, options, _ = CASES[case]
        self.transport = get_transport(name, **options)
        self.src = np.random.default_rng(12345).integers(0, 256, src_bytes, dtype=np.uint8)
        self.local = self.transport.register(self.src.ctypes.data, src_bytes)
        self.transport.add_peer("peer", peer.agent, secret=WRITER_SECRET)
        self.remote = self.transport.import_region("peer", peer.region)

    def write(self, lo, ro, sz):
        return self.transport.write(
            self.local,
            self.remote,
            np.asarray(lo, dtype=np.int64),
            np.asarray(ro, dtype=np.int64),
            np.asarray(sz, dtype=np.int64),
        )

    def close(self):
        self.transport.close()


@pytest.fixture
def writer(case, peer):
    w = Writer(case, peer)
    yield w
    w.close()


def apply(model: np.ndarray, src: np.ndarray, lo, ro, sz) -> None:
    """What the batch must do to the peer's region, applied to a numpy model of it."""
    for l, r, n in zip(lo, ro, sz):
        model[r : r + n] = src[l : l + n]
