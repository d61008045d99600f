"""Hypothesis strategies: one valid instance strategy per protocol message type."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.protocol import (
    Abort,
    BootstrapQuery,
    BootstrapReply,
    ChunkAck,
    ChunkReady,
    DecodeRegister,
    Heartbeat,
    PrefillLeave,
    PrefillRankInfo,
    PrefillReady,
    PrefillRegister,
    RegisterReply,
    RequestMeta,
    RoomQuery,
    RoomRoute,
    RoomWatch,
    StagedChunk,
    TransferDone,
    TransferFailed,
)

U64 = 2**64 - 1
I64 = 2**63 - 1

names = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=64)
rooms = st.integers(0, U64)
counts = st.integers(0, I64)
positives = st.integers(1, I64)
sides = st.sampled_from(["prefill", "decode"])
transports = st.from_regex(r"[a-z][a-z0-9_]{0,15}", fullmatch=True)
endpoints = st.builds(
    lambda scheme, host, port: f"{scheme}://{host}:{port}",
    st.sampled_from(["tcp", "ipc", "inproc"]),
    st.from_regex(r"[a-z0-9.-]{1,20}", fullmatch=True),
    st.integers(1, 65535),
)
# Any unicode (incl. surrogate-free astral chars), at least one non-space char.
reasons = st.text(min_size=1, max_size=300).filter(lambda s: s.strip() != "")
error_texts = st.one_of(st.just(""), reasons)
blobs = st.binary(min_size=1, max_size=64)
seconds = st.floats(0.0, 1e9, allow_nan=False, allow_infinity=False)


@st.composite
def tp_pairs(draw, max_size: int = 64):
    size = draw(st.integers(1, max_size))
    return size, draw(st.integers(0, size - 1))


@st.composite
def geometries(draw):
    common = dict(
        num_layers=draw(st.integers(1, 128)),
        dtype=draw(st.sampled_from(["bfloat16", "float16", "float32", "float8_e4m3fn", "int8"])),
        page_size=draw(st.sampled_from([1, 16, 32, 64])),
        layout=draw(st.sampled_from(["NHD", "HND"])),
        num_pages=draw(st.integers(1, 10**6)),
    )
    if draw(st.booleans()):
        return KVGeometry(total_kv_heads=1, head_dim=draw(st.integers(1, 1024)), mla=True, **common)
    return KVGeometry(
        total_kv_heads=draw(st.integers(1, 128)),
        head_dim=draw(st.integers(1, 512)),
        v_head_dim=draw(st.one_of(st.none(), st.integers(1, 512))),
        **common,
    )


page_id_arrays = st.lists(st.integers(0, 2**31 - 1), max_size=300).map(lambda ids: np.asarray(ids, dtype=np.int32))
timings = st.dictionaries(
    st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=16),
    seconds,
    max_size=8,
)


# protocol 6: the model's pool, a draft model's, or a pool of extra per-request state
kv_pools = st.sampled_from(["", "draft", "state:swa", "state:mamba.1"])
state_pool_lists = st.lists(st.sampled_from(["state:swa", "state:dsa", "state:mamba.0", "state:mamba.1"]), unique=True)


@st.composite
def pp_stages(draw):
    """Protocol 6: (pp_rank, pp_size, layer_start) of a prefill PP stage (0 without PP)."""
    size = draw(st.integers(1, 8))
    rank = draw(st.integers(0, size - 1))
    return rank, size, draw(st.integers(0, 4096)) if size > 1 else 0


@st.composite
def prefill_registers(draw):
    size, rank = draw(tp_pairs())
    pool = draw(kv_pools)
    pp_rank, pp_size, layer_start = draw(pp_stages())
    return PrefillRegister(
        draw(names),
        draw(names),
        size,
        rank,
        draw(endpoints),
        draw(geometries()),
        draw(transports),
        kv_pool=pool,
        draft_geometry=None if pool else draw(st.one_of(st.none(), geometries())),
        state_pools=() if pool else tuple(draw(state_pool_lists)),
        pp_rank=pp_rank,
        pp_size=pp_size,
        layer_start=layer_start,
        follows_room=draw(st.booleans()),
        all_heads=draw(st.booleans()),
    )


room_ids = st.integers(0, 2**64 - 1)


@st.composite
def bootstrap_replies(draw):
    size = draw(st.integers(1, 32))
    pool = draw(kv_pools)
    draft = None if pool else draw(st.one_of(st.none(), geometries()))
    pp_rank, pp_size, layer_start = draw(pp_stages())
    stages = tuple(sorted(draw(st.sets(st.integers(0, pp_size - 1), max_size=pp_size))))
    pp = dict(pp_rank=pp_rank, pp_size=pp_size, layer_start=layer_start, pp_stages=stages)
    pp["state_pools"] = () if pool else tuple(draw(state_pool_lists))
    pp["follows_room"] = draw(st.booleans())
    pp["all_heads"] = draw(st.booleans())
    pp["room_groups"] = tuple(draw(st.lists(st.tuples(room_ids, st.integers(0, 1023)), max_size=8)))
    if draw(st.booleans()):
        ranks = [PrefillRankInfo(r, draw(endpoints), draw(names)) for r in range(size)]
        return BootstrapReply(
            True, size, draw(geometries()), draw(transports), ranks, "", kv_pool=pool, draft_geometry=draft, **pp
        )
    registered = draw(st.lists(st.integers(0, size - 1), unique=True, max_size=size))
    ranks = [PrefillRankInfo(r, draw(endpoints), draw(names)) for r in registered]
    geometry = draw(st.one_of(st.none(), geometries()))
    return BootstrapReply(
        False,
        draw(st.sampled_from([0, size])),
        geometry,
        "",
        ranks,
        draw(reasons),
        kv_pool=pool,
        draft_geometry=draft,
        follows_room=pp["follows_room"],
        room_groups=pp["room_groups"],
    )


@st.composite
def decode_registers(draw):
    size, rank = draw(tp_pairs())
    geometry = draw(geometries())
    regions = draw(st.lists(blobs, min_size=1, max_size=40))
    locs = draw(
        st.lists(
            st.tuples(st.integers(0, len(regions) - 1), counts),
            min_size=geometry.num_buffers,
            max_size=geometry.num_buffers,
        )
    )
    return DecodeRegister(
        draw(names),
        draw(names),
        size,
        rank,
        draw(endpoints),
        geometry,
        draw(transports),
        draw(st.binary(min_size=1, max_size=512)),
        regions,
        draw(st.one_of(st.none(), blobs)),
        locs,
    )


@st.composite
def register_replies(draw):
    ok = draw(st.booleans())
    return RegisterReply(
        draw(names),
        draw(st.integers(0, 1023)),
        ok,
        "" if ok else draw(reasons),
        draw(geometries()),
        pool_mapped=ok and draw(st.booleans()),  # protocol 5: the prefill maps the decode's pool
        pool_note=draw(error_texts),
    )


increasing_positions = st.lists(st.integers(0, 2**20), max_size=64, unique=True).map(sorted)


@st.composite
def request_metas(draw):
    size, rank = draw(tp_pairs())
    staged = draw(st.booleans())
    elected = draw(st.booleans())
    return RequestMeta(
        draw(rooms),
        draw(names),
        rank,
        size,
        draw(counts),
        draw(page_id_arrays),
        draw(st.integers(-1, 2**31 - 1)),
        elected,
        draw(counts) if staged else -1,
        draw(positives) if staged else 0,
        draw(blobs) if staged else None,
        draw(counts),  # prefix_tokens
        fused=elected and not staged and draw(st.booleans()),  # protocol 5: one pool -> pool copy
        sparse=not staged and draw(st.booleans()),  # protocol 14: the writer picks the pages
    )


@st.composite
def transfer_dones(draw):
    total = draw(counts)
    chunk = None
    if total and draw(st.booleans()):  # the last staged chunk: at most total_bytes
        chunk = StagedChunk(draw(counts), draw(positives), draw(counts), draw(st.integers(1, total)))
    return TransferDone(
        draw(rooms),
        draw(st.integers(0, 1023)),
        total,
        draw(counts),
        draw(st.binary(max_size=256)),
        draw(timings),
        chunk,
        # protocol 14: the pages a sparse reader's writer wrote (direct writes: no staged chunk)
        positions=None if chunk is not None else draw(st.one_of(st.none(), increasing_positions)),
    )


MESSAGE_STRATEGIES = {
    "PrefillRegister": prefill_registers(),
    "BootstrapQuery": st.builds(
        BootstrapQuery, names, st.integers(0, 1023), kv_pool=kv_pools, pp_rank=st.integers(0, 1023)
    ),
    "PrefillLeave": st.builds(
        PrefillLeave,
        names,
        st.integers(0, 1023),
        dp_rank=st.integers(0, 1023),
        kv_pool=kv_pools,
        pp_rank=st.integers(0, 1023),
    ),
    "RoomRoute": st.builds(RoomRoute, names, room_ids, st.integers(0, 1023)),
    "RoomQuery": st.builds(RoomQuery, names, st.lists(room_ids, max_size=64).map(tuple)),
    "BootstrapReply": bootstrap_replies(),
    "DecodeRegister": decode_registers(),
    "RegisterReply": register_replies(),
    "RequestMeta": request_metas(),
    "ChunkAck": st.builds(ChunkAck, rooms, st.integers(0, 1023), counts),
    "RoomWatch": st.builds(RoomWatch, rooms, names, st.integers(0, 1023)),
    "PrefillReady": st.builds(PrefillReady, rooms, st.integers(0, 1023)),
    "ChunkReady": st.builds(ChunkReady, rooms, st.integers(0, 1023), counts, positives, counts, positives),
    "TransferDone": transfer_dones(),
    "TransferFailed": st.builds(TransferFailed, rooms, sides, st.integers(0, 1023), reasons),
    "Abort": st.builds(Abort, rooms, sides, st.integers(0, 1023), reasons),
    "Heartbeat": st.builds(
        Heartbeat,
        names,
        sides,
        st.integers(0, 1023),
        rooms,
        seconds,
        host=st.text(max_size=128),
        pid=st.integers(0, 2**31 - 1),
    ),
}

any_message = st.one_of(*MESSAGE_STRATEGIES.values())

# Anything msgpack can carry (what a hostile peer can put in any slot of a frame).
msgpack_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), U64),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.binary(max_size=40),
)
msgpack_objects = st.recursive(
    msgpack_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(st.one_of(st.text(max_size=12), st.binary(max_size=12)), inner, max_size=6),
    ),
    max_leaves=30,
)
