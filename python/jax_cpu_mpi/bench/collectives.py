"""nccl-tests-style ``all_reduce_perf``, ``all_gather_perf``, ``reduce_scatter_perf`` and
``alltoall_perf`` for CPU jobs: ``psum`` / ``all_gather`` / ``psum_scatter`` / ``all_to_all``
over gloo (JAX's path), over MPI (jax_cpu_mpi), and raw MPI (mpi4py's ``Allreduce``,
``Allgather``, ``Reduce_scatter_block``, ``Alltoall``) of the same bytes, side by side.
Raw MPI runs twice: ``mpi4py`` calls on one unchanging operand (as nccl-tests does), and
``mpi4py-carried`` makes the same calls with the operands moving as our scan's do (the
last result is the next operand of an all_reduce or alltoall; :func:`carried_loop`): an
operand just written by the previous call must reach the peer from this rank's caches,
while an unchanging one can stay cached on both sides from call to call, which alone made
MPI's own all_to_all of 256 KiB twice as fast in C (``benchmarks/alltoall_carried.c``).

Run under an MPI launcher, e.g.
``mpirun -n 2 python -m jax_cpu_mpi.bench.collectives --devices 1 --out DIR``.

Each size runs ``--rounds`` interleaved rounds (gloo, mpi, mpi4py, mpi4py-carried, then
again), each round timing ``--iters`` collectives: a jitted ``lax.scan`` of psums for JAX
(one dispatch per round, the per-op time is the round's time over ``--iters``), a loop of
the MPI call for mpi4py. In each round every method first runs ``--warmup`` untimed
launches (loops of calls for mpi4py) of its own, as nccl-tests warms up before it times:
the first launch of a 2-device program after another method ran (gloo's round, or a
pause) took several times a warm one's, and that cost is the launch's, not the
collective's. Reported: the median per-op time over rounds, nccl-tests' ``algbw`` (bytes /
time) and ``busbw`` (``algbw * 2 (P - 1) / P`` for all_reduce, ``algbw * (P - 1) / P`` for the
others, P ranks). The size is nccl-tests': all_reduce the buffer, all_gather the gathered
output, reduce_scatter the input, alltoall the buffer (per device).

``--devices k`` runs k CPU devices per process. The psum then spans all P x k devices and
is compared with mpi4py's Allreduce of one device's bytes: the k devices of a process reduce
among themselves first, so that is what the process's one MPI call moves, and what an
all_reduce of the same operand moves with one device per rank. The others are compared with
the MPI call on the bytes the process's devices hold together (all_gather: the k blocks of
the process; reduce_scatter and alltoall: k buffers).

Every process runs with glibc's ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (the benchmark
re-executes itself with it before it starts JAX; ``--no-huge-pages`` leaves malloc as the
environment has it), as ``benchmarks/run.sh`` runs the point-to-point benchmark: numpy asks
the kernel for transparent huge pages for every array of 4 MiB and more, so mpi4py's call
writes into huge pages, while XLA's allocator asks for none, so without the tunable ours
writes the same bytes into 4 KiB pages. On a 2-core VM that alone about halves the speed
of MPI's own ``MPI_Allgather`` at 16 MiB (the output's pages decide: MPICH's copy into it,
its single-copy ``process_vm_readv`` included), whoever calls it
(``benchmarks/huge_pages.c``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

#: Benchmark -> (JAX collective, mpi4py call, busbw factor of P ranks).
OPS = ("all_reduce", "all_gather", "reduce_scatter", "alltoall")
#: What runs each op: JAX's collective over gloo, over MPI (ours), mpi4py's call on one
#: unchanging operand, and mpi4py's call whose operands move as our scan's do
#: (:func:`carried_loop`).
METHODS = ("gloo", "mpi", "mpi4py", "mpi4py-carried")


#: glibc's tunable that has malloc mark its large blocks MADV_HUGEPAGE as it maps them, so
#: that their pages fault in as transparent huge pages (with THP set to "madvise", the usual
#: default): what numpy does for its arrays of 4 MiB and more.
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"


def with_huge_pages() -> None:
    """Re-executes this process with :data:`HUGE_PAGES_TUNABLE` added to ``GLIBC_TUNABLES``,
    unless it has a ``glibc.malloc.hugetlb`` setting already (the caller's choice stands) or
    its C library is not glibc. glibc reads its tunables only as a process starts, so the
    benchmark calls this first, before JAX or MPI start (an ``exec`` keeps the process, its
    launcher's environment and its open files)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb=" in tunables or platform.libc_ver()[0] != "glibc":
        return
    os.environ["GLIBC_TUNABLES"] = (f"{tunables}:{HUGE_PAGES_TUNABLE}" if tunables
                                    else HUGE_PAGES_TUNABLE)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def mpi_call(comm: Any, op: str, elements: int, devices: int,
             devices_per_rank: int) -> Callable[[], None]:
    """One process's MPI call (mpi4py, on ``comm``) that a benchmark of ``op`` (one of
    :data:`OPS`) compares with: the bytes our collective gives MPI. ``elements``: float32 per
    device of the op's larger buffer, ``devices`` in the whole mesh. The process's
    ``devices_per_rank`` devices meet first, so one rank sends what they hold together,
    except for all_reduce, whose devices reduce in process to one device's bytes first."""
    from mpi4py import MPI

    return _mpi_call(comm, op, elements, devices, devices_per_rank, MPI.SUM)[0]


def _mpi_call(comm: Any, op: str, elements: int, devices: int, devices_per_rank: int,
              reduction: Any) -> tuple[Callable[[], None], Any, Any]:
    """:func:`mpi_call`'s call with ``reduction`` as the MPI op of the reductions, and the
    numpy buffers it sends from and receives into (in that order), for
    :func:`carried_loop`, whose all_gather and reduce_scatter loops make the same call
    after they have written their launch's values into those buffers."""
    import numpy as np

    k = devices_per_rank
    if op == "all_reduce":
        buf = np.ones(elements, np.float32)
        out = np.empty_like(buf)
        return (lambda: comm.Allreduce(buf, out, op=reduction)), buf, out
    block = elements // devices
    if op == "all_gather":
        buf, out = np.ones(block * k, np.float32), np.empty(elements, np.float32)
        return (lambda: comm.Allgather(buf, out)), buf, out
    if op == "reduce_scatter":
        buf, out = np.ones(elements, np.float32), np.empty(block * k, np.float32)
        return (lambda: comm.Reduce_scatter_block(buf, out, op=reduction)), buf, out
    if op != "alltoall":
        raise ValueError(f"mpi_call: no MPI call for {op!r}; one of {OPS}")
    buf = np.ones(elements * k, np.float32)
    out = np.empty_like(buf)
    return (lambda: comm.Alltoall(buf, out)), buf, out


def carried_loop(comm: Any, op: str, elements: int, devices: int, devices_per_rank: int,
                 *, reduction: Any = None) -> Callable[[int], None]:
    """A loop of ``op``'s MPI call (:func:`mpi_call`'s, on the same bytes, out of place),
    whose operands move as those of :func:`scan_program`'s scan do: ``loop(iters)`` runs
    what one launch of the scan runs, as MPI calls on numpy buffers.

    - all_reduce, alltoall: the scan's operand is the last result. Here each call's output
      is the next call's operand (two buffers in turn), so the peer reads (and this rank
      reduces) bytes that were just written, as in the scan; :func:`mpi_call` re-sends one
      unchanging buffer, whose bytes can stay in the caches of both ranks from call to call
      (in C, ``benchmarks/alltoall_carried.c``).
    - all_gather, reduce_scatter: the scan carries the operand unchanged beside the result
      (no slice or copy inside the loop), so the calls are :func:`mpi_call`'s.

    And what a launch does before its loop: the scan's carry starts as a copy of the
    launch's operand (XLA cannot update a parameter in place), here a copy of an untouched
    operand into the first call's buffer (all_gather: the operand's first block into the
    source, the operand into the result; reduce_scatter: the operand's first block into the
    result). That also starts every loop from the same values (a carried all_reduce of
    ones doubles them at every call).

    ``reduction``: the MPI op of the reductions (``MPI.SUM`` if None)."""
    import numpy as np

    if reduction is None:
        from mpi4py import MPI

        reduction = MPI.SUM
    k = devices_per_rank
    block = elements // devices
    if op in ("all_reduce", "alltoall"):
        size = elements if op == "all_reduce" else elements * k
        launch = np.ones(size, np.float32)
        carry, other = np.empty_like(launch), np.empty_like(launch)

        def loop(iters: int) -> None:
            a, b = carry, other
            np.copyto(a, launch)
            for _ in range(iters):
                if op == "all_reduce":
                    comm.Allreduce(a, b, op=reduction)
                else:
                    comm.Alltoall(a, b)
                a, b = b, a
        return loop
    if op not in ("all_gather", "reduce_scatter"):
        raise ValueError(f"carried_loop: no MPI call for {op!r}; one of {OPS}")
    call, source, result = _mpi_call(comm, op, elements, devices, k, reduction)
    # all_gather's launch operand is the gathered shape, reduce_scatter's its source.
    launch = np.ones(elements, np.float32) if op == "all_gather" else source

    def loop(iters: int) -> None:
        if op == "all_gather":
            np.copyto(source, launch[:block * k])
            np.copyto(result, launch)
        else:
            np.copyto(result, launch[:block * k])
        for _ in range(iters):
            call()
    return loop


def scan_program(op: str, elements: int, mesh: Any, iters: int) -> tuple[Callable, Any]:
    """The jitted program that times ``op`` (one of :data:`OPS`) on ``mesh`` (one axis,
    ``"x"``), compiled and run once, and its operand: ``iters`` of ``op`` in a scan,
    ``elements`` float32 per device of the op's larger buffer, lowered with the
    ``collectives`` setting in force.

    psum and all_to_all keep the same shape: the next op's operand is the last result.
    all_gather and psum_scatter change it, so their scan carries the operand and the
    result side by side (the operand as a sharded parameter or a gradient would stay in
    its own buffer in a real program): deriving the next operand from the result instead
    (a slice, or an update of the operand's buffer) adds a copy of it at every op, which
    MPI's call on its own buffers does not pay."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_cpu_mpi.bench.programs import repeated_in_scan

    n = mesh.size
    block = elements // n if op != "all_reduce" else elements

    def one(c):
        if op == "all_reduce":
            # Nothing but the psum (a rescale would add a pass over the buffer that
            # MPI_Allreduce does not pay): ones grow to n ** iters, far below float32's
            # range for the default 20.
            return jax.lax.psum(c, "x")
        return jax.lax.all_to_all(c, "x", 0, 0, tiled=True)

    def body(v):
        # The operand carried beside the result (repeated_in_scan, as the patterns'
        # programs): its barrier keeps XLA from hoisting gloo's then loop-invariant
        # all-gather / reduce-scatter out of the scan (ours is a side-effecting call).
        if op == "all_gather":
            return repeated_in_scan(lambda o: jax.lax.all_gather(o, "x", tiled=True),
                                    v[:block], iters, first=v)
        if op == "reduce_scatter":
            return repeated_in_scan(lambda o: jax.lax.psum_scatter(o, "x", tiled=True),
                                    v, iters, first=v[:block])

        def step(c, _):
            return one(c), None
        return jax.lax.scan(step, v, None, length=iters)[0]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                              check_vma=False))
    x = jax.make_array_from_callback(
        (n * elements,), NamedSharding(mesh, P("x")),
        lambda idx: np.ones(elements, np.float32))
    f(x).block_until_ready()  # compile and warm up
    return f, x


def _busbw_factor(op: str, ranks: int) -> float:
    """nccl-tests' factor from algbw to busbw."""
    return (2 if op == "all_reduce" else 1) * (ranks - 1) / ranks


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jax_cpu_mpi.bench.collectives",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=1, help="CPU devices per process")
    p.add_argument("--min-bytes", type=int, default=8)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--factor", type=int, default=8, help="size step (multiplicative)")
    p.add_argument("--iters", type=int, default=20,
                   help="collectives per timed round: JAX's are one launch of a jitted scan "
                        "of this many (gloo's and ours alike), so a per-op time holds "
                        "1/iters of a launch; raise it to see the collective's own cost")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed launches (mpi4py: loops) of a method right before each of "
                        "its timed ones, in every round")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds per size")
    p.add_argument("--ops", default=",".join(OPS),
                   help=f"comma-separated, of {', '.join(OPS)}")
    p.add_argument("--out", default=None, help="directory for the JSON and the table")
    p.add_argument("--no-huge-pages", dest="huge_pages", action="store_false",
                   help=f"do not re-execute with GLIBC_TUNABLES={HUGE_PAGES_TUNABLE} (XLA's "
                        "large buffers then stay on 4 KiB pages, numpy's do not)")
    return p.parse_args()


def start(devices: int) -> tuple[Any, Any]:
    """Starts the job as the benchmark runs it: ``devices`` CPU devices per process, JAX's
    distributed runtime from MPI. Returns ``(MPI.COMM_WORLD, a 1-D mesh "x" of every
    device)``. Call it before anything imports jax."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={devices}")
    # CPU collectives: on a machine with a GPU plugin too, JAX's default devices would be
    # the GPU's.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    import jax_cpu_mpi  # noqa: F401  (registers the lowerings)

    # A held port, not JAX's hash(hostname) % 4096 one that concurrent jobs may share.
    from jax_cpu_mpi._src.runtime.launchers import initialize_over_mpi4py

    initialize_over_mpi4py()
    from mpi4py import MPI

    return MPI.COMM_WORLD, jax.make_mesh((jax.device_count(),), ("x",))


def main() -> int:
    args = _parse()
    if args.huge_pages:
        with_huge_pages()
    comm, mesh = start(args.devices)
    import jax
    import numpy as np

    from jax_cpu_mpi import config

    n = jax.device_count()
    rank0 = comm.Get_rank() == 0

    def program(op: str, setting: str, elements: int):
        """``op``'s program (:func:`scan_program`) lowered with ``collectives=setting``."""
        config.configure(collectives=setting)
        return scan_program(op, elements, mesh, args.iters)

    def time_jax(f, x) -> float:
        comm.Barrier()
        t = time.perf_counter()
        f(x).block_until_ready()
        return (time.perf_counter() - t) / args.iters

    def time_mpi4py(loop) -> float:
        comm.Barrier()
        t = time.perf_counter()
        loop(args.iters)
        return (time.perf_counter() - t) / args.iters

    def calls(call):
        def loop(iters: int) -> None:
            for _ in range(iters):
                call()
        return loop

    ranks = comm.Get_size()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or any(m not in METHODS for m in methods):
        raise SystemExit(f"--methods: {args.methods!r} is not a list of {', '.join(METHODS)}")
    for op in [o.strip() for o in args.ops.split(",") if o.strip()]:
        if op not in OPS:
            raise SystemExit(f"--ops: unknown {op!r} (of {', '.join(OPS)})")
        rows = []
        size = args.min_bytes
        while size <= args.max_bytes:
            if op == "all_reduce":
                elements = max(size // 4, 1)  # per device, as MPI_Allreduce's per rank
                nbytes = elements * 4
            else:
                elements = max(size // 4 // n, 1) * n  # per device, n blocks
                nbytes = elements * 4
            timers = {}
            for m in methods:
                if m in ("mpi4py", "mpi4py-carried"):
                    loop = (calls(mpi_call(comm, op, elements, n, args.devices))
                            if m == "mpi4py" else
                            carried_loop(comm, op, elements, n, args.devices))
                    loop(1)
                    timers[m] = lambda loop=loop: time_mpi4py(loop)
                else:
                    f, x = program(op, m, elements)
                    timers[m] = lambda f=f, x=x: time_jax(f, x)
            times: dict[str, list[float]] = {m: [] for m in methods}
            for _ in range(args.rounds):
                for m in methods:
                    for _ in range(args.warmup):
                        timers[m]()
                    times[m].append(timers[m]())
            medians = {k: float(np.median(v)) for k, v in times.items()}
            # A method left out is a blank column (NaN in the JSON).
            medians.update({m: float("nan") for m in METHODS if m not in medians})
            factor = _busbw_factor(op, ranks)
            row = {"bytes": nbytes, "count": nbytes // 4, "type": "float32", "devices": n,
                   **{f"{k}_us": v * 1e6 for k, v in medians.items()},
                   **{f"{k}_algbw_GBps": nbytes / v / 1e9 for k, v in medians.items()},
                   **{f"{k}_busbw_GBps": nbytes / v / 1e9 * factor
                      for k, v in medians.items()},
                   "mpi_vs_mpi4py": medians["mpi4py"] / medians["mpi"],
                   "mpi_vs_carried": medians["mpi4py-carried"] / medians["mpi"],
                   "gloo_vs_mpi": medians["gloo"] / medians["mpi"]}
            rows.append(row)
            if rank0:
                print(op, _line(row), flush=True)
            size *= args.factor
        if rank0:
            tunables = os.environ.get("GLIBC_TUNABLES", "")
            table = _table(op, rows, ranks, args.devices, args.iters, args.warmup, tunables)
            print(table)
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                stem = f"{op}_perf-{ranks}x{args.devices}"
                with open(os.path.join(args.out, stem + ".json"), "w") as fh:
                    json.dump({"op": op, "ranks": ranks, "devices_per_rank": args.devices,
                               "iters": args.iters, "rounds": args.rounds,
                               "warmup": args.warmup, "glibc_tunables": tunables,
                               "rows": rows},
                              fh, indent=1)
                with open(os.path.join(args.out, stem + ".md"), "w") as fh:
                    fh.write(table + "\n")
    return 0


def _line(r: dict) -> str:
    return (f"{r['bytes']:>10} B  gloo {r['gloo_us']:10.1f} us  mpi {r['mpi_us']:10.1f} us  "
            f"mpi4py {r['mpi4py_us']:10.1f} us  carried {r['mpi4py-carried_us']:10.1f} us  "
            f"ours/mpi4py speed {r['mpi_vs_mpi4py']:.2f}  "
            f"ours/carried speed {r['mpi_vs_carried']:.2f}")


def _cell(r: dict, key: str, digits: int) -> str:
    """``r[key]`` with ``digits`` decimals; "-" for a method the run left out (NaN) or a
    column its JSON does not have (a run from before ``mpi4py-carried``)."""
    v = r.get(key, float("nan"))
    return "-" if v != v else f"{v:.{digits}f}"


_WHAT = {"all_reduce": ("psum", "MPI_Allreduce", "2(P-1)/P"),
         "all_gather": ("all_gather (tiled)", "MPI_Allgather", "(P-1)/P"),
         "reduce_scatter": ("psum_scatter (tiled)", "MPI_Reduce_scatter_block", "(P-1)/P"),
         "alltoall": ("all_to_all", "MPI_Alltoall", "(P-1)/P")}


def _table(op: str, rows: list[dict], ranks: int, devices: int, iters: int,
           warmup: int, tunables: str | None = None) -> str:
    """``op``'s nccl-tests table. ``tunables``: the run's ``GLIBC_TUNABLES`` ("": none; None:
    a run from before the benchmark recorded them)."""
    jax_op, mpi_op, factor = _WHAT[op]
    head = (f"{op}_perf: {jax_op} of float32 against {mpi_op} (mpi4py), {ranks} ranks x "
            f"{devices} device(s); time per op (median of rounds), algbw and busbw (busbw = "
            f"algbw * {factor}, P ranks) in GB/s. A round of gloo or ours is one launch of a "
            f"jitted scan of {iters} ops (`--iters`), so their time per op holds 1/{iters} of "
            f"a launch; mpi4py's is a loop of {iters} calls; each timed after "
            f"{warmup} untimed one(s) of its own (`--warmup`)"
            + ("" if devices == 1 else
               f". Sizes per device; mpi4py's call moves what the process's one MPI call "
               f"moves: for all_reduce one device's bytes (the {devices} devices reduce in "
               f"process first), for the others the bytes of all {devices} devices")
            + ("" if tunables is None else
               f"; every process with GLIBC_TUNABLES={tunables}" if tunables else
               "; glibc's malloc as the environment had it (no GLIBC_TUNABLES)")
            + ("" if not any("mpi4py-carried_us" in r for r in rows) else
               ". mpi4py carried: the same call, its operands moving as the scan's do (for "
               "all_reduce and alltoall the last result is the next operand, two buffers "
               "in turn)")
            + "\n\n"
            "| size (B) | count | type | gloo us | gloo busbw | MPI (ours) us | ours busbw | "
            "mpi4py us | mpi4py busbw | mpi4py carried us | carried busbw | "
            "ours / mpi4py speed | ours / carried speed | gloo / ours time |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        cells = [str(r["bytes"]), str(r.get("count", r["bytes"] // 4)),
                 r.get("type", "float32"),
                 _cell(r, "gloo_us", 1), _cell(r, "gloo_busbw_GBps", 3),
                 _cell(r, "mpi_us", 1), _cell(r, "mpi_busbw_GBps", 3),
                 _cell(r, "mpi4py_us", 1), _cell(r, "mpi4py_busbw_GBps", 3),
                 _cell(r, "mpi4py-carried_us", 1), _cell(r, "mpi4py-carried_busbw_GBps", 3),
                 _cell(r, "mpi_vs_mpi4py", 2), _cell(r, "mpi_vs_carried", 2),
                 _cell(r, "gloo_vs_mpi", 1)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
