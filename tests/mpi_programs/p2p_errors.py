"""Errors across processes: byte-count mismatch, same byte count but another dtype or
shape, and an unmatched precv (timeout)."""

import re
import time

import _mpi_common as common
import jax
import jax.numpy as jnp
import numpy as np
from _mpi_common import P
from jax.experimental import multihost_utils

import jax_cpu_mpi
from jax_cpu_mpi import _jax_cpu_mpi, config

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


def expect_error(body, parts, f=None):
    """Runs ``body`` (or ``f``): rank 1 must fail with an error holding ``parts``, rank 0
    may complete. Returns the error's text, None on a rank that completed."""
    try:
        if f is None:
            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        out = f(x)
        out.block_until_ready()
    except jax.errors.JaxRuntimeError as e:
        if me == 1:  # the receiving rank reports
            for part in parts:
                assert part in str(e), (part, str(e))
        print("raised as expected:", str(e).splitlines()[0][:200], flush=True)
        return str(e)
    # The sending rank has nothing to fail on: its psend completed.
    assert me == 0, "rank 1 must fail"
    print("rank 0 completed its send", flush=True)
    return None


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
                  f"sent float32[{send_count}] ({4 * send_count} bytes)"])
    barrier(f"after {send_count}->{recv_count}")


# Same byte count, another dtype (int32) or shape (2 x n/2): float32[n] must not land as
# garbage. Every path: 16 B (eager, one message with its envelope), 64 KiB (the rendezvous
# of a psend whose precv keeps its operand: with the receiver first, its ready signal names
# another type, so the sender stages, one message received straight into the output),
# 512 KiB and 8 MiB (rendezvous, as 64 KiB; otherwise staged, the 8 MiB one as a chunk
# header and chunks). The sender first, then the receiver first.
def retyped(n, kind):
    want = (jax.ShapeDtypeStruct((n,), jnp.int32) if kind == "dtype"
            else jax.ShapeDtypeStruct((2, n // 2), jnp.float32))

    def body(v):
        payload = jnp.broadcast_to(v[:1], (n,))
        r = jax_cpu_mpi.precv(jax_cpu_mpi.psend(payload, "x", [(0, 1)]), want, "x", [(0, 1)])
        return v + r.reshape(-1)[:1].astype(v.dtype)
    return body


for n in (4, 16 << 10, 128 << 10, 2 << 20):
    for kind in ("dtype", "shape"):
        recv_desc = f"int32[{n}]" if kind == "dtype" else f"float32[2,{n // 2}]"
        f = jax.jit(jax.shard_map(retyped(n, kind), mesh=mesh, in_specs=P("x"),
                                  out_specs=P("x")))
        f.lower(x).compile()
        for late in (1, 0):  # rank 1 late: the sender first; rank 0 late: the receiver first
            barrier(f"retyped {n} {kind} {late}")
            if me == late:
                time.sleep(0.3)
            expect_error(None,
                         ["INVALID_ARGUMENT", f"expected {recv_desc} ({4 * n} bytes)",
                          "from partition 0 (process 0)", f"sent float32[{n}] ({4 * n} bytes)",
                          f"the sender's float32[{n}] as the receiver's {recv_desc}"], f)
            barrier(f"after retyped {n} {kind} {late}")

# After those, the largest still arrives right (straight from the operand, if the receiver
# is first).
big = common.global_array(mesh, P("x"), np.arange(2 * (2 << 20), dtype=np.float32))
got = common.gather(jax.jit(jax.shard_map(
    lambda v: jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", [(0, 1)]),
                                jax.ShapeDtypeStruct(v.shape, v.dtype), "x", [(0, 1)]),
    mesh=mesh, in_specs=P("x"), out_specs=P("x")))(big))
np.testing.assert_array_equal(got[2 << 20:], np.arange(2 << 20, dtype=np.float32))
barrier("after retyped")


def dangling(v):
    return jax_cpu_mpi.precv(jax.lax.create_token(), jax.ShapeDtypeStruct(v.shape, v.dtype), "x",
                             [(0, 1)])


with config.overrides(gpu_parity=False):
    # The error carries the transport's state (MpiTransport::StallReport): this channel's
    # receives (the latest the one that failed, a small one: staged, none matched), and
    # nothing left unreceived from rank 0, which sent every message it had. Twice: the
    # exit report counts the two under their first line, with the first one's state
    # (test_errors_over_mpi reads it, and the message numbers printed here).
    for attempt in range(2):
        error = expect_error(dangling, [
            "precv", "waited 3", "from partition 0 (process 0)", "JAX_CPU_MPI_RECV_TIMEOUT",
            "\n  Transport state at the timeout (this process is MPI rank 1; the peer MPI "
            "rank 0;",
            "\n    receives from rank 0, tag 1: the latest, #",
            ", failed; it was a staged receive (no staged message matched); ready signals "
            "sent: ",
            "\n    unreceived from rank 0 now: nothing",
            "\n    this process: 0 staged sends in flight (0 bytes)"])
        if error is not None:
            latest = re.search(r"receives from rank 0, tag 1: the latest, #\d+", error)
            assert latest, error
            print(f"timeout {attempt}: {latest.group(0)}", flush=True)
        # The timed-out precv left its channel refused (a late message would be taken as
        # the next precv's: stale_after_failure.py); no psend ran here, nothing was left.
        _jax_cpu_mpi.forget_refused_channels()
        barrier(f"after timeout {attempt}")

# The channel is still usable after both errors.
got = run(lambda v: jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", [(0, 1)]),
                                      jax.ShapeDtypeStruct(v.shape, v.dtype), "x", [(0, 1)]))
np.testing.assert_array_equal(got, [0, 0, 0, 0, 0, 1, 2, 3])
common.ok()
