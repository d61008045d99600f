"""The bootstrap's KV pools (protocol 6): a prefill rank that serves a draft model's KV
registers it apart (``kv_pool="draft"``) and announces its geometry with the model's pool;
likewise each pool of extra per-request state (``kv_pool="state:swa"``, announced in
``state_pools``); registrations, conflicts and queries are per pool. And the engine config
fields behind it."""

from __future__ import annotations

import pytest

from sglang_kvxfer.engine import bootstrap
from sglang_kvxfer.engine.bootstrap import BootstrapServer
from sglang_kvxfer.engine.config import EngineConfig
from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.protocol.messages import BootstrapQuery, PrefillRegister

GEO = KVGeometry(num_layers=2, total_kv_heads=4, head_dim=16, num_pages=8)
DRAFT = KVGeometry(num_layers=1, total_kv_heads=2, head_dim=8, num_pages=8)


def _register(addr: str, tp: int, *, pool="", geometry=GEO, draft=None, tp_size=2, session=None, states=()):
    msg = PrefillRegister(
        engine_version="t",
        session=session or f"p{pool}{tp}",
        tp_size=tp_size,
        tp_rank=tp,
        endpoint=f"tcp://127.0.0.1:{4000 + tp + (100 if pool else 0)}",
        geometry=geometry,
        transport="local",
        kv_pool=pool,
        draft_geometry=draft,
        state_pools=states,
    )
    return bootstrap.request(addr, msg, timeout_s=5.0, key=b"")


def _query(addr: str, pool: str = ""):
    return bootstrap.request(addr, BootstrapQuery(session="d", tp_rank=0, kv_pool=pool), timeout_s=5.0, key=b"")


def test_each_pool_is_registered_and_looked_up_apart():
    with BootstrapServer("127.0.0.1", 0, key="off") as srv:
        addr = srv.address
        _register(addr, 0, pool="draft", geometry=DRAFT)
        assert not _query(addr).ready  # a draft pool's ranks are not the model's
        assert _query(addr).draft_geometry is None  # no model-pool rank has announced one yet
        for tp in (0, 1):
            _register(addr, tp, draft=DRAFT)
        model = _query(addr)
        assert model.ready and model.geometry == GEO and model.draft_geometry == DRAFT and model.kv_pool == ""
        assert [r.session for r in model.ranks] == ["p0", "p1"]
        draft = _query(addr, "draft")
        assert not draft.ready and draft.kv_pool == "draft" and draft.draft_geometry is None
        assert draft.reason == "1 of 2 prefill rank(s) registered (kv_pool='draft')"
        _register(addr, 1, pool="draft", geometry=DRAFT)
        draft = _query(addr, "draft")
        assert draft.ready and draft.geometry == DRAFT and [r.session for r in draft.ranks] == ["pdraft0", "pdraft1"]
        assert srv.registered(kv_pool="draft") == {0: "pdraft0", 1: "pdraft1"} and srv.registered() == {
            0: "p0",
            1: "p1",
        }


def test_conflicts_are_per_pool_and_name_it():
    with BootstrapServer("127.0.0.1", 0, key="off") as srv:
        addr = srv.address
        _register(addr, 0, draft=DRAFT)
        _register(addr, 0, pool="draft", geometry=DRAFT)
        # another geometry in the other pool is fine; in the same pool it is refused
        refused = _register(addr, 1, pool="draft", geometry=GEO)
        assert not refused.ready
        assert refused.reason.startswith("prefill rank 1 of DP group 0 registers geometry=KVGeometry(num_layers=2")
        assert (
            "for kv_pool='draft' but rank 0 of DP group 0 registered geometry=KVGeometry(num_layers=1" in refused.reason
        )
        refused = _register(addr, 1, draft=None)
        assert "registers draft_geometry=None but rank 0 of DP group 0 registered draft_geometry=KVGeometry(" in (
            refused.reason
        )
        # the draft pool is served by the same TP group
        refused = _register(addr, 1, pool="draft", geometry=DRAFT, tp_size=4)
        assert "registers tp_size=4 for kv_pool='draft' but rank 0 of DP group 0 registered tp_size=2" in refused.reason


def test_engine_config_names_its_pool():
    base = dict(role="prefill", geometry=GEO, tp_size=2, tp_rank=0, bootstrap="127.0.0.1:1", auth_key="off")
    assert EngineConfig(**base, kv_pool="draft").kv_pool == "draft"
    assert EngineConfig(**base, draft_geometry=DRAFT).draft_geometry == DRAFT
    with pytest.raises(ValueError, match=r"kv_pool='mtp' must be '' \(the model's KV\), 'draft' or 'state:<kind>"):
        EngineConfig(**base, kv_pool="mtp")
    assert EngineConfig(**base, kv_pool="state:mamba.1").kv_pool == "state:mamba.1"
    assert EngineConfig(**base, state_pools=("state:swa",)).state_pools == ("state:swa",)
    with pytest.raises(ValueError, match=r"state_pools are announced by a prefill manager of the model's pool only"):
        EngineConfig(**base, kv_pool="state:swa", state_pools=("state:swa",))
    with pytest.raises(ValueError, match=r"state_pools=\('swa',\) must be distinct 'state:<kind>\[.<n>\]' names"):
        EngineConfig(**base, state_pools=("swa",))
    with pytest.raises(ValueError, match=r"draft_geometry .*only for a prefill manager of the model's pool"):
        EngineConfig(**{**base, "role": "decode"}, draft_geometry=DRAFT)
    with pytest.raises(ValueError, match=r"\(role='prefill', kv_pool='draft'\)"):
        EngineConfig(**base, kv_pool="draft", draft_geometry=DRAFT)


def test_a_prefill_rank_whose_registration_is_refused_fails_to_start_with_the_reason():
    """The bootstrap refuses a rank whose settings conflict with its group (the refusal's
    reason names what the other rank "registered"): the rank must not count itself as
    registered."""
    from sglang_kvxfer.engine import KVManager
    from sglang_kvxfer.errors import TransferFailedError

    from .harness import FAST

    with BootstrapServer("127.0.0.1", 0, key="off") as srv:
        _register(srv.address, 1, tp_size=2)  # a TP 2 group is registering
        cfg = EngineConfig("prefill", GEO, 1, 0, srv.address, "local", auth_key="off", **FAST)
        with KVManager(cfg) as mgr:
            with pytest.raises(
                TransferFailedError, match="registers tp_size=1 but rank 1 of DP group 0 registered tp_size=2"
            ):
                mgr.wait_registered(10)
        assert srv.registered() == {1: "p1"}  # the refused rank was not added
        # whoever looks the group up meanwhile hears why it is not ready, until that rank registers
        lookup = bootstrap.request(srv.address, BootstrapQuery(session="d", tp_rank=0), timeout_s=5.0, key=b"")
        assert not lookup.ready
        assert lookup.reason == (
            "1 of 2 prefill rank(s) registered; refused: prefill rank 0 of DP group 0 registers tp_size=1 but "
            "rank 1 of DP group 0 registered tp_size=2"
        ), lookup.reason
        assert _register(srv.address, 0, tp_size=2).ready


def test_a_refused_prefill_rank_fails_its_requests_at_once_with_the_reason():
    """SGLang never asks a prefill rank whether it registered: a rank the bootstrap refused
    keeps serving. Its requests must fail at once naming the refusal (no decode can find the
    rank), those made while it was registering as well as later ones, not at their deadline."""
    import time

    from sglang_kvxfer.engine import KVManager, KVSender
    from sglang_kvxfer.protocol.state import KVPoll

    from .harness import FAST

    with BootstrapServer("127.0.0.1", 0, key="off") as srv:
        _register(srv.address, 1, tp_size=2)  # a TP 2 group is registering
        cfg = EngineConfig(
            "prefill", GEO, 1, 0, srv.address, "local", auth_key="off", **{**FAST, "bootstrap_timeout_s": 60.0}
        )
        with KVManager(cfg) as mgr:
            early = KVSender(mgr, 11)  # (made before the refusal may have come back)
            deadline = time.monotonic() + 10
            while early.poll() is not KVPoll.Failed and time.monotonic() < deadline:
                time.sleep(0.01)
            late = KVSender(mgr, 12)
            for sender in (early, late):
                assert sender.poll() is KVPoll.Failed, sender.poll()
                reason = sender.failure_reason
                assert reason.startswith("prefill rank 0 is not registered with the bootstrap "), reason
                assert "registers tp_size=1 but rank 1 of DP group 0 registered tp_size=2" in reason, reason


def test_state_pools_are_announced_with_the_models_pool_and_registered_apart():
    swa = KVGeometry(num_layers=2, total_kv_heads=2, head_dim=8, num_pages=12)
    with BootstrapServer("127.0.0.1", 0, key="off") as srv:
        addr = srv.address
        for tp in (0, 1):
            _register(addr, tp, states=("state:swa",))
            _register(addr, tp, pool="state:swa", geometry=swa)
        model, state = _query(addr), _query(addr, "state:swa")
        assert model.ready and model.state_pools == ("state:swa",)
        assert state.ready and state.geometry == swa and state.state_pools == () and state.kv_pool == "state:swa"
        refused = _register(addr, 1, session="p-again")  # the same rank announcing no state pool
        assert "registers state_pools=() but rank 0 of DP group 0 registered state_pools=('state:swa',)" in (
            refused.reason
        )
