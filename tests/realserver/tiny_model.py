"""A tiny random-weight Llama with a local word-level tokenizer, built without any download.

4 layers, hidden 256, 8 query heads, 4 KV heads of 64, a 1024-word vocabulary: about 5 M
parameters. Weights are drawn with a fixed seed and a wide init (std 0.1) so greedy
decoding has clear top-1 margins in bf16 and is stable across processes. Runs in the
SGLang environment's Python (it needs ``transformers`` and ``tokenizers``):
``python tests/realserver/tiny_model.py DIR``.

``build_deepseek_v3`` (``python tests/realserver/tiny_model.py --deepseek-v3 DIR``) writes a
tiny DeepSeek-V3 (MLA) with the same tokenizer, shaped for vLLM's CPU MLA backend (docs/vllm.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SEED = 1234
VOCAB = 1024
KV_HEADS = 4
HEAD_DIM = 64

SENTENCES = (
    "the quick brown fox jumps over the lazy dog",
    "prefill and decode servers exchange the key value cache of every request",
    "a transfer engine moves head slices of pages between tensor parallel ranks",
    "every byte must arrive exactly once and the decoded tokens must not change",
    "one two three four five six seven eight nine ten eleven twelve",
)


def words() -> list[str]:
    seen: list[str] = []
    for sentence in SENTENCES:
        for word in sentence.split():
            if word not in seen:
                seen.append(word)
    specials = ["<unk>", "<s>", "</s>"]
    filler = [f"w{i}" for i in range(VOCAB - len(specials) - len(seen))]
    return specials + seen + filler


def save_tokenizer(out: Path) -> None:
    """The word-level tokenizer over ``words()`` (no download), saved next to a model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(words())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)


def write_model(out: Path, name: str | None, make) -> Path:
    """Build ``make(torch)`` (a ``*ForCausalLM``) under the fixed seed and write it, the
    tokenizer and ``kvxfer_tiny.json`` to ``out``, once: an existing build is reused."""
    import torch

    out = Path(out)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    make(torch).save_pretrained(out)
    save_tokenizer(out)
    meta = {"seed": SEED, "vocab": VOCAB, **({"model": name} if name else {})}
    (out / "kvxfer_tiny.json").write_text(json.dumps(meta))
    return out


def build(out: Path) -> Path:
    """Write the model and tokenizer to ``out`` (once: an existing build is reused)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=2048,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    return write_model(out, None, lambda torch: LlamaForCausalLM(config).to(torch.bfloat16))


MLA_KV_LORA_RANK = 512  # vLLM's CPU MLA decode kernel is built for a 576-wide latent only:
MLA_ROPE_DIM = 64  # kv_lora_rank 512 + qk_rope_head_dim 64 (CPU_MLA's supported head size)


def deepseek_v3(out: Path, name: str, *, kv_lora_rank: int, rope_dim: int, **extra) -> Path:
    """A tiny random-weight DeepSeek-V3 (MLA, every layer dense) and the word-level tokenizer
    in ``out`` (once): 2 layers, hidden 256, 4 query heads (qk_nope 32, v 32), no query LoRA,
    a latent of ``kv_lora_rank + rope_dim`` per token and layer, float32.
    ``first_k_dense_replace`` = the layer count (and ``moe_layer_freq`` 1, which SGLang reads)
    makes every layer a dense MLP; no MTP layer. ``extra``: more config fields."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    layers = 2
    config = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=layers,
        kv_lora_rank=kv_lora_rank,
        q_lora_rank=None,
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=2048,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        num_mtp_layers=0,
        **extra,
    )
    config.moe_layer_freq = 1
    return write_model(out, name, lambda torch: DeepseekV3ForCausalLM(config).to(torch.float32))


def build_deepseek_v3(out: Path) -> Path:
    """The tiny DeepSeek-V3 shaped for vLLM's CPU MLA: a 576-wide latent (the only width
    its kernel supports)."""
    return deepseek_v3(out, "deepseek_v3", kv_lora_rank=MLA_KV_LORA_RANK, rope_dim=MLA_ROPE_DIM)


if __name__ == "__main__":
    if sys.argv[1] == "--deepseek-v3":
        print(build_deepseek_v3(Path(sys.argv[2])))
    else:
        print(build(Path(sys.argv[1])))
