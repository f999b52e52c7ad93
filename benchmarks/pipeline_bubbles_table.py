"""One table from the JSON files of several ``pipeline_bubbles.py`` runs: per layout and
schedule, the bubble from the schedule's theory down to the measured one, medians over
the runs (each run itself the median of its steps).

    python benchmarks/pipeline_bubbles_table.py benchmarks/results/DIR/bubbles

Files are grouped by name: ``LAYOUT-runN.json`` (``p2-1proc-d4-kept-run2.json``: layout
``p2-1proc-d4-kept``). Columns, each the share of the step no stage computes in:

* ``theory``: ``Schedule.bubble_fraction`` (every action one tick, messages free);
* ``median costs``: the table run as dataflow with each action at the median time of its
  kind on its stage (what a machine whose actions always took that long would give);
* ``each tick's time``: the same with every tick's own measured time (the spread of the
  actions' times included);
* ``executor``: the executor simulated at those times (ticks, messages in their ticks);
* ``measured``: the step from stage 0's start (``idle_from_entry``), each run's median;
* ``x theory``: measured over theory; ``spread``: the median coefficient of variation of
  an action's time over its ticks.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main(directory: str) -> int:
    rows: dict[tuple[str, str], list[dict]] = {}
    for path in sorted(Path(directory).glob("*.json")):
        layout = path.stem.rsplit("-run", 1)[0]
        for r in json.loads(path.read_text())["rows"]:
            rows.setdefault((layout, r["schedule"]), []).append(r)
    print("| layout | schedule | theory | median costs | each tick's time | executor | "
          "measured (runs) | x theory | spread |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for (layout, schedule), runs in rows.items():
        def median(key: str, runs: list[dict] = runs) -> float:
            return statistics.median(r[key] for r in runs)

        spread = statistics.median(statistics.median(r["action_cv"].values()) for r in runs)
        measured = " / ".join(f"{r['idle_from_entry']:.3f}" for r in runs)
        print(f"| {layout} | {schedule} | {runs[0]['theory']:.3f} | "
              f"{median('dataflow_median_costs'):.3f} | {median('dataflow'):.3f} | "
              f"{median('weighted_sim'):.3f} | {measured} | "
              f"{median('idle_from_entry') / runs[0]['theory']:.2f} | {spread:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
