"""How the wait for an MPI peer copes with where the scheduler puts the ranks.

Not a test: a measurement for ``JAX_CPU_MPI_WAIT``. Unbound ranks (``mpirun -n 2`` with no
binding) now and then land on one core, and then a size of the collectives benchmark runs
several times slower. Forcing that placement makes it reproducible: run the ranks under
``taskset -c 0`` (both on core 0) and compare the wait settings, each launch with one::

    for w in spin auto spin auto; do
      JAX_CPU_MPI_WAIT=$w taskset -c 0 mpirun -n 2 python benchmarks/wait_placement.py
    done

(``spin`` is the long spin and yield, ``auto`` the default; on a node with more busy threads
than cores ``auto`` sleeps soon, as ``sleep`` does). Per size, rank 0 prints a psum's time
per op (one launch of a jitted scan of ``--iters`` psums, 1 device per rank, median over
``--rounds``) next to mpi4py's ``Allreduce`` of the same bytes in the same rounds, and per
op: the process's voluntary and involuntary context switches (all its threads, from
``/proc``) and the yields and sleeps of our waits (``jax_cpu_mpi.stats()``). The counts do
not depend on the machine's load the way the times do.
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
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_cpu_mpi

    jax.distributed.initialize(cluster_detection_method="mpi4py")
    from mpi4py import MPI

    jax_cpu_mpi.configure(collectives="mpi")
    comm = MPI.COMM_WORLD
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("x",))

    def counts() -> tuple[int, int, int, int]:
        stats = jax_cpu_mpi.stats()
        return (*context_switches(), stats["wait_yields"], stats["wait_sleeps"])

    for size in (int(s) for s in args.sizes.split(",")):
        elements = max(size // 4, 1)
        f = jax.jit(jax.shard_map(
            lambda v: jax.lax.scan(lambda c, _: (jax.lax.psum(c, "x"), None), v, None,
                                   length=args.iters)[0],
            mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
        x = jax.make_array_from_callback((n * elements,), NamedSharding(mesh, P("x")),
                                         lambda idx, e=elements: np.ones(e, np.float32))
        f(x).block_until_ready()  # compile and warm up
        buf = np.ones(elements, np.float32)
        out = np.empty_like(buf)
        ours, theirs, per_op = [], [], []
        for _ in range(args.rounds):
            comm.Barrier()
            before = counts()
            t = time.perf_counter()
            f(x).block_until_ready()
            ours.append((time.perf_counter() - t) / args.iters * 1e6)
            per_op.append([(b - a) / args.iters for a, b in zip(before, counts(), strict=True)])
            comm.Barrier()
            t = time.perf_counter()
            for _ in range(args.iters):
                comm.Allreduce(buf, out, op=MPI.SUM)
            theirs.append((time.perf_counter() - t) / args.iters * 1e6)
        if comm.Get_rank() == 0:
            vol, invol, yields, sleeps = np.median(np.array(per_op), axis=0)
            print(f"{size} B: psum {np.median(ours):.1f} us/op (min {min(ours):.1f}), "
                  f"mpi4py {np.median(theirs):.1f} us/op (min {min(theirs):.1f}); per psum: "
                  f"{vol:.2f} voluntary, {invol:.2f} involuntary switches, {yields:.1f} "
                  f"yields, {sleeps:.2f} sleeps", flush=True)


if __name__ == "__main__":
    main()
