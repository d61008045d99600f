"""Per-request transfer metrics: the record, the window rule, failure kinds, Prometheus.

Owns ``RequestRecord`` (one request on one rank: bytes, ops, phase busy times and the
timestamps that bound its transfer window), ``classify_failure`` (a failure reason -> one
of a few fixed kinds, so metric labels stay bounded) and ``MetricsServer`` /
``serve_metrics`` (a Prometheus endpoint for one rank). The engine fills the records
(``engine/prefill.py``, ``engine/decode.py``); this module must not import the engine,
torch or zmq, and imports ``prometheus_client`` only when a server is started.

**The transfer window.** A request's transfer time is ``last_notice - first_byte_ready``:

* ``first_byte_ready``: the first moment the prefill could move a byte of the request:
  its first chunk had been handed to the sender *and* every decode reader's destination
  pages were known (the later of the two). Queueing inside the engine after that counts;
  prefill compute before it, and decode-side waiting for the prefill, do not (SGLang
  #23937 counted decode time).
* ``last_notice``: prefill: when it began sending its ``TransferDone``s; decode: when the
  decode rank had processed the last writer's ``TransferDone`` and declared Success (every
  staged chunk is scattered before that: they run in order on the room's worker).

The window covers every byte of the request, not only the last chunk (SGLang #31993
divided the whole request's bytes by the last chunk's latency). The decode rank cannot
read the prefill's clock, so each ``TransferDone`` carries ``since_first_byte`` (seconds
from the writer's ``first_byte_ready`` to sending it) and the decode rank places the start
at ``arrival - since_first_byte``, earliest over its writers. That start is later than the
true one by one notice's flight time (tens of microseconds on a host), never earlier, and
needs no shared clock. On one Linux host ``time.monotonic()`` (CLOCK_MONOTONIC) is the
same clock in every process, so records of both sides can also be compared directly.

Phases are times summed over the request's chunks (and, on the decode side, over its
writers): ``plan`` (byte plans), ``wait`` (flow control: waiting for a free staging slot,
i.e. for the reader's scatter), ``gather``, ``wire`` (posting until the transport reports
done), ``scatter`` (decode) and ``notify`` (sending ``ChunkReady``). They may overlap each
other (the staged path gathers slot k+1 while slot k is on the wire), so they need not
add up to the window.
"""

from __future__ import annotations

import re
import threading
import typing
from dataclasses import asdict, dataclass, field

if typing.TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

__all__ = [
    "PHASES",
    "FAILURE_KINDS",
    "RequestRecord",
    "classify_failure",
    "note_writer_done",
    "MetricsServer",
    "serve_metrics",
]

PHASES = ("plan", "wait", "gather", "wire", "scatter", "notify")
FAILURE_KINDS = ("timeout", "peer_gone", "geometry", "aborted", "transport", "other")

# Keys of TransferDone.timings that are ages (seconds before the notice was sent), not phases.
SINCE_FIRST_BYTE = "since_first_byte"
SINCE_LAST_CHUNK = "since_last_chunk"

# First match wins: an abort is an abort whatever its reason says; a forwarded failure
# ("prefill rank 0 failed the request: timed out ...") is classified by its cause.
_KIND_PATTERNS = [
    ("aborted", re.compile(r"\babort", re.I)),
    ("geometry", re.compile(r"geometry|refused this decode rank|not divisible|kv_buffer_locs", re.I)),
    (
        "peer_gone",
        re.compile(
            r"is gone|sent nothing for|peer .*(exited|died|gone)|closed by the peer|"
            r"process exited|connection .*lost",
            re.I,
        ),
    ),
    ("timeout", re.compile(r"timed out|time-?out|deadline|within [\d.]+ ?s|after [\d.]+ ?s", re.I)),
    ("transport", re.compile(r"transport|tcp|cma|process_vm|ipc|write|scatter|gather|staging|connection", re.I)),
]


def classify_failure(reason: str | None) -> str:
    """One of ``FAILURE_KINDS`` for a failure reason (bounded label values)."""
    for kind, pattern in _KIND_PATTERNS:
        if reason and pattern.search(reason):
            return kind
    return "other"


@dataclass
class RequestRecord:
    """One request as one rank saw it. Times are ``time.monotonic()`` seconds of that rank.

    ``first_byte_ready`` / ``last_notice`` bound the transfer window (module docstring);
    ``last_chunk_ready`` is when the last chunk was ready to move, so ``tail_s`` is the
    latency the transfer adds after the prefill's last chunk. ``bytes``/``ops``: written
    (prefill, every reader) or received (decode, every writer); ops are transport
    descriptors (a fused pool -> pool copy counts one). ``pool_read_bytes`` (prefill): bytes
    read from the rank's KV pool; below ``bytes`` where staged readers that need the same
    head slice (replicated heads) share one gather (fan-out); 0 on the decode.
    ``failure_kind`` (one of ``FAILURE_KINDS``, "" on success) is derived from
    ``reason`` unless the engine knows it (an abort on this side).
    """

    room: int
    side: str
    tp_rank: int
    ok: bool
    reason: str = ""
    bytes: int = 0
    ops: int = 0
    pool_read_bytes: int = 0
    phases: dict = field(default_factory=dict)
    first_byte_ready: float | None = None
    last_chunk_ready: float | None = None
    last_notice: float | None = None
    failure_kind: str = ""

    def __post_init__(self) -> None:
        if self.ok:
            self.failure_kind = ""
        elif self.failure_kind not in FAILURE_KINDS:
            self.failure_kind = classify_failure(self.reason)

    @property
    def transfer_s(self) -> float | None:
        if self.first_byte_ready is None or self.last_notice is None:
            return None
        return max(0.0, self.last_notice - self.first_byte_ready)

    @property
    def tail_s(self) -> float | None:
        if self.last_chunk_ready is None or self.last_notice is None:
            return None
        return max(0.0, self.last_notice - self.last_chunk_ready)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(transfer_s=self.transfer_s, tail_s=self.tail_s)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> RequestRecord:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


def note_writer_done(marks: dict, timings, arrived: float) -> dict:
    """Decode side, one writer's ``TransferDone`` that arrived at ``arrived``: move the
    window estimates in ``marks`` earlier if this writer's start was earlier, and return
    the phase timings to add (the ages are not phases)."""
    phases = dict(timings)
    for key, mark in ((SINCE_FIRST_BYTE, "first_byte_ready"), (SINCE_LAST_CHUNK, "last_chunk_ready")):
        age = phases.pop(key, None)
        if age is not None:
            est = arrived - age
            marks[mark] = est if mark not in marks else min(marks[mark], est)
    return phases


# -- Prometheus -----------------------------------------------------------------------------------

_SECONDS_BUCKETS = (
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
_BYTES_BUCKETS = tuple(float(1 << s) for s in range(12, 37, 2))  # 4 KiB .. 64 GiB


class MetricsServer:
    """A Prometheus endpoint for one rank (``KVManager``): an HTTP server thread with its
    own registry, fed by the manager's finished-request records.

    Exposes (labels ``role``, ``tp_rank``): ``kvxfer_transfer_seconds`` and
    ``kvxfer_transfer_tail_seconds`` (histograms of successful requests' windows),
    ``kvxfer_transfer_bytes`` (histogram of bytes per request), ``kvxfer_transfer_ops``
    (counter of descriptors), ``kvxfer_transfer_phase_seconds{phase}`` (counter of busy
    time), ``kvxfer_transfer_failures{reason}`` (counter, ``reason`` in
    ``FAILURE_KINDS``), ``kvxfer_requests_in_flight`` and ``kvxfer_staging_bytes_in_use``,
    ``kvxfer_staging_bytes_allocated`` / ``kvxfer_staging_bytes_capacity`` (gauges read at scrape time),
    ``kvxfer_security_events{kind}`` (room conflicts, frames from unexpected or unregistered
    sessions, the unattached-room cap) and ``kvxfer_control_frames_dropped{reason}``
    (unauthenticated, replayed, spoofed, malformed), both read at scrape time. Counters gain
    ``_total`` on the wire.
    """

    def __init__(self, mgr, port: int, host: str = "127.0.0.1"):
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"metrics port={port!r} must be an integer in [0, 65536) (0 picks a free one)")
        try:
            import prometheus_client as prom
        except ImportError:
            raise ImportError(
                "the metrics endpoint needs prometheus_client: "
                "pip install 'sglang_kvxfer[metrics]' (or prometheus_client)"
            ) from None
        self._mgr = mgr
        self.registry = reg = prom.CollectorRegistry()
        ids = {"role": mgr.side.value, "tp_rank": str(mgr.tp_rank)}
        names = list(ids)

        def child(metric):
            return metric.labels(**ids)

        self._seconds = child(
            prom.Histogram(
                "kvxfer_transfer_seconds",
                "Transfer window of a successful request: first byte ready on "
                "the prefill to the last notice processed (decode) or to sending TransferDone (prefill)",
                names,
                registry=reg,
                buckets=_SECONDS_BUCKETS,
            )
        )
        self._tail = child(
            prom.Histogram(
                "kvxfer_transfer_tail_seconds",
                "Latency after the last chunk was ready until the last notice",
                names,
                registry=reg,
                buckets=_SECONDS_BUCKETS,
            )
        )
        self._bytes = child(
            prom.Histogram(
                "kvxfer_transfer_bytes",
                "KV bytes of a successful request on this rank (written or received)",
                names,
                registry=reg,
                buckets=_BYTES_BUCKETS,
            )
        )
        self._ops = child(
            prom.Counter("kvxfer_transfer_ops", "Transport descriptors of successful requests", names, registry=reg)
        )
        phase = prom.Counter(
            "kvxfer_transfer_phase_seconds", "Busy time per transfer phase", names + ["phase"], registry=reg
        )
        self._phases = {p: phase.labels(phase=p, **ids) for p in PHASES}
        failures = prom.Counter(
            "kvxfer_transfer_failures", "Failed requests by kind of reason", names + ["reason"], registry=reg
        )
        self._failures = {k: failures.labels(reason=k, **ids) for k in FAILURE_KINDS}
        child(
            prom.Gauge("kvxfer_requests_in_flight", "Requests not yet succeeded or failed", names, registry=reg)
        ).set_function(self._inflight)
        child(
            prom.Gauge("kvxfer_staging_bytes_in_use", "Bytes of the staging arena allocated now", names, registry=reg)
        ).set_function(self._staging_used)
        child(
            prom.Gauge("kvxfer_staging_bytes_capacity", "Cap of the staging arena", names, registry=reg)
        ).set_function(self._staging_cap)
        child(
            prom.Gauge(
                "kvxfer_staging_bytes_allocated",
                "Memory the staging arena holds now (0 until a transfer is staged)",
                names,
                registry=reg,
            )
        ).set_function(self._staging_size)
        reg.register(_SecurityCollector(mgr, ids))
        self._lock = threading.Lock()
        self._httpd: WSGIServer | None
        try:
            httpd, self._thread = prom.start_http_server(port, addr=host, registry=reg)
        except OSError as exc:
            raise OSError(exc.errno, f"metrics endpoint cannot listen on {host}:{port}: {exc.strerror}") from None
        self._httpd = httpd
        self.port = httpd.server_port
        self.host = host
        mgr.request_listeners.append(self.observe)

    def _inflight(self) -> float:
        return float(self._mgr.num_inflight())

    def _staging_used(self) -> float:
        staging = self._mgr.staging
        return float(staging.used_bytes) if staging is not None else 0.0

    def _staging_size(self) -> float:
        staging = self._mgr.staging
        return float(staging.nbytes) if staging is not None else 0.0

    def _staging_cap(self) -> float:
        staging = self._mgr.staging
        return float(staging.cap_bytes) if staging is not None else 0.0

    def observe(self, record: RequestRecord) -> None:
        """Count one finished request (called by the manager, on its threads)."""
        with self._lock:
            if not record.ok:
                self._failures[record.failure_kind].inc()
                return
            if record.transfer_s is not None:
                self._seconds.observe(record.transfer_s)
            if record.tail_s is not None:
                self._tail.observe(record.tail_s)
            self._bytes.observe(record.bytes)
            self._ops.inc(record.ops)
            for name, seconds in record.phases.items():
                if name in self._phases and seconds > 0:
                    self._phases[name].inc(seconds)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and stop listening to the manager. Idempotent."""
        listeners = getattr(self._mgr, "request_listeners", [])
        if self.observe in listeners:
            listeners.remove(self.observe)
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(5)
            self._httpd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _SecurityCollector:
    """Reads the manager's security counters at scrape time."""

    def __init__(self, mgr, ids: dict):
        self._mgr, self._ids = mgr, ids

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        labels = list(self._ids)
        events = CounterMetricFamily("kvxfer_security_events", "Security events by kind", labels=labels + ["kind"])
        for kind, count in sorted(dict(getattr(self._mgr, "security_events", {})).items()):
            events.add_metric(list(self._ids.values()) + [kind], count)
        dropped = CounterMetricFamily(
            "kvxfer_control_frames_dropped",
            "Control frames dropped before handling, by reason",
            labels=labels + ["reason"],
        )
        control = getattr(self._mgr, "control", None)
        for reason, count in sorted(dict(control.dropped if control is not None else {}).items()):
            dropped.add_metric(list(self._ids.values()) + [reason], count)
        return [events, dropped]


def serve_metrics(mgr, port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Start a Prometheus endpoint for ``mgr`` at ``http://host:port/metrics``.

    What a rank process calls when its spec has a metrics port (``port`` 0 picks a free
    port; ``.port`` tells which). Close it before the manager.
    """
    return MetricsServer(mgr, port, host)
