"""The protocol package stays sans-I/O: no sockets, threads, clocks, zmq or torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import sglang_kvxfer.protocol as protocol

PACKAGE_DIR = Path(protocol.__file__).parent
# Imported by nothing in the protocol, directly or through numpy/msgpack.
NEVER_LOADED = (
    "zmq",
    "torch",
    "socket",
    "_socket",
    "selectors",
    "asyncio",
    "multiprocessing",
    "concurrent",
    "mori",
    "nixl",
)
# Loaded by numpy/msgpack themselves (threading), so checked in our own source instead.
NEVER_IMPORTED_HERE = NEVER_LOADED + ("threading", "_thread", "time", "datetime", "subprocess")


def test_importing_the_protocol_loads_no_io_or_heavy_module():
    code = (
        f"import sys, sglang_kvxfer.protocol;bad=[m for m in {NEVER_LOADED!r} if m in sys.modules];print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "", f"import sglang_kvxfer.protocol loaded: {out.stdout.strip()}"


def test_protocol_source_imports_no_io_thread_or_clock_module():
    files = sorted(PACKAGE_DIR.glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "messages.py", "codec.py", "state.py"}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in NEVER_IMPORTED_HERE, f"{path.name} imports {name}"


def test_every_public_name_is_exported():
    missing = [name for name in protocol.__all__ if not hasattr(protocol, name)]
    assert missing == []
