"""SGLang 0.5.23 refuses ``--enable-kv-cache-sharding`` for every transfer backend but
mooncake and nixl, by name, while it resolves the launch arguments (``kv_shard_hook``).
After ``sglang_install.install()`` (SGLang's plugin loader runs it in every process) kvxfer
passes that step as mooncake does, through SGLang's own override point; every other rule of
the step still applies and other backends are still refused. Run in the SGLang environment,
with SGLang's real step."""

from __future__ import annotations

from pathlib import Path

from tests.realserver import harness as h

SCRIPT = Path(__file__).with_name("kv_shard_check.py")


def test_sglangs_kv_sharding_step_lets_kvxfer_through_as_mooncake_and_keeps_its_other_rules(server_env, tiny_model):
    out = h.run_json_script(SCRIPT, server_env, str(tiny_model))
    assert out["overrides"] == 1  # install() twice: one override
    # kvxfer passes, and the step's own resolution (the chunk rounded to whole pages) lands
    assert out["kvxfer"] == {"chunked_prefill_size": 128, "backend": "kvxfer"}, out
    # SGLang's step alone refuses kvxfer by name (the negative control), and still refuses mori
    assert "only supports the mooncake and nixl transfer backends" in out["kvxfer_without_override"]["refused"]
    assert "Got --disaggregation-transfer-backend 'kvxfer'" in out["kvxfer_without_override"]["refused"]
    assert "Got --disaggregation-transfer-backend 'mori'" in out["mori"]["refused"]
    # its other rules still apply to kvxfer
    assert "requires a real page size" in out["kvxfer_page_size_1"]["refused"]
    assert "only supported on PD prefill workers" in out["kvxfer_decode"]["refused"]
