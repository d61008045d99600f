"""A silent peer on this host: the kernel tells exited, stopped and starved apart.

``engine/liveness.py`` is checked against real child processes (busy, idle, stopped, killed).
The engine's rule is checked two ways: with real rank processes (a SIGKILLed prefill rank
fails the decode's request long before the heartbeat timeout, naming the exit; a SIGSTOPped
one at the timeout, naming the stop), and with an in-process pair whose prefill goes silent
while its heartbeats name a real child process as its own (busy: the decode waits, and the
request then moves and verifies every byte; idle, stopped, or the grace turned off: the
decode declares it gone at the timeout).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from sglang_kvxfer.cluster.group import make_spec, open_groups
from sglang_kvxfer.engine import BootstrapServer, KVPoll, KVReceiver, KVSender
from sglang_kvxfer.engine.liveness import PeerProcess, host_id, sample
from sglang_kvxfer.engine.synthetic import fill_request
from tests.engine.harness import FAST, Cluster, geometry, wait_terminal

BUSY = "while True: pass"
IDLE = "import time; time.sleep(120)"


def child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def watch(proc: PeerProcess, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        proc.look(time.monotonic())
        time.sleep(0.05)


def test_host_id_is_this_hosts_boot_and_pid_namespace():
    hid = host_id()
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert hid.startswith(f.read().strip() + "/pid:["), hid
    out = subprocess.run(
        [sys.executable, "-c", "from sglang_kvxfer.engine.liveness import host_id; print(host_id())"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == hid


def test_the_kernel_tells_a_busy_an_idle_a_stopped_and_an_exited_process_apart():
    busy, idle = child(BUSY), child(IDLE)
    try:
        time.sleep(0.3)
        p_busy, p_idle = PeerProcess(busy.pid, 0.3), PeerProcess(idle.pid, 0.3)
        watch(p_busy, 0.8)
        watch(p_idle, 0.8)
        assert p_busy.verdict() == "scheduled" and p_busy.share > 0.3, p_busy.share
        assert p_idle.verdict() is None and p_idle.share < 0.05, p_idle.share
        os.kill(busy.pid, signal.SIGSTOP)
        time.sleep(0.1)
        p_busy.quiet()
        watch(p_busy, 0.8)
        assert p_busy.verdict() == "stopped" and p_busy.share < 0.05, (p_busy.verdict(), p_busy.share)
        os.kill(busy.pid, signal.SIGKILL)
        time.sleep(0.2)
        assert sample(busy.pid) is not None and sample(busy.pid).dead  # a zombie until reaped
        p_busy.look(time.monotonic())
        assert p_busy.verdict() == "exited"
        busy.wait(10)
        assert sample(busy.pid) is None
        assert PeerProcess(busy.pid, 0.3).verdict() is None  # a pid never seen alive is not judged
    finally:
        for p in (busy, idle):
            p.kill()
            p.wait(10)


# -- real rank processes -----------------------------------------------------------------------
# the in-process harness's options with an 8 s heartbeat timeout (a kill must beat it by far)
OPTS = dict(FAST, bootstrap_timeout_s=30.0, waiting_timeout_s=30.0, transfer_timeout_s=30.0, heartbeat_timeout_s=8.0)


def job(room: int, delay_s: float = 0.0) -> dict:
    return {"room": room, "tokens": 64, "chunk_tokens": 8, "aux": b"a", "verify": True, "chunk_delay_s": delay_s}


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_killed_prefill_rank_on_this_host_is_gone_at_once_and_a_stopped_one_at_the_timeout(fault):
    with BootstrapServer() as boot:
        g = geometry(h=4, num_pages=64)
        spec_p = make_spec("prefill", g, 2, boot.address, "local", options=OPTS, concurrency=2)
        spec_d = make_spec("decode", g, 1, boot.address, "local", options=OPTS, concurrency=2)
        pre, dec = open_groups(spec_p, spec_d)
        with pre, dec:
            fp, fd = pre.submit(job(1)), dec.submit(job(1))
            assert all(r["ok"] for r in fp.result(30) + fd.result(30))
            victim = pre.pids[1]
            fd = dec.submit(job(2, delay_s=0.3))  # 8 chunks, 0.3 s apart: the decode waits ~2.4 s
            pre.submit(job(2, delay_s=0.3))
            time.sleep(0.8)
            os.kill(victim, getattr(signal, fault))
            t_fault = time.monotonic()
            try:
                (res,) = fd.result(30)
                waited = time.monotonic() - t_fault
            finally:
                if fault == "SIGSTOP":
                    os.kill(victim, signal.SIGCONT)
            assert not res["ok"], res
            assert "prefill rank 1 is gone" in res["reason"], res["reason"]
            if fault == "SIGKILL":
                assert f"its process {victim} on this host exited" in res["reason"], res["reason"]
                # not the heartbeat timeout (8 s): the kernel said the process is gone
                assert waited < OPTS["heartbeat_timeout_s"] / 2, f"took {waited:.1f} s"
            else:
                assert f"its process {victim} on this host is stopped" in res["reason"], res["reason"]
                assert waited >= OPTS["heartbeat_timeout_s"] - 1.0, f"took {waited:.1f} s"


# -- the grace of a starved peer, in process ---------------------------------------------------
def silent_prefill_named(c: Cluster, pid: int) -> None:
    """The prefill's heartbeats name process ``pid`` from now on; wait until the decode
    watches it."""
    c.pre[0]._pid = pid
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        peers = [p for m in c.dec for p in m._peers()]
        if peers and all(p.process is not None and p.process.pid == pid for p in peers):
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the decode never watched the named process")
    c.pre[0]._next_heartbeat = math.inf  # silent from now on


def resume(c: Cluster) -> None:
    c.pre[0]._next_heartbeat = 0.0


def run_through_silence(c: Cluster, room: int, silence_s: float) -> tuple[list, list, object]:
    """Post a request, keep the prefill silent for ``silence_s``, then let it send."""
    tokens = 12
    src, dst, rxs = c.receive(room, tokens)
    m = c.pre[0]
    fill_request(m.placement, m.pool.buffers, room, src, 0, tokens)
    tx = KVSender(m, room)
    time.sleep(silence_s)
    resume(c)
    if tx.poll() not in (KVPoll.Failed,):
        tx.send(src, last_chunk=True, aux=b"aux")
    return [tx], rxs, dst


GRACE_OPTS = dict(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0, heartbeat_starved_grace_s=30.0)


@pytest.mark.parametrize(
    "case", ["busy", "idle", "stopped", "busy, no grace"], ids=["busy", "idle", "stopped", "no-grace"]
)
def test_a_silent_peer_whose_process_is_still_scheduled_gets_the_grace_and_others_do_not(case, caplog):
    opts = dict(GRACE_OPTS, heartbeat_starved_grace_s=0.0) if case == "busy, no grace" else GRACE_OPTS
    proc = child(IDLE if case == "idle" else BUSY)
    try:
        if case == "stopped":
            os.kill(proc.pid, signal.SIGSTOP)
        with caplog.at_level(logging.WARNING, logger="sglang_kvxfer"):
            with Cluster(1, 1, geometry(h=4), prefill_opts=GRACE_OPTS, decode_opts=opts) as c:
                txs, rxs, dst = c.start(1, 12)
                assert wait_terminal(txs + rxs) == [KVPoll.Success] * 2
                silent_prefill_named(c, proc.pid)
                txs, rxs, dst = run_through_silence(c, 2, 3 * GRACE_OPTS["heartbeat_timeout_s"])
                states = wait_terminal(rxs, 15)
                if case == "busy":
                    assert states == [KVPoll.Success], rxs[0].failure_reason
                    assert wait_terminal(txs) == [KVPoll.Success]
                    assert c.verify(2, dst, 12) == []
                    assert f"but its process {proc.pid} on this host is still scheduled" in caplog.text, caplog.text
                    end = time.monotonic() + 5  # its next heartbeat is logged as the end of the silence
                    while "spoke again after" not in caplog.text and time.monotonic() < end:
                        time.sleep(0.05)
                    assert "spoke again after" in caplog.text, caplog.text
                else:
                    assert states == [KVPoll.Failed]
                    reason = rxs[0].failure_reason
                    assert "prefill rank 0 is gone" in reason and "sent nothing for" in reason, reason
                    if case == "stopped":
                        assert f"its process {proc.pid} on this host is stopped" in reason, reason
                    if case == "busy, no grace":
                        assert "past KVXFER_HEARTBEAT_STARVED_GRACE_S=0.0" in reason, reason
                # the pair serves again either way (a lost prefill re-registers)
                resume(c)
                c.pre[0]._pid = os.getpid()
                ok, room = None, 10
                end = time.monotonic() + 15
                while ok is None and time.monotonic() < end:
                    room += 1
                    txs, rxs, dst = c.start(room, 12)
                    if wait_terminal(txs + rxs) == [KVPoll.Success] * 2:
                        ok = True
                    else:
                        time.sleep(0.3)
                assert ok, [r.failure_reason for r in rxs]
    finally:
        if case == "stopped":
            os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)


def test_a_busy_peer_silent_past_the_grace_is_gone_naming_the_grace():
    opts = dict(GRACE_OPTS, heartbeat_starved_grace_s=1.0)
    proc = child(BUSY)
    try:
        with Cluster(1, 1, geometry(h=4), prefill_opts=GRACE_OPTS, decode_opts=opts) as c:
            txs, rxs, _ = c.start(1, 12)  # the decode registers with the prefill
            assert wait_terminal(txs + rxs) == [KVPoll.Success] * 2
            silent_prefill_named(c, proc.pid)
            rx = KVReceiver(c.dec[0], 5)
            rx.send_metadata([1, 2, 3], num_tokens=12)
            t0 = time.monotonic()
            assert wait_terminal([rx], 15) == [KVPoll.Failed]
            waited = time.monotonic() - t0
            reason = rx.failure_reason
            assert f"its process {proc.pid} on this host is still scheduled, past" in reason, reason
            assert "KVXFER_HEARTBEAT_STARVED_GRACE_S=1.0" in reason, reason
            assert waited >= GRACE_OPTS["heartbeat_timeout_s"] + 1.0 - 0.5, f"took {waited:.1f} s"
            resume(c)
    finally:
        proc.kill()
        proc.wait(10)
