"""Run in the SGLang environment (``test_sglang_kv_shard_check.py``): SGLang 0.5.23's own
resolution step for ``--enable-kv-cache-sharding`` (``arg_groups/kv_shard_hook``), as its
launch pipeline runs it, for kvxfer after ``sglang_install.install()`` and for others.
Prints one JSON object: what each case resolved to, or the reason SGLang gave."""

from __future__ import annotations

import json
import sys

from sglang_kvxfer.integrations import sglang_install

sglang_install.install()
sglang_install.install()  # idempotent: one override of the step

from sglang.srt.arg_groups import cuda_graph_hook, kv_shard_hook, resolution_hooks  # noqa: E402
from sglang.srt.arg_groups.overrides import resolving_view  # noqa: E402
from sglang.srt.arg_groups.resolution_hooks import run_hook  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402

STEP = "handle_kv_cache_sharding"
ARGV = [
    "--model-path", sys.argv[1], "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "kvxfer",
    "--enable-kv-cache-sharding", "--tp-size", "2", "--attn-cp-size", "2", "--enable-prefill-cp",
    "--page-size", "64", "--chunked-prefill-size", "100", "--prefill-attention-backend", "fa3", "--device", "cpu",
    "--mem-fraction-static", "0.5",
]  # fmt: skip


def resolve(argv: list[str]) -> dict:
    args = prepare_server_args(argv)
    try:
        run_hook(cuda_graph_hook.handle_cuda_graph_config, args)  # (the pipeline resolves it before)
        run_hook(kv_shard_hook.handle_kv_cache_sharding, args)
    except Exception as exc:  # SGLang's refusal, with its reason
        return {"refused": str(exc)}
    cfg = resolving_view(args)
    return {"chunked_prefill_size": cfg.chunked_prefill_size, "backend": cfg.disaggregation_transfer_backend}


def swap(old: str, new: str) -> list[str]:
    return [new if a == old else a for a in ARGV]


out = {"overrides": len(resolution_hooks._HOOKS.get(STEP, []))}
out["kvxfer"] = resolve(ARGV)
out["mori"] = resolve(swap("kvxfer", "mori"))
out["kvxfer_page_size_1"] = resolve(swap("64", "1"))
out["kvxfer_decode"] = resolve(swap("prefill", "decode"))
ours = resolution_hooks._HOOKS.pop(STEP)  # the negative control: SGLang's step alone
out["kvxfer_without_override"] = resolve(ARGV)
resolution_hooks._HOOKS[STEP] = ours
print(json.dumps(out))
