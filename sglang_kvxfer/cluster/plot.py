"""The ``kvxfer bench --plot`` figure: GB/s and latency against context length.

Owns ``plot_records(records, path)``: one line per configuration (every record field
except the context length), GB/s on the left with the same-run baseline as a dashed line
of the same colour, transfer latency p50 on the right with a p90 band. Needs matplotlib
(``pip install 'sglang_kvxfer[plot]'``), imported only here, with the file-only backend.
Must not parse command-line arguments or print: it writes the file and nothing else.
"""

from __future__ import annotations

__all__ = ["plot_records", "config_label"]

# Fields that may vary between records and then name a line (tokens is the x axis).
_LABEL_FIELDS = [
    ("total_kv_heads", "H{}"),
    ("head_dim", "d{}"),
    ("mla", "MLA={}"),
    ("prefill_page_size", "page {}"),
    ("decode_page_size", "->{}"),
    ("prefill_layout", "{}"),
    ("decode_layout", "->{}"),
    ("concurrency", "c{}"),
    ("chunk_tokens", "chunk {}"),
]


def config_label(record: dict, varying: set[str] | None = None) -> str:
    """A short name of the record's configuration: transport and TP pair, then the
    ``varying`` fields (all of them when ``varying`` is None)."""
    parts = [f"{record['transport']} P{record['prefill_tp']}->D{record['decode_tp']}"]
    parts += [fmt.format(record.get(key)) for key, fmt in _LABEL_FIELDS if varying is None or key in varying]
    return " ".join(parts).replace(" ->", "->")


def plot_records(records: list[dict], path: str, title: str = "kvxfer bench") -> None:
    """Write a PNG of ``records`` (``kvxfer bench`` JSON records) to ``path``."""
    if not records:
        raise ValueError("no records to plot")
    try:
        import matplotlib
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'sglang_kvxfer[plot]' (or matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    varying = {k for k, _ in _LABEL_FIELDS if len({str(r.get(k)) for r in records}) > 1}
    lines: dict[str, list[dict]] = {}
    for r in records:
        lines.setdefault(config_label(r, varying), []).append(r)
    fig, (ax_bw, ax_lat) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, rs) in enumerate(sorted(lines.items())):
        rs = sorted(rs, key=lambda r: r["tokens"])
        x = [r["tokens"] for r in rs]
        c = colors[i % len(colors)]
        style = ("s" if rs[0]["transport"] == "tcp" else "o") + "-"
        ax_bw.plot(x, [r["gbps"] for r in rs], style, color=c, label=label)
        ax_bw.plot(x, [r["baseline"]["gbps"] for r in rs], "--", color=c, alpha=0.6, linewidth=1)
        p50 = [r["latency_ms"]["p50"] for r in rs]
        ax_lat.plot(x, p50, style, color=c, label=label)
        ax_lat.fill_between(x, p50, [r["latency_ms"]["p90"] for r in rs], color=c, alpha=0.15)
    ticks = sorted({r["tokens"] for r in records})
    for ax in (ax_bw, ax_lat):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("context length (tokens per request)")
        ax.grid(True, which="major", alpha=0.3)
    ax_bw.set_ylabel("GB/s")
    ax_bw.set_yscale("log")
    ax_lat.set_ylabel("ms")
    ax_lat.set_yscale("log")
    ax_bw.set_title("throughput (solid: engine; dashed: plain baseline, same run)", fontsize=9)
    ax_lat.set_title("transfer latency per request (p50; band to p90)", fontsize=9)
    ax_lat.legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90, pil_kwargs={"optimize": True})
    plt.close(fig)
