"""The transformer benchmark's runner (``benchmarks/transformer/run.py``), without running
it: both sides get the same model and mesh, the layouts launch as documented, and the
table's ratio and failures come out of the recorded results (the measurement itself is no
test: it takes minutes, and torch is no dependency of the suite)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "transformer" / "run.py"
_spec = importlib.util.spec_from_file_location("transformer_bench_run", _PATH)
run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run)


def _flags(cmd: list[str]) -> dict[str, str]:
    return {k: v for k, v in itertools.pairwise(cmd) if k.startswith("--")}


def test_both_sides_get_the_same_model_and_mesh() -> None:
    a = run.parse_args(["--width", "64", "--layers", "8", "--dropout", "0.2"])
    plan = run.launches(a, "/torch/python", "mpirun")
    assert [(L["framework"], L["variant"], L["layout"]) for L in plan] == [
        ("jax", "kept", "1x4"), ("jax", "remat", "1x4"), ("torch", "", "1x4"),
        ("jax", "kept", "2x2"), ("jax", "remat", "2x2"), ("torch", "", "2x2")]
    model = ["--layers", "--width", "--heads", "--seq-len", "--batch", "--microbatches",
             "--dropout", "--seed", "--stages", "--data", "--steps", "--warmup-steps"]
    for layout in ("1x4", "2x2"):
        sides = [_flags(L["cmd"]) for L in plan if L["layout"] == layout]
        assert all({k: s[k] for k in model} == {k: sides[0][k] for k in model}
                   for s in sides), sides
        assert sides[0]["--width"] == "64" and sides[0]["--dropout"] == "0.2"
    kept, remat, torch_ = plan[:3]
    assert "--no-remat" in kept["cmd"] and "--remat" in remat["cmd"]
    assert kept["cmd"][0] != "mpirun" and _flags(kept["cmd"])["--stages"] == "4"
    assert torch_["cmd"][:3] == ["/torch/python", "-m", "torch.distributed.run"]
    assert _flags(torch_["cmd"])["--nproc-per-node"] == "4"
    # 2x2 runs under mpirun, a process per stage, unless --mpi-layouts leaves it out.
    assert plan[3]["cmd"][:3] == ["mpirun", "-n", "2"]
    a = run.parse_args(["--mpi-layouts", "", "--jax-variants", "remat"])
    assert [L["cmd"][0] for L in run.launches(a, None, "mpirun")] == [sys.executable] * 2
    # LAYOUT:PROCESSES: 1x4 as 2 processes of 2 stages, the mesh unchanged.
    a = run.parse_args(["--mpi-layouts", "2x2,1x4:2", "--jax-variants", "remat"])
    plan = run.launches(a, None, "mpirun")
    assert [L["cmd"][:3] for L in plan] == [["mpirun", "-n", "2"]] * 2
    assert [(_flags(L["cmd"])["--stages"], _flags(L["cmd"])["--data"]) for L in plan] == \
        [("4", "1"), ("2", "2")]
    assert plan[0]["launch"] == "2 process(es) x 2 devices (mpirun)"


@pytest.mark.parametrize("argv", [["--layouts", "3x3"], ["--jax-variants", "fast"],
                                  ["--mpi-layouts", "1x5"], ["--mpi-layouts", "1x5:2"],
                                  ["--mpi-layouts", "1x4:3"], ["--mpi-layouts", "2x2:0"],
                                  ["--microbatches", "2"]])
def test_bad_options_are_refused(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit):
        run.parse_args(argv)
    err = capsys.readouterr().err
    assert "use some of" in err or "positive divisor" in err or argv[0] == "--microbatches"


def _round(step: float, ok: bool = True) -> dict:
    return {"step_seconds": [step, step * 1.1, step * 0.9], "tokens_per_step": 2048,
            "peak_rss_bytes": [2**30, 2**29], "cpu_seconds_per_step": [0.1, 0.1],
            "parameters": 826208, "check": {"ok": ok, "grad_rel_diff": 1e-7}}


def test_the_table_ratio_and_failures_come_from_the_results(tmp_path) -> None:
    a = run.parse_args([])
    cfgs = [{"framework": "jax", "variant": "kept", "layout": "1x4", "launch": "1 x 4",
             "rounds": [_round(0.05), _round(0.10)]},
            {"framework": "torch", "variant": "", "layout": "1x4", "launch": "4",
             "rounds": [_round(0.10), _round(0.10)]},
            {"framework": "jax", "variant": "kept", "layout": "2x2", "launch": "2 x 2",
             "error": "exit 11", "rounds": [{"error": "exit 11", "check": {
                 "ok": False, "grad_rel_diff": float("nan")}}]},
            {"framework": "torch", "variant": "", "layout": "2x2", "launch": "4",
             "rounds": [_round(0.1), _round(0.1)]}]
    meta = {"date": "today", "machine": "m", "python": "3", "jax": "j", "torch": "t"}
    targets = run.write_outputs(a, tmp_path, cfgs, ["a note"], meta)
    # Rounds' ratios 2.0 and 1.0: their median; tokens/s: the median of all 6 steps.
    assert targets == [{"layout": "1x4", "variant": "kept", "ratio": 1.5, "goal": 1.5,
                        "met": True}]
    table = (tmp_path / "transformer.md").read_text()
    assert "| 1x4 (4 x 1) | jax_cpu_mpi | 1 x 4 | 28248 | 20480-40960 | 1.50x | 1024 | 1536 |" \
        in table, table
    assert "| 2x2 (2 x 2) | jax_cpu_mpi | 2 x 2 | failed: exit 11 |" in table, table
    # The table again from the JSON alone.
    (tmp_path / "transformer.md").unlink()
    assert run.main(["--from-json", str(tmp_path / "transformer.json")]) == 0
    assert (tmp_path / "transformer.md").read_text().startswith(table.rstrip("\n"))
    assert json.loads((tmp_path / "transformer.json").read_text())["targets"][0]["met"]
