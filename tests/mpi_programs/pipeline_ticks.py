"""A pipeline's ticks in the timeline under mpirun (2 processes x 2 devices, 4 stages).

Argument: the trace directory. Runs 1F1B (P = 4, M = 4) once to compile, once recorded
into the directory, and prints which device (as the timeline numbers them) runs each stage,
for tests/trace/test_trace_mpi.py to check the merged ticks against the plan.
"""

from __future__ import annotations

import json
import sys

import _mpi_common  # noqa: F401  (devices, distributed runtime, jax_cpu_mpi)
import jax
from _mpi_common import ok
from pipeline_cases import Case, run_pipeline

import jax_cpu_mpi

devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
case = Case("1f1b", stages=4, microbatches=4)
run_pipeline(case, devices)
with jax_cpu_mpi.trace(sys.argv[1]):
    run_pipeline(case, devices)
# The timeline numbers a device by its position among the job's devices sorted by id.
position = {i: n for n, i in enumerate(sorted(d.id for d in jax.devices()))}
print("STAGE-DEVICES", json.dumps([position[d.id] for d in devices[:4]]))
ok()
