"""vLLM processes for tests/vllm, each in the vLLM environment, in a session of its own.

An ``Engine`` is one offline engine, a ``driver.py`` process (the driver and its TP worker
processes share one process group), with its log in a file; ``request`` writes one JSON
command and waits for the answer with a deadline; ``stop`` ends every process of the engine.
A ``Service`` is one HTTP process (vLLM's OpenAI server, the example's proxy): readiness and
requests have deadlines, ``stop`` ends its whole process tree. Pure standard library, so it
runs under any Python.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.realserver.harness import (
    free_port,
    log_tail,
    process_title,
    process_tree,
    spawn,
    stop_tree,
    wait_http,
)

__all__ = ["Engine", "Service", "stop_tree", "venv_dir", "env_problem", "base_env", "free_port", "process_title"]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DRIVER = HERE / "driver.py"
MAKE_ENV = HERE / "make_env.sh"
DEFAULT_VENV = Path.home() / ".cache" / "kvxfer" / "vllm-0.32.0"

READY_TIMEOUT_S = 300.0  # one engine: 30-50 s on 2 idle cores; two at once take longer
REQUEST_TIMEOUT_S = 120.0
STOP_GRACE_S = 10.0


def venv_dir() -> Path:
    return Path(os.environ.get("KVXFER_VLLM_VENV") or DEFAULT_VENV)


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def env_problem() -> str | None:
    """Why the vLLM environment cannot be used (None when it can)."""
    if not venv_python().exists():
        return f"no vLLM environment at {venv_dir()} (build it: tests/vllm/make_env.sh)"
    if not (venv_dir() / ".kvxfer-recipe").exists():
        return f"the vLLM environment at {venv_dir()} is incomplete (rerun tests/vllm/make_env.sh)"
    return None


def base_env(auth_key: str) -> dict:
    env = dict(os.environ)
    for name in ("PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(name, None)
    env.update(
        PYTHONPATH=str(ROOT),  # the test connector (tests.vllm.corrupt_connector) imports from here
        PYTHONUNBUFFERED="1",
        VLLM_HOST_IP="127.0.0.1",
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB of KV cache per engine: several engines share 24 GB
        KVXFER_AUTH_KEY=auth_key,
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
    )
    env["PATH"] = f"{venv_dir() / 'bin'}:{env.get('PATH', '')}"
    return env


@dataclass
class Engine:
    """One offline vLLM engine; ``spec`` is the driver's JSON argument."""

    name: str
    spec: dict
    env: dict
    log_path: Path
    proc: subprocess.Popen | None = None
    _answers: queue.Queue = field(default_factory=queue.Queue)

    def start(self) -> Engine:
        env = dict(self.env)
        # Unbound OpenMP threads, TP 2 included: with "0|1" each TP worker is pinned to one core,
        # and the connector's threads there (heartbeats, control) starved for > 10 s next to
        # vLLM's busy-polling worker loop; unbound, TP 2 runs and its tokens are unchanged.
        env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("KVXFER_TEST_VLLM_BIND", "nobind")
        cmd = [str(venv_python()), str(DRIVER), json.dumps(self.spec)]
        self.proc = spawn(cmd, env, self.log_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self._answers.put(json.loads(line))
            except ValueError:
                self._answers.put({"error": f"not JSON: {line[:200]}"})
        self._answers.put(None)  # the driver's stdout closed: it exited

    def _answer(self, timeout_s: float, what: str) -> dict:
        try:
            answer = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(
                f"{self.name}: no answer to {what} within {timeout_s:.0f} s\n{self.log_tail()}"
            ) from None
        if answer is None:
            code = self.proc.poll() if self.proc else None
            raise RuntimeError(f"{self.name} exited ({code}) before answering {what}\n{self.log_tail()}")
        return answer

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        t0 = time.monotonic()
        self._answer(timeout_s, "start-up")
        return time.monotonic() - t0

    def request(self, cmd: dict, timeout_s: float = REQUEST_TIMEOUT_S) -> dict:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._answer(timeout_s, cmd.get("cmd", "?"))

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        params: list | None = None,
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> dict:
        return self.request(
            {"cmd": "generate", "prompts": prompts, "max_tokens": max_tokens, "params": params}, timeout_s
        )

    def log_tail(self, n: int = 40) -> str:
        return log_tail(self.log_path, n)

    def pids(self) -> list[int]:
        """Every live process of this engine: the driver's descendants and their process groups."""
        return [] if self.proc is None else process_tree(self.proc.pid)

    def kill(self, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process of the engine at once; returns their pids."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def stop(self) -> None:
        """Quit, then SIGTERM, then SIGKILL every process left, each after a grace period."""
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(STOP_GRACE_S)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        stop_tree(self.proc)


@dataclass
class Service:
    """One HTTP process of the vLLM environment (``cmd`` after the venv's Python), its output
    in ``log_path``; ready once ``GET ready_path`` answers 200."""

    name: str
    cmd: list[str]
    env: dict
    log_path: Path
    port: int
    ready_path: str = "/health"
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Service:
        env = dict(self.env)
        env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("KVXFER_TEST_VLLM_BIND", "nobind")  # see Engine.start
        cmd = [str(venv_python()), *self.cmd]
        self.proc = spawn(cmd, env, self.log_path, stdin=subprocess.DEVNULL)
        return self

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        assert self.proc is not None
        return wait_http(self.proc, self.url + self.ready_path, self.name, self.log_tail, timeout_s)

    def post(self, path: str, body: dict, timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[int, dict]:
        """``(HTTP status, JSON answer)``; an HTTP error's body comes back as ``{"error": ...}``."""
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, {"error": exc.read().decode(errors="replace")}

    def get(self, path: str, timeout_s: float = REQUEST_TIMEOUT_S) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout_s) as r:
            return r.read().decode(errors="replace")

    def log_tail(self, n: int = 40) -> str:
        return log_tail(self.log_path, n)

    def pids(self) -> list[int]:
        return [] if self.proc is None else process_tree(self.proc.pid)

    def stop(self) -> None:
        if self.proc is not None:
            stop_tree(self.proc)
