"""The backend reads what KVArgs does not carry from the model config, through SGLang's own
``ModelConfig`` (``sglang_common``: the KV head counts, a DSA indexer's ``index_head_dim``
for its kpool-compression tails). Run in the SGLang environment on the tiny Llama and a
copy of it whose config names an indexer; a config without one raises naming the field."""

from __future__ import annotations

import json
from pathlib import Path

from tests.realserver import harness as h

SCRIPT = Path(__file__).with_name("model_config_check.py")


def test_the_model_config_reads_go_through_sglangs_model_config(server_env, tiny_model):
    out = h.run_json_script(SCRIPT, server_env, str(tiny_model))
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    assert out["index_head_dim"] == {"value": 24}, out
    assert "has no index_head_dim" in out["index_head_dim_absent"]["error"], out
    assert out["total_kv_heads"] == {"value": config["num_key_value_heads"]}, out
    assert out["swa_kv_heads"] == {"value": config["num_key_value_heads"]}, out
