"""nccl-tests-style ``all_reduce_perf`` for CPU jobs: ``psum`` over gloo (JAX's path), over
MPI (jax_cpu_mpi), and raw ``MPI_Allreduce`` (mpi4py) of the same bytes, side by side.

Run under an MPI launcher, e.g.
``mpirun -n 2 python -m jax_cpu_mpi.bench.collectives --devices 1 --out DIR``.

Each size runs ``--rounds`` interleaved rounds (gloo, mpi, mpi4py, then again), each round
timing ``--iters`` collectives: a jitted ``lax.scan`` of psums for JAX (one dispatch per
round, the per-op time is the round's time over ``--iters``), a loop of ``Allreduce`` for
mpi4py. Reported: the median per-op time over rounds, nccl-tests' ``algbw`` (bytes / time)
and ``busbw`` (``algbw * 2 (n - 1) / n``, n the devices of the reduction).

``--devices k`` runs k CPU devices per process; the psum then spans all P x k devices and
is compared with mpi4py's Allreduce of the same bytes per process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jax_cpu_mpi.bench.collectives",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=1, help="CPU devices per process")
    p.add_argument("--min-bytes", type=int, default=8)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--factor", type=int, default=8, help="size step (multiplicative)")
    p.add_argument("--iters", type=int, default=20, help="collectives per timed round")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds per size")
    p.add_argument("--out", default=None, help="directory for the JSON and the table")
    return p.parse_args()


def main() -> int:
    args = _parse()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}")
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_cpu_mpi  # noqa: F401  (registers the lowerings)

    jax.distributed.initialize(cluster_detection_method="mpi4py")
    from mpi4py import MPI

    from jax_cpu_mpi import config

    comm = MPI.COMM_WORLD
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("x",))
    rank0 = comm.Get_rank() == 0

    def program(setting: str, elements: int):
        config.configure(collectives=setting)

        def body(v):
            def step(c, _):
                # Nothing but the psum (a rescale would add a pass over the buffer that
                # MPI_Allreduce does not pay): ones grow to n ** iters, far below float32's
                # range for the default 20.
                return jax.lax.psum(c, "x"), None
            return jax.lax.scan(step, v, None, length=args.iters)[0]

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                  check_vma=False))
        x = jax.make_array_from_callback(
            (n * elements,), NamedSharding(mesh, P("x")),
            lambda idx: np.ones(elements, np.float32))
        f(x).block_until_ready()  # compile and warm up
        return f, x

    def time_jax(f, x) -> float:
        comm.Barrier()
        t = time.perf_counter()
        f(x).block_until_ready()
        return (time.perf_counter() - t) / args.iters

    def time_mpi4py(buf, out) -> float:
        comm.Barrier()
        t = time.perf_counter()
        for _ in range(args.iters):
            comm.Allreduce(buf, out, op=MPI.SUM)
        return (time.perf_counter() - t) / args.iters

    rows = []
    size = args.min_bytes
    while size <= args.max_bytes:
        elements = max(size // 4 // args.devices, 1)  # per device; bytes per process = size
        per_process = elements * 4 * args.devices
        gloo, ours = program("gloo", elements), program("mpi", elements)
        buf = np.ones(elements * args.devices, np.float32)
        out = np.empty_like(buf)
        comm.Allreduce(buf, out, op=MPI.SUM)
        times: dict[str, list[float]] = {"gloo": [], "mpi": [], "mpi4py": []}
        for _ in range(args.rounds):
            times["gloo"].append(time_jax(*gloo))
            times["mpi"].append(time_jax(*ours))
            times["mpi4py"].append(time_mpi4py(buf, out))
        medians = {k: float(np.median(v)) for k, v in times.items()}
        # Reduction over n devices of per_process / devices bytes each; the per-process bytes
        # are what one MPI rank moves (nccl-tests' "size" is the bytes of one buffer).
        row = {"bytes": per_process, "devices": n,
               **{f"{k}_us": v * 1e6 for k, v in medians.items()},
               **{f"{k}_algbw_GBps": per_process / v / 1e9 for k, v in medians.items()},
               **{f"{k}_busbw_GBps": per_process / v / 1e9 * 2 * (comm.Get_size() - 1)
                  / comm.Get_size() for k, v in medians.items()},
               "mpi_vs_mpi4py": medians["mpi4py"] / medians["mpi"],
               "gloo_vs_mpi": medians["gloo"] / medians["mpi"]}
        rows.append(row)
        if rank0:
            print(_line(row), flush=True)
        size *= args.factor
    if rank0:
        table = _table(rows, comm.Get_size(), args.devices)
        print(table)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            stem = f"all_reduce_perf-{comm.Get_size()}x{args.devices}"
            with open(os.path.join(args.out, stem + ".json"), "w") as fh:
                json.dump({"ranks": comm.Get_size(), "devices_per_rank": args.devices,
                           "iters": args.iters, "rounds": args.rounds, "rows": rows}, fh,
                          indent=1)
            with open(os.path.join(args.out, stem + ".md"), "w") as fh:
                fh.write(table + "\n")
    return 0


def _line(r: dict) -> str:
    return (f"{r['bytes']:>10} B  gloo {r['gloo_us']:10.1f} us  mpi {r['mpi_us']:10.1f} us  "
            f"mpi4py {r['mpi4py_us']:10.1f} us  ours/mpi4py speed {r['mpi_vs_mpi4py']:.2f}")


def _table(rows: list[dict], ranks: int, devices: int) -> str:
    head = (f"all_reduce_perf: psum of float32, {ranks} ranks x {devices} device(s); time per "
            "op (median of rounds), algbw and busbw (busbw = algbw * 2(P-1)/P, P ranks) in "
            "GB/s\n\n| bytes/rank | gloo us | gloo busbw | MPI (ours) us | ours busbw | "
            "mpi4py us | mpi4py busbw | ours / mpi4py speed | gloo / ours time |\n"
            "|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['bytes']} | {r['gloo_us']:.1f} | {r['gloo_busbw_GBps']:.3f} | "
                     f"{r['mpi_us']:.1f} | {r['mpi_busbw_GBps']:.3f} | {r['mpi4py_us']:.1f} | "
                     f"{r['mpi4py_busbw_GBps']:.3f} | {r['mpi_vs_mpi4py']:.2f} | "
                     f"{r['gloo_vs_mpi']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
