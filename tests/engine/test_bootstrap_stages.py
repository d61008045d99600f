"""The bootstrap's pipeline-parallel stages (protocol 6): each prefill PP stage registers
under its stage with its first layer, keyed by (kv_pool, dp, pp, tp); a query names the stage
(``host:port#ppS``, ``#dpN#ppS``) and gets that stage's ranks and layers only; conflicts
within a stage and across stages are refused naming both sides; the engine config's PP
fields and the messages' PP rules."""

from __future__ import annotations

import dataclasses

import pytest

from sglang_kvxfer.engine import bootstrap
from sglang_kvxfer.engine.bootstrap import BootstrapServer
from sglang_kvxfer.engine.config import EngineConfig
from sglang_kvxfer.errors import LocalProtocolError, RemoteProtocolError
from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.protocol.codec import decode, encode
from sglang_kvxfer.protocol.messages import BootstrapQuery, BootstrapReply, PrefillRegister

STAGE0 = KVGeometry(num_layers=2, total_kv_heads=4, head_dim=16, num_pages=8)  # layers [0, 2)
STAGE1 = dataclasses.replace(STAGE0, num_layers=3, num_pages=12)  # layers [2, 5): its own pages


def _msg(tp: int, pp: int, *, start=None, geometry=None, tp_size=2, pp_size=2, dp=0, dp_size=1, session=None):
    return PrefillRegister(
        engine_version="t",
        session=session or f"p{dp}.{pp}.{tp}",
        tp_size=tp_size,
        tp_rank=tp,
        endpoint=f"tcp://127.0.0.1:{5000 + 100 * dp + 10 * pp + tp}",
        geometry=geometry or (STAGE0 if pp == 0 else STAGE1),
        transport="local",
        dp_rank=dp,
        dp_size=dp_size,
        pp_rank=pp,
        pp_size=pp_size,
        layer_start=(0 if pp == 0 else 2) if start is None else start,
    )


def _register(addr: str, *args, **kwargs) -> BootstrapReply:
    return bootstrap.request(addr, _msg(*args, **kwargs), timeout_s=5.0, key=b"")


def _query(address: str, dp: int = 0, pp: int = 0) -> BootstrapReply:
    q = BootstrapQuery(session="d", tp_rank=0, dp_rank=dp, pp_rank=pp)
    return bootstrap.request(address, q, timeout_s=5.0, key=b"")


def test_each_stage_is_a_group_of_its_own_with_its_layers():
    with BootstrapServer("127.0.0.1", 0, key="off") as srv:
        addr = srv.address
        _register(addr, 0, 0)
        _register(addr, 1, 0)
        zero = _query(addr)
        assert zero.ready and (zero.pp_size, zero.pp_rank, zero.layer_start, zero.pp_stages) == (2, 0, 0, (0,))
        assert zero.geometry == STAGE0 and [r.session for r in zero.ranks] == ["p0.0.0", "p0.0.1"]
        one = _query(bootstrap.group_address(addr, 0, 1))
        assert not one.ready and one.pp_rank == 1
        assert (
            one.reason
            == "PP stage 1 of DP group 0 has no prefill rank registered (registered PP stages: [0] of pp_size=2)"
        )
        _register(addr, 0, 1)
        assert _query(addr, pp=1).reason == "1 of 2 prefill rank(s) registered in PP stage 1 of DP group 0"
        _register(addr, 1, 1)
        one = _query(bootstrap.group_address(addr, 0, 1))
        assert one.ready and (one.layer_start, one.geometry.num_layers, one.pp_stages) == (2, 3, (0, 1))
        assert one.geometry.num_pages == 12  # a stage's pool is sized by its own memory
        assert [r.session for r in one.ranks] == ["p0.1.0", "p0.1.1"]  # the stage's ranks only
        assert srv.registered(pp_rank=1) == {0: "p0.1.0", 1: "p0.1.1"}
        past = _query(addr, pp=2)
        assert (
            past.reason
            == "pp_rank=2: the prefill behind this bootstrap has pp_size=2 (registered PP stages of DP group 0: [0, 1])"
        )
        # a restart of a rank (new session) replaces it
        _register(addr, 1, 1, session="restarted")
        assert srv.registered(pp_rank=1)[1] == "restarted"


def test_stages_of_every_dp_group_are_addressed_by_group_and_stage():
    with BootstrapServer("127.0.0.1", 0, key="off") as srv:
        addr = srv.address
        for dp in (0, 1):
            for pp in (0, 1):
                _register(addr, 0, pp, tp_size=1, dp=dp, dp_size=2)
        reply = _query(bootstrap.group_address(addr, 1, 1))
        assert reply.ready and (reply.dp_rank, reply.pp_rank, reply.layer_start) == (1, 1, 2)
        assert [r.session for r in reply.ranks] == ["p1.1.0"] and reply.dp_groups == (0, 1)


def test_conflicts_within_a_stage_and_across_stages_are_refused_naming_both():
    with BootstrapServer("127.0.0.1", 0, key="off") as srv:
        addr = srv.address
        _register(addr, 0, 0)
        _register(addr, 0, 1)
        cases = [
            # the ranks of one stage hold the same layers and pool
            (
                _msg(1, 0, start=1, session="x"),
                "registers layer_start=1 but rank 0 of DP group 0, PP stage 0, registered layer_start=0",
            ),
            (
                _msg(1, 1, geometry=dataclasses.replace(STAGE1, num_pages=4), session="x"),
                "registers geometry=",
            ),
            # every stage: the same sizes and model
            (
                _msg(1, 1, pp_size=3, session="x"),
                "registers pp_size=3 but rank 0 of DP group 0, PP stage 0, registered pp_size=2",
            ),
            (_msg(1, 1, tp_size=4, session="x"), "registers tp_size=4 but"),
            (
                _msg(1, 1, geometry=dataclasses.replace(STAGE1, head_dim=8), session="x"),
                "prefill rank 1 of DP group 0, PP stage 1, registers geometry.head_dim=8 but rank 0 of DP group 0, "
                "PP stage 0, registered head_dim=16",
            ),
            # stages hold disjoint layer ranges, in stage order
            (
                _msg(1, 1, start=1, geometry=dataclasses.replace(STAGE1, num_layers=4), session="x"),
                "prefill rank 1 of DP group 0, PP stage 1, registers layers [1, 5) but PP stage 0 registered layers "
                "[0, 2) (stages hold disjoint layer ranges in stage order)",
            ),
        ]
        for msg, want in cases:
            reply = bootstrap.request(addr, msg, timeout_s=5.0, key=b"")
            assert not reply.ready and want in reply.reason, (want, reply.reason)
        # a stage 2 of a 3-stage prefill would overlap: shown with a fresh bootstrap
    with BootstrapServer("127.0.0.1", 0, key="off") as srv:
        addr = srv.address
        _register(addr, 0, 0, tp_size=1, pp_size=3)
        _register(addr, 0, 2, tp_size=1, pp_size=3, start=4)
        reply = _register(addr, 0, 1, tp_size=1, pp_size=3, start=2, geometry=dataclasses.replace(STAGE1, num_layers=3))
        assert reply.reason == (
            "prefill rank 0 of DP group 0, PP stage 1, registers layers [2, 5) but PP stage 2 registered layers "
            "[4, 7) (stages hold disjoint layer ranges in stage order)"
        )
        assert srv.registered(pp_rank=1) == {}


def test_stage_addresses_round_trip_and_reject_garbage():
    assert bootstrap.group_address("10.0.0.1:8998", 0, 1) == "10.0.0.1:8998#pp1"
    assert bootstrap.group_address("10.0.0.1:8998", 2, 3) == "10.0.0.1:8998#dp2#pp3"
    assert bootstrap.group_address("10.0.0.1:8998", 2, 0) == "10.0.0.1:8998#dp2"
    assert bootstrap.split_stage_address("10.0.0.1:8998#dp2#pp3") == ("10.0.0.1:8998", 2, 3)
    assert bootstrap.split_stage_address("10.0.0.1:8998#pp3") == ("10.0.0.1:8998", 0, 3)
    assert bootstrap.split_stage_address("10.0.0.1:8998") == ("10.0.0.1:8998", 0, 0)
    for bad in ("10.0.0.1:8998#pp", "10.0.0.1:8998#pp0", "10.0.0.1:8998#ppx", "10.0.0.1:8998#dp1#pp01"):
        with pytest.raises(ValueError, match="the PP stage after '#pp' must be an int >= 1"):
            bootstrap.split_stage_address(bad)
    with pytest.raises(ValueError, match="names PP stage 3; this call takes a DP group's address"):
        bootstrap.split_group_address("10.0.0.1:8998#pp3")
    with pytest.raises(ValueError, match="pp_rank=-1 must be an int >= 0"):
        bootstrap.group_address("10.0.0.1:8998", 0, -1)
    with pytest.raises(ValueError, match="BootstrapQuery.pp_rank=2 but the address '127.0.0.1:9#pp1' names PP stage 1"):
        bootstrap.request("127.0.0.1:9#pp1", BootstrapQuery(session="d", tp_rank=0, pp_rank=2), timeout_s=0.1, key=b"")


def test_pp_fields_travel_and_are_checked():
    msg = _msg(1, 1)
    back = decode(encode(msg))
    assert (back.pp_rank, back.pp_size, back.layer_start) == (1, 2, 2)
    assert decode(encode(BootstrapQuery(session="d", tp_rank=0, pp_rank=3))).pp_rank == 3
    with pytest.raises(LocalProtocolError, match=r"PrefillRegister.pp_rank=2 must be < pp_size=2"):
        _msg(0, 2)
    with pytest.raises(LocalProtocolError, match=r"layer_start=3 must be 0 without pipeline parallelism"):
        _msg(0, 0, pp_size=1, start=3)
    with pytest.raises(LocalProtocolError, match=r"BootstrapReply.pp_stages must list each once, in order"):
        BootstrapReply(False, 0, None, "", (), "x", pp_size=2, pp_stages=(1, 0))
    with pytest.raises(LocalProtocolError, match=r"BootstrapReply.pp_rank=2 must be < pp_size=2 when ready"):
        BootstrapReply(True, 1, STAGE0, "local", (_info(),), "", pp_rank=2, pp_size=2)
    frame = encode(BootstrapQuery(session="d", tp_rank=0, pp_rank=3))
    assert decode(frame).pp_rank == 3
    with pytest.raises(RemoteProtocolError):
        decode(frame[:-3])


def _info():
    from sglang_kvxfer.protocol.messages import PrefillRankInfo

    return PrefillRankInfo(tp_rank=0, endpoint="tcp://127.0.0.1:1", session="s")


def test_engine_config_pp_fields():
    common = dict(role="prefill", geometry=STAGE1, tp_size=1, tp_rank=0, bootstrap="127.0.0.1:1", auth_key="off")
    cfg = EngineConfig(**common, pp_rank=1, pp_size=2, layer_start=2)
    assert (cfg.pp_rank, cfg.pp_size, cfg.layer_start) == (1, 2, 2)
    with pytest.raises(ValueError, match="pp_rank=2 must be < pp_size=2"):
        EngineConfig(**common, pp_rank=2, pp_size=2)
    with pytest.raises(ValueError, match="layer_start=-1 must be an integer >= 0"):
        EngineConfig(**common, pp_size=2, layer_start=-1)
    with pytest.raises(ValueError, match=r"layer_start=2 must be 0 without pipeline parallelism \(pp_size=1\)"):
        EngineConfig(**common, layer_start=2)


def test_only_the_last_stage_announces_a_draft_pool_and_its_ranks_must_agree():
    """SGLang runs the draft model on the last PP stage: that stage's ranks announce the draft
    pool and register it (kv_pool="draft", the draft's own layers) there; stage 0 announces
    none. Ranks of one stage that disagree about it are still refused naming both values."""
    draft = KVGeometry(num_layers=1, total_kv_heads=2, head_dim=8, num_pages=12)
    with BootstrapServer("127.0.0.1", 0, key="off") as srv:
        addr = srv.address
        for tp in (0, 1):
            _register(addr, tp, 0)
        last = dataclasses.replace(_msg(0, 1), draft_geometry=draft)
        assert "registers" not in bootstrap.request(addr, last, timeout_s=5.0, key=b"").reason  # accepted
        other = dataclasses.replace(_msg(1, 1), draft_geometry=None)
        refused = bootstrap.request(addr, other, timeout_s=5.0, key=b"")
        assert "registers draft_geometry=None but rank 0 of DP group 0, PP stage 1, registered draft_geometry=" in (
            refused.reason
        ), refused.reason
        bootstrap.request(addr, dataclasses.replace(other, draft_geometry=draft), timeout_s=5.0, key=b"")
        for tp in (0, 1):  # the draft pool itself, at the last stage, layers from 0
            pool = dataclasses.replace(_msg(tp, 1, start=0, geometry=draft), kv_pool="draft")
            assert "registers" not in bootstrap.request(addr, pool, timeout_s=5.0, key=b"").reason
        assert _query(addr).draft_geometry is None and _query(addr).ready
        one = _query(addr, pp=1)
        assert one.ready and one.draft_geometry == draft
        q = BootstrapQuery(session="d", tp_rank=0, dp_rank=0, pp_rank=1, kv_pool="draft")
        got = bootstrap.request(addr, q, timeout_s=5.0, key=b"")
        assert got.ready and got.geometry == draft and got.layer_start == 0
