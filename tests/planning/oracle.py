"""A brute-force oracle for KV re-sharding, written independently of the planner.

It builds the full KV of every head, places each rank's owned heads into that rank's pool
token by token with plain loops, and says what every decode pool must hold afterwards.
"""

from __future__ import annotations

import numpy as np

from sglang_kvxfer.geometry import Layout, RankPlacement

SENTINEL = -7.0  # untouched decode bytes
POISON = -3.0  # unused prefill bytes: copying any of them shows up in a decode pool


def full_kv(num_layers, num_heads, num_tokens, head_dim, v_head_dim, seed=0):
    """Distinct float32 values for every (layer, K/V, token, head, dim)."""
    rng = np.random.default_rng(seed)
    k = rng.permutation(num_layers * num_tokens * num_heads * head_dim).astype(np.float32)
    k = k.reshape(num_layers, num_tokens, num_heads, head_dim) + 1.0
    v = None
    if v_head_dim:
        v = rng.permutation(num_layers * num_tokens * num_heads * v_head_dim).astype(np.float32)
        v = -(v.reshape(num_layers, num_tokens, num_heads, v_head_dim) + 1.0) * 0.5 - 100.0
    return k, v


def empty_pool(place: RankPlacement, fill: float = SENTINEL):
    return [np.full(place.buffer_shape(i), fill, dtype=np.float32) for i in range(place.geometry.num_buffers)]


def place_tokens(place: RankPlacement, pool, k_full, v_full, pages, num_tokens):
    """Write the heads this rank's pool holds (its owned heads; every head with
    ``all_heads``) of tokens [0, num_tokens) into its pages, one element row at a time."""
    g = place.geometry
    heads = list(place.stored_heads)
    for layer in range(g.num_layers):
        if g.packed_kv:  # one buffer per layer: HND_KV [page, head, K|V, slot, dim], NHD_KV [page, slot, head, K+V]
            kinds = [(layer, 0, k_full), (layer, 1, v_full)]
        else:
            kinds = [(layer, 0, k_full)] + ([(g.num_layers + layer, 1, v_full)] if g.has_v else [])
        for buf_index, kind, full in kinds:
            buf = pool[buf_index]
            for t in range(num_tokens):
                page, slot = int(pages[t // g.page_size]), t % g.page_size
                for local, head in enumerate(heads):
                    row = full[layer, t, head]
                    if g.layout is Layout.NHD:
                        buf[page * g.page_size + slot, local, :] = row
                    elif g.layout is Layout.HND_KV:
                        buf[page, local, kind, slot, :] = row
                    elif g.layout is Layout.NHD_KV:  # K elements first, then V
                        lo = 0 if kind == 0 else g.head_dim
                        buf[page, slot, local, lo : lo + row.size] = row
                    else:
                        buf[page, local, slot, :] = row
    return pool
