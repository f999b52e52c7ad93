"""The stress matrix (scripts/stress_matrix.py) in miniature: one launch of the body of
JAX's test_psend_precv_basic_with_no_deadlock_cycle under CPU load (busy loops that never
yield, on every core but one) and one oversubscribed (4 ranks), and a long run of 30,000
steps. The full matrix (20 launches of each program, a busy loop on every core, quiet
launches, 10^5 steps) runs outside the suite (docs/reliability.md).

Only outcomes are checked (no launch stuck, every result right, no file descriptor or
thread growth): the times the script records are for the matrix, not for a test. So no
quiet launches (``--quiet-runs 0``): their times only judge a launch *late*, which no test
could assert on a shared machine. A busy loop on every core but one, not on every core: the
ranks still compete for the cores with processes that never yield (on CI's 2 cores, the two
ranks and one loop, and the suite's other worker on the core left), and a loop on that
core would only take it from the other worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_launches_under_load_and_oversubscribed_and_a_long_run(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "stress_matrix.py"), "--only", "jax-cycle",
         "--conditions", "load", "oversub", "--launches", "1", "--quiet-runs", "0",
         "--load-procs", str(max(1, (os.cpu_count() or 2) - 1)),
         "--long-steps", "30000", "--limit", "120", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=280, cwd=ROOT)
    out = proc.stdout + proc.stderr
    launches = json.loads((tmp_path / "matrix.json").read_text())
    assert {r["condition"] for r in launches} == {"load", "oversub"}, out
    assert {r["ranks"] for r in launches} == {2, 4}, out
    for r in launches:
        assert not r["stuck"] and r["ok"], out
        assert r["late"] is None, out  # no quiet time, nothing judged late
    assert "| jax-cycle | load | 2 x 4 | 1 | 0 | 0 | - | - |" in out, out
    long = json.loads((tmp_path / "long_run.json").read_text())
    assert long["ok"] and sorted(long["growth"]) == ["0", "1"], out
    for growth in long["growth"].values():
        assert growth["fd_growth"] == 0 and growth["thread_growth"] == 0, out
