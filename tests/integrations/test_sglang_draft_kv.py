"""Speculative decoding's draft-model KV and ``--disaggregation-enable-kv-checksum`` through our
SGLang classes, driven by the scripted scheduler in SGLang's call order (``sglang_sides``:
prefill and decode in separate processes, SGLang's real base classes).

The draft pool has a geometry of its own (one layer, other heads and dims than the model's)
and the model's page ids; every byte of every buffer of both pools is compared on every
decode rank with what that rank must hold, for TP 1 -> 1, 2 -> 1 (a decode rank gathers from
two writers; one draft head replicated on both prefill ranks, one elected) and 1 -> 2 (a
prefill rank splits its heads; the draft head replicated on both decode ranks). A draft pool
on one side only, or of another geometry, fails the request on both sides naming both values;
a checksum over what each writer sent is verified on every decode rank, and one byte flipped
after landing fails the request naming both checksums.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from tests.integrations import sglang_sides as sides
from tests.integrations.sglang_env import Draft, Model, import_sglang_base
from tests.ports import free_port

_base, _reason = import_sglang_base()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_base is None, reason=_reason)]

# (room, prompt tokens): a partial last page over several chunks; a one-chunk request
REQUESTS = [(0xD7AF_0001_F00D, 37), (0xD7AF_0002_CAFE, 9)]


def run(p, d, prefill_model, decode_model=None, *, transport="local", timeout_s=60.0, **decode_opts):
    """Both sides with ``prefill_model`` / ``decode_model``; ``kv_checksum`` goes to both
    sides, ``corrupt`` to the decode only."""
    port = free_port()
    env = {**sides.ENV, "KVXFER_SGLANG_TRANSPORT": transport}
    checksum = decode_opts.pop("kv_checksum", False)
    prefill = sides.Spec("prefill", prefill_model, p, port, REQUESTS, env, timeout_s, kv_checksum=checksum)
    decode = sides.Spec("decode", decode_model or prefill_model, d, port, REQUESTS, env, timeout_s)
    decode = dataclasses.replace(decode, kv_checksum=checksum, **decode_opts)
    return sides.run_in_processes(sides.main, [prefill, decode], timeout_s)


def model(draft_heads=2, **draft) -> Model:
    return Model(total_kv_heads=4, kv_cache_dtype_str="bfloat16", draft=Draft(total_kv_heads=draft_heads, **draft))


def heads_written(m: Model, d: int, tokens: int) -> tuple[int, int]:
    """Bytes every prefill rank together writes for a request: the model's heads of every
    token row of every page, K and V, once per decode rank holding them; the draft's too."""
    pages = -(-tokens // m.page_size)
    dm = m.draft.model(m)
    target = m.num_layers * (m.head_dim + m.v_head_dim) * 2 * m.page_size * pages * max(m.total_kv_heads, d)
    draft = dm.num_layers * (dm.head_dim + dm.v_head_dim) * 2 * dm.page_size * pages * max(dm.total_kv_heads, d)
    return target, draft


@pytest.mark.parametrize(
    "p, d, draft_heads, transport",
    [
        (1, 1, 2, "local"),
        (2, 1, 1, "tcp"),  # model heads gathered from two writers; the draft head elected among two replicas
        (1, 2, 1, "local"),  # model heads split over two decode ranks; the draft head replicated on both
    ],
)
def test_draft_model_kv_lands_byte_exact_beside_the_models(p, d, draft_heads, transport):
    m = model(draft_heads)
    prefill, decode = run(p, d, m, transport=transport)
    for room, tokens in REQUESTS:
        assert decode[room]["status"] == "Success", decode[room]
        # sglang_sides checks every byte of the model's and the draft's buffers on every rank
        assert decode[room]["problems"] == [], decode[room]["problems"]
        assert prefill[room]["status"] == "Success", prefill[room]
        assert sum(prefill[room]["bytes"]) == sum(heads_written(m, d, tokens)), prefill[room]["bytes"]


@pytest.mark.parametrize("side_with_draft", ["prefill", "decode"])
def test_a_draft_pool_on_one_side_only_fails_the_request_naming_both_sides(side_with_draft):
    with_draft, without = model(), Model(total_kv_heads=4, kv_cache_dtype_str="bfloat16")
    pm, dm = (with_draft, without) if side_with_draft == "prefill" else (without, with_draft)
    prefill, decode = run(1, 1, pm, dm, timeout_s=30.0)
    have = "1 layer(s), 2 KV heads, head_dim 8/8, bfloat16"
    none = "none (num_draft_entries=0)"
    want = (
        f"draft-model KV (speculative decoding): prefill={have if side_with_draft == 'prefill' else none} "
        f"decode={none if side_with_draft == 'prefill' else have}; one server has a draft model's KV pool "
        "and the other has none"
    )
    for room, _ in REQUESTS:
        for side, report in (("decode", decode[room]), ("prefill", prefill[room])):
            assert report["status"] == "Failed", (side, report)
            (reason,) = report["reasons"]
            assert want in reason, (side, reason)


def test_a_draft_geometry_mismatch_fails_at_registration_naming_the_field_and_both_values():
    prefill, decode = run(1, 1, model(head_dim=8), model(head_dim=16), timeout_s=30.0)
    for room, _ in REQUESTS:
        for side, report in (("decode", decode[room]), ("prefill", prefill[room])):
            assert report["status"] == "Failed", (side, report)
            (reason,) = report["reasons"]
            assert "draft-model KV (speculative decoding)" in reason, (side, reason)
            assert "head_dim: prefill=8 decode=16" in reason, (side, reason)


@pytest.mark.parametrize("p, d", [(2, 1), (1, 2)])
def test_kv_checksum_is_verified_per_writer_under_tp_resharding(p, d):
    m = model(draft_heads=1)
    prefill, decode = run(p, d, m, kv_checksum=True)
    for room, _ in REQUESTS:
        assert decode[room]["status"] == "Success", decode[room]
        assert decode[room]["problems"] == [], decode[room]["problems"]
        assert prefill[room]["status"] == "Success", prefill[room]
        # every decode rank compared each head it holds, of both pools, with its writer's digest
        assert decode[room]["verified"] == [m.total_kv_heads // d + 1] * d, decode[room]
    _, plain = run(p, d, m)  # without the flag nothing is digested
    assert all(plain[room]["verified"] == [0] * d for room, _ in REQUESTS), plain


@pytest.mark.parametrize("pool", ["kv", "draft"])
def test_a_byte_flipped_after_landing_fails_the_request_naming_both_checksums(pool):
    prefill, decode = run(2, 1, model(draft_heads=1), kv_checksum=True, corrupt=pool)
    (bad, _), (good, _) = REQUESTS
    assert decode[good]["status"] == "Success" and decode[good]["problems"] == [], decode[good]
    assert decode[bad]["status"] == "Failed", decode[bad]
    (reason,) = decode[bad]["reasons"]
    where = " in the draft-model KV (speculative decoding)" if pool == "draft" else ""
    # rank 0 of the prefill writes head 0 of the model's KV; the draft's one head comes from
    # whichever of the two replicas the room elected
    pattern = (
        rf"KV checksum mismatch \(--disaggregation-enable-kv-checksum\){re.escape(where)}: KV head 0 written by "
        r"prefill rank [01]: prefill crc32=0x[0-9a-f]{8}, decode crc32=0x[0-9a-f]{8} "
        r"\(the KV that landed on decode rank 0 is not what the prefill sent\)"
    )
    assert re.search(pattern, reason), reason
    theirs, ours = re.findall(r"crc32=(0x[0-9a-f]{8})", reason)
    assert theirs != ours
    assert prefill[bad]["status"] == "Success", prefill[bad]  # the prefill sent what it digested


@pytest.mark.parametrize("p, d", [(1, 1), (2, 1)])
def test_a_dsa_models_mtp_draft_kv_lands_beside_its_latent_and_indexer(p, d):
    """GLM-5 / DeepSeek-V3.2 with MTP: a draft model beside a DSA model's indexer state. The
    draft pool registers its own KV only (the state pools are announced with the model's:
    a draft manager that announced them too failed at construction), and every latent,
    indexer and draft byte of every decode rank is compared."""
    from tests.integrations import sglang_dp_sides as dps
    from tests.integrations.sglang_state_env import StateModel

    state = StateModel(kinds=("dsa",), dsa_layers=3)
    m = Model(mla=True, head_dim=24, num_layers=3, pool_tokens=192, state=state, draft=Draft(mla=True, head_dim=16))
    requests = [dps.DpRequest(room, tokens) for room, tokens in REQUESTS]
    port, env = free_port(), {**sides.ENV, "KVXFER_SGLANG_TRANSPORT": "local"}
    specs = [dps.DpSpec("prefill", m, p, 1, port, requests, env), dps.DpSpec("decode", m, d, 1, port, requests, env)]
    pre, dec = sides.run_in_processes(dps.main, specs, 60.0)
    assert "error" not in pre and "error" not in dec, (pre.get("error"), dec.get("error"))
    for q in requests:
        assert dec[q.room]["status"] == "Success", dec[q.room]
        assert dec[q.room]["problems"] == [], dec[q.room]["problems"]  # the indexer rows
    assert dec["pool_problems"] == [], "\n".join(dec["pool_problems"])  # the latent and the draft's KV
