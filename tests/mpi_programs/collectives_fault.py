"""A peer that never joins a collective over MPI: the other rank's all_gather (its first
use: the group's communicator is never created) and then psum (an established
communicator) fail within JAX_CPU_MPI_RECV_TIMEOUT with an error naming the collective and
the peer, instead of hanging; a collective after that fails at once without calling MPI.
Run by tests/runtime/test_collectives_mpi.py (JAX_CPU_MPI_RECV_TIMEOUT=3,
JAX_CPU_MPI_ABORT_ON_ERROR=0)."""

import time

import _mpi_common as common
import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_cpu_mpi import config

config.configure(collectives="mpi")
n = jax.device_count()
mesh = jax.make_mesh((n,), ("x",))
f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"),
                          out_specs=P("x"), check_vma=False))
x = common.global_array(mesh, P("x"), np.ones(n * 4, np.float32))
f(x).block_until_ready()  # both ranks: the communicator exists, the collective works
if jax.process_index() == 1:
    time.sleep(12)  # the stopped peer: never joins the all_gather nor the second psum
    print("peer: stayed away", flush=True)
    common.ok()
else:
    g = jax.jit(jax.shard_map(lambda v: jax.lax.all_gather(v, "x", tiled=True), mesh=mesh,
                              in_specs=P("x"), out_specs=P("x"), check_vma=False))
    start = time.monotonic()
    try:
        g(x).block_until_ready()
        print("FAIL: the all_gather completed without its peer", flush=True)
        raise SystemExit(1)
    except Exception as e:
        waited = time.monotonic() - start
        text = str(e)
        assert "all_gather" in text and "MPI rank 1" in text and "not created in time" in text, text
        assert waited < 3 + 4, waited
        print(f"raised as expected after {waited:.1f} s: {text.splitlines()[0][:300]}",
              flush=True)
    start = time.monotonic()
    try:
        f(x).block_until_ready()
        print("FAIL: the psum completed without its peer", flush=True)
    except Exception as e:
        waited = time.monotonic() - start
        text = str(e)
        assert "psum" in text and "MPI rank 1" in text and "did not complete" in text, text
        assert waited < 3 + 4, waited
        print(f"raised as expected after {waited:.1f} s: {text.splitlines()[0][:300]}",
              flush=True)
    # The psum's request was abandoned (MPI cannot cancel a collective): any later MPI call
    # could complete it into a buffer XLA has reused, so the next collective must fail at
    # once without calling MPI.
    start = time.monotonic()
    try:
        f(x).block_until_ready()
        print("FAIL: a collective ran after an abandoned one", flush=True)
    except Exception as e:
        waited = time.monotonic() - start
        text = str(e)
        assert "psum" in text and "earlier MPI operation of this process timed out" in text, text
        assert waited < 2, waited
        print(f"refused at once after {waited:.1f} s: {text.splitlines()[0][:300]}", flush=True)
        common.ok()
