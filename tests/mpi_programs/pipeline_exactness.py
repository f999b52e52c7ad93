"""Every schedule under mpirun: loss, gradients and outputs equal the one-device reference.

Arguments: ``STAGES MICROBATCHES [DATA]``; the devices of all processes form the mesh
(stages x data). One launch runs every schedule (compiling is the cost, not the run); the
results are replicated, and process 0 compares them with the reference.
"""

from __future__ import annotations

import sys

import _mpi_common  # noqa: F401  (devices, distributed runtime, jax_cpu_mpi)
import jax
from _mpi_common import ok
from pipeline_cases import Case, compare, run_pipeline, within

stages, microbatches = int(sys.argv[1]), int(sys.argv[2])
data = int(sys.argv[3]) if len(sys.argv) > 3 else 1
devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
# 1F1B and ZB-H1 also return the microbatches' gradients (formed on stage 0, shared);
# GPipe and interleaved 1F1B keep their forwards' residuals (remat=False).
cases = [Case(name, stages=stages, microbatches=microbatches, data=data,
              input_grads=name in ("1f1b", "zero-bubble"),
              remat=name in ("1f1b", "zero-bubble"))
         for name in ("gpipe", "1f1b", "interleaved-1f1b:2", "zero-bubble")]
# Every process runs every pipeline first, then process 0 alone compiles the references:
# a process that ran ahead into the next pipeline while process 0 compiled a reference would
# wait for its messages, on a loaded machine past the receive timeout.
runs = [run_pipeline(case, devices) for case in cases]
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
