"""KV checksums per writer (``integrations/sglang_checksum``): digests keyed by global head
agree wherever a head lives (any TP, any page ids), see a single flipped byte, travel in
front of the aux payload; and SGLang's CUDA-only digest stands aside on CPU pools."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.integrations import sglang_checksum as checksum
from tests.integrations.sglang_env import import_sglang_base

GEO = KVGeometry(num_layers=2, total_kv_heads=4, head_dim=8, v_head_dim=4, dtype="bfloat16", page_size=4, num_pages=6)


def pool(place, seed: int) -> list[np.ndarray]:
    """A rank's NHD buffers (K of every layer, then V) filled with noise."""
    rng = np.random.default_rng(seed)
    return [
        rng.integers(0, 256, size=place.buffer_nbytes(b), dtype=np.uint8).reshape(
            place.buffer_shape(b)[0], place.buffer_shape(b)[1], -1
        )
        for b in range(GEO.num_buffers)
    ]


def copy_heads(src_place, src, src_pages, dst_place, dst, dst_pages) -> None:
    """What a transfer does: the heads both ranks hold, row by row, into other page ids."""
    ps = GEO.page_size
    for h in set(src_place.heads) & set(dst_place.heads):
        i, j = src_place.heads.index(h), dst_place.heads.index(h)
        for s, d in zip(src_pages, dst_pages):
            for b in range(GEO.num_buffers):
                dst[b][d * ps : (d + 1) * ps, j] = src[b][s * ps : (s + 1) * ps, i]


def ptrs(bufs) -> list[int]:
    return [b.ctypes.data for b in bufs]


def test_a_head_digests_the_same_on_any_rank_at_any_pages_and_sees_one_byte():
    p, d = GEO.placement(1, 0), GEO.placement(2, 1)  # prefill TP 1 (heads 0-3) -> decode rank 1 of 2 (2, 3)
    src, dst = pool(p, 1), pool(d, 2)
    src_pages, dst_pages = [4, 1, 2], [0, 5, 3]
    copy_heads(p, src, src_pages, d, dst, dst_pages)
    theirs = checksum.head_digests(p, ptrs(src), src_pages)
    mine = checksum.head_digests(d, ptrs(dst), dst_pages)
    assert sorted(theirs) == [0, 1, 2, 3] and sorted(mine) == [2, 3]
    assert checksum.mismatches({0: theirs}, mine) == []
    dst[GEO.num_layers][dst_pages[2] * GEO.page_size + 3, 1, 7] ^= 1  # V of layer 0, last row, head 3
    bad = checksum.mismatches({0: theirs}, checksum.head_digests(d, ptrs(dst), dst_pages))
    assert [(rank, head) for rank, head, _, _ in bad] == [(0, 3)] and bad[0][2] == theirs[3] != bad[0][3]
    assert checksum.mismatches({0: None}, {}) == []  # a writer that sent no digests is not compared


def test_head_digests_refuse_what_they_cannot_read():
    p = GEO.placement(1, 0)
    bufs = pool(p, 3)
    with pytest.raises(ValueError, match=r"3 buffer addresses for a geometry of 4 buffers"):
        checksum.head_digests(p, ptrs(bufs)[:3], [0])
    with pytest.raises(ValueError, match=r"page ids must lie in \[0, 6\), got 0..6"):
        checksum.head_digests(p, ptrs(bufs), [0, 6])
    hnd = KVGeometry(num_layers=1, total_kv_heads=1, head_dim=8, layout="HND")
    with pytest.raises(ValueError, match="KV checksums read NHD pools; this pool is HND"):
        checksum.head_digests(hnd.placement(1, 0), [1, 2], [0])


def test_token_digests_of_each_phase_match_a_dcp_rank_holding_every_nth_token():
    """A writer digests a request's first 21 tokens (its pages of 4) per phase of stride 3; a
    DCP rank of phase f holding tokens f, f + 3, ... one after another in its own pages digests
    the same, and sees one flipped byte."""
    p = GEO.placement(1, 0)
    src = pool(p, 4)
    src_pages, tokens, stride, ps = [5, 0, 3, 1, 2, 4], 21, 3, GEO.page_size
    theirs = checksum.token_digests(p, ptrs(src), src_pages, tokens, stride)
    assert (theirs.tokens, theirs.stride, len(theirs.crcs)) == (21, 3, 3 * 4)
    for phase in range(stride):
        dst, dst_pages = pool(p, 10 + phase), [4, 2]  # 7 tokens of this phase: two pages
        for i, t in enumerate(range(phase, tokens, stride)):
            s_row, d_row = src_pages[t // ps] * ps + t % ps, dst_pages[i // ps] * ps + i % ps
            for b in range(GEO.num_buffers):
                dst[b][d_row] = src[b][s_row]
        mine = checksum.phase_digests(p, ptrs(dst), dst_pages, theirs, phase)
        assert checksum.mismatches({0: theirs.of_phase(phase)}, mine) == []
        other = checksum.phase_digests(p, ptrs(dst), dst_pages, theirs, (phase + 1) % stride)
        assert checksum.mismatches({0: theirs.of_phase((phase + 1) % stride)}, other) != []  # the control
        dst[0][dst_pages[1] * ps + 2, 0, 0] ^= 1  # this phase's 7th token, head 0, layer 0's K
        bad = checksum.mismatches(
            {0: theirs.of_phase(phase)}, checksum.phase_digests(p, ptrs(dst), dst_pages, theirs, phase)
        )
        assert [head for _, head, _, _ in bad] == [0]
    with pytest.raises(ValueError, match=r"token 24 lies past the 6 page\(s\) of 4 tokens given"):
        checksum.token_digests(p, ptrs(src), src_pages, 25, 2)


def test_digests_ride_in_front_of_the_aux_payload():
    aux = b"KVXA" + bytes(range(20))
    digests = {3: 0xDEADBEEF, 0: 1}
    assert checksum.detach(checksum.attach(aux, digests)) == (digests, aux)
    assert checksum.detach(checksum.attach(b"", {})) == ({}, b"")
    assert checksum.detach(aux) == (None, aux) and checksum.detach(b"") == (None, b"")
    with pytest.raises(ValueError, match=r"version 2 with 1 digests in 16 bytes \(expected version 1 or 2"):
        checksum.detach(b"KVXD\x02\x00\x01\x00" + bytes(8))
    with pytest.raises(ValueError, match=r"version 3 with 0 digests in 8 bytes \(expected version 1 or 2"):
        checksum.detach(b"KVXD\x03\x00\x00\x00")
    tokens = checksum.TokenDigests(37, 2, {(0, 0): 5, (1, 0): 0xFFFFFFFF})
    assert checksum.detach(checksum.attach_tokens(aux, tokens)) == (tokens, aux)
    assert tokens.of_phase(1) == {0: 0xFFFFFFFF}
    with pytest.raises(ValueError, match="version 1 with 2 digests in 16 bytes"):
        checksum.detach(checksum.attach(b"", {1: 2})[:6] + b"\x02\x00" + bytes(8))


_base, _reason = import_sglang_base()


@pytest.mark.skipif(_base is None, reason=_reason)
def test_sglangs_cuda_digest_stands_aside_for_cpu_index_tensors(monkeypatch):
    from sglang_kvxfer.integrations import sglang as backend

    class KvChecksumComputer:  # SGLang 0.5.23's compute() asserts CUDA index tensors
        def compute(self, kv_page_indices_gpu, state_indices_gpu=None):
            assert kv_page_indices_gpu.is_cuda
            return 0x1234

    module = types.ModuleType("sglang.srt.disaggregation.checksum")
    module.KvChecksumComputer = KvChecksumComputer
    monkeypatch.setitem(sys.modules, module.__name__, module)
    backend._defer_sglang_cpu_checksum()
    backend._defer_sglang_cpu_checksum()  # once
    assert KvChecksumComputer.compute.__kvxfer_original__.__name__ == "compute"
    computer = KvChecksumComputer()
    assert computer.compute(types.SimpleNamespace(is_cuda=False)) == 0  # "no digest": SGLang's decode skips it
    assert computer.compute(types.SimpleNamespace(is_cuda=True)) == 0x1234  # CUDA: SGLang's own digest


@pytest.mark.skipif(_base is None, reason=_reason)
def test_a_dcp_rank_refuses_token_digests_its_writers_disagree_on_or_of_another_stride():
    """The decode side's reading of token digests: each writer's digests of this rank's phase
    against its own rows; writers that digested other token counts or strides, or a stride
    that is neither 1 nor this rank's --dcp-size, are refused naming both."""
    from sglang_kvxfer.integrations.sglang_requests import KVXferKVReceiver

    p = GEO.placement(1, 0)
    src = pool(p, 5)
    pages = [1, 2, 3]
    rx = types.SimpleNamespace(kv_mgr=types.SimpleNamespace(dcp_rank=1, dcp_size=2), _prefix=0)
    theirs = checksum.token_digests(p, ptrs(src), pages, 12, 2)
    writers, mine = KVXferKVReceiver._token_digests(rx, "", {0: theirs}, p, ptrs(src), pages)
    assert writers == {0: theirs.of_phase(1)} and set(mine) == {0, 1, 2, 3}
    other = checksum.token_digests(p, ptrs(src), pages, 8, 2)
    with pytest.raises(ValueError, match=r"prefill rank 1 digested 8 tokens with stride 2 of the draft, another of "):
        KVXferKVReceiver._token_digests(rx, "draft", {0: theirs, 1: other}, p, ptrs(src), pages)
    with pytest.raises(ValueError, match=r"prefill rank 1 digested whole pages, another of its writers 12 tokens"):
        KVXferKVReceiver._token_digests(rx, "", {0: theirs, 1: {0: 1}}, p, ptrs(src), pages)
    stride3 = checksum.token_digests(p, ptrs(src), pages, 12, 3)
    with pytest.raises(ValueError, match=r"digested token stride 3, this decode rank holds every 2-th token"):
        KVXferKVReceiver._token_digests(rx, "", {0: stride3}, p, ptrs(src), pages)
