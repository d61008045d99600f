"""Tiny random-weight models for the attention-DP real-server tests, with the tiny Llama's
word-level tokenizer, built without any download. Run in the SGLang environment's Python:
``python tests/realserver/tiny_dp_models.py qwen3|deepseek DIR``.

* Qwen3: 2 layers, hidden 256, 8 query heads, 4 KV heads of 64, q/k norms. SGLang's Qwen3
  shards attention by the attention-TP size, so it serves ``--enable-dp-attention`` (SGLang's
  Llama does not).
* DeepSeek-V3 shaped for SGLang's CPU path (MLA): 2 dense layers, kv_lora_rank 64, rope 32,
  nope 32, v 32; SGLang's CPU rotary embedding needs a ``yarn`` rope setting and its config
  reader ``moe_layer_freq`` (``tiny_model.build_deepseek_v3`` is shaped for vLLM instead).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_model import VOCAB, deepseek_v3, write_model  # noqa: E402


def build_qwen3(out: Path) -> Path:
    """Write the model and tokenizer to ``out`` (once: an existing build is reused)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=2048,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    return write_model(out, "qwen3", lambda torch: Qwen3ForCausalLM(config).to(torch.float32))


YARN = {  # SGLang's CPU rotary embedding for DeepSeek needs a yarn setting (factor 1: none)
    "type": "yarn",
    "rope_type": "yarn",
    "factor": 1.0,
    "original_max_position_embeddings": 2048,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def build_deepseek(out: Path) -> Path:
    """Write the tiny DeepSeek-V3 and tokenizer to ``out`` (once)."""
    return deepseek_v3(out, "deepseek_v3_sglang", kv_lora_rank=64, rope_dim=32, rope_scaling=YARN)


if __name__ == "__main__":
    build = {"qwen3": build_qwen3, "deepseek": build_deepseek}[sys.argv[1]]
    print(build(Path(sys.argv[2])))
