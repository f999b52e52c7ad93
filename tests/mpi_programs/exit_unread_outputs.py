"""The body of JAX's ``test_psend_precv_basic_with_no_deadlock_cycle`` (an 8-device chain,
an optimization barrier, a back edge 7 -> 0 whose psend sends float32[8,8] to a precv of
float32[1,8]), run as JAX's test does: only the output's shape is read, never its value.

The devices of process 1 compute for a while before their psends (a loop whose trip count
depends on the device), so both main threads reach the interpreter's exit long before the
program has finished: the exit must let it finish (``keep``), end what still waits after
the grace (``drop``: the output was never kept), and report the refused message on stderr.

Argument: ``keep`` (the output stays referenced, as in a script), ``drop`` (it is
dropped at once; the program then exits with ``sys.exit(3)``) or ``shutdown`` (kept, then
``jax.distributed.shutdown()`` before the end, which must close MPI as the exit does).
"""

import sys
import time
from functools import partial

import _mpi_common as common
import jax
import jax.numpy as jnp
import numpy as np
from _mpi_common import P
from jax import lax

import jax_cpu_mpi

mode = sys.argv[1]
mesh = jax.make_mesh((8,), ("x",))
chain = [(i, i + 1) for i in range(7)]
a = common.global_array(mesh, P("x", None), np.arange(64, dtype=np.float32).reshape(8, 8))
weights = jax.random.uniform(key=jax.random.key(0), shape=(8, 1), dtype=jnp.float32)


def late(v):
    """``v``, after a few hundred ms of work on the devices of process 1 only."""
    trips = jnp.where(lax.axis_index("x") >= 4, 300, 0)
    m = jnp.full((192, 192), 1e-3, jnp.float32)
    m = lax.fori_loop(0, trips, lambda i, m: jnp.tanh(m @ m), m)
    return v + m[0, :1] * 0


@jax.jit
@partial(jax.shard_map, mesh=mesh, in_specs=(P("x", None),), out_specs=P("x", None))
def fwd(a):
    like = jax.ShapeDtypeStruct.like(a)
    data = jax_cpu_mpi.precv(jax_cpu_mpi.psend(late(a), "x", chain), like, "x", chain)
    weights_, _ = lax.optimization_barrier((weights, data))
    res = jnp.dot(weights_, data)  # float32[8,8]: not the precv's out_shape below
    back = jax_cpu_mpi.psend(res, "x", [(7, 0)])
    return jax_cpu_mpi.precv(back, like, "x", [(7, 0)])


start = time.monotonic()
c = fwd(a)
assert c.shape == a.shape
print(f"process {jax.process_index()}: shape {c.shape} at {time.monotonic() - start:.2f} s",
      flush=True)
if mode in ("keep", "shutdown"):
    # runpy (tests/mpi_programs/_rank_output.py) drops the program's globals before the
    # interpreter exits; a user's script keeps them alive until then.
    common.kept_outputs = [c]
    common.ok()
    if mode == "shutdown":
        jax.distributed.shutdown()
        # Programs on this process's own devices still run, and their precv still waits
        # for a late psend (the shutdown closed MPI, not the process).
        own = jax.sharding.Mesh(np.array(jax.local_devices()[:2]), ("y",))

        @jax.jit
        @partial(jax.shard_map, mesh=own, in_specs=P("y"), out_specs=P("y"))
        def hop(v):
            m = lax.fori_loop(0, jnp.where(lax.axis_index("y") == 0, 100, 0),
                              lambda i, m: jnp.tanh(m @ m), jnp.full((192, 192), 1e-3))
            tok = jax_cpu_mpi.psend(v + m[0, :1] * 0 + 1, "y", [(0, 1)])
            return jax_cpu_mpi.precv(tok, jax.ShapeDtypeStruct.like(v), "y", [(0, 1)])

        v = jax.device_put(np.zeros(2, np.float32), jax.sharding.NamedSharding(own, P("y")))
        got = np.asarray(hop(v))
        assert got.tolist() == [0.0, 1.0], got
        print("shut down", flush=True)
else:
    del c
    common.ok()
    sys.exit(3)
