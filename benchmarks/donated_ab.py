"""Fresh buffers against a donated, warm one: the same scan of psend/precv steps, two ways.

    mpirun -n 2 -genv GLIBC_TUNABLES glibc.malloc.hugetlb=1 \\
        python benchmarks/donated_ab.py --kind exchange --sizes 64K,1M,16M,64M --rounds 15

Program A is the benchmark's own (``psend/scan`` of ``--pattern``, or the one-way hop's
ping-pong scan with ``--kind pingpong``): each call receives into XLA's fresh per-call
buffers (both scans run their first step before the loop instead of copying ``x`` into a
fresh loop carry). Program B is the same scan whose results are donated back to the next
call (``donate_argnums``), so that it receives into the same buffer at every call, as the
MPI baseline receives into one warm buffer. Program C is the scan as it was before the
first step moved out of the loop: its carry starts from ``x`` (the ping-pong's from
``(x, x)``), which every call copies into the carry. All are compiled in one process and
their calls alternate, so that a loaded machine slows them alike; each rank prints the
median time per step (per hop), the minor page faults per step and B's and C's time over
A's. docs/benchmarks.md ("Fresh buffers against a warm one") quotes its figures.
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_cpu_mpi._src.runtime.config import overrides, parse_bytes
from jax_cpu_mpi.bench import patterns, programs
from jax_cpu_mpi.bench import session as bench_session


def _round_trips(z0: jax.Array, y0: jax.Array, hops: int) -> tuple[jax.Array, jax.Array]:
    """``hops // 2`` ping-pong round trips in a scan whose carry ``(z, y)`` starts from
    ``(z0, y0)``."""
    def round_trip(carry, _):
        z, _ = carry
        y = programs._hop("psend", z, programs.FORWARD)
        return (programs._hop("psend", y, programs.BACKWARD), y), None

    return jax.lax.scan(round_trip, (z0, y0), None, length=hops // 2)[0]


def _pingpong_donated(mesh, hops: int) -> Callable:
    """The ping-pong scan of programs.pingpong_scan from donated carries ``(z, y)``."""
    def body(z0, y0):
        return _round_trips(z0, y0, hops)

    spec = P(programs.AXIS)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec),
                                 out_specs=(spec, spec)), donate_argnums=(0, 1))


def _pingpong_carry_copy(mesh, hops: int) -> Callable:
    """The ping-pong scan as it was before its first round trip ran before the loop: the
    carry starts from ``(x, x)``, which every call copies into the loop's buffers."""
    def body(x):
        return _round_trips(x, x, hops)

    spec = P(programs.AXIS)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec, spec)))


def _programs(session, kind: str, n: int, steps: int):
    """(run A, run B, check B's result, run C or None) for one size."""
    if kind == "pingpong":
        mesh = programs.mesh_of(session.pair)
        x = programs.sharded_pattern(mesh, n)
        fresh = programs.pingpong_scan(mesh, "psend", steps)
        donated = _pingpong_donated(mesh, steps)
        state = [jax.block_until_ready(x.copy()), jax.block_until_ready(jnp.zeros_like(x))]

        def run_b() -> None:
            state[:] = list(jax.block_until_ready(donated(*state)))

        def check() -> bool:  # rank 0's z: the pattern, back from rank 1
            shard = programs.shard_on(state[0], session.pair[0])
            return shard is None or bool((np.asarray(shard) == programs.pattern(n)).all())

        carry_copy = _pingpong_carry_copy(mesh, steps)
        return ((lambda: jax.block_until_ready(fresh(x))), run_b, check,
                lambda: jax.block_until_ready(carry_copy(x)))

    mesh = patterns._mesh(session)
    perm = patterns.pairs(kind, session.nranks)
    value = programs.pattern(n)
    x = jax.make_array_from_callback((session.nranks * n,), NamedSharding(mesh, P(programs.AXIS)),
                                     lambda index: value)
    with overrides(gpu_parity=False):  # one op with a cycle, as a CPU-only program
        fresh = patterns._scan_program(mesh, "psend", perm, steps).lower(x).compile()
        donated = patterns.donated_scan_program(mesh, "psend", perm, steps).lower(x, x).compile()
        carry_copy = jax.jit(jax.shard_map(
            lambda v: programs.repeated_in_scan(
                lambda u: patterns._step("psend", u, perm), v, steps),
            mesh=mesh, in_specs=P(programs.AXIS), out_specs=P(programs.AXIS))).lower(x).compile()
    state = [jax.block_until_ready(jnp.zeros_like(x))]
    two_way = kind != "multi-pair"

    def run_a() -> None:
        jax.block_until_ready(fresh(x))
        if not two_way:
            session.barrier()

    def run_b() -> None:
        state[:] = [jax.block_until_ready(donated(x, state[0]))]
        if not two_way:
            session.barrier()

    def run_c() -> None:
        jax.block_until_ready(carry_copy(x))
        if not two_way:
            session.barrier()

    def check() -> bool:
        if session.rank not in {d for _, d in perm}:
            return True
        me = mesh.devices.reshape(-1)[session.rank]
        return programs.count_wrong(programs.shard_on(state[0], me), value) == 0

    return run_a, run_b, check, run_c


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kind", default="exchange",
                   choices=("pingpong", "exchange", "ring", "multi-pair"))
    p.add_argument("--sizes", default="64K,1M,16M,64M")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--step-bytes", default="512M",
                   help="bytes per call: steps = this / size, 2 to 64 (the benchmark's "
                        "--scan-bytes; multi-pair uses half, as --window-bytes 256M)")
    args = p.parse_args()
    session = bench_session.start("cpu", 1)
    for n in (parse_bytes(s) for s in args.sizes.split(",")):
        budget = parse_bytes(args.step_bytes) // (2 if args.kind == "multi-pair" else 1)
        steps = max(2, min(64, budget // n)) & ~1
        run_a, run_b, check, run_c = _programs(session, args.kind, n, steps)
        runs = [("a", run_a), ("b", run_b)] + ([("c", run_c)] if run_c else [])
        for _, run in runs + runs:  # compile, warm up
            run()
        times: dict[str, list[float]] = {name: [] for name, _ in runs}
        faults: dict[str, list[int]] = {name: [] for name, _ in runs}
        for _ in range(args.rounds):
            for name, run in runs:
                session.barrier()
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        a, b = (float(np.median(times[k])) / steps for k in ("a", "b"))
        fa, fb = (float(np.median(faults[k])) / steps for k in ("a", "b"))
        line = (f"rank {session.rank} {args.kind} {n} B, {steps} steps per call: "
                f"fresh {a * 1e6:.1f} us/step ({fa:.0f} faults), donated {b * 1e6:.1f} us/step "
                f"({fb:.0f} faults), donated/fresh x{b / a:.3f}")
        if run_c:
            c = float(np.median(times["c"])) / steps
            fc = float(np.median(faults["c"])) / steps
            line += (f", carry copied from x {c * 1e6:.1f} us/step ({fc:.0f} faults), "
                     f"carry-copy/fresh x{c / a:.3f}")
        print(f"{line}, checked {check()}", flush=True)


if __name__ == "__main__":
    main()
