"""How the wait for an MPI peer copes with where the scheduler puts the ranks.

Not a test: a measurement for ``JAX_CPU_MPI_WAIT``. Unbound ranks (``mpirun -n 2`` with no
binding) now and then land on one core, and then a size of the collectives benchmark runs
several times slower. Forcing that placement makes it reproducible: run the ranks under
``taskset -c 0`` (both on core 0) and compare the wait settings, each launch with one::

    for w in spin auto spin auto; do
      JAX_CPU_MPI_WAIT=$w taskset -c 0 mpirun -n 2 python benchmarks/wait_placement.py
    done

With ``--devices 2`` (unbound, no taskset) it shows the in-process meeting's wait as well:
one involuntary switch an op where each process's two device threads take turns on a core.

(``spin`` is the long spin and yield, ``auto`` the default; on a node with more busy threads
than cores ``auto`` sleeps soon, as ``sleep`` does). Per size, rank 0 prints a psum's time
per op (one launch of a jitted scan of ``--iters`` psums, ``--devices`` per rank, median over
``--rounds``; ``--op all_to_all`` or ``all_gather`` for those, as the collectives benchmark
runs them) next to mpi4py's ``Allreduce`` (or ``Alltoall``, ``Allgather``) of what the
process's one MPI call moves, in the same rounds, and per op:
the process's voluntary and involuntary context switches (all its threads, from ``/proc``)
and the yields and sleeps of our waits (``jax_cpu_mpi.stats()``). The counts do
not depend on the machine's load the way the times do.

``--ab`` compares, in the same rounds, a device that parks in its process's meeting (its
call returns a pending future that the leader completes: JAX_CPU_MPI_PARK=on, the default
``auto`` on a node with more busy threads than cores) with one that waits there (``off``),
in alternate calls of each round: rank 0 prints a line for each.
"""

from __future__ import annotations

import argparse
import glob
import os
import time


def context_switches() -> tuple[int, int]:
    """(voluntary, involuntary) context switches of every thread of this process."""
    voluntary = involuntary = 0
    for path in glob.glob("/proc/self/task/*/status"):
        try:
            with open(path) as fh:
                for line in fh:
                    if line.startswith("voluntary_ctxt_switches"):
                        voluntary += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        involuntary += int(line.split()[1])
        except OSError:  # a thread that ended meanwhile
            continue
    return voluntary, involuntary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,4096,262144", help="bytes per rank, commas")
    parser.add_argument("--iters", type=int, default=200, help="psums per launch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--devices", type=int, default=1,
                        help="CPU devices per rank (2: the in-process meeting's wait too)")
    parser.add_argument("--op", choices=("psum", "all_to_all", "all_gather"), default="psum",
                        help="all_to_all: tiled, of the leading axis, against MPI_Alltoall; "
                             "all_gather: tiled, the size its gathered result, against "
                             "MPI_Allgather")
    parser.add_argument("--ab", action="store_true",
                        help="parked against waiting non-leading devices, in the same rounds")
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_cpu_mpi
    from jax_cpu_mpi import _jax_cpu_mpi
    from jax_cpu_mpi.bench.collectives import mpi_call
    from jax_cpu_mpi.bench.programs import repeated_in_scan

    jax.distributed.initialize(cluster_detection_method="mpi4py")
    from mpi4py import MPI

    jax_cpu_mpi.configure(collectives="mpi")
    comm = MPI.COMM_WORLD
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("x",))

    def counts() -> tuple[int, int, int, int, int]:
        stats = jax_cpu_mpi.stats()
        return (*context_switches(), stats["wait_yields"], stats["wait_sleeps"],
                stats["collective_parks"])

    def one(c):
        if args.op == "psum":
            return jax.lax.psum(c, "x")
        return jax.lax.all_to_all(c, "x", 0, 0, tiled=True)

    def scan(v, block: int):
        if args.op == "all_gather":
            # The operand beside the result, as the collectives benchmark's program.
            return repeated_in_scan(lambda o: jax.lax.all_gather(o, "x", tiled=True),
                                    v[:block], args.iters, first=v)
        return jax.lax.scan(lambda c, _: (one(c), None), v, None, length=args.iters)[0]

    mode = _jax_cpu_mpi.meeting_handoff()  # JAX_CPU_MPI_PARK's, restored after --ab
    for size in (int(s) for s in args.sizes.split(",")):
        # Bytes per device; an all_to_all's operand (an all_gather's result) splits into a
        # block per device.
        elements = max(size // 4, 1) if args.op == "psum" else max(size // 4 // n, 1) * n
        f = jax.jit(jax.shard_map(
            lambda v, b=elements // n: scan(v, b),
            mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
        x = jax.make_array_from_callback((n * elements,), NamedSharding(mesh, P("x")),
                                         lambda idx, e=elements: np.ones(e, np.float32))
        f(x).block_until_ready()  # compile and warm up
        # mpi4py moves what our process's one MPI call moves: one device's bytes for a
        # psum (the devices reduce in process first), every local device's for the others.
        bench_op = {"psum": "all_reduce", "all_to_all": "alltoall"}.get(args.op, args.op)
        call = mpi_call(comm, bench_op, elements, n, args.devices)
        variants = (2, 0) if args.ab else (None,)
        ours: dict = {v: [] for v in variants}
        per_op: dict = {v: [] for v in variants}
        theirs = []
        for _ in range(args.rounds):
            for v in variants:
                if v is not None:
                    _jax_cpu_mpi.set_meeting_handoff(v)
                    f(x).block_until_ready()  # untimed: the other variant ran last
                comm.Barrier()
                before = counts()
                t = time.perf_counter()
                f(x).block_until_ready()
                ours[v].append((time.perf_counter() - t) / args.iters * 1e6)
                per_op[v].append([(b - a) / args.iters
                                  for a, b in zip(before, counts(), strict=True)])
            comm.Barrier()
            t = time.perf_counter()
            for _ in range(args.iters):
                call()
            theirs.append((time.perf_counter() - t) / args.iters * 1e6)
        _jax_cpu_mpi.set_meeting_handoff(mode)
        if comm.Get_rank() == 0:
            for v in variants:
                vol, invol, yields, sleeps, parks = np.median(np.array(per_op[v]), axis=0)
                name = "" if v is None else (" parked" if v == 2 else " waiting")
                print(f"{size} B: {args.op} x{args.devices}{name} {np.median(ours[v]):.1f} "
                      f"us/op (min {min(ours[v]):.1f}), mpi4py {np.median(theirs):.1f} us/op "
                      f"(min {min(theirs):.1f}); per op: "
                      f"{vol:.2f} voluntary, {invol:.2f} involuntary switches, {yields:.1f} "
                      f"yields, {sleeps:.2f} sleeps, {parks:.2f} parked calls", flush=True)


if __name__ == "__main__":
    main()
