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
