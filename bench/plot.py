"""Shared plotting helper for the benchmarks: time and memory against sequence length, log-log."""

from __future__ import annotations

from pathlib import Path


def plot_scaling(
    rows: list[dict], path: Path, title: str, memory_label: str, xlabel: str = "sequence length n"
) -> None:
    """Two panels (median time, peak memory) against n (named ``xlabel``), one line per peer; the memory panel only
    when no row has a time.

    ``rows``: dicts with ``peer``, ``n``, ``status`` and, when ``status == "ok"``, ``peak_mem_bytes`` and ``time_s``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("time_s", "median time per step (s)", 1.0), ("peak_mem_bytes", memory_label, 2.0**-20)]
    if not any("time_s" in row for row in rows):
        panels = panels[1:]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    axes = axes[0]
    for ax, (key, label, scale) in zip(axes, panels):
        for peer in dict.fromkeys(row["peer"] for row in rows):
            done = [row for row in rows if row["peer"] == peer and row["status"] == "ok"]
            if done:
                ax.plot([r["n"] for r in done], [r[key] * scale for r in done], marker="o", label=peer)
        ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel=label)
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
