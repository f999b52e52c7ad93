"""A gradient pytree's psum: its leaves merged into one all-reduce call or one call each.

    mpirun -n 2 python benchmarks/combined_all_reduces.py --devices 2 --leaves 40

JAX binds ``psum`` leaf by leaf; ``passes/combined_all_reduces.py`` merges the small leaves
of one dtype into one call over MPI (``JAX_CPU_MPI_COMBINE_BYTES``). Each program is a jitted
``lax.scan`` of ``--steps`` steps, each a ``psum`` of the whole pytree (``--leaves`` float32
leaves of 16 to 32,768 elements, drawn with a fixed seed, as a model's biases, norms and
small kernels), lowered with each ``--combine-bytes`` setting (256 KiB and 0 by default:
every leaf merged, none merged); the programs alternate in ``--rounds`` rounds, each timed
after one untimed launch of its own. Rank 0 prints, per program, the calls per step in the
lowered program and the step's median and fastest time, and the ratio of the first
setting's median to the last's; ``--out`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=1, help="CPU devices per process")
    p.add_argument("--leaves", type=int, default=40, help="leaves of the pytree")
    p.add_argument("--steps", type=int, default=20, help="psums of the pytree per launch")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds")
    p.add_argument("--combine-bytes", default="262144,0",
                   help="the combine_bytes settings to compare, comma-separated (the first "
                        "is the ratio's numerator's; 0: every leaf its own call)")
    p.add_argument("--out", help="a JSON file for the results")
    args = p.parse_args()

    from jax_cpu_mpi.bench.collectives import start

    comm, mesh = start(args.devices)
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_cpu_mpi import config

    n = jax.device_count()
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in rng.choice([16, 128, 1024, 8192, 32768], args.leaves)]
    values = [rng.standard_normal((n, s)).astype(np.float32) for s in sizes]
    leaves = [jax.make_array_from_callback(v.shape, NamedSharding(mesh, P("x")),
                                           lambda i, v=v: v[i]) for v in values]

    def body(*tree):
        def step(carry, _):
            summed = jax.lax.psum(carry, "x")
            return tuple(jax.lax.pcast(x * 0.5, "x", to="varying") for x in summed), None

        out, _ = jax.lax.scan(step, tree, None, length=args.steps)
        return out

    programs = {}
    settings = [int(x) for x in args.combine_bytes.split(",")]
    for combine in settings:
        label = f"combine_bytes={combine}"
        config.configure(collectives="mpi", combine_bytes=combine)
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        calls = f.lower(*leaves).as_text().count("@jax_cpu_mpi_all_reduce(")
        jax.block_until_ready(f(*leaves))
        programs[label] = (f, calls)
    results = {label: [] for label in programs}
    for _ in range(args.rounds):
        for label, (f, _) in programs.items():
            comm.Barrier()
            t = time.perf_counter()
            jax.block_until_ready(f(*leaves))
            results[label].append((time.perf_counter() - t) / args.steps * 1e6)
    if comm.Get_rank() == 0:
        report = {"ranks": comm.Get_size(), "devices_per_process": args.devices,
                  "leaves": args.leaves, "bytes_per_device": 4 * sum(sizes),
                  "steps": args.steps, "rounds": args.rounds, "programs": {}}
        for label, (_, calls) in programs.items():
            us = results[label]
            report["programs"][label] = {"calls_per_step": calls, "median_us": float(
                np.median(us)), "min_us": float(min(us)), "step_us": us}
            print(f"{label:22s} calls per step {calls:3d}  step median {np.median(us):9.1f} us"
                  f"  fastest {min(us):9.1f} us")
        first, last = (f"combine_bytes={settings[0]}", f"combine_bytes={settings[-1]}")
        ratio = (report["programs"][last]["median_us"] / report["programs"][first]["median_us"])
        report["speed_first_over_last"] = ratio
        print(f"{args.leaves} leaves, {4 * sum(sizes)} bytes per device, {comm.Get_size()} "
              f"ranks x {args.devices} devices: {first} is x{ratio:.2f} the speed of {last} "
              "(medians)")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
