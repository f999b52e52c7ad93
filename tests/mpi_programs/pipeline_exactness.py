"""Every schedule under mpirun: loss, gradients and outputs equal the one-device reference.

Every process must also compile the same program: a program that differs between processes
(one process's index in a custom call's attributes) runs here on jax 0.10.2 to 0.12.0.1, but
with jax 0.12.1 its first collective of XLA's own (gloo) waits forever. The compiled text of
the first schedule's program is compared across processes (through mpi4py, not JAX).

Arguments: ``STAGES MICROBATCHES [DATA] [--large=NAME,...]``; the devices of all processes
form the mesh (stages x data). One launch runs every schedule (compiling is the cost, not the
run); the results are replicated, and process 0 compares them with the reference. The
schedules named in ``--large`` run with microbatches of ``LARGE_SAMPLES`` samples: messages
of 4 MiB + 4 KiB + 192 B (activations and cotangents), where a precv that is no
destination (the first stage's forward receive, the last stage's backward one) leaves its
output unwritten (poisoned under the tests), in the schedule's scan whose buffers XLA
reuses: every precv of the executor is checked to be lowered so (``zero_fill = 0``).
"""

from __future__ import annotations

import difflib
import sys

import _mpi_common  # noqa: F401  (devices, distributed runtime, jax_cpu_mpi)
import jax
from _mpi_common import ok
from mpi4py import MPI
from pipeline_cases import (
    MICROBATCH,
    Case,
    compare,
    pipeline_program,
    precv_zero_fills,
    run_pipeline,
    run_program,
    within,
)

LARGE_SAMPLES = (1 << 16) + 67  # x WIDTH 8 x 2 leaves x 4 B
flags = [a for a in sys.argv[1:] if a.startswith("--")]
args = [a for a in sys.argv[1:] if not a.startswith("--")]
large = next((f.split("=", 1)[1].split(",") for f in flags if f.startswith("--large=")), [])
stages, microbatches = int(args[0]), int(args[1])
data = int(args[2]) if len(args) > 2 else 1
devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
# 1F1B and ZB-H1 also return the microbatches' gradients (formed on stage 0, shared);
# GPipe and interleaved 1F1B keep their forwards' residuals (remat=False).
cases = [Case(name, stages=stages, microbatches=microbatches, data=data,
              input_grads=name in ("1f1b", "zero-bubble"),
              remat=name in ("1f1b", "zero-bubble"),
              samples=LARGE_SAMPLES if name in large else MICROBATCH)
         for name in ("gpipe", "1f1b", "interleaved-1f1b:2", "zero-bubble")]
# Every process runs every pipeline first, then process 0 alone compiles the references:
# a process that ran ahead into the next pipeline while process 0 compiled a reference would
# wait for its messages, on a loaded machine past the receive timeout.
# The first schedule's program is kept: its compiled text below is the one that ran (jit's
# cache), not a second compilation.
first = pipeline_program(cases[0], devices)
runs = [run_program(*first)] + [run_pipeline(case, devices) for case in cases[1:]]
program, program_args, _ = first
# A stage that is no destination of a tick's message leaves its precv's output unwritten
# (the scratch slot, read by no tick): poisoned here (JAX_CPU_MPI_POISON_UNINITIALIZED).
fills = precv_zero_fills(program.lower(*program_args).as_text())
if not fills or set(fills) != {0}:
    raise SystemExit(f"process {jax.process_index()}: the pipeline's precvs write zeros "
                     f"where no tick reads them: zero_fill {fills}")
texts = MPI.COMM_WORLD.allgather(program.lower(*program_args).compile().as_text())
if texts[jax.process_index()] != texts[0]:
    differs = [line for line in difflib.unified_diff(
        texts[0].splitlines(), texts[jax.process_index()].splitlines(), "process 0",
        f"process {jax.process_index()}", n=0, lineterm="")][:12]
    raise SystemExit(f"process {jax.process_index()}: compiled a program that differs from "
                     f"process 0's ({cases[0].name}):\n" + "\n".join(differs))
failed = []
if jax.process_index() == 0:
    for case, run in zip(cases, runs, strict=True):
        errors = compare(case, *run)
        print(f"process 0: {case.name} P={stages} M={microbatches} D={data} {errors}",
              flush=True)
        if not within(case, errors):
            failed.append(case.name)
if failed:
    raise SystemExit(f"process 0: differs from the reference: {failed}")
ok()
