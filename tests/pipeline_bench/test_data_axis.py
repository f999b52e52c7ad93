"""The data-axis pipeline benchmark's driver (``benchmarks/pipeline/data_axis.py``), without
running it: the launches hold the documented mesh and both settings in alternating order, and
the table's times, ratio and failures come out of the recorded results (the measurement
itself takes minutes; ``benchmarks/results/pipeline/dev-2core/data-axis`` holds one), and
one small launch of ``jax_bench.py`` with the data axis across two processes."""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path

import pytest

from mpi_launcher import run_mpi

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "pipeline" / "data_axis.py"
_spec = importlib.util.spec_from_file_location("pipeline_data_axis", _PATH)
data_axis = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(data_axis)


def _flags(cmd: list[str]) -> dict[str, str]:
    return {k: v for k, v in itertools.pairwise(cmd) if k.startswith("--")}


def test_launches_put_the_stages_in_a_process_and_the_data_across() -> None:
    a = data_axis.parse_args(["--stages", "2", "--data", "2", "--width", "64", "--rounds", "3"])
    orders = data_axis.orders(a.rounds)
    assert orders == [("gloo", "mpi"), ("mpi", "gloo"), ("gloo", "mpi")]
    # A launch per setting (JAX_CPU_MPI_COLLECTIVES), or both in one with --together.
    assert data_axis.round_launches(orders[1], False) == [("mpi",), ("gloo",)]
    assert data_axis.round_launches(orders[1], True) == [("mpi", "gloo")]
    cmd = data_axis.command(a, orders[1], "/x/mpirun")
    assert cmd[:3] == ["/x/mpirun", "-n", "2"] and cmd[4].endswith("jax_bench.py")
    flags = _flags(cmd)
    assert flags["--data"] == "2" and flags["--stages"] == "2" and flags["--devices"] == "2"
    assert flags["--collectives"] == "mpi,gloo" and flags["--schedule"] == "1f1b,gpipe"
    assert flags["--width"] == "64"
    a = data_axis.parse_args(["--stages", "4", "--data", "3", "--batch", "48"])
    cmd = data_axis.command(a, ("gloo", "mpi"), "mpirun")
    flags = _flags(cmd)
    assert (cmd[2], flags["--devices"], flags["--data"]) == ("3", "4", "3")


@pytest.mark.parametrize("argv, message", [
    (["--data", "1"], "--data must be at least 2"),
    (["--batch", "100"], "--batch 100 must be a multiple of --microbatches x --data = 16"),
    (["--schedules", "1f1b,dualpipe"], "--schedules: unknown dualpipe"),
])
def test_bad_options_say_what_to_change(argv, message, capsys) -> None:
    with pytest.raises(SystemExit):
        data_axis.parse_args(argv)
    assert message in capsys.readouterr().err


def _result(schedule: str, setting: str, step_ms: float, ok: bool = True,
            diff: float = 0.0, digest: str = "d") -> dict:
    return {"schedule": schedule, "collectives": setting, "digest": digest,
            "step_seconds": [[step_ms / 1e3] * 3, [step_ms / 1e3] * 3],
            "mpi_all_reduce_calls": 3 if setting == "mpi" else 0,
            "check": {"ok": ok, "grad_rel_diff": 2e-7, "loss_rel_diff": 1e-9,
                      "same_as_first_setting": {"ok": ok, "grads_max_abs_diff": diff,
                                                "loss_abs_diff": 0.0, "lowering_ok": True,
                                                "against": "gloo"}}}


def _meta() -> dict:
    return {"date": "2026-12-04 19:00 UTC", "machine": "x86_64, 2 cores", "jax": "0",
            "python": "3", "loadavg_start": [2.0, 0, 0], "loadavg_end": [3.0, 0, 0],
            "git": {"head": "abc", "uncommitted": []}}


def test_table_gives_each_setting_and_the_ratio_over_rounds(tmp_path) -> None:
    a = data_axis.parse_args(["--rounds", "3", "--together"])
    runs = {"1f1b@gloo": [_result("1f1b", "gloo", t) for t in (30, 40, 36)],
            "1f1b@mpi": [_result("1f1b", "mpi", t) for t in (20, 40, 24)],
            "gpipe@gloo": [_result("gpipe", "gloo", 50), {"error": "exit 1"},
                           _result("gpipe", "gloo", 50)],
            "gpipe@mpi": [_result("gpipe", "mpi", 50, diff=1e-8), {"error": "exit 1"},
                          _result("gpipe", "mpi", 50, ok=False, diff=1e-8)]}
    text = data_axis.write(a, tmp_path, runs, ["machine shared"], _meta())
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    # Ratios per round 1.5, 1.0, 1.5: the median 1.5; medians over every step 36 and 24 ms.
    assert rows["| 1F1B"].split(" | ")[1:6] == ["36.00", "24.00", "1.50x", "1.00-1.50",
                                                "PASS (2.0e-07)"]
    assert "bit-equal" in rows["| 1F1B"]
    # A failed check, or a launch that failed, shows as FAIL; different gradients show.
    assert "FAIL" in rows["| GPipe"] and "max |diff| 1.0e-08" in rows["| GPipe"]
    assert "- machine shared" in text and "3 MPI all-reduce(s)" in text
    assert (tmp_path / "data-axis.md").read_text() == text
    # The table is written again, the same, from the recorded JSON.
    (tmp_path / "data-axis.md").unlink()
    assert data_axis.main(["--from-json", str(tmp_path / "data-axis.json")]) == 0
    assert (tmp_path / "data-axis.md").read_text() == text


def test_separate_launches_compare_digests(tmp_path) -> None:
    # One setting per launch: a launch compares its setting with itself only (diff 0), so
    # the table goes by the digests of loss and gradients across launches.
    a = data_axis.parse_args(["--rounds", "2", "--schedules", "1f1b,gpipe"])

    def alone(schedule, setting, ms, digest="d"):
        r = _result(schedule, setting, ms, digest=digest)
        r["check"]["same_as_first_setting"]["against"] = setting
        return r

    runs = {"1f1b@gloo": [alone("1f1b", "gloo", 30), alone("1f1b", "gloo", 30)],
            "1f1b@mpi": [alone("1f1b", "mpi", 20), alone("1f1b", "mpi", 20)],
            "gpipe@gloo": [alone("gpipe", "gloo", 30), alone("gpipe", "gloo", 30)],
            "gpipe@mpi": [alone("gpipe", "mpi", 20), alone("gpipe", "mpi", 20, digest="e")]}
    text = data_axis.write(a, tmp_path, runs, [], _meta())
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    assert rows["| 1F1B"].endswith("| 1.50x | 1.50-1.50 | PASS (2.0e-07) | bit-equal |")
    assert rows["| GPipe"].endswith("| FAIL (2.0e-07) | DIFFER |")
    assert "separate launches" in text


def test_a_setting_without_results_is_a_failed_row(tmp_path) -> None:
    a = data_axis.parse_args(["--rounds", "1", "--schedules", "1f1b"])
    runs = {"1f1b@gloo": [{"error": "timed out"}], "1f1b@mpi": [{"error": "timed out"}]}
    text = data_axis.write(a, tmp_path, runs, [], _meta())
    assert "| 1F1B | failed: timed out |" in text
    dump = json.loads((tmp_path / "data-axis.json").read_text())
    assert dump["rows"][0]["check"] is False


@pytest.mark.mpi
@pytest.mark.timeout(90)
def test_a_small_launch_gives_both_settings_the_same_loss_and_gradients(tmp_path) -> None:
    out = tmp_path / "r.json"
    run = run_mpi(str(_PATH.parent / "jax_bench.py"), "--schedule", "1f1b", "--devices", "2",
                  "--stages", "2", "--data", "2", "--collectives", "gloo,mpi", "--layers", "2",
                  "--width", "8", "--batch", "16", "--microbatches", "2", "--steps", "1",
                  "--repeats", "1", "--warmup", "0", "--out", str(out), nprocs=2,
                  devices_per_process=2, timeout=80)
    assert run.returncode == 0 and out.exists(), run.report()  # exit 1: a check failed
    by = {r["collectives"]: r for r in json.loads(out.read_text())["results"]}
    assert set(by) == {"gloo", "mpi"}, by
    # The pmean over the data axis crossed processes over MPI in one program, not the other.
    assert by["mpi"]["mpi_all_reduce_calls"] > 0 and by["gloo"]["mpi_all_reduce_calls"] == 0
    assert by["gloo"]["digest"] == by["mpi"]["digest"]
    for r in by.values():
        assert r["check"]["ok"] and r["check"]["same_as_first_setting"]["lowering_ok"], r
        assert "2 stages x 2 data shards" in r["layout"]
