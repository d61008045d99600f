"""Protocol 5: ``RegisterReply.pool_mapped`` / ``pool_note`` (the prefill maps the decode's
KV pool) and ``RequestMeta.fused`` (the writer writes the decode's pool with one fused copy):
round trips, and every rejection with its message, locally and from a peer."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from sglang_kvxfer.errors import LocalProtocolError, RemoteProtocolError
from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.protocol import PROTOCOL_VERSION, RegisterReply, RequestMeta, decode, encode

G = KVGeometry(num_layers=2, total_kv_heads=8, head_dim=16, dtype="bfloat16", page_size=4, num_pages=64)
PAGES = np.array([3, 1, 2], dtype=np.int32)


def meta(**kw):
    base = dict(
        room=7,
        session="d0",
        tp_rank=0,
        tp_size=1,
        num_tokens=12,
        dst_page_ids=PAGES,
        aux_slot=-1,
        elected=True,
        staging_offset=-1,
        staging_capacity_bytes=0,
        staging_region=None,
    )
    base.update(kw)
    return RequestMeta(**base)


def test_fused_fields_round_trip():
    reply = RegisterReply("p0", 0, True, "", G, pool_mapped=True, pool_note="local maps its 1 KV region(s) on cpu")
    got = decode(encode(reply))
    assert got == reply and got.pool_mapped and got.pool_note.startswith("local maps")
    assert decode(encode(meta(fused=True))).fused
    assert not decode(encode(meta())).fused  # the default: direct
    plain = RegisterReply("p0", 0, True, "", G)
    assert not plain.pool_mapped and plain.pool_note == ""


def test_a_refused_registration_cannot_claim_a_mapped_pool():
    with pytest.raises(LocalProtocolError, match=r"RegisterReply.pool_mapped must be False when ok=False"):
        RegisterReply("p0", 0, False, "head_dim: prefill=16 decode=8", G, pool_mapped=True)


@pytest.mark.parametrize(
    "changes, text",
    [
        (dict(elected=False), "elected=False, staging_offset=-1"),
        (dict(staging_offset=0, staging_capacity_bytes=4096, staging_region=b"seg"), "elected=True, staging_offset=0"),
    ],
)
def test_fused_needs_an_elected_writer_without_a_window(changes, text):
    with pytest.raises(LocalProtocolError, match=r"RequestMeta.fused=True needs an elected writer without a staging"):
        meta(fused=True, **changes)
    with pytest.raises(LocalProtocolError, match=text):
        meta(fused=True, **changes)


def test_a_peer_claiming_fused_with_a_window_is_refused_naming_the_field():
    fields = msgpack.unpackb(encode(meta(staging_offset=0, staging_capacity_bytes=64, staging_region=b"s")))[2]
    fields["fused"] = True
    frame = msgpack.packb([PROTOCOL_VERSION, "RequestMeta", fields], use_bin_type=True)
    with pytest.raises(RemoteProtocolError, match=r"invalid RequestMeta from peer: RequestMeta.fused=True needs"):
        decode(frame)


def test_a_frame_without_the_new_fields_is_refused_naming_them():
    fields = msgpack.unpackb(encode(RegisterReply("p0", 0, True, "", G)), raw=False)[2]
    del fields["pool_mapped"]
    frame = msgpack.packb([PROTOCOL_VERSION, "RegisterReply", fields], use_bin_type=True)
    with pytest.raises(RemoteProtocolError, match=r"RegisterReply is missing field\(s\): pool_mapped"):
        decode(frame)
