"""The progress line the commands show on stderr while requests run.

Owns ``Progress``: ``cluster.workload.run_workload`` calls its ``update`` once per finished
request; the bar counts requests, failures and bytes. Output only; it runs nothing.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang_kvxfer.cluster.workload import RequestResult

__all__ = ["Progress"]


class Progress:
    """A progress line on stderr (redrawn on a terminal, every 2 s otherwise); ``note``
    names what runs now. One bar may span several ``run_workload`` calls."""

    def __init__(self, total: int, enabled: bool, label: str = "requests"):
        self.total, self.enabled, self.label = total, enabled, label
        self.note = ""
        self.done = self.failed = self.bytes = 0
        self.t0 = time.monotonic()
        self._last = 0.0
        self._tty = sys.stderr.isatty()

    def update(self, res: RequestResult) -> None:
        self.done += 1
        self.failed += not res.ok
        self.bytes += res.bytes
        now = time.monotonic()
        if not self.enabled or (not self._tty and now - self._last < 2.0 and self.done < self.total):
            return
        self._last = now
        width = 24
        filled = int(width * self.done / self.total)
        rate = self.bytes / max(now - self.t0, 1e-9) / 1e9
        line = (
            f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {self.label}, "
            f"{self.bytes / 1e9:.2f} GB, {rate:.2f} GB/s, {self.failed} failed"
            + (f" | {self.note}" if self.note else "")
        )
        end = "\r" if self._tty and self.done < self.total else "\n"
        print(line, end=end, file=sys.stderr, flush=True)
