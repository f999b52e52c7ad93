"""The one-way hop's ping-pong scan at two scan lengths, next to raw MPI, in one launch.

    mpirun -n 2 -genv GLIBC_TUNABLES glibc.malloc.hugetlb=1 \\
        python benchmarks/hops_per_call.py --sizes 16M,64M --rounds 7

``psend/scan``'s hop (:func:`jax_cpu_mpi.bench.programs.pingpong_scan`) pays, once per call,
for the call's fresh output buffers (at 64 MiB, maps that fault in, and that the kernel
clears, at every call), so its figure depends on the hops per call: the benchmark's
``--scan-bytes`` sets them (the patterns run's ``512M``: 32 hops at 16 MiB, 8 at 64 MiB; the
default ``4G``: 256 and 64). This compiles the scan with both counts and times them and
``mpi4py``'s ping-pong in turn in every round; rank 0 prints, per variant, the median time
per hop, the median of the per-round speed ratios to ``mpi4py`` (and their range) and the
minor page faults per hop.
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Callable

import jax
import numpy as np

from jax_cpu_mpi._src.runtime.config import parse_bytes
from jax_cpu_mpi.bench import programs
from jax_cpu_mpi.bench import session as bench_session
from jax_cpu_mpi.bench.methods import mpi_round_trip


def hops_for(scan_bytes: int, n: int) -> int:
    """The benchmark's hops per call for ``--scan-bytes`` (at most 256, even)."""
    return max(2, min(256, scan_bytes // n)) & ~1


def measure(session: bench_session.Session, n: int, scan_bytes: list[int], rounds: int
            ) -> None:
    """Times ``mpi4py`` and each scan length at ``n`` bytes; rank 0 prints the lines."""
    mesh = programs.mesh_of(session.pair)
    x = programs.sharded_pattern(mesh, n)
    counts = sorted({hops_for(b, n) for b in scan_bytes})
    most = counts[-1]
    send, recv = programs.pattern(n), np.zeros(n, np.uint8)
    round_trip = mpi_round_trip(session.pair_comm, session.rank, send, recv)

    def mpi() -> None:
        for _ in range(most // 2):
            round_trip()

    runs: list[tuple[str, Callable[[], object], int]] = [("mpi4py", mpi, most)]
    for hops in counts:
        fn = programs.pingpong_scan(mesh, "psend", hops)
        runs.append((f"psend/scan, {hops} hops a call",
                     lambda fn=fn: jax.block_until_ready(fn(x)), hops))
    for _, run, _ in runs + runs:  # compile, warm up
        run()
    times: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    faults: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for _ in range(rounds):
        for name, run, hops in runs:
            session.barrier()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) / hops)
            faults[name].append(
                (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / hops)
    if session.rank == 0:
        reference = times["mpi4py"]
        for name, seconds in times.items():
            ratios = [a / b for a, b in zip(reference, seconds, strict=True)]
            print(f"{n} B {name}: {np.median(seconds) * 1e6:.1f} us a hop, "
                  f"x{np.median(ratios):.2f} of mpi4py's speed (rounds "
                  f"x{min(ratios):.2f}-x{max(ratios):.2f}), "
                  f"{np.median(faults[name]):.0f} minor faults a hop", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="16M,64M")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--scan-bytes", default="512M,4G", help="the two --scan-bytes compared")
    args = p.parse_args()
    session = bench_session.start("cpu", 1)
    scan_bytes = [parse_bytes(s) for s in args.scan_bytes.split(",")]
    for n in (parse_bytes(s) for s in args.sizes.split(",")):
        measure(session, n, scan_bytes, args.rounds)


if __name__ == "__main__":
    main()
