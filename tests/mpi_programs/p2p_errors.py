"""Errors across processes: byte-count mismatch and an unmatched precv (timeout)."""

import _mpi_common as common
import jax
import jax.numpy as jnp
import numpy as np
from _mpi_common import P
from jax.experimental import multihost_utils

import jax_cpu_mpi
from jax_cpu_mpi import config

mesh = jax.make_mesh((2,), ("x",))
x = common.global_array(mesh, P("x"), np.arange(8, dtype=np.float32))
me = jax.process_index()


def run(body):
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    return common.gather(f(x))


def mismatch(v):
    tok = jax_cpu_mpi.psend(v, "x", [(0, 1)])
    r = jax_cpu_mpi.precv(tok, jax.ShapeDtypeStruct((2,), jnp.float32), "x", [(0, 1)])
    return jnp.concatenate([r, r])


def expect_error(body, parts):
    try:
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        out = f(x)
        out.block_until_ready()
    except jax.errors.JaxRuntimeError as e:
        if me == 1:  # the receiving rank reports
            for part in parts:
                assert part in str(e), (part, str(e))
        print("raised as expected:", str(e).splitlines()[0][:200], flush=True)
        return
    # The sending rank has nothing to fail on: its psend completed.
    assert me == 0, "rank 1 must fail"
    print("rank 0 completed its send", flush=True)


def barrier(name):
    # Programs are not synchronized across processes: without this, rank 0 could run the next
    # program and its psend would feed rank 1's precv of this one (channels are FIFO).
    multihost_utils.sync_global_devices(name)


expect_error(mismatch, ["precv", "partition 1 (process 1)", "partition 0 (process 0)",
                        "float32[2]", "8 bytes", "16 bytes"])
barrier("after mismatch")


def sizes(send_count, recv_count):
    """psend float32[send_count] into precv float32[recv_count] on pair (0, 1)."""
    def body(v):
        payload = jnp.broadcast_to(v[:1], (send_count,))
        tok = jax_cpu_mpi.psend(payload, "x", [(0, 1)])
        r = jax_cpu_mpi.precv(tok, jax.ShapeDtypeStruct((recv_count,), jnp.float32), "x", [(0, 1)])
        return v + r[:1]
    return body


# Chunked sender (8 MiB) into a smaller chunked receiver, into a header-sized receiver, and a
# plain sender into a chunked receiver: each is reported, and the channel stays in sync.
for send_count, recv_count in [(2 << 20, 6 << 18), (2 << 20, 8), (8, 2 << 20)]:
    expect_error(sizes(send_count, recv_count),
                 ["precv", f"float32[{recv_count}]", f"({4 * recv_count} bytes)",
                  f"sent {4 * send_count} bytes"])
    barrier(f"after {send_count}->{recv_count}")


def dangling(v):
    return jax_cpu_mpi.precv(jax.lax.create_token(), jax.ShapeDtypeStruct(v.shape, v.dtype), "x",
                             [(0, 1)])


with config.overrides(gpu_parity=False):
    expect_error(dangling, ["precv", "waited 3", "from partition 0 (process 0)",
                            "JAX_CPU_MPI_RECV_TIMEOUT"])
barrier("after timeout")

# The channel is still usable after both errors.
got = run(lambda v: jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", [(0, 1)]),
                                      jax.ShapeDtypeStruct(v.shape, v.dtype), "x", [(0, 1)]))
np.testing.assert_array_equal(got, [0, 0, 0, 0, 0, 1, 2, 3])
common.ok()
