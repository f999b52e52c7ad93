"""MPI sends: the in-flight bound holds, and sends still in flight at exit are delivered.

1. With max_inflight_bytes = 1 MiB, rank 0 runs ahead with 16 psends of 256 KiB (its precvs
   are no-ops: it is no destination) while rank 1 receives them: every message arrives in
   order and rank 0 never holds more than the bound.
2. Rank 0 sends 32 MiB and exits at once; rank 1 posts its precv 3 s later. The exit hook
   completes the send before MPI finalizes: rank 1 gets every byte, nobody warns.
"""

import time

import _mpi_common as common
import jax
import jax.numpy as jnp
import numpy as np
from _mpi_common import P
from jax.experimental import multihost_utils

import jax_cpu_mpi

me = jax.process_index()
mesh = jax.make_mesh((2,), ("x",))
pair = [(0, 1)]


def local(x: jax.Array) -> np.ndarray:
    return np.asarray(x.addressable_shards[0].data)


# 1. Bounded in-flight bytes.
jax_cpu_mpi.configure(max_inflight_bytes=1 << 20)
count = 64 << 10  # float32 -> 256 KiB per message
x = common.global_array(mesh, P("x"), np.zeros(2 * count, np.float32))


def stream(v):
    def step(i, acc):
        tok = jax_cpu_mpi.psend(v + i.astype(v.dtype), "x", pair)
        r = jax_cpu_mpi.precv(tok, jax.ShapeDtypeStruct(v.shape, v.dtype), "x", pair)
        return acc + r * (i + 1).astype(v.dtype)
    return jax.lax.fori_loop(0, 16, step, jnp.zeros_like(v))


got = local(jax.jit(jax.shard_map(stream, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x))
want = sum(float(i * (i + 1)) for i in range(16)) if me == 1 else 0.0
np.testing.assert_array_equal(got, np.full(count, want, np.float32))
stats = jax_cpu_mpi.stats()
print("stats after stream:", stats, flush=True)
assert stats["mpi_peak_inflight_bytes"] <= 1 << 20, stats
multihost_utils.sync_global_devices("stream done")
jax_cpu_mpi.configure(max_inflight_bytes=1 << 30)

# 2. Sends in flight at exit.
big = 8 << 20  # float32 -> 32 MiB per device
y = common.global_array(mesh, P("x"), np.arange(2 * big, dtype=np.float32) % 4093)
f = jax.jit(jax.shard_map(
    lambda v: jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", pair),
                                jax.ShapeDtypeStruct(v.shape, v.dtype), "x", pair),
    mesh=mesh, in_specs=P("x"), out_specs=P("x")))
f.lower(y).compile()  # both ranks attach/compile before the timing below
if me == 1:
    time.sleep(3.0)
out = local(f(y))
if me == 1:
    np.testing.assert_array_equal(out, (np.arange(big, dtype=np.float32) % 4093))
    print("rank 1 received all 32 MiB", flush=True)
else:
    print("rank 0 exits with its send in flight:", jax_cpu_mpi.stats(), flush=True)
common.ok()
