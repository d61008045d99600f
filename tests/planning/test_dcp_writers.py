"""Decode context parallel between equal DCP sizes relies on the MLA election: a prefill rank
``p`` holds the tokens ``t % N == p % N`` (N = ``--dcp-size``, which divides both attention TP
sizes), so every decode rank's writer, for every request, must be a prefill rank of its own
DCP rank. Checked over every TP pair up to 16 and every such N, and every salt's rotation."""

from __future__ import annotations

from sglang_kvxfer.planning import candidate_prefill_ranks, plan_tp


def test_every_mla_writer_is_a_prefill_rank_of_the_readers_dcp_rank():
    checked = 0
    for ptp in range(1, 17):
        for dtp in range(1, 17):
            for n in (k for k in range(2, 17) if ptp % k == 0 and dtp % k == 0):
                for d in range(dtp):
                    cands = candidate_prefill_ranks(1, ptp, dtp, d, mla=True)
                    assert cands and all(p % n == d % n for p in cands), (ptp, dtp, n, d, cands)
                for salt in range(4):
                    plan = plan_tp(1, ptp, dtp, mla=True, salt=salt)
                    for t in plan.transfers:
                        assert t.prefill_rank % n == t.decode_rank % n, (ptp, dtp, n, salt, t)
                        checked += 1
    assert checked > 1000
