"""A collective's steady cost apart from its program's launch, against the MPI call.

Not a test: a measurement for the in-process meeting of a process's devices (several
devices per rank). ``python -m jax_cpu_mpi.bench.collectives`` times one launch of a scan
of ``--iters`` (20) collectives, so its per-op time holds a twentieth of the launch; here
three programs per size, scans of 1, 20 and 200 collectives over MPI, launch in
interleaved rounds, and the table gives

* ``launch(1)``: one launch of a program of one collective (min and median of rounds);
* ``per op @20``: the median launch of 20 over 20 (what the bench reports);
* ``steady``: (median of 200 - median of 20) / 180, the collective without the launch;
* ``mpi4py``: what the process's one MPI call moves, with mpi4py's call in a loop (median of
  rounds): for psum one device's bytes (its k devices reduce in process first), for the
  others all k devices' bytes;
* with ``--timeline`` (one host), the steady cost split from one launch of the 200-op
  program in the timeline (``jax_cpu_mpi.trace``), medians over process 0's calls:
  ``call`` (a collective's slice: our handler and MPI), ``wait`` (of it, waiting for the
  group) and ``between`` (from one call's end to the next one's start: XLA's loop).

Usage (the build in the interpreter's environment; alternate two builds' launches for an
A/B)::

    mpirun -n 2 python benchmarks/collectives_launch.py --devices 2 --op psum \\
        --sizes 8,4096,32768 --rounds 9 --out DIR
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import shutil
import tempfile
import time

OPS = ("psum", "all_gather", "all_to_all")
#: The timeline's names of their slices.
COLLECTIVES = ("all_reduce", "all_gather", "all_to_all")
#: Each op's benchmark in jax_cpu_mpi.bench.collectives (its MPI call: mpi_call).
BENCHMARK = {"psum": "all_reduce", "all_gather": "all_gather", "all_to_all": "alltoall"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2, help="CPU devices per process")
    parser.add_argument("--op", choices=OPS, default="psum")
    parser.add_argument("--sizes", default="8,4096,32768",
                        help="bytes per process (psum) or per device (the others), commas")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default=None, help="directory for the JSON and the table")
    parser.add_argument("--timeline", action="store_true",
                        help="split the steady cost into the call and XLA's loop (one host)")
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_cpu_mpi  # registers the lowerings

    jax.distributed.initialize(cluster_detection_method="mpi4py")
    from mpi4py import MPI

    from jax_cpu_mpi import config
    from jax_cpu_mpi.bench.collectives import mpi_call
    from jax_cpu_mpi.bench.programs import repeated_in_scan

    config.configure(collectives="mpi")
    comm = MPI.COMM_WORLD
    n = jax.device_count()
    k = args.devices
    mesh = jax.make_mesh((n,), ("x",))

    def program(elements: int, iters: int):
        def one(c):
            if args.op == "psum":
                return jax.lax.psum(c, "x")
            return jax.lax.all_to_all(c, "x", 0, 0, tiled=True)

        def body(v):
            if args.op == "all_gather":
                # The operand carried beside the result, as in jax_cpu_mpi.bench.collectives
                # (a slice of the result would be a copy; the helper's barrier keeps XLA
                # from hoisting gloo's loop-invariant all-gather out of the scan).
                return repeated_in_scan(lambda o: jax.lax.all_gather(o, "x", tiled=True),
                                        v[: elements // n], iters, first=v)
            return jax.lax.scan(lambda c, _: (one(c), None), v, None, length=iters)[0]

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                  check_vma=False))
        x = jax.make_array_from_callback((n * elements,), NamedSharding(mesh, P("x")),
                                         lambda idx: np.ones(elements, np.float32))
        f(x).block_until_ready()  # compile and warm up
        return f, x

    def timeline_split(f, x) -> dict:
        """One launch of ``f`` recorded: medians of process 0's collective slices, their
        waits, and the gaps between a device's consecutive slices (rank 0's dict)."""
        directory = comm.bcast(tempfile.mkdtemp() if comm.Get_rank() == 0 else None)
        comm.Barrier()
        with jax_cpu_mpi.trace(directory):
            f(x).block_until_ready()
        comm.Barrier()
        if comm.Get_rank() != 0:
            return {}
        # Process 0's Chrome trace file (read_timeline merges psend/precv only): one slice
        # per device and collective, with its wait.
        calls = []
        for path in glob.glob(os.path.join(directory, "process0-*.json")):
            with open(path) as fh:
                data = json.load(fh)
            events = data["traceEvents"] if isinstance(data, dict) else data
            calls += [e for e in events if e.get("ph") == "X" and e.get("name") in COLLECTIVES]
        gaps = []
        for device in {e["tid"] for e in calls}:
            mine = sorted((e for e in calls if e["tid"] == device), key=lambda e: e["ts"])
            gaps += [b["ts"] - (a["ts"] + a["dur"]) for a, b in itertools.pairwise(mine)]
        shutil.rmtree(directory, ignore_errors=True)
        if not calls:
            return {"call_us": float("nan"), "call_wait_us": float("nan"),
                    "between_us": float("nan")}
        return {"call_us": float(np.median([e["dur"] for e in calls])),
                "call_wait_us": float(np.median([e["args"]["wait_us"] for e in calls])),
                "between_us": float(np.median(gaps)) if gaps else 0.0}

    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        if args.op == "psum":
            elements = max(size // 4 // k, 1)
        else:
            elements = max(size // 4 // n, 1) * n
        progs = {iters: program(elements, iters) for iters in (1, 20, 200)}
        # What the process's one MPI call moves (bench.collectives.mpi_call).
        call = mpi_call(comm, BENCHMARK[args.op], elements, n, k)
        times: dict[object, list[float]] = {iters: [] for iters in progs}
        times["mpi4py"] = []
        for _ in range(args.rounds):
            for iters, (f, x) in progs.items():
                comm.Barrier()
                t = time.perf_counter()
                f(x).block_until_ready()
                times[iters].append((time.perf_counter() - t) * 1e6)
            comm.Barrier()
            t = time.perf_counter()
            for _ in range(20):
                call()
            times["mpi4py"].append((time.perf_counter() - t) * 1e6 / 20)
        med = {key: float(np.median(v)) for key, v in times.items()}
        row = {"op": args.op, "bytes": size, "devices_per_rank": k,
               "launch1_min_us": min(times[1]), "launch1_med_us": med[1],
               "per_op_at_20_us": med[20] / 20, "steady_us": (med[200] - med[20]) / 180,
               "mpi4py_us": med["mpi4py"]}
        if args.timeline:
            row.update(timeline_split(*progs[200]))
        rows.append(row)
        if comm.Get_rank() == 0:
            print(json.dumps(row), flush=True)
    if comm.Get_rank() == 0:
        table = ["| op | bytes | launch(1) min / med us | per op @20 us | steady us | "
                 "mpi4py us | mpi4py / steady |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            table.append(f"| {r['op']} | {r['bytes']} | {r['launch1_min_us']:.0f} / "
                         f"{r['launch1_med_us']:.0f} | {r['per_op_at_20_us']:.1f} | "
                         f"{r['steady_us']:.1f} | {r['mpi4py_us']:.1f} | "
                         f"{r['mpi4py_us'] / max(r['steady_us'], 1e-9):.2f} |")
        if args.timeline:
            table += ["", "| op | bytes | call us | of it wait us | between calls us |",
                      "|---|---|---|---|---|"]
            table += [f"| {r['op']} | {r['bytes']} | {r['call_us']:.2f} | "
                      f"{r['call_wait_us']:.2f} | {r['between_us']:.2f} |" for r in rows]
        print("\n".join(table))
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            stem = os.path.join(args.out, f"{args.op}-{comm.Get_size()}x{k}")
            with open(stem + ".json", "w") as fh:
                json.dump({"rounds": args.rounds, "rows": rows}, fh, indent=1)
            with open(stem + ".md", "w") as fh:
                fh.write("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
