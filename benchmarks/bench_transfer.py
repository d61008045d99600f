"""Benchmark KV transfer between a prefill TP group and a decode TP group on this node; print JSON.

The same code as ``kvxfer bench`` (``sglang_kvxfer/cli/bench.py``), with ``--json`` on:
sweeps the comma-separated axes given (transport, TP sizes, context length, heads,
head_dim, page size and layout per side, MLA, concurrency, chunk size), verifies every
byte unless ``--no-verify``, and measures a plain baseline of the same bytes in the same
run (copy for ``local``, one socket per stream for ``tcp``, device-to-device copy on GPUs).

    python benchmarks/bench_transfer.py --quick [--plot out.png]
    python benchmarks/bench_transfer.py --transport local --prefill-devices cuda:0,cuda:1 \\
        --decode-devices cuda:2,cuda:3 --prefill-tp 1,2 --decode-tp 1,2 --tokens 1024,4096,16384,65536
"""

from __future__ import annotations

import sys

from sglang_kvxfer.cli import main

if __name__ == "__main__":  # rank processes are spawned: they must not re-run this
    argv = sys.argv[1:]
    sys.exit(main(["bench", *argv, *([] if "--json" in argv else ["--json"])]))
