"""Run in the SGLang environment (``test_sglang_model_config_seams.py``): the backend's reads
of the model config that KVArgs does not carry, through SGLang's own ``ModelConfig``, for the
tiny Llama and for a copy of it whose config names a DSA indexer's ``index_head_dim``. Prints
one JSON object: what each read returned, or the error it raised."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from sglang.srt.server_args import ServerArgs

from sglang_kvxfer.integrations import sglang_common


def read(fn, model: Path):
    args = ServerArgs(model_path=str(model), device="cpu", mem_fraction_static=0.5)
    try:
        return {"value": fn(args)}
    except Exception as exc:  # the reason, as the manager would wrap it
        return {"error": f"{type(exc).__name__}: {exc}"}


tiny = Path(sys.argv[1])
with tempfile.TemporaryDirectory() as tmp:
    dsa = Path(tmp) / "tiny-with-indexer"
    shutil.copytree(tiny, dsa)
    config = json.loads((dsa / "config.json").read_text())
    config["index_head_dim"] = 24
    (dsa / "config.json").write_text(json.dumps(config))
    out = {
        "index_head_dim": read(sglang_common.model_dsa_index_head_dim, dsa),
        "index_head_dim_absent": read(sglang_common.model_dsa_index_head_dim, tiny),
        "total_kv_heads": read(sglang_common.model_total_kv_heads, tiny),
        "swa_kv_heads": read(sglang_common.model_swa_kv_heads, tiny),
    }
print(json.dumps(out))
