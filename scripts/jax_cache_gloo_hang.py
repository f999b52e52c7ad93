"""A JAX-only reproducer of jaxlib 0.12.1's hang that jax_cpu_mpi works around
(``python/jax_cpu_mpi/_src/runtime/gloo_cache.py``): under mpirun, a program with a
collective of XLA's own (gloo) that is loaded from JAX's persistent compilation cache never
finishes. Nothing of jax_cpu_mpi runs: run it in a venv with jax, jaxlib, mpi4py and mpich
only (with jax_cpu_mpi installed the psum goes over MPI, or, with
``JAX_CPU_MPI_COLLECTIVES=gloo``, stays on gloo and is compiled anew instead of loaded)::

    rm -rf /tmp/cache && JAX_COMPILATION_CACHE_DIR=/tmp/cache \\
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1 \\
      timeout -s KILL 60 mpirun -n 2 python scripts/jax_cache_gloo_hang.py

Each process prints ``call 0``, ``call 1``, ``call 2``: the second jit of the same function
is a cache hit (on process 0: JAX writes entries from process 0, and on CPU the key differs
between processes, so process 1 compiles anew). jax 0.12.0.1 prints all three on both
processes; jax 0.12.1 stops after ``call 0``, both processes waiting in gloo's all-reduce.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

jax.distributed.initialize(cluster_detection_method="mpi4py")
mesh = jax.make_mesh((jax.device_count(),), ("x",))
x = jax.make_array_from_callback((jax.device_count(), 4), NamedSharding(mesh, P("x")),
                                 lambda index: np.ones((jax.device_count(), 4), np.float32)[index])
for call in range(3):
    # A new jit each time: the same program, looked up in the persistent cache again.
    f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x") * 2, mesh=mesh,
                              in_specs=P("x"), out_specs=P("x")))
    result = np.asarray(f(x).addressable_data(0))
    print(f"process {jax.process_index()}: call {call} {result.ravel()[:2]}", flush=True)
