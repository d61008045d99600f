"""The bootstrap's attention-CP ranks (protocol 11): a prefill whose CP ranks each send their
share of a request's pages registers every CP rank under its own cp_rank, keyed by (kv_pool,
dp, pp, cp, tp); a query names the CP rank (``host:port#cpC``, ``#dpN#cpC``) and gets that CP
rank's ranks only; ranks that disagree on cp_size, or CP ranks of one stage that disagree on
their geometry, are refused naming both sides; a closing CP rank takes back only its own
registration."""

from __future__ import annotations

import dataclasses

import pytest

from sglang_kvxfer.engine import bootstrap
from sglang_kvxfer.engine.bootstrap import BootstrapServer
from sglang_kvxfer.engine.config import EngineConfig
from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.protocol.messages import BootstrapQuery, BootstrapReply, PrefillLeave, PrefillRegister

GEO = KVGeometry(num_layers=2, total_kv_heads=4, head_dim=16, num_pages=8)


def _msg(tp: int, cp: int, *, cp_size=2, tp_size=2, dp=0, dp_size=1, geometry=GEO, session=None):
    return PrefillRegister(
        engine_version="t",
        session=session or f"p{dp}.{cp}.{tp}",
        tp_size=tp_size,
        tp_rank=tp,
        endpoint=f"tcp://127.0.0.1:{5000 + 100 * dp + 10 * cp + tp}",
        geometry=geometry,
        transport="local",
        dp_rank=dp,
        dp_size=dp_size,
        cp_rank=cp,
        cp_size=cp_size,
    )


def _register(addr: str, *args, **kwargs) -> BootstrapReply:
    return bootstrap.request(addr, _msg(*args, **kwargs), timeout_s=5.0, key=b"")


def _query(address: str) -> BootstrapReply:
    return bootstrap.request(address, BootstrapQuery(session="d", tp_rank=0), timeout_s=5.0, key=b"")


def test_each_cp_rank_is_a_group_of_its_own():
    with BootstrapServer("127.0.0.1", 0, key="off") as srv:
        addr = srv.address
        for tp in range(2):
            _register(addr, tp, 0)
        zero = _query(addr)
        assert zero.ready and (zero.cp_rank, zero.cp_size) == (0, 2)
        assert [r.session for r in zero.ranks] == ["p0.0.0", "p0.0.1"]
        one = _query(bootstrap.group_address(addr, 0, 0, 1))
        assert not one.ready and one.cp_rank == 1
        assert one.reason == "0 of ? prefill rank(s) registered in CP rank 1 of DP group 0"
        _register(addr, 0, 1)
        one = _query(bootstrap.group_address(addr, 0, 0, 1))
        assert one.reason == "1 of 2 prefill rank(s) registered in CP rank 1 of DP group 0"
        _register(addr, 1, 1)
        one = _query(bootstrap.group_address(addr, 0, 0, 1))
        assert one.ready and [r.session for r in one.ranks] == ["p0.1.0", "p0.1.1"]
        assert srv.registered(cp_rank=1) == {0: "p0.1.0", 1: "p0.1.1"}
        # a CP rank past the registered size is named as such
        two = _query(bootstrap.group_address(addr, 0, 0, 2))
        assert not two.ready and "cp_rank=2: the prefill behind this bootstrap registered cp_size=2" in two.reason


def test_cp_ranks_that_disagree_are_refused_naming_both():
    with BootstrapServer("127.0.0.1", 0, key="off") as srv:
        addr = srv.address
        _register(addr, 0, 0)
        reply = _register(addr, 1, 1, cp_size=3)
        assert not reply.ready
        assert reply.reason == (
            "prefill rank 1 of DP group 0 CP rank 1 registers cp_size=3 but rank 0 of DP group 0 CP rank 0 "
            "registered cp_size=2"
        )
        other = dataclasses.replace(GEO, head_dim=32)
        reply = _register(addr, 0, 1, geometry=other)
        assert "registers geometry=" in reply.reason and "rank 0 of DP group 0 CP rank 0 registered geometry=" in (
            reply.reason
        )
        assert srv.registered(cp_rank=1) == {}
        # the refusal is told to a decode asking about that CP rank
        assert (
            "refused: prefill rank 0 of DP group 0 CP rank 1 registers geometry="
            in _query(bootstrap.group_address(addr, 0, 0, 1)).reason
        )


def test_a_leaving_cp_rank_takes_back_its_own_registration_only():
    with BootstrapServer("127.0.0.1", 0, key="off") as srv:
        addr = srv.address
        for cp in range(2):
            _register(addr, 0, cp, tp_size=1)
        leave = PrefillLeave(session="p0.1.0", tp_rank=0, cp_rank=1)
        bootstrap.request(addr, leave, timeout_s=5.0, key=b"")
        assert srv.registered(cp_rank=1) == {} and srv.registered() == {0: "p0.0.0"}
        # another session's leave of CP rank 0 (a restart's entry stays)
        bootstrap.request(addr, PrefillLeave(session="p0.1.0", tp_rank=0, cp_rank=0), timeout_s=5.0, key=b"")
        assert srv.registered() == {0: "p0.0.0"}


def test_cp_addresses_round_trip_and_reject_garbage():
    assert bootstrap.group_address("10.0.0.1:8998", 0, 0, 1) == "10.0.0.1:8998#cp1"
    assert bootstrap.group_address("10.0.0.1:8998", 2, 0, 3) == "10.0.0.1:8998#dp2#cp3"
    assert bootstrap.split_address("10.0.0.1:8998#dp2#cp3") == ("10.0.0.1:8998", 2, 0, 3)
    assert bootstrap.split_address("10.0.0.1:8998#dp2") == ("10.0.0.1:8998", 2, 0, 0)
    for bad in ("10.0.0.1:8998#cp", "10.0.0.1:8998#cp0", "10.0.0.1:8998#dp1#cpx"):
        with pytest.raises(ValueError, match="the CP rank after '#cp' must be an int >= 1"):
            bootstrap.split_address(bad)
    with pytest.raises(ValueError, match="names CP rank 3; this call takes a PP stage's address"):
        bootstrap.split_stage_address("10.0.0.1:8998#cp3")
    with pytest.raises(ValueError, match="cp_rank=-1 must be an int >= 0"):
        bootstrap.group_address("10.0.0.1:8998", 0, 0, -1)
    with pytest.raises(ValueError, match="BootstrapQuery.cp_rank=2 but the address '127.0.0.1:9#cp1' names CP rank 1"):
        bootstrap.request("127.0.0.1:9#cp1", BootstrapQuery(session="d", tp_rank=0, cp_rank=2), timeout_s=0.1, key=b"")


def test_cp_fields_are_checked():
    geo = GEO
    with pytest.raises(ValueError, match="cp_rank=2 must be < cp_size=2"):
        EngineConfig("prefill", geo, 1, 0, "127.0.0.1:1", cp_rank=2, cp_size=2)
    with pytest.raises(ValueError, match="cp_size=0 must be an integer >= 1"):
        EngineConfig("prefill", geo, 1, 0, "127.0.0.1:1", cp_size=0)
    with pytest.raises(Exception, match="cp_rank"):
        _msg(0, 2, cp_size=2)


def test_pools_of_every_head_are_told_to_the_decode_and_must_agree():
    """Protocol 12 (CP-TP group sharing): ranks whose pools hold every KV head register
    ``all_heads``; the reply carries it, so a decode addresses heads in those pools; a rank of
    the same pool that says otherwise is refused naming both; a state pool of the same ranks
    (their TP share) registers without it."""
    with BootstrapServer("127.0.0.1", 0, key="off") as srv:
        addr = srv.address
        bootstrap.request(addr, dataclasses.replace(_msg(0, 0, cp_size=1), all_heads=True), timeout_s=5.0, key=b"")
        reply = bootstrap.request(addr, _msg(1, 0, cp_size=1), timeout_s=5.0, key=b"")
        assert not reply.ready
        assert reply.reason == (
            "prefill rank 1 of DP group 0 registers all_heads=False but rank 0 of DP group 0 registered all_heads=True"
        )
        state = dataclasses.replace(_msg(1, 0, cp_size=1), kv_pool="state:mamba.0", session="p0.0.0")
        assert "all_heads" not in bootstrap.request(addr, state, timeout_s=5.0, key=b"").reason  # another pool
        bootstrap.request(addr, dataclasses.replace(_msg(1, 0, cp_size=1), all_heads=True), timeout_s=5.0, key=b"")
        got = _query(addr)
        assert got.ready and got.all_heads and got.tp_size == 2
        assert srv.registered() == {0: "p0.0.0", 1: "p0.0.1"}


def test_a_pool_of_every_head_is_a_prefills_only():
    """EngineConfig: ``all_heads`` is a bool, and only a prefill rank's pool holds every head
    while it sends its TP rank's (a decode rank always holds its own heads)."""
    assert EngineConfig("prefill", GEO, 2, 1, "127.0.0.1:1", all_heads=True).placement.num_local_heads == 4
    with pytest.raises(
        ValueError, match=r"all_heads=True must be a bool, and True only on a prefill \(role='decode'\)"
    ):
        EngineConfig("decode", GEO, 2, 1, "127.0.0.1:1", all_heads=True)
    with pytest.raises(ValueError, match=r"all_heads=1 must be a bool"):
        EngineConfig("prefill", GEO, 2, 1, "127.0.0.1:1", all_heads=1)


def test_sharded_cp_ranks_are_told_to_the_decode_and_must_agree():
    """Protocol 14 (SGLang's KV cache sharding): CP ranks that hold a request's pages
    interleaved register ``kv_sharded``; the reply carries it, so a decode asks each for
    sparse writes; a CP rank that says otherwise is refused naming both; it needs CP ranks."""
    with BootstrapServer("127.0.0.1", 0, key="off") as srv:
        addr = srv.address
        bootstrap.request(addr, dataclasses.replace(_msg(0, 0), kv_sharded=True), timeout_s=5.0, key=b"")
        reply = _register(addr, 0, 1)
        assert not reply.ready and "kv_sharded=False" in reply.reason and "kv_sharded=True" in reply.reason
        for tp, cp in ((1, 0), (0, 1), (1, 1)):
            bootstrap.request(addr, dataclasses.replace(_msg(tp, cp), kv_sharded=True), timeout_s=5.0, key=b"")
        asked = BootstrapQuery(session="d", tp_rank=0, cp_rank=1)
        got = bootstrap.request(addr, asked, timeout_s=5.0, key=b"")
        assert got.ready and got.kv_sharded and (got.cp_rank, got.cp_size) == (1, 2)
    with pytest.raises(Exception, match=r"kv_sharded.*needs the pages sharded over cp_size >= 2 CP ranks, got 1"):
        dataclasses.replace(_msg(0, 0, cp_size=1), kv_sharded=True)
    with pytest.raises(ValueError, match=r"kv_sharded=True must be a bool, and True only on a prefill"):
        EngineConfig("decode", GEO, 2, 1, "127.0.0.1:1", kv_sharded=True)
    with pytest.raises(ValueError, match=r"kv_sharded=True needs the pages sharded over cp_size >= 2 CP ranks, got 1"):
        EngineConfig("prefill", GEO, 2, 1, "127.0.0.1:1", kv_sharded=True)
