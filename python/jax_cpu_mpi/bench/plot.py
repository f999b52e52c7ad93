"""The PNG plot: latency and bandwidth against message size, one line per method.

matplotlib is optional: :func:`write_plot` returns a note instead of a file without it.
"""

from __future__ import annotations

from typing import Any

from .stats import Measurement


def style_size_axes(lat_ax: Any, bw_ax: Any,
                    latency_label: str = "one-way latency (us), median") -> None:
    """Log-log axes over message size for a latency and a bandwidth panel, labelled, gridded,
    with a legend where lines were drawn (also used by benchmarks/plot_results.py)."""
    for ax, label in ((lat_ax, latency_label), (bw_ax, "bandwidth (MB/s), median")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)


def write_plot(results: list[Measurement], path: str, title: str) -> str | None:
    """Writes the plot to ``path``; returns None, or why no plot was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    import numpy as np

    fig, (lat_ax, bw_ax) = plt.subplots(1, 2, figsize=(14, 5.5))
    series: dict[tuple[str, str], list[Measurement]] = {}
    for m in results:
        series.setdefault((m.method, m.kind), []).append(m)
    names = list(dict.fromkeys(method for method, _ in series))
    palette = plt.get_cmap("tab20")
    colors = {name: palette(i % 20) for i, name in enumerate(names)}
    for (method, kind), ms in series.items():
        ms = sorted(ms, key=lambda m: m.size)
        sizes = [m.size for m in ms]
        style = "--" if method.endswith("/call") else "-"
        marker = "o" if method.startswith("psend") else "."
        if kind == "latency":
            values = [float(np.median(m.seconds)) * 1e6 for m in ms]
            lat_ax.plot(sizes, values, style, marker=marker, label=method, color=colors[method])
        else:
            values = [m.bandwidth_mbps()["median"] for m in ms]
            bw_ax.plot(sizes, values, style, marker=marker, label=method, color=colors[method])
    style_size_axes(lat_ax, bw_ax)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
