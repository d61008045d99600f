"""One offline vLLM engine (``vllm.LLM``) that answers JSON commands, for tests/vllm.

Runs in the vLLM environment (``tests/vllm/make_env.sh``)::

    python tests/vllm/driver.py '{"model": DIR, "tp": 2, "kv_role": "kv_both", "kv_port": 15000, ...}'

Builds the engine, prints ``{"ready": ...}``, then reads one JSON command per line on stdin
and answers one JSON line on stdout:

- ``{"cmd": "generate", "prompts": [[ids]], "max_tokens": n, "params": [kv_transfer_params or null]}``
  -> ``{"outputs": [{"token_ids": [...], "finish_reason": ..., "kv_transfer_params": ...}]}``
- ``{"cmd": "quit"}``.

Everything vLLM prints goes to stderr (the log file); stdout carries only answers.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def main() -> None:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's and the workers' prints go to the log, not into the answers
    sys.stdout = sys.stderr
    spec = json.loads(sys.argv[1])

    from vllm import LLM, SamplingParams

    ktc = {
        "kv_connector": spec.get("connector", "KVXferConnector"),
        "kv_connector_module_path": spec.get("connector_module", "sglang_kvxfer.integrations.vllm"),
        "kv_role": spec["kv_role"],
        "kv_port": spec["kv_port"],
        "kv_load_failure_policy": spec.get("failure_policy", "fail"),
        "kv_connector_extra_config": {"transport": spec.get("transport", "local")},
    }
    llm = LLM(
        model=spec["model"],
        tensor_parallel_size=spec["tp"],
        dtype="float32",  # bf16 drifts between TP sizes on a CPU
        enforce_eager=True,
        block_size=spec.get("block_size", 32),  # CPU attention: a multiple of 32
        max_model_len=1024,
        max_num_batched_tokens=1024,
        enable_prefix_caching=False,  # every request moves its KV (see docs/vllm.md)
        kv_transfer_config=ktc,
        seed=0,
        # None: vLLM's choice. The MLA test names CPU_MLA: on a CPU with AMX tiles vLLM picks
        # AMX_MLA, which refuses the float32 weights used here.
        attention_backend=spec.get("attention_backend"),
    )
    answers.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("cmd") == "quit":
            break
        try:
            params = cmd.get("params") or [None] * len(cmd["prompts"])
            sampling = [
                SamplingParams(
                    temperature=0.0,
                    max_tokens=cmd.get("max_tokens", 16),
                    ignore_eos=True,
                    extra_args={"kv_transfer_params": p} if p is not None else None,
                )
                for p in params
            ]
            prompts = [{"prompt_token_ids": ids} for ids in cmd["prompts"]]
            outs = llm.generate(prompts, sampling, use_tqdm=False)
            answer = {
                "outputs": [
                    {
                        "token_ids": list(o.outputs[0].token_ids),
                        "finish_reason": o.outputs[0].finish_reason,
                        "kv_transfer_params": o.kv_transfer_params,
                    }
                    for o in outs
                ]
            }
        except Exception as exc:
            traceback.print_exc()
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        answers.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
