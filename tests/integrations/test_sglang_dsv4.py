"""DeepSeek-V4 pools (``DeepSeekV4TokenToKVPool``: ``KVArgs.kv_layout`` set, MLA) through our
SGLang classes, driven by the scripted scheduler in SGLang's call order (``sglang_sides``:
prefill and decode in separate processes, SGLang's real base classes, the state fields filled
by SGLang's own ``append_state_component``, the C128 ring page from SGLang's own
``request_scoped_state_transfer_indices``).

The KV entries are compressed pools of pages of their own sizes (the model's pool, then
``StateModel.kv_pages``: C4 indexer keys, C128 KV), all addressed by the request's KV page ids
and moved as whole pages; the state is rows: the SWA component's entries of their own sizes by
SWA page, the unified SWA ring's rows of the window's positions, the C128 ring page (none at a
block boundary) and a draft's request row. Every byte a decode rank must hold is compared with
an oracle (``sglang_state_env``), the decode's prefix pages must stay unwritten, no row any
request was not given may change; servers of different ``kv_layout`` fail naming it on both
sides."""

from __future__ import annotations

import pytest

from tests.integrations import sglang_sides as sides
from tests.integrations.sglang_env import Model, import_sglang_base
from tests.integrations.sglang_state_env import StateModel
from tests.integrations.test_sglang_state import REQUESTS, failed_on_both_sides, run, succeeded
from tests.ports import free_port

_base, _reason = import_sglang_base()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_base is None, reason=_reason)]

V4 = "v4,c4:v4,c128:v4"  # DeepSeekV4TokenToKVPool.pd_kv_layout() of the V4 layouts
# a prompt over several chunks with a 16-token decode prefix; a short one; one ending at a C128
# block boundary of the test's ratio 8 (SGLang sends no C128 ring page for it)
PREFIXED = [(REQUESTS[0][0], 37, 16), REQUESTS[1], (0x5A7E_0003_D5A4, 32)]


def dsv4(*kinds, layout=V4, **state) -> Model:
    return Model(
        total_kv_heads=1,
        kv_cache_dtype_str="bfloat16",
        mla=True,
        kv_layout=layout,
        state=StateModel(kinds=kinds, **state),
    )


@pytest.mark.parametrize(
    "p, d, kinds, requests, transport",
    [
        (1, 1, ("swa", "c128_state", "request_row"), REQUESTS, "local"),
        (2, 1, ("swa", "swa_ring", "c128_state"), PREFIXED, "tcp"),  # unified KV: the SWA ring by rows
        (1, 2, ("swa", "c128_state", "request_row"), PREFIXED, "local"),  # replicated on both decode ranks
    ],
    ids=["1to1", "2to1-prefix-unified-tcp", "1to2-prefix"],
)
def test_deepseek_v4_compressed_pages_and_state_land_byte_exact_any_tp(p, d, kinds, requests, transport):
    """Every page of every compressed pool after the decode's prefix (the prefix's stay the
    decode's), every SWA, ring, C128 and request row, compared byte for byte on every decode rank."""
    succeeded(*run(p, d, dsv4(*kinds), transport=transport, requests=requests), requests=requests)


@pytest.mark.parametrize(
    "p, d, kinds",
    [
        (2, 1, ("swa", "c128_state", "swa:draft", "request_row")),  # paged SWA: the draft's SWA pages
        (1, 2, ("swa", "swa_ring", "c128_state", "swa_ring:draft", "request_row")),  # unified KV: its ring rows
    ],
    ids=["paged-2to1", "unified-1to2"],
)
def test_a_deepseek_v4_nextn_drafts_swa_state_lands_beside_the_targets(p, d, kinds):
    """SGLang appends a NextN draft's SWA (or SWA ring) component after the target's, with the
    same indices, and its valid-from mark as a request row: every row of both, whose contents
    differ, lands in its own component."""
    succeeded(*run(p, d, dsv4(*kinds), requests=PREFIXED), requests=PREFIXED)


def test_deepseek_v4_with_the_kv_checksum_digests_every_pool():
    prefill, decode = run(2, 1, dsv4("swa", "c128_state"), kv_checksum=True, requests=PREFIXED)
    succeeded(prefill, decode, requests=PREFIXED)
    for room, *_ in PREFIXED:
        for parts in decode[room]["parts"]:
            assert parts.get("", 0) > 0, parts  # the model's pool
            labels = " ".join(label for label, n in parts.items() if label and n > 0).lower()
            assert "compressed kv pages" in labels and "swa kv and compressor state" in labels, parts


def test_deepseek_v4_servers_of_different_kv_layouts_fail_naming_it_on_both_sides():
    prefill, decode = run(1, 1, dsv4("swa"), dsv4("swa", layout="v41,c4:v41,c128:v41"), timeout_s=30.0)
    failed_on_both_sides(prefill, decode, "compressed KV pools (KVArgs.kv_layout, kv_item_lens): prefill [state:kv_")


@pytest.mark.parametrize(
    "role, tp, extra, message",
    [
        ("prefill", 2, dict(attn_cp_size=2), r"--attn-cp-size=2: with a compressed KV pool \(KVArgs.kv_layout='v4,"),
        ("decode", 2, dict(dcp_size=2), r"--dcp-size=2: with a kv_layout pool \(whole compressed pages are not split"),
        ("prefill", 2, dict(enable_kv_cache_sharding=True), r"--enable-kv-cache-sharding=True: with a compressed KV"),
    ],
    ids=["prefill-cp", "decode-dcp", "prefill-kv-sharding"],
)
def test_deepseek_v4_over_cp_or_dcp_ranks_is_refused_at_manager_construction(role, tp, extra, message):
    from sglang_kvxfer.integrations import sglang as backend
    from tests.integrations.sglang_env import rank_memory, server_args

    m = dsv4("swa")
    _, defs = sides.setup(sides.Spec(role, m, tp, free_port(), []))
    sa = server_args(sides.MODEL_PATH, role, tp, free_port(), **extra)
    args = rank_memory(m, tp, 0, role).kv_args
    mode = defs.DisaggregationMode.PREFILL if role == "prefill" else defs.DisaggregationMode.DECODE
    with pytest.raises(Exception, match=message):
        backend.KVXferKVManager(args, mode, sa, m.is_mla_backend)
