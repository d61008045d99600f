"""A second process that hosts one transport and one region, driven over a pipe.

The contract tests write into this peer's region from the test process and read the bytes
back through the pipe; they can also stop or kill it. Commands and replies are small
tuples; every wait on the pipe has a timeout.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import signal
import sys
import time

import numpy as np

PEER_TIMEOUT_S = 20.0  # the longest any single command may take
# What the peer grants the test's writer (``authorize_peer``) and the writer proves
# (``add_peer(..., secret=)``), as the engine would do with its per-session secrets.
WRITER_ID, WRITER_SECRET = "writer", bytes(range(32))


def pattern(seed: int, nbytes: int) -> np.ndarray:
    """The bytes ``fill(seed)`` writes, so the test can model the peer's region."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _serve(conn, name: str, options: dict, memory: str, nbytes: int, hook: str | None) -> None:
    try:
        _serve_commands(conn, name, options, memory, nbytes, hook)
    finally:
        nixl = sys.modules.get("sglang_kvxfer.transports.nixl")
        if nixl is not None and nixl.ucx_backend_created():
            nixl.exit_process(0)  # a UCX process may crash in exit (see nixl.exit_process)


def _serve_commands(conn, name, options, memory, nbytes, hook) -> None:
    from sglang_kvxfer.transports import get_transport
    from sglang_kvxfer.transports.local import alloc_shared

    if hook is not None:  # e.g. "tests.transports.fake_mori:install": runs before the transport is created
        module, _, func = hook.partition(":")
        getattr(importlib.import_module(module), func)()
    parent = os.getppid()
    try:
        transport = get_transport(name, **options)
        if memory == "shm":
            buf = alloc_shared(nbytes)
            arr = buf.as_numpy()
        else:
            arr = np.zeros(nbytes, dtype=np.uint8)
        region = transport.register(arr.ctypes.data, nbytes)
        transport.authorize_peer(WRITER_ID, WRITER_SECRET, [region])
    except Exception as exc:  # the test reads the setup error (e.g. CMA refused)
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", transport.agent_descriptor(), region.descriptor, os.getpid()))
    while True:
        if not conn.poll(1.0):
            if os.getppid() != parent:
                return
            continue
        cmd, *args = conn.recv()
        if cmd == "fill":
            arr[:] = pattern(args[0], nbytes)
            conn.send(None)
        elif cmd == "read":
            conn.send(arr.tobytes())
        elif cmd == "deregister":
            transport.deregister(region)
            conn.send(None)
        elif cmd == "failures":
            conn.send([(f.peer_id, f.reason) for f in transport.peer_failures()])
        elif cmd == "exit":
            transport.close()
            conn.send(None)
            return


class PeerProcess:
    """Handle on a spawned peer: ``agent``/``region`` descriptors, ``pid``, commands.

    ``hook`` ("module:function") runs in the peer before its transport is created.
    """

    def __init__(self, name: str, options: dict, memory: str, nbytes: int, hook: str | None = None):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.nbytes = nbytes
        self.proc = ctx.Process(target=_serve, args=(child, name, options, memory, nbytes, hook), daemon=True)
        self.proc.start()
        child.close()
        reply = self._reply()
        if reply[0] == "error":
            self.setup_error = reply[1]
            self.agent = self.region = self.pid = None
        else:
            self.setup_error = None
            _, self.agent, self.region, self.pid = reply

    def _reply(self):
        if not self._conn.poll(PEER_TIMEOUT_S):
            raise TimeoutError(f"peer process did not answer within {PEER_TIMEOUT_S} s")
        return self._conn.recv()

    def call(self, *cmd):
        self._conn.send(cmd)
        return self._reply()

    def fill(self, seed: int) -> np.ndarray:
        self.call("fill", seed)
        return pattern(seed, self.nbytes)

    def read(self) -> np.ndarray:
        return np.frombuffer(self.call("read"), dtype=np.uint8)

    def stop(self) -> None:
        """SIGSTOP the peer and wait until all its threads are stopped (that is not
        immediate: a busy thread runs on for a while, tens of ms on a loaded machine)."""
        os.kill(self.pid, signal.SIGSTOP)
        if not wait_until(
            lambda: all(state in "tT" for state in _thread_states(self.pid)), PEER_TIMEOUT_S, interval_s=0.001
        ):
            raise TimeoutError(f"peer {self.pid} did not stop within {PEER_TIMEOUT_S} s")

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(PEER_TIMEOUT_S)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                if self.setup_error is None:
                    self.call("exit")
            except (OSError, EOFError, TimeoutError):
                pass
            self.proc.join(PEER_TIMEOUT_S)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(PEER_TIMEOUT_S)
        self._conn.close()


def _thread_states(pid: int) -> list[str]:
    """The state letter of every thread of ``pid`` (from /proc/<pid>/task/*/stat)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:  # the thread exited meanwhile
            pass
    return states


def wait_until(predicate, timeout_s: float, interval_s: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
