"""multi-pair's two definitions of a sample, interleaved in one launch: the former one (one
window per jitted call, then a barrier of every rank) against osu_mbw_mr's (several windows
per call, each followed by a 4-byte acknowledgement back from the receiver), for
``psend/scan`` and raw MPI (mpi4py).

    mpirun -n 2 -genv GLIBC_TUNABLES glibc.malloc.hugetlb=1 \\
        python benchmarks/multi_pair_ab.py --sizes 8,64K --rounds 11

Each round runs every variant ``--calls`` times, in turn, after a barrier, so that a loaded
machine slows them alike; rank 0 prints the median time per message over the rounds and the
context switches per message (``getrusage``: a wait that sleeps instead of polling).
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_cpu_mpi._src.runtime.config import overrides, parse_bytes
from jax_cpu_mpi.bench import patterns, programs
from jax_cpu_mpi.bench import session as bench_session


def _variants(session, n: int, window: int, windows: int
              ) -> dict[str, tuple[Callable[[], None], int]]:
    """name -> (one sample, messages in it)."""
    from mpi4py import MPI

    comm, rank = session.comm, session.rank
    mesh = patterns._mesh(session)
    perm = patterns.pairs("multi-pair", session.nranks)
    dest = [d for s, d in perm if s == rank]
    source = [s for s, d in perm if d == rank]
    value = programs.pattern(n)
    x = jax.make_array_from_callback((session.nranks * n,),
                                     NamedSharding(mesh, P(programs.AXIS)), lambda index: value)
    with overrides(gpu_parity=False):
        former = patterns._scan_program(mesh, "psend", perm, window).lower(x).compile()
        osu = patterns.window_program(mesh, "psend", perm, window, windows).lower(x).compile()
    send, recv = value.copy(), np.zeros(n, np.uint8)

    def mpi(count: int, ack_bytes: int) -> None:
        ack = np.zeros(ack_bytes, np.uint8)
        for _ in range(count):
            reqs = [comm.Irecv(recv, s, 6) for s in source for _ in range(window)]
            reqs += [comm.Isend(send, d, 6) for d in dest for _ in range(window)]
            MPI.Request.Waitall(reqs)
            if source:
                comm.Send(ack, source[0], 7)
            if dest:
                comm.Recv(ack, dest[0], 7)

    def former_call() -> None:
        jax.block_until_ready(former(x))
        session.barrier()

    return {
        "psend/scan, former (1 window + barrier)": (former_call, window),
        f"psend/scan, osu_mbw_mr ({windows} windows + acks)":
            (lambda: jax.block_until_ready(osu(x)), window * windows),
        "mpi4py, former (1 window + 8 B ack)": (lambda: mpi(1, 8), window),
        f"mpi4py, osu_mbw_mr ({windows} windows + 4 B acks)":
            (lambda: mpi(windows, patterns.WINDOW_ACK_BYTES), window * windows),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="8,64K")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--calls", type=int, default=10, help="samples per variant per round")
    p.add_argument("--window", type=int, default=64, help="messages per window (OSU's 64)")
    p.add_argument("--windows", type=int, default=4, help="windows per osu_mbw_mr sample")
    args = p.parse_args()
    session = bench_session.start("cpu", 1)
    for n in (parse_bytes(s) for s in args.sizes.split(",")):
        variants = _variants(session, n, args.window, args.windows)
        for run, _ in variants.values():
            for _ in range(3):  # compile, warm up
                run()
        times: dict[str, list[float]] = {k: [] for k in variants}
        switches: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds):
            for name, (run, messages) in variants.items():
                session.barrier()
                before = resource.getrusage(resource.RUSAGE_SELF)
                start = time.perf_counter()
                for _ in range(args.calls):
                    run()
                times[name].append((time.perf_counter() - start) / args.calls / messages)
                after = resource.getrusage(resource.RUSAGE_SELF)
                switches[name].append((after.ru_nvcsw + after.ru_nivcsw - before.ru_nvcsw
                                       - before.ru_nivcsw) / args.calls / messages)
        if session.rank == 0:
            for name in variants:
                print(f"{n} B {name}: {np.median(times[name]) * 1e6:.2f} us per message, "
                      f"{np.median(switches[name]):.3f} context switches per message",
                      flush=True)


if __name__ == "__main__":
    main()
