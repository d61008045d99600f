"""vLLM's KV cache tensors as an engine geometry (no vLLM import here).

Owns ``VllmLayout``: the ``KVGeometry`` of one vLLM worker's KV cache and the per-layer
tensors in model order, read from the ``{layer_name: tensor}`` dict vLLM hands to
``register_kv_caches``. Must not import vLLM (unit tests run without it) or move bytes.

What vLLM 0.32 allocates, per layer:

- CPU attention (``CPU_ATTN``, layout ``LBHNC``): ``[num_blocks, kv_heads_local, block_size,
  2 * head_dim]``, each ``(block, head)`` tile the K rows of the block's tokens then their V
  rows: the engine's ``HND_KV`` layout.
- MLA: one latent tensor per layer, the same on every rank: ``[num_blocks, block_size,
  latent_dim]`` or ``[num_blocks, 1, block_size, latent_dim]`` (``CPU_MLA``, and the logical
  view on GPUs), the same bytes: the engine's MLA geometry (``NHD``, one head).
- GPU attention (FlashAttention and others) in vLLM's default layout ``LBNHC``: the logical
  ``[num_blocks, heads, block_size, head_dim + v_head_dim]`` view (``KVCacheLayout``,
  ``create_kv_cache_views``) over token-major storage ``[num_blocks, block_size, heads,
  head_dim + v_head_dim]``, each (token, head) its K then its V (FlashAttention reads it with
  ``transpose(1, 2).split(head_dim, -1)``): the engine's ``NHD_KV`` layout. ``tensors`` then
  holds the contiguous ``permute(0, 2, 1, 3)`` views (no copy).
- Refused with the reason: GPU caches in ``LBHNC`` (head-major ``[K | V]`` rows: FlashInfer's
  TRT-LLM kernels on Blackwell; no engine layout yet), and every layout whose per-layer view
  is not dense pages of one layer (``BLNHC``, ``BLHNC``, ``BHLNC``, ``LHBNC``: other layers'
  pages or other blocks' heads between a block's rows).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sglang_kvxfer.geometry import KVGeometry, Layout, normalize_dtype, owned_heads

__all__ = ["VllmLayout", "layer_order"]

_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_order(names: list[str]) -> list[str]:
    """Layer names in model order: by the first ``.N.`` index in the name (vLLM's
    ``model.layers.N.self_attn.attn``), then by name."""

    def key(name: str) -> tuple[int, str]:
        found = _INDEX.search(name)
        return (int(found.group(1)) if found else -1, name)

    return sorted(names, key=key)


def _check_local_heads(name: str, local_heads: int, total_kv_heads: int, tp_size: int, tp_rank: int) -> None:
    """A cache layer must hold exactly the KV heads its TP rank owns."""
    heads = owned_heads(total_kv_heads, tp_size, tp_rank)
    if len(heads) != local_heads:
        raise ValueError(
            f"KV cache layer {name} holds {local_heads} head(s), but TP rank {tp_rank} of {tp_size} owns "
            f"{len(heads)} of the model's {total_kv_heads} KV heads"
        )


@dataclass(frozen=True)
class VllmLayout:
    """One vLLM worker's KV cache as the engine sees it.

    ``tensors[i]`` is layer ``i``'s tensor as vLLM allocated it (model order, the pool's
    buffer order); ``geometry`` describes them; ``tp_size``/``tp_rank`` place the rank.
    """

    geometry: KVGeometry
    tensors: tuple
    layer_names: tuple[str, ...]
    tp_size: int
    tp_rank: int

    @classmethod
    def from_kv_caches(
        cls,
        kv_caches: Mapping[str, Any],
        *,
        total_kv_heads: int,
        mla: bool,
        tp_size: int,
        tp_rank: int,
        head_dim: int | None = None,
    ) -> VllmLayout:
        """Read ``register_kv_caches``' dict. Raises ``ValueError`` naming the layer and the
        shape (and strides) when the tensors are not a layout the engine can move.
        ``head_dim``: the K head size of a GPU cache, whose rows hold K then V (default: half
        the row, ``head_size_v == head_size``)."""
        if not kv_caches:
            raise ValueError("vLLM registered no KV cache tensors")
        names = layer_order(list(kv_caches))
        tensors = [kv_caches[n] for n in names]
        first = tensors[0]
        for name, t in zip(names, tensors):
            if tuple(t.shape) != tuple(first.shape) or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(
                    f"KV cache layer {name} is {tuple(t.shape)} {t.dtype} on {t.device}, layer {names[0]} is "
                    f"{tuple(first.shape)} {first.dtype} on {first.device}: the kvxfer connector needs one "
                    "shape for every layer (hybrid and multi-group caches are not supported)"
                )
        dtype = normalize_dtype(first.dtype)
        shape = tuple(first.shape)
        if first.device.type != "cpu" and not mla:
            return cls._gpu_cache(names, tensors, total_kv_heads, tp_size, tp_rank, head_dim)
        for name, t in zip(names, tensors):
            if not t.is_contiguous():
                raise ValueError(f"KV cache layer {name} is not contiguous (strides {t.stride()})")
        if mla:
            if len(shape) == 4 and shape[1] == 1:  # CPU_MLA: [num_blocks, 1, block_size, latent_dim]
                shape = (shape[0], shape[2], shape[3])
            if len(shape) != 3:
                raise ValueError(
                    f"MLA KV cache layer {names[0]} is {tuple(first.shape)}; expected [num_blocks, block_size, "
                    "latent_dim] or [num_blocks, 1, block_size, latent_dim]"
                )
            num_blocks, block_size, latent = shape
            geometry = KVGeometry(
                num_layers=len(names),
                total_kv_heads=1,
                head_dim=latent,
                dtype=dtype,
                page_size=block_size,
                layout=Layout.NHD,
                mla=True,
                num_pages=num_blocks,
            )
            views = tuple(t.view(num_blocks * block_size, 1, latent) for t in tensors)
            return cls(geometry, views, tuple(names), tp_size, tp_rank)
        if len(shape) != 4 or shape[3] % 2:
            raise ValueError(
                f"KV cache layer {names[0]} is {shape}; expected vLLM's CPU layout "
                "[num_blocks, kv_heads, block_size, 2 * head_dim]"
            )
        num_blocks, local_heads, block_size, two_dim = shape
        _check_local_heads(names[0], local_heads, total_kv_heads, tp_size, tp_rank)
        geometry = KVGeometry(
            num_layers=len(names),
            total_kv_heads=total_kv_heads,
            head_dim=two_dim // 2,
            dtype=dtype,
            page_size=block_size,
            layout=Layout.HND_KV,
            num_pages=num_blocks,
        )
        return cls(geometry, tuple(tensors), tuple(names), tp_size, tp_rank)

    @classmethod
    def _gpu_cache(cls, names, tensors, total_kv_heads, tp_size, tp_rank, head_dim) -> VllmLayout:
        """A GPU attention cache: vLLM's logical ``[num_blocks, heads, block_size, head_dim +
        v_head_dim]`` view; only the token-major storage (``LBNHC``) is accepted."""
        first = tensors[0]
        shape = tuple(first.shape)
        if len(shape) != 4:
            raise ValueError(
                f"KV cache layer {names[0]} on {first.device} is {shape}; expected vLLM's logical "
                "[num_blocks, kv_heads, block_size, head_dim + v_head_dim] view"
            )
        num_blocks, local_heads, block_size, row = shape
        for name, t in zip(names, tensors):
            if t.permute(0, 2, 1, 3).is_contiguous():
                continue
            if t.is_contiguous():
                why = (
                    "head-major [K | V] rows (vLLM layout LBHNC, e.g. FlashInfer's TRT-LLM kernels on Blackwell), "
                    "which the engine has no layout for yet; run vLLM with VLLM_KV_CACHE_LAYOUT=LBNHC"
                )
            else:
                dense = (block_size * local_heads * row, row, local_heads * row, 1)
                why = (
                    f"not dense token-major pages of one layer (LBNHC strides would be {dense}): a cross-layer "
                    "or padded layout (BLNHC, BLHNC, BHLNC, LHBNC); run vLLM with VLLM_KV_CACHE_LAYOUT=LBNHC"
                )
            raise ValueError(f"KV cache layer {name} on {t.device} is {shape} with strides {t.stride()}: {why}")
        if head_dim is None:
            if row % 2:
                raise ValueError(
                    f"KV cache layer {names[0]} rows hold {row} elements, odd: pass head_dim (K) so the "
                    "rest is V (head_size_v)"
                )
            head_dim = row // 2
        if not 1 <= head_dim < row:
            raise ValueError(f"head_dim={head_dim} must be in [1, {row}) for rows of {row} elements (K then V)")
        _check_local_heads(names[0], local_heads, total_kv_heads, tp_size, tp_rank)
        geometry = KVGeometry(
            num_layers=len(names),
            total_kv_heads=total_kv_heads,
            head_dim=head_dim,
            v_head_dim=row - head_dim,
            dtype=normalize_dtype(first.dtype),
            page_size=block_size,
            layout=Layout.NHD_KV,
            num_pages=num_blocks,
        )
        views = tuple(t.permute(0, 2, 1, 3) for t in tensors)  # [num_blocks, block_size, heads, row]
        return cls(geometry, views, tuple(names), tp_size, tp_rank)

    def heads_slice(self, lo: int, hi: int) -> slice:
        """Local index range of global heads ``[lo, hi)`` on this rank (clipped)."""
        heads = owned_heads(self.geometry.total_kv_heads, self.tp_size, self.tp_rank, self.geometry.mla)
        start, stop = max(lo, heads.start), min(hi, heads.stop)
        return slice(start - heads.start, max(start, stop) - heads.start)
