"""Plot a recorded benchmark run: latency and bandwidth against size, one line per method.

    python benchmarks/plot_results.py benchmarks/results/<run> [OUT.png]

Reads ``<run>/results.jsonl`` and, if present, ``<run>/one-process/results.jsonl`` (what
``benchmarks/run.sh`` writes) and writes ``<run>/plot.png`` (or OUT.png): the medians of
every method, the two-rank ones solid, the one-process ones dashed. Needs matplotlib.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(run: Path) -> tuple[dict, dict[tuple[str, str], list[tuple[int, float]]]]:
    """(the run record, {(method, kind): [(size, median), ...]}) of a run folder."""
    header: dict = {}
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for path in (run / "results.jsonl", run / "one-process" / "results.jsonl"):
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["type"] == "run" and not header:
                header = record
            if record["type"] != "result":
                continue
            value = (record["latency_us"]["median"] if record["kind"] == "latency"
                     else record["bandwidth_MBps"]["median"])
            series.setdefault((record["method"], record["kind"]), []).append(
                (record["size"], value))
    if not series:
        raise SystemExit(f"{run}: no results.jsonl with results")
    return header, series


def plot(run: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from jax_cpu_mpi.bench.plot import style_size_axes

    header, series = load(run)
    fig, (lat_ax, bw_ax) = plt.subplots(1, 2, figsize=(12, 4.8))
    for (method, kind), points in sorted(series.items()):
        sizes, values = zip(*sorted(points), strict=True)
        ax = lat_ax if kind == "latency" else bw_ax
        local = "local" in method or method == "memcpy"
        ax.plot(sizes, values, "--" if local else "-",
                marker="o" if method.startswith("psend") else ".", label=method)
    style_size_axes(lat_ax, bw_ax, "one-way latency per hop (us), median")
    fig.suptitle(f"{run.name}: jax {header.get('jax', '?')}, {header.get('cpus', '?')} CPUs, "
                 "solid: 2 MPI ranks, dashed: one process", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    run_dir = Path(sys.argv[1])
    plot(run_dir, Path(sys.argv[2]) if len(sys.argv) > 2 else run_dir / "plot.png")
