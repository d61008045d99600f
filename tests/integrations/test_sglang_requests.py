"""One request at a time through our SGLang classes, prefill and decode managers in this
process: SGLang's KVPoll contract (monotonic, Failed terminal, failure_exception), the aux
slot written before Success, and every way a scheduler call can fail a request, each with
its message."""

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
    "KVXFER_STAGING_BYTES": str(1 << 20),
    "KVXFER_STAGING_SLOT_BYTES": str(16 << 10),
    "KVXFER_BOOTSTRAP_TIMEOUT_S": "10",
    "KVXFER_WAITING_TIMEOUT_S": "10",
    "KVXFER_TRANSFER_TIMEOUT_S": "10",
    "KVXFER_HEARTBEAT_INTERVAL_S": "0.2",
    "KVXFER_HEARTBEAT_TIMEOUT_S": "3",
}
FAILED, BOOTSTRAPPING, WAITING, TRANSFERRING, SUCCESS = range(5)
_rooms = itertools.count(0x1000_0000_0001)


def poll_until(handle, want, timeout_s=10.0, seen=None) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = int(handle.poll())
        if seen is not None:
            seen.append(state)
        if state == FAILED or state >= want:
            return state
        time.sleep(0.002)
    raise AssertionError(f"poll stuck at {handle.poll()} after {timeout_s} s (wanted {want})")


def failure(handle) -> Exception:
    with pytest.raises(Exception) as info:
        handle.failure_exception()
    return info.value


class Deployment:
    """A bootstrap server, one prefill rank and one decode rank (TP 1 each)."""

    def __init__(
        self, backend, defs, model: Model, decode_model: Model | None = None, prefill_args: dict | None = None
    ):
        self.backend, self.model = backend, model
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.boot = backend.KVXferKVBootstrapServer("127.0.0.1", self.port)
        self.pmem = rank_memory(model, 1, 0, "prefill")
        self.dmem = rank_memory(decode_model or model, 1, 0, "decode")
        self.dmem.kv_args.kv_head_num, self.dmem.kv_args.total_kv_head_num = model.total_kv_heads, model.total_kv_heads
        self.closers = [self.boot.close]
        prefill_sa = server_args("m", "prefill", 1, self.port)
        for name, value in (prefill_args or {}).items():  # e.g. its HTTP "port"
            setattr(prefill_sa, name, value)
        self.pre = backend.KVXferKVManager(self.pmem.kv_args, defs.DisaggregationMode.PREFILL, prefill_sa, False)
        self.closers.append(self.pre.close)
        self.dec = backend.KVXferKVManager(
            self.dmem.kv_args, defs.DisaggregationMode.DECODE, server_args("m", "decode", 1, self.port + 1), False
        )
        self.closers.append(self.dec.close)
        self.pre.register_to_bootstrap()

    def pair(self):
        room = next(_rooms)
        rx = self.backend.KVXferKVReceiver(self.dec, self.addr, room)
        tx = self.backend.KVXferKVSender(self.pre, self.addr, room)
        return room, tx, rx

    def handshake(self, tx, rx, pages=(3, 4, 5), slot=1):
        deadline = time.monotonic() + 10
        while not self.dec.try_ensure_parallel_info(self.addr):
            assert time.monotonic() < deadline, "prefill info never arrived"
            time.sleep(0.01)
        rx.init(0)
        assert poll_until(rx, WAITING) == WAITING
        rx.send_metadata(np.asarray(pages, dtype=np.int32), slot, [], decode_prefix_len=0)
        assert poll_until(tx, WAITING) == WAITING

    def close(self):
        for close in reversed(self.closers):
            close()


@pytest.fixture(scope="module")
def sglang_backend():
    with pytest.MonkeyPatch.context() as mp:
        for k, v in ENV.items():
            mp.setenv(k, v)
        from sglang_kvxfer.integrations import sglang as backend

        yield backend, load_utils_defs()


@pytest.fixture(scope="module")
def dep(sglang_backend):
    with pytest.MonkeyPatch.context() as mp:
        for k, v in ENV.items():
            mp.setenv(k, v)
        d = Deployment(*sglang_backend, Model())
        yield d
        d.close()


def test_success_polls_move_forward_only_and_aux_lands_before_success(dep):
    room, tx, rx = dep.pair()
    seen_rx, seen_tx = [], []
    assert int(rx.poll()) == BOOTSTRAPPING
    deadline = time.monotonic() + 10
    while not dep.dec.try_ensure_parallel_info(dep.addr):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.05)
    assert int(rx.poll()) == BOOTSTRAPPING, "a receiver reports WaitingForInput only after init()"
    rx.init(0)
    poll_until(rx, WAITING, seen=seen_rx)
    rx.send_metadata(np.asarray([6, 7, 8], dtype=np.int32), 2, [], decode_prefix_len=0)
    poll_until(tx, WAITING, seen=seen_tx)
    tx.init(3, 5)
    dep.pmem.k[0][6 * 4 : 9 * 4] = 0.25  # the prefill's pages 6..8 of layer 0's K
    dep.pmem.meta["bootstrap_room"][5, 0] = room
    dep.pmem.meta["output_ids"][5, 0] = 4242
    tx.send(np.asarray([6, 7, 8], dtype=np.int32), [], num_kv_tokens=10)
    while True:
        state = poll_until(rx, SUCCESS, seen=seen_rx)
        if state == SUCCESS:  # what SGLang's metadata gate reads is already in place
            assert int(dep.dmem.meta["bootstrap_room"][2, 0]) == room
            assert int(dep.dmem.meta["output_ids"][2, 0]) == 4242
            break
    assert poll_until(tx, SUCCESS, seen=seen_tx) == SUCCESS
    for seen in (seen_rx, seen_tx):
        assert seen == sorted(seen) and seen[-1] == SUCCESS, seen
    assert float(dep.dmem.k[0][6 * 4 : 9 * 4].float().min()) == 0.25
    assert int(rx.poll()) == SUCCESS and int(tx.poll()) == SUCCESS  # stays
    # 3 pages x 4 tokens x 4 heads x (K 16 + V 8) x 2 layers x 2 bytes
    assert tx.get_transfer_metric().transfer_total_bytes == 3 * 4 * 4 * 24 * 2 * 2
    tx.clear()
    rx.clear()


def test_send_before_init_fails_the_request_with_the_reason(dep):
    _, tx, rx = dep.pair()
    dep.handshake(tx, rx)
    tx.send(np.asarray([1, 2, 3], dtype=np.int32), [])
    assert int(tx.poll()) == FAILED
    exc = failure(tx)
    assert type(exc).__name__ == "KVXferTransferError" and not exc.is_from_another_rank
    assert exc.failure_reason == "send(): send() came before init()"
    assert poll_until(rx, SUCCESS) == FAILED  # the decode side hears it
    assert "send() came before init()" in failure(rx).failure_reason
    tx.init(3, 1)
    tx.send(np.asarray([1, 2, 3], dtype=np.int32), [])
    assert int(tx.poll()) == FAILED  # terminal


def test_chunks_past_the_page_count_fail_the_request(dep):
    _, tx, rx = dep.pair()
    dep.handshake(tx, rx)
    tx.init(3, 1)
    tx.send(np.asarray([1, 2], dtype=np.int32), None)
    tx.send(np.asarray([3, 4], dtype=np.int32), [])
    assert failure(tx).failure_reason == "send(): pages [2, 4) run past num_kv_indices=3 given to init()"


def test_bad_scheduler_arguments_fail_the_request_by_name(dep):
    _, tx, rx = dep.pair()
    tx.init(3, 99)
    assert failure(tx).failure_reason == "init(): aux_index=99 must be a slot in [0, 8)"
    _, tx, rx = dep.pair()
    rx.init(1)
    reason = failure(rx).failure_reason
    assert "init(): prefill_dp_rank=1 names no DP group of the prefill at 127.0.0.1:" in reason, reason
    want = "it registered dp_size=1, so ranks 0..0 (DP groups registered when this decode read its info: [0])"
    assert want in reason, reason
    _, tx, rx = dep.pair()
    rx.init(0)
    rx.send_metadata(np.asarray([1, 2], dtype=np.int32), 0, [], decode_prefix_len=6)
    assert "decode_prefix_len=6 is not a whole number of decode pages (page_size=4)" in failure(rx).failure_reason
    _, tx, rx = dep.pair()
    rx.init(0)
    rx.send_metadata(np.asarray([1, 2], dtype=np.int32), 0, [], decode_prefix_len=-4)
    assert "decode_prefix_len=-4 must be an int >= 0" in failure(rx).failure_reason
    _, tx, rx = dep.pair()
    rx.init(0)
    rx.send_metadata(np.asarray([[1, 2]], dtype=np.int32), 0, [])
    assert "kv_indices must be a 1-D integer array, got shape (1, 2)" in failure(rx).failure_reason
    _, tx, rx = dep.pair()
    rx.init(0)
    rx.send_metadata(np.asarray([1, 2], dtype=np.int32), 0, [np.asarray([3])])
    assert "state_indices were given, but this server keeps no per-request state" in failure(rx).failure_reason
    rx = dep.backend.KVXferKVReceiver(dep.dec, "no-port-here", next(_rooms))
    assert int(rx.poll()) == FAILED
    assert "bootstrap_addr='no-port-here' must look like 'host:port'" in failure(rx).failure_reason


def test_an_unexpected_error_in_a_scheduler_call_fails_only_that_request(dep):
    class BrokenEvent:
        def synchronize(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    _, tx, rx = dep.pair()
    dep.handshake(tx, rx)
    tx.init(3, 1)
    tx.send(np.asarray([1, 2, 3], dtype=np.int32), [], num_kv_tokens=12, indices_event=BrokenEvent())
    assert failure(tx).failure_reason == ("send(): RuntimeError: CUDA error: an illegal memory access was encountered")
    _, tx, rx = dep.pair()  # the next request is served
    dep.handshake(tx, rx)
    tx.init(3, 1)
    tx.send(np.asarray([1, 2, 3], dtype=np.int32), [])
    assert poll_until(rx, SUCCESS) == SUCCESS and poll_until(tx, SUCCESS) == SUCCESS


def test_decode_abort_reaches_the_prefill(dep):
    _, tx, rx = dep.pair()
    dep.handshake(tx, rx)
    rx.abort()
    assert int(rx.poll()) == FAILED and rx.abort_notified
    assert poll_until(tx, SUCCESS) == FAILED
    assert "decode rank 0 aborted the request: aborted by SGLang (AbortReq)" in failure(tx).failure_reason


def test_failure_seen_only_through_the_all_reduce_is_marked_and_ends_the_local_room(dep):
    _, tx, rx = dep.pair()
    dep.handshake(tx, rx)
    assert int(tx.poll()) == WAITING  # this rank is fine; another TP rank failed
    exc = failure(tx)
    assert exc.is_from_another_rank and exc.failure_reason == "Failed due to an unknown reason from another rank"
    assert int(tx.poll()) == FAILED
    assert poll_until(rx, SUCCESS) == FAILED  # the local room was ended, and the decode told
    assert "another TP rank failed this request" in failure(rx).failure_reason


def test_wrong_manager_kinds_are_refused(dep):
    with pytest.raises(TypeError, match="mgr must be a prefill KVXferKVManager"):
        dep.backend.KVXferKVSender(dep.dec, dep.addr, 1)
    with pytest.raises(TypeError, match="mgr must be a decode KVXferKVManager"):
        dep.backend.KVXferKVReceiver(dep.pre, dep.addr, 1)
    with pytest.raises(ValueError, match="bootstrap_room=None must be an int"):
        dep.backend.KVXferKVReceiver(dep.dec, dep.addr, None)
    with pytest.raises(ValueError, match="try_ensure_parallel_info\\(\\) is a decode-side call"):
        dep.pre.try_ensure_parallel_info(dep.addr)
    assert dep.dec.try_ensure_parallel_info("not-an-address") is False


def test_unsupported_server_settings_refuse_the_manager(sglang_backend):
    backend, defs = sglang_backend
    mem = rank_memory(Model(), 2, 0, "decode")
    args = server_args("m", "decode", 2, free_port(), dcp_size=2)
    with pytest.raises(Exception, match="does not support --dcp-size=2: decode context parallel needs an MLA KV pool"):
        backend.KVXferKVManager(mem.kv_args, defs.DisaggregationMode.DECODE, args, False)
    with pytest.raises(ValueError, match="disaggregation_mode=.* must be PREFILL or DECODE"):
        backend.KVXferKVManager(mem.kv_args, defs.DisaggregationMode.NULL, args, False)


def test_metadata_layout_mismatch_fails_the_decode_with_the_buffer(sglang_backend):
    with pytest.MonkeyPatch.context() as mp:
        for k, v in ENV.items():
            mp.setenv(k, v)
        d = Deployment(*sglang_backend, Model(), decode_model=Model(hidden_size=16))
        try:
            room, tx, rx = d.pair()
            d.handshake(tx, rx)
            tx.init(3, 0)
            tx.send(np.asarray([1, 2, 3], dtype=np.int32), [])
            assert poll_until(rx, SUCCESS) == FAILED
            assert failure(rx).failure_reason == (
                "aux slot 1: aux buffer 8: prefill sent 64 bytes per slot, this decode rank holds 32 "
                "(run both servers with the same SGLang version and metadata options)"
            )
            assert int(d.dmem.meta["bootstrap_room"][1, 0]) == 0  # nothing written: the gate stays shut
        finally:
            d.close()


def test_page_size_mismatch_fails_requests_at_init(sglang_backend):
    with pytest.MonkeyPatch.context() as mp:
        for k, v in ENV.items():
            mp.setenv(k, v)
        d = Deployment(*sglang_backend, Model(), decode_model=Model(page_size=8))
        try:
            _, tx, rx = d.pair()
            deadline = time.monotonic() + 10
            while not d.dec.try_ensure_parallel_info(d.addr):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            rx.init(0)
            assert int(rx.poll()) == FAILED
            assert failure(rx).failure_reason == (
                "page_size: prefill=4 decode=8 (start both servers with the same --page-size)"
            )
            assert poll_until(tx, SUCCESS) == FAILED  # the prefill side hears it
        finally:
            d.close()


def test_parallel_info_is_known_while_the_prefill_rank_has_not_answered_the_registration(sglang_backend):
    """SGLang 0.5.23's decode gives up on a bootstrap address after 15 calls of
    try_ensure_parallel_info about a second apart. A prefill rank whose I/O thread is held
    (as by CPU starvation) must not make it give up: the info comes from the bootstrap, and
    the request waits in Bootstrapping until the rank answers, then goes on."""
    import threading

    with pytest.MonkeyPatch.context() as mp:
        for k, v in ENV.items():
            mp.setenv(k, v)
        d = Deployment(*sglang_backend, Model())
        release = threading.Event()
        engine = d.pre.prefill_engine
        answer = engine._on_register
        held: list[float] = []

        def held_register(msg):  # the prefill rank's I/O thread, stuck until released
            held.append(time.monotonic())
            release.wait(30)
            answer(msg)

        mp.setattr(engine, "_on_register", held_register)
        try:
            room, tx, rx = d.pair()
            calls, deadline = 0, time.monotonic() + 10
            while not d.dec.try_ensure_parallel_info(d.addr):
                calls += 1
                assert time.monotonic() < deadline, f"no parallel info after {calls} calls"
                time.sleep(0.05)
            info = d.dec.prefill_info_table[d.addr]
            assert (info.attn_tp_size, info.dp_size, info.problem) == (1, 1, "")
            rx.init(0)
            time.sleep(0.3)
            assert held, "the decode rank never registered with the prefill rank"
            assert int(rx.poll()) == BOOTSTRAPPING  # the rank has not accepted this decode rank yet
            release.set()
            assert poll_until(rx, WAITING) == WAITING
            rx.send_metadata(np.asarray([3, 4, 5], dtype=np.int32), 1, [], decode_prefix_len=0)
            assert poll_until(tx, WAITING) == WAITING
        finally:
            release.set()
            d.close()


class _PrefillApi:
    """A stand-in for the prefill server's HTTP API: records each POST, answers ``status``."""

    def __init__(self, status: int = 200):
        import http.server
        import json
        import threading

        self.posts: list[tuple[str, dict]] = []
        self.status = status
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                api.posts.append((self.path, json.loads(body)))
                self.send_response(api.status)
                self.end_headers()
                self.wfile.write(b'{"text": "recomputed"}' if api.status < 400 else b"prefill says no")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_retracted_request_asks_the_prefill_server_to_compute_it_again(sglang_backend):
    """PD retraction with prefill recompute: the decode's leader POSTs SGLang's payload to
    ``/generate`` at the HTTP port the prefill registered with the bootstrap (protocol 10,
    ``api_port``), and the request then moves as any other; an HTTP error fails it naming
    the URL and the answer."""
    api = _PrefillApi()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in ENV.items():
            mp.setenv(k, v)
        d = Deployment(*sglang_backend, Model(), prefill_args={"port": api.port})
        try:
            room, tx, rx = d.pair()
            deadline = time.monotonic() + 10
            while not d.dec.try_ensure_parallel_info(d.addr):
                assert time.monotonic() < deadline, "prefill info never arrived"
                time.sleep(0.01)
            assert d.dec.prefill_info_table[d.addr].prefill_http_port == api.port
            rx.init(0)
            payload = {"rid": "r-1", "input_ids": [5, 6, 7], "bootstrap_room": room, "sampling_params": {}}
            d.dec.submit_prefill_recompute(rx, payload)
            while not api.posts:
                assert time.monotonic() < deadline, "the prefill server was never asked"
                time.sleep(0.01)
            assert api.posts == [("/generate", payload)]
            assert poll_until(rx, WAITING) == WAITING  # the request goes on as any other
            rx.send_metadata(np.asarray([3, 4, 5], dtype=np.int32), 1, [], decode_prefix_len=0)
            assert poll_until(tx, WAITING) == WAITING
            tx.init(3, 1)
            tx.send(np.asarray([7, 8, 9], dtype=np.int32), [])
            assert poll_until(rx, SUCCESS) == SUCCESS and poll_until(tx, SUCCESS) == SUCCESS

            api.status = 503
            room, tx, rx = d.pair()
            rx.init(0)
            d.dec.submit_prefill_recompute(rx, {"rid": "r-2", "bootstrap_room": room})
            assert poll_until(rx, SUCCESS) == FAILED  # (no metadata: it can only fail)
            reason = failure(rx).failure_reason
            assert f"POST http://127.0.0.1:{api.port}/generate answered 503: prefill says no" in reason, reason
        finally:
            d.close()
            api.close()
