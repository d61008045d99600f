"""vLLM's KV cache tensors as an engine geometry (no vLLM import here).

Owns ``VllmLayout``: the ``KVGeometry`` of one vLLM worker's KV cache and the per-layer
tensors in model order, read from the ``{layer_name: tensor}`` dict vLLM hands to
``register_kv_caches``. Must not import vLLM (unit tests run without it) or move bytes.

What vLLM 0.32 allocates, per layer:

- CPU attention (``CPU_ATTN``, layout ``LBHNC``): ``[num_blocks, kv_heads_local, block_size,
  2 * head_dim]``, each ``(block, head)`` tile the K rows of the block's tokens then their V
  rows: the engine's ``HND_KV`` layout.
- MLA: one latent tensor per layer, the same on every rank: ``[num_blocks, block_size,
  latent_dim]`` (GPU MLA backends) or ``[num_blocks, 1, block_size, latent_dim]`` (``CPU_MLA``),
  the same bytes: the engine's MLA geometry (``NHD``, one head).
- GPU attention (FlashAttention and others): the logical ``[num_blocks, heads, block_size,
  2 * head_dim]`` view over a store whose innermost axis is one token's ``[K | V]`` (read with
  ``transpose(1, 2).split(head_dim, -1)``). Neither ``NHD`` nor ``HND`` (separate K and V
  buffers) nor ``HND_KV`` (K rows then V rows per tile) describes that; it is refused with
  the reason (see docs/vllm.md).
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
        cls, kv_caches: Mapping[str, Any], *, total_kv_heads: int, mla: bool, tp_size: int, tp_rank: int
    ) -> VllmLayout:
        """Read ``register_kv_caches``' dict. Raises ``ValueError`` naming the layer and the
        shape when the tensors are not a layout the engine can move."""
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
            if not t.is_contiguous():
                raise ValueError(f"KV cache layer {name} is not contiguous (strides {t.stride()})")
        if first.device.type != "cpu":
            raise ValueError(
                f"KV cache on {first.device}: vLLM's GPU attention backends keep one token's [K | V] "
                "innermost, a layout the engine has no name for yet (NHD/HND keep K and V in separate "
                "buffers, HND_KV keeps a tile's K rows before its V rows); see docs/vllm.md"
            )
        dtype = normalize_dtype(first.dtype)
        shape = tuple(first.shape)
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
        heads = owned_heads(total_kv_heads, tp_size, tp_rank)
        if len(heads) != local_heads:
            raise ValueError(
                f"KV cache layer {names[0]} holds {local_heads} head(s), but TP rank {tp_rank} of {tp_size} owns "
                f"{len(heads)} of the model's {total_kv_heads} KV heads"
            )
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

    def heads_slice(self, lo: int, hi: int) -> slice:
        """Local index range of global heads ``[lo, hi)`` on this rank (clipped)."""
        heads = owned_heads(self.geometry.total_kv_heads, self.tp_size, self.tp_rank, self.geometry.mla)
        start, stop = max(lo, heads.start), min(hi, heads.stop)
        return slice(start - heads.start, max(start, stop) - heads.start)
