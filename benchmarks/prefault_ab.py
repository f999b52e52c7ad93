"""A waiting precv's output faulted in during the wait, on and off, in one launch.

    mpirun -n 2 python benchmarks/prefault_ab.py --sizes 1M,16M,64M --kinds hop,late,exchange

Both ranks switch the fault-in (``_prefault_waiting_outputs``, cpp/common/keep_freed_memory.h)
on and off together before every call, in alternating order from round to round, so that a
loaded machine slows both alike (``--switch zero-fill-ends``: instead whether the zeros of a
large precv that is no destination give back, on, or write, off, the 4 KiB pages not in memory
at the output's partial huge pages; ``_zero_fill_ends_by_page``, cpp/local/zero_fill.h).
The programs:

* ``hop``: the benchmark's ``psend/scan`` ping-pong (hops per call as its ``--scan-bytes``,
  here too; 4G by default);
* ``donated``: its ``psend-donated/scan`` (the same round trips into the previous call's
  results, donated back: warm outputs, whose fault-in finds every page present);
* ``late``: one one-way hop per call whose sender sleeps 20 ms before it (a pipeline's stage
  waiting for the stage before): the receiver's call time less the delay;
* ``exchange``: the patterns' one-op exchange scan (a cycle: never faulted in, a control).

Each rank prints, per program and size, the median time per message both ways, on/off's
speed ratio and the quartiles of the per-round ratios, and the minor page faults per call.
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

from jax_cpu_mpi import _jax_cpu_mpi as ext
from jax_cpu_mpi._src.runtime.config import overrides, parse_bytes
from jax_cpu_mpi.bench import patterns, programs
from jax_cpu_mpi.bench import session as bench_session

LATE_S = 0.02


def _program(session, kind: str, n: int, scan_bytes: int
             ) -> tuple[Callable[[], None], int, float]:
    """(one call, messages per call, the sender's delay) for ``kind`` at ``n`` bytes."""
    mesh = programs.mesh_of(session.pair)
    hops = max(2, min(256, scan_bytes // n)) & ~1
    x = programs.sharded_pattern(mesh, n)
    if kind == "hop":
        hop = programs.pingpong_scan(mesh, "psend", hops)
        return (lambda: jax.block_until_ready(hop(x))), hops, 0.0
    if kind == "donated":
        donated = programs.pingpong_donated_scan(mesh, "psend", hops)
        copy = jax.jit(lambda v: v + np.uint8(0), out_shardings=x.sharding)
        state = [jax.block_until_ready(copy(x)), jax.block_until_ready(copy(x))]

        def again() -> None:
            state[:] = jax.block_until_ready(donated(*state))

        return again, hops, 0.0
    if kind == "late":
        one = programs.one_way(mesh, "psend")

        def late() -> None:
            if session.rank == 0:
                time.sleep(LATE_S)
            jax.block_until_ready(one(x))

        return late, 1, LATE_S
    pair_mesh = patterns._mesh(session)
    perm = patterns.pairs("exchange", session.nranks)
    value = programs.pattern(n)
    xe = jax.make_array_from_callback((session.nranks * n,),
                                      NamedSharding(pair_mesh, P(programs.AXIS)),
                                      lambda index: value)
    with overrides(gpu_parity=False):  # one op with a cycle, as a CPU-only program
        step = patterns._scan_program(pair_mesh, "psend", perm, hops).lower(xe).compile()
    return (lambda: jax.block_until_ready(step(xe))), hops, 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1M,16M,64M")
    p.add_argument("--kinds", default="hop,late,exchange")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--switch", choices=("prefault", "zero-fill-ends"), default="prefault")
    p.add_argument("--scan-bytes", default="4G",
                   help="hops a call of hop, donated and exchange: this / size (2 to 256)")
    args = p.parse_args()
    switch = (ext._prefault_waiting_outputs if args.switch == "prefault"
              else ext._zero_fill_ends_by_page)
    session = bench_session.start("cpu", 1)
    for n in (parse_bytes(s) for s in args.sizes.split(",")):
        for kind in args.kinds.split(","):
            run, per_call, delay = _program(session, kind, n, parse_bytes(args.scan_bytes))
            for on in (True, False, True, False):  # compile, warm up
                switch(on)
                session.barrier()
                run()
            times: dict[bool, list[float]] = {True: [], False: []}
            faults: dict[bool, list[int]] = {True: [], False: []}
            for r in range(args.rounds):
                for on in ((True, False) if r % 2 == 0 else (False, True)):
                    switch(on)
                    session.barrier()
                    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    start = time.perf_counter()
                    run()
                    times[on].append(time.perf_counter() - start - delay)
                    faults[on].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
            switch(True)
            on_us, off_us = (float(np.median(times[k])) / per_call * 1e6 for k in (True, False))
            ratios = np.array(times[False]) / np.array(times[True])
            print(f"rank {session.rank} {kind} {n} B ({per_call} messages a call, {args.rounds} "
                  f"rounds): on {on_us:.1f} us, off {off_us:.1f} us a message, on/off speed "
                  f"x{off_us / on_us:.3f} (rounds' quartiles x{np.percentile(ratios, 25):.3f}-"
                  f"x{np.percentile(ratios, 75):.3f}), faults a call on "
                  f"{np.median(faults[True]):.0f}, off {np.median(faults[False]):.0f}", flush=True)


if __name__ == "__main__":
    main()
