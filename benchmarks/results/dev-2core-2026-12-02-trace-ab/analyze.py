"""Summary of the interleaved A/B runs of ab.sh: per variant, the median over runs of each
run's minimum, 10th percentile and median per-hop time, and the ratios off/base and
on/base within each round (the figure: the median over rounds of those ratios).

usage: python analyze.py RAW_DIR
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path


def p10(values: list[float]) -> float:
    return sorted(values)[len(values) // 10]


STATS = {"min": min, "p10": p10, "median": statistics.median}


def main(directory: str) -> None:
    for mode in ("local", "mpi"):
        runs: dict[str, dict[int, list[float]]] = {}
        for path in Path(directory).glob(f"{mode}-*-*.json"):
            match = re.fullmatch(rf"{mode}-(\w+)-(\d+)\.json", path.name)
            text = path.read_text().strip()
            if match and text:
                per_hop = json.loads(text)["per_hop_us"]
                runs.setdefault(match.group(1), {})[int(match.group(2))] = per_hop
        if not runs:
            continue
        print(f"== {mode}: 8 B hop, per-hop us (1000 hops per jitted scan call)")
        for variant in ("base", "off", "on"):
            by_round = runs.get(variant, {})
            cells = []
            for name, stat in STATS.items():
                cells.append(f"{name}-of-run median "
                             f"{statistics.median(stat(h) for h in by_round.values()):6.2f}")
            mins = [min(h) for h in by_round.values()]
            print(f"  {variant:5s} runs {len(by_round):2d}  " + "  ".join(cells)
                  + f"  (min-of-run range {min(mins):.2f}..{max(mins):.2f})")
        for variant in ("off", "on"):
            rounds = sorted(set(runs.get(variant, {})) & set(runs.get("base", {})))
            for name, stat in STATS.items():
                ratios = [stat(runs[variant][k]) / stat(runs["base"][k]) for k in rounds]
                if ratios:
                    print(f"  {variant}/base per-round ratio of {name:6s}: median "
                          f"{statistics.median(ratios):.3f} (range {min(ratios):.3f}.."
                          f"{max(ratios):.3f}, {len(ratios)} rounds)")


if __name__ == "__main__":
    main(sys.argv[1])
