"""PNG plots of the training benchmarks' records: throughput (tokens/s) and per-rank peak memory (peak RSS), tiers
next to its torch peer for every strategy, one panel per world size.

matplotlib is optional (`pip install matplotlib`); write_plots raises ImportError without it. The Agg backend is
used: no display needed.
"""

from __future__ import annotations

import os
import textwrap

PLOTS = (  # file, record field, axis label, scale, title
    ("throughput.png", "throughput", "tokens/s", 1.0, "Training throughput (higher is better)"),
    ("memory.png", "peak_rss_per_rank_bytes", "peak RSS per rank (MB)", 1e-6,
     "Per-rank peak memory (lower is better)"),
)


def pairs(records: list[dict], key: str) -> dict[int, list[tuple[str, float, float]]]:
    """{world: [(label, ours, peer), ...]} for every "ours" record of a training benchmark (throughput in tokens/s)
    whose peer record (same benchmark and world, system = its peer) has `key` too."""
    out: dict[int, list[tuple[str, float, float]]] = {}
    for r in records:
        if r.get("role") != "ours" or r.get("unit") != "tokens/s" or r.get(key) is None:
            continue
        peer = next((p for p in records if p.get("role") == "peer" and p["benchmark"] == r["benchmark"]
                     and p["world"] == r["world"] and p["system"] == r.get("peer") and p.get(key) is not None), None)
        if peer is None:
            continue
        label = f"{r.get('strategy') or r['system']}\nvs " + "\n".join(textwrap.wrap(r["peer"], 22,
                                                                                   break_long_words=False))
        out.setdefault(r["world"], []).append((label, r[key], peer[key]))
    return out


def write_plots(records: list[dict], directory: str, *, quick: bool = False, machine: str = "") -> list[str]:
    """Writes throughput.png and memory.png into `directory`; returns the paths written (none when no record has a
    peer to pair with). Raises ImportError when matplotlib is missing."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, key, ylabel, scale, title in PLOTS:
        by_world = pairs(records, key)
        if not by_world:
            continue
        worlds = sorted(by_world)
        widths = [max(len(by_world[w]), 1) for w in worlds]
        fig, axes = plt.subplots(1, len(worlds), figsize=(2.0 + 2.2 * sum(widths), 5.2), squeeze=False,
                                 gridspec_kw={"width_ratios": widths})
        for ax, world in zip(axes[0], worlds):
            groups = by_world[world]
            xs = range(len(groups))
            ours = [g[1] * scale for g in groups]
            peer = [g[2] * scale for g in groups]
            bars = ax.bar([x - 0.2 for x in xs], ours, 0.4, label="tiers", color="tab:blue")
            ax.bar([x + 0.2 for x in xs], peer, 0.4, label="torch peer", color="tab:gray")
            for bar, o, p in zip(bars, ours, peer):
                ax.annotate(f"{o / p:.2f}×" if p else "", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)
            ax.set_xticks(list(xs))
            ax.set_xticklabels([g[0] for g in groups], fontsize=7)
            ax.set_title("1 process" if world == 1 else f"{world} ranks", fontsize=10)
            ax.set_ylabel(ylabel)
            ax.margins(y=0.12)
        handles, names = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, names, fontsize=8, loc="upper right")
        fig.suptitle(title + (" — QUICK RUN, tiny models: not measurements" if quick else "")
                     + "\nabove each tiers bar: tiers ÷ peer", fontsize=11)
        if machine:
            fig.text(0.01, 0.01, machine, fontsize=7, color="dimgray")
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
