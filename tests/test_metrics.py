"""metrics.py without processes: failure kinds, records, the decode-side window estimate,
and the refusals of the Prometheus endpoint."""

from __future__ import annotations

import sys

import pytest

from sglang_kvxfer.cluster.workload import busy_seconds, percentiles_ms
from sglang_kvxfer.metrics import (
    FAILURE_KINDS,
    SINCE_FIRST_BYTE,
    SINCE_LAST_CHUNK,
    RequestRecord,
    classify_failure,
    note_writer_done,
    serve_metrics,
)

# Reasons as the engine and the transports word them, and the kind each must count as.
REASONS = [
    ("timed out after 10.0 s in Transferring without progress", "timeout"),
    ("prefill rank 0 failed the request: timed out after 60.0 s in Bootstrapping", "timeout"),
    ("room 7: decode rank 1 returned no staging slot within 120.0 s", "timeout"),
    (
        "prefill rank 1 is gone: peer tcp://127.0.0.1:5 (session ab) sent nothing for 2.1 s "
        "(KVXFER_HEARTBEAT_TIMEOUT_S=2.0)",
        "peer_gone",
    ),
    ("peer 'f24d' (pid 123) has exited", "peer_gone"),
    (
        "prefill rank 0 refused this decode rank: incompatible KV geometry: head_dim: prefill=16 decode=8 "
        "(use the same model on both sides)",
        "geometry",
    ),
    ("decode rank 0 aborted the request: the rank server gave up after 60 s", "aborted"),
    ("aborted by the decode side", "aborted"),
    ("tcp: 127.0.0.1:4000 refused the write: entry 3 outside region 1", "transport"),
    ("scatter of tokens [0, 16) failed: bad page id", "transport"),
    ("decode ranks disagree on the request length: 10 vs 12 tokens", "other"),
    ("", "other"),
    (None, "other"),
]


@pytest.mark.parametrize("reason,kind", REASONS)
def test_failure_reasons_fall_into_a_fixed_set_of_kinds(reason, kind):
    assert classify_failure(reason) == kind
    assert kind in FAILURE_KINDS


def test_record_window_tail_and_round_trip():
    rec = RequestRecord(
        room=5,
        side="decode",
        tp_rank=1,
        ok=True,
        bytes=4096,
        ops=2,
        phases={"scatter": 0.25},
        first_byte_ready=10.0,
        last_chunk_ready=10.5,
        last_notice=11.5,
    )
    assert rec.transfer_s == pytest.approx(1.5)
    assert rec.tail_s == pytest.approx(1.0)
    assert rec.failure_kind == ""
    d = rec.to_dict()
    assert d["transfer_s"] == pytest.approx(1.5) and d["tail_s"] == pytest.approx(1.0)
    assert RequestRecord.from_dict(d) == rec
    unfinished = RequestRecord(room=5, side="prefill", tp_rank=0, ok=False, reason="aborted by the decode side")
    assert unfinished.transfer_s is None and unfinished.tail_s is None
    assert unfinished.failure_kind == "aborted"
    # the engine knows a local abort whatever its caller wrote as the reason
    told = RequestRecord(
        room=6, side="decode", tp_rank=0, ok=False, reason="the client went away", failure_kind="aborted"
    )
    assert told.failure_kind == "aborted"
    untold = RequestRecord(room=6, side="decode", tp_rank=0, ok=False, reason="the client went away")
    assert untold.failure_kind == "other"
    assert RequestRecord(room=6, side="decode", tp_rank=0, ok=True, failure_kind="aborted").failure_kind == ""


def test_decode_window_starts_at_the_earliest_writer_and_ages_are_not_phases():
    marks: dict = {}
    # writer A: first byte ready 3 s before its notice arrived at t=100
    phases = note_writer_done(marks, {"gather": 0.5, SINCE_FIRST_BYTE: 3.0, SINCE_LAST_CHUNK: 1.0}, arrived=100.0)
    assert phases == {"gather": 0.5}
    assert marks == {"first_byte_ready": 97.0, "last_chunk_ready": 99.0}
    # writer B started later (ready 2 s before t=101) but finished its last chunk later too
    note_writer_done(marks, {SINCE_FIRST_BYTE: 2.0, SINCE_LAST_CHUNK: 0.5}, arrived=101.0)
    assert marks == {"first_byte_ready": 97.0, "last_chunk_ready": 99.0}
    # writer C started earlier still
    note_writer_done(marks, {SINCE_FIRST_BYTE: 5.0, SINCE_LAST_CHUNK: 4.5}, arrived=101.0)
    assert marks == {"first_byte_ready": 96.0, "last_chunk_ready": 96.5}
    # an old peer that sends no ages leaves the window unknown rather than invented
    empty: dict = {}
    assert note_writer_done(empty, {"wire": 1.0}, arrived=5.0) == {"wire": 1.0} and empty == {}


def test_busy_time_is_the_union_of_windows():
    nan = float("nan")
    assert busy_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (nan, nan)]) == pytest.approx(3.0)
    assert busy_seconds([(1.0, 2.0), (0.0, 5.0)]) == pytest.approx(5.0)
    assert busy_seconds([]) == 0.0
    assert percentiles_ms([0.001, 0.002, nan]) == {"p50": 1.5, "p90": 1.9, "p99": 1.99}


class _FakeManager:
    """What MetricsServer reads from a manager (its refusals happen before any use)."""

    class side:
        value = "prefill"

    tp_rank = 0
    staging = None

    def __init__(self):
        self.request_listeners = []

    def num_inflight(self):
        return 0


@pytest.mark.parametrize("port", [-1, 70000, 1.5, True, "9000"])
def test_metrics_port_must_be_a_port(port):
    with pytest.raises(ValueError, match=r"metrics port=.* must be an integer in \[0, 65536\)"):
        serve_metrics(_FakeManager(), port)


def test_metrics_without_prometheus_client_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match=r"pip install 'sglang_kvxfer\[metrics\]'"):
        serve_metrics(_FakeManager(), 0)


def test_metrics_port_in_use_names_the_address():
    pytest.importorskip("prometheus_client")
    mgr = _FakeManager()
    with serve_metrics(mgr, 0) as first:
        with pytest.raises(OSError, match=rf"metrics endpoint cannot listen on 127.0.0.1:{first.port}"):
            serve_metrics(_FakeManager(), first.port)
    assert mgr.request_listeners == []  # close() detached it
