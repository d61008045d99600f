"""Pipeline parallelism (SGLang ``--pp-size``) for the SGLang backend.

A prefill PP stage is a set of SGLang ranks whose pools hold the stage's layers; each rank
runs one engine manager over them and registers with the bootstrap under its stage, with its
first layer. What PP adds around those managers lives here:

* ``StageStatus``: SGLang's PP prefill polls its bootstrap queue on PP stage 0 only
  (``poll_pp_consensus``) and hands that status to the later stages, which then ask for the
  decode's prefix and init their senders; so stage 0 reports a request bootstrapped only
  once every stage has the decode's request. Each later stage pushes its requests' bootstrap
  status, as it changes, to stage 0 over an authenticated ZMQ channel (the envelope of the
  control plane), whose address stage 0 hands out through SGLang's PP group broadcast;
* ``TopologyLookup``: a decode rank's background lookup of the prefill behind one bootstrap:
  its TP, DP and PP sizes and every stage's layers;
* the layer rules: stage labels, whether the stages' layers tile a decode's layers, SGLang's
  rule for the two PP sizes (equal, or decode 1), and the layer-slice view of a decode pool
  (the buffers of a stage's layers: no copy).

Must not: import torch or SGLang, or touch a pool's bytes.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from sglang_kvxfer.engine import bootstrap
from sglang_kvxfer.errors import AuthenticationError, KVXferError, TransferTimeoutError
from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.integrations.sglang_args import entry_spans
from sglang_kvxfer.protocol import envelope
from sglang_kvxfer.protocol.messages import BootstrapQuery, BootstrapReply
from sglang_kvxfer.protocol.state import KVPoll

__all__ = [
    "StageStatus",
    "TopologyLookup",
    "PrefillTopology",
    "stage_label",
    "entry_spans",
    "count_problem",
    "stage_entries",
    "tiling_problem",
    "pp_rule_problem",
    "layer_slice",
]

log = logging.getLogger("sglang_kvxfer.sglang")

_STATUS = struct.Struct("<HQb")  # PP stage, room, KVPoll (-1: the stage forgot the room)
_FORGET = -1


def stage_label(pp_rank: int, layers: range, entries: range | None = None) -> str:
    """How failures name a stage: its layers; with ``entries``, the stage's part of a pool
    whose entries are not one per layer (a hybrid model's full-attention KV, a state pool)."""
    if entries is None:
        return f"PP stage {pp_rank} (layers [{layers.start}, {layers.stop}))"
    return f"PP stage {pp_rank} (from layer {layers.start}, entries [{entries.start}, {entries.stop}))"


def stage_entries(layer_ids: Sequence[int], stage: range, what: str) -> range:
    """The entries of a whole-model pool (one per id of ``layer_ids``, ascending) that hold
    the layers of ``stage``; ``KVXferError`` naming ``what`` when the stage holds none or
    they are not consecutive."""
    index = [i for i, layer in enumerate(layer_ids) if layer in stage]
    if not index or index != list(range(index[0], index[-1] + 1)):
        raise KVXferError(
            f"{what}: PP stage layers [{stage.start}, {stage.stop}) hold {len(index)} of its layers "
            f"{list(layer_ids)}; a stage must hold one or more of them, consecutive (change SGLANG_PP_LAYER_PARTITION)"
        )
    return range(index[0], index[-1] + 1)


def count_problem(what: str, counts: Sequence[int], ours: int) -> str:
    """Why the stages' entry counts of ``what`` do not fill this decode's ``ours`` ("" if they do)."""
    if sum(counts) == ours:
        return ""
    parts = " + ".join(str(n) for n in counts)
    return (
        f"{what}: the prefill's {len(counts)} PP stages hold {parts} = {sum(counts)} entries, this decode's pool "
        f"{ours}: serve the same model with the same memory flags on both servers"
    )


def _spans(layers: Sequence[range]) -> str:
    return ", ".join(f"[{r.start}, {r.stop})" for r in layers)


def tiling_problem(layers: Sequence[range], num_layers: int) -> str:
    """Why the stages' layer ranges (in stage order) are not exactly ``[0, num_layers)`` one
    after another ("" if they are)."""
    at = 0
    for r in layers:
        if r.start != at:
            break
        at = r.stop
    else:
        if at == num_layers:
            return ""
    total = sum(len(r) for r in layers)
    return (
        f"the prefill's {len(layers)} PP stages hold layers {_spans(layers)} ({total} layers in all), which do not "
        f"tile this decode's {num_layers} layers [0, {num_layers}): serve the same model with the same layer "
        "split (SGLANG_PP_LAYER_PARTITION) on both servers"
    )


def pp_rule_problem(decode_pp: int, prefill_pp: int) -> str:
    """SGLang's rule for PD with pipeline parallelism: the decode's PP size equals the
    prefill's or is 1 ("" when it holds)."""
    if decode_pp in (1, prefill_pp):
        return ""
    return (
        f"decode pp size ({decode_pp}) must be equal to the prefill pp size ({prefill_pp}) or 1 (SGLang's rule "
        f"for PD with pipeline parallelism): start the decode with --pp-size {prefill_pp} or --pp-size 1"
    )


def layer_slice(
    geometry: KVGeometry, ptrs: Sequence[int], lens: Sequence[int], layers: range
) -> tuple[KVGeometry, tuple[int, ...], tuple[int, ...]]:
    """The geometry and buffers of ``layers`` of a pool (K of every layer then V; MLA, K only:
    one buffer per layer): a view of the same memory with the stage's layer count."""
    n = geometry.num_layers
    if layers.start < 0 or layers.stop > n or not len(layers):
        raise ValueError(f"layers [{layers.start}, {layers.stop}) are not a non-empty part of [0, {n})")
    index = list(layers) if geometry.num_buffers == n else [*layers, *(n + i for i in layers)]
    part = dataclasses.replace(geometry, num_layers=len(layers))
    return part, tuple(ptrs[i] for i in index), tuple(lens[i] for i in index)


# -- prefill: the stages' bootstrap status, collected at stage 0 ------------------------------------


class StageStatus:
    """The bootstrap status of one prefill pipeline's requests on every PP stage.

    Stage 0 binds an inbox and hands its address to the later stages with ``exchange`` (a
    broadcast from stage 0: every stage calls it once, stage 0 with the address, the others
    with None, and all get stage 0's value). A later stage ``watch``es each request with a
    function returning its current bootstrap status; a thread pushes every change to stage 0
    until the request is bootstrapped or failed, and ``forget`` drops it there.
    ``consensus(room, own)`` on stage 0 is the lowest status of every stage (a stage that has
    not reported the room counts as Bootstrapping). Frames carry the control plane's
    authenticated envelope (``key``); anything else is dropped and counted in ``dropped``.
    """

    def __init__(
        self,
        pp_rank: int,
        pp_size: int,
        exchange: Callable[[Any], Any],
        *,
        key: bytes,
        host: str,
        session: str,
        interval_s: float = 0.005,
    ):
        if not 0 <= pp_rank < pp_size:
            raise ValueError(f"pp_rank={pp_rank} must be in [0, pp_size={pp_size})")
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.session = f"{session}.pp{pp_rank}"
        self.dropped = 0
        self._key, self._interval_s = key, interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._peers: dict[int, dict[int, int]] = {}  # stage 0: stage -> room -> status
        self._watched: dict[int, Callable[[], int]] = {}  # later stages: room -> status of it
        self._pushed: dict[int, int] = {}
        self._forgotten: list[int] = []
        self._ctx = zmq.Context()
        try:
            if pp_rank == 0:
                self._sock = self._ctx.socket(zmq.PULL)
                self._sock.setsockopt(zmq.LINGER, 0)
                self._sock.setsockopt(zmq.MAXMSGSIZE, 4096)
                port = self._sock.bind_to_random_port(f"tcp://{host}")
                self.endpoint = f"tcp://{host}:{port}"
                self._guard = envelope.SequenceGuard()
                exchange(self.endpoint)
                target = self._receive
            else:
                endpoint = exchange(None)
                if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
                    raise KVXferError(
                        f"PP stage {pp_rank}: PP stage 0 handed out {endpoint!r} as the address of its "
                        "bootstrap-status inbox (a 'tcp://host:port' was expected)"
                    )
                self.endpoint = endpoint
                self._sock = self._ctx.socket(zmq.PUSH)
                self._sock.setsockopt(zmq.LINGER, 0)
                self._sock.connect(endpoint)
                self._seq = itertools.count(1)
                target = self._push
        except BaseException:
            self._ctx.destroy(0)
            raise
        self._thread = threading.Thread(target=target, name=f"kvxfer-pp{pp_rank}-status", daemon=True)
        self._thread.start()

    # -- stage 0 -----------------------------------------------------------------------------------
    def consensus(self, room: int, own: int) -> tuple[int, list[int]]:
        """``(the lowest bootstrap status of room over every stage, the stages that failed
        it)``, ``own`` being stage 0's status."""
        if self.pp_rank != 0:
            return int(own), []
        with self._lock:
            seen = [self._peers.get(s, {}).get(room) for s in range(1, self.pp_size)]
        statuses = [int(own)] + [int(KVPoll.Bootstrapping) if s is None else s for s in seen]
        return min(statuses), [s for s, st in enumerate(statuses) if st == int(KVPoll.Failed)]

    def _receive(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                continue
            try:
                sender, seq, payload = envelope.open_frame(self._key, frame, self.endpoint)
                stage, room, status = _STATUS.unpack(payload)
                if not 0 < stage < self.pp_size or not _FORGET <= status <= int(KVPoll.Success):
                    raise ValueError(f"stage {stage}, status {status} (pp_size={self.pp_size})")
                if not self._guard.accept(sender, seq):
                    raise ValueError(f"a replayed or reordered frame from {sender}")
            except (AuthenticationError, ValueError, struct.error) as exc:
                self.dropped += 1
                if self.dropped <= 3:
                    log.warning("PP stage 0 dropped a bootstrap-status frame (%d so far): %s", self.dropped, exc)
                continue
            with self._lock:
                rooms = self._peers.setdefault(stage, {})
                if status == _FORGET:
                    rooms.pop(room, None)
                else:
                    rooms[room] = status

    # -- later stages ------------------------------------------------------------------------------
    def watch(self, room: int, status_of: Callable[[], int]) -> None:
        """Push ``status_of()`` of ``room`` to stage 0 as it changes (until bootstrapped)."""
        if self.pp_rank == 0:
            return
        with self._lock:
            self._watched[room] = status_of

    def forget(self, room: int) -> None:
        if self.pp_rank == 0:
            return
        with self._lock:
            self._watched.pop(room, None)
            if self._pushed.pop(room, None) is not None:
                self._forgotten.append(room)

    def _send(self, room: int, status: int) -> None:
        payload = _STATUS.pack(self.pp_rank, room, status)
        try:
            self._sock.send(
                envelope.seal(self._key, self.session, next(self._seq), payload, self.endpoint), zmq.NOBLOCK
            )
        except zmq.Again:  # stage 0 is gone or far behind: its requests fail by their deadline
            log.warning("PP stage %d: PP stage 0 takes no bootstrap status (room %d)", self.pp_rank, room)

    def _push(self) -> None:
        while not self._stop.wait(self._interval_s if self._watched else 10 * self._interval_s):
            with self._lock:
                watched, forgotten, self._forgotten = list(self._watched.items()), self._forgotten, []
            try:
                for room in forgotten:
                    self._send(room, _FORGET)
                for room, status_of in watched:
                    status = int(status_of())
                    with self._lock:
                        if room not in self._watched:
                            continue  # forgotten meanwhile
                        changed = self._pushed.get(room) != status
                        self._pushed[room] = status
                        if status == int(KVPoll.Failed) or status >= int(KVPoll.WaitingForInput):
                            del self._watched[room]  # stage 0 asks nothing later
                    if changed:
                        self._send(room, status)
            except zmq.ZMQError as exc:
                if not self._stop.is_set():
                    log.warning("PP stage %d: pushing bootstrap status to PP stage 0 failed: %s", self.pp_rank, exc)

    def close(self, timeout_s: float = 2.0) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout_s)
        self._sock.close(0)
        self._ctx.term()


# -- decode: the prefill behind a bootstrap ---------------------------------------------------------


@dataclass(frozen=True)
class PrefillTopology:
    """What a decode rank learned about the prefill behind one bootstrap (its DP group 0)."""

    tp_size: int
    geometry: KVGeometry  # PP stage 0's (its num_layers: stage 0's layer count)
    dp_size: int
    dp_groups: tuple[int, ...]
    draft_geometry: KVGeometry | None  # the last PP stage's draft-model pool (None: none)
    pp_size: int
    pp_layers: tuple[range, ...]  # each stage's layers, in stage order
    # each state pool asked about: its entry count on every stage, in stage order (asked only
    # of a prefill of several stages)
    state_counts: tuple[tuple[str, tuple[int, ...]], ...] = ()
    state_pools: tuple[str, ...] = ()  # the state pools the prefill announced
    follows_room: bool = True  # its DP groups are bootstrap_room % dp_size (else: ask the bootstrap)
    api_port: int = 0  # the prefill server's HTTP port (0: not registered)
    dcp_size: int = 1  # the prefill's --dcp-size
    cp_size: int = 1  # the prefill's CP ranks that send, each its share of a request's pages
    all_heads: bool = False  # its ranks' pools hold every KV head (--enable-cp-tp-group-sharing)
    kv_sharded: bool = False  # its CP ranks hold the pages interleaved (--enable-kv-cache-sharding)


class TopologyLookup:
    """In the background: ask the bootstrap at ``address`` until PP stage 0 of DP group 0 is
    registered, then until every later stage is, and record their layers; with several stages,
    also until every stage's pool of each of ``state_pools`` is, and record its entry count.
    ``result`` is the ``PrefillTopology`` once known; ``error`` says why not after ``timeout_s``."""

    def __init__(
        self,
        address: str,
        *,
        key: bytes,
        session: str,
        tp_rank: int,
        timeout_s: float,
        state_pools: Sequence[str] = (),
    ):
        self.address = address
        self.result: PrefillTopology | None = None
        self.error = ""
        self._key, self._timeout_s = key, timeout_s
        self._query = BootstrapQuery(session=f"{session}.pp", tp_rank=tp_rank)
        self._state_pools = tuple(state_pools)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvxfer-prefill-lookup", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return self.result is not None or bool(self.error)

    def _ready(self, address: str, deadline: float, kv_pool: str = "") -> BootstrapReply | None:
        last, unanswered = "no answer", 0
        query = dataclasses.replace(self._query, kv_pool=kv_pool) if kv_pool else self._query
        while not self._stop.is_set():
            wait_s = bootstrap.attempt_timeout(unanswered, deadline)
            try:
                reply = bootstrap.request(address, query, timeout_s=wait_s, key=self._key)
            except KVXferError as exc:
                last = str(exc)
                unanswered = unanswered + 1 if isinstance(exc, TransferTimeoutError) else 0
            else:
                unanswered = 0
                if reply.ready:
                    return reply
                last = reply.reason
            if time.monotonic() >= deadline:
                self.error = f"bootstrap {address}: prefill group not ready after {self._timeout_s:.0f} s ({last})"
                return None
            self._stop.wait(0.1)
        return None

    def _run(self) -> None:
        deadline = time.monotonic() + self._timeout_s
        first = self._ready(self.address, deadline)
        if first is None or first.geometry is None:
            return
        layers = [range(first.layer_start, first.layer_start + first.geometry.num_layers)]
        draft = first.draft_geometry
        for s in range(1, max(first.pp_size, 1)):
            reply = self._ready(bootstrap.group_address(self.address, 0, s), deadline)
            if reply is None or reply.geometry is None:
                return
            layers.append(range(reply.layer_start, reply.layer_start + reply.geometry.num_layers))
            draft = reply.draft_geometry  # the last stage's: where SGLang runs the draft model
        counts = []
        # (a pool the prefill does not announce is not waited for: state_problem names it)
        for name in [n for n in self._state_pools if n in first.state_pools] if len(layers) > 1 else ():
            stages = []
            for s in range(len(layers)):
                reply = self._ready(bootstrap.group_address(self.address, 0, s), deadline, kv_pool=name)
                if reply is None or reply.geometry is None:
                    return
                stages.append(reply.geometry.num_layers)
            counts.append((name, tuple(stages)))
        self.result = PrefillTopology(
            tp_size=first.tp_size,
            geometry=first.geometry,
            dp_size=max(first.dp_size, 1),
            dp_groups=tuple(first.dp_groups) or (0,),
            draft_geometry=draft,
            pp_size=max(first.pp_size, 1),
            pp_layers=tuple(layers),
            state_counts=tuple(counts),
            state_pools=tuple(first.state_pools),
            follows_room=first.follows_room,
            api_port=first.api_port,
            dcp_size=first.dcp_size,
            cp_size=first.cp_size,
            all_heads=first.all_heads,
            kv_sharded=first.kv_sharded,
        )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
