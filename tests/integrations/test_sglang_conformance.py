"""Our classes against SGLang 0.5.23's real base classes: they subclass them, implement
every abstract method, accept every argument the base signatures and SGLang's event loops
pass (by position and by keyword), and read only KVArgs/ServerArgs fields SGLang defines."""

from __future__ import annotations

import inspect

import pytest

from tests.integrations.sglang_env import import_sglang_base

base, _reason = import_sglang_base()
pytestmark = pytest.mark.skipif(base is None, reason=_reason)

if base is not None:
    from sglang_kvxfer.integrations import sglang as ours

    PAIRS = [
        (ours.KVXferKVManager, base.BaseKVManager),
        (ours.KVXferKVSender, base.BaseKVSender),
        (ours.KVXferKVReceiver, base.BaseKVReceiver),
        (ours.KVXferKVBootstrapServer, base.BaseKVBootstrapServer),
    ]
else:
    PAIRS = []

_VAR = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def signature_problems(theirs, mine) -> list[str]:
    """Why a call valid for ``theirs`` could fail on ``mine`` (empty: compatible)."""
    b, o = inspect.signature(theirs), inspect.signature(mine)
    o_names = list(o.parameters)
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in o.parameters.values())
    problems = []
    for pos, p in enumerate(b.parameters.values()):
        if p.kind in _VAR:
            continue
        q = o.parameters.get(p.name)
        if q is None:
            if not takes_kwargs:
                problems.append(f"parameter {p.name!r} is not accepted")
            continue
        if p.kind is not inspect.Parameter.KEYWORD_ONLY and o_names.index(p.name) != pos:
            problems.append(f"parameter {p.name!r} is at position {o_names.index(p.name)}, SGLang's at {pos}")
        if q.kind is inspect.Parameter.POSITIONAL_ONLY:
            problems.append(f"parameter {p.name!r} cannot be passed by keyword")
        if p.default is not inspect.Parameter.empty and q.default is inspect.Parameter.empty:
            problems.append(f"parameter {p.name!r} is optional in SGLang but required here")
    for q in o.parameters.values():
        if q.name not in b.parameters and q.kind not in _VAR and q.default is inspect.Parameter.empty:
            problems.append(f"parameter {q.name!r} is required here but SGLang never passes it")
    return problems


def _public_methods(cls) -> list[str]:
    return sorted(n for n, v in vars(cls).items() if callable(v) and (not n.startswith("_") or n == "__init__"))


@pytest.mark.parametrize("mine, theirs", PAIRS, ids=lambda c: c.__name__)
def test_subclasses_the_real_base_and_implements_every_abstract_method(mine, theirs):
    assert issubclass(mine, theirs)
    assert theirs.__abstractmethods__, f"{theirs.__name__} declares no abstract methods: wrong module?"
    assert not inspect.isabstract(mine), f"{mine.__name__} leaves {sorted(mine.__abstractmethods__)} abstract"
    for name in theirs.__abstractmethods__:
        assert getattr(mine, name) is not getattr(theirs, name), f"{mine.__name__}.{name} is SGLang's stub"


@pytest.mark.parametrize("mine, theirs", PAIRS, ids=lambda c: c.__name__)
def test_every_base_method_signature_is_compatible(mine, theirs):
    checked = 0
    for name in _public_methods(theirs):
        if getattr(mine, name) is getattr(theirs, name):
            continue  # inherited unchanged
        problems = signature_problems(getattr(theirs, name), getattr(mine, name))
        assert not problems, f"{mine.__name__}.{name}: {problems}"
        checked += 1
    assert checked >= 1


def test_the_signature_check_catches_incompatible_methods():
    def theirs(self, kv_indices, aux_index=None, state_indices=None): ...
    def reordered(self, aux_index, kv_indices, state_indices=None): ...
    def required(self, kv_indices, aux_index, state_indices=None): ...
    def extra(self, kv_indices, aux_index=None, state_indices=None, mode=None, *, room): ...

    assert signature_problems(theirs, theirs) == []
    assert "parameter 'kv_indices' is at position 2, SGLang's at 1" in signature_problems(theirs, reordered)
    assert "parameter 'aux_index' is optional in SGLang but required here" in signature_problems(theirs, required)
    assert "parameter 'room' is required here but SGLang never passes it" in signature_problems(theirs, extra)


def _bind(cls, method: str, *args, **kwargs) -> None:
    inspect.signature(getattr(cls, method)).bind(None, *args, **kwargs)


def test_accepts_the_calls_sglangs_event_loops_make():
    """The calls of 0.5.23's prefill.py / decode.py / disagg_service.py, argument for argument
    (including those beyond the base signatures: indices_event, destination)."""
    x = object()
    _bind(ours.KVXferKVManager, "__init__", x, x, x, False)
    _bind(ours.KVXferKVManager, "register_to_bootstrap")
    _bind(ours.KVXferKVManager, "try_ensure_parallel_info", "h:1")
    _bind(ours.KVXferKVManager, "should_verify_kv_checksum", "h:1")
    _bind(ours.KVXferKVManager, "submit_prefill_recompute", x, x)
    _bind(
        ours.KVXferKVSender,
        "__init__",
        mgr=x,
        bootstrap_addr="h:1",
        bootstrap_room=1,
        req_has_disagg_prefill_dp_rank=False,
    )
    _bind(ours.KVXferKVSender, "init", 3, 0)
    _bind(ours.KVXferKVSender, "send", x, None, num_kv_tokens=16)
    _bind(ours.KVXferKVSender, "send", x, None, num_kv_tokens=16, indices_event=x)
    _bind(ours.KVXferKVSender, "should_send_kv_chunk", 3, True)
    for name in (
        "poll",
        "failure_exception",
        "abort",
        "clear",
        "get_transfer_metric",
        "pop_decode_prefix_len",
        "get_max_transfer_tokens",
    ):
        _bind(ours.KVXferKVSender, name)
        if hasattr(base.BaseKVReceiver, name):
            _bind(ours.KVXferKVReceiver, name)
    _bind(ours.KVXferKVReceiver, "__init__", mgr=x, bootstrap_addr="h:1", bootstrap_room=1)
    _bind(ours.KVXferKVReceiver, "init", 0)
    _bind(ours.KVXferKVReceiver, "send_metadata", x, 0, x, decode_prefix_len=0)
    _bind(
        ours.KVXferKVReceiver,
        "send_metadata",
        x,
        0,
        x,
        decode_prefix_len=0,
        destination=base.KVTransferDestination.DEVICE,
    )
    _bind(ours.KVXferKVReceiver, "ensure_abort_notified", force_arm=True)
    _bind(ours.KVXferKVBootstrapServer, "__init__", host="0.0.0.0", port=8998)


def test_reads_only_fields_sglang_defines():
    from sglang.srt.server_args import ServerArgs

    from sglang_kvxfer.integrations.sglang_args import KVARGS_FIELDS, SERVER_ARGS_FIELDS

    assert set(KVARGS_FIELDS) <= set(base.KVArgs.__annotations__), set(KVARGS_FIELDS) - set(base.KVArgs.__annotations__)
    fields = set(ServerArgs.__dataclass_fields__) if hasattr(ServerArgs, "__dataclass_fields__") else set()
    fields |= {n for c in ServerArgs.__mro__ for n in getattr(c, "__annotations__", {})}
    assert set(SERVER_ARGS_FIELDS) <= fields, set(SERVER_ARGS_FIELDS) - fields


def test_poll_values_are_sglangs():
    from sglang_kvxfer.protocol.state import KVPoll as EngineKVPoll

    for state in EngineKVPoll:
        assert getattr(base.KVPoll, state.name) == int(state)
