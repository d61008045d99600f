"""Our SGLang classes driven by a scripted scheduler, prefill and decode in separate
processes (see ``sglang_sides``): equal TP, P=2 -> D=1 and P=1 -> D=2 move every KV byte and
the metadata slot exactly; a geometry mismatch reaches ``failure_exception()`` on both
sides with the field-level message."""

from __future__ import annotations

import dataclasses

import pytest

from tests.integrations import sglang_sides as sides
from tests.integrations.sglang_env import Model, import_sglang_base
from tests.ports import free_port

_base, _reason = import_sglang_base()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_base is None, reason=_reason)]

# (room, prompt tokens): a partial last page, several chunks; a one-chunk request
REQUESTS = [(0x5EED_0001_F00D, 37), (0x7A11_0002_CAFE, 9)]


def run_sides(
    p: int,
    d: int,
    model: Model,
    decode_model: Model | None = None,
    transport="local",
    timeout_s: float = 60.0,
    requests: list = REQUESTS,
):
    """Start both sides, collect what each reports, then let them shut down."""
    port = free_port()
    env = {**sides.ENV, "KVXFER_SGLANG_TRANSPORT": transport}
    specs = [
        sides.Spec(role, mdl, tp, port, requests, env, timeout_s)
        for role, mdl, tp in (("prefill", model, p), ("decode", decode_model or model, d))
    ]
    return sides.run_in_processes(sides.main, specs, timeout_s)


@pytest.mark.parametrize(
    "p, d, transport, dtype_str",
    [
        (1, 1, "local", "auto"),  # kv_cache_dtype_str "auto": the pool is described in bytes
        (2, 1, "tcp", "bfloat16"),  # a decode rank gathers its heads from two prefill ranks
        (1, 2, "local", "bfloat16"),  # a prefill rank splits its heads over two decode ranks
    ],
)
def test_scripted_scheduler_moves_every_byte(p, d, transport, dtype_str):
    model = Model(total_kv_heads=4, kv_cache_dtype_str=dtype_str)
    prefill, decode = run_sides(p, d, model, transport=transport)
    for room, tokens in REQUESTS:
        assert decode[room]["status"] == "Success", decode[room]
        assert decode[room]["problems"] == [], decode[room]["problems"]
        assert prefill[room]["status"] == "Success", prefill[room]
        # every prefill rank wrote its heads of every token row of every page: K and V rows
        pages = -(-tokens // model.page_size)
        row = model.num_layers * (model.head_dim + model.v_head_dim) * 2 * model.page_size * pages
        heads_written = sum(prefill[room]["bytes"]) // row
        assert heads_written == max(model.total_kv_heads, d), prefill[room]["bytes"]


def test_mla_latent_reaches_every_decode_rank():
    model = Model(mla=True, head_dim=24, kv_cache_dtype_str="bfloat16")
    _, decode = run_sides(2, 2, model)
    for room, _ in REQUESTS:
        assert decode[room]["status"] == "Success", decode[room]
        assert decode[room]["problems"] == [], decode[room]["problems"]


def test_geometry_mismatch_reaches_failure_exception_on_both_sides():
    model = Model(head_dim=16)
    prefill, decode = run_sides(1, 1, model, decode_model=dataclasses.replace(model, head_dim=8), timeout_s=40.0)
    for room, _ in REQUESTS:
        for side, report in (("decode", decode[room]), ("prefill", prefill[room])):
            assert report["status"] == "Failed", (side, report)
            (reason,) = report["reasons"]
            assert reason.startswith("KVXferTransferError"), (side, reason)
            assert "head_dim: prefill=16 decode=8" in reason, (side, reason)


@pytest.mark.parametrize("p, d, transport", [(1, 1, "local"), (2, 1, "tcp"), (1, 2, "local")])
def test_decode_radix_cache_prefix_is_not_sent_and_the_rest_lands_after_it(p, d, transport):
    """A decode that already holds a request's first pages (``decode_prefix_len``, decode
    radix cache) receives only the pages after them: the prefill pops the same length, sends
    only those pages, and every token of the request, prefix and rest, is exact on every
    decode rank. A prefill that ignored the prefix would shift every row (the check fails)."""
    model = Model(total_kv_heads=4, kv_cache_dtype_str="bfloat16")
    ps = model.page_size
    # (room, tokens, prefix): a prefix of 2 pages and a partial last page; a prefix of all but
    # a few tokens; no prefix next to them; a prefix of the whole prompt
    requests = [
        (0x9F1C_0001_0001, 37, 2 * ps),
        (0x9F1C_0002_0002, 3 * ps + 1, 3 * ps),
        (0x9F1C_0003_0003, 20, 0),
        (0x9F1C_0005_0005, 3 * ps, 3 * ps),  # the decode holds the whole prompt: only the aux data moves
    ]
    prefill, decode = run_sides(p, d, model, transport=transport, requests=requests)
    for room, tokens, prefix in requests:
        assert decode[room]["status"] == "Success", decode[room]
        assert decode[room]["problems"] == [], decode[room]["problems"]
        assert prefill[room]["status"] == "Success", prefill[room]
        assert prefill[room]["prefixes"] == [prefix] * p, prefill[room]
        # only the pages after the prefix moved: K and V rows of every head, once per decode replica
        pages = -(-tokens // ps) - prefix // ps
        row = model.num_layers * (model.head_dim + model.v_head_dim) * 2 * ps * pages
        assert sum(prefill[room]["bytes"]) == row * max(model.total_kv_heads, d), prefill[room]["bytes"]
