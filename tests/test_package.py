"""The package imports cheaply and its environment variables are all documented."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_pulls_no_heavy_or_optional_module():
    code = (
        "import sys, sglang_kvxfer, sglang_kvxfer.geometry;"
        "bad=[m for m in ('torch','mori','nixl','nixl_cu12','zmq') if m in sys.modules];"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import sglang_kvxfer imported: {out.stdout.strip()}"


def test_env_doc_table_matches_the_registry():
    from sglang_kvxfer import envs

    doc = (ROOT / "docs" / "environment.md").read_text()
    block = re.search(r"<!-- envs:begin -->\n(.*?)\n?<!-- envs:end -->", doc, re.S)
    assert block, "docs/environment.md lost its envs:begin/envs:end markers"
    assert block.group(1).strip() == envs.markdown_table(), (
        "docs/environment.md env table is stale: regenerate it with `python -m sglang_kvxfer.envs`"
    )
    for var in envs.all_vars():
        assert var.name.startswith("KVXFER_")


def test_env_var_parse_error_names_the_variable(monkeypatch):
    from sglang_kvxfer import envs

    monkeypatch.setenv("KVXFER_DATA_PATH", "sideways")
    try:
        envs.KVXFER_DATA_PATH.get()
    except ValueError as exc:
        assert "KVXFER_DATA_PATH" in str(exc) and "sideways" in str(exc)
    else:
        raise AssertionError("a bad KVXFER_DATA_PATH was accepted")


def _log_probe(level: str | None) -> subprocess.CompletedProcess:
    """A fresh interpreter that imports the package and logs at INFO and WARNING through an
    engine logger, with ``KVXFER_LOG_LEVEL`` set to ``level`` (unset for None)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "KVXFER_LOG_LEVEL"}
    if level is not None:
        env["KVXFER_LOG_LEVEL"] = level
    code = (
        "import logging, sglang_kvxfer\n"
        "log = logging.getLogger('sglang_kvxfer.probe')\n"
        "log.info('info line'); log.warning('warning line')\n"
    )
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_kvxfer_log_level_sets_the_engine_logger_level():
    shown = _log_probe("info")
    assert shown.returncode == 0, shown.stderr
    assert "INFO sglang_kvxfer.probe: info line" in shown.stderr
    assert shown.stderr.count("warning line") == 1
    quiet = _log_probe("ERROR")
    assert "info line" not in quiet.stderr and "warning line" not in quiet.stderr
    unset = _log_probe(None)  # the host's logging decides: Python's fallback shows warnings only
    assert "info line" not in unset.stderr and "warning line" in unset.stderr


def test_a_malformed_kvxfer_log_level_names_the_variable():
    bad = _log_probe("chatty")
    assert bad.returncode != 0
    assert "KVXFER_LOG_LEVEL='chatty' is invalid: expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL" in bad.stderr
