"""Where a large collective's time goes with several devices per rank: per op, ours beside
mpi4py's call, the counts that depend little on the machine's load.

    mpirun -n 2 python benchmarks/collective_counts.py --devices 2 \\
        --sizes 262144,2097152,16777216 --ops all_reduce,all_gather,reduce_scatter,alltoall

Each op and size runs the collectives benchmark's own programs (``python -m
jax_cpu_mpi.bench.collectives``: a jitted ``lax.scan`` of ``--iters`` collectives over MPI,
the same sizes and shapes) and its mpi4py call (``mpi_call``: what the process's one MPI
call moves), alternating in ``--rounds`` rounds after a barrier, each timed after one
untimed launch (loop) of its own. Rank 0 prints, per op, the median over rounds of: the
time, the process's CPU time (user + system: the copies and reductions each process does,
``process_vm_readv``'s copy of MPI's shared-memory path counts as system time) and its
system part, the page faults (fresh output pages: XLA's result buffers of a launch), and
the voluntary and involuntary context switches (``getrusage``, all threads). On a loaded
machine the times stretch, but the CPU time per op follows the bytes each process moves.
For an A/B of two builds, run the same command with each build's Python in alternating
launches.

``--program fresh`` times a jitted program of one collective instead (all_gather of the
operand's first block, psum_scatter, all_to_all or psum of the operand), launched
``--iters`` times: XLA allocates its output afresh at every launch, as for a collective
outside a loop, so its page faults (4 KiB or huge pages: ``GLIBC_TUNABLES``, and the hint a
large collective output gets, ``kHugePageHintBytes`` in cpp/common/keep_freed_memory.h)
count per op.
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Callable

#: getrusage fields reported per op, with the key they are printed under.
FIELDS = ("us", "cpu_us", "sys_us", "faults", "vcsw", "ivcsw")


def _usage() -> tuple[float, float, int, int, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_stime, r.ru_minflt, r.ru_nvcsw, r.ru_nivcsw


def _measure(comm, run: Callable[[], None], ops: int) -> dict[str, float]:
    """``run`` (``ops`` collectives) once after a barrier: per-op time and counts."""
    comm.Barrier()
    before, t = _usage(), time.perf_counter()
    run()
    elapsed, after = time.perf_counter() - t, _usage()
    d = [(a - b) / ops for a, b in zip(after, before, strict=True)]
    return {"us": elapsed / ops * 1e6, "cpu_us": d[0] * 1e6, "sys_us": d[1] * 1e6,
            "faults": d[2], "vcsw": d[3], "ivcsw": d[4]}


def fresh_program(op: str, elements: int, mesh) -> tuple[Callable, object]:
    """One ``op`` (of the collectives benchmark's OPS) of the operand the benchmark's
    ``scan_program`` takes (``elements`` float32 per device), jitted, compiled and run once,
    and that operand."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.size
    block = elements // n
    body = {"all_reduce": lambda v: jax.lax.psum(v, "x"),
            "all_gather": lambda v: jax.lax.all_gather(v[:block], "x", tiled=True),
            "reduce_scatter": lambda v: jax.lax.psum_scatter(v, "x", tiled=True),
            "alltoall": lambda v: jax.lax.all_to_all(v, "x", 0, 0, tiled=True)}[op]
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                              check_vma=False))
    x = jax.make_array_from_callback((n * elements,), NamedSharding(mesh, P("x")),
                                     lambda idx: np.ones(elements, np.float32))
    f(x).block_until_ready()
    return f, x


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=2, help="CPU devices per process")
    p.add_argument("--sizes", default="262144,2097152,16777216",
                   help="bytes, as the collectives benchmark's sizes (commas)")
    p.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter,alltoall")
    p.add_argument("--iters", type=int, default=50, help="collectives per launch")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--program", choices=("scan", "fresh"), default="scan",
                   help="scan: the benchmark's scan of --iters ops; fresh: --iters launches "
                        "of one op (a fresh output each)")
    args = p.parse_args()
    from jax_cpu_mpi.bench.collectives import OPS, mpi_call, scan_program, start

    comm, mesh = start(args.devices)
    import jax
    import numpy as np

    from jax_cpu_mpi import config

    n = jax.device_count()
    config.configure(collectives="mpi")

    for op in [o.strip() for o in args.ops.split(",") if o.strip()]:
        if op not in OPS:
            raise SystemExit(f"--ops: unknown {op!r} (of {', '.join(OPS)})")
        for size in [int(s) for s in args.sizes.split(",") if s.strip()]:
            elements = max(size // 4, 1) if op == "all_reduce" else max(size // 4 // n, 1) * n
            if args.program == "fresh":
                f, x = fresh_program(op, elements, mesh)
                launches = args.iters
            else:
                f, x = scan_program(op, elements, mesh, args.iters)
                launches = 1
            call = mpi_call(comm, op, elements, n, args.devices)

            def ours(f=f, x=x, launches=launches) -> None:
                for _ in range(launches):
                    f(x).block_until_ready()

            def theirs(call=call) -> None:
                for _ in range(args.iters):
                    call()

            rows: dict[str, list[dict[str, float]]] = {"ours": [], "mpi4py": []}
            for _ in range(args.rounds):
                for name, run in (("ours", ours), ("mpi4py", theirs)):
                    run()  # warm up (the first launch after the other method's)
                    rows[name].append(_measure(comm, run, args.iters))
            if comm.Get_rank() == 0:
                for name, rs in rows.items():
                    med = {k: float(np.median([r[k] for r in rs])) for k in FIELDS}
                    print(f"{op:15s} {size:>9d} B {name:7s} " +
                          "  ".join(f"{k} {med[k]:9.1f}" for k in FIELDS), flush=True)


if __name__ == "__main__":
    main()
