"""Real SGLang servers for the real-server tests and ``examples/sglang_cpu_pd``.

Starts ``python -m sglang.launch_server`` (a plain server) or ``kvxfer sglang-serve`` (a PD
server with this engine as its transfer backend) from the SGLang environment that
``make_env.sh`` builds, on loopback only, each in its own process group with its log in a
file; sends requests the way SGLang's router does (the same bootstrap host, port and room
to the prefill and the decode server); and always ends the whole group. Every wait has a
deadline. Pure standard library, so it runs under any Python.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.ports import free_port

HERE = Path(__file__).resolve().parent
STANDINS = HERE / "standins"
MAKE_ENV = HERE / "make_env.sh"
DEFAULT_VENV = Path.home() / ".cache" / "kvxfer" / "sglang-0.5.23"

READY_TIMEOUT_S = 600.0  # one server: 35-45 s on 2 idle cores; several at once take longer
REQUEST_TIMEOUT_S = 120.0
STOP_GRACE_S = 10.0

# What every server needs on a CPU without AMX (see the README's "Use with SGLang"):
CPU_FLAGS = [
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",  # SGLang's attention backends other than torch_native need CUDA or AMX
    "--sampling-backend",
    "pytorch",
    "--disable-cuda-graph",
    "--dtype",
    "float32",  # bf16 rounding differs between TP sizes; a decode of another TP than its
    # prefill then drifts from any single server after a few tokens of a long prompt
    "--skip-server-warmup",
    "--sleep-on-idle",  # an idle scheduler otherwise busy-polls a core
    "--max-total-tokens",
    "8192",  # a small KV pool: several servers share 24 GB
]
PREFILL_FLAGS = [
    "--disaggregation-mode",
    "prefill",
    "--disaggregation-transfer-backend",
    "kvxfer",
    "--disable-overlap-schedule",  # the overlap scheduler creates CUDA events for a repeated prompt
]
DECODE_FLAGS = [
    "--disaggregation-mode",
    "decode",
    "--disaggregation-transfer-backend",
    "kvxfer",
    "--disaggregation-decode-retraction-backup",
    "none",  # the default pins a host pool with a CUDA call
]


def venv_dir() -> Path:
    return Path(os.environ.get("KVXFER_SGLANG_VENV") or DEFAULT_VENV)


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def run_json_script(script: Path, env: dict, *args: str, timeout_s: float = 300) -> dict:
    """``script`` run by the SGLang environment's Python: the JSON object on its last line of
    output (the test fails with its stderr when it exits non-zero)."""
    run = subprocess.run(
        [str(venv_python()), str(script), *args], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def env_problem() -> str | None:
    """Why the SGLang environment cannot be used (None when it can)."""
    py = venv_python()
    if not py.exists():
        return f"no SGLang environment at {venv_dir()} (build it: {MAKE_ENV.relative_to(HERE.parent.parent)})"
    if not (venv_dir() / ".kvxfer-recipe").exists():
        return f"the SGLang environment at {venv_dir()} is incomplete (rerun {MAKE_ENV.name})"
    return None


def build_model(out: Path) -> Path:
    """Build the tiny model with the SGLang environment's transformers (cached in ``out``)."""
    done = subprocess.run(
        [str(venv_python()), str(HERE / "tiny_model.py"), str(out)], timeout=300, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"building the tiny model failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return out


def base_env(standin_log: Path, auth_key: str | None = None) -> dict:
    """The environment of every server process (loopback, stand-ins, one shared key)."""
    env = dict(os.environ)
    for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(name, None)
    env.update(
        PYTHONPATH=str(STANDINS),
        PYTHONUNBUFFERED="1",
        KVXFER_STANDIN_LOG=str(standin_log),
        SGLANG_USE_CPU_ENGINE="1",  # without it --device cpu still takes CUDA paths
        SGLANG_HOST_IP="127.0.0.1",
        KVXFER_AUTH_KEY=auth_key or secrets.token_hex(32),
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",  # one compute thread per rank: several servers share two cores
    )
    env["PATH"] = f"{venv_dir() / 'bin'}:{env.get('PATH', '')}"
    skip = other_model_archs()
    if skip:
        env["SGLANG_DISABLED_MODEL_ARCHS"] = ",".join(skip)
    return env


def other_model_archs(keep: tuple[str, ...] = ("llama",)) -> list[str]:
    """SGLang imports every module of ``sglang.srt.models`` in every scheduler process (most
    of a CPU server's start-up); its ``SGLANG_DISABLED_MODEL_ARCHS`` skips all but Llama's."""
    found = sorted(venv_dir().glob("lib/python3*/site-packages/sglang/srt/models"))
    if not found:
        return []
    return sorted(f.stem for f in found[0].glob("*.py") if f.stem not in keep and not f.stem.startswith("_"))


@dataclass
class Server:
    """One SGLang server (all its processes in one process group)."""

    name: str
    args: list[str]
    env: dict
    log_path: Path
    kvxfer: bool = True
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    def start(self) -> Server:
        py = str(venv_python())
        head = [py, "-m", "sglang_kvxfer", "sglang-serve"] if self.kvxfer else [py, "-m", "sglang.launch_server"]
        cmd = [*head, *self.args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = spawn(cmd, self.env, self.log_path)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 40) -> str:
        return log_tail(self.log_path, n, skip="server_args=")

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        """Seconds until the server answers /health. A server that exited because another
        process took its HTTP port first is started once more on a new port."""
        assert self.proc is not None
        try:
            return wait_http(self.proc, self.url + "/health", self.name, self.log_tail, timeout_s)
        except RuntimeError:
            if not self._lost_its_port():
                raise
        self.port = free_port()
        with open(self.log_path, "ab") as log:
            log.write(b"(the HTTP port was taken by another process: starting again on a new port)\n")
        self.start()
        return wait_http(self.proc, self.url + "/health", self.name, self.log_tail, timeout_s)

    def _lost_its_port(self) -> bool:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return False
        return any("address already in use" in line and f", {self.port})" in line for line in lines)

    def generate(self, payload: dict, timeout_s: float = REQUEST_TIMEOUT_S) -> dict:
        return self.post("/generate", payload, timeout_s)

    def post(self, path: str, payload: dict, timeout_s: float = REQUEST_TIMEOUT_S) -> dict:
        """POST ``payload`` as JSON to ``path``: the JSON answer, or ``http_error`` and ``body``."""
        req = urllib.request.Request(
            self.url + path, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return {"http_error": exc.code, "body": exc.read().decode(errors="replace")}

    def pids(self) -> list[int]:
        """Every live process of this server (``process_tree``: ``kvxfer sglang-serve`` runs
        SGLang in a process group of its own)."""
        return [] if self.proc is None else process_tree(self.proc.pid)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """End the whole process group: ``sig``, then SIGKILL after a grace period."""
        if self.proc is not None:
            stop_tree(self.proc, sig)


def spawn(cmd: list[str], env: dict, log_path: Path, **popen) -> subprocess.Popen:
    """Start ``cmd`` in a session of its own, its output appended to ``log_path`` after the
    command line (only stderr when ``popen`` takes stdout)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        if "stdout" in popen:  # the caller reads stdout (a driver's answers): only stderr is logged
            popen.setdefault("stderr", log)
        else:
            popen.update(stdout=log, stderr=popen.get("stderr", subprocess.STDOUT))
        return subprocess.Popen(cmd, env=env, start_new_session=True, **popen)


def wait_http(proc: subprocess.Popen, url: str, name: str, tail: Callable[[], str], timeout_s: float) -> float:
    """Seconds until ``GET url`` answers 200; raises if ``proc`` exits or the deadline passes
    (with ``tail()``, the end of its log)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        code = proc.poll()
        if code is not None:
            raise RuntimeError(f"{name} exited with {code} while starting:\n{tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{name} not ready within {timeout_s:.0f} s:\n{tail()}")


def stop_tree(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """``sig``, then SIGKILL, to every process of ``proc``'s tree and process groups, each
    after a grace period; then reap ``proc``."""
    for s in (sig, signal.SIGKILL):
        pids = process_tree(proc.pid)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, s)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        while process_tree(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


def process_title(pid: int) -> str:
    """A process's command line as ``ps`` shows it (SGLang renames its processes, e.g.
    ``sglang::scheduler_TP1``)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


# Lines worth showing even when they scrolled out of the tail (a bind error, the kvxfer
# engine's own reports), up to ERRORS_SHOWN of them.
NOTABLE = ("ERROR", "Errno", "kvxfer:", "Traceback", "did not run for", "on the I/O thread", "is gone")
ERRORS_SHOWN = 20


def log_tail(path: Path, n: int = 40, skip: str = "") -> str:
    """The last ``n`` lines of a log file (without lines containing ``skip``), after the
    last ``ERRORS_SHOWN`` notable lines above them (errors, the engine's reports)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    if skip:
        lines = [line for line in lines if skip not in line]
    head, tail = lines[:-n], lines[-n:]
    notable = [line for line in head if any(word in line for word in NOTABLE)][-ERRORS_SHOWN:]
    if not notable:
        return "\n".join(tail)
    return "\n".join([f"(notable lines above the last {n}:)", *notable, "(the last lines:)", *tail])


def process_tree(root: int) -> list[int]:
    """Every live process under ``root``: its descendants and the members of their process
    groups (``root``'s own included), so a child that moved to a group of its own is found."""
    table = _process_table()
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in found or pid not in table:
            continue
        found.add(pid)
        todo += [p for p, (ppid, _) in table.items() if ppid == pid]
    groups = {table[p][1] for p in found} | {root}
    return sorted(p for p, (_, pgid) in table.items() if pgid in groups or p in found)


def machine_snapshot(window_s: float = 0.5, top: int = 8) -> str:
    """The load average and the ``top`` processes using the most CPU over ``window_s``
    (for a failure's report: a starved engine looks like a broken one)."""

    def cpu_ticks() -> dict[int, int]:
        ticks = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    ticks[int(entry)] = int(fields[11]) + int(fields[12])  # utime + stime
                except (OSError, IndexError, ValueError):
                    pass
        return ticks

    before = cpu_ticks()
    time.sleep(window_s)
    after = cpu_ticks()
    hz = os.sysconf("SC_CLK_TCK")
    busy = sorted(((after[p] - before.get(p, after[p])) / hz / window_s, p) for p in after)[::-1][:top]
    one, five, _ = os.getloadavg()
    lines = [f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} CPUs; busiest processes:"]
    lines += [f"  {100 * share:5.0f}% pid {pid}: {process_title(pid)[:160]}" for share, pid in busy if share > 0]
    return "\n".join(lines)


def _process_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, pgid) of every live (not zombie) process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            table[int(entry)] = (int(fields[1]), int(fields[2]))
    return table


def tp_env(env: dict, tp: int) -> dict:
    """TP 2 on 2 cores: one OpenMP thread bound to each core."""
    env = dict(env)
    if tp > 1:
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
    return env


def reference_server(name: str, model: Path, tp: int, env: dict, logs: Path) -> Server:
    return Server(
        name, ["--model-path", str(model), "--tp", str(tp), *CPU_FLAGS], tp_env(env, tp), logs / f"{name}.log", False
    )


def prefill_server(
    name: str, model: Path, tp: int, env: dict, logs: Path, bootstrap_port: int, extra: list[str] = ()
) -> Server:
    args = ["--model-path", str(model), "--tp", str(tp), *CPU_FLAGS, *PREFILL_FLAGS]
    args += ["--disaggregation-bootstrap-port", str(bootstrap_port), *extra]
    return Server(name, args, tp_env(env, tp), logs / f"{name}.log")


def decode_server(name: str, model: Path, tp: int, env: dict, logs: Path, extra: list[str] = ()) -> Server:
    args = ["--model-path", str(model), "--tp", str(tp), *CPU_FLAGS, *DECODE_FLAGS, *extra]
    return Server(name, args, tp_env(env, tp), logs / f"{name}.log")


def sampling(max_new_tokens: int = 16) -> dict:
    return {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}


def generate_single(server: Server, input_ids: list[int], max_new_tokens: int = 16) -> dict:
    return server.generate({"input_ids": input_ids, "sampling_params": sampling(max_new_tokens)})


def generate_pd(
    prefill: Server, decode: Server, bootstrap_port: int, input_ids: list[int], room: int, max_new_tokens: int = 16
) -> tuple[dict, dict]:
    """One request through a PD pair, as SGLang's router sends it: the same body, with the
    prefill's bootstrap address and a room, to both servers at once. Returns (prefill's
    answer, decode's answer)."""
    body = {
        "input_ids": input_ids,
        "sampling_params": sampling(max_new_tokens),
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": room,
    }
    out: dict = {}

    def ask(key: str, server: Server) -> None:
        try:
            out[key] = server.generate(body)
        except Exception as exc:  # a timeout, a dropped connection: the failure names it
            out[key] = {"error": f"{type(exc).__name__}: {exc}"}

    threads = [threading.Thread(target=ask, args=kv, daemon=True) for kv in (("prefill", prefill), ("decode", decode))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S + 10)
    return out.get("prefill", {"error": "no answer"}), out.get("decode", {"error": "no answer"})


def output_ids(answer: dict) -> list[int] | None:
    ids = answer.get("output_ids")
    return list(ids) if isinstance(ids, list) else None


def finish_reason(answer: dict) -> dict:
    return (answer.get("meta_info") or {}).get("finish_reason") or {}


# -- a PD pair with a reference: (prefill, decode, bootstrap port, reference, ...) ----------------


def pair_logs(pair) -> str:
    """The log tails of a pair's prefill and decode, for a failure message."""
    prefill, decode = pair[:2]
    return f"--- {prefill.name}:\n{prefill.log_tail()}\n--- {decode.name}:\n{decode.log_tail()}"


def pair_tokens(pair, ids: list[int], room: int) -> list[int]:
    """The decode's greedy tokens of one request through the pair (the assertion names both answers)."""
    prefill, decode, port = pair[:3]
    pre, dec = generate_pd(prefill, decode, port, ids, room)
    got = output_ids(dec)
    assert got is not None, f"decode answered {dec} (prefill: {pre})\n{pair_logs(pair)}"
    return got


def pair_reference(pair, ids: list[int]) -> list[int]:
    """The pair's reference server's greedy tokens of the same request."""
    answer = generate_single(pair[3], ids)
    want = output_ids(answer)
    assert want is not None, f"reference failed: {answer}"
    return want


def build_tiny_swa_model(out: Path, layers: str = "sssf") -> Path:
    """The tiny Gemma-4 of ``tiny_swa_model.py`` (layer types ``layers``), built in the SGLang
    environment's Python."""
    done = subprocess.run(
        [str(venv_python()), str(HERE / "tiny_swa_model.py"), str(out), layers],
        timeout=300,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"building the tiny Gemma-4 failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return out


def pair_tokens_corrupted(pair, logs: Path, spec: str, ids: list[int], room: int) -> tuple[list[int], str]:
    """The decode's tokens of one request with the negative control's hook on (``spec``: what
    the decode zeroes once the KV landed, see ``standins/sitecustomize.py``), and what the
    hook logged it zeroed."""
    control = logs / "corrupt-writer"
    record = Path(str(control) + ".log")
    before = record.read_text() if record.exists() else ""
    control.write_text(spec)
    try:
        got = pair_tokens(pair, ids, room)
    finally:
        control.unlink()
    return got, record.read_text()[len(before) :]
