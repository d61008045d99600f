"""SGLang as the integration tests see it: its real base module, real code from its
``disaggregation/utils.py``, and KV pools / metadata buffers laid out as SGLang lays them out.

CI installs ``sglang==0.5.23`` without its dependencies plus the few small packages that
``import sglang.srt.disaggregation.base.conn`` needs (see ``.ci/run``). Two of SGLang's
heavy dependencies are left out on purpose, and these helpers say how:

* ``triton`` (about 1 GB installed): SGLang's ``utils/common.py`` runs ``import triton`` and
  one ``setattr`` on it at import time, and the base classes use nothing else from it. If
  triton is missing, the base module is imported once with an empty stand-in module bound
  to the name, which is removed again right after (torch never sees it).
* ``disaggregation/utils.py`` imports the model zoo (transformers, torchvision, triton
  kernels). ``load_utils_defs`` takes the few definitions the tests need from that file's
  own source (``DisaggregationMode``, ``TransferBackend``, ``KVClassType``,
  ``get_kv_class``) and runs them in a fresh module: SGLang's code, not a copy of it.
"""

from __future__ import annotations
import __future__

import ast
import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BASE = "sglang.srt.disaggregation.base.conn"


def import_sglang_base():
    """``(module, "")`` for SGLang's base module, or ``(None, reason)``."""
    if BASE in sys.modules:
        return sys.modules[BASE], ""
    if importlib.util.find_spec("sglang") is None:
        return None, (
            f"SGLang is not installed, so its base module {BASE} cannot be imported; "
            "install it as .ci/run does: pip install --no-deps sglang==0.5.23 ..."
        )
    shim = None
    if importlib.util.find_spec("triton") is None:
        shim = types.ModuleType("triton")
        shim.__doc__ = "empty stand-in bound only while SGLang's base module imports (see sglang_env)"
        sys.modules["triton"] = shim
    try:
        return importlib.import_module(BASE), ""
    except Exception as exc:
        return None, (
            f"SGLang's base module {BASE} failed to import ({type(exc).__name__}: {exc}); "
            "install what it needs as .ci/run does"
        )
    finally:
        if shim is not None and sys.modules.get("triton") is shim:
            del sys.modules["triton"]


def load_utils_defs(
    names=("DisaggregationMode", "TransferBackend", "KVClassType", "get_kv_class"),
    relpath: str = "disaggregation/utils.py",
):
    """A module holding SGLang's own definitions ``names`` from its installed
    ``disaggregation/utils.py`` (or another module of ``sglang/srt``: ``relpath``; the
    implementation of ``get_kv_class``, not its overloads)."""
    import enum
    import typing

    import sglang

    path = Path(sglang.__file__).parent / "srt" / relpath
    tree = ast.parse(path.read_text(), str(path))

    def is_overload(node) -> bool:
        return any(getattr(d, "id", getattr(d, "attr", None)) == "overload" for d in node.decorator_list)

    picked = [
        n
        for n in tree.body
        if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name in names and not is_overload(n)
    ]
    missing = set(names) - {n.name for n in picked}
    if missing:
        raise LookupError(f"{path} no longer defines {sorted(missing)}")
    module = types.ModuleType("sglang_utils_defs")
    module.__file__ = str(path)
    module.__dict__.update(Enum=enum.Enum, Optional=typing.Optional, Type=type)
    code = compile(
        ast.Module(body=picked, type_ignores=[]),
        str(path),
        "exec",
        flags=__future__.annotations.compiler_flag,
        dont_inherit=True,
    )
    exec(code, module.__dict__)
    return module


# -- SGLang-shaped memory ------------------------------------------------------------------------


@dataclass
class Model:
    """The test model: what SGLang's pools of every rank are sized from."""

    total_kv_heads: int = 4
    num_layers: int = 2
    head_dim: int = 16
    v_head_dim: int = 8
    page_size: int = 4
    pool_tokens: int = 96  # MHATokenToKVPool `size`; buffers hold size + page_size rows
    dtype: str = "bfloat16"
    kv_cache_dtype_str: str = "bfloat16"
    metadata_slots: int = 8
    hidden_size: int = 32
    mla: bool = False
    # a speculative decoding draft model (EAGLE-like: its own layers, heads and dims; the
    # pool's page size, rows and dtype are the model's): its KV entries follow the model's
    draft: Draft | None = None
    # extra per-request state (KVArgs.state_types): a sglang_state_env.StateModel
    state: Any = None
    # KVArgs.kv_layout (a DeepSeek-V4 pool, MLA): the model's KV buffers are its first compressed
    # pool (one item a page), followed by state.kv_pages' pools
    kv_layout: str | None = None

    @property
    def hybrid_mla(self) -> bool:
        """A hybrid linear-attention model over an MLA pool (Kimi-Linear): SGLang's
        HybridLinearKVPool, for which it passes ``is_mla_backend=False`` and sets
        ``KVArgs.is_hybrid_mla_backend``."""
        return self.mla and self.state is not None and "mamba" in self.state.kinds

    @property
    def is_mla_backend(self) -> bool:
        """What SGLang's schedulers pass the manager (``is_mla_backend(token_to_kv_pool)``)."""
        return self.mla and not self.hybrid_mla


@dataclass
class Draft:
    """The draft model's KV shape (``draft_token_to_kv_pool``)."""

    num_layers: int = 1
    total_kv_heads: int = 2
    head_dim: int = 8
    v_head_dim: int = 8
    mla: bool = False

    def model(self, target: Model) -> Model:
        """The draft pool as a ``Model`` of its own (for ``model_geometry`` and the fill)."""
        return Model(
            total_kv_heads=self.total_kv_heads,
            num_layers=self.num_layers,
            head_dim=self.head_dim,
            v_head_dim=self.v_head_dim,
            page_size=target.page_size,
            pool_tokens=target.pool_tokens,
            dtype=target.dtype,
            kv_cache_dtype_str=target.kv_cache_dtype_str,
            mla=self.mla,
        )


@dataclass
class RankMemory:
    """One rank's KV pool and metadata buffers, and the KVArgs SGLang would build over them."""

    k: list
    v: list
    meta: dict
    kv_args: object = None
    extra: dict = field(default_factory=dict)
    draft_k: list = field(default_factory=list)
    draft_v: list = field(default_factory=list)

    @property
    def buffers(self) -> list:
        return self.k + self.v

    @property
    def draft_buffers(self) -> list:
        return self.draft_k + self.draft_v


def local_heads(model: Model, tp: int) -> int:
    return 1 if model.mla else max(1, model.total_kv_heads // tp)


def metadata_buffers(model: Model):
    """``MetadataBuffers`` of 0.5.23 (no sampling mask, no DSA, no checksum): name -> tensor."""
    import torch

    s = model.metadata_slots
    return {
        "output_ids": torch.zeros((s, 16), dtype=torch.int32),
        "cached_tokens": torch.zeros((s, 16), dtype=torch.int32),
        "output_token_logprobs_val": torch.zeros((s, 16), dtype=torch.float32),
        "output_token_logprobs_idx": torch.zeros((s, 16), dtype=torch.int32),
        "output_top_logprobs_val": torch.zeros((s, 128), dtype=torch.float32),
        "output_top_logprobs_idx": torch.zeros((s, 128), dtype=torch.int32),
        "output_topk_p": torch.zeros((s, 16), dtype=torch.float32),
        "output_topk_index": torch.zeros((s, 16), dtype=torch.int64),
        "output_hidden_states": torch.zeros((s, model.hidden_size), dtype=torch.bfloat16),
        "bootstrap_room": torch.zeros((s, 8), dtype=torch.uint64),
    }


def rank_memory(model: Model, tp: int, rank: int, role: str, state_tp: tuple[int, int] | None = None) -> RankMemory:
    """KV buffers as ``MHATokenToKVPool``/``MLATokenToKVPool`` allocate them (NHD,
    ``size + page_size`` rows per layer; K of every layer then V in ``kv_data_ptrs``), the
    metadata buffers, and ``KVArgs`` filled the way SGLang's ``_init_kv_manager`` of
    ``role`` fills it (the decode side sets no head counts). ``state_tp``: the ``(TP size,
    rank)`` the extra state is sharded by when it is not the KV's (CP-TP group sharing: KV of
    attention TP 1, linear attention over the whole TP group)."""
    import torch

    base, _ = import_sglang_base()
    dtype = getattr(torch, model.dtype)
    rows = model.pool_tokens + model.page_size
    heads = local_heads(model, tp)
    width = model.head_dim
    k = [torch.zeros((rows, heads, width), dtype=dtype) for _ in range(model.num_layers)]
    v = (
        []
        if model.mla
        else [torch.zeros((rows, heads, model.v_head_dim), dtype=dtype) for _ in range(model.num_layers)]
    )
    meta = metadata_buffers(model)
    draft_k, draft_v = [], []
    if model.draft is not None:  # draft_token_to_kv_pool: same rows, the draft's heads and dims
        dm = model.draft.model(model)
        dh = local_heads(dm, tp)
        draft_k = [torch.zeros((rows, dh, dm.head_dim), dtype=dtype) for _ in range(dm.num_layers)]
        if not dm.mla:
            draft_v = [torch.zeros((rows, dh, dm.v_head_dim), dtype=dtype) for _ in range(dm.num_layers)]
    args = base.KVArgs()
    args.engine_rank = rank
    args.pp_rank = 0
    args.system_dp_rank = 0
    args.rust_http_port = None
    args.kv_cache_dtype_str = model.kv_cache_dtype_str
    args.kv_layout = model.kv_layout
    args.prefill_start_layer = 0
    args.prefill_end_layer = model.num_layers
    # _init_kv_manager: the model's entries, then draft_kv_pool.get_contiguous_buf_infos()
    bufs = k + v + draft_k + draft_v
    args.kv_data_ptrs = [t.data_ptr() for t in bufs]
    args.kv_data_lens = [t.nbytes for t in bufs]
    args.kv_item_lens = [t[0].nbytes * model.page_size for t in bufs]
    args.num_draft_entries = len(draft_k) + len(draft_v)
    args.kv_layer_ids = list(range(model.num_layers)) * (1 if model.mla else 2)
    args.kv_layer_ids += [model.num_layers + i for i in range(len(draft_k))] * (2 if draft_v else 1)
    if role == "prefill" and not model.mla:
        args.kv_head_num = heads
        args.total_kv_head_num = model.total_kv_heads
    args.page_size = model.page_size
    tensors = list(meta.values())
    args.aux_data_ptrs = [t.data_ptr() for t in tensors]
    args.aux_data_lens = [t.nbytes for t in tensors]
    args.aux_item_lens = [t[0].nbytes for t in tensors]
    args.ib_device = None
    args.gpu_id = 0
    # setup_state_kv_args for a model without extra per-request state
    args.state_types = []
    args.state_data_ptrs, args.state_data_lens, args.state_item_lens = [], [], []
    args.state_layer_ids, args.state_dim_per_tensor, args.state_slice_outer_counts = [], [], []
    args.state_conv_shard_groups = []
    args.is_hybrid_mla_backend = model.hybrid_mla
    args.swa_kv_cache_layout = None
    mem = RankMemory(k, v, meta, args, draft_k=draft_k, draft_v=draft_v)
    if model.state is not None:  # setup_state_kv_args of a hybrid pool
        from tests.integrations import sglang_state_env

        defs = load_utils_defs(("append_state_component",))
        mem.extra["state"] = sglang_state_env.attach(model, *(state_tp or (tp, rank)), args, defs, kv=(k, v))
    return mem


def model_geometry(model: Model):
    """The model's geometry as the test fills and checks it (element dtype, real dims)."""
    from sglang_kvxfer.geometry import KVGeometry

    return KVGeometry(
        num_layers=model.num_layers,
        total_kv_heads=1 if model.mla else model.total_kv_heads,
        head_dim=model.head_dim,
        v_head_dim=None if model.mla else model.v_head_dim,
        dtype=model.dtype,
        page_size=model.page_size,
        mla=model.mla,
        num_pages=(model.pool_tokens + model.page_size) // model.page_size,
    )


def server_args(model_path: str, role: str, tp: int, port: int, **extra):
    """A real ``ServerArgs`` for one side of the test deployment."""
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        model_path=model_path,
        tp_size=tp,
        device="cpu",
        host="127.0.0.1",
        disaggregation_mode=role,
        disaggregation_transfer_backend="kvxfer",
        disaggregation_bootstrap_port=port,
        **extra,
    )
