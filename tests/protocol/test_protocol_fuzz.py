"""Fuzz: whatever bytes arrive, decode returns a valid message or raises RemoteProtocolError.

Any other exception escaping decode would crash a server's I/O thread; these tests fail on it.
"""

from __future__ import annotations

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_kvxfer.protocol import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Message,
    RemoteProtocolError,
    decode,
    encode,
)
from tests.protocol.protocol_strategies import (
    MESSAGE_STRATEGIES,
    any_message,
    msgpack_objects,
)

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def decode_or_reject(data: bytes):
    """Decode ``data``; a RemoteProtocolError is fine, any other exception fails the test."""
    try:
        msg = decode(data)
    except RemoteProtocolError as exc:
        assert str(exc), "a rejection must say why"
        return None
    assert isinstance(msg, Message)
    assert decode(encode(msg)) == msg  # whatever was accepted is a valid, re-encodable message
    return msg


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes(data):
    decode_or_reject(data)


@FUZZ
@given(msgpack_objects)
def test_random_msgpack_objects(obj):
    decode_or_reject(msgpack.packb(obj, use_bin_type=True))


@FUZZ
@given(st.sampled_from(sorted(MESSAGE_TYPES)), st.dictionaries(st.text(max_size=12), msgpack_objects, max_size=12))
def test_random_fields_under_a_valid_envelope(tag, fields):
    decode_or_reject(msgpack.packb([PROTOCOL_VERSION, tag, fields], use_bin_type=True))


@st.composite
def one_field_replaced(draw):
    """A valid message's wire map with one field swapped for an arbitrary msgpack value."""
    msg = draw(any_message)
    fields = msg.to_wire()
    name = draw(st.sampled_from(sorted(fields)))
    fields[name] = draw(msgpack_objects)
    return type(msg).__name__, fields


@FUZZ
@given(one_field_replaced())
def test_one_field_replaced_by_anything(case):
    tag, fields = case
    decode_or_reject(msgpack.packb([PROTOCOL_VERSION, tag, fields], use_bin_type=True))


@st.composite
def mutated_frames(draw):
    """A valid frame with a few bytes overwritten, inserted or cut."""
    data = bytearray(encode(draw(any_message)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["set", "insert", "cut"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "set" and data:
            data[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        else:
            del data[pos : pos + draw(st.integers(1, 8))]
    return bytes(data)


@FUZZ
@given(mutated_frames())
def test_mutated_valid_frames(data):
    decode_or_reject(data)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(MESSAGE_STRATEGIES)).flatmap(lambda tag: MESSAGE_STRATEGIES[tag]), st.integers(0, 2**32))
def test_every_prefix_of_a_valid_frame_is_rejected(msg, seed):
    data = encode(msg)
    cut = seed % len(data)
    assert decode_or_reject(data[:cut]) is None
