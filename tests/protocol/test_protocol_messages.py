"""Messages: every type round-trips through the codec; local construction is validated."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.protocol import (
    MAX_PAGE_IDS,
    MAX_REASON_CHARS,
    MESSAGE_TYPES,
    Abort,
    BootstrapReply,
    ChunkReady,
    DecodeRegister,
    Heartbeat,
    LocalProtocolError,
    PrefillRankInfo,
    RegisterReply,
    RequestMeta,
    Side,
    StagedChunk,
    TransferDone,
    TransferFailed,
    decode,
    encode,
)
from tests.protocol.protocol_strategies import MESSAGE_STRATEGIES, any_message

GEO = KVGeometry(num_layers=2, total_kv_heads=8, head_dim=64)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def meta(**over):
    fields = dict(
        room=7,
        session="dec-1",
        tp_rank=1,
        tp_size=2,
        num_tokens=40,
        dst_page_ids=[3, 9, 4],
        aux_slot=5,
        elected=True,
        staging_offset=-1,
        staging_capacity_bytes=0,
        staging_region=None,
    )
    fields.update(over)
    return RequestMeta(**fields)


def decode_register(**over):
    fields = dict(
        engine_version="0.1.0",
        session="dec-1",
        tp_size=2,
        tp_rank=0,
        endpoint="tcp://10.0.0.2:5000",
        geometry=GEO,
        transport="tcp",
        agent_descriptor=b"agent",
        kv_regions=[b"k0", b"k1", b"v0", b"v1"],
        aux_region=b"aux",
        kv_buffer_locs=[(0, 0), (1, 0), (2, 0), (3, 0)],
    )
    fields.update(over)
    return DecodeRegister(**fields)


# -- round trips -------------------------------------------------------------------------------
def test_every_message_type_has_a_strategy():
    assert set(MESSAGE_STRATEGIES) == set(MESSAGE_TYPES)
    assert len(MESSAGE_TYPES) == 17


@pytest.mark.parametrize("tag", sorted(MESSAGE_STRATEGIES))
def test_round_trip(tag):
    @SETTINGS
    @given(MESSAGE_STRATEGIES[tag])
    def check(msg):
        frame = encode(msg)
        back = decode(frame)
        assert type(back) is type(msg)
        assert back == msg
        assert encode(back) == frame  # the encoding is canonical
        for name in type(msg)._kinds:
            a, b = getattr(msg, name), getattr(back, name)
            if isinstance(a, np.ndarray):
                assert b.dtype == np.int32 and not b.flags.writeable
                assert a.tobytes() == b.tobytes()

    check()


def test_page_ids_travel_as_little_endian_int32_bytes():
    m = meta(dst_page_ids=np.array([1, 2**31 - 1, 0], dtype=np.int64))
    back = decode(encode(m))
    assert back.dst_page_ids.tolist() == [1, 2**31 - 1, 0]
    assert b"\x01\x00\x00\x00\xff\xff\xff\x7f\x00\x00\x00\x00" in encode(m)


def test_equality_compares_page_ids_by_value():
    assert meta() == meta(dst_page_ids=np.array([3, 9, 4]))
    assert meta() != meta(dst_page_ids=[3, 9, 5])
    assert meta() != meta(room=8)
    assert meta() != "not a message"


@SETTINGS
@given(any_message)
def test_messages_are_frozen_and_slotted(msg):
    name = next(iter(type(msg)._kinds))
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(msg, name, getattr(msg, name))
    assert not hasattr(msg, "__dict__")


# -- local construction: normalisation ---------------------------------------------------------
def test_page_ids_are_copied_and_read_only():
    src = np.array([5, 6, 7], dtype=np.int32)
    m = meta(dst_page_ids=src)
    src[0] = 99
    assert m.dst_page_ids.tolist() == [5, 6, 7]
    with pytest.raises(ValueError):
        m.dst_page_ids[0] = 1


def test_bytes_like_descriptors_become_bytes():
    m = decode_register(
        agent_descriptor=bytearray(b"ag"),
        kv_regions=(memoryview(b"k"),),
        kv_buffer_locs=[(0, 0), (0, 64), (0, 128), (0, 192)],
    )
    assert m.agent_descriptor == b"ag" and type(m.agent_descriptor) is bytes
    assert m.kv_regions == (b"k",)


def test_kv_buffer_locs_must_match_the_geometry_and_regions():
    with pytest.raises(
        LocalProtocolError, match=r"DecodeRegister.kv_buffer_locs has 3 entries; the geometry has 4 KV buffers"
    ):
        decode_register(kv_buffer_locs=[(0, 0)] * 3)
    with pytest.raises(
        LocalProtocolError,
        match=r"DecodeRegister.kv_buffer_locs\[2\] names region 4; only 4 region\(s\) are registered",
    ):
        decode_register(kv_buffer_locs=[(0, 0), (1, 0), (4, 0), (3, 0)])
    with pytest.raises(LocalProtocolError, match=r"DecodeRegister.kv_buffer_locs\[0\] has 1 items; needs at least 2"):
        decode_register(kv_buffer_locs=[(0,), (1, 0), (2, 0), (3, 0)])


def test_geometry_dict_is_parsed_into_kvgeometry():
    m = decode_register(geometry=GEO.to_dict())
    assert m.geometry == GEO and isinstance(m.geometry, KVGeometry)


def test_side_accepts_strings_and_stores_the_enum():
    assert Abort(1, "decode", 0, "x").side is Side.DECODE


def test_timings_are_read_only():
    m = TransferDone(1, 0, 10, 1, b"", {"gather": 1})
    assert m.timings == {"gather": 1.0}
    with pytest.raises(TypeError):
        m.timings["gather"] = 2.0  # type: ignore[index]


def test_a_long_local_reason_is_cut_not_refused():
    m = TransferFailed(1, "prefill", 0, "boom " * 2000)
    assert len(m.reason) <= MAX_REASON_CHARS
    assert m.reason.startswith("boom boom") and "[cut " in m.reason
    assert decode(encode(m)) == m


def test_a_reason_with_a_lone_surrogate_is_escaped_so_it_can_be_sent():
    m = Abort(1, "prefill", 0, "bad path \udcff")
    assert decode(encode(m)).reason == "bad path \\udcff"


# -- local construction: rejections (message names class, field, value) ------------------------
@pytest.mark.parametrize(
    "build, text",
    [
        (lambda: meta(room=-1), "RequestMeta.room=-1 is out of range [0, 18446744073709551615]"),
        (lambda: meta(room=2**64), "RequestMeta.room=18446744073709551616 is out of range"),
        (lambda: meta(room="7"), "RequestMeta.room must be an integer, got str '7'"),
        (lambda: meta(room=True), "RequestMeta.room must be an integer, got bool True"),
        (lambda: meta(tp_rank=2), "RequestMeta.tp_rank=2 must be < tp_size=2"),
        (lambda: meta(tp_size=0), "RequestMeta.tp_size=0 is out of range [1, 1024]"),
        (lambda: meta(elected=1), "RequestMeta.elected must be a bool, got int 1"),
        (lambda: meta(session=""), "RequestMeta.session='' is not 1 or more printable ASCII"),
        (lambda: meta(session="a b"), "RequestMeta.session='a b' is not 1 or more printable ASCII"),
        (lambda: meta(session="x" * 65), "RequestMeta.session is too long: 65 chars (limit 64)"),
        (lambda: meta(aux_slot=-2), "RequestMeta.aux_slot=-2 is out of range [-1, 2147483647]"),
        (lambda: meta(staging_offset=0), "RequestMeta.staging_capacity_bytes=0 does not fit staging_offset=0"),
        (lambda: meta(staging_capacity_bytes=8), "staging_capacity_bytes=8 does not fit staging_offset=-1"),
        (
            lambda: meta(staging_region=b"seg"),
            "RequestMeta.staging_region must be None on the direct path (staging_offset=-1)",
        ),
        (
            lambda: meta(staging_offset=0, staging_capacity_bytes=8),
            "RequestMeta.staging_region must be a region descriptor on the staged path (staging_offset=0)",
        ),
        (lambda: meta(dst_page_ids=[1, -2]), "RequestMeta.dst_page_ids[1]=-2 is out of range [0, 2147483647]"),
        (lambda: meta(dst_page_ids=[2**31]), "RequestMeta.dst_page_ids[0]=2147483648 is out of range"),
        (lambda: meta(dst_page_ids=np.array([0, 2**31])), "RequestMeta.dst_page_ids[1]=2147483648 is out of range"),
        (lambda: meta(dst_page_ids=[1, True]), "RequestMeta.dst_page_ids[1] must be an integer page id, got bool"),
        (lambda: meta(dst_page_ids=np.zeros(3)), "RequestMeta.dst_page_ids must be integer page ids, got ndarray"),
        (
            lambda: meta(dst_page_ids=np.zeros((2, 2), np.int32)),
            "RequestMeta.dst_page_ids must be 1-D, got shape (2, 2)",
        ),
        (
            lambda: meta(dst_page_ids=b"\x00" * 4),
            "RequestMeta.dst_page_ids must be an integer array or a list of ints, got bytes",
        ),
        (
            lambda: meta(dst_page_ids=np.zeros(MAX_PAGE_IDS + 1, np.int32)),
            f"RequestMeta.dst_page_ids is too long: {MAX_PAGE_IDS + 1} page ids (limit {MAX_PAGE_IDS})",
        ),
        (lambda: decode_register(kv_regions=[]), "DecodeRegister.kv_regions has 0 items; needs at least 1"),
        (lambda: decode_register(kv_regions=[b"a", "b"]), "DecodeRegister.kv_regions[1] must be bytes, got str 'b'"),
        (lambda: decode_register(kv_regions=[b""]), "DecodeRegister.kv_regions[0] has 0 bytes; needs at least 1"),
        (
            lambda: decode_register(agent_descriptor=b"x" * (4 * 2**20 + 1)),
            "DecodeRegister.agent_descriptor is too long: 4194305 bytes (limit 4194304)",
        ),
        (
            lambda: decode_register(endpoint="10.0.0.1:5000"),
            "DecodeRegister.endpoint='10.0.0.1:5000' is not a ZMQ endpoint",
        ),
        (lambda: decode_register(transport="TCP"), "DecodeRegister.transport='TCP' is not a transport name"),
        (
            lambda: decode_register(geometry={**GEO.to_dict(), "dtype": "int3"}),
            "DecodeRegister.geometry is invalid: dtype='int3' is not supported",
        ),
        (lambda: decode_register(geometry="bf16"), "DecodeRegister.geometry must be a KVGeometry or its dict, got str"),
        (lambda: decode_register(session="é"), "DecodeRegister.session='é' is not 1 or more printable ASCII"),
        (lambda: TransferFailed(1, "middle", 0, "x"), "TransferFailed.side='middle' must be 'prefill' or 'decode'"),
        (lambda: TransferFailed(1, "decode", 0, "  "), "TransferFailed.reason='  ' is not a non-empty reason"),
        (
            lambda: TransferDone(1, 0, 1, 1, b"x" * (2**20 + 1), {}),
            "TransferDone.aux_payload is too long: 1048577 bytes (limit 1048576)",
        ),
        (
            lambda: TransferDone(1, 0, 1, 1, b"", {"t": -1.0}),
            "TransferDone.timings['t']=-1.0 must be a finite number >= 0.0",
        ),
        (
            lambda: TransferDone(1, 0, 1, 1, b"", {"t": float("nan")}),
            "TransferDone.timings['t']=nan must be a finite number",
        ),
        (
            lambda: TransferDone(1, 0, 1, 1, b"", {f"p{i}": 0 for i in range(33)}),
            "TransferDone.timings is too long: 33 entries (limit 32)",
        ),
        (
            lambda: TransferDone(1, 0, 1, 1, b"", [("t", 1.0)]),
            "TransferDone.timings must be a dict of str -> seconds, got list",
        ),
        (lambda: ChunkReady(1, 0, 0, 0, 0, 8), "ChunkReady.num_tokens=0 is out of range [1, 9223372036854775807]"),
        (lambda: Heartbeat("s", "prefill", 0, 1, float("inf")), "Heartbeat.sent_at=inf must be a finite number"),
        (lambda: Heartbeat("s", "prefill", 0, 1, 10**400), "Heartbeat.sent_at=1000000"),
        (lambda: RegisterReply("p", 0, True, "mismatch", GEO), "RegisterReply.error must be empty when ok=True"),
        (lambda: RegisterReply("p", 0, False, "", GEO), "RegisterReply.error must say why when ok=False"),
        (
            lambda: BootstrapReply(True, 2, GEO, "tcp", [PrefillRankInfo(0, "tcp://a:1", "s")], ""),
            "BootstrapReply.ranks must list tp_rank 0..1 once each, got [0]",
        ),
        (
            lambda: BootstrapReply(True, 1, None, "tcp", [PrefillRankInfo(0, "tcp://a:1", "s")], ""),
            "BootstrapReply.ready is True but tp_size, geometry or transport is missing",
        ),
        (
            lambda: BootstrapReply(False, 2, None, "", [PrefillRankInfo(1, "tcp://a:1", "s")] * 2, "wait"),
            "BootstrapReply.ranks lists a tp_rank twice: [1, 1]",
        ),
        (
            lambda: BootstrapReply(False, 0, None, "", [(0, "tcp://a:1", "s")], "wait"),
            "BootstrapReply.ranks[0] must be a PrefillRankInfo, got tuple",
        ),
    ],
)
def test_local_construction_rejects_with_a_named_field(build, text):
    with pytest.raises(LocalProtocolError) as info:
        build()
    assert text in str(info.value)


def test_a_last_chunk_larger_than_the_writers_bytes_is_a_local_error():
    with pytest.raises(LocalProtocolError, match=r"TransferDone.last_chunk has 64 bytes, more than total_bytes=10"):
        TransferDone(1, 0, 10, 1, b"", {}, StagedChunk(0, 4, 0, 64))
    with pytest.raises(LocalProtocolError, match=r"StagedChunk.num_tokens=0 is out of range"):
        StagedChunk(0, 0, 0, 64)
    with pytest.raises(LocalProtocolError, match=r"TransferDone.last_chunk must be a StagedChunk, got dict"):
        TransferDone(1, 0, 10, 1, b"", {}, {"token_start": 0})  # type: ignore[arg-type]
