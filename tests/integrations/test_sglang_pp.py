"""Pipeline parallelism on the prefill (SGLang ``--pp-size``) through kvxfer, driven by the
scripted scheduler (``sglang_pp_sides``): every prefill PP stage in its own process, a writer
of its layers; a decode of PP 1 receives every stage into its one pool, a decode of the same
PP size receives each stage on the stage of its rank. Every byte of every decode buffer is
compared against the PP oracle (which layer came from which stage, each head from its TP
writer), for MHA and MLA, with prefill and decode TP, DP and PP sizes that differ. Stages whose
layers do not tile the decode's, a decode PP that is neither 1 nor the prefill's, and a stage
rank that dies are each refused or failed with a message naming them."""

from __future__ import annotations

import pytest

from tests.integrations import sglang_pp_sides as pps
from tests.integrations.sglang_env import Draft, Model, import_sglang_base
from tests.integrations.sglang_state_env import StateModel
from tests.ports import free_port

_base, _reason = import_sglang_base()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_base is None, reason=_reason)]

# Rooms of both parities (room % 2 picks a prefill DP group), partial last pages, several chunks.
ROOMS = [(0x5EED_0000_F00D, 37), (0x5EED_0001_F00D, 9), (0x7A11_0002_CAFE, 20)]


def run(tmp_path, model, prefill, decode, requests=ROOMS, **kw):
    specs = pps.deployment(model, prefill, decode, requests, str(tmp_path), free_port(), **kw)
    return pps.run_pp(specs, kw.get("timeout_s", 60.0))


def _check_success(reports, model, prefill, decode, requests=ROOMS):
    p_tp, p_dp, p_pp = prefill
    for s in range(decode[2]):
        dec = reports[f"decode pp{s}"]
        assert dec["info"]["pp_size"] == p_pp, dec["info"]
        assert dec["info"]["pp_layers"] == [list(r) for r in pps.pp_layers(model.num_layers, p_pp)], dec["info"]
        for room, _ in requests:
            assert dec[room]["status"] == "Success", dec[room]
            assert dec[room]["problems"] == [], dec[room]["problems"]
        assert dec["pool_problems"] == [], dec["pool_problems"]
    for s in range(p_pp):
        pre = reports[f"prefill pp{s}"]
        for room, _ in requests:
            assert pre[room]["status"] == "Success", (s, pre[room])


@pytest.mark.parametrize(
    "prefill, decode, mla",
    [
        ((1, 1, 2), (1, 1, 1), False),  # prefill PP 2 x TP 1 -> decode TP 1 (PP 1): two stages into one pool
        ((2, 1, 2), (1, 1, 1), False),  # PP 2 x TP 2 -> TP 1: each stage's two writers gathered
        ((1, 1, 2), (2, 1, 1), False),  # PP 2 x TP 1 -> TP 2: each stage's heads split over two ranks
        ((1, 1, 2), (1, 1, 2), False),  # PP 2 -> decode PP 2: stage s to decode stage s only
        ((1, 1, 3), (2, 1, 1), True),  # MLA, PP 3 (an uneven split) -> TP 2: the latent to every rank
        ((1, 2, 2), (1, 1, 1), False),  # attention DP 2 x PP 2 -> TP 1: the routed group's stages
    ],
    ids=["pp2-to-tp1", "pp2xtp2-to-tp1", "pp2-to-tp2", "pp2-to-pp2", "mla-pp3-to-tp2", "dp2xpp2-to-tp1"],
)
def test_every_stage_writes_its_layers_and_every_decode_byte_is_exact(tmp_path, prefill, decode, mla):
    layers = 5 if mla else 4
    if mla:
        model = Model(mla=True, head_dim=24, num_layers=layers, pool_tokens=192)
    else:
        model = Model(total_kv_heads=4, num_layers=layers, pool_tokens=192)
    reports = run(tmp_path, model, prefill, decode)
    _check_success(reports, model, prefill, decode)


def _hybrid(*kinds, mla=False, **state) -> Model:
    """A hybrid model of 4 full-attention KV layers beside its state layers (3 of each kind:
    SGLang's split gives the stages of PP 2 one and two)."""
    st = StateModel(kinds=kinds, **{"swa_layers": 3, "mamba_layers": 3, "dsa_layers": 3, "dsa_skip": (), **state})
    if mla:
        return Model(mla=True, head_dim=24, num_layers=4, pool_tokens=192, kv_cache_dtype_str="bfloat16", state=st)
    return Model(total_kv_heads=4, num_layers=4, pool_tokens=192, kv_cache_dtype_str="bfloat16", state=st)


@pytest.mark.parametrize(
    "kinds, prefill, decode, mla",
    [
        (("swa", "mamba"), (1, 1, 2), (1, 1, 1), False),  # two stages' state into one pool's slices
        (("swa", "mamba"), (2, 1, 2), (2, 1, 2), False),  # decode PP 2: stage s's state on decode stage s
        (("swa", "mamba"), (2, 1, 2), (2, 1, 1), False),  # PP 2 x TP 2 -> TP 2: each rank its mamba shard
        (("swa",), (2, 1, 2), (1, 1, 1), False),  # SWA heads gathered from two writers of each stage
        (("dsa",), (1, 1, 2), (2, 1, 1), True),  # MLA: DSA rows of each stage replicated to both ranks
        # QSA key rings and compressed keys of each stage's layer into that layer's entries, and
        # the RoPE ring every stage holds whole from each stage (SGLang pairs entries by layer id)
        (("mamba", "qsa_pending", "qsa_compressed"), (1, 1, 2), (1, 1, 1), False),
        (("qsa_pending", "qsa_compressed"), (2, 1, 2), (2, 1, 1), False),
    ],
    ids=[
        "swa+mamba-pp2-to-pp1",
        "swa+mamba-pp2-to-pp2",
        "swa+mamba-pp2xtp2-to-tp2",
        "swa-pp2xtp2-to-tp1",
        "dsa-mla",
        "qsa+mamba-pp2-to-pp1",
        "qsa-pp2xtp2-to-tp2",
    ],
)
def test_each_stage_sends_its_layers_state_and_every_state_byte_is_exact(tmp_path, kinds, prefill, decode, mla):
    """Extra per-request state with --pp-size: every stage registers and sends its own layers'
    state pools; a decode of PP 1 receives each stage's entries into that stage's slice of its
    pool (found by the counts the stages registered, the model's KV pool likewise: it holds the
    full-attention layers only, whose stage starts are not their entry starts), a decode of the
    same PP size on the stage of its rank. Every state row and KV byte is compared."""
    model = _hybrid(*kinds, mla=mla)
    reports = run(tmp_path, model, prefill, decode)
    for s in range(decode[2]):  # the hybrid stages registered their first model layer
        want = [[2 * a, 2 * a + b - a] for a, b in pps.pp_layers(model.num_layers, prefill[2])]
        assert reports[f"decode pp{s}"]["info"]["pp_layers"] == want, reports[f"decode pp{s}"]["info"]
    pps.check_decoded(reports, decode[2], ROOMS)
    for s in range(prefill[2]):
        for room, _ in ROOMS:
            assert reports[f"prefill pp{s}"][room]["status"] == "Success", (s, reports[f"prefill pp{s}"][room])


def _mxfp8(*kinds) -> Model:
    """--kv-cache-dtype mxfp8 over 4 KV layers: FP8 E4M3 KV and its block scales (K of every
    layer of a stage, then V)."""
    st = StateModel(kinds=kinds)
    return Model(
        total_kv_heads=4, num_layers=4, pool_tokens=192, dtype="float8_e4m3fn", kv_cache_dtype_str="mxfp8", state=st
    )


TAILS = dict(dsa_layers=3, dsa_skip=(1,), tail_pool=8)  # rings of 9; layer 1 shares another's indexer


def _dsv4(*kinds) -> Model:
    """A DeepSeek-V4 pool (kv_layout, MLA) of 4 layers: each stage's compressed KV pools and
    state rows are of its own layers (their contents a function of the stage)."""
    st = StateModel(kinds=kinds)
    return Model(
        mla=True, head_dim=24, num_layers=4, pool_tokens=192, kv_cache_dtype_str="bfloat16", kv_layout="v4", state=st
    )


@pytest.mark.parametrize(
    "model, prefill, decode",
    [
        (_mxfp8("block_scale"), (1, 1, 2), (1, 1, 2)),
        (_mxfp8("block_scale"), (2, 1, 2), (2, 1, 2)),  # each rank's scales of its heads, stage to stage
        (_hybrid("dsa", "dsa_tail", mla=True, **TAILS), (1, 1, 2), (2, 1, 2)),  # tails replicated to both ranks
        (_hybrid("mamba", "qsa_pending", "qsa_compressed", qsa_layers=2), (1, 1, 2), (2, 1, 2)),
        (_hybrid("qsa_pending", "qsa_compressed", qsa_layers=3), (2, 1, 2), (1, 1, 2)),  # 1 + 2 QSA layers
        (_dsv4("swa", "c128_state", "request_row"), (1, 1, 2), (2, 1, 2)),  # replicated to both decode ranks
        (_dsv4("swa", "swa_ring", "c128_state", "swa_ring:draft"), (2, 1, 2), (1, 1, 2)),
    ],
    ids=[
        "mxfp8-pp2-to-pp2",
        "mxfp8-pp2xtp2-to-pp2xtp2",
        "dsa-tails-mla-pp2-to-pp2xtp2",
        "qsa+mamba-pp2-to-pp2xtp2",
        "qsa-pp2xtp2-to-pp2",
        "dsv4-pp2-to-pp2xtp2",
        "dsv4-unified-draft-pp2xtp2-to-pp2",
    ],  # fmt: skip
)
def test_scales_tails_and_qsa_state_move_stage_to_stage_to_a_decode_of_the_same_pp(tmp_path, model, prefill, decode):
    """MXFP8 block scales, DSA indexer tails and QSA indexer state with --pp-size: each stage
    registers and sends the entries of its own layers (K, then V scales; K, then score rings;
    QSA key rings and its RoPE ring, compressed keys) to the decode stage of the same PP rank; every row's content is a function of its model-wide
    entry (a row of another stage's layer is caught), every state row and KV byte is compared."""
    reports = run(tmp_path, model, prefill, decode)
    pps.check_decoded(reports, decode[2], ROOMS)
    for s in range(prefill[2]):
        for room, _ in ROOMS:
            assert reports[f"prefill pp{s}"][room]["status"] == "Success", (s, reports[f"prefill pp{s}"][room])


@pytest.mark.parametrize(
    "model, label",
    [
        (_mxfp8("block_scale"), "MXFP8 KV block scales (KVArgs.state_types[0]='block_scale'"),
        (_hybrid("dsa_tail", mla=True, **TAILS), "DSA indexer tails (KVArgs.state_types[0]='dsa_tail'"),
        (_dsv4("swa"), "compressed KV pages (kv_data_ptrs, entries 4..5: rows of 40 bytes), KVArgs.kv_layout='v4'"),
    ],
    ids=["mxfp8", "dsa-tails", "dsv4"],
)
def test_scales_tails_or_qsa_state_from_pp_stages_to_a_decode_of_pp1_fail_naming_the_pool(tmp_path, model, label):
    env = {"KVXFER_BOOTSTRAP_TIMEOUT_S": "5"}
    reports = run(tmp_path, model, (1, 1, 2), (1, 1, 1), requests=ROOMS[:1], env=env)
    dec = reports["decode pp0"]
    (reason,) = dec[ROOMS[0][0]]["reasons"]
    assert label in reason and "the prefill's 2 PP stages each send the entries of their own layers" in reason, reason
    assert "serve the decode with --pp-size 2" in reason, reason
    assert dec["pool_problems"] == [], dec["pool_problems"]  # nothing landed
    _prefill_told(reports, reason)


def test_each_stages_mamba_channels_are_resliced_into_a_decode_of_another_tp(tmp_path):
    """PP 2 x TP 2 -> TP 1 with GDN-style conv rows ([q|k|v] sub-blocks of 4, 4, 8 channels):
    each stage's writers send their channels of its layers' entries into that stage's slice of
    the decode's pools, every sub-block gathered on its own; every state row and KV byte is
    compared."""
    model = _hybrid("mamba", mamba_conv_dim=16, mamba_groups=(4, 4, 8))
    reports = run(tmp_path, model, (2, 1, 2), (1, 1, 1))
    dec = reports["decode pp0"]
    for room, _ in ROOMS:
        assert dec[room]["status"] == "Success" and dec[room]["problems"] == [], dec[room]
        for s in range(2):
            assert reports[f"prefill pp{s}"][room]["status"] == "Success", (s, reports[f"prefill pp{s}"][room])
    assert dec["pool_problems"] == [], dec["pool_problems"]


@pytest.mark.parametrize("decode", [(1, 1, 1), (1, 1, 2)], ids=["decode-pp1", "decode-pp2"])
def test_kv_checksum_covers_each_stages_state_pools(tmp_path, decode):
    """--disaggregation-enable-kv-checksum with state and PP: every stage digests its own
    layers' state rows, and the decode compares each stage's part (on a decode of PP 1, that
    stage's slice of its pools) with them."""
    model = _hybrid("swa", "mamba")
    reports = run(tmp_path, model, (1, 1, 2), decode, kv_checksum=True)
    for s in range(decode[2]):
        dec = reports[f"decode pp{s}"]
        for room, _ in ROOMS:
            assert dec[room]["status"] == "Success" and dec[room]["problems"] == [], dec[room]
            for parts in dec[room]["parts"]:
                state = {label: n for label, n in parts.items() if "state" in label.lower()}
                stages = 2 if decode[2] == 1 else 1  # a decode of PP 1 holds both stages' slices
                kinds = ("swa", "mamba")
                assert all(n > 0 for n in state.values()), parts
                for kind in kinds:
                    assert sum(kind in label.lower() for label in state) >= stages, (kind, parts)


def _prefill_told(reports, decode_reason: str) -> None:
    """A request the decode refused by the prefill's stages: stage 0 of the prefill fails it
    with the decode's own reason (told, where it used to wait out its bootstrap deadline and
    name that), the later stages through SGLang's stage consensus."""
    room = ROOMS[0][0]
    (reason,) = reports["prefill pp0"][room]["reasons"]
    told = decode_reason.removeprefix("KVXferTransferError: ")
    assert reason == f"KVXferTransferError: decode rank 0 aborted the request: {told}", reason
    for name, report in reports.items():
        if name.startswith("prefill pp") and name != "prefill pp0":
            assert report[room]["status"] == "Failed", (name, report[room])


def test_stage_state_counts_that_do_not_fill_the_decode_pool_fail_naming_both(tmp_path):
    """The decode's model has 4 SWA layers, the prefill's stages hold 1 + 2: every request
    fails naming the pool, each stage's count and the decode's (nothing lands)."""
    env = {"KVXFER_BOOTSTRAP_TIMEOUT_S": "5"}
    decode_model = _hybrid("swa", swa_layers=4)
    reports = run(
        tmp_path, _hybrid("swa"), (1, 1, 2), (1, 1, 1), requests=ROOMS[:1], env=env, decode_model=decode_model
    )
    dec = reports["decode pp0"]
    (reason,) = dec[ROOMS[0][0]]["reasons"]
    assert (
        "SWA state (KVArgs.state_types[0]='swa'): the prefill's 2 PP stages hold 1 + 2 = 3 entries, this decode's "
        "pool 4" in reason
    ), reason
    assert dec["pool_problems"] == [], dec["pool_problems"]
    _prefill_told(reports, reason)


def test_kv_checksum_is_verified_per_stage_and_a_corrupted_stage_fails_by_name(tmp_path):
    """--disaggregation-enable-kv-checksum: each stage's writers digest their layers' heads and
    the decode compares each stage's part; a byte of stage 1's layers flipped after landing
    fails that request naming the stage, the other requests succeed."""
    model = Model(total_kv_heads=4, num_layers=4, pool_tokens=192)
    reports = run(tmp_path, model, (2, 1, 2), (1, 1, 1), kv_checksum=True, corrupt_stage=1)
    dec = reports["decode pp0"]
    first, *rest = ROOMS
    (reason,) = dec[first[0]]["reasons"]
    assert dec[first[0]]["status"] == "Failed", dec[first[0]]
    assert "KV checksum mismatch (--disaggregation-enable-kv-checksum) in the PP stage 1 (layers [2, 4)): " in reason
    assert "written by prefill rank " in reason, reason
    for room, _ in rest:
        assert dec[room]["status"] == "Success", dec[room]
        assert dec[room]["verified"] == [2 * model.total_kv_heads], dec[room]  # every head of both stages
    assert dec["pool_problems"] == [], dec["pool_problems"]


def test_stages_whose_layers_do_not_tile_the_decode_fail_naming_the_ranges(tmp_path):
    model = Model(total_kv_heads=4, num_layers=4, pool_tokens=192)
    env = {"KVXFER_BOOTSTRAP_TIMEOUT_S": "5"}
    reports = run(tmp_path, model, (1, 1, 2), (1, 1, 1), requests=ROOMS[:1], env=env, prefill_layers=[(0, 2), (3, 4)])
    dec = reports["decode pp0"]
    assert dec["info"]["pp_layers"] == [[0, 2], [3, 4]]
    (reason,) = dec[ROOMS[0][0]]["reasons"]
    assert (
        "the prefill's 2 PP stages hold layers [0, 2), [3, 4) (3 layers in all), which do not tile this decode's "
        "4 layers [0, 4)" in reason
    ), reason
    assert dec["pool_problems"] == [], dec["pool_problems"]  # nothing landed
    _prefill_told(reports, reason)


def test_a_decode_pp_size_neither_1_nor_the_prefills_is_refused_by_sglangs_rule(tmp_path):
    model = Model(total_kv_heads=4, num_layers=6, pool_tokens=192)
    env = {"KVXFER_BOOTSTRAP_TIMEOUT_S": "5"}
    specs = pps.deployment(model, (1, 1, 2), (1, 1, 3), ROOMS[:1], str(tmp_path), free_port(), env=env)
    specs = [s for s in specs if s.name != "decode pp1" and s.name != "decode pp2"]  # one decode stage shows it
    reports = pps.run_pp(specs, 60.0)
    dec = reports["decode pp0"]
    (reason,) = dec[ROOMS[0][0]]["reasons"]
    assert "decode pp size (3) must be equal to the prefill pp size (2) or 1" in reason, reason
    assert "start the decode with --pp-size 2 or --pp-size 1" in reason, reason
    _prefill_told(reports, reason)


def test_a_dead_stage_rank_fails_the_request_within_the_heartbeat_bound(tmp_path):
    """Stage 1's process ends once the request is bootstrapped, before it sends: the decode's
    part for stage 1 fails on the missing heartbeats (every other deadline is far away), and
    the request fails naming the stage."""
    model = Model(total_kv_heads=4, num_layers=4, pool_tokens=192)
    far = {"KVXFER_WAITING_TIMEOUT_S": "120", "KVXFER_TRANSFER_TIMEOUT_S": "120"}
    reports = run(tmp_path, model, (1, 1, 2), (1, 1, 1), requests=ROOMS[:1], env=far, die_stage=1, timeout_s=40.0)
    assert reports["prefill pp1"] == {"died": ROOMS[0][0]}
    dec = reports["decode pp0"]
    (reason,) = dec[ROOMS[0][0]]["reasons"]
    assert dec[ROOMS[0][0]]["status"] == "Failed"
    assert reason.startswith("KVXferTransferError: PP stage 1 (layers [2, 4)): prefill rank 0 is gone: "), reason
    assert "KVXFER_HEARTBEAT_TIMEOUT_S=3.0" in reason, reason


@pytest.mark.parametrize(
    "prefill, decode, mla",
    [
        ((1, 1, 2), (1, 1, 1), False),  # the last stage's draft pool into the decode's only one
        ((2, 1, 2), (1, 1, 2), False),  # PP 2 x TP 2 -> PP 2: last stage to last stage, draft heads gathered
        ((1, 1, 3), (2, 1, 1), True),  # MLA model and MLA draft, PP 3 -> TP 2: the latent to both ranks
    ],
    ids=["pp2-to-tp1", "pp2xtp2-to-pp2", "mla-pp3-to-tp2"],
)
def test_the_last_stages_draft_model_kv_lands_beside_every_stages_layers(tmp_path, prefill, decode, mla):
    """Speculative decoding with --pp-size: SGLang runs the draft model on the last PP stage
    only, so that stage's KVArgs carry the draft pool; its ranks send it (registered with the
    draft's own layers) beside their layers, and the decode's draft pool (on its last stage)
    receives it from there. Every byte of both pools is compared; draft rows no request used
    stay untouched."""
    if mla:
        model = Model(mla=True, head_dim=24, num_layers=5, pool_tokens=192, draft=Draft(mla=True, head_dim=16))
    else:
        model = Model(total_kv_heads=4, num_layers=4, pool_tokens=192, draft=Draft(num_layers=2, total_kv_heads=2))
    reports = run(tmp_path, model, prefill, decode)
    _check_success(reports, model, prefill, decode)  # (the draft pool's bytes are among the problems checked)


def test_kv_checksum_covers_the_last_stages_draft_pool(tmp_path):
    """--disaggregation-enable-kv-checksum with a draft model and PP 2: the decode compares the
    digests of both stages' layers and of the last stage's draft pool, every head of each."""
    model = Model(total_kv_heads=4, num_layers=4, pool_tokens=192, draft=Draft(total_kv_heads=2))
    reports = run(tmp_path, model, (1, 1, 2), (1, 1, 1), kv_checksum=True)
    _check_success(reports, model, (1, 1, 2), (1, 1, 1))
    for room, _ in ROOMS:
        (parts,) = reports["decode pp0"][room]["parts"]
        assert parts.get("draft-model KV (speculative decoding)") == 2, parts  # the draft's two heads
        assert sum(parts.values()) == 2 * model.total_kv_heads + 2, parts  # and every head of both stages


def test_a_draft_pool_on_one_side_of_a_pp_deployment_fails_naming_both(tmp_path):
    """A PP prefill without a draft model and a decode with one: the request fails on the
    decode naming both sides' draft pools (and the prefill hears why)."""
    with_draft = Model(total_kv_heads=4, num_layers=4, pool_tokens=192, draft=Draft())
    reports = run(
        tmp_path,
        Model(total_kv_heads=4, num_layers=4, pool_tokens=192),
        (1, 1, 2),
        (1, 1, 1),
        requests=ROOMS[:1],
        decode_model=with_draft,
    )
    dec = reports["decode pp0"]
    assert dec[ROOMS[0][0]]["status"] == "Failed", dec
    (reason,) = set(dec[ROOMS[0][0]]["reasons"])
    assert "draft-model KV (speculative decoding): prefill=none (num_draft_entries=0) decode=" in reason, reason


def test_a_draft_pool_off_the_last_stage_and_a_bad_stage_are_refused_at_construction(monkeypatch):
    """A draft model's pool on a PP stage other than the last is refused naming the stage
    (SGLang runs the draft model on the last one); so is a KVArgs.pp_rank outside --pp-size
    and a prefill stage without its first layer."""
    from sglang_kvxfer.errors import KVXferError
    from tests.integrations import sglang_sides as sides
    from tests.integrations.sglang_env import Draft, load_utils_defs, rank_memory, server_args

    monkeypatch.setenv("SGLANG_HOST_IP", "127.0.0.1")
    monkeypatch.setenv("KVXFER_SGLANG_TRANSPORT", "local")
    from sglang_kvxfer.integrations import sglang as backend

    monkeypatch.setattr(backend, "_draft_model_kv", sides._draft_heads(Model(draft=Draft())))
    mode = load_utils_defs().DisaggregationMode.PREFILL
    sa = server_args(sides.MODEL_PATH, "prefill", 1, free_port(), pp_size=2, disable_overlap_schedule=True)
    mem = rank_memory(Model(draft=Draft()), 1, 0, "prefill")
    with pytest.raises(
        KVXferError,
        match=r"KVArgs of prefill PP stage 0 of --pp-size=2 carry a draft-model KV \(speculative decoding\) "
        r"\(num_draft_entries=2\): kvxfer moves it from and to the last PP stage \(1\)",
    ):
        backend.KVXferKVManager(mem.kv_args, mode, sa, False)
    mem = rank_memory(Model(), 1, 0, "prefill")
    mem.kv_args.pp_rank = 2
    with pytest.raises(KVXferError, match=r"KVArgs.pp_rank=2 must be an int in \[0, --pp-size=2\)"):
        backend.KVXferKVManager(mem.kv_args, mode, sa, False)
    mem.kv_args.pp_rank, mem.kv_args.prefill_start_layer = 1, None
    with pytest.raises(KVXferError, match=r"KVArgs.prefill_start_layer=None must be an int >= 0 \(PP stage 1\)"):
        backend.KVXferKVManager(mem.kv_args, mode, sa, False)


def test_a_whole_model_swa_pool_on_a_stage_is_cut_to_the_stages_layers_or_refused_naming_them(monkeypatch):
    """SGLang's SWAKVPool lists every layer of the model on each PP stage (prefill_start_layer
    0): the manager keeps the entries of its stage's layers only (model config: full layers 1
    and 3, SWA layers 0 and 2; stage 1 holds layers [2, 4)) and registers the stage's first
    layer. Pools that fit neither the model nor the stage, and a stage without a layer of a
    kind, are refused naming the counts and the layers."""
    from sglang_kvxfer.errors import KVXferError
    from tests.integrations import sglang_sides as sides
    from tests.integrations.sglang_env import load_utils_defs, rank_memory, server_args

    monkeypatch.setenv("SGLANG_HOST_IP", "127.0.0.1")
    monkeypatch.setenv("KVXFER_SGLANG_TRANSPORT", "local")
    from sglang_kvxfer.integrations import sglang as backend

    model = _hybrid("swa", swa_layers=2)
    model.num_layers = 2
    monkeypatch.setattr(backend, "_model_swa_kv_heads", lambda server_args: model.state.swa_heads)
    # stage 0's bootstrap-status inbox, as SGLang's PP group broadcast would hand it out (nobody listens)
    monkeypatch.setattr(
        backend, "_pp_exchange", lambda server_args, kv_args: lambda value: f"tcp://127.0.0.1:{free_port()}"
    )
    mode = load_utils_defs().DisaggregationMode.PREFILL
    sa = server_args(sides.MODEL_PATH, "prefill", 1, free_port(), pp_size=2, disable_overlap_schedule=True)

    def manager(stage: range, full: tuple, swa: tuple):
        monkeypatch.setattr(
            backend, "_model_swa_stage_layers", lambda server_args, pp_rank, pp_size: (stage, full, swa)
        )
        mem = rank_memory(model, 1, 0, "prefill")
        mem.kv_args.pp_rank, mem.kv_args.prefill_start_layer = 1, 0
        return mem.kv_args, backend.KVXferKVManager(mem.kv_args, mode, sa, False)

    args, mgr = manager(range(2, 4), (1, 3), (0, 2))
    try:
        kv, st = list(args.kv_data_ptrs), list(args.state_data_ptrs[0])
        assert mgr.layout.geometry.num_layers == 1 and mgr.layout.kv_ptrs == (kv[1], kv[3])  # K and V of layer 3
        (swa,) = mgr.layout.states
        assert swa.geometry.num_layers == 1 and swa.ptrs == (st[1], st[3])  # K and V of SWA layer 2
        assert mgr.config.layer_start == 2
    finally:
        mgr.close()
    with pytest.raises(KVXferError, match=r"its pools hold 2 full-attention and 2 SWA layers; the model has 3 and 2"):
        manager(range(2, 4), (1, 3, 5), (0, 2))
    with pytest.raises(KVXferError, match=r"PP stage layers \[3, 4\) hold 0 of its layers \[0, 2\]; a stage must hold"):
        manager(range(3, 4), (1, 3), (0, 2))
