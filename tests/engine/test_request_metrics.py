"""Per-request metrics from a real engine: the transfer window is bounded by the first byte
being ready and the last notice, both sides' records agree on bytes and ops, every
finished request reaches the listeners once, and the Prometheus endpoints answer real
scrapes (in-process, and from rank processes during a run)."""

from __future__ import annotations

import time
import urllib.request

import pytest

from sglang_kvxfer.cluster.group import make_spec, open_groups
from sglang_kvxfer.cluster.workload import make_requests, run_workload
from sglang_kvxfer.engine import BootstrapServer, KVPoll, KVReceiver, KVSender
from sglang_kvxfer.engine.synthetic import fill_request
from tests.ports import free_port

from .harness import FAST, Cluster, geometry, wait_terminal


def eventually(check, timeout_s=10.0, what="condition"):
    """Poll ``check`` until it returns a truthy value; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what} not reached within {timeout_s} s")


@pytest.mark.parametrize("p,d", [(2, 1), (1, 2)])
def test_window_runs_from_first_byte_ready_to_last_notice_and_covers_every_chunk(p, d):
    g = geometry(8, page_size=4, num_pages=64)
    room, tokens, chunk = 31, 48, 16
    with Cluster(p, d, g, decode_opts={"data_path": "staged"}) as c:  # staged phases (local would fuse)
        src, dst = c.pages(c.pre[0], tokens), c.pages(c.dec[0], tokens)
        for m in c.pre:
            fill_request(m.placement, m.pool.buffers, room, src, 0, tokens)
        rxs = [KVReceiver(m, room) for m in c.dec]
        for rx in rxs:
            rx.send_metadata(dst, num_tokens=tokens)
        txs = [KVSender(m, room) for m in c.pre]
        time.sleep(0.2)  # decode waits for the prefill's compute: not transfer time (SGLang #23937)
        t_first = time.monotonic()
        for i, a in enumerate(range(0, tokens, chunk)):
            if i:
                time.sleep(0.2)  # the next chunk's prefill compute: inside the window
            for tx in txs:
                tx.send(src[a // 4 : (a + chunk) // 4], last_chunk=a + chunk >= tokens)
        assert wait_terminal(txs + rxs) == [KVPoll.Success] * (p + d)
        assert c.verify(room, dst, tokens) == []
        pre, dec = [tx.record for tx in txs], [rx.record for rx in rxs]

    for r in pre:
        assert r.ok and r.side == "prefill"
        assert t_first <= r.first_byte_ready <= r.last_chunk_ready <= r.last_notice
    first_ready = min(r.first_byte_ready for r in pre)
    for r in dec:
        assert r.ok and r.side == "decode"
        # no time before the first byte was ready, none after the last notice
        assert r.first_byte_ready >= first_ready
        assert r.transfer_s == pytest.approx(r.last_notice - r.first_byte_ready)
        assert r.last_notice >= max(x.last_notice for x in pre)
        # every chunk is inside, not only the last one (SGLang #31993)
        assert r.first_byte_ready < min(x.last_chunk_ready for x in pre)
        assert 0 < r.tail_s < r.transfer_s
        assert r.phases["scatter"] > 0 and r.phases["gather"] > 0  # staged: TP differs on NHD pools
    row = 2 * (16 + 8) * 2  # layers x (K dim + V dim) x bf16, per head and token
    assert sum(r.bytes for r in dec) == sum(r.bytes for r in pre) == tokens * max(8, d) * row
    assert sum(r.ops for r in dec) == sum(r.ops for r in pre) > 0


def test_each_finished_request_reaches_the_listeners_once_with_its_failure_kind():
    seen: dict[str, list] = {"prefill": [], "decode": []}

    def broken(record):
        raise RuntimeError("a listener bug must not reach the data path")

    with Cluster(1, 1, geometry(8, page_size=4)) as c:
        for m, side in ((c.pre[0], "prefill"), (c.dec[0], "decode")):
            m.request_listeners += [broken, seen[side].append]
        txs, rxs, dst = c.start(41, 20, chunk=8)
        assert wait_terminal(txs + rxs) == [KVPoll.Success] * 2
        assert c.verify(41, dst, 20) == []
        rx = KVReceiver(c.dec[0], 42)
        rx.send_metadata(c.pages(c.dec[0], 8), num_tokens=8)
        tx = KVSender(c.pre[0], 42)
        rx.abort("the client went away")
        assert wait_terminal([tx, rx]) == [KVPoll.Failed] * 2
        eventually(lambda: len(seen["prefill"]) == 2 and len(seen["decode"]) == 2, what="two records per side")
    for side, records in seen.items():
        good, bad = sorted(records, key=lambda r: r.room)
        assert (good.room, good.ok, good.side, bad.room, bad.ok) == (41, True, side, 42, False)
        assert bad.failure_kind == "aborted", bad.reason
        assert "the client went away" in bad.reason
        assert good.bytes == 20 * 8 * 2 * (16 + 8) * 2 and good.transfer_s > 0


def scrape(port: int) -> dict[str, float]:
    """Samples of one endpoint: ``name`` or ``name{value of reason/phase}`` -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            extra = s.labels.get("reason") or s.labels.get("phase")
            if "le" not in s.labels:
                out[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    return out


def test_prometheus_endpoint_in_process_counts_in_flight_done_and_failed():
    pytest.importorskip("prometheus_client")
    from sglang_kvxfer.metrics import serve_metrics

    g = geometry(8, page_size=4)
    with Cluster(1, 1, g) as c, serve_metrics(c.pre[0], 0) as mp, serve_metrics(c.dec[0], 0) as md:
        rx = KVReceiver(c.dec[0], 51)
        dst = c.pages(c.dec[0], 24)
        rx.send_metadata(dst, num_tokens=24)
        before = scrape(md.port)
        assert before["kvxfer_requests_in_flight"] == 1
        assert before["kvxfer_transfer_seconds_count"] == 0
        assert before["kvxfer_staging_bytes_capacity"] == FAST["staging_bytes"]
        src = c.pages(c.pre[0], 24)
        fill_request(c.pre[0].placement, c.pre[0].pool.buffers, 51, src, 0, 24)
        tx = KVSender(c.pre[0], 51)
        tx.send(src, last_chunk=True)
        assert wait_terminal([tx, rx]) == [KVPoll.Success] * 2
        assert c.verify(51, dst, 24) == []
        after = eventually(
            lambda: (s := scrape(md.port))["kvxfer_transfer_seconds_count"] == 1 and s, what="the decode histogram"
        )
        assert after["kvxfer_requests_in_flight"] == 0
        assert after["kvxfer_transfer_bytes_sum"] == rx.record.bytes == 24 * 8 * 2 * (16 + 8) * 2
        assert after["kvxfer_transfer_ops_total"] == rx.record.ops == tx.ops
        assert after["kvxfer_transfer_seconds_sum"] == pytest.approx(rx.record.transfer_s)
        assert after["kvxfer_staging_bytes_in_use"] == 0
        assert eventually(lambda: scrape(mp.port)["kvxfer_transfer_bytes_sum"] == tx.bytes_sent)

        rx2 = KVReceiver(c.dec[0], 52)
        rx2.send_metadata(c.pages(c.dec[0], 8), num_tokens=8)
        tx2 = KVSender(c.pre[0], 52)
        rx2.abort("the client went away")
        assert wait_terminal([tx2, rx2]) == [KVPoll.Failed] * 2
        for port in (md.port, mp.port):
            failed = eventually(
                lambda port=port: (s := scrape(port))["kvxfer_transfer_failures_total{aborted}"] == 1 and s,
                what="the aborted counter",
            )
            assert failed["kvxfer_transfer_failures_total{timeout}"] == 0
            assert failed["kvxfer_requests_in_flight"] == 0


def test_rank_processes_serve_metrics_that_a_scrape_reads_during_a_run():
    pytest.importorskip("prometheus_client")
    g = geometry(8, page_size=4, num_pages=96)
    # staged: the decode's scatter phase is one of the metrics checked (auto writes these rows)
    opts = {k: v for k, v in FAST.items() if k != "num_workers"} | {"data_path": "staged"}
    base = free_port(span=3)
    with BootstrapServer() as boot:
        pre, dec = open_groups(
            make_spec("prefill", g, 2, boot.address, "tcp", options=opts, metrics_port=base),
            make_spec("decode", g, 1, boot.address, "tcp", options=opts, metrics_port=base + 2),
            one_process=True,
        )
        with pre, dec:
            assert pre.metrics_ports == [base, base + 1] and dec.metrics_ports == [base + 2]
            (slow,) = make_requests(1, [64], 16, 4, seed=5, chunk_delay_s=0.5)  # 4 chunks, ~1.5 s in flight
            fut_p, fut_d = pre.submit(slow), dec.submit(slow)
            eventually(lambda: scrape(base + 2)["kvxfer_requests_in_flight"] == 1, what="a request in flight")
            assert fut_d.result(30)[0]["ok"] and all(r["ok"] for r in fut_p.result(30))
            results, _ = run_workload(pre, dec, make_requests(3, [37, 64, 9], 8, 4, seed=6), 2, 60, progress=False)
            assert all(r.ok and r.verified for r in results), [r.reason for r in results]
            decoded = eventually(
                lambda: (s := scrape(base + 2))["kvxfer_transfer_seconds_count"] == 4 and s,
                what="four requests on the decode rank",
            )
            received = sum(r.bytes for r in results) + fut_d.result(1)[0]["bytes"]
            assert decoded["kvxfer_transfer_bytes_sum"] == received
            assert decoded["kvxfer_requests_in_flight"] == 0
            assert sum(v for k, v in decoded.items() if k.startswith("kvxfer_transfer_failures_total")) == 0
            assert decoded["kvxfer_transfer_phase_seconds_total{scatter}"] > 0
            sent = [
                eventually(
                    lambda port=port: (s := scrape(port))["kvxfer_transfer_seconds_count"] == 4 and s,
                    what="four requests on a prefill rank",
                )
                for port in (base, base + 1)
            ]
            assert sum(s["kvxfer_transfer_bytes_sum"] for s in sent) == received
            ops = sum(r.ops for r in results) + sum(r["ops"] for r in fut_p.result(1))
            assert sum(s["kvxfer_transfer_ops_total"] for s in sent) == ops
