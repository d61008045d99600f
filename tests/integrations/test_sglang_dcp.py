"""A decode with ``--dcp-size N`` (decode context parallel) through our SGLang classes, driven
by the scripted scheduler in SGLang's call order (``sglang_dcp_sides``: prefill and decode in
separate processes, SGLang's real base classes and ``ServerArgs``).

An MLA model's KV lands on every decode rank as SGLang's DCP keeps it: token ``t`` of a
request on DCP rank ``t % N`` (``N`` = ``--dcp-size``, DCP rank = attention-TP rank % N), packed
into that rank's pages of the request's page ids. Every row each decode rank must hold is
compared with what the prefill's forward wrote (prefill TP 1 and 2, DCP 2 and 4, DCP inside a
larger decode TP, chunked prompts with partial last pages, a decode radix-cache prefix, a
draft model's KV, which is not split), and no page outside the requests' may change. The
control: each rank's rows compared with the next DCP rank's tokens must differ.
"""

from __future__ import annotations

import pytest

from tests.integrations import sglang_dcp_sides as dcps
from tests.integrations import sglang_sides as sides
from tests.integrations.sglang_env import Draft, Model, import_sglang_base
from tests.integrations.sglang_state_env import StateModel
from tests.ports import free_port

KIMI = dict(mamba_conv_dim=12, mamba_groups=(4, 4, 4), mamba_kimi=True)  # Kimi's conv: [k - 1, q|k|v]

_base, _reason = import_sglang_base()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_base is None, reason=_reason)]


def run(p, d, dcp, model, requests, transport="local", timeout_s=60.0, prefill_dcp=1, checksum=False, corrupt=""):
    port = free_port()
    env = {**sides.ENV, "KVXFER_SGLANG_TRANSPORT": transport}
    prefill = sides.Spec("prefill", model, p, port, requests, env, timeout_s, checksum, dcp_size=prefill_dcp)
    decode = sides.Spec("decode", model, d, port, requests, env, timeout_s, checksum, corrupt, dcp_size=dcp)
    return sides.run_in_processes(dcps.main, [prefill, decode], timeout_s)


def mla(page_size=4, **kw) -> Model:
    return Model(mla=True, head_dim=24, num_layers=2, page_size=page_size, pool_tokens=192, **kw)


def check(pre, dec, requests):
    for room, *_ in requests:
        assert pre[room]["status"] == "Success", pre[room]
        assert dec["requests"][room] == {"status": "Success", "problems": []}, dec["requests"][room]
    assert dec["pool_problems"] == [], "\n".join(dec["pool_problems"])
    assert dec["control_problems"] > 0  # the check tells one DCP rank's tokens from another's


# (room, prompt tokens): chunks of 16 tokens end inside a decode page of page_size * N
# tokens, partial last pages on both sides; a one-page request
REQUESTS = [(0xDC9_0001, 45), (0xDC9_0002, 3), (0xDC9_0003, 32)]


@pytest.mark.parametrize(
    "p, d, dcp, page_size, transport",
    [
        (1, 2, 2, 4, "local"),
        (2, 2, 2, 1, "tcp"),
        (1, 4, 4, 2, "local"),
        (2, 4, 2, 4, "tcp"),  # DCP 2 inside attention TP 4: ranks r and r + 2 hold the same tokens
    ],
)
def test_each_dcp_rank_holds_every_nth_token_of_the_prompt(p, d, dcp, page_size, transport):
    pre, dec = run(p, d, dcp, mla(page_size), REQUESTS, transport)
    check(pre, dec, REQUESTS)


def test_dcp_with_a_decode_radix_cache_prefix_and_a_draft_model():
    """A prefix of two DCP pages already on the decode (each rank its share); the draft
    model's KV (MLA, not split over DCP ranks) lands whole on every rank."""
    requests = [(0xDC9_0011, 41, 16), (0xDC9_0012, 21)]
    pre, dec = run(1, 2, 2, mla(4, draft=Draft(num_layers=1, head_dim=8, mla=True)), requests)
    check(pre, dec, requests)


@pytest.mark.parametrize("p, d", [(1, 2), (2, 2), (2, 4)])
def test_dcp_of_a_hybrid_mla_model_with_its_mamba_state(p, d):
    """Kimi-Linear's pools (a HybridLinearKVPool over an MLA pool) with a DCP 2 decode: the
    latent lands token by token on its DCP rank, the mamba state (one slot per request, its
    channels split over attention TP as without DCP) on every rank; every row of both is
    compared, and no other state row may change."""
    m = mla(4, state=StateModel(kinds=("mamba",), **KIMI))
    assert m.hybrid_mla
    pre, dec = run(p, d, 2, m, REQUESTS, "tcp" if p == 2 else "local")
    check(pre, dec, REQUESTS)


@pytest.mark.parametrize("p, d", [(1, 2), (2, 4)])
def test_dcp_of_a_dsa_model_with_its_indexer_rows(p, d):
    """DeepSeek-V3.2's pools (an MLA latent and DSA indexer buffers, one with no indexer) with
    a DCP 2 decode: the latent lands token by token on its DCP rank; the indexer rows, which
    SGLang does not split over DCP ranks (one row per ``page_size`` tokens of the widened id
    space, listed in order), land whole on every rank, row for row from the prefill's pages,
    after a radix-cache prefix too; every row is compared, and no other row may change."""
    m = mla(4, state=StateModel(kinds=("dsa",)))
    requests = REQUESTS + [(0xDC9_0004, 41, 16)]
    pre, dec = run(p, d, 2, m, requests, "tcp" if p == 2 else "local")
    check(pre, dec, requests)


def test_equal_dcp_sizes_move_dsa_indexer_rows_row_for_row():
    """A prefill of ``--dcp-size 2`` with DSA state: its indexer rows (the widened id space, as
    the decode's) go row for row beside its latent, page for page between ranks of one DCP
    rank, after a radix-cache prefix too."""
    m = mla(4, state=StateModel(kinds=("dsa",)))
    requests = REQUESTS + [(0xDC9_0005, 41, 16)]
    pre, dec = run(2, 2, 2, m, requests, prefill_dcp=2)
    check(pre, dec, requests)


@pytest.mark.parametrize("p, d, transport", [(2, 2, "local"), (4, 2, "tcp"), (2, 4, "local")])
def test_equal_dcp_sizes_move_page_for_page_between_ranks_of_one_dcp_rank(p, d, transport):
    """A prefill of ``--dcp-size 2`` holds each request as the decode does (SGLang moves it
    unchanged between ranks of the same DCP rank): every decode rank's writer is a prefill
    rank of its DCP rank, and every row lands where the decode's DCP rank holds it."""
    pre, dec = run(p, d, 2, mla(4), REQUESTS, transport, prefill_dcp=2)
    check(pre, dec, REQUESTS)


def test_equal_dcp_sizes_with_a_prefix_and_a_draft_model():
    requests = [(0xDC9_0021, 41, 16), (0xDC9_0022, 21)]
    pre, dec = run(2, 2, 2, mla(4, draft=Draft(num_layers=1, head_dim=8, mla=True)), requests, prefill_dcp=2)
    check(pre, dec, requests)


def test_a_dcp_prefill_with_a_decode_of_another_dcp_size_fails_naming_both():
    """SGLang's own rule: DCP 1 -> N is relaid out, equal sizes move page for page, anything
    else is refused; here the decode refuses the prefill's requests naming both sizes."""
    requests = [(0xDC9_0031, 20)]
    pre, dec = run(2, 2, 1, mla(4), requests, timeout_s=30.0, prefill_dcp=2)
    report = dec["requests"][0xDC9_0031]
    assert report["status"] == "Failed", report
    assert any("--dcp-size: prefill=2 decode=1" in r for r in report["reasons"]), report


CHECKSUM_REQUESTS = [(0xDC9_0041, 45), (0xDC9_0042, 41, 16), (0xDC9_0043, 3)]


@pytest.mark.parametrize(
    "p, d, prefill_dcp, transport",
    [(1, 2, 1, "local"), (2, 4, 1, "tcp"), (2, 2, 2, "local")],
    ids=["dcp1-to-2", "tp2-to-tp4-dcp2", "equal-dcp2"],
)
def test_the_kv_checksum_is_compared_on_every_dcp_rank(p, d, prefill_dcp, transport):
    """``--disaggregation-enable-kv-checksum`` with a DCP 2 decode: from a prefill of DCP 1 the
    writers digest the request's tokens once per token phase and each DCP rank compares its
    phase's digests over its own rows (the draft model's KV, not split, over its tokens);
    from a prefill of DCP 2, page for page. Every rank compared the latent of every part."""
    model = mla(4, draft=Draft(num_layers=1, head_dim=8, mla=True))
    pre, dec = run(p, d, 2, model, CHECKSUM_REQUESTS, transport, prefill_dcp=prefill_dcp, checksum=True)
    check(pre, dec, CHECKSUM_REQUESTS)
    for room, *_ in CHECKSUM_REQUESTS:  # the latent (one "head", one writer) of the model and of the draft
        assert dec["verified"][room] == [2] * d, (room, dec["verified"][room])


@pytest.mark.parametrize("what, part", [("kv", ""), ("draft", " in the draft-model KV (speculative decoding)")])
def test_a_byte_flipped_on_a_dcp_rank_fails_its_request_naming_the_checksums(what, part):
    """One byte of decode rank 0's first landed token (the latent of its DCP phase, or the
    draft's) flipped after landing: that request fails naming the mismatch and both
    checksums; the others succeed."""
    model = mla(4, draft=Draft(num_layers=1, head_dim=8, mla=True))
    requests = CHECKSUM_REQUESTS[:2]
    pre, dec = run(1, 2, 2, model, requests, checksum=True, corrupt=what)
    report = dec["requests"][requests[0][0]]
    assert report["status"] == "Failed", report
    want = f"KV checksum mismatch (--disaggregation-enable-kv-checksum){part}: KV head 0 written by prefill rank 0"
    assert any(want in r and "prefill crc32=0x" in r and "decode crc32=0x" in r for r in report["reasons"]), report
    assert dec["requests"][requests[1][0]] == {"status": "Success", "problems": []}


@pytest.mark.parametrize("state", [("swa",), ("dsa", "dsa_tail")], ids=["swa", "dsa-tail"])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_what_dcp_does_not_move_is_refused_at_construction_naming_it(monkeypatch, role, state):
    """In process: a DCP manager with SWA state (its pages would be split over the DCP ranks
    token by token; SGLang refuses an SWA pool with PD DCP too) or DSA indexer tails is
    refused naming --dcp-size and why."""
    pool = state[-1]
    why = rf"extra per-request state \(state:{pool}\) with DCP is not implemented \(mamba and DSA state are\)"
    from sglang_kvxfer.errors import KVXferError
    from sglang_kvxfer.integrations import sglang as backend
    from tests.integrations.sglang_env import load_utils_defs, rank_memory, server_args

    for name, value in sides.ENV.items():
        monkeypatch.setenv(name, value)
    m = mla(4, state=StateModel(kinds=state))
    monkeypatch.setattr(backend, "_model_swa_kv_heads", lambda server_args: m.state.swa_heads)
    monkeypatch.setattr(backend, "_model_dsa_index_head_dim", lambda server_args: m.state.tail_dim)
    mem = rank_memory(m, 2, 0, role)
    sa = server_args("m", role, 2, free_port(), dcp_size=2)
    mode = getattr(load_utils_defs().DisaggregationMode, role.upper())
    with pytest.raises(KVXferError, match=r"does not support --dcp-size=2: " + why):
        backend.KVXferKVManager(mem.kv_args, mode, sa, m.is_mla_backend)
