"""A tiny random-weight Gemma-4 text model (SGLang's hybrid sliding-window attention), with the
tiny Llama's word-level tokenizer, built without any download. Run in the SGLang environment's
Python: ``python tests/realserver/tiny_swa_model.py DIR [LAYERS]`` (``LAYERS``: ``sssf`` by default,
``sfsf`` gives each of two PP stages a sliding-window and a full-attention layer).

4 layers (3 sliding-window layers of window 16, then one full-attention layer), hidden 256,
4 query heads, 2 KV heads of 64, no per-layer input embeddings, float32. SGLang 0.5.23 serves
it with a separate SWA pool (``SWAKVPool``: ``KVArgs.state_types=['swa']``) unless
``--disable-hybrid-swa-memory``. Two fields are fixed up in ``config.json``: an empty
``per_layer_config`` (transformers would otherwise give the full-attention layers a head_dim
of 512) and ``swa_num_key_value_heads`` (SGLang sizes the SWA pool of Gemma-4 with it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_model import VOCAB, write_model  # noqa: E402

WINDOW = 16
KV_HEADS = 2


def build_gemma4(out: Path, layers: str = "sssf") -> Path:
    """Write the model and tokenizer to ``out`` (once: an existing build is reused).
    ``layers``: each layer's type, ``s`` sliding-window or ``f`` full attention."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    out = Path(out)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    config = Gemma4TextConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=len(layers),
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        head_dim=64,
        max_position_embeddings=2048,
        initializer_range=0.1,
        sliding_window=WINDOW,
        layer_types=[{"s": "sliding_attention", "f": "full_attention"}[t] for t in layers],
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=VOCAB,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,  # tied, the random model repeats one token whatever the prompt
        per_layer_config={},
    )
    write_model(out, "gemma4_text", lambda torch: Gemma4ForCausalLM(config).to(torch.float32))
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(per_layer_config={}, swa_num_key_value_heads=KV_HEADS)
    path.write_text(json.dumps(cfg, indent=2))
    return out


if __name__ == "__main__":
    print(build_gemma4(Path(sys.argv[1]), *sys.argv[2:3]))
