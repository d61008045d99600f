"""Strict decoding: every kind of malformed frame is a RemoteProtocolError that says what."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.protocol import (
    MAX_FRAME_BYTES,
    MAX_KV_REGIONS,
    MAX_PAGE_IDS,
    MAX_REASON_CHARS,
    MAX_RECEIPTS,
    PROTOCOL_VERSION,
    Abort,
    BootstrapReply,
    DecodeRegister,
    Heartbeat,
    LocalProtocolError,
    PrefillRankInfo,
    RemoteProtocolError,
    RequestMeta,
    StagedChunk,
    TransferDone,
    decode,
    encode,
)

GEO = KVGeometry(num_layers=2, total_kv_heads=8, head_dim=64)
META = RequestMeta(7, "dec-1", 1, 2, 40, [3, 9, 4], 5, True, -1, 0, None)
REG = DecodeRegister(
    "0.1.0",
    "dec-1",
    2,
    0,
    "tcp://10.0.0.2:5000",
    GEO,
    "tcp",
    b"agent",
    [b"k0", b"k1", b"v0", b"v1"],
    b"aux",
    [(0, 0), (1, 0), (2, 0), (3, 0)],
)
DONE = TransferDone(7, 0, 4096, 3, b"\x01", {"write": 0.5})
ABORT = Abort(7, "decode", 1, "client went away")
BEAT = Heartbeat("pre-1", "prefill", 0, 12, 1234.5)
REPLY = BootstrapReply(
    True, 2, GEO, "tcp", [PrefillRankInfo(0, "tcp://a:1", "s0"), PrefillRankInfo(1, "tcp://a:2", "s1")], ""
)


def envelope(msg):
    """The decoded form of ``encode(msg)``: ``[version, tag, fields]``, ready to tamper with."""
    return msgpack.unpackb(encode(msg), raw=False)


def frame(version, tag, fields):
    return msgpack.packb([version, tag, fields], use_bin_type=True)


def tampered(msg, **changes):
    _, tag, fields = envelope(msg)
    for name, value in changes.items():
        if value is DROP:
            del fields[name]
        else:
            fields[name] = value
    return frame(PROTOCOL_VERSION, tag, fields)


DROP = object()


def rejected(data) -> str:
    with pytest.raises(RemoteProtocolError) as info:
        decode(data)
    return str(info.value)


# -- the frame itself --------------------------------------------------------------------------
def test_not_msgpack():
    assert "frame is not valid msgpack" in rejected(b"\xc1")  # 0xc1 is never used by msgpack


def test_truncated_frame():
    assert "frame is not valid msgpack" in rejected(encode(META)[:-3])


def test_empty_frame():
    assert "frame is not valid msgpack" in rejected(b"")


def test_trailing_bytes():
    assert "frame is not valid msgpack (ExtraData" in rejected(encode(META) + b"\x00")


def test_invalid_utf8_string():
    assert "not valid msgpack (UnicodeDecodeError" in rejected(b"\x93\x01\xa2\xff\xfe\x80")


def test_ext_types_are_refused():
    data = msgpack.packb([PROTOCOL_VERSION, "Abort", msgpack.ExtType(5, b"x")])
    assert "exceeds max_ext_len" in rejected(data)


def test_non_string_map_keys_are_refused():
    assert "not allowed for map key" in rejected(frame(PROTOCOL_VERSION, "Abort", {1: 2}))


def test_duplicate_map_key():
    fields = msgpack.packb("room") + msgpack.packb(1) + msgpack.packb("room") + msgpack.packb(2)
    data = b"\x93" + msgpack.packb(PROTOCOL_VERSION) + msgpack.packb("Abort") + b"\x82" + fields
    assert "malformed frame: a map in the frame has the key 'room' twice" in rejected(data)


def test_frame_over_the_size_limit():
    text = rejected(bytes(MAX_FRAME_BYTES + 1))
    assert f"frame of {MAX_FRAME_BYTES + 1} bytes exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}" in text


def test_a_declared_huge_array_is_refused_before_allocation():
    assert "exceeds max_array_len" in rejected(b"\xdd\xff\xff\xff\xff")


def test_a_bin_larger_than_any_field_allows_is_refused_by_msgpack():
    assert "exceeds max_bin_len" in rejected(tampered(DONE, aux_payload=bytes(16 * 2**20 + 1)))


def test_decode_takes_bytearray_and_memoryview():
    data = encode(META)
    assert decode(bytearray(data)) == META
    assert decode(memoryview(data)) == META


def test_decode_of_a_non_bytes_argument_is_a_local_error():
    with pytest.raises(LocalProtocolError, match="decode\\(\\) takes bytes, got str"):
        decode("hello")  # type: ignore[arg-type]


# -- the envelope --------------------------------------------------------------------------------
def test_envelope_not_an_array():
    assert "frame must be a msgpack array [version, type, fields], got dict" in rejected(msgpack.packb({"room": 1}))


def test_envelope_wrong_length():
    assert "got a list of 2" in rejected(msgpack.packb([PROTOCOL_VERSION, "Abort"]))


def test_unknown_version():
    _, tag, fields = envelope(ABORT)
    text = rejected(frame(PROTOCOL_VERSION + 1, tag, fields))
    assert f"peer speaks protocol version {PROTOCOL_VERSION + 1}, this engine speaks {PROTOCOL_VERSION}" in text


def test_version_of_the_wrong_type():
    _, tag, fields = envelope(ABORT)
    assert "frame version must be an integer, got str '1'" in rejected(frame("1", tag, fields))
    assert "frame version must be an integer, got bool True" in rejected(frame(True, tag, fields))


def test_unknown_type():
    text = rejected(frame(PROTOCOL_VERSION, "Teleport", {}))
    assert "unknown message type 'Teleport' (known: Abort, BootstrapQuery" in text


def test_type_tag_not_a_string():
    assert "frame type must be a str, got int 3" in rejected(frame(PROTOCOL_VERSION, 3, {}))


def test_fields_not_a_map():
    assert "Abort fields must be a msgpack map, got list" in rejected(frame(PROTOCOL_VERSION, "Abort", [1]))


# -- fields ------------------------------------------------------------------------------------------
def test_missing_field():
    assert "invalid RequestMeta from peer: RequestMeta is missing field(s): room" in rejected(tampered(META, room=DROP))


def test_missing_fields_are_all_listed():
    assert "Abort is missing field(s): side, reason" in rejected(tampered(ABORT, side=DROP, reason=DROP))


def test_unknown_field():
    assert "RequestMeta has unknown field(s): 'priority'" in rejected(tampered(META, priority=1))


@pytest.mark.parametrize(
    "msg, field, value, text",
    [
        (META, "room", "7", "RequestMeta.room must be an integer, got str '7'"),
        (META, "room", 7.0, "RequestMeta.room must be an integer, got float 7.0"),
        (META, "room", None, "RequestMeta.room must be an integer, got NoneType None"),
        (META, "elected", 1, "RequestMeta.elected must be a bool, got int 1"),
        (META, "session", b"dec-1", "RequestMeta.session must be a str, got bytes b'dec-1'"),
        (
            META,
            "dst_page_ids",
            [3, 9, 4],
            "RequestMeta.dst_page_ids must be bytes of little-endian int32 page ids, got list",
        ),
        (META, "tp_size", [2], "RequestMeta.tp_size must be an integer, got list [2]"),
        (REG, "geometry", "bf16", "DecodeRegister.geometry must be a KVGeometry or its dict, got str 'bf16'"),
        (REG, "kv_regions", b"k0", "DecodeRegister.kv_regions must be a list, got bytes b'k0'"),
        (REG, "kv_regions", [b"k0", "k1"], "DecodeRegister.kv_regions[1] must be bytes, got str 'k1'"),
        (REG, "aux_region", "none", "DecodeRegister.aux_region must be bytes, got str 'none'"),
        (META, "staging_region", "none", "RequestMeta.staging_region must be bytes, got str 'none'"),
        (DONE, "aux_payload", "x", "TransferDone.aux_payload must be bytes, got str 'x'"),
        (DONE, "timings", [1.0], "TransferDone.timings must be a dict of str -> seconds, got list"),
        (DONE, "timings", {"write": "fast"}, "TransferDone.timings['write'] must be a number, got str 'fast'"),
        (ABORT, "side", "middle", "Abort.side='middle' must be 'prefill' or 'decode'"),
        (ABORT, "side", 1, "Abort.side=1 must be 'prefill' or 'decode'"),
        (ABORT, "reason", 404, "Abort.reason must be a str, got int 404"),
        (BEAT, "sent_at", "now", "Heartbeat.sent_at must be a number, got str 'now'"),
        (REPLY, "ranks", [{"tp_rank": 0}], "BootstrapReply.ranks[0] is missing field(s): endpoint, session"),
        (REPLY, "ranks", [[0, "tcp://a:1", "s0"]], "BootstrapReply.ranks[0] must be a map of fields, got list"),
    ],
)
def test_wrong_type(msg, field, value, text):
    assert text in rejected(tampered(msg, **{field: value}))


def test_wrong_type_inside_a_nested_record_names_the_path():
    ranks = [{"tp_rank": 0, "endpoint": "tcp://a:1", "session": "s0"}, {"tp_rank": 1, "endpoint": 5, "session": "s1"}]
    assert "BootstrapReply.ranks[1].endpoint must be a str, got int 5" in rejected(tampered(REPLY, ranks=ranks))


def test_cross_field_rule_inside_a_nested_record_names_the_path():
    ranks = [
        {"tp_rank": 0, "endpoint": "tcp://a:1", "session": "s0"},
        {"tp_rank": 0, "endpoint": "tcp://a:2", "session": "s1"},
    ]
    assert "BootstrapReply.ranks lists a tp_rank twice: [0, 0]" in rejected(tampered(REPLY, ranks=ranks))


def test_bad_geometry_names_the_geometry_field():
    geometry = {**GEO.to_dict(), "head_dim": 0}
    assert "DecodeRegister.geometry is invalid: head_dim=0 must be >= 1" in rejected(tampered(REG, geometry=geometry))
    geometry = {k: v for k, v in GEO.to_dict().items() if k != "dtype"}
    assert "DecodeRegister.geometry is invalid: KVGeometry is missing field(s): dtype" in rejected(
        tampered(REG, geometry=geometry)
    )
    geometry = {**GEO.to_dict(), "dtype": [[["bf16"]]]}
    assert "DecodeRegister.geometry.dtype must be a scalar, got list" in rejected(tampered(REG, geometry=geometry))


def test_deeply_nested_value_is_rejected_not_a_recursion_error():
    # 1000 nested arrays: str()/repr() of it would raise RecursionError.
    nested = b"\x91" * 1000 + b"\xc0"
    _, tag, fields = envelope(ABORT)
    del fields["reason"]
    body = msgpack.packb(fields)
    data = (
        b"\x93"
        + msgpack.packb(PROTOCOL_VERSION)
        + msgpack.packb(tag)
        + bytes([body[0] + 1])
        + body[1:]
        + msgpack.packb("reason")
        + nested
    )
    assert "Abort.reason must be a str, got list [[[[...]]]]" in rejected(data)


# -- ranges and sizes -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "msg, field, value, text",
    [
        (META, "room", -1, "RequestMeta.room=-1 is out of range [0, 18446744073709551615]"),
        (META, "room", -(2**63), "RequestMeta.room=-9223372036854775808 is out of range"),
        (META, "tp_rank", 2, "RequestMeta.tp_rank=2 must be < tp_size=2"),
        (META, "tp_size", 5000, "RequestMeta.tp_size=5000 is out of range [1, 1024]"),
        (META, "aux_slot", -7, "RequestMeta.aux_slot=-7 is out of range [-1, 2147483647]"),
        (META, "staging_offset", 64, "RequestMeta.staging_capacity_bytes=0 does not fit staging_offset=64"),
        (META, "session", "x" * 65, "RequestMeta.session is too long: 65 chars (limit 64)"),
        (
            ABORT,
            "reason",
            "r" * (MAX_REASON_CHARS + 1),
            f"Abort.reason is too long: {MAX_REASON_CHARS + 1} chars (limit {MAX_REASON_CHARS})",
        ),
        (ABORT, "reason", "", "Abort.reason='' is not a non-empty reason"),
        (
            DONE,
            "aux_payload",
            b"\x00" * (2**20 + 1),
            "TransferDone.aux_payload is too long: 1048577 bytes (limit 1048576)",
        ),
        (DONE, "timings", {f"t{i}": 0.0 for i in range(33)}, "TransferDone.timings is too long: 33 entries (limit 32)"),
        (DONE, "timings", {"write": float("nan")}, "TransferDone.timings['write']=nan must be a finite number"),
        (
            REG,
            "kv_regions",
            [b"r"] * (MAX_KV_REGIONS + 1),
            f"DecodeRegister.kv_regions is too long: {MAX_KV_REGIONS + 1} items (limit {MAX_KV_REGIONS})",
        ),
        (
            REG,
            "kv_regions",
            [b"r" * (16 * 1024 + 1)],
            "DecodeRegister.kv_regions[0] is too long: 16385 bytes (limit 16384)",
        ),
        (REG, "endpoint", "http://x", "DecodeRegister.endpoint='http://x' is not a ZMQ endpoint"),
        (BEAT, "sent_at", float("inf"), "Heartbeat.sent_at=inf must be a finite number"),
        (BEAT, "sent_at", -1.0, "Heartbeat.sent_at=-1.0 must be a finite number >= 0.0"),
        (BEAT, "seq", -5, "Heartbeat.seq=-5 is out of range"),
        (BEAT, "pid", -1, "Heartbeat.pid=-1 is out of range"),
        (BEAT, "host", "h" * 129, "Heartbeat.host is too long: 129 chars (limit 128)"),
    ],
)
def test_out_of_range_or_oversized(msg, field, value, text):
    assert text in rejected(tampered(msg, **{field: value}))


def test_page_id_bytes_not_a_multiple_of_four():
    text = rejected(tampered(META, dst_page_ids=b"\x01\x00\x00\x00\x02\x00\x00"))
    assert "RequestMeta.dst_page_ids has 7 bytes, not a multiple of 4 (int32 page ids)" in text


def test_too_many_page_ids():
    data = tampered(META, dst_page_ids=bytes(4 * (MAX_PAGE_IDS + 1)))
    assert f"RequestMeta.dst_page_ids is too long: {MAX_PAGE_IDS + 1} page ids (limit {MAX_PAGE_IDS})" in rejected(data)


def test_negative_page_id_on_the_wire():
    ids = np.array([4, -1, 6], dtype="<i4").tobytes()
    assert "RequestMeta.dst_page_ids[1]=-1 is out of range [0, 2147483647]" in rejected(
        tampered(META, dst_page_ids=ids)
    )


def test_decoded_page_ids_are_read_only_int32():
    ids = decode(encode(META)).dst_page_ids
    assert ids.dtype == np.int32 and ids.tolist() == [3, 9, 4] and not ids.flags.writeable


# -- encode ------------------------------------------------------------------------------------------------
def test_encode_refuses_a_non_message():
    with pytest.raises(LocalProtocolError, match="encode\\(\\) takes a protocol message, got dict"):
        encode({"room": 1})  # type: ignore[arg-type]


def test_encode_refuses_a_frame_the_peer_would_refuse():
    region = bytes(16 * 1024)
    big = DecodeRegister(
        "0.1.0",
        "d",
        1,
        0,
        "tcp://a:1",
        GEO,
        "tcp",
        b"a",
        [region] * (MAX_FRAME_BYTES // len(region) + 1),
        None,
        [(0, 0)] * 4,
    )
    with pytest.raises(LocalProtocolError, match="DecodeRegister encodes to .* bytes, over MAX_FRAME_BYTES"):
        encode(big)


# -- protocol 3: the last staged chunk rides on TransferDone -------------------------------------
DONE_WITH_CHUNK = TransferDone(7, 1, 8192, 2, b"\x01", {"gather": 0.1}, StagedChunk(48, 16, 4096, 4096))


def test_transfer_done_with_its_last_chunk_round_trips():
    got = decode(encode(DONE_WITH_CHUNK))
    assert got == DONE_WITH_CHUNK and got.last_chunk == StagedChunk(48, 16, 4096, 4096)
    assert decode(encode(DONE)).last_chunk is None


@pytest.mark.parametrize("old", [2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13])
def test_an_older_peer_is_refused_at_its_first_frame_naming_both_versions(old):
    _, tag, fields = envelope(REG)  # a decode rank's first frame to a prefill rank
    text = rejected(frame(old, tag, fields))
    assert PROTOCOL_VERSION == 14
    assert f"peer speaks protocol version {old}, this engine speaks 14" in text


# -- protocol 14: sparse writers (the writer picks the decode pages; TransferDone names them) ----
def test_sparse_metadata_and_the_positions_a_writer_names_round_trip():
    meta = RequestMeta(7, "dec-1", 0, 1, 40, [3, 9, 4], 5, True, -1, 0, None, sparse=True)
    assert decode(encode(meta)).sparse is True
    done = TransferDone(7, 1, 8192, 2, b"", {}, positions=[0, 2, 7])
    got = decode(encode(done))
    assert got.positions.tolist() == [0, 2, 7] and got.positions.dtype == np.int32


def test_sparse_metadata_with_a_staging_window_or_a_token_stride_is_refused_naming_the_field():
    with pytest.raises(LocalProtocolError, match=r"sparse.*needs direct writes of every token.*staging_offset=0"):
        RequestMeta(7, "dec-1", 0, 1, 40, [3], 5, True, 0, 64, b"r", sparse=True)
    with pytest.raises(LocalProtocolError, match=r"sparse.*token_stride=2"):
        RequestMeta(7, "dec-1", 0, 1, 40, [3], 5, True, -1, 0, None, token_stride=2, sparse=True)


def test_positions_that_do_not_increase_are_refused_naming_the_pair():
    with pytest.raises(LocalProtocolError, match=r"positions.*must increase: positions\[1\]=4, positions\[2\]=4"):
        TransferDone(7, 1, 8192, 2, b"", {}, positions=[0, 4, 4])


# -- protocol 8: TransferDone carries the landing receipts of unacknowledged writes --------------
def test_transfer_done_with_receipts_round_trips():
    done = TransferDone(7, 1, 8192, 2, b"", {}, receipts=[(0xFFFF_FFFF_FFFF_FFFF, 1), (5, 2**40)])
    got = decode(encode(done))
    assert got == done and got.receipts == ((0xFFFF_FFFF_FFFF_FFFF, 1), (5, 2**40))
    assert decode(encode(DONE)).receipts == ()


def test_a_version_7_transfer_done_without_receipts_is_refused_naming_the_field():
    _, tag, fields = envelope(DONE)
    del fields["receipts"]
    assert "TransferDone is missing field(s): receipts" in rejected(frame(PROTOCOL_VERSION, tag, fields))


@pytest.mark.parametrize(
    "receipts, text",
    [
        ([[0, 1]], "TransferDone.receipts[0][0]=0 is out of range"),
        ([[1, 0]], "TransferDone.receipts[0][1]=0 is out of range"),
        ([[1, 2, 3]], "TransferDone.receipts[0] is too long: 3 items (limit 2)"),
        ([[1]], "TransferDone.receipts[0] has 1 items; needs at least 2"),
        ([[1, 1]] * (MAX_RECEIPTS + 1), f"TransferDone.receipts is too long: {MAX_RECEIPTS + 1} items"),
        ("x", "TransferDone.receipts must be a list"),
    ],
)
def test_bad_receipts_from_the_wire_are_refused_naming_the_field(receipts, text):
    _, tag, fields = envelope(DONE)
    fields["receipts"] = receipts
    assert text in rejected(frame(PROTOCOL_VERSION, tag, fields))


def test_a_version_2_transfer_done_without_last_chunk_is_refused_naming_the_field():
    _, tag, fields = envelope(DONE)
    del fields["last_chunk"]
    assert "TransferDone is missing field(s): last_chunk" in rejected(frame(PROTOCOL_VERSION, tag, fields))


@pytest.mark.parametrize(
    "chunk, text",
    [
        ("x", "TransferDone.last_chunk must be a map of fields, got str 'x'"),
        (
            {"token_start": 0, "num_tokens": 16},
            "TransferDone.last_chunk is missing field(s): staging_offset, chunk_bytes",
        ),
        (
            {"token_start": 0, "num_tokens": 0, "staging_offset": 0, "chunk_bytes": 64},
            "TransferDone.last_chunk.num_tokens=0 is out of range",
        ),
        (
            {"token_start": 0, "num_tokens": 4, "staging_offset": -1, "chunk_bytes": 64},
            "TransferDone.last_chunk.staging_offset=-1 is out of range",
        ),
        (
            {"token_start": 0, "num_tokens": 4, "staging_offset": 0, "chunk_bytes": 1 << 20},
            "TransferDone.last_chunk has 1048576 bytes, more than total_bytes=8192",
        ),
    ],
)
def test_a_malformed_last_chunk_is_refused_naming_the_field(chunk, text):
    _, tag, fields = envelope(DONE_WITH_CHUNK)
    fields["last_chunk"] = chunk
    assert text in rejected(frame(PROTOCOL_VERSION, tag, fields))
