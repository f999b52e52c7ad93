"""A peer that never joins a collective over MPI: the other rank's all_gather (its first
use: the group's communicator is never created) and then psum (an established
communicator) fail within JAX_CPU_MPI_RECV_TIMEOUT with an error naming the collective and
the peer, instead of hanging; a collective after that fails at once without calling MPI.
With 2 devices per rank, a device of rank 0 that never joins its sibling's collective (a
psum under a condition that only one of them takes) fails the sibling's meeting within the
timeout too (the sibling parked: its call returned a pending future), and every later
collective of the process fails at once: calls queued behind a dead meeting must not wait a
whole timeout each (JAX keeps dozens in flight).
With the argument ``skipped`` (a launch of its own, 1 device per rank; skipped_collective),
a call whose psend/precv fails on rank 0 before its psum while rank 1's psum ran: rank 0's
next call's psum met rank 1's, each returning the other call's data without a word; now
rank 0 refuses every later collective at once, naming the psum and the failure, and rank
1's psum fails within the timeout (its transport then broken).
Run by tests/runtime/test_collectives_mpi.py (2 devices per rank, JAX_CPU_MPI_RECV_TIMEOUT=3,
JAX_CPU_MPI_ABORT_ON_ERROR=0)."""

import sys
import time

import _mpi_common as common
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_cpu_mpi
from jax_cpu_mpi import _jax_cpu_mpi, config

config.configure(collectives="mpi")
# With 2 devices per rank, a device that does not lead its meeting parks (its call returns a
# pending future) on any machine, not only where the node has more busy threads than cores:
# a parked device must fail by the timeout as a waiting one does.
_jax_cpu_mpi.set_meeting_handoff(2)
n = jax.device_count()
mesh = jax.make_mesh((n,), ("x",))
f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"),
                          out_specs=P("x"), check_vma=False))
x = common.global_array(mesh, P("x"), np.ones(n * 4, np.float32))
f(x).block_until_ready()  # both ranks: the communicator exists, the collective works


def skipped_collective() -> None:
    """On one device per rank: rank 1 sends int32 where rank 0's precv expects float32, so
    rank 0's program fails there and XLA skips its psum after it; rank 1's psum runs."""
    pair = [next(d for d in jax.devices() if d.process_index == p) for p in (0, 1)]
    two = jax.sharding.Mesh(np.array(pair), ("x",))

    def failing(v, w):
        bad = jax_cpu_mpi.precv(jax_cpu_mpi.psend(w, "x", [(1, 0)]),
                                jax.ShapeDtypeStruct(w.shape, jnp.float32), "x", [(1, 0)])
        return jax.lax.psum(v + 0 * bad.sum(), "x"), bad  # the psum after the precv

    spec = (P("x"), P("x"))
    bad_call = jax.jit(jax.shard_map(failing, mesh=two, in_specs=spec, out_specs=spec,
                                     check_vma=False))
    psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=two, in_specs=P("x"),
                                 out_specs=P("x"), check_vma=False))
    ones = common.global_array(two, P("x"), np.ones(8, np.float32))
    ints = common.global_array(two, P("x"), np.arange(8, dtype=np.int32))
    psum(ones).block_until_ready()
    start = time.monotonic()
    try:
        got = bad_call(ones, ints)[0].block_until_ready()
    except jax.errors.JaxRuntimeError as e:
        text = str(e).splitlines()[0]
        if jax.process_index() == 0:
            assert "expected float32[4]" in text, text
        else:  # its psum waited for rank 0's, skipped: the error names the psum
            assert "psum" in text and "did not complete" in text, text
            assert time.monotonic() - start < 3 + 4
        print(f"skipped collective: call failed: {text[:120]}", flush=True)
    else:
        print(f"skipped collective: FAIL: the call returned {np.asarray(got.addressable_data(0))}",
              flush=True)
    if jax.process_index() != 0:
        return
    try:  # 10 + 10, unless it meets rank 1's psum of the failed call
        got = psum(ones * 10).block_until_ready()
    except Exception as e:  # a ValueError where XLA ran the refused program inline
        text = str(e)
        assert "psum" in text and "refused: an earlier call of a program that runs " \
            "collectives failed" in text and "expected float32[4]" in text, text
        print(f"skipped collective: refused at once: {text.splitlines()[0][:160]}", flush=True)
    else:
        print(f"skipped collective: FAIL: {np.asarray(got.addressable_data(0))}", flush=True)

# A psum_scatter large enough that, with 2 devices per rank, it goes as point-to-point
# messages between the processes (MpiTransport::Exchange): run once by both ranks.
rs = jax.jit(jax.shard_map(lambda v: jax.lax.psum_scatter(v, "x", tiled=True), mesh=mesh,
                           in_specs=P("x"), out_specs=P("x"), check_vma=False))
x_rs = common.global_array(mesh, P("x"), np.ones(n * n * 8192, np.float32))
rs(x_rs).block_until_ready()
if sys.argv[1:] == ["skipped"]:  # a launch of its own: rank 1's transport ends up broken
    skipped_collective()
    common.ok()
    sys.exit(0)
if jax.process_index() == 1:
    time.sleep(12)  # the stopped peer: never joins the all_gather nor the second psum
    print("peer: stayed away", flush=True)
    common.ok()
else:

    def fails(call, what: str, needles: tuple[str, ...], within: float, said: str) -> None:
        """``call`` must raise within ``within`` seconds an error holding every needle."""
        start = time.monotonic()
        try:
            call().block_until_ready()
        except Exception as e:
            waited = time.monotonic() - start
            text = str(e)
            assert all(n in text for n in needles), text
            assert waited < within, waited
            print(f"{said} after {waited:.1f} s: {text.splitlines()[0][:300]}", flush=True)
            return
        print(f"FAIL: {what}", flush=True)
        raise SystemExit(1)

    # A timeout's error carries the transport's state (MpiTransport::StallReport).
    STATE = "\n  Transport state at the timeout (this process is MPI rank 0"
    g = jax.jit(jax.shard_map(lambda v: jax.lax.all_gather(v, "x", tiled=True), mesh=mesh,
                              in_specs=P("x"), out_specs=P("x"), check_vma=False))
    fails(lambda: g(x), "the all_gather completed without its peer",
          ("all_gather", "MPI rank 1", "not created in time", STATE), 3 + 4, "raised as expected")
    fails(lambda: rs(x_rs), "the psum_scatter completed without its peer",
          ("reduce_scatter", "MPI rank 1", "did not complete", STATE), 3 + 4, "raised as expected")
    fails(lambda: f(x), "the psum completed without its peer",
          ("psum", "MPI rank 1", "did not complete"), 3 + 4, "raised as expected")
    # The psum's request was abandoned (MPI cannot cancel a collective): any later MPI call
    # could complete it into a buffer XLA has reused, so the next collective must fail at
    # once without calling MPI.
    fails(lambda: f(x), "a collective ran after an abandoned one",
          ("psum", "earlier MPI operation of this process timed out"), 2, "refused at once")
    if jax.local_device_count() > 1:

        def first_device_only(v):
            first = jax.lax.axis_index("x") == 0
            return jax.lax.cond(first, lambda u: jax.lax.psum(u, "x"), lambda u: u, v)

        h = jax.jit(jax.shard_map(first_device_only, mesh=mesh, in_specs=P("x"),
                                  out_specs=P("x"), check_vma=False))
        parked_before = jax_cpu_mpi.stats()["collective_parks"]
        fails(lambda: h(x), "a meeting completed without its sibling device",
              ("psum", "for the other devices of its group in this process"), 3 + 4,
              "meeting raised as expected")
        # The device that came waited parked: the watch over parked devices failed it.
        assert jax_cpu_mpi.stats()["collective_parks"] == parked_before + 1
        print("the device that came had parked", flush=True)
        fails(lambda: f(x), "a collective waited after a dead meeting",
              ("psum", "timed out waiting for the other devices of its group"), 2,
              "meeting refused at once")
    common.ok()
