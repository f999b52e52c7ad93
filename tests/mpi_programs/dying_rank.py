"""A rank dies in the middle of point-to-point traffic; the job must end, loudly.

``dying_rank.py SCENARIO`` under ``mpirun -n 2`` (one device per rank):

* ``killed-while-peer-receives``: rank 1 waits in a precv for rank 0, which is SIGKILLed
  (it never sends).
* ``killed-while-peer-sends``: rank 0 has a 256 MiB psend to rank 1 in flight (one-way and
  kept: framed from its operand) and waits in the precv that keeps its operand for rank 1
  to take it; rank 1 is SIGKILLed instead of receiving.
* ``hangs-while-peer-receives``: rank 0 stays alive but never sends (stuck elsewhere):
  rank 1's precv must give up after ``JAX_CPU_MPI_RECV_TIMEOUT`` with an error naming it.
* ``exits-while-peer-sends``: like the second, but rank 1 leaves with ``os._exit(0)``: the
  launcher may see no failure, so the timeout of rank 0's wait for its send must end it.
* ``killed-mid-rendezvous``: rank 1 waits in its precv of 64 MiB and stops itself
  (SIGSTOP); rank 0's one-way psend, whose operand its precv keeps, sends straight from its
  operand (no ready signal), a send that cannot complete; a thread of rank 0 then SIGKILLs
  rank 1.
* ``exits-mid-rendezvous``: rank 1 waits in that precv and leaves with ``os._exit(0)``.
* ``stopped-mid-rendezvous``: rank 1 stops itself there, as in ``killed-mid-rendezvous``,
  and nobody kills it: rank 0's psend, kept in flight by the precv that keeps its operand,
  waits for a receiver that never takes the bytes; that precv must fail
  with the send's timeout error (the psend, its peer, the transport's state), and the job
  end (MPI_Abort ends the stopped rank).
* ``stopped-then-peer-exits``: rank 1 stops itself (SIGSTOP) and never answers; rank 0's
  precv times out, rank 0 catches the ``JaxRuntimeError`` and calls ``sys.exit(3)``: the whole
  launch must end at once (``MPI_Abort``), not wait for the stopped rank.

The survivor must not hang: either the launcher aborts the job when it sees a rank die, or
the survivor's precv gives up after ``JAX_CPU_MPI_RECV_TIMEOUT`` and raises. The test runs
the job with a hard timeout and checks that it ended on its own, with a failure status.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import _mpi_common as common
import jax
import jax.numpy as jnp
import numpy as np
from _mpi_common import P
from jax.experimental import multihost_utils

import jax_cpu_mpi

SCENARIO = sys.argv[1]
me = jax.process_index()
mesh = jax.make_mesh((2,), ("x",))
FWD, BWD = [(0, 1)], [(1, 0)]
# Rows of 4 KiB: 256 MiB while a send is in flight, 64 MiB for the rendezvous, else 4 KiB.
MESSAGE_ROWS = (64 << 10 if SCENARIO.endswith("peer-sends") else
                16 << 10 if SCENARIO.endswith("mid-rendezvous") else 1)


def exchange(v):
    shape = jax.ShapeDtypeStruct(v.shape, v.dtype)
    got = jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", FWD), shape, "x", FWD)  # rank 0 -> rank 1
    reply = jax_cpu_mpi.precv(jax_cpu_mpi.psend(got[:1] + 1, "x", BWD), jax.ShapeDtypeStruct(
        (1, v.shape[1]), v.dtype), "x", BWD)  # rank 1 -> rank 0
    return got[:1] + reply


x = common.global_array(mesh, P("x"), np.ones((2 * MESSAGE_ROWS, 4096), np.uint8))
f = jax.jit(jax.shard_map(exchange, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
compiled = f.lower(x).compile()  # attaches MPI on both ranks
multihost_utils.sync_global_devices("ready")
print(f"process {me}: ready ({SCENARIO})", flush=True)


def die(how: str) -> None:
    print(f"process {me}: dying now ({how})", flush=True)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(0)


if SCENARIO == "killed-while-peer-receives" and me == 0:
    time.sleep(2.0)  # rank 1 is in its precv by now
    die("kill")
if SCENARIO == "stopped-then-peer-exits":
    if me == 1:
        print(f"process {me}: stopping (SIGSTOP), never answers", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)
    time.sleep(1.0)
    try:
        jax.block_until_ready(compiled(x))
    except jax.errors.JaxRuntimeError as e:  # handled: the program decides to exit
        print(f"process {me}: failed: {e}", flush=True)
        print(f"process {me}: sys.exit(3) at {time.time():.3f}", flush=True)
        sys.exit(3)
    print(f"process {me}: completed, unexpectedly", flush=True)
    sys.exit(0)
if SCENARIO == "hangs-while-peer-receives" and me == 0:
    print(f"process {me}: stuck, never sends", flush=True)
    time.sleep(3600)
if SCENARIO.endswith("while-peer-sends") and me == 1:
    time.sleep(3.0)  # rank 0's send is in flight, rank 0 waits for the reply
    die("kill" if SCENARIO.startswith("killed") else "exit")
if SCENARIO.endswith("mid-rendezvous"):
    from mpi4py import MPI

    pids = MPI.COMM_WORLD.allgather(os.getpid())
    if me == 1:
        pending = compiled(x)  # dispatched: the device thread waits in its precv
        time.sleep(1.5)
        if SCENARIO.startswith("exits"):
            die("exit")
        print(f"process {me}: stopping inside the rendezvous", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)
    time.sleep(3.0)  # rank 1 waits in its precv

    def kill_peer() -> None:
        time.sleep(3.0)  # by now rank 0 is in its direct send
        stats = __import__("jax_cpu_mpi").stats()
        # Nothing staged, one send in flight: the direct send from the operand (which the
        # precv that keeps the operand is finishing).
        staged, inflight = stats["mpi_staged_large_sends"], stats["mpi_inflight_sends"]
        print(f"process {me}: while sending: staged {staged}, in flight {inflight}", flush=True)
        assert staged == 0 and inflight == 1 and stats["mpi_direct_sends"] == 0, stats
        print(f"process {me}: process 1 is dying now (kill), from process {me}", flush=True)
        os.kill(pids[1], signal.SIGKILL)

    import threading

    if not SCENARIO.startswith("stopped"):  # stopped: rank 0's own send times out instead
        threading.Thread(target=kill_peer, daemon=True).start()

start = time.perf_counter()
try:
    out = jax.block_until_ready(compiled(x))
except Exception as e:  # the survivor's error is the point of the test: show it
    print(f"process {me}: failed after {time.perf_counter() - start:.1f} s: "
          f"{type(e).__name__}: {e}", flush=True)
    raise
print(f"process {me}: completed {jnp.asarray(out).shape} after "
      f"{time.perf_counter() - start:.1f} s, stats {__import__('jax_cpu_mpi').stats()}",
      flush=True)
common.ok()
