"""SGLang's runtime prefill <-> decode role switch (``--enable-pd-role-switch``), in SGLang's
call order with our classes in this process: on an idle instance the scheduler calls the
manager's ``teardown()`` and builds a manager of the other role over the same KV pool (SGLang
starts a bootstrap on every instance with the flag). Two instances trade roles twice; each
request's bytes are compared page by page, and the bootstrap of an instance that stopped
being a prefill no longer names its old rank."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from tests.integrations.sglang_env import Model, import_sglang_base, load_utils_defs, rank_memory, server_args
from tests.ports import free_port

base, _reason = import_sglang_base()
pytestmark = pytest.mark.skipif(base is None, reason=_reason)

ENV = {
    "SGLANG_HOST_IP": "127.0.0.1",
    "KVXFER_SGLANG_TRANSPORT": "local",
    "KVXFER_BOOTSTRAP_TIMEOUT_S": "10",
    "KVXFER_WAITING_TIMEOUT_S": "10",
    "KVXFER_TRANSFER_TIMEOUT_S": "10",
    "KVXFER_HEARTBEAT_INTERVAL_S": "0.2",
    "KVXFER_HEARTBEAT_TIMEOUT_S": "3",
}
FAILED, WAITING, SUCCESS = 0, 2, 4
_rooms = itertools.count(0x2000_0000_0001)


def poll_until(handle, want: int, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = int(handle.poll())
        if state == FAILED or state >= want:
            return state
        time.sleep(0.002)
    raise AssertionError(f"poll stuck at {handle.poll()} after {timeout_s} s (wanted {want})")


class Instance:
    """One SGLang instance of TP 1: its KV pool (kept across roles), its bootstrap (SGLang
    runs one on every instance with --enable-pd-role-switch) and its current manager."""

    def __init__(self, backend, defs, model: Model):
        self.backend, self.defs = backend, defs
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.boot = backend.KVXferKVBootstrapServer("127.0.0.1", self.port)
        self.mem = rank_memory(model, 1, 0, "prefill")
        self.manager = None
        self.role = ""

    def become(self, role: str) -> None:
        """SGLang's switch: ``teardown()`` of the current manager, then one of ``role``."""
        if self.manager is not None:
            assert self.manager.supports_role_switch
            self.manager.teardown()
        mode = self.defs.DisaggregationMode.PREFILL if role == "prefill" else self.defs.DisaggregationMode.DECODE
        args = server_args("m", role, 1, self.port, enable_pd_role_switch=True)
        self.manager = self.backend.KVXferKVManager(self.mem.kv_args, mode, args, False)
        self.role = role
        if role == "prefill":
            self.manager.register_to_bootstrap()

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()
        self.boot.close()


def transfer(prefill: Instance, decode: Instance, seed: int) -> None:
    """One request prefill -> decode (SGLang's call order); its pages must land byte for byte."""
    backend = prefill.backend
    room = next(_rooms)
    rng = np.random.default_rng(seed)
    src_pages, dst_pages = rng.choice(np.arange(1, 16), size=(2, 3), replace=False)
    rx = backend.KVXferKVReceiver(decode.manager, prefill.addr, room)
    tx = backend.KVXferKVSender(prefill.manager, prefill.addr, room)
    deadline = time.monotonic() + 10
    while not decode.manager.try_ensure_parallel_info(prefill.addr):
        assert time.monotonic() < deadline, f"prefill info of {prefill.addr} never arrived"
        time.sleep(0.01)
    rx.init(0)
    assert poll_until(rx, WAITING) == WAITING
    rx.send_metadata(dst_pages.astype(np.int32), 1, [], decode_prefix_len=0)
    assert poll_until(tx, WAITING) == WAITING
    tx.init(3, 2)
    ps = 4  # Model().page_size
    for buf in prefill.mem.buffers:
        for p in src_pages:
            rows = buf[p * ps : (p + 1) * ps]
            rows.copy_(rows.new_tensor(rng.standard_normal(tuple(rows.shape))))
    tx.send(src_pages.astype(np.int32), [], num_kv_tokens=12)
    assert poll_until(rx, SUCCESS) == SUCCESS, rx.failure_exception()
    assert poll_until(tx, SUCCESS) == SUCCESS
    for i, (src, dst) in enumerate(zip(prefill.mem.buffers, decode.mem.buffers)):
        for s, d in zip(src_pages, dst_pages):
            a, b = src[s * ps : (s + 1) * ps], dst[d * ps : (d + 1) * ps]
            assert bool((a == b).all()), f"buffer {i}: prefill page {s} -> decode page {d} differs"
    tx.clear()
    rx.clear()


@pytest.fixture
def instances():
    with pytest.MonkeyPatch.context() as mp:
        for k, v in ENV.items():
            mp.setenv(k, v)
        from sglang_kvxfer.integrations import sglang as backend

        defs = load_utils_defs()
        made = [Instance(backend, defs, Model()) for _ in range(2)]
        try:
            yield made
        finally:
            for inst in made:
                inst.close()


def test_two_instances_trade_roles_and_each_request_lands(instances):
    a, b = instances
    assert Model().page_size == 4
    a.become("prefill")
    b.become("decode")
    transfer(a, b, seed=1)
    assert set(a.boot.server.registered()) == {0}
    for round_ in range(2):  # A -> decode, B -> prefill; then back
        prefill, decode = (b, a) if a.role == "prefill" else (a, b)
        old = decode  # the instance about to stop being a decode
        was = prefill
        was.become("decode")
        assert was.boot.server.registered() == {}, "the old prefill rank still registered after teardown"
        old.become("prefill")
        assert set(old.boot.server.registered()) == {0}
        transfer(old, was, seed=10 + round_)
