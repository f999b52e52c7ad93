"""Every schedule under mpirun: loss, gradients and outputs equal the one-device reference.

Arguments: ``STAGES MICROBATCHES [DATA]``; the devices of all processes form the mesh
(stages x data). One launch runs every schedule (compiling is the cost, not the run).
"""

from __future__ import annotations

import sys

import _mpi_common  # noqa: F401  (devices, distributed runtime, jax_cpu_mpi)
import jax
from _mpi_common import gather, ok
from pipeline_cases import Case, run_case, tolerance

stages, microbatches = int(sys.argv[1]), int(sys.argv[2])
data = int(sys.argv[3]) if len(sys.argv) > 3 else 1
devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
failed = []
for name in ("gpipe", "1f1b", "interleaved-1f1b:2", "zero-bubble"):
    case = Case(name, stages=stages, microbatches=microbatches, data=data)
    # Every process gathers the same results; process 0 compares them with the reference.
    errors = run_case(case, devices, gather, compare=jax.process_index() == 0)
    print(f"process {jax.process_index()}: {name} P={stages} M={microbatches} D={data} "
          f"{errors}", flush=True)
    if errors and not max(errors.values()) <= tolerance(case):
        failed.append(name)
if failed:
    raise SystemExit(f"process {jax.process_index()}: differs from the reference: {failed}")
ok()
