"""The JAX side of the pipeline benchmark: one configuration per process (or mpirun job).

Launched by ``run.py``::

    python benchmarks/pipeline/jax_bench.py --schedule baseline --out r.json     # 1 device
    python benchmarks/pipeline/jax_bench.py --schedule 1f1b --devices 4 --out r.json
    mpirun -n 2 python benchmarks/pipeline/jax_bench.py --schedule 1f1b --devices 2 --out r.json
    mpirun -n 2 python benchmarks/pipeline/jax_bench.py --schedule 1f1b --devices 2 --stages 2 \
        --data 2 --collectives gloo,mpi --out r.json


``baseline``: ``jax.jit(jax.value_and_grad(loss))`` of the whole model on the full batch,
one device. Otherwise the schedule (``gpipe``, ``1f1b``, ``interleaved-1f1b``,
``zero-bubble``) of ``jax_cpu_mpi.pipeline`` over a 1-D ``'stage'`` mesh of every device of
the job (stage ``s`` on the job's ``s``-th device, process by process); ``NAME-kept`` runs
it with ``remat=False``; ``NAME-fill`` compiles it with the executor's precvs writing the
zeros of a stage that is no destination (``passes/selected_zeros.py`` leaves them
unwritten: no tick reads them), to time both in one launch. ``--data D``: a ``stage x
data`` mesh instead, the stages inside a process and the ``D`` data shards across processes
(``mpirun -n D``, ``--devices`` = ``--stages``): each shard runs the pipeline on its part
of every microbatch and the gradients are averaged over ``data``
(``shard_value_and_grad(data_axis_name=...)``, a ``pmean`` between the processes).
``--collectives gloo,mpi`` compiles every schedule once per setting of
``JAX_CPU_MPI_COLLECTIVES`` (read when a program is lowered), checks that the settings give
the same loss and gradients, and times them in turn. Both compute the loss and the
gradients only (no optimizer update), as the torch side does. Before timing, the loss and
the gradients are compared with a float64 NumPy reference (exit 1 beyond float32
tolerance). Process 0 writes the JSON: per-step seconds of every repeat (process 0's wall
clock until its outputs are ready), XLA's compiled memory analysis (temp bytes of one
device's program) and the peak RSS of every process.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

# model.py is NumPy only: importing it before JAX leaves the XLA flags to parse_args.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import add_model_arguments

PIPELINES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
#: ``NAME-kept``: the same schedule with remat=False (the forwards keep their residuals).
#: ``NAME-fill`` (``NAME-kept-fill``): compiled with the executor's precvs writing their
#: zeros where their stage is no destination, as before the pass marked them, for an A/B
#: inside one launch.
SCHEDULES = ("baseline", *PIPELINES, *(f"{n}-kept" for n in PIPELINES),
             *(f"{n}{k}-fill" for n in PIPELINES for k in ("", "-kept")))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--schedule", required=True,
                   help="comma-separated: " + ", ".join(SCHEDULES) + " (baseline alone)")
    p.add_argument("--devices", type=int, default=1, help="CPU devices per process")
    p.add_argument("--data", type=int, default=1,
                   help="data-parallel shards (a stage x data mesh, data across processes)")
    p.add_argument("--collectives", default="",
                   help="comma-separated JAX_CPU_MPI_COLLECTIVES settings (gloo, mpi) to "
                        "compile and time each schedule with ('' = the environment's)")
    add_model_arguments(p)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", required=True)
    return p.parse_args()


ARGS = parse_args()
# Before JAX creates its CPU backend, which reads XLA_FLAGS.
_flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count={ARGS.devices}".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from model import (  # noqa: E402
    Shape,
    make_problem,
    reference_loss_and_grads,
    relative_difference,
)

import jax_cpu_mpi  # noqa: E402, F401  (registers the CPU lowerings of psend/precv)

_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


def chunk_fn(params: dict[str, jax.Array], h: jax.Array) -> jax.Array:
    """One pipeline chunk: its layers ``h -> tanh(h @ w + b)`` in order."""
    for i in range(params["w"].shape[0]):
        h = jnp.tanh(h @ params["w"][i] + params["b"][i])
    return h


def mse(out: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.mean((out - target) ** 2)


def time_steps(run, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - start)
    return times


def temp_bytes(compiled) -> int | None:
    analysis = compiled.memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def baseline(shape: Shape, problem, name: str) -> tuple[dict, Callable]:
    def loss(params, x, y):
        return mse(chunk_fn(params, x), y)

    device = jax.local_devices()[0]
    params = jax.device_put({"w": problem.w, "b": problem.b}, device)
    x, y = jax.device_put(problem.x, device), jax.device_put(problem.y, device)
    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, x, y).compile()
    value, grads = compiled(params, x, y)
    return ({"layout": "1 process x 1 device (no pipeline, full batch)",
             "loss": float(value), "grads_w": np.asarray(grads["w"]),
             "grads_b": np.asarray(grads["b"]), "temp_bytes": temp_bytes(compiled)},
            lambda: compiled(params, x, y))


#: The target of the package's cross-process all-reduce (a ``pmean`` lowered over MPI).
MPI_ALL_REDUCE = "jax_cpu_mpi_all_reduce"


def pipelined(shape: Shape, problem, name: str, collectives: str = "") -> tuple[dict, Callable]:
    from jax.experimental import multihost_utils

    from jax_cpu_mpi import config
    from jax_cpu_mpi import pipeline as pl

    fill = name.endswith("-fill")
    name = name.removesuffix("-fill")
    kept = name.endswith("-kept")
    name = name.removesuffix("-kept")
    virtual = ARGS.virtual_stages if name == "interleaved-1f1b" else 1
    shape.check(virtual)
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    D = ARGS.data
    if len(devices) != shape.stages * D:
        raise SystemExit(f"jax_bench: {shape.stages} stages x {D} data shards need "
                         f"{shape.stages * D} devices, the job has {len(devices)}")
    if shape.batch % (shape.microbatches * D):
        raise SystemExit(f"jax_bench: batch {shape.batch} is not a multiple of "
                         f"{shape.microbatches} microbatches x {D} data shards")
    if D == 1:
        mesh = jax.make_mesh((shape.stages,), ("stage",), devices=devices)
    else:
        # Data shard d on the d-th block of devices (process by process): the stages stay
        # inside a process, the gradients' pmean over "data" crosses processes.
        grid = np.asarray(devices).reshape(D, shape.stages).T
        mesh = jax.sharding.Mesh(grid, ("stage", "data"))
    schedule = pl.schedule_by_name(name, virtual_stages=virtual)
    S, V, lpc = shape.stages, virtual, shape.layers // (shape.stages * virtual)
    W = shape.width

    # Model chunk c = v * P + s (looping placement) holds layers c*lpc ... -> [P, V, lpc, ...].
    def stacked(a: np.ndarray) -> np.ndarray:
        a = a.reshape(V, S, lpc, *a.shape[1:]).swapaxes(0, 1)
        return a[:, 0] if V == 1 else a

    host_params = {"w": stacked(problem.w), "b": stacked(problem.b)}
    M = shape.microbatches
    host_x = problem.x.reshape(M, -1, W)
    host_y = problem.y.reshape(M, -1, W)

    def to_mesh(a: np.ndarray, spec: P) -> jax.Array:
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec),
                                            lambda index: a[index])

    params = jax.tree.map(lambda a: to_mesh(a, P("stage")), host_params)
    batch_spec = P() if D == 1 else P(None, "data")
    x, y = to_mesh(host_x, batch_spec), to_mesh(host_y, batch_spec)
    f = pl.shard_value_and_grad(chunk_fn, mse, mesh, schedule, axis_name="stage",
                                data_axis_name=None if D == 1 else "data", remat=not kept)
    setting = {"collectives": collectives} if collectives else {}
    from jax_cpu_mpi._src.passes import selected_zeros

    unread = selected_zeros.unread_off_destinations
    if fill:  # the pass's step off while this program is lowered: its precvs fill
        selected_zeros.unread_off_destinations = lambda module: 0
    try:
        with config.overrides(**setting):  # the collectives' lowering is chosen here
            compiled = jax.jit(f).lower(params, x, y).compile()
    finally:
        selected_zeros.unread_off_destinations = unread
    mpi_reductions = compiled.as_text().count(MPI_ALL_REDUCE)
    value, grads = compiled(params, x, y)
    grads = jax.tree.map(lambda g: np.asarray(multihost_utils.process_allgather(g, tiled=True)),
                         grads)

    def unstacked(g: np.ndarray) -> np.ndarray:  # back to model order [L, ...]
        g = g[:, None] if V == 1 else g
        return g.swapaxes(0, 1).reshape(shape.layers, *g.shape[3:])

    # The mean loss is the same on every stage: any local shard holds it.
    loss_value = float(np.asarray(value.addressable_data(0)).ravel()[0])
    bound = schedule.bind(S, M) if hasattr(schedule, "bind") else schedule
    return ({"layout": (f"{jax.process_count()} process(es) x {jax.local_device_count()} "
                        f"device(s)" + (" (mpirun)" if jax.process_count() > 1 else "")
                        + (f", {S} stages x {D} data shards" if D > 1 else "")),
             "loss": loss_value, "grads_w": unstacked(grads["w"]),
             "grads_b": unstacked(grads["b"]), "temp_bytes": temp_bytes(compiled),
             "data": D, "collectives": collectives or "environment",
             "mpi_all_reduce_calls": mpi_reductions,
             "bubble_fraction_theory": float(getattr(bound, "bubble_fraction", float("nan"))),
             "peak_stash_theory": list(getattr(bound, "peak_stash", ()))},
            lambda: compiled(params, x, y))


def main() -> int:
    if any(v in os.environ for v in _MPI_RANK_VARS):
        jax.distributed.initialize()
    names = ARGS.schedule.split(",")
    if any(n not in SCHEDULES for n in names) or ("baseline" in names and len(names) > 1):
        raise SystemExit(f"jax_bench: --schedule {ARGS.schedule}: use baseline alone or "
                         f"some of {', '.join(SCHEDULES[1:])}")
    shape = Shape(ARGS.layers, ARGS.width, ARGS.batch, ARGS.stages, ARGS.microbatches,
                  ARGS.seed)
    shape.check(1)
    problem = make_problem(shape)
    want_loss, want_gw, want_gb = reference_loss_and_grads(problem)
    settings = [c for c in ARGS.collectives.split(",") if c]
    if any(c not in ("gloo", "mpi") for c in settings) or (settings and "baseline" in names):
        raise SystemExit(f"jax_bench: --collectives {ARGS.collectives}: use gloo and/or mpi, "
                         f"with pipeline schedules")
    if ARGS.data > 1 and "baseline" in names:
        raise SystemExit("jax_bench: --data needs a pipeline schedule, not baseline")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    results, runs = {}, {}
    # A run is a schedule (NAME) or a schedule with a collectives setting (NAME@SETTING).
    keys = [f"{n}@{c}" for n in names for c in settings] if settings else names
    first: dict[str, tuple[float, np.ndarray, np.ndarray]] = {}
    for key in keys:  # compile and check every run first
        name, _, setting = key.partition("@")
        if name == "baseline":
            result, runs[key] = baseline(shape, problem, name)
        else:
            result, runs[key] = pipelined(shape, problem, name, setting)
        loss, gw, gb = result.pop("loss"), result.pop("grads_w"), result.pop("grads_b")
        # Bit-equality with another launch (another collectives setting) without the arrays.
        result["digest"] = hashlib.sha256(np.float32(loss).tobytes() + np.asarray(gw).tobytes()
                                          + np.asarray(gb).tobytes()).hexdigest()
        grad_diff = max(relative_difference(gw, want_gw), relative_difference(gb, want_gb))
        loss_diff = abs(loss - want_loss) / abs(want_loss)
        ok = grad_diff <= 1e-4 and loss_diff <= 1e-5
        result["check"] = {"ok": ok, "grad_rel_diff": grad_diff, "loss_rel_diff": loss_diff}
        if setting:
            # Every setting against the first one of its schedule: the same program but for
            # the collectives' transport, so the same loss and gradients up to the order of
            # the reduction.
            base = first.setdefault(name, (loss, gw, gb))
            same = {"loss_abs_diff": abs(loss - base[0]),
                    "grads_max_abs_diff": float(max(np.max(np.abs(gw - base[1])),
                                                    np.max(np.abs(gb - base[2])))),
                    "against": settings[0]}
            same["ok"] = (same["loss_abs_diff"] <= 1e-6 * abs(base[0]) and
                          max(relative_difference(gw, base[1]),
                              relative_difference(gb, base[2])) <= 1e-6)
            # The setting must show in the program: MPI's all-reduce there, or not.
            crosses = ARGS.data > 1 and jax.process_count() > 1
            lowered = result["mpi_all_reduce_calls"] > 0
            same["lowering_ok"] = lowered == (setting == "mpi" and crosses)
            result["check"]["same_as_first_setting"] = same
            result["check"]["ok"] = ok and same["ok"] and same["lowering_ok"]
        result["step_seconds"] = []
        results[key] = result
    names = keys
    for name in names:
        for _ in range(ARGS.warmup):
            jax.block_until_ready(runs[name]())
    # The schedules take turns, a repeat each, so that a change of the shared machine's load
    # falls on all of them alike. CPU time (all threads of this process) tells computing
    # from waiting: a receiver that spins burns CPU time while it waits.
    cpu = dict.fromkeys(names, 0.0)
    for _ in range(ARGS.repeats):
        for name in names:
            start = time.process_time()
            results[name]["step_seconds"].append(time_steps(runs[name], ARGS.steps))
            cpu[name] += (time.process_time() - start) / ARGS.steps / ARGS.repeats
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mine = np.array([peak, rss_before, *(cpu[n] for n in names)], np.float64)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, mine.size)
    else:
        every = mine[None]
    peaks, befores = every[:, 0], every[:, 1]
    for i, name in enumerate(names):
        results[name]["cpu_seconds_per_step"] = [float(v) for v in every[:, 2 + i]]
    if jax.process_index() != 0:
        return 0
    for key, result in results.items():
        name = key.partition("@")[0]
        virtual = ARGS.virtual_stages if name.startswith("interleaved-1f1b") else 1
        result.update({
            "framework": "jax", "schedule": name, "virtual_stages": virtual,
            "processes": jax.process_count(), "devices_per_process": jax.local_device_count(),
            "jax": jax.__version__, "shape": shape.as_dict(),
            "memory": {"kind": "XLA memory_analysis temp bytes of one device's program; "
                               "peak RSS per process (getrusage ru_maxrss) of the processes "
                               "that ran all schedules of this launch",
                       "peak_rss_bytes": [int(v) for v in peaks],
                       "rss_before_compile_bytes": [int(v) for v in befores]},
        })
        check = result["check"]
        median = np.median(np.concatenate(result["step_seconds"]))
        print(f"jax {key} [{result['layout']}]: check {'PASS' if check['ok'] else 'FAIL'} "
              f"(grads {check['grad_rel_diff']:.1e}, loss {check['loss_rel_diff']:.1e}), "
              f"median step {median * 1e3:.2f} ms, temp {result['temp_bytes']} B", flush=True)
    Path(ARGS.out).write_text(json.dumps({"results": list(results.values())}, indent=1))
    return 0 if all(r["check"]["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
