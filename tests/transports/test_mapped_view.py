"""The mapped-view capability (``Transport.mapped_device`` / ``remote_view``), per contract
case: ``local`` maps a peer's shared memory here (``cpu``) and a view writes the peer's
bytes in place; private memory (``process_vm_writev``), ``tcp``, ``nixl`` and ``mori`` map
nothing (the default: ``None``, and ``remote_view`` yields ``None``). A view of a peer that
exits while it is held fails when its block ends; a view of a peer already gone is refused."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_kvxfer.errors import PeerGoneError
from sglang_kvxfer.transports.base import RemoteRegion

from .conftest import CASES, Writer


def _mapped_here(case: str) -> bool:
    name, _, memory = CASES[case]
    return name == "local" and memory == "shm"


def test_mapped_device_says_where_remote_view_writes(case, writer, peer):
    import torch

    t, remote = writer.transport, writer.remote
    want = "cpu" if _mapped_here(case) else None
    assert t.mapped_device(remote) == want
    before = peer.read().copy()
    with t.remote_view(remote, 4096, 512) as view:
        if want is None:
            assert view is None  # the bytes go through write()
            return
        assert view.device == torch.device(want) and view.numel() == 512
        view.copy_(torch.arange(512, dtype=torch.int64).remainder(253).to(torch.uint8))
    after = peer.read()
    expected = before.copy()
    expected[4096 : 4096 + 512] = (np.arange(512) % 253).astype(np.uint8)
    assert np.array_equal(after, expected)  # those bytes, and nothing else


def test_mapped_device_refuses_what_is_not_an_imported_region(case, writer):
    t = writer.transport
    with pytest.raises(TypeError, match="remote must be a RemoteRegion, got str"):
        t.mapped_device("region")  # type: ignore[arg-type]
    if CASES[case][0] == "local":
        stranger = RemoteRegion("peer", 999, 64, "cpu")
        with pytest.raises(ValueError, match=r"remote region 999 of peer 'peer' is not imported"):
            t.mapped_device(stranger)


def test_a_view_of_a_peer_that_exits_meanwhile_fails_when_its_block_ends(case, fresh_peer):
    if not _mapped_here(case):
        pytest.skip(f"{case} hands out no view")
    w = Writer(case, fresh_peer)
    try:
        pid = fresh_peer.pid
        with pytest.raises(PeerGoneError, match=rf"peer 'peer' \(pid {pid}\) has exited while its memory was written"):
            with w.transport.remote_view(w.remote, 0, 64) as view:
                view.fill_(1)
                fresh_peer.kill()  # and reaped: the transport's pidfd of it is readable now
        with pytest.raises(PeerGoneError, match=rf"peer 'peer' \(pid {pid}\) has exited"):
            with w.transport.remote_view(w.remote, 0, 64):
                pass  # refused before the block runs
        assert w.transport.mapped_device(w.remote) == "cpu"  # still imported: the mapping is this process's
    finally:
        w.close()
