"""Launchers (``kvxfer prefill|decode``) and rank processes under faults (real processes).

A rank killed with SIGKILL fails its requests at once with a reason naming it and is
started again; a launcher killed with SIGKILL takes its ranks with it; SIGTERM ends a
launcher and its ranks; a job that fails part-way aborts its peer; the client port refuses
bad fields and answers "busy" past ``--concurrency``. Every wait here has a deadline;
the time bounds are fault-detection bounds (correctness), far below the deadlines in use.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.cli.test_cli_servers import free_port

GEOMETRY = ["--layers", "2", "--total-kv-heads", "4", "--head-dim", "16", "--page-size", "8", "--num-pages", "64"]
DEADLINES = [
    "--bootstrap-timeout",
    "20",
    "--waiting-timeout",
    "30",
    "--transfer-timeout",
    "30",
    "--heartbeat-timeout",
    "3",
]


class Launcher:
    """A ``kvxfer prefill|decode`` process; its stderr is collected by a thread."""

    def __init__(self, role: str, *args: str, port: int | None = None):
        self.port = port or free_port()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sglang_kvxfer",
                role,
                "--port",
                str(self.port),
                "--log-level",
                "WARNING",
                *GEOMETRY,
                *DEADLINES,
                *args,
            ],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stderr], daemon=True).start()
        self.address = f"127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                assert self.proc.poll() is None, f"launcher exited: {self.stderr()}"
                continue
            self.seen.append(line)
            if "ready on" in line:
                return
        raise AssertionError(f"launcher not ready in time: {self.stderr()}")

    def stderr(self) -> str:
        while True:
            try:
                self.seen.append(self.lines.get_nowait())
            except queue.Empty:
                return "".join(self.seen)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def started_at(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), None if it is gone: with
    the pid, it names one process even if the pid is reused later."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


def alive(pid: int, since: int | None = None) -> bool:
    """True while ``pid`` runs (a zombie nobody reaped counts as gone; so does another
    process that reused the pid, when ``since`` is the original's start time)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            state = next(line for line in f if line.startswith("State:"))
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return False
    if since is not None and started_at(pid) != since:
        return False
    return "Z" not in state.split()[1]


def describe(pid: int) -> str:
    """What a process that should be gone is doing (for failure messages)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read()
    except OSError:
        return f"pid {pid}: gone"
    return (
        f"pid {pid}: {fields.get('State', '?').strip()}, ppid {fields.get('PPid', '?').strip()}, "
        f"threads {fields.get('Threads', '?').strip()}, wchan {wchan}"
    )


def wait_until(cond, timeout_s: float, what: str) -> float:
    """Seconds until ``cond()`` held; fails after ``timeout_s``."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, f"{what} not within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - t0


def client(address: str):
    from sglang_kvxfer.cli.client import RemoteGroup

    return RemoteGroup(address)


def job(room: int, tokens: int = 64, chunk: int = 8, delay_s: float = 0.0) -> dict:
    return {
        "room": room,
        "tokens": tokens,
        "chunk_tokens": chunk,
        "aux": b"\x01\x02",
        "verify": True,
        "chunk_delay_s": delay_s,
    }


def all_up(remote, restarts: int | None = None):
    def check() -> bool:
        info = remote.info(10)
        return all(s == "up" for s in info["states"]) and (restarts is None or info["restarts"] >= restarts)

    return check


@pytest.fixture(scope="module")
def pair():
    """A prefill TP 2 and a decode TP 2 launcher with rank restarts on (the default)."""
    bport = free_port()
    pre = Launcher("prefill", "--tp", "2", "--bootstrap-port", str(bport))
    dec = None
    try:
        pre.wait_ready()
        dec = Launcher("decode", "--tp", "2", "--bootstrap", f"127.0.0.1:{bport}")
        dec.wait_ready()
        rp, rd = client(pre.address), client(dec.address)
        try:
            yield pre, dec, rp, rd
        finally:
            rp.close()
            rd.close()
    finally:
        for launcher in (dec, pre):
            if launcher is not None:
                launcher.stop()


def run_one(rp, rd, one: dict):
    from sglang_kvxfer.cluster.workload import run_workload

    results, _ = run_workload(rp, rd, [one], 1, 60.0, progress=False)
    return results[0]


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_killed_rank_fails_its_request_at_once_and_is_restarted(pair, side):
    pre, dec, rp, rd = pair
    wait_until(all_up(rp), 30, "prefill ranks up")
    wait_until(all_up(rd), 30, "decode ranks up")
    victim_remote, victim_launcher = (rp, pre) if side == "prefill" else (rd, dec)
    before = victim_remote.info(10)
    pid = before["pids"][1]
    out: list = []
    room = 1000 + (side == "decode")
    th = threading.Thread(target=lambda: out.append(run_one(rp, rd, job(room, tokens=64, chunk=8, delay_s=0.5))))
    th.start()
    time.sleep(1.2)  # the request is part-way: ~8 chunks, 0.5 s apart
    os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    th.join(30)
    waited = time.monotonic() - t_kill
    assert out, "the request never ended"
    res = out[0]
    assert not res.ok
    assert f"{side} rank 1 (pid {pid}) died: killed by SIGKILL" in res.reason, res.reason
    assert waited < 5.0, f"the failure took {waited:.1f} s"  # not a heartbeat or a request deadline
    assert victim_launcher.proc.poll() is None, victim_launcher.stderr()  # the launcher stays up
    # the rank comes back under a new pid and the pair serves again
    wait_until(all_up(victim_remote, before["restarts"] + 1), 30, f"{side} rank restart")
    after = victim_remote.info(10)
    assert after["pids"][1] != pid and after["pids"][0] == before["pids"][0]
    # Peer ranks of the other server learn that the old process is gone by its silence
    # (heartbeat timeout, 3 s here): a request inside that window may still fail, with that
    # reason; after it, every request is served by the restarted rank.
    served_at, room_next = None, room + 10
    while served_at is None and time.monotonic() - t_kill < 20:
        res = run_one(rp, rd, job(room_next, tokens=40, chunk=16))
        room_next += 1
        if res.ok:
            served_at = time.monotonic()
        else:
            assert "is gone" in res.reason or "died" in res.reason, res.reason
    assert served_at is not None, f"no request served within 20 s of the kill: {res.reason}"
    res = run_one(rp, rd, job(room_next, tokens=40, chunk=16))
    assert res.ok and res.verified, res.reason
    log = victim_launcher.stderr()
    assert f"{side} rank 1 (pid {pid}) died: killed by SIGKILL" in log and "restarted as pid" in log, log
    assert "Traceback" not in log and "BrokenPipeError" not in log, log


def test_jobs_fail_at_once_while_a_rank_is_down_and_the_launcher_still_answers_info():
    pre = Launcher("prefill", "--tp", "2", "--bootstrap-port", str(free_port()), "--restart-ranks", "0")
    try:
        pre.wait_ready()
        rp = client(pre.address)
        try:
            pid = rp.info(10)["pids"][0]
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: rp.info(10)["states"][0] == "down", 5, "the rank marked down")
            t0 = time.monotonic()
            ranks = rp.submit(job(7)).result(10)
            assert time.monotonic() - t0 < 2.0
            assert all(not r["ok"] for r in ranks)
            assert (
                f"prefill rank 0 is down after: prefill rank 0 (pid {pid}) died: killed by SIGKILL"
                in ranks[0]["reason"]
            ), ranks
            assert "rank restarts are off" in ranks[0]["reason"]
        finally:
            rp.close()
        assert pre.proc.poll() is None
    finally:
        pre.stop()


def test_a_sigkilled_launcher_takes_its_ranks_along_within_seconds():
    pre = Launcher("prefill", "--tp", "2", "--bootstrap-port", str(free_port()))
    try:
        pre.wait_ready()
        rp = client(pre.address)
        try:
            pids = rp.info(10)["pids"]
            rp.submit(job(11, delay_s=30.0))  # no decode peer: the ranks hold this job for a long time
            time.sleep(0.5)
        finally:
            rp.close()
        since = {p: started_at(p) for p in pids}
        assert all(alive(p, since[p]) for p in pids)
        pre.proc.kill()
        t0 = time.monotonic()
        while any(alive(p, since[p]) for p in pids) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        gone = time.monotonic() - t0
        survivors = [describe(p) for p in pids if alive(p, since[p])]
        assert not survivors and gone < 3.0, f"ranks outlived their launcher by {gone:.1f} s: {survivors}"
    finally:
        pre.stop()


def test_a_burst_of_sigterms_ends_a_rank_promptly():
    """PR_SET_PDEATHSIG sends one signal per launcher thread as they die: a burst of
    SIGTERMs must end a busy rank as one does (a second one landing inside the first
    handler once deadlocked the rank for good)."""
    pre = Launcher("prefill", "--tp", "1", "--bootstrap-port", str(free_port()), "--restart-ranks", "0")
    try:
        pre.wait_ready()
        rp = client(pre.address)
        try:
            pid = rp.info(10)["pids"][0]
            rp.submit(job(13, delay_s=30.0))  # no decode peer: the rank holds this job
            time.sleep(0.5)
            since = started_at(pid)
            # two shells send SIGTERMs back to back until the rank is gone
            storm = [
                subprocess.Popen(
                    ["bash", "-c", f"for i in $(seq 20000); do kill -TERM {pid} 2>/dev/null || exit 0; done"]
                )
                for _ in range(2)
            ]
            for proc in storm:
                proc.wait(30)
            t0 = time.monotonic()
            while alive(pid, since) and time.monotonic() - t0 < 10:
                time.sleep(0.05)
            assert not alive(pid, since), f"after a burst of SIGTERMs the rank still runs: {describe(pid)}"
            wait_until(lambda: rp.info(10)["states"][0] == "down", 5, "the rank marked down")
        finally:
            rp.close()
        assert pre.proc.poll() is None, pre.stderr()
    finally:
        pre.stop()


def test_sigterm_ends_the_launcher_and_its_ranks_without_a_traceback():
    pre = Launcher("prefill", "--tp", "2", "--bootstrap-port", str(free_port()))
    try:
        pre.wait_ready()
        rp = client(pre.address)
        try:
            pids = rp.info(10)["pids"]
            rp.submit(job(12, delay_s=30.0))  # a job in flight must not hold the exit
            time.sleep(0.5)
        finally:
            rp.close()
        t0 = time.monotonic()
        pre.proc.send_signal(signal.SIGTERM)
        code = pre.proc.wait(30)
        took = time.monotonic() - t0
        assert code in (0, 143, -signal.SIGTERM), code
        assert took < 6.0, f"SIGTERM took {took:.1f} s"
        wait_until(lambda: not any(alive(p) for p in pids), 3, "rank processes gone")
        time.sleep(0.2)
        assert "Traceback" not in pre.stderr(), pre.stderr()
    finally:
        pre.stop()


@pytest.fixture(scope="module")
def lone_prefill():
    """A prefill launcher with no decode peer and --concurrency 1 (for the client-port checks)."""
    pre = Launcher("prefill", "--tp", "1", "--bootstrap-port", str(free_port()), "--concurrency", "1")
    try:
        pre.wait_ready()
        rp = client(pre.address)
        try:
            yield pre, rp
        finally:
            rp.close()
    finally:
        pre.stop()


def _transfer(rp, fields: dict) -> dict:
    return rp._request(dict(fields, op="transfer")).result(10)


@pytest.mark.parametrize(
    "change,words",
    [
        ({"chunk_delay_s": 1e9}, "chunk_delay_s=1000000000.0 must be in 0..60 s"),
        ({"chunk_delay_s": -0.005}, "chunk_delay_s=-0.005 must be in 0..60 s"),
        ({"chunk_delay_s": float("nan")}, "chunk_delay_s=nan must be in 0..60 s"),
        ({"tokens": 513}, "tokens=513 must be in 1..512: the prefill pool holds 64 pages of 8 tokens = 512 tokens"),
        ({"tokens": 0}, "tokens=0 must be in 1..512"),
        ({"chunk_tokens": -1}, "chunk_tokens=-1 must be in 0..2**31-1"),
        ({"room": -1}, "room=-1 must be in 0..2**64-1"),
        ({"aux": b"x" * (65 << 10)}, "aux of 66560 bytes is over the limit of 65536"),
        ({"tokens": "8"}, "field tokens='8' has the wrong type"),
    ],
)
def test_the_client_port_refuses_out_of_range_fields(lone_prefill, change, words):
    _, rp = lone_prefill
    reply = _transfer(rp, dict(job(21), **change))
    assert reply["op"] == "error" and words in reply["reason"], reply


def test_a_full_group_answers_busy_at_once(lone_prefill):
    pre, rp = lone_prefill
    first = rp.submit(job(31, delay_s=5.0))  # no decode peer: it stays in flight
    time.sleep(0.3)
    t0 = time.monotonic()
    ranks = rp.submit(job(32)).result(5)
    assert time.monotonic() - t0 < 2.0
    assert not ranks[0]["ok"] and "busy" in ranks[0]["reason"] and "is 1" in ranks[0]["reason"], ranks
    rp.abort(31, "test over")
    ranks = first.result(10)
    assert not ranks[0]["ok"] and "test over" in ranks[0]["reason"], ranks
    assert pre.proc.poll() is None


def test_the_client_port_drops_requests_without_the_key_and_replays(lone_prefill):
    """Another key (or none) gets no answer at all, and a captured request replayed gets
    none either; the launcher counts nothing it acted on and keeps serving its client."""
    import zmq

    from sglang_kvxfer import auth
    from sglang_kvxfer.cli.client import RemoteGroup
    from sglang_kvxfer.errors import TransferTimeoutError
    from sglang_kvxfer.protocol import envelope

    pre, rp = lone_prefill
    stranger = RemoteGroup(pre.address, key=auth.key_from_secret("not-the-key-of-this-user-at-all"))
    try:
        with pytest.raises(TransferTimeoutError):
            stranger.info(2)
        aborted = stranger.submit(job(41))  # would abort nothing, would run nothing
        time.sleep(0.5)
        assert not aborted.done()
    finally:
        stranger.close()
    # A request sealed with the right key, sent twice: the second copy is a replay.
    import msgpack

    frame = envelope.seal(
        auth.resolve_key(), "replayer", envelope.fresh_seq(time.time()), msgpack.packb({"op": "info", "id": 7})
    )
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{pre.address}")
    try:
        sock.send_multipart([b"", frame])
        assert sock.poll(5000), "the first copy must be answered"
        sock.recv_multipart()
        sock.send_multipart([b"", frame])
        assert not sock.poll(1500), "a replayed request must not be answered"
    finally:
        sock.close(0)
        ctx.term()
    assert rp.info(10)["role"] == "prefill"
    assert "dropped a client request" in pre.stderr()


def test_a_job_that_fails_part_way_aborts_its_peer_at_once():
    """The prefill rank fails after its first chunk (``chunk_delay_s=-1`` reaches the rank
    unchecked when a ``RankGroup`` is driven directly); the decode rank must learn now, not
    at its 30 s waiting deadline."""
    from sglang_kvxfer.cluster.group import RankGroup, make_spec
    from sglang_kvxfer.engine.bootstrap import BootstrapServer
    from sglang_kvxfer.geometry import KVGeometry

    g = KVGeometry(num_layers=2, total_kv_heads=2, head_dim=16, dtype="bf16", page_size=8, num_pages=32)
    opts = {
        "bootstrap_timeout_s": 20.0,
        "waiting_timeout_s": 30.0,
        "transfer_timeout_s": 30.0,
        "heartbeat_timeout_s": 10.0,
    }
    with BootstrapServer() as boot:
        with (
            RankGroup(make_spec("prefill", g, 1, boot.address, "local", options=opts)) as pre,
            RankGroup(make_spec("decode", g, 1, boot.address, "local", options=opts)) as dec,
        ):
            bad = job(41, tokens=32, chunk=8, delay_s=-1.0)
            t0 = time.monotonic()
            fut_d = dec.submit(bad)
            fut_p = pre.submit(bad)
            (p,) = fut_p.result(30)
            (d,) = fut_d.result(30)
            waited = time.monotonic() - t0
            assert not p["ok"] and "sleep length must be non-negative" in p["reason"], p
            assert not d["ok"], d
            assert waited < 8.0, f"the decode rank learned after {waited:.1f} s"  # its deadline is 30 s
            # both ranks serve the next request
            fut_d, fut_p = dec.submit(job(42, tokens=24, chunk=8)), pre.submit(job(42, tokens=24, chunk=8))
            (p2,), (d2,) = fut_p.result(30), fut_d.result(30)
            assert p2["ok"] and d2["ok"] and d2["verified"], (p2, d2)
