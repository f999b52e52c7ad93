"""The docs' collectives page from a results folder of ``python -m jax_cpu_mpi.bench.collectives``.

    python benchmarks/collectives_table.py benchmarks/results/collectives/<machine>

Reads every ``<op>_perf-<P>x<k>.json`` there and writes ``collectives.md`` (one nccl-tests
table per benchmark and mesh, then a summary of ours against mpi4py and gloo) and, with
matplotlib, ``collectives.png`` (busbw against size: gloo, ours, mpi4py and mpi4py
carried, one panel per benchmark). docs/benchmarks.md includes both.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jax_cpu_mpi.bench.collectives import OPS, _table


def load(folder: Path) -> list[dict]:
    runs = [json.loads(p.read_text()) for p in sorted(folder.glob("*_perf-*.json"))]
    for run, path in zip(runs, sorted(folder.glob("*_perf-*.json")), strict=True):
        run.setdefault("op", path.name.split("_perf-")[0])
    order = {op: i for i, op in enumerate(OPS)}
    return sorted(runs, key=lambda r: (order.get(r["op"], 99), r["devices_per_rank"]))


def _span(rows: list[dict], key: str, digits: int) -> str:
    """"min - max" of the rows' ``key``, leaving out NaN (a method the run left out); "-"
    where no row has a value (a run from before the key)."""
    values = [row[key] for row in rows if row.get(key, float("nan")) == row.get(key)]
    return f"{min(values):.{digits}f} - {max(values):.{digits}f}" if values else "-"


def summary(runs: list[dict]) -> str:
    lines = ["| benchmark | ranks x devices | ours / mpi4py speed (min - max) | "
             "ours / mpi4py carried speed (min - max) | gloo / ours time (min - max) |",
             "|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['op']}_perf | {r['ranks']} x {r['devices_per_rank']} | "
                     f"{_span(r['rows'], 'mpi_vs_mpi4py', 2)} | "
                     f"{_span(r['rows'], 'mpi_vs_carried', 2)} | "
                     f"{_span(r['rows'], 'gloo_vs_mpi', 1)} |")
    return "\n".join(lines)


def plot(runs: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in OPS if any(r["op"] == op for r in runs)]
    fig, axes = plt.subplots(1, len(ops), figsize=(4.2 * len(ops), 3.6), squeeze=False)
    for ax, op in zip(axes[0], ops, strict=True):
        for r in (r for r in runs if r["op"] == op):
            style = "-" if r["devices_per_rank"] == 1 else "--"
            for method, color in (("gloo", "tab:red"), ("mpi", "tab:blue"),
                                  ("mpi4py", "tab:gray"), ("mpi4py-carried", "tab:olive")):
                key = f"{method}_busbw_GBps"
                if method.startswith("mpi4py") and r["devices_per_rank"] != 1:
                    continue
                if not any(key in row for row in r["rows"]):
                    continue  # a run from before the method
                ax.plot([row["bytes"] for row in r["rows"]],
                        [row.get(key, float("nan")) for row in r["rows"]], style,
                        color=color, marker=".",
                        label=f"{'ours' if method == 'mpi' else method} "
                              f"{r['ranks']}x{r['devices_per_rank']}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{op}_perf")
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        raise SystemExit(__doc__)
    folder = Path(argv[0])
    runs = load(folder)
    if not runs:
        raise SystemExit(f"{folder}: no *_perf-*.json")
    parts = [summary(runs)]
    # Runs from before --warmup timed each launch right after the other methods' (0).
    parts += [_table(r["op"], r["rows"], r["ranks"], r["devices_per_rank"], r.get("iters", 20),
                     r.get("warmup", 0), r.get("glibc_tunables")) for r in runs]
    (folder / "collectives.md").write_text("\n\n".join(parts) + "\n")
    try:
        plot(runs, folder / "collectives.png")
    except ImportError:
        print("no matplotlib: collectives.png not written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
