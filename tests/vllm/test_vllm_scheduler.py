"""``vllm_scheduler`` without vLLM: the producer's and consumer's bookkeeping against
stand-ins shaped like vLLM 0.32's ``Request``, ``SchedulerOutput``, ``NewRequestData`` and
``CachedRequestData``, and the room checks with their messages.

What vLLM does with the answers (checked against its scheduler's code): a request id in
``finished_sending`` has its blocks freed (and must be a finished request whose
``request_finished`` returned True); a preempted request's blocks are freed by vLLM itself.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Any

import pytest

from sglang_kvxfer.integrations.vllm_meta import ParamKeys, Settings, check_room
from sglang_kvxfer.integrations.vllm_scheduler import SchedulerSide
from tests.ports import free_port

BLOCK = 32


class Status(enum.IntEnum):  # the names vLLM's RequestStatus uses
    WAITING = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict | None
    status: Status = Status.RUNNING


@dataclass
class Blocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (list(self.ids),)


@dataclass
class NewReq:
    req_id: str
    num_computed_tokens: int
    block_ids: tuple[list[int], ...]


@dataclass
class Cached:
    req_ids: list[str] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class BlockState:
    blocks: dict[str, list[int]]

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...] | None:
        return (self.blocks[req_id],) if req_id in self.blocks else None


@dataclass
class Output:
    """A ``SchedulerOutput`` with the fields the connector reads."""

    scheduled_new_reqs: list[NewReq] = field(default_factory=list)
    scheduled_cached_reqs: Cached = field(default_factory=Cached)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_connector_block_state: Any = None


@dataclass
class ConnectorOutput:
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None


def settings(**kw) -> Settings:
    base = dict(produces=True, consumes=True, bootstrap=f"127.0.0.1:{free_port()}", host="127.0.0.1", block_size=BLOCK)
    return Settings(**{**base, **kw})


@pytest.fixture
def side():
    s = SchedulerSide(None, settings())
    yield s
    s.close()


def produce(side: SchedulerSide, req: Request, blocks: list[int]) -> dict:
    """Schedule ``req``'s whole prompt in one step; returns the step's metadata."""
    side.update_state_after_alloc(req, Blocks(blocks), 0)
    out = Output(
        scheduled_new_reqs=[NewReq(req.request_id, 0, (list(blocks),))],
        num_scheduled_tokens={req.request_id: len(req.prompt_token_ids)},
        kv_connector_block_state=BlockState({req.request_id: list(blocks)}),
    )
    return side.build_connector_meta(out)


def test_a_completed_prompt_opens_a_layerwise_send_in_the_same_step(side):
    req = Request("a", list(range(70)), {"do_remote_decode": True})
    meta = produce(side, req, [4, 8, 9, 11])  # 70 tokens: 3 blocks of 32 (a 4th allocated, not sent)
    spec = meta.sends["a"]
    assert (spec.layerwise, spec.block_ids, spec.num_tokens) == (True, (4, 8, 9), 70)
    assert 0 <= spec.room < 2**63
    req.status = Status.FINISHED_LENGTH_CAPPED
    hold, params = side.request_finished(req, ([4, 8, 9, 11],))
    assert hold and params is not None
    assert (params[ParamKeys.ROOM], params[ParamKeys.DO_REMOTE_PREFILL], params[ParamKeys.NUM_TOKENS]) == (
        spec.room,
        True,
        70,
    )
    meta = side.build_connector_meta(Output())
    assert meta.released == {"a"} and not meta.sends and not meta.send_aborts
    assert side.has_pending_work()
    side.update_connector_output(ConnectorOutput(finished_sending={"a"}))
    assert not side.has_pending_work()


def test_a_client_room_is_used_as_given(side):
    req = Request("a", list(range(40)), {"do_remote_decode": True, "room": 12345})
    assert produce(side, req, [1, 2]).sends["a"].room == 12345
    req.status = Status.FINISHED_STOPPED
    assert side.request_finished(req, ([1, 2],))[1][ParamKeys.ROOM] == 12345


def test_a_prompt_that_completes_in_a_later_chunk_opens_the_send_then():
    """Chunked prefill: the send opens with the step that schedules the prompt's last tokens."""
    side = SchedulerSide(None, settings())
    try:
        req = Request("c", list(range(100)), {"do_remote_decode": True})
        side.update_state_after_alloc(req, Blocks([3, 5]), 0)
        first = Output([NewReq("c", 0, ([3, 5],))], num_scheduled_tokens={"c": 64})
        assert not side.build_connector_meta(first).sends
        last = Output(
            scheduled_cached_reqs=Cached(["c"], [64]),
            num_scheduled_tokens={"c": 36},
            kv_connector_block_state=BlockState({"c": [3, 5, 6, 7]}),
        )
        assert side.build_connector_meta(last).sends["c"].block_ids == (3, 5, 6, 7)
        assert not side.build_connector_meta(
            Output(scheduled_cached_reqs=Cached(["c"], [100]), num_scheduled_tokens={"c": 1})
        ).sends
    finally:
        side.close()


@pytest.mark.parametrize("status", [Status.FINISHED_ABORTED, Status.FINISHED_ERROR])
def test_an_abnormal_finish_aborts_the_send_and_frees_blocks_only_after_the_workers_report(side, status):
    req = Request("a", list(range(70)), {"do_remote_decode": True})
    produce(side, req, [4, 8, 9])
    req.status = status
    hold, params = side.request_finished(req, ([4, 8, 9],))
    assert (hold, params) == (True, None)  # vLLM keeps the blocks: the send may be reading them
    meta = side.build_connector_meta(Output())
    assert meta.released == {"a"}
    assert meta.send_aborts == {"a": f"vLLM finished the request ({status.name}) on the producer"}
    for _ in range(3):  # steps pass while the workers' abort is under way: still held
        assert side.has_pending_work()
        side.update_connector_output(ConnectorOutput(finished_sending=set()))
        meta = side.build_connector_meta(Output())
        assert not (meta.sends or meta.released or meta.send_aborts)
    side.update_connector_output(ConnectorOutput(finished_sending={"a"}))
    assert not side.has_pending_work()


def test_an_abort_before_the_prompt_completes_holds_nothing(side):
    req = Request("a", list(range(70)), {"do_remote_decode": True, "room": 9})
    side.update_state_after_alloc(req, Blocks([1, 2, 3]), 0)
    req.status = Status.FINISHED_ABORTED
    assert side.request_finished(req, ([1, 2, 3],)) == (False, None)
    meta = side.build_connector_meta(Output())
    assert not (meta.sends or meta.released or meta.send_aborts) and not side.has_pending_work()
    # its room is free again
    again = Request("b", list(range(10)), {"do_remote_decode": True, "room": 9})
    assert produce(side, again, [7]).sends["b"].room == 9


def test_a_preempted_request_drops_its_send_and_sends_again_with_the_same_room(side):
    req = Request("a", list(range(70)), {"do_remote_decode": True})
    room = produce(side, req, [4, 8, 9]).sends["a"].room
    meta = side.build_connector_meta(Output(preempted_req_ids={"a"}))
    assert "preempted" in meta.dropped["a"] and not meta.released
    again = produce(side, req, [1, 2, 3])  # recomputed into other blocks
    assert (again.sends["a"].room, again.sends["a"].block_ids) == (room, (1, 2, 3))
    req.status = Status.FINISHED_LENGTH_CAPPED
    assert side.request_finished(req, ([1, 2, 3],))[1][ParamKeys.BLOCK_IDS] == [1, 2, 3]


def test_whole_request_sends_when_layerwise_is_off_logged_once(caplog):
    caplog.set_level(logging.INFO, logger="sglang_kvxfer.vllm")
    side = SchedulerSide(None, settings(layerwise=False))
    try:
        assert "whole-request sends after each request finishes: kv_connector_extra_config layerwise=false" in (
            caplog.text
        )
        req = Request("a", list(range(40)), {"do_remote_decode": True})
        assert not produce(side, req, [1, 2]).sends  # nothing during the forward
        req.status = Status.FINISHED_STOPPED
        hold, params = side.request_finished(req, ([1, 2],))
        meta = side.build_connector_meta(Output())
        spec = meta.sends["a"]
        assert hold and (spec.layerwise, spec.room, spec.block_ids) == (False, params[ParamKeys.ROOM], (1, 2))
    finally:
        side.close()


def test_several_kv_cache_groups_fall_back_to_whole_request_sends(caplog):
    side = SchedulerSide(None, settings(), num_kv_cache_groups=2)
    try:
        assert "2 KV cache groups" in side.whole_request_reason and "2 KV cache groups" in caplog.text
        assert not produce(side, Request("a", list(range(40)), {"do_remote_decode": True}), [1, 2]).sends
    finally:
        side.close()


def test_a_prompt_completion_without_block_ids_falls_back_and_says_why_once(side, caplog):
    for name in ("a", "b"):
        req = Request(name, list(range(100)), {"do_remote_decode": True})
        side.update_state_after_alloc(req, Blocks([1, 2]), 0)
        out = Output(scheduled_cached_reqs=Cached([name], [64]), num_scheduled_tokens={name: 36})  # no block state
        assert not side.build_connector_meta(out).sends
        req.status = Status.FINISHED_STOPPED
        assert side.request_finished(req, ([1, 2, 3, 4],))[0]
        assert side.build_connector_meta(Output()).sends[name].layerwise is False
    assert caplog.text.count("is sent whole after it finishes, not layer-wise") == 1
    assert "block ids are not in the scheduler output" in caplog.text


# -- rooms given by the client ---------------------------------------------------------------


@pytest.mark.parametrize(
    "value,shown",
    [
        (-1, "room=-1 (int)"),
        (2**63, f"room={2**63} (int)"),
        ("12", "room='12' (str)"),
        (1.0, "room=1.0 (float)"),
        (True, "room=True (bool)"),
        (None, "room=None (NoneType)"),
    ],
)
def test_a_bad_room_is_refused_naming_the_field_and_the_value(value, shown):
    with pytest.raises(ValueError) as exc:
        check_room(value)
    assert str(exc.value) == f"kv_transfer_params {shown} must be an int with 0 <= room < 2**63"


@pytest.mark.parametrize("room", [0, 2**63 - 1])
def test_rooms_at_the_limits_are_accepted(room):
    assert check_room(room) == room


def test_a_producer_request_with_a_bad_room_moves_nothing_and_answers_why(side, caplog):
    req = Request("a", list(range(40)), {"do_remote_decode": True, "room": -5})
    assert not produce(side, req, [1, 2]).sends
    req.status = Status.FINISHED_LENGTH_CAPPED
    hold, params = side.request_finished(req, ([1, 2],))
    want = "kv_transfer_params room=-5 (int) must be an int with 0 <= room < 2**63"
    assert not hold and params == {
        ParamKeys.DO_REMOTE_PREFILL: False,
        ParamKeys.DO_REMOTE_DECODE: False,
        ParamKeys.ERROR: want,
        ParamKeys.ENGINE: "sglang_kvxfer",
    }
    assert f"kvxfer: request a moves no KV: {want}" in caplog.text
    assert not side.build_connector_meta(Output()).sends and not side.has_pending_work()


def test_a_room_in_use_on_the_producer_is_refused_naming_the_other_request(side):
    produce(side, Request("a", list(range(40)), {"do_remote_decode": True, "room": 77}), [1, 2])
    late = Request("b", list(range(40)), {"do_remote_decode": True, "room": 77})
    assert not produce(side, late, [3, 4]).sends
    late.status = Status.FINISHED_STOPPED
    error = side.request_finished(late, ([3, 4],))[1][ParamKeys.ERROR]
    assert error == (
        "kv_transfer_params room=77 is in use by request a on this producer; pick a new random room per request"
    )


@pytest.mark.parametrize(
    "params,reason",
    [
        ({"room": "x", "bootstrap_addr": "h:1"}, "kv_transfer_params room='x' (str) must be an int"),
        ({"room": -3, "bootstrap_addr": "h:1"}, "kv_transfer_params room=-3 (int) must be an int"),
        ({"bootstrap_addr": "h:1"}, "kv_transfer_params room=None (NoneType) must be an int"),
        ({"room": 5}, "kv_transfer_params bootstrap_addr=None must be 'host:port'"),
    ],
)
def test_a_consumer_request_with_bad_params_fails_its_receive_with_the_message(side, params, reason):
    req = Request("d", list(range(40)), dict(params, do_remote_prefill=True))
    assert side.get_num_new_matched_tokens(req, 0) == (40, True)
    side.update_state_after_alloc(req, Blocks([1, 2]), 40)
    spec = side.build_connector_meta(Output()).recvs["d"]
    assert spec.room == -1 and spec.bootstrap.startswith(f"bad kv_transfer_params: {reason}"), spec
