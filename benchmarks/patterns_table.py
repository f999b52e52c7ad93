"""A markdown table of a ``--pattern`` run: each two-way pattern and size, every method.

    python benchmarks/patterns_table.py benchmarks/results/p2p/dev-2core/patterns

Reads ``results.jsonl`` of the folder and writes ``table.md`` next to it (and prints it). For
``exchange`` and ``ring`` a cell is the median time per step, for the one-way hop
(``pingpong`` in the run's ``--pattern``) the median time per hop (lower is better); for ``bibw``
and ``multi-pair`` the median bandwidth (higher is better). The ratio columns compare
psend/precv with raw MPI (``mpi4py``) as a speed ratio (>= 1: as fast or faster), the median
over rounds of the ratio within each round; with ``ppermute/scan`` in the run (cross-process
``ppermute`` over MPI), also ``ppermute/scan`` against ``psend/scan`` (the one-op exchange of
the same bytes) and against gloo's ``ppermute`` (``gloo/scan``). Only the methods of the run
get a column.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

METHODS = ("mpi4py", "psend/scan", "psend2/scan", "psend-donated/scan", "ppermute/scan",
           "gloo/scan")
#: Speed ratios (numerator, denominator, header): the first over the second.
RATIOS = (("psend/scan", "mpi4py", "`psend/scan` / MPI"),
          ("psend2/scan", "mpi4py", "`psend2/scan` / MPI"),
          ("psend-donated/scan", "mpi4py", "`psend-donated/scan` / MPI"),
          ("ppermute/scan", "psend/scan", "`ppermute/scan` / `psend/scan`"),
          ("ppermute/scan", "gloo/scan", "`ppermute/scan` / gloo"))
TIMED = ("latency", "exchange", "ring")
#: The row names of the kinds (``latency`` is ``--pattern pingpong``: half a round trip).
NAMES = {"latency": "one-way hop"}


def _size(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _cell(kind: str, size: int, median_us: float) -> str:
    if kind in TIMED:
        return f"{median_us:.1f} us" if median_us < 1000 else f"{median_us / 1000:.2f} ms"
    mbps = size / median_us  # bytes per us = MB/s
    return f"{mbps:.0f} MB/s" if mbps >= 10 else f"{mbps:.2g} MB/s"


def table(folder: Path) -> str:
    results = {}
    for line in (folder / "results.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "method" in r and "round_medians_us" in r:
            results[(r["method"], r["kind"], r["size"])] = r
    kinds = [k for k in ("latency", "exchange", "ring", "bibw", "multi-pair")
             if any(key[1] == k for key in results)]
    present = {key[0] for key in results}
    methods = [m for m in METHODS if m in present]
    ratio_cols = [r for r in RATIOS if r[0] in present and r[1] in present]
    lines = ["| pattern | size | " + " | ".join(f"`{m}`" for m in methods) + " | "
             + " | ".join(head for _, _, head in ratio_cols) + " |",
             "| --- | --- | " + " | ".join("---" for _ in methods + ratio_cols) + " |"]
    for kind in kinds:
        for size in sorted({key[2] for key in results if key[1] == kind}):
            cells = []
            for m in methods:
                r = results.get((m, kind, size))
                cells.append(_cell(kind, size, r["latency_us"]["median"]) if r else "")
            ratios = []
            for num, den, _ in ratio_cols:
                ours, theirs = results.get((num, kind, size)), results.get((den, kind, size))
                if ours and theirs:
                    # A time per step (or per message) in each: their time / ours = speed.
                    per_round = [a / b for a, b in zip(theirs["round_medians_us"],
                                                       ours["round_medians_us"], strict=False)]
                    ratios.append(f"x{statistics.median(per_round):.2f}")
                else:
                    ratios.append("")
            name = NAMES.get(kind, kind)
            lines.append(f"| {name} | {_size(size)} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    folder = Path(argv[1] if len(argv) > 1 else "benchmarks/results/p2p/dev-2core/patterns")
    text = table(folder)
    (folder / "table.md").write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
