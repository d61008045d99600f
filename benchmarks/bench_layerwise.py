"""Layer-wise streaming vs a whole-request send after the forward pass; prints one JSON object.

A simulated forward pass computes ``--layers`` layers of ``--layer-ms`` each (a sleep on the
caller's thread, as a GPU forward leaves the host free). Per request and case:

* ``layerwise``: after each layer, ``KVSender.send(pages, layers=range(l, l + 1))`` (the
  last one with ``last_chunk``), so the transfer of layer l overlaps the compute of l + 1.
* ``baseline`` (same run, interleaved request by request): the whole forward first, then
  one ``send(pages, last_chunk=True)``, as the engine did before layer-wise streaming.

Measured: ``tail_s``, the time from the last layer's ready event (its compute ended) to
the decode receiver's Success, and ``ttft_s``, forward start to Success. Medians over
``--requests`` requests. The target for ``layerwise``: ``tail_s`` at most one layer's
transfer time (``layer_transfer_s``: the baseline's ``tail_s`` / layers) + 1 ms.

Prefill and decode run as managers of this process (threads, each with its own transport,
pool and sockets; the ``tcp`` transport still moves every byte over loopback sockets), one
prefill rank and one decode rank; ``--path direct`` (page runs) or ``staged`` (gather ->
one write per layer -> scatter). The last request of each case is checked byte for byte.

    python benchmarks/bench_layerwise.py                        # local and tcp, direct and staged
    python benchmarks/bench_layerwise.py --transport tcp --requests 20
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time


def _geometry(layers: int, tokens: int, page_size: int):
    from sglang_kvxfer.geometry import KVGeometry

    return KVGeometry(
        num_layers=layers,
        total_kv_heads=8,
        head_dim=128,
        v_head_dim=128,
        dtype="bf16",
        mla=False,
        page_size=page_size,
        layout="NHD",
        num_pages=2 * (-(-tokens // page_size)) + 8,
    )


def _wait_success(rx, deadline_s: float) -> float:
    from sglang_kvxfer.engine import KVPoll

    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        state = rx.poll()
        if state is KVPoll.Success:
            return time.perf_counter()
        if state is KVPoll.Failed:
            raise RuntimeError(f"request failed: {rx.failure_reason}")
        time.sleep(0.0001)
    raise TimeoutError(f"no Success within {deadline_s} s")


def _request(pre, dec, room: int, src, dst, tokens: int, layers: int, layer_s: float, layerwise: bool) -> dict:
    from sglang_kvxfer.engine import KVReceiver, KVSender

    rx = KVReceiver(dec, room)
    rx.send_metadata(dst, num_tokens=tokens)
    tx = KVSender(pre, room)
    t0 = time.perf_counter()
    for layer in range(layers):
        time.sleep(layer_s)  # the layer's compute
        if layerwise:
            ready_at = time.perf_counter()
            tx.send(src, last_chunk=layer == layers - 1, layers=range(layer, layer + 1))
    if not layerwise:
        ready_at = time.perf_counter()
        tx.send(src, last_chunk=True)
    done = _wait_success(rx, 60.0)
    out = {"tail_s": done - ready_at, "ttft_s": done - t0}
    tx.poll()
    tx.clear()
    rx.clear()
    return out


def run_case(transport: str, path: str, args) -> dict:
    import numpy as np

    from sglang_kvxfer.engine import BootstrapServer, EngineConfig, KVManager
    from sglang_kvxfer.engine.synthetic import fill_request, verify_request

    g = _geometry(args.layers, args.tokens, args.page_size)
    layer_bytes = args.tokens * 8 * 256 * 2
    opts = dict(
        data_path=path,
        staging_bytes=max(64 << 20, 4 * layer_bytes * args.layers),
        staging_slot_bytes=max(1 << 20, layer_bytes * args.layers),
        num_workers=2,
    )
    n_pages = -(-args.tokens // args.page_size)
    src, dst = np.arange(n_pages), np.arange(n_pages, 2 * n_pages)
    with BootstrapServer() as boot:
        pre = KVManager(EngineConfig("prefill", g, 1, 0, boot.address, transport, **opts))
        dec = KVManager(EngineConfig("decode", g, 1, 0, boot.address, transport, **opts))
        try:
            pre.wait_registered(30)
            rows: dict[str, list[dict]] = {"layerwise": [], "baseline": []}
            room = 1
            for i in range(args.warmup + args.requests):
                for kind in ("layerwise", "baseline"):
                    room += 1
                    if i == args.warmup + args.requests - 1:
                        fill_request(pre.placement, pre.pool.buffers, room, src, 0, args.tokens)
                    r = _request(
                        pre, dec, room, src, dst, args.tokens, args.layers, args.layer_ms / 1e3, kind == "layerwise"
                    )
                    if i == args.warmup + args.requests - 1:
                        problems = verify_request(dec.placement, dec.pool.buffers, room, dst, args.tokens)
                        if problems:
                            raise RuntimeError(f"{kind} request {room} is not byte-exact: {problems[:3]}")
                    if i >= args.warmup:
                        rows[kind].append(r)
        finally:
            pre.close()
            dec.close()
            boot.close()

    def med(kind: str, key: str) -> float:
        return round(statistics.median(r[key] for r in rows[kind]), 6)

    base_tail = med("baseline", "tail_s")
    layer_transfer = base_tail / args.layers
    lw_tail = med("layerwise", "tail_s")
    return {
        "transport": transport,
        "path": path,
        "request_bytes": layer_bytes * args.layers,
        "layer_bytes": layer_bytes,
        "layerwise": {"tail_s_p50": lw_tail, "ttft_s_p50": med("layerwise", "ttft_s")},
        "baseline": {"tail_s_p50": base_tail, "ttft_s_p50": med("baseline", "ttft_s")},
        "layer_transfer_s": round(layer_transfer, 6),
        "target_tail_s": round(layer_transfer + 1e-3, 6),
        "meets_target": lw_tail <= layer_transfer + 1e-3,
        "tail_ratio_vs_baseline": round(lw_tail / base_tail, 3) if base_tail else None,
        "verified": True,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--transport", default="local,tcp")
    ap.add_argument("--path", default="direct,staged")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--layer-ms", type=float, default=2.0)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--requests", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    cases = []
    for transport in args.transport.split(","):
        for path in args.path.split(","):
            cases.append(run_case(transport, path, args))
    print(
        json.dumps(
            {
                "bench": "layerwise",
                "host": platform.node(),
                "python": sys.version.split()[0],
                "layers": args.layers,
                "layer_ms": args.layer_ms,
                "tokens": args.tokens,
                "requests": args.requests,
                "cases": cases,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
