"""Prefill attention CP (``--attn-cp-size``) through kvxfer, driven by the scripted scheduler
(``sglang_dp_sides``) in SGLang 0.5.23's call order. SGLang materializes a request's KV on
every CP rank; CP rank 0 of each attention-TP rank sends it, and the other CP ranks are
dummy participants (WaitingForInput at once, Success at their last chunk) whose polls join
the MIN. The replicas' pools hold a poison of their own here, so every byte of every decode
buffer matching the oracle of CP rank 0's KV shows that nothing came from a replica; the
decode sees a prefill of the attention-TP size (the replicas never register)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.integrations import sglang_dp_sides as dps
from tests.integrations import sglang_sides as sides
from tests.integrations.sglang_env import Model, import_sglang_base, load_utils_defs, rank_memory, server_args
from tests.ports import free_port

_base, _reason = import_sglang_base()
needs_sglang = pytest.mark.skipif(_base is None, reason=_reason)

R = dps.DpRequest
ROOMS = [R(0x0C90_0000_F00D, 37), R(0x0C90_0001_F00D, 9), R(0x0C91_0002_CAFE, 41)]


def run_cp(prefill: tuple, decode: tuple, model: Model, requests, timeout_s: float = 60.0):
    """``prefill``: ``(attn_tp, dp, cp)``; ``decode``: ``(attn_tp, dp)``."""
    port = free_port()
    env = {**sides.ENV, "KVXFER_SGLANG_TRANSPORT": "local"}
    (ptp, pdp, pcp), (dtp, ddp) = prefill, decode
    specs = [
        dps.DpSpec("prefill", model, ptp, pdp, port, requests, env, timeout_s, cp=pcp),
        dps.DpSpec("decode", model, dtp, ddp, port, requests, env, timeout_s),
    ]
    return sides.run_in_processes(dps.main, specs, timeout_s)


@needs_sglang
@pytest.mark.slow
@pytest.mark.parametrize(
    "prefill, decode, mla",
    [
        ((1, 1, 2), (1, 1), False),  # attn TP 1 x CP 2 -> TP 1
        ((2, 1, 2), (1, 1), False),  # attn TP 2 x CP 2 (--tp 4) -> TP 1: two writers, two replicas
        ((1, 2, 2), (2, 1), True),  # MLA (DeepSeek): DP 2 x CP 2 -> TP 2, the latent of the routed group
    ],
    ids=["tp1xcp2-to-tp1", "tp2xcp2-to-tp1", "mla-dp2xcp2-to-tp2"],
)
def test_cp_rank_0_sends_every_page_and_the_replicas_nothing(prefill, decode, mla):
    model = Model(mla=True, head_dim=24, pool_tokens=192) if mla else Model(total_kv_heads=4, pool_tokens=192)
    pre, dec = run_cp(prefill, decode, model, ROOMS)
    assert "error" not in pre and "error" not in dec, (pre.get("error"), dec.get("error"))
    assert dec["info"] == {"attn_tp_size": prefill[0], "dp_size": prefill[1]}  # replicas never registered
    for q in ROOMS:
        group = q.room % prefill[1]
        assert dec[q.room]["status"] == "Success", dec[q.room]
        assert dec[q.room]["problems"] == [], dec[q.room]["problems"]
        assert pre[(q.room, group)]["status"] == "Success", pre  # every CP rank's poll in the MIN
    assert dec["pool_problems"] == [], dec["pool_problems"]  # CP rank 0's bytes, every one


@needs_sglang
def test_a_cp_replica_sender_moves_nothing_and_follows_sglangs_dummy_states(monkeypatch):
    """In-process: a CP rank 1 manager has no engine and registers nothing; its sender is
    WaitingForInput at once, Success at its last chunk; a failure elsewhere (the MIN) makes
    failure_exception name another rank; an abort fails it."""
    from sglang_kvxfer.integrations import sglang as backend
    from sglang_kvxfer.integrations.sglang_requests import CPReplicaSender

    for name, value in sides.ENV.items():
        monkeypatch.setenv(name, value)
    model = Model(total_kv_heads=4)
    mem = rank_memory(model, 1, 0, "prefill")
    mem.kv_args.engine_rank = 1  # --tp 2 --attn-cp-size 2: attention-TP rank 0, CP rank 1
    sa = server_args("m", "prefill", 2, free_port(), attn_cp_size=2)
    mgr = backend.KVXferKVManager(mem.kv_args, load_utils_defs().DisaggregationMode.PREFILL, sa, False)
    try:
        assert (mgr.cp_rank, mgr.is_dummy_cp_rank, mgr.engine) == (1, True, None)
        mgr.register_to_bootstrap()  # nothing to wait for: no bootstrap is even running
        # as SGLang's prefill creates it (create_sender: keywords)
        tx = backend.KVXferKVSender(
            mgr=mgr, bootstrap_addr=f"{sa.host}:8998", bootstrap_room=77, req_has_disagg_prefill_dp_rank=False
        )
        assert isinstance(tx, CPReplicaSender)
        assert tx.poll() == dps.WAITING and tx.pop_decode_prefix_len() == 0
        tx.init(3, 0)
        tx.send(np.array([4, 5], dtype=np.int32))
        assert tx.poll() == dps.WAITING
        tx.send(np.array([6], dtype=np.int32), [])
        assert tx.poll() == dps.SUCCESS and tx.get_transfer_metric().transfer_total_bytes == 0

        over = backend.KVXferKVSender(mgr, sa.host, 78)
        over.init(1, 0)
        over.send(np.array([1, 2], dtype=np.int32))
        assert over.poll() == dps.FAILED
        with pytest.raises(backend.KVXferTransferError, match=r"pages \[0, 2\) run past num_kv_indices=1"):
            over.failure_exception()

        other = backend.KVXferKVSender(mgr, sa.host, 79)
        with pytest.raises(backend.KVXferTransferError, match="unknown reason from another rank"):
            other.failure_exception()  # the MIN was Failed: CP rank 0 failed it
        aborted = backend.KVXferKVSender(mgr, sa.host, 80)
        aborted.abort()
        assert aborted.poll() == dps.FAILED
    finally:
        mgr.close()
