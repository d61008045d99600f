"""The authenticated envelope: tags, destinations, replay guards, data-plane secrets."""

from __future__ import annotations

import pytest

from sglang_kvxfer.errors import AuthenticationError, LocalProtocolError
from sglang_kvxfer.protocol import envelope

KEY = bytes(range(32))
OTHER = bytes(32)


def test_a_sealed_frame_opens_with_the_same_key_and_destination():
    frame = envelope.seal(KEY, "sess-a", 7, b"payload", "tcp://127.0.0.1:5")
    sender, seq, payload = envelope.open_frame(KEY, frame, "tcp://127.0.0.1:5")
    assert (sender, seq, bytes(payload)) == ("sess-a", 7, b"payload")
    assert len(frame) == envelope.OVERHEAD_BYTES + len("sess-a") + len(b"payload")


@pytest.mark.parametrize("change", ["key", "destination", "payload", "sender", "seq", "tag"])
def test_any_change_fails_authentication(change):
    frame = bytearray(envelope.seal(KEY, "sess-a", 7, b"payload", "tcp://h:1"))
    key, dest = KEY, "tcp://h:1"
    if change == "key":
        key = OTHER
    elif change == "destination":
        dest = "tcp://h:2"
    elif change == "payload":
        frame[-1] ^= 1
    elif change == "sender":
        frame[envelope.OVERHEAD_BYTES] ^= 1
    elif change == "seq":
        frame[36] ^= 1
    else:
        frame[4] ^= 1
    with pytest.raises(AuthenticationError, match="tag does not verify"):
        envelope.open_frame(key, bytes(frame), dest)


@pytest.mark.parametrize("data", [b"", b"KXA1", b"\x93\x01\xa9Heartbeat\x80", b"KXA1" + bytes(40)])
def test_non_envelopes_are_refused_before_any_decoding(data):
    with pytest.raises(AuthenticationError):
        envelope.open_frame(KEY, data)


def test_with_authentication_off_the_tag_is_not_checked_but_the_sender_is_carried():
    frame = envelope.seal(b"", "sess-b", 1, b"x")
    assert envelope.open_frame(b"", frame)[0] == "sess-b"
    with pytest.raises(AuthenticationError):  # a keyed receiver refuses an unkeyed frame
        envelope.open_frame(KEY, frame)


def test_bad_local_arguments_are_local_errors():
    with pytest.raises(LocalProtocolError, match="sender"):
        envelope.seal(KEY, "", 1, b"")
    with pytest.raises(LocalProtocolError, match="seq"):
        envelope.seal(KEY, "s", 1 << 64, b"")


def test_sequence_guard_accepts_each_sender_stream_strictly_increasing():
    guard = envelope.SequenceGuard(capacity=2)
    assert guard.accept("a", 1) and guard.accept("a", 2) and guard.accept("b", 1)
    assert not guard.accept("a", 2) and not guard.accept("a", 1)
    assert guard.accept("c", 1)  # evicts "a", the least recently seen
    assert guard.accept("b", 2)


def test_freshness_guard_refuses_replays_and_stale_or_future_stamps():
    guard = envelope.FreshnessGuard(window_s=10, capacity=3)
    now = 1_800_000_000.0
    seq = envelope.fresh_seq(now)
    assert guard.accept("s", seq, now) == ""
    assert "replay" in guard.accept("s", seq, now + 1)
    assert "clocks out of sync" in guard.accept("s", envelope.fresh_seq(now - 60), now)
    assert "clocks out of sync" in guard.accept("s", envelope.fresh_seq(now + 60), now)
    assert guard.accept("s", envelope.fresh_seq(now), now) == ""
    assert guard.accept("t", envelope.fresh_seq(now), now) == ""
    assert "too many" in guard.accept("u", envelope.fresh_seq(now), now)
    assert guard.accept("u", envelope.fresh_seq(now + 11), now + 11) == ""  # the old ones aged out


def test_peer_secrets_differ_per_pair_direction_and_key():
    a = envelope.peer_secret(KEY, "w", "r")
    assert len(a) == 32
    assert a != envelope.peer_secret(KEY, "r", "w")
    assert a != envelope.peer_secret(OTHER, "w", "r")
    assert a == envelope.peer_secret(KEY, "w", "r")
