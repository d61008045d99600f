"""A prefill process killed (SIGKILL) in the middle of a layer-wise stream.

The prefill rank is a real process: it hands over layers [0, 1) of a request, then its
"forward pass" stalls, and the test kills it. The decode rank (this process) has scattered
layer 0 and holds nothing of layers 1..3; it must fail the request by the heartbeat
machinery with the reason, not wait for the missing layers and not report Success.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sglang_kvxfer.engine import BootstrapServer, EngineConfig, KVManager, KVPoll, KVReceiver
from tests.engine.harness import geometry, wait_terminal

OPTS = dict(
    bootstrap_timeout_s=10.0,
    waiting_timeout_s=30.0,
    transfer_timeout_s=30.0,  # longer than the heartbeat timeout: silence must be what ends it
    heartbeat_interval_s=0.2,
    heartbeat_timeout_s=1.0,
    staging_bytes=1 << 20,
    staging_slot_bytes=64 << 10,
    data_path="staged",
)
NUM_LAYERS = 4
ROOM = 77
TOKENS = 16

PREFILL = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from sglang_kvxfer.engine import EngineConfig, KVManager, KVSender
    from tests.engine.harness import geometry
    from tests.faults.test_layerwise_faults import NUM_LAYERS, OPTS, ROOM, TOKENS

    boot, transport = sys.argv[1], sys.argv[2]
    g = geometry(8, page_size=4, num_layers=NUM_LAYERS)
    mgr = KVManager(EngineConfig("prefill", g, 1, 0, boot, transport, **OPTS))
    mgr.wait_registered(10)
    tx = KVSender(mgr, ROOM)
    tx.send(np.arange(TOKENS // 4), layers=range(0, 1))
    print("streaming", flush=True)
    time.sleep(120)  # the forward of layer 1 never ends: the test kills this process
    """
)


def _wait(cond, timeout_s, what, why=lambda: ""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"{what} not within {timeout_s} s{why()}")


@pytest.mark.parametrize("transport", ["local", "tcp"])
def test_a_prefill_killed_mid_stream_fails_the_request_with_the_reason(transport):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with BootstrapServer() as boot:
        g = geometry(8, page_size=4, num_layers=NUM_LAYERS)
        dec = KVManager(EngineConfig("decode", g, 1, 0, boot.address, transport, **OPTS))
        child = subprocess.Popen(
            [sys.executable, "-c", PREFILL, boot.address, transport],
            cwd=root,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": root},
        )
        try:
            rx = KVReceiver(dec, ROOM)
            rx.send_metadata(list(range(8, 8 + TOKENS // 4)), num_tokens=TOKENS)
            why = lambda: f" (decode: {rx.poll()!r} {rx.failure_reason})"  # noqa: E731
            _wait(lambda: dec.room(ROOM).layer_tokens, 60, "the staging window", why)
            stand = dec.room(ROOM).layer_tokens[0]
            _wait(lambda: stand[0] == TOKENS, 60, "layer 0 scattered", why)
            assert rx.poll() is KVPoll.Transferring and list(stand) == [TOKENS, 0, 0, 0]
            os.kill(child.pid, signal.SIGKILL)
            child.wait(10)
            assert wait_terminal([rx], timeout_s=10) == [KVPoll.Failed]
            assert "prefill rank 0 is gone" in rx.failure_reason, rx.failure_reason
            assert list(stand) == [TOKENS, 0, 0, 0]
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(10)
            dec.close()
