"""A mesh on some processes of the job only (JAX's ``test_psend_precv_basic_two_gpus`` under
``mpirun -n 4``: one device of the first process and one of the last).

Processes 0 and 3 (the last) lower and run a round trip 0 -> 3 -> 0 over a mesh of their
devices, a small message and one of 512 KiB (the rendezvous path); the processes between
them never lower anything that spans processes: they print their line and exit at once.
MPI must not need them at the lowering (it waited for them there forever: its attach was
collective over every rank), and the exit must still end every process promptly.
"""

import _mpi_common as common
import jax
import numpy as np
from _mpi_common import P
from jax.sharding import Mesh

import jax_cpu_mpi

me, last = jax.process_index(), jax.process_count() - 1
if me in (0, last):
    devices = [d for d in jax.devices() if d.process_index in (0, last)]
    mesh = Mesh(np.array([devices[0], devices[-1]]), ("x",))

    def round_trip(v):
        like = jax.ShapeDtypeStruct.like(v)
        there = jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", [(0, 1)]), like, "x", [(0, 1)])
        back = jax_cpu_mpi.psend(there * 2 + 1, "x", [(1, 0)])
        return jax_cpu_mpi.precv(back, like, "x", [(1, 0)])

    f = jax.jit(jax.shard_map(round_trip, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    for per_device in (2, 1 << 17):  # 8 B, then 512 KiB (float32)
        value = np.arange(2 * per_device, dtype=np.float32)
        out = f(common.global_array(mesh, P("x"), value))
        mine = np.asarray(out.addressable_shards[0].data)
        # Device 0 gets device 0's block, doubled plus one; device 1 gets zeros.
        want = value[:per_device] * 2 + 1 if me == 0 else np.zeros(per_device, np.float32)
        np.testing.assert_array_equal(mine, want)
    print(f"process {me}: round trips over processes 0 and {last} right", flush=True)
else:
    print(f"process {me}: outside the mesh, exits", flush=True)
common.ok()
