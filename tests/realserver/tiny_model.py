"""A tiny random-weight Llama with a local word-level tokenizer, built without any download.

4 layers, hidden 256, 8 query heads, 4 KV heads of 64, a 1024-word vocabulary: about 5 M
parameters. Weights are drawn with a fixed seed and a wide init (std 0.1) so greedy
decoding has clear top-1 margins in bf16 and is stable across processes. Runs in the
SGLang environment's Python (it needs ``transformers`` and ``tokenizers``):
``python tests/realserver/tiny_model.py DIR``.
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


def build(out: Path) -> Path:
    """Write the model and tokenizer to ``out`` (once: an existing build is reused)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
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
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    vocab = {w: i for i, w in enumerate(words())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    (out / "kvxfer_tiny.json").write_text(json.dumps({"seed": SEED, "vocab": VOCAB}))
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
