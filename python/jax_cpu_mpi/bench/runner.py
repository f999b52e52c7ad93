"""Runs the selected methods over the sizes, on every rank in the same order.

Cross-process methods run first, on all ranks in lockstep (ranks beyond the first two only
meet the others at each measurement's barrier). Then rank 0 runs the in-process methods
while the other ranks wait asleep.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from . import methods
from .options import GPU_METHODS, LOCAL_METHODS, MPI_METHODS, Options, format_size
from .progress import Progress
from .session import Session
from .stats import Measurement


@dataclass
class Outcome:
    """Everything a run produced."""

    results: list[Measurement] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _runnable(options: Options, session: Session, notes: list[str]) -> tuple[list[str],
                                                                           list[str]]:
    """(cross-process or GPU methods, in-process methods) this run can measure."""
    chosen = options.methods
    cross: list[str] = []
    local: list[str] = []
    if options.platform == "gpu":
        skipped = [m for m in chosen if m not in GPU_METHODS]
        if skipped:
            notes.append(f"skipped with --platform gpu (CPU methods): {', '.join(skipped)}")
        return [m for m in chosen if m in GPU_METHODS], []
    skipped_gpu = [m for m in chosen if m in GPU_METHODS]
    if skipped_gpu:
        notes.append(f"skipped (need --platform gpu): {', '.join(skipped_gpu)}")
    for m in chosen:
        if m in MPI_METHODS and session.pair is not None:
            cross.append(m)
        elif m in LOCAL_METHODS and (session.local_pair is not None or m == "memcpy"):
            local.append(m)
    if session.nranks > 1 and any(m.startswith("ppermute-local") for m in local):
        local = [m for m in local if not m.startswith("ppermute-local")]
        notes.append(
            "ppermute-local skipped under mpirun: in a multi-process JAX job, XLA runs a "
            "ppermute between two devices of one process through gloo, which hangs at large "
            "sizes (jax 0.10.2). Run `python -m jax_cpu_mpi.bench --methods "
            "memcpy,psend-local,ppermute-local` without mpirun to measure it.")
    if any(m.startswith("mpi4jax") for m in cross):
        why = methods.mpi4jax_available()
        if why is not None:
            cross = [m for m in cross if not m.startswith("mpi4jax")]
            notes.append(
                f"mpi4jax skipped: it does not import ({why}). It is optional: "
                "`PATH=$(dirname $(which python)):$PATH CUDA_PATH=$(mktemp -d) pip install "
                "--no-build-isolation mpi4jax` (needs mpicc on PATH).")
    return cross, local


def _kinds(options: Options, method: str) -> list[str]:
    if method in methods.LATENCY_ONLY:
        return [k for k in options.kinds if k == "latency"]
    return list(options.kinds)


def _better(a: Measurement | None, b: Measurement) -> Measurement:
    """The repetition with the lower median time per message (the quieter machine)."""
    if a is None:
        return b
    if b.wrong != a.wrong:
        return a if a.wrong > b.wrong else b  # keep a failed validation visible
    return b if float(np.median(b.seconds)) < float(np.median(a.seconds)) else a


def _measure(options: Options, session: Session, method: str, kind: str, size: int,
             participant: bool) -> Measurement | None:
    best: Measurement | None = None
    for _ in range(options.repeat):
        ctx = methods.Context(session, options.plan(size), kind)
        if participant:
            best = _better(best, methods.METHODS[method](ctx))
        else:
            session.barrier(sleep=True)  # the one meeting inside each measurement
    return best


def run(options: Options, session: Session,
        on_result: Callable[[Measurement], None] | None = None) -> Outcome:
    """Measures everything; ``on_result`` sees each result on rank 0 as soon as it exists."""
    outcome = Outcome(notes=list(session.notes))

    def keep(m: Measurement) -> None:
        outcome.results.append(m)
        if on_result is not None:
            on_result(m)

    cross, local = _runnable(options, session, outcome.notes)
    if not session.is_root:
        local = []
    cross_tasks = [(m, k) for m in cross for k in _kinds(options, m)]
    local_tasks = [(m, k) for m in local for k in _kinds(options, m)]
    total = (len(cross_tasks) + len(local_tasks)) * len(options.sizes)
    progress = Progress(total, enabled=options.progress and session.is_root)
    participant = session.rank < 2
    # Size-major: the methods compared at one size run close together in time.
    for size in options.sizes:
        for method, kind in cross_tasks:
            progress.step(f"{method} {kind} {format_size(size)}")
            m = _measure(options, session, method, kind, size, participant)
            wrong = session.allreduce_sum(m.wrong if m is not None else 0)
            if m is not None and session.is_root:
                m.wrong = wrong
                keep(m)
    for size in options.sizes:
        for method, kind in local_tasks:
            progress.step(f"{method} {kind} {format_size(size)}")
            m = _measure(options, session, method, kind, size, True)
            if m is not None:
                keep(m)
    if session.comm is not None and any(m in LOCAL_METHODS for m in options.methods):
        session.idle_barrier()
    progress.close()
    return outcome
