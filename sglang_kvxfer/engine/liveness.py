"""What a silent peer process on this host is doing: exited, stopped, still scheduled, idle.

A heartbeat that stops cannot tell a dead peer from one that is starved for CPU (a shared
host, a burst of start-ups): both are silent. For a peer on this host, in this PID
namespace, the kernel can: ``/proc/<pid>`` says whether the process still exists (its start
time guards against a reused pid) and whether it is stopped or a zombie, and
``/proc/<pid>/task/*/schedstat`` says how long its threads ran on a CPU or waited for one.
A process that exited is gone at once, whatever the heartbeat timeout; one that keeps being
scheduled while silent is starved or busy, not dead, and gets a bounded grace period.

Each heartbeat carries the sender's ``host_id()`` (boot id and PID namespace) and pid, so a
rank knows which peers it may look at. Where ``/proc`` is missing or unreadable, nothing here
claims anything (``sample`` returns None or a sample without ``busy_ns``) and the heartbeat
rule alone decides.

Must not import zmq or torch, or know about rooms.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

__all__ = ["host_id", "ProcessSample", "sample", "PeerProcess"]

# A silent peer counts as scheduled when its threads ran or waited for a CPU at least this
# share of one core over the last window: a starved process waits on the run queue nearly
# all the time, a stopped one not at all, a deadlocked or idle one a few timer wake-ups.
SCHEDULED_SHARE = 0.05


@functools.lru_cache(maxsize=1)
def host_id() -> str:
    """This host's boot id and this process's PID namespace ("" where either is unknown):
    two processes with the same value see each other's pids in ``/proc``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    if not boot or not ns:
        return ""
    return f"{boot}/{ns}"[:128]


@dataclass(frozen=True)
class ProcessSample:
    """One look at a process: its kernel start time (clock ticks since boot), its state
    letter (``R``, ``S``, ``T`` stopped, ``Z`` zombie, ...) and the nanoseconds its threads
    have run on or waited for a CPU (None where schedstat is unreadable)."""

    start: int
    state: str
    busy_ns: int | None

    @property
    def dead(self) -> bool:
        return self.state in ("Z", "X", "x")

    @property
    def stopped(self) -> bool:
        return self.state in ("T", "t")


def sample(pid: int, threads: bool = True) -> ProcessSample | None:
    """The process ``pid`` now, or None if there is none (or ``/proc`` cannot say);
    ``threads=False`` skips the per-thread schedstat (``busy_ns`` None)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after its last ")"
    fields = stat[stat.rfind(b")") + 2 :].split()
    if len(fields) < 20:
        return None
    state, start = fields[0].decode("ascii", "replace"), int(fields[19])
    if not threads:
        return ProcessSample(start, state, None)
    busy, seen = 0, 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tids = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                run_ns, wait_ns = f.read().split()[:2]
        except (OSError, ValueError):
            continue  # a thread that just ended, or no schedstat on this kernel
        busy += int(run_ns) + int(wait_ns)
        seen += 1
    return ProcessSample(start, state, busy if seen else None)


class PeerProcess:
    """A peer's process on this host, watched while the peer is silent.

    Made from the peer's first heartbeat, while it is known to run: its start time then
    tells its process from a later one under the same pid. ``look(now)`` takes a sample and
    keeps, per window of ``window_s``, the share of one core its threads ran or waited for a
    CPU. ``verdict()`` is then one of ``"exited"`` (no such process any more, a zombie, or
    another process under its pid), ``"stopped"``, ``"scheduled"`` (the last full window's
    share at least ``SCHEDULED_SHARE``), or None (idle, or not known yet: the heartbeat rule
    decides). A pid ``/proc`` cannot show at the first heartbeat is never judged.
    """

    def __init__(self, pid: int, window_s: float):
        self.pid, self.window_s = pid, window_s
        first = sample(pid, threads=False)
        self.start = None if first is None or first.dead else first.start
        self.last: ProcessSample | None = first
        self.gone = False
        self.share: float | None = None  # of the last full window
        self._mark: tuple[float, int] | None = None

    def look(self, now: float) -> None:
        """Sample the process (the I/O thread, on ticks while the peer is silent)."""
        if self.gone or self.start is None:
            return
        # every tick: whether it exited or stopped; its threads only at a window's ends
        due = self._mark is None or now - self._mark[0] >= self.window_s
        s = sample(self.pid, threads=due)
        if s is None or s.start != self.start or s.dead:
            self.gone, self.last = True, s
            return
        self.last = s
        if s.busy_ns is None:
            return
        if self._mark is None:
            self._mark = (now, s.busy_ns)
        elif now - self._mark[0] >= self.window_s:
            t0, b0 = self._mark
            self.share = (s.busy_ns - b0) / 1e9 / (now - t0)
            self._mark = (now, s.busy_ns)

    def quiet(self) -> None:
        """The peer spoke again: the next silence starts its windows afresh."""
        self._mark, self.share = None, None

    def verdict(self) -> str | None:
        if self.start is None:
            return None
        if self.gone:
            return "exited"
        if self.last is not None and self.last.stopped:
            return "stopped"
        if self.share is not None and self.share >= SCHEDULED_SHARE:
            return "scheduled"
        return None
