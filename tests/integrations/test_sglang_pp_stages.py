"""The pieces of ``sglang_pp`` without SGLang: the stages' bootstrap status collected at PP
stage 0 (what SGLang's ``poll_pp_consensus`` asks), over its authenticated channel; the layer
rules (tiling, SGLang's PP-size rule) and the layer-slice view of a pool."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.integrations.sglang_pp import (
    StageStatus,
    layer_slice,
    pp_rule_problem,
    stage_label,
    tiling_problem,
)
from sglang_kvxfer.protocol import envelope

FAILED, BOOTSTRAPPING, WAITING, TRANSFERRING, SUCCESS = range(5)
KEY = b"k" * 32


def _exchange():
    """A PP group of one process: stage 0's value, handed to every later stage."""
    box: dict = {}
    ready = threading.Event()

    def exchange(value):
        if value is not None:
            box["v"] = value
            ready.set()
            return value
        assert ready.wait(5), "stage 0 never published"
        return box["v"]

    return exchange


def _until(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return False


@pytest.fixture
def stages():
    ex = _exchange()
    made = [StageStatus(0, 3, ex, key=KEY, host="127.0.0.1", session="s0")]
    made += [StageStatus(s, 3, ex, key=KEY, host="127.0.0.1", session=f"s{s}") for s in (1, 2)]
    yield made
    for st in made:
        st.close()


def test_stage_0_reports_the_lowest_status_of_every_stage(stages):
    zero, one, two = stages
    room = 0xABC
    assert zero.consensus(room, WAITING) == (BOOTSTRAPPING, [])  # stages 1, 2 have not reported it
    state = {1: BOOTSTRAPPING, 2: WAITING}
    one.watch(room, lambda: state[1])
    two.watch(room, lambda: state[2])
    assert _until(lambda: zero._peers.get(2, {}).get(room) == WAITING)
    assert zero.consensus(room, WAITING) == (BOOTSTRAPPING, [])  # stage 1 still bootstrapping
    state[1] = WAITING  # the decode's request reached stage 1
    assert _until(lambda: zero.consensus(room, WAITING) == (WAITING, []))
    assert zero.consensus(room, BOOTSTRAPPING) == (BOOTSTRAPPING, [])  # stage 0's own status counts too
    # a stage that fails a request fails it at stage 0, named
    other = 0xDEF
    one.watch(other, lambda: FAILED)
    assert _until(lambda: zero.consensus(other, WAITING) == (FAILED, [1]))
    # forgotten rooms are dropped at stage 0 (a later request may reuse the room)
    one.forget(room)
    two.forget(room)
    assert _until(lambda: room not in zero._peers.get(1, {}) and room not in zero._peers.get(2, {}))
    assert zero.consensus(room, WAITING) == (BOOTSTRAPPING, [])


def test_frames_without_the_key_or_replayed_are_dropped(stages):
    zero = stages[0]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(zero.endpoint)
    try:
        from sglang_kvxfer.integrations.sglang_pp import _STATUS

        payload = _STATUS.pack(1, 7, WAITING)
        sock.send(envelope.seal(b"x" * 32, "intruder", 1, payload, zero.endpoint))  # another key
        good = envelope.seal(KEY, "peer", 5, payload, zero.endpoint)
        sock.send(good)
        sock.send(envelope.seal(KEY, "peer", 6, _STATUS.pack(1, 7, FAILED), "tcp://elsewhere:1"))  # another inbox
        sock.send(good)  # a replay of seq 5
        sock.send(envelope.seal(KEY, "peer", 7, _STATUS.pack(9, 7, FAILED), zero.endpoint))  # no stage 9
        assert _until(lambda: zero.dropped == 4)
        assert zero.consensus(7, WAITING) == (BOOTSTRAPPING, [])  # stage 2 never reported room 7
        assert zero._peers[1][7] == WAITING  # only the authenticated, fresh frame counted
    finally:
        sock.close(0)
        ctx.term()


def test_a_later_stage_refuses_a_bad_address_from_stage_0():
    with pytest.raises(Exception, match=r"PP stage 0 handed out 'nonsense' as the address"):
        StageStatus(1, 2, lambda value: "nonsense", key=KEY, host="127.0.0.1", session="s1")


def test_layer_rules():
    assert stage_label(1, range(16, 32)) == "PP stage 1 (layers [16, 32))"
    assert tiling_problem([range(0, 2), range(2, 4)], 4) == ""
    for layers, n in (([range(0, 2), range(3, 4)], 4), ([range(0, 2), range(2, 4)], 5), ([range(1, 4)], 4)):
        assert "do not tile this decode's" in tiling_problem(layers, n)
    assert (
        tiling_problem([range(0, 2), range(2, 3)], 4)
        == "the prefill's 2 PP stages hold layers [0, 2), [2, 3) (3 layers in all), which do not tile this "
        "decode's 4 layers [0, 4): serve the same model with the same layer split (SGLANG_PP_LAYER_PARTITION) "
        "on both servers"
    )
    assert pp_rule_problem(1, 4) == "" and pp_rule_problem(4, 4) == "" and pp_rule_problem(1, 1) == ""
    assert pp_rule_problem(2, 4).startswith("decode pp size (2) must be equal to the prefill pp size (4) or 1")
    assert pp_rule_problem(2, 1).startswith("decode pp size (2) must be equal to the prefill pp size (1) or 1")


def test_layer_slice_views_the_stage_layers_of_k_then_v():
    g = KVGeometry(num_layers=4, total_kv_heads=2, head_dim=8, num_pages=4)
    ptrs = tuple(range(100, 108))  # K0..K3, V0..V3
    lens = tuple(range(200, 208))
    part, p, n = layer_slice(g, ptrs, lens, range(1, 3))
    assert part.num_layers == 2 and part.head_dim == 8 and p == (101, 102, 105, 106) and n == (201, 202, 205, 206)
    mla = KVGeometry(num_layers=4, total_kv_heads=1, head_dim=24, mla=True, num_pages=4)
    assert layer_slice(mla, ptrs[:4], lens[:4], range(2, 4))[1] == (102, 103)
    with pytest.raises(ValueError, match=r"layers \[3, 5\) are not a non-empty part of \[0, 4\)"):
        layer_slice(g, ptrs, lens, range(3, 5))
