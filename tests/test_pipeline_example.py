"""The pipeline example trains exactly like one device, in every topology.

``python -m jax_cpu_mpi.examples.pipeline --check`` (default schedule 1F1B) runs in three
topologies (1 process x 4 devices, ``mpirun -n 2`` x 2 devices, ``mpirun -n 4`` x 1 device),
and with ``--schedule zero-bubble`` in one process. Each run must pass its own
check against single-device training, print the same loss curve as the other topologies, and
match a NumPy float64 implementation of the same training written here, with hand-written
backpropagation (independent of JAX's autodiff and of the example's code).
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

from jax_cpu_mpi.examples.pipeline import make_problem
from mpi_launcher import run_mpi

STAGES, MICROBATCHES, STEPS, WIDTH, BATCH, LR, SEED = 4, 4, 5, 16, 64, 2.0, 3
ARGS = ["--stages", str(STAGES), "--microbatches", str(MICROBATCHES), "--steps", str(STEPS),
        "--width", str(WIDTH), "--batch", str(BATCH), "--lr", str(LR), "--seed", str(SEED),
        "--check"]
MODULE = "jax_cpu_mpi.examples.pipeline"
_STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+) \[[#.]+\] loss (\S+)\s+[\d.]+ samples/s")


def numpy_reference_losses() -> np.ndarray:
    """The loss of each SGD step, by NumPy in float64 with hand-written backpropagation."""
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
    return np.array(losses)


def parse_run(output: str) -> np.ndarray:
    """The printed loss of every step; asserts the example's own check passed."""
    steps = [_STEP_LINE.match(line) for line in output.splitlines()]
    steps = [m for m in steps if m]
    assert [int(m.group(1)) for m in steps] == list(range(1, STEPS + 1)), output
    assert re.search(r"^check: PASS ", output, re.MULTILINE), output
    return np.array([float(m.group(3)) for m in steps])


def assert_primitives(output: str) -> None:
    """The example binds our own primitives where JAX's removal is simulated."""
    whose = "jax_cpu_mpi" if jax_p2p_removal.requested() else "JAX"
    assert f"psend/precv: {whose}'s primitives" in output, output


@cache
def single_process_run(schedule: str = "1f1b") -> np.ndarray:
    env = dict(os.environ, JAX_CPU_MPI_RECV_TIMEOUT="60")
    env.pop("XLA_FLAGS", None)  # the example sets its own device count
    proc = subprocess.run([*python_prefix(), "-m", MODULE, *ARGS, "--schedule", schedule],
                          capture_output=True, text=True, env=env, timeout=150)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert f"{STAGES} stages on 1 process(es) x 4 CPU device(s)" in output, output
    # The schedule's theoretical bubble, as jax_cpu_mpi.pipeline computes it.
    bubble = {"1f1b": (STAGES - 1) / (MICROBATCHES + STAGES - 1),
              "zero-bubble": (STAGES - 1) / (3 * MICROBATCHES + STAGES - 1)}[schedule]
    assert re.search(rf"^schedule: .*bubble fraction {bubble:.3f}", output, re.MULTILINE), \
        output
    assert_primitives(output)
    return parse_run(output)


def mpi_run(nprocs: int) -> np.ndarray:
    # XLA_FLAGS still asks for pytest's 8 devices: the example must replace that count.
    run = run_mpi(MODULE, *ARGS, nprocs=nprocs, module=True, timeout=150)
    assert run.returncode == 0, run.report()
    by_rank = run.by_rank()
    assert sorted(by_rank) == list(range(nprocs)), run.report()
    output = "\n".join(by_rank[0])
    assert f"{STAGES} stages on {nprocs} process(es) x {STAGES // nprocs} CPU device(s)" \
        in output, run.report()
    assert_primitives(output)
    # Only process 0 prints the progress and the check.
    assert not any(_STEP_LINE.match(line) for r in range(1, nprocs) for line in by_rank[r])
    return parse_run(output)


def test_numpy_reference_is_a_training_run():
    losses = numpy_reference_losses()
    assert np.all(np.diff(losses) < 0), losses  # SGD on this problem decreases the loss


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_one_process_four_devices_matches_reference(schedule):
    losses = single_process_run(schedule)
    np.testing.assert_allclose(losses, numpy_reference_losses(), rtol=1e-5)


@pytest.mark.mpi
@pytest.mark.timeout(360)
@pytest.mark.parametrize("nprocs", [2, 4], ids=["mpirun-n2x2devices", "mpirun-n4x1device"])
def test_mpirun_matches_reference_and_one_process(nprocs):
    losses = mpi_run(nprocs)
    np.testing.assert_allclose(losses, numpy_reference_losses(), rtol=1e-5)
    one_process = single_process_run()
    # Same stages, same microbatches, same order of operations on every device.
    np.testing.assert_allclose(losses, one_process, rtol=1e-6)


@pytest.mark.timeout(180)
def test_trace_records_every_message_of_the_steps_after_compilation(tmp_path):
    """``--trace DIR`` records steps 2.. and ``trace DIR`` merges them: every tick runs every
    message op on every device (jax_cpu_mpi.pipeline's executor), so each device has one
    event per op it takes part in, per tick, per recorded step."""
    import json

    import jax_cpu_mpi
    from jax_cpu_mpi import pipeline

    steps, schedule = 3, "gpipe"
    env = dict(os.environ, JAX_CPU_MPI_RECV_TIMEOUT="60")
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_CPU_MPI_TRACE", None)
    args = [a for a in ARGS if a != "--check"]
    args[args.index("--steps") + 1] = str(steps)
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
    ticks = pipeline.schedule_by_name(schedule).bind(STAGES, MICROBATCHES).ticks
    # Activations s -> s + 1 and cotangents s + 1 -> s: a psend on the source, a precv on
    # the destination, every tick.
    want: dict[tuple[str, int], int] = {}
    for src, dst in [(s, s + 1) for s in range(STAGES - 1)] + \
                    [(s + 1, s) for s in range(STAGES - 1)]:
        want[("psend", src)] = want.get(("psend", src), 0) + ticks * (steps - 1)
        want[("precv", dst)] = want.get(("precv", dst), 0) + ticks * (steps - 1)
    got: dict[tuple[str, int], int] = {}
    for e in ops:
        got[(e["name"], e["tid"])] = got.get((e["name"], e["tid"]), 0) + 1
    assert got == want, merged.stdout
    assert 0.0 < jax_cpu_mpi.read_timeline(tmp_path).bubble_fraction() < 1.0
