"""The pipeline example's command line trains exactly like one device.

The library's results (every schedule, every topology, against one device) are checked by
tests/pipeline/; here only what the example itself adds, in as few runs as that takes (each
run is a JAX start and two compilations): ``python -m jax_cpu_mpi.examples.pipeline
--schedule zero-bubble --check`` in one process x 4 devices (the device count it sets
itself) and under ``mpirun -n 2`` (2 devices each, replacing the count pytest's
environment asks for). Each run must print its schedule, one progress line per step on
process 0 only, and ``check: PASS`` with exit code 0, and its losses must match a NumPy
float64 implementation of the same training written here, with hand-written
backpropagation (independent of JAX's autodiff and of the example's code). That the check
can print FAIL runs in this process.
"""

from __future__ import annotations

import os
import re
import subprocess
from functools import cache

import jax_p2p_removal
import numpy as np
import pytest
from jax_p2p_removal import python_prefix

from jax_cpu_mpi.examples.pipeline import Params, make_problem, parse_args, run_check
from mpi_launcher import run_mpi

STAGES, MICROBATCHES, STEPS, WIDTH, BATCH, LR, SEED = 4, 4, 3, 8, 16, 2.0, 3
SCHEDULE = "zero-bubble"  # not the default: the run shows that --schedule is obeyed
ARGS = ["--stages", str(STAGES), "--microbatches", str(MICROBATCHES), "--steps", str(STEPS),
        "--width", str(WIDTH), "--batch", str(BATCH), "--lr", str(LR), "--seed", str(SEED),
        "--schedule", SCHEDULE, "--check"]
MODULE = "jax_cpu_mpi.examples.pipeline"
_STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+) \[[#.]+\] loss (\S+)\s+[\d.]+ samples/s")


@cache
def numpy_reference() -> tuple[np.ndarray, Params]:
    """The loss of each SGD step and the final parameters, by NumPy in float64 with
    hand-written backpropagation."""
    problem = make_problem(SEED, STAGES, WIDTH, BATCH)
    w, b = problem.init.w.astype(np.float64), problem.init.b.astype(np.float64)
    x = problem.x.astype(np.float64).reshape(MICROBATCHES, -1, WIDTH)
    y = problem.y.astype(np.float64).reshape(MICROBATCHES, -1, WIDTH)
    losses = []
    for _ in range(STEPS):
        hs = [x]
        for s in range(STAGES):
            hs.append(np.tanh(hs[-1] @ w[s] + b[s]))
        err = hs[-1] - y
        losses.append(np.mean(err**2))  # equal microbatches: the mean of their means
        g = 2.0 * err / err.size
        gw, gb = np.zeros_like(w), np.zeros_like(b)
        for s in reversed(range(STAGES)):
            g = g * (1.0 - hs[s + 1] ** 2)
            gw[s] = np.einsum("mbi,mbj->ij", hs[s], g)
            gb[s] = g.sum(axis=(0, 1))
            g = g @ w[s].T
        w, b = w - LR * gw, b - LR * gb
    return np.array(losses), Params(w, b)


def check_output(output: str, processes: int) -> np.ndarray:
    """The printed loss of every step, after checking the run's header lines and its own
    check's verdict."""
    assert f"{STAGES} stages on {processes} process(es) x {STAGES // processes} CPU " \
        f"device(s)" in output, output
    # The schedule's theoretical bubble, as jax_cpu_mpi.pipeline computes it (ZB-H1's).
    bubble = (STAGES - 1) / (3 * MICROBATCHES + STAGES - 1)
    assert re.search(rf"^schedule: .*bubble fraction {bubble:.3f}", output, re.MULTILINE), \
        output
    # The example binds our own primitives where JAX's removal is simulated.
    whose = "jax_cpu_mpi" if jax_p2p_removal.requested() else "JAX"
    assert f"psend/precv: {whose}'s primitives" in output, output
    steps = [_STEP_LINE.match(line) for line in output.splitlines()]
    steps = [m for m in steps if m]
    assert [int(m.group(1)) for m in steps] == list(range(1, STEPS + 1)), output
    assert re.search(r"^check: PASS ", output, re.MULTILINE), output
    return np.array([float(m.group(3)) for m in steps])


def test_numpy_reference_is_a_training_run():
    losses, _ = numpy_reference()
    assert np.all(np.diff(losses) < 0), losses  # SGD on this problem decreases the loss


def test_the_check_tells_pass_from_fail(capsys):
    """run_check (what --check prints) passes the NumPy reference's training and fails it
    when one step's loss is off by 1e-4."""
    args = parse_args(ARGS)
    problem = make_problem(SEED, STAGES, WIDTH, BATCH)
    losses, final = numpy_reference()
    assert run_check(args, problem, list(losses), final, print)
    off = list(losses)
    off[1] *= 1 + 1e-4
    assert not run_check(args, problem, off, final, print)
    verdicts = [line.split()[1] for line in capsys.readouterr().out.splitlines()
                if line.startswith("check: ") and line.split()[1] in ("PASS", "FAIL")]
    assert verdicts == ["PASS", "FAIL"]


@pytest.mark.timeout(180)
def test_one_process_four_devices_matches_reference():
    env = dict(os.environ, JAX_CPU_MPI_RECV_TIMEOUT="60")
    env.pop("XLA_FLAGS", None)  # the example sets its own device count
    proc = subprocess.run([*python_prefix(), "-m", MODULE, *ARGS], capture_output=True,
                          text=True, env=env, timeout=150)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    losses = check_output(output, processes=1)
    np.testing.assert_allclose(losses, numpy_reference()[0], rtol=1e-5)


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_mpirun_n2x2devices_matches_reference():
    """The main job under mpirun, keeping the forwards' residuals (the library's results in
    the other layouts are tests/pipeline/'s)."""
    nprocs = 2
    # XLA_FLAGS still asks for pytest's 8 devices: the example must replace that count.
    run = run_mpi(MODULE, *ARGS, "--no-remat", nprocs=nprocs, module=True, timeout=200)
    assert run.returncode == 0, run.report()
    by_rank = run.by_rank()
    assert sorted(by_rank) == list(range(nprocs)), run.report()
    # Only process 0 prints the progress and the check.
    assert not any(_STEP_LINE.match(line) for r in range(1, nprocs) for line in by_rank[r])
    losses = check_output("\n".join(by_rank[0]), processes=nprocs)
    np.testing.assert_allclose(losses, numpy_reference()[0], rtol=1e-5)


@pytest.mark.timeout(180)
def test_trace_records_every_message_of_the_steps_after_compilation(tmp_path):
    """``--trace DIR`` records steps 2.. and ``trace DIR`` merges them: each device has one
    event per message it sends or receives (a tick's ops carry only the pairs with a
    message, jax_cpu_mpi.pipeline's plan), per recorded step."""
    import json

    import jax_cpu_mpi
    from jax_cpu_mpi import pipeline
    from jax_cpu_mpi._src.pipeline.plan import make_plan

    steps, schedule = 3, "gpipe"
    env = dict(os.environ, JAX_CPU_MPI_RECV_TIMEOUT="60")
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_CPU_MPI_TRACE", None)
    args = [a for a in ARGS if a != "--check"]
    args[args.index("--steps") + 1] = str(steps)
    del args[args.index("--schedule"):args.index("--schedule") + 2]  # its own, below
    proc = subprocess.run([*python_prefix(), "-m", MODULE, *args, "--schedule", schedule,
                           "--trace", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"trace: steps 2..{steps} recorded into {tmp_path}" in proc.stdout, proc.stdout
    merged = subprocess.run([*python_prefix(), "-m", "jax_cpu_mpi", "trace", str(tmp_path),
                             "--no-png"], capture_output=True, text=True, timeout=60)
    assert merged.returncode == 0, merged.stdout + merged.stderr
    events = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    ops = [e for e in events if e.get("ph") == "X" and e["name"] in ("psend", "precv")]
    plan = make_plan(pipeline.schedule_by_name(schedule).bind(STAGES, MICROBATCHES))
    # A psend on the source, a precv on the destination, for each message of the plan.
    want: dict[tuple[str, int], int] = {}
    for tick in plan.messages:
        for _, pairs in tick:
            for src, dst in pairs:
                want[("psend", src)] = want.get(("psend", src), 0) + steps - 1
                want[("precv", dst)] = want.get(("precv", dst), 0) + steps - 1
    got: dict[tuple[str, int], int] = {}
    for e in ops:
        got[(e["name"], e["tid"])] = got.get((e["name"], e["tid"]), 0) + 1
    assert got == want, merged.stdout
    assert 0.0 < jax_cpu_mpi.read_timeline(tmp_path).bubble_fraction() < 1.0
    # The steps' ticks too: every stage's every tick, once per recorded step.
    assert f"pipeline: {steps - 1} step(s) of {plan.ticks} ticks per device" in merged.stdout
    ticks = [e for e in events if e.get("cat") == "pipeline"]
    assert len(ticks) == (steps - 1) * plan.ticks * STAGES
