"""The two-op exchange with and without a combination of its results in every step.

    mpirun -n 2 -genv GLIBC_TUNABLES glibc.malloc.hugetlb=1 \\
        python benchmarks/two_op_ab.py --sizes 64K,1M,16M,64M --rounds 9

Programs of the ``exchange`` pattern (2 ranks x 1 device), compiled in one process, their
calls interleaved in rounds so that a loaded machine slows them alike:

* ``or``: the step ``psend2/scan`` had before: one psend/precv per direction, and the OR of
  the two results (a device receives in one op and gets zeros from the other) in every step;
* ``where``: one psend/precv per direction, each device taking the result of the op it
  receives in (``jnp.where`` on the axis index) in every step, as a GPU-parity program reads
  what it receives;
* ``or-fill``, ``where-fill`` (``--fill-too``): the same programs compiled without
  ``passes/selected_zeros.py``, so that their precvs write the zeros of the op a device is
  no destination of instead of the reading fusion selecting them;
* ``psend2``: ``psend2/scan`` now: each op's result stays in the loop carry, the two are
  ORed once after the loop (the OR selects the zeros: the precvs in the loop write none);
* ``psend2-fill`` (``--fill-too``): ``psend2`` compiled without ``passes/selected_zeros.py``,
  so that the precv a device is no destination of writes its zeros at every step;
* ``psend``: ``psend/scan``, one op with a cycle (``JAX_CPU_MPI_GPU_PARITY=0``).

Each rank prints, per program, the median time per step and the CPU time per step of XLA's
intra-op (Eigen) threads: from 1 MiB XLA splits the OR over them, a wake-up of them in every
step (docs/benchmarks.md, "Two ops, one per direction"). From 16 MiB XLA also splits the
copy of ``x`` into the loop carry, and what follows it may run on the Eigen thread that
finished it, transfers included: the Eigen figure then tells nothing about the OR.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_cpu_mpi._src.passes import selected_zeros
from jax_cpu_mpi._src.runtime.config import overrides, parse_bytes
from jax_cpu_mpi.bench import patterns, programs
from jax_cpu_mpi.bench import session as bench_session

FORMS = ("or", "where", "psend2", "psend")
FILLED = ("or-fill", "where-fill", "psend2-fill")


def _program(form: str, mesh, perm: list[tuple[int, int]], steps: int) -> Callable:
    if form not in ("or", "where"):
        return patterns._scan_program(mesh, form, perm, steps)

    def body(x):
        def step(v):
            up, down = patterns._step("psend2", v, perm)
            if form == "where":  # device 0 receives in the op 1 -> 0 (down)
                return jnp.where(jax.lax.axis_index(programs.AXIS) == 0, down, up)
            return up | down

        return programs.repeated_in_scan(step, x, steps)

    spec = P(programs.AXIS)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


def _eigen_cpu_seconds() -> float:
    """CPU time so far of this process's threads named like XLA's intra-op pool."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread has ended
            continue
        if "Eigen" in stat[stat.index("(") + 1:stat.rindex(")")]:
            fields = stat[stat.rindex(")") + 2:].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime, in ticks
    return total / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="64K,1M,16M,64M")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=3, help="calls per program and round")
    p.add_argument("--step-bytes", default="512M",
                   help="bytes per call: steps = this / size, 8 to 256 (the benchmark's "
                        "--scan-bytes)")
    p.add_argument("--fill-too", action="store_true",
                   help="also or-fill, where-fill and psend2-fill: or, where and psend2 "
                        "with their precvs' zeros written by the precvs "
                        "(passes/selected_zeros.py off)")
    args = p.parse_args()
    forms = FORMS + (FILLED if args.fill_too else ())
    session = bench_session.start("cpu", 1)
    if session.nranks != 2:
        raise SystemExit("two_op_ab.py: run it with mpirun -n 2")
    mesh = patterns._mesh(session)
    perm = patterns.pairs("exchange", session.nranks)
    me = mesh.devices.reshape(-1)[session.rank]
    for n in (parse_bytes(s) for s in args.sizes.split(",")):
        steps = max(8, min(256, parse_bytes(args.step_bytes) // n))
        value = programs.pattern(n)
        x = jax.make_array_from_callback((2 * n,), NamedSharding(mesh, P(programs.AXIS)),
                                         lambda index, value=value: value)
        runs = {}
        for form in forms:
            select = selected_zeros.select_zeros
            if form in FILLED:  # compiled as before the pass's step: the precvs fill
                selected_zeros.select_zeros = lambda module: 0
            try:
                with overrides(gpu_parity=False):  # psend: one op with a cycle
                    program = _program(form.removesuffix("-fill"), mesh, perm, steps)
                    runs[form] = program.lower(x).compile()
            finally:
                selected_zeros.select_zeros = select
            out = jax.block_until_ready(runs[form](x))  # and warm up
            wrong = programs.count_wrong(programs.shard_on(out, me), value)
            if wrong:
                raise SystemExit(f"two_op_ab.py: {form} at {n} B: {wrong} wrong bytes")
        times: dict[str, list[float]] = {form: [] for form in forms}
        eigen = dict.fromkeys(forms, 0.0)
        for _ in range(args.rounds):
            for form in forms:
                session.barrier()
                cpu, start = _eigen_cpu_seconds(), time.perf_counter()
                for _ in range(args.calls):
                    jax.block_until_ready(runs[form](x))
                times[form].append((time.perf_counter() - start) / args.calls / steps)
                eigen[form] += _eigen_cpu_seconds() - cpu
        per_step = args.rounds * args.calls * steps
        median = {form: float(np.median(times[form])) for form in forms}
        print(f"rank {session.rank} {n} B, {steps} steps per call: " + ", ".join(
            f"{form} {np.median(times[form]) * 1e6:.1f} us/step "
            f"(Eigen {eigen[form] / per_step * 1e6:.1f} us/step)" for form in forms)
            + f"; psend2/or x{median['psend2'] / median['or']:.2f}"
            + (f"; psend2-fill/psend2 x{median['psend2-fill'] / median['psend2']:.2f}"
               if args.fill_too else ""),
            flush=True)


if __name__ == "__main__":
    main()
