"""A sender stops (SIGSTOP) in the middle of a message; its receiver must fail in time.

``stopped_sender.py PATH`` under ``mpirun -n 2`` (one device per rank), with UCX on TCP
(``UCX_TLS=tcp,self``) as between two hosts: over shared memory a receiver can read a
stopped sender's memory itself (CMA), over a network it cannot, which is the case to test.
A small ``UCX_RNDV_THRESH`` makes every payload above a few KiB move only once the sender
answers the receiver's match (rendezvous). Rank 0 stops itself with
``_stop_mid_next_mpi_send``: at the first test of its send, not yet known complete, some
time after it was posted, before that test moves more of it (the announcement of the
message has left by then). Rank 0 sends
``N`` bytes to rank 1:

* ``eager`` (8 B): an 8 B message is never in the middle (it leaves whole, or not at all),
  so rank 0 stops before its psend: rank 1's precv matches nothing and times out.
* ``staged`` (8 MiB: a chunk header and 8 chunks of 1 MiB), the receiver late: rank 0's
  psend posts the header and the chunks and returns; 0.2 s later (its progress thread
  tests the send) it stops. Rank 1's precv, 1.5 s after, matches the header and every
  chunk, whose payload cannot move before that match, and never comes.
* ``direct`` (64 MiB), the receiver ready first: rank 0's one-way psend, whose operand its
  precv keeps, sends straight from its operand (a chunk header, then the payload, without
  a ready signal), and stops 2 ms after posting, while the payload flows (64 MiB take far
  longer than that over TCP); rank 1's receive into its output has matched.

In the last two a matched receive cannot be cancelled: rank 1 must still fail with the
precv timeout error, within ``JAX_CPU_MPI_RECV_TIMEOUT`` and a grace period, and report the
transport broken (``job_broken``); the program then runs again, and fails at once with the
broken transport's error, which must name that first precv (printed as ``the next op failed
at once: ...``). The first error is left uncaught: jax_cpu_mpi aborts the job (MPI_Abort),
which must end the stopped rank 0 too.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import _mpi_common as common
import jax
import numpy as np
from _mpi_common import P
from jax.experimental import multihost_utils

import jax_cpu_mpi
from jax_cpu_mpi import _jax_cpu_mpi as ext

PATH = sys.argv[1]
N = {"eager": 8, "staged": 8 << 20, "direct": 64 << 20}[PATH]
STOP_AFTER_S = {"staged": 0.2, "direct": 0.002}.get(PATH)
FWD, BWD = [(0, 1)], [(1, 0)]
me = jax.process_index()
mesh = jax.make_mesh((2,), ("x",))


def body(v):
    like = jax.ShapeDtypeStruct(v.shape, v.dtype)
    return jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", FWD), like, "x", FWD)


def both_ways(v):
    like = jax.ShapeDtypeStruct(v.shape, v.dtype)
    there = jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", FWD), like, "x", FWD)
    return jax_cpu_mpi.precv(jax_cpu_mpi.psend(there, "x", BWD), like, "x", BWD)


f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
x = common.global_array(mesh, P("x"), np.ones(2 * N, np.uint8))
compiled = f.lower(x).compile()  # attaches MPI on both ranks
# A 1 MiB message each way first: UCX connects an endpoint, and the lane of its rendezvous
# protocol, on first use, with the progress of both sides; a send posted before that waits
# in UCX, and its receiver sees nothing of it. Connected, a message announces itself at once.
warm = jax.jit(jax.shard_map(both_ways, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
jax.block_until_ready(warm(common.global_array(mesh, P("x"), np.ones(2 << 20, np.uint8))))
multihost_utils.sync_global_devices("ready")
print(f"process {me}: ready ({PATH}, {N} bytes)", flush=True)

if me == 0:
    if PATH == "eager":
        print("process 0: stopping before the psend", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        if PATH == "direct":
            time.sleep(1.5)  # rank 1 waits in its precv
        ext._stop_mid_next_mpi_send(N, STOP_AFTER_S)
        print(f"process 0: sending; stops {STOP_AFTER_S} s after posting", flush=True)
    jax.block_until_ready(compiled(x))
    # Staged, the psend returned before the stop (its send in flight); direct, never.
    print("process 0: program returned", flush=True)
    time.sleep(3600)

if PATH == "staged":
    time.sleep(1.5)  # rank 0 has posted its send and stopped
start = time.perf_counter()
try:
    jax.block_until_ready(compiled(x))
except Exception as e:  # the error is the point of the test: show it, then let it abort
    print(f"process 1: failed after {time.perf_counter() - start:.1f} s, job_broken "
          f"{ext.job_broken()}: {type(e).__name__}: {e}", flush=True)
    if ext.job_broken():
        try:
            jax.block_until_ready(compiled(x))
        except jax.errors.JaxRuntimeError as later:
            text = " ".join(str(later).split())
            print(f"process 1: the next op failed at once: {text}", flush=True)
    raise
print(f"process 1: completed after {time.perf_counter() - start:.1f} s, which it must not",
      flush=True)
