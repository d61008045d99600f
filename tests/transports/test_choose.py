"""``--transport auto``: which built-in transport serves KV pools on which devices."""

from __future__ import annotations

import dataclasses

import pytest

from sglang_kvxfer.errors import TransportUnavailableError
from sglang_kvxfer.transports import check_serves_devices, choose_transport
from sglang_kvxfer.transports.tcp import TcpTransport


def test_auto_picks_local_on_one_host_and_tcp_across_hosts_for_any_pool_device():
    assert choose_transport(["cpu"], same_host=True) == "local"
    assert choose_transport(["cuda:0", "cuda:1"], same_host=True) == "local"
    assert choose_transport(["cpu", "cpu"], same_host=False) == "tcp"
    assert choose_transport(["cuda:0", "cuda:3"], same_host=False) == "tcp"  # GPU pools: bounce buffers


def test_auto_refuses_a_transport_that_cannot_move_the_pools_memory(monkeypatch):
    monkeypatch.setattr(TcpTransport, "caps", dataclasses.replace(TcpTransport.caps, mem_kinds=frozenset({"cpu"})))
    with pytest.raises(TransportUnavailableError, match="transport 'tcp' cannot move cuda memory \\(it moves cpu\\)"):
        choose_transport(["cpu", "cuda:1"], same_host=False)
    check_serves_devices("tcp", ["cpu"])
    check_serves_devices("nixl", ["cuda:0"])  # not built in: not imported, not judged here
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N', got 'xpu:0'"):
        choose_transport(["xpu:0"], same_host=True)
