"""Every schedule computes the loss, gradients and outputs of the model on one device.

One process, the first devices of pytest's 8: 4 stages (pytree activations, M not a
multiple of P), 2 stages x 2 data shards, M = 1, P = 1 and bfloat16. The mpirun topologies
run in test_mpi.py. Reference: ``jax.value_and_grad`` of the chunks composed without a
pipeline (tests/mpi_programs/pipeline_cases.py).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from pipeline_cases import Case, run_case, tolerance

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b:2", "zero-bubble"]

CASES = (
    [Case(s, stages=4, microbatches=5) for s in SCHEDULES]
    + [Case(s, stages=2, microbatches=3, data=2) for s in ("1f1b", "interleaved-1f1b:2")]
    + [Case(s, stages=4, microbatches=1) for s in ("gpipe", "zero-bubble")]
    + [Case(s, stages=1, microbatches=3) for s in ("1f1b", "interleaved-1f1b:3")]
    + [Case("zero-bubble", stages=2, microbatches=2, dtype="bfloat16")]
)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.name}-P{c.stages}-M{c.microbatches}"
                         f"-D{c.data}-{c.dtype}")
def test_matches_single_device(case):
    errors = run_case(case, jax.devices(), np.asarray)
    assert max(errors.values()) <= tolerance(case), errors
