"""Attention DP through kvxfer, driven by the scripted scheduler (``sglang_dp_sides``): several
prefill DP groups behind one bootstrap, each its own attention-TP group with its own pools;
a decode rank routes every request to the group SGLang's rule names and receives exactly
that group's bytes (every byte of every decode buffer against the DP oracle), for MHA and
MLA, with prefill and decode DP / attention-TP sizes that differ. A route to another group
never takes that group's bytes, and a wrong route fails naming the group."""

from __future__ import annotations

import pytest

from sglang_kvxfer.engine import BootstrapServer, bootstrap
from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.protocol.messages import BootstrapQuery, PrefillRegister
from tests.integrations import sglang_dp_sides as dps
from tests.integrations import sglang_sides as sides
from tests.integrations.sglang_env import Model, import_sglang_base
from tests.ports import free_port

_base, _reason = import_sglang_base()
needs_sglang = pytest.mark.skipif(_base is None, reason=_reason)

R = dps.DpRequest
# Rooms of both parities (bootstrap_room % 2 picks the prefill group), partial last pages,
# several chunks.
ROOMS = [R(0x5EED_0000_F00D, 37), R(0x5EED_0001_F00D, 9), R(0x7A11_0002_CAFE, 20), R(0x7A11_0003_CAFE, 41)]


def run_dp(
    prefill: tuple,
    decode: tuple,
    model: Model,
    requests,
    env=None,
    timeout_s: float = 60.0,
    system=(False, False),
    load_balance: str = "auto",
):
    """``prefill``/``decode``: ``(attn_tp, dp)``; ``system``: which side's DP groups are
    DP replicas (``--dp-size`` without ``--enable-dp-attention``); ``load_balance``: the
    prefill's ``--load-balance-method``. Returns both sides' reports."""
    port = free_port()
    env = {**sides.ENV, "KVXFER_SGLANG_TRANSPORT": "local", **(env or {})}
    specs = [
        dps.DpSpec(role, model, tp, dp, port, requests, env, timeout_s, system=replicas, load_balance=load_balance)
        for role, (tp, dp), replicas in zip(("prefill", "decode"), (prefill, decode), system)
    ]
    return sides.run_in_processes(dps.main, specs, timeout_s)


def _every_room_lands_from_its_route(prefill, decode, model, **kw) -> None:
    """Run every room of ``ROOMS`` and check each landed, byte-exact, from the DP group
    ``bootstrap_room % dp_size`` names (``kw``: ``run_dp``'s)."""
    requests = [R(q.room, q.tokens, decode_group=i % decode[1]) for i, q in enumerate(ROOMS)]
    pre, dec = run_dp(prefill, decode, model, requests, **kw)
    assert dec["info"] == {"attn_tp_size": prefill[0], "dp_size": prefill[1]}
    for q in requests:
        assert dec[q.room]["status"] == "Success", dec[q.room]
        assert dec[q.room]["route"] == q.room % prefill[1]
        assert dec[q.room]["problems"] == [], dec[q.room]["problems"]
        assert pre[(q.room, q.room % prefill[1])]["status"] == "Success", pre
    assert dec["pool_problems"] == [], dec["pool_problems"]


@needs_sglang
@pytest.mark.slow
@pytest.mark.parametrize(
    "prefill, decode, mla",
    [
        ((1, 2), (1, 1), False),  # prefill DP 2 x attn TP 1 -> decode TP 1
        ((1, 2), (1, 2), False),  # prefill DP 2 -> decode DP 2 (each decode group its own requests)
        ((2, 2), (1, 1), False),  # prefill attn TP 2 x DP 2 -> decode TP 1: two writers per group
        ((1, 2), (1, 1), True),  # MLA (DeepSeek): the latent of the routed group
        ((2, 2), (2, 1), True),  # MLA, attn TP 2 x DP 2 -> decode TP 2
    ],
    ids=["dp2-to-tp1", "dp2-to-dp2", "tp2xdp2-to-tp1", "mla-dp2-to-tp1", "mla-tp2xdp2-to-tp2"],
)
def test_each_request_lands_from_its_prefill_dp_group(prefill, decode, mla):
    model = Model(mla=True, head_dim=24, pool_tokens=192) if mla else Model(total_kv_heads=4, pool_tokens=192)
    _every_room_lands_from_its_route(prefill, decode, model)


@needs_sglang
@pytest.mark.slow
@pytest.mark.parametrize(
    "prefill, decode, system, mla",
    [
        ((1, 2), (1, 1), (True, False), False),  # prefill --tp 1 --dp-size 2 -> decode TP 1
        ((2, 2), (1, 2), (True, True), False),  # prefill 2 replicas of TP 2 -> decode 2 replicas of TP 1
        ((2, 2), (1, 2), (True, False), False),  # DP replicas -> attention DP on the decode
        ((2, 2), (2, 1), (True, False), True),  # MLA: replicas of TP 2 -> decode TP 2
    ],
    ids=["rep2-to-tp1", "rep2xtp2-to-rep2", "rep2xtp2-to-attndp2", "mla-rep2xtp2-to-tp2"],
)
def test_dp_replicas_serve_each_request_from_the_replica_its_room_names(prefill, decode, system, mla):
    """DP replicas (--dp-size without --enable-dp-attention; SGLang's system DP): every replica
    a whole TP group whose ranks count from 0 (engine_rank = tp_rank, system_dp_rank = the
    replica), all behind one bootstrap as DP groups. Each request lands from the replica
    bootstrap_room % dp_size names, every decode byte against that replica's oracle (the
    replicas' KV differ in every row, so a byte from the other one shows)."""
    model = Model(mla=True, head_dim=24, pool_tokens=192) if mla else Model(total_kv_heads=4, pool_tokens=192)
    _every_room_lands_from_its_route(prefill, decode, model, system=system)


@needs_sglang
@pytest.mark.slow
def test_routes_never_take_another_groups_bytes_and_wrong_routes_fail_by_name():
    """One deployment, prefill DP 2 -> decode TP 1:

    * a room prefilled on both groups (router-chosen ranks) and routed to group 1 holds group
      1's bytes, every one of them (the oracles of the two groups differ in every row);
    * the router's rank overrides bootstrap_room % 2 on both sides;
    * a room prefilled on group 1 but routed to group 0 fails at the deadline, naming group 0;
    * a rank past dp_size fails at init() naming the value, dp_size and the groups;
    * a prefill group given a room that follow_bootstrap_room sends elsewhere fails naming both.
    """
    model = Model(total_kv_heads=4)
    both = R(0x1111_0000_0002, 29, prefill_groups=(0, 1), explicit=True, route=1)
    override = R(0x2222_0000_0004, 13, prefill_groups=(1,), explicit=True, route=1)  # room % 2 == 0
    wrong = R(0x3333_0000_0006, 11, prefill_groups=(1,), explicit=True, route=0)
    past = R(0x4444_0000_0008, 7, prefill_groups=(), route=5)
    misrouted = R(0x5555_0000_0001, 7, prefill_groups=(0,))  # room % 2 == 1, no router rank
    env = {"KVXFER_WAITING_TIMEOUT_S": "4", "KVXFER_TRANSFER_TIMEOUT_S": "4", "KVXFER_BOOTSTRAP_TIMEOUT_S": "8"}
    pre, dec = run_dp((1, 2), (1, 1), model, [both, override, wrong, past, misrouted], env=env)
    assert dec[both.room]["status"] == "Success", dec[both.room]
    assert pre[(both.room, 1)]["status"] == "Success", pre
    assert dec[override.room]["status"] == "Success", dec[override.room]
    assert dec["pool_problems"] == [], dec["pool_problems"]  # both rooms hold group 1's bytes

    (reason,) = dec[wrong.room]["reasons"]
    assert dec[wrong.room]["status"] == "Failed" and "[prefill DP group 0 of dp_size=2 at 127.0.0.1:" in reason, reason
    (reason,) = dec[past.room]["reasons"]
    assert "init(): prefill_dp_rank=5 names no DP group of the prefill at 127.0.0.1:" in reason, reason
    # (which groups had registered when the decode read the prefill's info depends on timing)
    want = "it registered dp_size=2, so ranks 0..1 (DP groups registered when this decode read its info: ["
    assert want in reason, reason
    (reason,) = pre[(misrouted.room, 0)]["reasons"]
    assert "prefill DP group 0 was given bootstrap_room=" in reason, reason
    assert "follow_bootstrap_room routes to DP group 1 (bootstrap_room % dp_size, dp_size=2)" in reason, reason


@needs_sglang
@pytest.mark.slow
@pytest.mark.parametrize(
    "prefill, mla, load_balance, env",
    [
        ((1, 2), False, "round_robin", {}),
        ((2, 2), True, "total_requests", {}),  # MLA (DeepSeek), two writers per group
        ((1, 2), False, "auto", {"SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK": "1"}),
    ],
    ids=["round-robin", "mla-tp2xdp2-total-requests", "force-query"],
)
def test_rooms_the_prefill_load_balancer_placed_are_found_through_the_bootstrap(prefill, mla, load_balance, env):
    """Another --load-balance-method than follow_bootstrap_room (or SGLang's force-query flag):
    every room is prefilled on the group that bootstrap_room % 2 does NOT name; the group's
    first rank registers it with the bootstrap and the decode, told the prefill does not follow
    bootstrap_room, asks for it as SGLang's decode does. Each room lands, byte-exact, from the
    group that prefilled it."""
    model = Model(mla=True, head_dim=24, pool_tokens=192) if mla else Model(total_kv_heads=4, pool_tokens=192)
    requests = [R(q.room, q.tokens, prefill_groups=((q.room + 1) % 2,)) for q in ROOMS]
    pre, dec = run_dp(prefill, (1, 1), model, requests, env=env, load_balance=load_balance)
    assert dec["follows_room"] is False
    for q in requests:
        group = (q.room + 1) % 2
        assert dec[q.room]["status"] == "Success", dec[q.room]
        assert dec[q.room]["route"] == group
        assert dec[q.room]["problems"] == [], dec[q.room]["problems"]
        assert pre[(q.room, group)]["status"] == "Success", pre
    assert dec["pool_problems"] == [], dec["pool_problems"]


# -- the bootstrap's DP groups (no SGLang needed) -------------------------------------------------

GEO = KVGeometry(num_layers=2, total_kv_heads=4, head_dim=8, dtype="bfloat16", page_size=4, num_pages=8)


def _register(addr: str, dp: int, tp: int, *, tp_size=1, dp_size=2, geometry=GEO, session=None):
    msg = PrefillRegister(
        engine_version="t",
        session=session or f"p{dp}.{tp}",
        tp_size=tp_size,
        tp_rank=tp,
        endpoint=f"tcp://127.0.0.1:{4000 + 10 * dp + tp}",
        geometry=geometry,
        transport="local",
        dp_rank=dp,
        dp_size=dp_size,
    )
    return bootstrap.request(addr, msg, timeout_s=5.0, key=b"")


def _query(address: str, dp: int = 0):
    return bootstrap.request(address, BootstrapQuery(session="d", tp_rank=0, dp_rank=dp), timeout_s=5.0, key=b"")


def test_bootstrap_serves_each_dp_group_its_own_ranks_and_names_what_registered():
    with BootstrapServer("127.0.0.1", 0, key="off") as srv:
        addr = srv.address
        _register(addr, 0, 0, tp_size=2)
        _register(addr, 0, 1, tp_size=2)
        one = _query(bootstrap.group_address(addr, 1))
        assert not one.ready and one.dp_rank == 1 and one.dp_groups == (0,)
        assert one.reason == "DP group 1 has no prefill rank registered (registered DP groups: [0] of dp_size=2)"
        _register(addr, 1, 0, tp_size=2)
        assert _query(addr, 1).reason == "1 of 2 prefill rank(s) registered in DP group 1"
        _register(addr, 1, 1, tp_size=2)
        zero, one = _query(addr), _query(bootstrap.group_address(addr, 1))
        assert zero.ready and one.ready and (zero.dp_size, one.dp_groups) == (2, (0, 1))
        assert [r.session for r in zero.ranks] == ["p0.0", "p0.1"]  # a group's ranks only
        assert [r.session for r in one.ranks] == ["p1.0", "p1.1"]
        assert srv.registered(1) == {0: "p1.0", 1: "p1.1"}
        past = _query(addr, 3)
        assert not past.ready
        assert (
            past.reason == "dp_rank=3: the prefill behind this bootstrap has dp_size=2 (registered DP groups: [0, 1])"
        )
        # every group is an attention-TP group of the same size, model and DP size
        refused = _register(addr, 1, 0, tp_size=1, session="late")
        assert (
            refused.reason
            == "prefill rank 0 of DP group 1 registers tp_size=1 but rank 0 of DP group 0 registered tp_size=2"
        )
        refused = _register(addr, 1, 0, tp_size=2, dp_size=4, session="late")
        assert "registers dp_size=4 but rank 0 of DP group 0 registered dp_size=2" in refused.reason


def test_group_addresses_round_trip_and_reject_garbage():
    assert bootstrap.group_address("10.0.0.1:8998", 0) == "10.0.0.1:8998"
    assert bootstrap.group_address("10.0.0.1:8998", 3) == "10.0.0.1:8998#dp3"
    assert bootstrap.split_group_address("10.0.0.1:8998#dp3") == ("10.0.0.1:8998", 3)
    assert bootstrap.split_group_address("10.0.0.1:8998") == ("10.0.0.1:8998", 0)
    for bad in ("10.0.0.1:8998#dp", "10.0.0.1:8998#dp0", "10.0.0.1:8998#dpx", "10.0.0.1:8998#dp01"):
        with pytest.raises(ValueError, match="the DP group after '#dp' must be an int >= 1"):
            bootstrap.split_group_address(bad)
    with pytest.raises(ValueError, match="dp_rank=-1 must be an int >= 0"):
        bootstrap.group_address("10.0.0.1:8998", -1)
    with pytest.raises(ValueError, match="BootstrapQuery.dp_rank=2 but the address '127.0.0.1:9#dp1' names DP group 1"):
        bootstrap.request("127.0.0.1:9#dp1", BootstrapQuery(session="d", tp_rank=0, dp_rank=2), timeout_s=0.1, key=b"")
