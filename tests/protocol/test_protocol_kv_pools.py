"""Protocol 6: the KV pool a registration, a query and a reply are about (``kv_pool``: the
model's, a draft model's, a pool of extra per-request state) and the draft-model geometry and
state pools a registration of the model's pool announces; each rejection names the message and
the field."""

from __future__ import annotations

import pytest

from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.protocol import (
    BootstrapQuery,
    BootstrapReply,
    LocalProtocolError,
    PrefillRegister,
    RemoteProtocolError,
    decode,
    encode,
)

GEO = KVGeometry(num_layers=2, total_kv_heads=8, head_dim=64)
DRAFT = KVGeometry(num_layers=1, total_kv_heads=2, head_dim=64)


def register(**over) -> PrefillRegister:
    fields = dict(
        engine_version="t",
        session="s",
        tp_size=1,
        tp_rank=0,
        endpoint="tcp://127.0.0.1:1",
        geometry=GEO,
        transport="local",
    )
    return PrefillRegister(**{**fields, **over})


def test_pools_and_the_announced_draft_geometry_round_trip():
    for msg in (
        register(draft_geometry=DRAFT),
        register(kv_pool="draft", geometry=DRAFT),
        BootstrapQuery(session="d", tp_rank=0, kv_pool="draft"),
        BootstrapReply(False, 0, None, "", (), "0 of ? prefill rank(s) registered", draft_geometry=DRAFT),
        BootstrapReply(False, 0, None, "", (), "0 of ? prefill rank(s) registered", kv_pool="draft"),
    ):
        back = decode(encode(msg))
        assert (back.kv_pool, getattr(back, "draft_geometry", None)) == (
            msg.kv_pool,
            getattr(msg, "draft_geometry", None),
        )
    assert register().kv_pool == "" and register().draft_geometry is None  # the model's pool, no draft


def test_an_unknown_pool_and_a_draft_of_the_draft_are_refused_naming_the_field():
    with pytest.raises(LocalProtocolError, match=r"PrefillRegister.kv_pool='mtp' is not '' \(the model's KV pool\)"):
        register(kv_pool="mtp")
    with pytest.raises(LocalProtocolError, match=r"BootstrapQuery.kv_pool='Draft' is not"):
        BootstrapQuery(session="d", tp_rank=0, kv_pool="Draft")
    with pytest.raises(
        LocalProtocolError, match=r"PrefillRegister.draft_geometry must be None in a registration of kv_pool='draft'"
    ):
        register(kv_pool="draft", draft_geometry=DRAFT)
    with pytest.raises(
        LocalProtocolError, match=r"BootstrapReply.draft_geometry must be None in a reply about kv_pool='draft'"
    ):
        BootstrapReply(False, 0, None, "", (), "x", kv_pool="draft", draft_geometry=DRAFT)


def test_a_peer_naming_an_unknown_pool_is_refused_as_the_peers_fault():
    frame = encode(BootstrapQuery(session="d", tp_rank=0, kv_pool="draft")).replace(b"draft", b"drAft")
    with pytest.raises(RemoteProtocolError, match=r"invalid BootstrapQuery from peer: .*kv_pool='drAft'"):
        decode(frame)


def test_state_pools_are_named_announced_with_the_models_pool_and_round_trip():
    announced = ("state:swa", "state:mamba.0", "state:mamba.1")
    for msg in (
        register(state_pools=announced),
        register(kv_pool="state:mamba.1", geometry=DRAFT),
        BootstrapQuery(session="d", tp_rank=0, kv_pool="state:swa"),
        BootstrapReply(False, 0, None, "", (), "0 of ? prefill rank(s) registered", state_pools=announced),
        BootstrapReply(False, 0, None, "", (), "0 of ? prefill rank(s) registered", kv_pool="state:dsa"),
    ):
        back = decode(encode(msg))
        assert back.kv_pool == msg.kv_pool
        assert getattr(back, "state_pools", ()) == getattr(msg, "state_pools", ())
    assert register().state_pools == ()


def test_a_bad_state_pool_name_or_announcement_is_refused_naming_the_field():
    with pytest.raises(LocalProtocolError, match=r"PrefillRegister.kv_pool='state:' is not '' \(the model's KV pool\)"):
        register(kv_pool="state:")
    with pytest.raises(LocalProtocolError, match=r"PrefillRegister.state_pools\[0\]='swa' is not a state pool name"):
        register(state_pools=("swa",))
    with pytest.raises(LocalProtocolError, match=r"PrefillRegister.state_pools names a pool twice"):
        register(state_pools=("state:swa", "state:swa"))
    with pytest.raises(
        LocalProtocolError, match=r"PrefillRegister.state_pools must be empty in a registration of kv_pool='draft'"
    ):
        register(kv_pool="draft", state_pools=("state:swa",))
    with pytest.raises(LocalProtocolError, match=r"BootstrapReply.state_pools must be empty in a reply about"):
        BootstrapReply(False, 0, None, "", (), "x", kv_pool="state:swa", state_pools=("state:swa",))
