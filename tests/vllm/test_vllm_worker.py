"""``vllm_worker`` without vLLM: producer TP 2 -> consumer TP 1 worker sides in this process,
real engine managers over vLLM-shaped CPU caches (``local`` transport), real bytes.

The producer's caches start as random garbage and each layer's true KV is written only just
before ``save_kv_layer`` reports that layer (as vLLM's forward writes it), so a layer handed
to the engine before it is written moves garbage, and the byte comparison of every consumer
block against the truth fails. The consumer registers first (the concurrent-room order), so
each layer moves as soon as it is handed over.
"""

from __future__ import annotations

import time

import pytest
import torch

from sglang_kvxfer.engine import BootstrapServer, KVPoll
from sglang_kvxfer.integrations.vllm_layout import VllmLayout
from sglang_kvxfer.integrations.vllm_meta import KVXferConnectorMetadata, RecvSpec, SendSpec, Settings
from sglang_kvxfer.integrations.vllm_worker import SendReport, WorkerSide

NUM_LAYERS, HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 4, 4, 8, 32, 12
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
SRC, DST = (5, 2, 9), (1, 7, 3)  # the producer's and the consumer's blocks of one 70-token prompt
DEADLINE_S = 30.0


def wait_until(cond, what: str, timeout_s: float = DEADLINE_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"{what}: not within {timeout_s} s")


class Sides:
    """Two producer worker sides (TP 2) and one consumer worker side (TP 1)."""

    def __init__(self):
        self.boot = BootstrapServer()
        self.reports: list[SendReport] = []
        self.received: list[str] = []
        self.producers: list[WorkerSide] = []
        self.consumer: WorkerSide | None = None
        gen = torch.Generator().manual_seed(7)
        self.truth = []  # per producer rank, per layer: [blocks, local heads, block, 2 * head_dim]
        try:
            for rank in range(2):
                side = self._side(True, 2, rank)
                for t in side.layout.tensors:  # garbage until the "forward" writes a layer
                    t.copy_(torch.randn(t.shape, generator=gen))
                self.truth.append([torch.randn(side.layout.tensors[0].shape, generator=gen) for _ in NAMES])
                self.producers.append(side)
            self.consumer = self._side(False, 1, 0)
            for side in self.producers:
                side.prefill.wait_registered(DEADLINE_S)
        except BaseException:
            self.close()
            raise

    def _side(self, produces: bool, tp_size: int, tp_rank: int) -> WorkerSide:
        local = HEADS // tp_size
        caches = {name: torch.zeros(NUM_BLOCKS, local, BLOCK, 2 * HEAD_DIM) for name in reversed(NAMES)}
        layout = VllmLayout.from_kv_caches(caches, total_kv_heads=HEADS, mla=False, tp_size=tp_size, tp_rank=tp_rank)
        settings = Settings(
            produces=produces,
            consumes=not produces,
            bootstrap=self.boot.address,
            host="127.0.0.1",
            transport="local",
            tp_size=tp_size,
            block_size=BLOCK,
        )
        side = WorkerSide(
            None, settings, on_received=lambda req, ids: self.received.append(req), on_sent=self.reports.append
        )
        side.attach(layout)
        return side

    def receive(self, req: str, room: int) -> None:
        assert self.consumer is not None
        self.consumer.start_recvs(KVXferConnectorMetadata(recvs={req: RecvSpec(room, self.boot.address, DST, 70)}))

    def forward(self, meta: KVXferConnectorMetadata, order=range(NUM_LAYERS), reported=None) -> None:
        """One step on both producer ranks: bind, then per layer write its truth and report
        it (``reported``: the layers ``save_kv_layer`` is called for), then ``wait_for_save``."""
        reported = set(order if reported is None else reported)
        for side in self.producers:
            side.begin_step(meta)
        for layer in order:
            for rank, side in enumerate(self.producers):
                side.layout.tensors[layer][list(SRC)] = self.truth[rank][layer][list(SRC)]
                if layer in reported:
                    side.save_kv_layer(NAMES[layer])
        for side in self.producers:
            side.finish_step(meta)

    def step(self, meta: KVXferConnectorMetadata) -> None:
        for side in self.producers:
            side.begin_step(meta)
            side.finish_step(meta)

    def poll_consumer(self) -> tuple[set[str], set[str]]:
        assert self.consumer is not None
        _, done, failed = self.consumer.poll()
        return done, failed

    def sender_state(self, req: str) -> list[KVPoll]:
        return [side._sends[req].handle.poll() for side in self.producers]

    def consumer_blocks_equal_truth(self) -> bool:
        assert self.consumer is not None
        for layer in range(NUM_LAYERS):
            got = self.consumer.layout.tensors[layer][list(DST)]
            want = torch.cat([self.truth[r][layer][list(SRC)] for r in range(2)], dim=1)  # heads 0-1, then 2-3
            if not torch.equal(got, want):
                return False
        return True

    def close(self) -> None:
        for side in [*self.producers, self.consumer]:
            if side is not None:
                side.close()
        self.boot.close()


@pytest.fixture
def sides():
    s = Sides()
    try:
        yield s
    finally:
        s.close()


def layerwise(room: int, req: str = "r1") -> KVXferConnectorMetadata:
    return KVXferConnectorMetadata(sends={req: SendSpec(room, SRC, 70, layerwise=True)})


def receive_all(sides: Sides, req: str) -> set[str]:
    """Poll the consumer until its receive ended; returns the failed requests."""
    ended: set[str] = set()
    failed: set[str] = set()

    def done():
        d, f = sides.poll_consumer()
        ended.update(d)
        failed.update(f)
        return req in ended

    wait_until(done, f"the receive of {req}")
    return failed


@pytest.mark.parametrize(
    "order,reported,groups,late",
    [
        pytest.param(range(4), range(4), 4, 0, id="in-order"),
        pytest.param((1, 0, 3, 2), (1, 0, 3, 2), 2, 0, id="out-of-order"),  # [0, 2) after 0, [2, 4) after 2
        pytest.param(range(4), (0, 1), 3, 2, id="unreported-layers-move-at-wait-for-save"),
    ],
)
def test_layers_move_as_reported_and_the_bytes_are_exact(sides, order, reported, groups, late):
    room = 41
    sides.receive("r1", room)
    sides.forward(layerwise(room), order=order, reported=reported)
    assert not receive_all(sides, "r1"), sides.consumer.layout.tensors[0].shape
    assert sides.received == ["r1"]
    assert sides.consumer_blocks_equal_truth(), "the consumer's blocks differ from the producer's written KV"
    wait_until(lambda: all(s == KVPoll.Success for s in sides.sender_state("r1")), "the senders' success")
    # Not reported until the scheduler released it: vLLM frees the blocks of what is reported.
    assert [side.poll()[0] for side in sides.producers] == [set(), set()]
    assert sides.reports == []
    sides.step(KVXferConnectorMetadata(released={"r1"}))
    assert [side.poll()[0] for side in sides.producers] == [{"r1"}, {"r1"}]
    assert sorted(r.tp_rank for r in sides.reports) == [0, 1]
    for r in sides.reports:
        assert (r.room, r.layerwise, r.ok, r.layer_groups, r.layers_late) == (room, True, True, groups, late), r
        assert r.layers_streamed + r.layers_late == NUM_LAYERS and r.bytes > 0, r


def test_the_producer_forward_before_the_consumer_registers_still_moves_every_byte(sides):
    """The ordinary order: the layers queue on the producer until the consumer's metadata
    arrives (the engine merges them)."""
    sides.forward(layerwise(52))
    sides.step(KVXferConnectorMetadata(released={"r1"}))
    sides.receive("r1", 52)
    assert not receive_all(sides, "r1")
    assert sides.consumer_blocks_equal_truth()
    sent = [set(), set()]

    def reported():
        for rank, side in enumerate(sides.producers):
            sent[rank] |= side.poll()[0]
        return sent == [{"r1"}, {"r1"}]

    wait_until(reported, "both producer ranks report the send")
    assert all(r.ok and r.layer_groups == NUM_LAYERS and r.layers_streamed == NUM_LAYERS for r in sides.reports)


def open_and_report_layer0(sides: Sides, room: int) -> None:
    """A step cut short: the send is open and has layer 0, the rest never comes. Returns once
    the consumer's metadata is in on both producer ranks (so an abort reaches the consumer)."""
    for rank, side in enumerate(sides.producers):
        side.begin_step(layerwise(room))
        side.layout.tensors[0][list(SRC)] = sides.truth[rank][0][list(SRC)]
        side.save_kv_layer(NAMES[0])
    wait_until(lambda: KVPoll.Bootstrapping not in sides.sender_state("r1"), "the consumer's metadata")


def test_an_aborted_request_aborts_its_send_with_the_reason_and_reports_it_once_released(sides):
    sides.receive("r1", 63)
    open_and_report_layer0(sides, 63)
    reason = "vLLM finished the request (FINISHED_ABORTED) on the producer"
    sides.step(KVXferConnectorMetadata(send_aborts={"r1": reason}, released={"r1"}))
    assert [side.poll()[0] for side in sides.producers] == [{"r1"}, {"r1"}]
    assert [(r.ok, r.reason, r.layers_streamed) for r in sides.reports] == [(False, reason, 1)] * 2
    assert receive_all(sides, "r1") == {"r1"}  # the consumer is told, with the reason


def test_a_dropped_send_is_aborted_and_never_reported(sides):
    """vLLM preempted the request and freed its blocks itself: reporting it would free them
    twice. The consumer that registered is told (its receive fails, not hangs)."""
    sides.receive("r1", 74)
    open_and_report_layer0(sides, 74)
    sides.step(KVXferConnectorMetadata(dropped={"r1": "vLLM preempted the request"}))
    assert receive_all(sides, "r1") == {"r1"}
    for _ in range(3):
        assert [side.poll()[0] for side in sides.producers] == [set(), set()]
    assert sides.reports == []
