"""The fused data path of a prefill rank: one copy from its pool into a reader's pool.

Owns ``FusedWrites``, the part of ``PrefillManager`` that finds out, when a decode rank
registers, whether this process maps every region of that rank's KV pool writable on the
device of its own pool (``Transport.mapped_device``: ``local`` shared memory, CUDA IPC of
a visible GPU), and, for a reader whose ``RequestMeta`` says ``fused``, writes each chunk
(token range x layer group) with one ``ops.copy_kv_heads`` that reads this rank's pages
and writes the reader's pages through both page tables: no staging slot, no transport
write, no scatter on the reader. The reader's regions are viewed (``remote_view``) only
for the copy, so the transport's lease keeps them mapped while it runs and its liveness
check after the copy fails a chunk whose reader exited meanwhile.
Must not: send messages or count a chunk the copy did not finish.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

from sglang_kvxfer.engine.manager import RankBase
from sglang_kvxfer.engine.pool import torch_dtype
from sglang_kvxfer.engine.prefill_rooms import PrefillRoom, Synchronizable
from sglang_kvxfer.errors import TransferFailedError
from sglang_kvxfer.planning import PoolMapping, RequestPlan
from sglang_kvxfer.transports.base import parse_device

if TYPE_CHECKING:
    from sglang_kvxfer.engine.prefill import DecodePeer

__all__ = ["FusedWrites"]


class FusedWrites(RankBase[PrefillRoom]):
    """Fused pool -> pool writes of ``PrefillManager`` (a mixin over ``RankBase``)."""

    def _pool_mapping(self, peer: DecodePeer) -> PoolMapping:
        """Whether ``peer``'s KV pool is mapped writable here on this pool's device (asked
        once, at its registration: a region's mapping does not change while imported)."""
        transport = self._live_transport
        mine = self._live_pool.device
        used = sorted({loc.region for loc in peer.locs})
        for r in used:
            device = transport.mapped_device(peer.regions[r])
            if device is None:
                return PoolMapping(
                    False,
                    f"transport {transport.name!r} does not map region {r} of the reader's KV pool in the "
                    f"writer's process (its bytes go through the transport's writes)",
                )
            if parse_device(device) != parse_device(mine):
                return PoolMapping(
                    False, f"the reader's KV pool region {r} is mapped on {device}, the writer's pool is on {mine}"
                )
        return PoolMapping(True, f"{transport.name} maps its {len(used)} KV region(s) on {mine}")

    def _write_fused(
        self,
        rec: PrefillRoom,
        plan: RequestPlan,
        peer: DecodePeer,
        start: int,
        stop: int,
        layers: tuple[int, int],
        ready: Synchronizable | None = None,
    ) -> None:
        """Copy tokens ``[start, stop)`` of ``layers`` from this pool into the reader's
        pool, after ``ready``, and count them once the copy finished. Raises (nothing is
        counted) where a view cannot be had or the reader exited meanwhile."""
        from sglang_kvxfer import ops

        t0 = time.perf_counter()
        reader = plan.transfer.decode_rank
        src_slice, dst_slice = plan.gather_slice(start, stop), plan.scatter_slice(start, stop)
        nbytes = plan.nbytes(start, stop, layers)
        k, v = plan.layer_buffers(self._live_pool.buffers, layers)
        with contextlib.ExitStack() as views:
            dst = self._mapped_buffers(peer, layers, views, rec.room)
            dk, dv = plan.layer_buffers(dst, layers, side="dst")
            t1 = time.perf_counter()
            self.copy_stream.run(lambda: ops.copy_kv_heads(k, v, src_slice, dk, dv, dst_slice), ready)
        # The views are closed: the transport saw the reader alive after the copy.
        rec.timings["plan"] += t1 - t0
        rec.timings["wire"] += time.perf_counter() - t1  # the move into the reader's memory
        rec.bytes += nbytes
        rec.ops += 1
        rec.pool_read_bytes += nbytes  # one read of the slice per reader: fan-out copies it again
        rec.reader_bytes[reader] += nbytes
        rec.reader_ops[reader] += 1

    def _mapped_buffers(
        self, peer: DecodePeer, layers: tuple[int, int], views: contextlib.ExitStack, room: int
    ) -> list[Any]:
        """The reader's KV buffers of ``layers`` as tensors over its regions mapped here
        (other entries None, so ``layer_buffers`` can cut the list), valid while ``views``
        holds the regions' views. The tensors are made once per reader and kept
        (``peer.mapped_buffers``): slicing and reshaping 2 x num_layers views costs about a
        millisecond on a loaded CPU, per chunk otherwise. A kept tensor is used only while
        a fresh view of its region is held, and only if that view starts where the one it
        was cut from did."""
        place = peer.placement
        g = place.geometry
        transport = self._live_transport
        wanted = [b for b in range(g.num_buffers) if layers[0] <= RequestPlan.buffer_layer(g, b) < layers[1]]
        bases: dict[int, Any] = {}
        for b in wanted:
            r = peer.locs[b].region
            if r not in bases:
                region = peer.regions[r]
                bases[r] = views.enter_context(transport.remote_view(region, 0, region.nbytes))
                if bases[r] is None:
                    raise TransferFailedError(
                        f"decode rank {peer.tp_rank}'s KV region {r} is no longer mapped here", room
                    )
        dtype = torch_dtype(g.dtype)
        out: list[Any] = [None] * g.num_buffers
        for b in wanted:
            loc = peer.locs[b]
            base = bases[loc.region]
            kept = peer.mapped_buffers.get(b)
            if kept is None or kept[0] != base.data_ptr():
                raw = base[loc.offset : loc.offset + place.buffer_nbytes(b)]
                kept = peer.mapped_buffers[b] = (base.data_ptr(), raw.view(dtype).view(place.buffer_shape(b)))
            out[b] = kept[1]
        return out
