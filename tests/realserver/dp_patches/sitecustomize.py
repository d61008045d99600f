"""PATCHES to SGLang 0.5.23's CPU path for attention DP and DeepSeek MLA: test tree only.

SGLang's attention-DP and DeepSeek code paths assume a GPU (or the AMX CPU backend); on a
CPU with ``--attention-backend torch_native`` three gaps stop a server. They are SGLang's
gaps, not this project's, and are patched here, in the servers of the DP real-server tests
only (this directory goes first on their ``PYTHONPATH``; the stand-ins' ``sitecustomize``
next to it is loaded first, so its hooks stay in force):

1. DP-attention padding asks the attention backend for
   ``get_cpu_graph_seq_len_fill_value()``, which only ``intel_amx`` defines: the torch-native
   backend gets the same (1: a padded sequence of one token).
2. An idle DP rank runs a forward over 0 tokens, and the native rotary embedding cannot
   reshape an empty query: an empty batch goes through unchanged.
3. DeepSeek's attention dispatch has no ``torch_native`` entry and falls back to an MHA
   extend over the latent pool: ``torch_native`` dispatches to the absorbed MLA in every mode.

Each patch is applied right after SGLang's module is imported, in every process.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

_standins = Path(__file__).resolve().parent.parent / "standins" / "sitecustomize.py"
_spec = importlib.util.spec_from_file_location("kvxfer_standins_sitecustomize", _standins)
_module = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _module
_spec.loader.exec_module(_module)


def _fill_value(module) -> None:
    module.TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value = lambda self: 1


def _empty_rope(module) -> None:
    for name in ("RotaryEmbedding", "DeepseekScalingRotaryEmbedding"):
        cls = getattr(module, name, None)
        if cls is None or "forward_native" not in cls.__dict__:
            continue
        native = cls.__dict__["forward_native"]

        def forward_native(self, positions, query, key, *args, _native=native, **kwargs):
            if query.shape[0] == 0:
                return query, key
            return _native(self, positions, query, key, *args, **kwargs)

        cls.forward_native = forward_native


def _mla_dispatch(module) -> None:
    module.AttentionBackendRegistry.register("torch_native", module._dispatch_mla_subtype)


PATCHES = {
    "sglang.srt.layers.attention.torch_native_backend": _fill_value,
    "sglang.srt.layers.rotary_embedding.base": _empty_rope,
    "sglang.srt.layers.rotary_embedding.rope_variant": _empty_rope,
    "sglang.srt.models.deepseek_common.attention_backend_handler": _mla_dispatch,
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.pending = dict(PATCHES)

    def find_spec(self, fullname, path=None, target=None):
        patch = self.pending.pop(fullname, None)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            if self.pending:
                sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            patch(module)
            if os.environ.get("KVXFER_DP_PATCHES_LOG"):
                with open(os.environ["KVXFER_DP_PATCHES_LOG"], "a") as f:
                    f.write(f"pid {os.getpid()}: patched {fullname}\n")

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
