"""One of two jobs that run at once on this host (tests/runtime/test_coordinator_port.py).

``coordinator_port.py TOKEN`` under ``mpirun -n 2``: the ranks gather their job's TOKEN through
JAX's distributed runtime and check that every rank holds this job's, not the other job's:
each job's processes registered with their own coordinator.
"""

from __future__ import annotations

import sys

import _mpi_common as common
import jax
import numpy as np
from jax.experimental import multihost_utils

token = int(sys.argv[1])
assert jax.process_count() == 2, jax.process_count()
tokens = np.asarray(multihost_utils.process_allgather(np.int32(token)))
assert tokens.tolist() == [token, token], (token, tokens)
print(f"process {jax.process_index()}: job {token}: both processes in this job", flush=True)
common.ok()
