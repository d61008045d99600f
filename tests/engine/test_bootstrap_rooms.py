"""The bootstrap's DP-rank registry (protocol 9): with ``follows_room=False`` SGLang's prefill
load balancer places requests, so a decode cannot find a request's DP group as
``bootstrap_room % dp_size``. A rank of the group that got a room registers it
(``RoomRoute``), taken only from a registered rank of that group; a decode asks for it
(``RoomQuery``). Every prefill rank registers the same ``follows_room``."""

from __future__ import annotations

import pytest

from sglang_kvxfer.engine import EngineConfig, KVManager, bootstrap
from sglang_kvxfer.engine.bootstrap import BootstrapServer
from sglang_kvxfer.errors import TransferFailedError
from sglang_kvxfer.protocol.messages import BootstrapQuery, PrefillRegister, RoomRoute
from tests.engine.harness import FAST, geometry

GEO = geometry()


def _register(addr: str, dp: int, session: str, follows_room: bool = False, tp: int = 0):
    msg = PrefillRegister(
        engine_version="t",
        session=session,
        tp_size=1,
        tp_rank=tp,
        endpoint="tcp://127.0.0.1:4000",
        geometry=GEO,
        transport="local",
        dp_rank=dp,
        dp_size=2,
        follows_room=follows_room,
    )
    return bootstrap.request(addr, msg, timeout_s=5.0, key=b"")


def _route(addr: str, session: str, room: int, dp: int):
    return bootstrap.request(addr, RoomRoute(session=session, room=room, dp_rank=dp), timeout_s=5.0, key=b"")


def _groups(addr: str, rooms):
    return bootstrap.room_groups(addr, rooms, session="d", timeout_s=5.0, key=b"")


def test_a_group_registers_its_rooms_and_a_decode_finds_them():
    with BootstrapServer("127.0.0.1", 0, key="off") as srv:
        addr = srv.address
        _register(addr, 0, "g0")
        _register(addr, 1, "g1")
        reply = bootstrap.request(addr, BootstrapQuery(session="d", tp_rank=0), timeout_s=5.0, key=b"")
        assert reply.ready and reply.follows_room is False  # a decode learns it must ask
        assert _route(addr, "g1", 10, 1).room_groups == ((10, 1),)
        assert _route(addr, "g0", 11, 0).room_groups == ((11, 0),)
        assert _groups(addr, [10, 11, 12]) == {10: 1, 11: 0}  # 12: not registered (yet)
        assert _groups(f"{addr}#dp1", [10]) == {10: 1}  # a group's address asks the same bootstrap


def test_only_a_registered_rank_of_the_group_can_route_a_room_to_it():
    with BootstrapServer("127.0.0.1", 0, key="off") as srv:
        addr = srv.address
        _register(addr, 0, "g0")
        _register(addr, 1, "g1")
        refused = _route(addr, "g0", 10, 1)  # group 0's rank naming group 1
        assert refused.room_groups == () and not refused.ready
        assert refused.reason == "RoomRoute of room 10: session g0 is no registered prefill rank of DP group 1"
        refused = _route(addr, "stranger", 10, 0)
        assert "session stranger is no registered prefill rank of DP group 0" in refused.reason
        assert _groups(addr, [10]) == {}


def test_ranks_must_agree_on_how_rooms_are_placed():
    with BootstrapServer("127.0.0.1", 0, key="off") as srv:
        addr = srv.address
        _register(addr, 0, "g0", follows_room=False)
        refused = _register(addr, 1, "g1", follows_room=True)
        assert not refused.ready
        assert "registers follows_room=True but rank 0 of DP group 0 registered follows_room=False" in refused.reason


def test_the_oldest_rooms_are_forgotten_past_the_cap(monkeypatch):
    monkeypatch.setattr(bootstrap, "MAX_ROOM_ROUTES", 3)
    with BootstrapServer("127.0.0.1", 0, key="off") as srv:
        addr = srv.address
        _register(addr, 0, "g0")
        for room in range(5):
            _route(addr, "g0", room, 0)
        assert _groups(addr, range(5)) == {2: 0, 3: 0, 4: 0}


def test_a_prefill_manager_routes_its_rooms_and_a_refusal_says_why():
    with BootstrapServer() as boot:
        configs = [
            EngineConfig("prefill", GEO, 1, 0, boot.address, "local", dp_rank=dp, dp_size=2, follows_room=False, **FAST)
            for dp in (0, 1)
        ]
        managers = [KVManager(c) for c in configs]
        try:
            for m in managers:
                m.wait_registered(10)
            managers[1].route_room(77)
            managers[0].route_room(78)
            assert bootstrap.room_groups(boot.address, [77, 78], session="d", timeout_s=5.0) == {77: 1, 78: 0}
            managers[1].close()  # it left: its group has no registered rank to route rooms now
            with pytest.raises(TransferFailedError, match="no registered prefill rank of DP group 1"):
                managers[1].route_room(79)
        finally:
            for m in managers:
                m.close()
