"""A decode rank that holds every n-th token (decode context parallel, ``token_stride``):
real managers move an MLA request and every byte of every decode pool is compared with the
oracle of what that rank must hold (token ``j * stride + phase`` at its ``j``-th row)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_kvxfer.engine import KVPoll, KVReceiver, KVSender
from tests.engine.harness import Cluster, geometry, wait_terminal


def _mla(page_size, num_pages=48):
    return geometry(h=1, mla=True, page_size=page_size, num_pages=num_pages, num_layers=3)


def _fill_latent(cluster, seed):
    """The same random latent on every prefill rank (MLA is replicated over TP)."""
    gen = torch.Generator().manual_seed(seed)
    ref = [
        torch.randint(-(2**15), 2**15, b.shape, generator=gen, dtype=torch.int16) for b in cluster.pre[0].pool.buffers
    ]
    for m in cluster.pre:
        for buf, r in zip(m.pool.buffers, ref):
            buf.view(torch.int16).copy_(r)
    return ref


def _run(cluster, room, stride, virtual_pages, chunk_pages, seed=0):
    """One request of ``virtual_pages`` decode pages (each ``page_size * stride`` tokens of the
    request, of which a rank holds ``page_size``): send it in chunks of ``chunk_pages`` prefill
    pages and return (prefill pages, each decode rank's pages, receivers)."""
    ref = _fill_latent(cluster, seed)
    ps = cluster.pre[0].config.geometry.page_size
    tokens = virtual_pages * ps * stride
    rng = np.random.default_rng(seed)
    src = rng.permutation(cluster.pre[0].config.geometry.num_pages)[: tokens // ps]
    dst = [rng.permutation(m.config.geometry.num_pages)[:virtual_pages] for m in cluster.dec]
    rxs = [KVReceiver(m, room) for m in cluster.dec]
    for r, (rx, pages) in enumerate(zip(rxs, dst)):
        rx.send_metadata(pages, num_tokens=tokens, token_stride=stride, token_phase=r % stride)
    for m in cluster.pre:
        tx = KVSender(m, room)
        for a in range(0, len(src), chunk_pages):
            last = a + chunk_pages >= len(src)
            tx.send(src[a : a + chunk_pages], last_chunk=last, aux=b"aux" if last else b"")
    return ref, src, dst, rxs, tokens


def _check(cluster, ref, src, dst, stride, tokens):
    ps = cluster.pre[0].config.geometry.page_size
    for r, (m, pages) in enumerate(zip(cluster.dec, dst)):
        phase = r % stride
        own = np.arange(phase, tokens, stride)
        src_rows = src[own // ps] * ps + own % ps
        j = np.arange(len(own))
        dst_rows = pages[j // ps] * ps + j % ps
        others = np.setdiff1d(np.arange(m.config.geometry.num_pages * ps), dst_rows)
        for layer, (buf, want) in enumerate(zip(m.pool.buffers, ref)):
            got = buf.view(torch.int16)
            assert torch.equal(got[torch.from_numpy(dst_rows)], want[torch.from_numpy(src_rows)]), (
                f"decode rank {r} (phase {phase} of {stride}) layer {layer}"
            )
            assert not got[torch.from_numpy(others)].any(), f"decode rank {r} wrote rows it does not own"


@pytest.mark.parametrize(
    "p, d, stride, ps, chunk_pages, transport",
    [
        (1, 2, 2, 4, 3, "local"),  # chunks end inside a decode page
        (2, 2, 2, 1, 5, "tcp"),
        (1, 4, 4, 2, 100, "tcp"),  # one chunk
        (2, 4, 2, 4, 1, "local"),  # DCP 2 inside decode TP 4: ranks r and r + 2 share a phase
        (1, 3, 3, 1, 2, "local"),
    ],
)
def test_each_dcp_rank_receives_its_tokens_packed_into_its_pages(p, d, stride, ps, chunk_pages, transport):
    with Cluster(p, d, _mla(ps), transport=transport) as cluster:
        ref, src, dst, rxs, tokens = _run(cluster, 7, stride, virtual_pages=5, chunk_pages=chunk_pages)
        assert wait_terminal(rxs) == [KVPoll.Success] * d
        _check(cluster, ref, src, dst, stride, tokens)


@pytest.mark.parametrize("path", ["staged", "direct"])
def test_dcp_reader_over_each_data_path(path):
    opts = {"data_path": path}
    with Cluster(1, 2, _mla(2), transport="tcp", prefill_opts=opts, decode_opts=opts) as cluster:
        ref, src, dst, rxs, tokens = _run(cluster, 11, 2, virtual_pages=6, chunk_pages=4, seed=3)
        assert wait_terminal(rxs) == [KVPoll.Success] * 2
        _check(cluster, ref, src, dst, 2, tokens)
        assert {why[0] for rx in rxs for why in rx.paths.values()} == {path}


def test_a_dcp_reader_whose_pages_cannot_hold_its_share_is_refused():
    with Cluster(1, 2, _mla(2)) as cluster:
        rx = KVReceiver(cluster.dec[0], 3)
        with pytest.raises(
            ValueError, match=r"num_tokens=16 \(8 of 16 at token_stride 2, token_phase 0\) does not fit 3"
        ):
            rx.send_metadata(np.arange(3), num_tokens=16, token_stride=2, token_phase=0)
        with pytest.raises(ValueError, match="token_phase=2 must be below token_stride=2"):
            rx.send_metadata(np.arange(4), num_tokens=16, token_stride=2, token_phase=2)
        with pytest.raises(ValueError, match="needs num_tokens"):
            rx.send_metadata(np.arange(4), token_stride=2, token_phase=1)


def test_decode_ranks_of_one_request_must_agree_on_its_length():
    """Every DCP rank sends the whole request's length: a rank that sent its own share
    instead fails the request on the prefill, naming both lengths."""
    with Cluster(1, 2, _mla(1)) as cluster:
        rxs = [KVReceiver(m, 5) for m in cluster.dec]
        rxs[0].send_metadata(np.arange(4), num_tokens=8, token_stride=2, token_phase=0)
        rxs[1].send_metadata(np.arange(3), num_tokens=6, token_stride=2, token_phase=1)
        tx = KVSender(cluster.pre[0], 5)
        states = wait_terminal(rxs + [tx])
        assert KVPoll.Failed in states
        reasons = " ".join(h.failure_reason or "" for h in rxs + [tx])
        assert "decode ranks disagree on the request length: 6 vs 8 tokens" in reasons or (
            "decode ranks disagree on the request length: 8 vs 6 tokens" in reasons
        ), reasons
