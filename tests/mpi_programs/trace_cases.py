"""The per-message timeline under ``mpirun -n 2`` with 2 devices per process.

Launched with ``JAX_CPU_MPI_TRACE=DIR`` and ``JAX_CPU_MPI_DEBUG=1``: a ring over the 4
devices (two in-process hops, two over MPI, 8 B each, ``RING_CALLS`` times), then 1 MiB from
device 1 (process 0) to device 2 (process 1), sent after the receiver is ready and then
before (one-way: framed from the operand either way, received as a staged message; the
psend returns before it completes: kept), then 1 MiB both ways between them in one op (a
cycle: the sends wait for the receivers' ready signals and go direct).
Each process prints how many psend/precv it executed per path family, and the MPI
transport's own counters, for tests/trace/test_trace.py to compare with the files.
"""

from __future__ import annotations

import json
import time

import _mpi_common as common
import jax
import numpy as np
from _mpi_common import P
from jax.experimental import multihost_utils

import jax_cpu_mpi

RING_CALLS = 5
me = jax.process_index()
mesh = jax.make_mesh((4,), ("x",))
ring = [(i, (i + 1) % 4) for i in range(4)]
one_way = [(1, 2)]
cycle = [(1, 2), (2, 1)]


def program(perm):
    def body(v):
        tok = jax_cpu_mpi.psend(v, "x", perm)
        return jax_cpu_mpi.precv(tok, jax.ShapeDtypeStruct(v.shape, v.dtype), "x", perm)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))


executed = {"psend": 0, "precv": 0}
# Mesh positions (the pairs' partition ids) of this process's devices.
mine = [i for i, d in enumerate(mesh.devices.flat) if d.process_index == me]


def count(perm, calls=1):
    for src, dst in perm:
        executed["psend"] += calls * (src in mine)
        executed["precv"] += calls * (dst in mine)


f = program(ring)
x = common.global_array(mesh, P("x"), np.arange(8, dtype=np.float32))
for _ in range(RING_CALLS):
    got = common.gather(jax.block_until_ready(f(x)))
np.testing.assert_array_equal(got, np.roll(np.arange(8, dtype=np.float32), 2))
count(ring, RING_CALLS)

g = program(one_way)
n = 1 << 18  # float32: 1 MiB per device
big = common.global_array(mesh, P("x"), np.ones(4 * n, np.float32))
g.lower(big).compile()
before = jax_cpu_mpi.stats()
for sender_late in (True, False):
    multihost_utils.sync_global_devices(f"big {sender_late}")
    if sender_late == (me == 0):
        time.sleep(0.3)
    jax.block_until_ready(g(big))
    count(one_way)
h = program(cycle)
for _ in range(2):
    jax.block_until_ready(h(big))
    count(cycle)
after = jax_cpu_mpi.stats()
path = jax_cpu_mpi.trace_flush()
print("TRACE-FILE", path)
print("EXECUTED", json.dumps(executed))
print("STATS", json.dumps({k: after[k] - before[k] for k in
                           ("mpi_direct_sends", "mpi_staged_large_sends", "kept_sends")}))
common.ok()
