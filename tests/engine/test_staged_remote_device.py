"""Staged transfers when the transport maps the reader's slot on another device than the
prefill KV pool (``local`` over CUDA IPC with prefill on cuda:0 and decode on cuda:1): the
gather must not target that view; the slot goes through local staging and ``write()``.
A wrapped ``local`` transport stands in for the second GPU: its views are ``meta`` tensors."""

from __future__ import annotations

import contextlib

import pytest
import torch

from sglang_kvxfer.engine import KVPoll

from .harness import Cluster, geometry, wait_terminal


def _wrap(transport, monkeypatch, foreign_views: bool) -> list[int]:
    """Count ``write`` calls on ``transport``; with ``foreign_views``, every mapped view it
    hands out reports the ``meta`` device."""
    writes: list[int] = []
    write = transport.write

    def counting_write(*args, **kwargs):
        writes.append(1)
        return write(*args, **kwargs)

    @contextlib.contextmanager
    def foreign_view(remote, offset, nbytes):
        yield torch.empty(nbytes, dtype=torch.uint8, device="meta")

    monkeypatch.setattr(transport, "write", counting_write)
    if foreign_views:
        monkeypatch.setattr(transport, "_remote_view", foreign_view)
    return writes


@pytest.mark.parametrize("foreign_views", [True, False], ids=["other-device", "same-device"])
def test_staged_slots_on_another_device_go_through_write(monkeypatch, foreign_views):
    # 8 heads over prefill TP 2 and decode TP 1: each prefill rank gathers a strided head slice
    g = geometry(8, page_size=4)
    # staged forced: over shared memory auto would fuse (one pool -> pool copy, no slots)
    with Cluster(2, 1, g, transport="local", decode_opts={"data_path": "staged"}) as c:
        writes = [_wrap(m.transport, monkeypatch, foreign_views) for m in c.pre]
        tokens = 37
        txs, rxs, dst = c.start(31, tokens, chunk=8)
        assert wait_terminal(txs + rxs) == [KVPoll.Success] * 3, [x.failure_reason for x in txs + rxs]
        assert c.verify(31, dst, tokens) == []
        assert all(tx.paths == {"staged": 1} for tx in txs), [tx.paths for tx in txs]
        if foreign_views:
            assert all(len(w) >= 1 for w in writes), writes  # every slot: local staging + write()
        else:
            assert all(len(w) == 0 for w in writes), writes  # shared memory on cpu: in place
