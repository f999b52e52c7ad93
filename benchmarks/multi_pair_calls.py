"""multi-pair split into a cost per call and a cost per message, for psend/scan and raw MPI.

    mpirun -n 2 -genv GLIBC_TUNABLES glibc.malloc.hugetlb=1 \\
        python benchmarks/multi_pair_calls.py --sizes 8,64K --rounds 9

This times ``--pattern multi-pair``'s former sample, one window of one-way messages and an
acknowledgement: for ``psend/scan`` one call of the jitted scan (``patterns._scan_program``)
and the barrier after it, for ``mpi4py`` a window of ``Isend``/``Irecv`` and an 8-byte
reply. (The benchmark now runs several windows per call, each acknowledged by a message,
as ``osu_mbw_mr`` does; ``benchmarks/multi_pair_ab.py`` sets the two side by side.)
Both are timed here with two windows (``--windows``,
16 and 128 messages), their calls interleaved in rounds in one process so that load slows
them alike; the line through the two medians gives the cost of one sample apart from its
messages (per call) and the cost of one more message (per message). Each rank also times an
empty jitted call and the barrier (the floor of a call). Rank 0 prints the figures.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_cpu_mpi._src.runtime.config import overrides, parse_bytes
from jax_cpu_mpi.bench import patterns, programs
from jax_cpu_mpi.bench import session as bench_session


def _fit(small: float, large: float, windows: tuple[int, int]) -> tuple[float, float]:
    """(per call, per message) of the line through two samples' times."""
    per_message = (large - small) / (windows[1] - windows[0])
    return small - windows[0] * per_message, per_message


def _measure(session, n: int, windows: tuple[int, int], rounds: int, samples: int) -> str:
    """One size: both methods and the floor, interleaved; the line rank 0 prints."""
    from mpi4py import MPI

    comm, rank = session.comm, session.rank
    mesh = patterns._mesh(session)
    perm = patterns.pairs("multi-pair", session.nranks)
    dest = [d for s, d in perm if s == rank]
    source = [s for s, d in perm if d == rank]
    value = programs.pattern(n)
    x = jax.make_array_from_callback((session.nranks * n,),
                                     NamedSharding(mesh, P(programs.AXIS)),
                                     lambda index: value)
    with overrides(gpu_parity=False):
        scans = {w: patterns._scan_program(mesh, "psend", perm, w).lower(x).compile()
                 for w in windows}
    empty = jax.jit(lambda v: v).lower(x).compile()
    send, recv, ack = value.copy(), np.zeros(n, np.uint8), np.zeros(8, np.uint8)

    def ours(w: int) -> None:
        jax.block_until_ready(scans[w](x))
        session.barrier()

    def mpi(w: int) -> None:
        reqs = [comm.Irecv(recv, s, 6) for s in source for _ in range(w)]
        reqs += [comm.Isend(send, d, 6) for d in dest for _ in range(w)]
        MPI.Request.Waitall(reqs)
        if source:
            comm.Send(ack, source[0], 7)
        if dest:
            comm.Recv(ack, dest[0], 7)

    def floor(_: int) -> None:
        jax.block_until_ready(empty(x))
        session.barrier()

    runs: dict[str, Callable[[int], None]] = {"psend/scan": ours, "mpi4py": mpi, "floor": floor}
    for run in runs.values():
        for w in windows:
            for _ in range(3):  # compile, warm up
                run(w)
    times: dict[tuple[str, int], list[float]] = {(k, w): [] for k in runs for w in windows}
    for _ in range(rounds):
        for name, run in runs.items():
            for w in windows:
                session.barrier()
                start = time.perf_counter()
                for _ in range(samples):
                    run(w)
                times[(name, w)].append((time.perf_counter() - start) / samples)
    medians = {key: float(np.median(v)) for key, v in times.items()}
    parts = []
    for name in ("psend/scan", "mpi4py"):
        call, message = _fit(medians[(name, windows[0])], medians[(name, windows[1])], windows)
        parts.append(f"{name}: per call {call * 1e6:.1f} us, per message {message * 1e6:.2f} us")
    floor_us = medians[("floor", windows[0])] * 1e6
    return (f"{n} B ({rounds} rounds): " + "; ".join(parts)
            + f"; an empty jitted call and the barrier {floor_us:.1f} us")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="8,64K")
    p.add_argument("--windows", default="16,128", help="the two windows (messages per call)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--samples", type=int, default=50, help="samples per method and round")
    args = p.parse_args()
    first, second = (int(w) for w in args.windows.split(","))
    if not 0 < first < second:
        p.error("--windows takes two windows, the smaller first")
    session = bench_session.start("cpu", 2)  # as the benchmark: 2 CPU devices per process
    for n in (parse_bytes(s) for s in args.sizes.split(",")):
        line = _measure(session, n, (first, second), args.rounds, args.samples)
        if session.rank == 0:
            print(line, flush=True)


if __name__ == "__main__":
    main()
