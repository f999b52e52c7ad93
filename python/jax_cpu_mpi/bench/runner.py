"""Runs the selected methods over the sizes, on every rank in the same order.

Cross-process methods run first, on all ranks in lockstep (ranks beyond the first two only
meet the others at each measurement's barrier). Then rank 0 runs the in-process methods
while the other ranks wait asleep.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from jax_cpu_mpi import _jax_cpu_mpi as ext

from . import methods, patterns
from .options import (
    EXTRA_METHODS,
    GPU_METHODS,
    LOCAL_METHODS,
    MPI_METHODS,
    Options,
    format_size,
)
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
        if (m in MPI_METHODS or m in EXTRA_METHODS) and session.pair is not None:
            cross.append(m)
        elif m in LOCAL_METHODS and (session.local_pair is not None
                                         or m in ("memcpy", "hop-floor-local")):
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


def _kinds(options: Options, method: str, nranks: int = 2) -> list[str]:
    """The kinds (one-message kinds, then --pattern's two-way ones) ``method`` measures."""
    kinds = [k for k in options.kinds if k in ("latency", "bandwidth")
             and method in methods.METHODS]
    if method in methods.LATENCY_ONLY:
        kinds = [k for k in kinds if k == "latency"]
    return kinds + [k for k in options.kinds
                    if k in patterns.KINDS and patterns.available(method, k, nranks)]


def _better(a: Measurement | None, b: Measurement) -> Measurement:
    """The repetition with the lower median time per message (the quieter machine)."""
    if a is None:
        return b
    if b.wrong != a.wrong:
        return a if a.wrong > b.wrong else b  # keep a failed validation visible
    return b if float(np.median(b.seconds)) < float(np.median(a.seconds)) else a


def core_round_trip(session: Session, meet: bool) -> float | None:
    """The round trip (ns) of a cache line between the first two CPUs this process may use,
    measured on rank 0 (``meet``: between two barriers, while the other ranks sleep). About
    100 ns where the two share a cache, about 500 ns on the development VM when its host
    runs them apart: the phase that MPI's 8 B and 1 MiB hops follow. None without two CPUs
    (an MPI launcher that binds each rank to one core) and on the other ranks."""
    if meet:
        session.barrier(sleep=True)
    ns = None
    if session.is_root and hasattr(os, "sched_getaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) >= 2:
            got = ext.core_to_core_round_trip_ns(cpus[0], cpus[1])
            ns = float(got) if got > 0 else None
    if meet:
        session.barrier(sleep=True)
    return ns


def merge_rounds(rounds: list[Measurement]) -> Measurement:
    """One result from the rounds of a method at a size: the samples of every round, and
    each round's median (``round_medians_us``, for per-round ratios) and core-to-core round
    trip (``round_core_to_core_ns``, measured when the round started)."""
    first = rounds[0]
    extra = dict(first.extra)
    extra.pop("core_to_core_ns", None)
    extra["round_medians_us"] = [float(np.median(m.seconds)) * 1e6 for m in rounds]
    extra["round_core_to_core_ns"] = [m.extra.get("core_to_core_ns") for m in rounds]
    return Measurement(method=first.method, kind=first.kind, size=first.size,
                       seconds=np.concatenate([m.seconds for m in rounds]),
                       warmup=first.warmup, messages_per_sample=first.messages_per_sample,
                       wrong=sum(m.wrong for m in rounds), mode=first.mode,
                       description=first.description, extra=extra)


def _measure(options: Options, session: Session, method: str, kind: str, size: int,
             participant: bool) -> Measurement | None:
    best: Measurement | None = None
    for _ in range(options.repeat):
        ctx = methods.Context(session, options.plan(size), kind)
        if kind in patterns.KINDS:  # every rank takes part
            best = _better(best, patterns.measure(ctx, method))
        elif participant:
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
    cross_tasks = [(m, k) for m in cross for k in _kinds(options, m, session.nranks)]
    local_tasks = [(m, k) for m in local for k in _kinds(options, m, session.nranks)]
    total = (len(cross_tasks) + len(local_tasks)) * len(options.sizes) * options.rounds
    progress = Progress(total, enabled=options.progress and session.is_root)
    participant = session.rank < 2

    def label(method: str, kind: str, size: int, r: int) -> str:
        text = f"{method} {kind} {format_size(size)}"
        return text if options.rounds == 1 else f"{text} round {r + 1}/{options.rounds}"

    # Size-major, and within a size round-major (raw, ours, raw, ours, ...): the methods
    # compared at one size run close together in time, in every phase of a shared machine.
    for size in options.sizes:
        by_task: dict[tuple[str, str], list[Measurement]] = {}
        for r in range(options.rounds):
            cores = core_round_trip(session, meet=True) if cross_tasks else None
            for method, kind in cross_tasks:
                progress.step(label(method, kind, size, r))
                m = _measure(options, session, method, kind, size, participant)
                wrong = session.allreduce_sum(m.wrong if m is not None else 0)
                if m is not None and session.is_root:
                    m.wrong = wrong
                    m.extra["core_to_core_ns"] = cores
                    by_task.setdefault((method, kind), []).append(m)
        for ms in by_task.values():
            keep(merge_rounds(ms))
    for size in options.sizes:
        by_task = {}
        for r in range(options.rounds):
            # (Only rank 0 runs these; the other ranks sleep until the end.)
            cores = core_round_trip(session, meet=False) if local_tasks else None
            for method, kind in local_tasks:
                progress.step(label(method, kind, size, r))
                m = _measure(options, session, method, kind, size, True)
                if m is not None:
                    m.extra["core_to_core_ns"] = cores
                    by_task.setdefault((method, kind), []).append(m)
        for ms in by_task.values():
            keep(merge_rounds(ms))
    if session.comm is not None and any(m in LOCAL_METHODS for m in options.methods):
        session.idle_barrier()
    progress.close()
    return outcome
