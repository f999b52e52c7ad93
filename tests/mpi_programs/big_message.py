"""One message just over 2 GiB (2**31 + 4096 bytes of uint8), device 0 -> device 1.

``big_message.py local``: one process, 2 CPU devices (mailbox copy).
``big_message.py mpi``: under ``mpirun -n 2``, one device per rank (MPI large-count calls).
An optional second argument sets the number of 4 KiB rows (default: 2**19 + 1).

The bytes are made by the jitted program itself (a position hash, see ``_reliability``) so the
host never holds a 2 GiB NumPy array. The receiver compares every byte with the pattern
recomputed in the same program (mismatching rows are counted), and checks the first, last
and 16 random rows against NumPy. Each process prints a ``RESULT`` line with the time of the
call (pattern generation + transfer + verification) and its peak resident memory.
"""

# The device count must be set before JAX starts (local mode), hence imports below code.
# ruff: noqa: E402
from __future__ import annotations

import os
import sys
import time

MODE = sys.argv[1]
if MODE == "local":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2")
    import jax

    import jax_cpu_mpi
else:
    import _mpi_common as common  # starts jax.distributed
    import jax
    from jax.experimental import multihost_utils

    import jax_cpu_mpi

import jax.numpy as jnp
import numpy as np
from _reliability import count_bad_rows, pattern, pattern_np, peak_rss_bytes
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

COLS = 4096
ROWS = int(sys.argv[2]) if len(sys.argv) > 2 else (1 << 31) // COLS + 1  # 2 GiB + 4 KiB
BYTES = ROWS * COLS
SALTS = (7, 9)  # device 0 sends pattern+7; device 1's own data is pattern+9
PAIR = [(0, 1)]
SAMPLE = np.sort(np.random.default_rng(0).choice(ROWS, 16, replace=False))
SAMPLE[0], SAMPLE[-1] = 0, ROWS - 1

mesh = jax.make_mesh((2,), ("x",))


def body(salt):
    # Each device takes one branch, so the sender holds only the message and the receiver
    # only its output: the untaken branch's buffers are never touched (not resident).
    def send(salt):
        jax_cpu_mpi.psend(pattern(ROWS, COLS, salt[0]), "x", PAIR)
        return jnp.zeros((1,), jnp.int32), jnp.zeros((SAMPLE.size, COLS), jnp.uint8)

    def receive(salt):
        y = jax_cpu_mpi.precv(lax.create_token(), jax.ShapeDtypeStruct((ROWS, COLS), jnp.uint8),
                              "x", PAIR)
        return count_bad_rows(y, SALTS[0])[None], jnp.take(y, jnp.asarray(SAMPLE), axis=0)

    return lax.cond(lax.axis_index("x") == 0, send, receive, salt)


f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P("x"))))
salt_all = np.array(SALTS, np.uint8)
if MODE == "local":
    salt = jax.device_put(salt_all, NamedSharding(mesh, P("x")))
else:
    salt = common.global_array(mesh, P("x"), salt_all)
compiled = f.lower(salt).compile()
if MODE != "local":
    multihost_utils.sync_global_devices("compiled")

start = time.perf_counter()
bad, sample = compiled(salt)
jax.block_until_ready((bad, sample))
seconds = time.perf_counter() - start

for shard_bad, shard_sample in zip(bad.addressable_shards, sample.addressable_shards,
                                   strict=True):
    device = shard_bad.index[0].start  # position on the mesh axis
    n_bad = int(np.asarray(shard_bad.data)[0])
    rows = np.asarray(shard_sample.data)
    if device == 1:
        assert n_bad == 0, f"{n_bad} of {ROWS} rows of the 2 GiB message differ"
        for k, row in enumerate(SAMPLE):
            np.testing.assert_array_equal(rows[k], pattern_np(slice(row, row + 1), COLS,
                                                              SALTS[0])[0])
        print(f"device 1 received all {BYTES} bytes intact", flush=True)
    else:  # the sender's branch returns zeros
        assert n_bad == 0 and not rows.any()
del bad, sample

stats = jax_cpu_mpi.stats()
if MODE != "local" and jax.process_index() == 0:
    # One send of 2 GiB: straight from the operand if the receiver was ready (its 256 MiB
    # counts), else staged: above the 1 GiB in-flight bound, allowed because it is alone.
    direct, staged = stats["mpi_direct_sends"], stats["mpi_staged_large_sends"]
    assert direct + staged == 1, stats
    assert stats["mpi_peak_inflight_bytes"] in ((0, BYTES) if direct else (BYTES,)), stats
print(f"RESULT mode={MODE} process={jax.process_index()} bytes={BYTES} seconds={seconds:.2f} "
      f"peak_rss_gib={peak_rss_bytes() / 2**30:.2f}", flush=True)
print("stats:", stats, flush=True)
if MODE == "local":
    print("JCM-OK", flush=True)
else:
    common.ok()
