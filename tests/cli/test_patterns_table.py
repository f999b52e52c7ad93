"""``benchmarks/patterns_table.py``: the columns of the methods a run measured, and the speed
ratios (cross-process ``ppermute`` over MPI against the one-op psend/precv exchange and
against gloo) as the median over rounds of the within-round ratio."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "patterns_table.py"
_spec = importlib.util.spec_from_file_location("patterns_table", _PATH)
patterns_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(patterns_table)


def _result(method: str, size: int, rounds: list[float]) -> dict:
    median = sorted(rounds)[len(rounds) // 2]
    return {"method": method, "kind": "exchange", "size": size,
            "latency_us": {"median": median}, "round_medians_us": rounds}


def test_ppermute_columns_and_ratios(tmp_path) -> None:
    results = [_result("mpi4py", 8, [2.0, 2.0, 2.0]), _result("psend/scan", 8, [4.0, 2.0, 4.0]),
               _result("ppermute/scan", 8, [4.0, 4.0, 2.0]),
               _result("gloo/scan", 8, [100.0, 80.0, 120.0]),
               _result("psend/scan", 1 << 20, [1000.0, 1100.0, 900.0]),
               _result("ppermute/scan", 1 << 20, [2000.0, 1100.0, 1000.0])]
    (tmp_path / "results.jsonl").write_text(
        "\n".join(json.dumps(r) for r in [{"type": "header"}, *results]) + "\n")
    assert patterns_table.main(["x", str(tmp_path)]) == 0
    head, _, *rows = (tmp_path / "table.md").read_text().splitlines()
    # psend2/scan was not in the run: no column, no ratio.
    assert head == ("| pattern | size | `mpi4py` | `psend/scan` | `ppermute/scan` | `gloo/scan` | "
                    "`psend/scan` / MPI | `ppermute/scan` / `psend/scan` | "
                    "`ppermute/scan` / gloo |")
    # Within-round ratios psend/ppermute 1, 0.5, 2 -> x1.00; gloo/ppermute 25, 20, 60 -> x25.
    assert rows[0] == ("| exchange | 8 B | 2.0 us | 4.0 us | 4.0 us | 100.0 us | x0.50 | "
                       "x1.00 | x25.00 |")
    assert rows[1] == "| exchange | 1 MiB |  | 1.00 ms | 1.10 ms |  |  | x0.90 |  |"
