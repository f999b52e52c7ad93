"""The JAX side of the pipeline benchmark: one configuration per process (or mpirun job).

Launched by ``run.py``::

    python benchmarks/pipeline/jax_bench.py --schedule baseline --out r.json     # 1 device
    python benchmarks/pipeline/jax_bench.py --schedule 1f1b --devices 4 --out r.json
    mpirun -n 2 python benchmarks/pipeline/jax_bench.py --schedule 1f1b --devices 2 --out r.json

``baseline``: ``jax.jit(jax.value_and_grad(loss))`` of the whole model on the full batch, one
device. Otherwise the schedule (``gpipe``, ``1f1b``, ``interleaved-1f1b``, ``zero-bubble``)
of ``jax_cpu_mpi.pipeline`` over a 1-D ``'stage'`` mesh of every device of the job (stage
``s`` on the job's ``s``-th device, process by process). Both compute the loss and the
gradients only (no optimizer update), as the torch side does. Before timing, the loss and
the gradients are compared with a float64 NumPy reference (exit 1 beyond float32
tolerance). Process 0 writes the JSON: per-step seconds of every repeat (process 0's wall
clock until its outputs are ready), XLA's compiled memory analysis (temp bytes of one
device's program) and the peak RSS of every process.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import sys
import time
from pathlib import Path

SCHEDULES = ("baseline", "gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--schedule", choices=SCHEDULES, required=True)
    p.add_argument("--devices", type=int, default=1, help="CPU devices per process")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--virtual-stages", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
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

import jax_cpu_mpi  # noqa: E402, F401  (registers the CPU lowerings of psend/precv)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import (  # noqa: E402
    Shape,
    make_problem,
    reference_loss_and_grads,
    relative_difference,
)

_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


def chunk_fn(params: dict[str, jax.Array], h: jax.Array) -> jax.Array:
    """One pipeline chunk: its layers ``h -> tanh(h @ w + b)`` in order."""
    for i in range(params["w"].shape[0]):
        h = jnp.tanh(h @ params["w"][i] + params["b"][i])
    return h


def mse(out: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.mean((out - target) ** 2)


def time_steps(run, steps: int, warmup: int, repeats: int) -> list[list[float]]:
    for _ in range(warmup):
        jax.block_until_ready(run())
    out = []
    for _ in range(repeats):
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            jax.block_until_ready(run())
            times.append(time.perf_counter() - start)
        out.append(times)
    return out


def temp_bytes(compiled) -> int | None:
    analysis = compiled.memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def baseline(shape: Shape, problem) -> dict:
    def loss(params, x, y):
        return mse(chunk_fn(params, x), y)

    device = jax.local_devices()[0]
    params = jax.device_put({"w": problem.w, "b": problem.b}, device)
    x, y = jax.device_put(problem.x, device), jax.device_put(problem.y, device)
    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, x, y).compile()
    value, grads = compiled(params, x, y)
    steps = time_steps(lambda: compiled(params, x, y), ARGS.steps, ARGS.warmup, ARGS.repeats)
    return {"layout": "1 process x 1 device (no pipeline, full batch)",
            "loss": float(value), "grads_w": np.asarray(grads["w"]),
            "grads_b": np.asarray(grads["b"]), "step_seconds": steps,
            "temp_bytes": temp_bytes(compiled)}


def pipelined(shape: Shape, problem) -> dict:
    from jax.experimental import multihost_utils

    from jax_cpu_mpi import pipeline as pl

    virtual = ARGS.virtual_stages if ARGS.schedule == "interleaved-1f1b" else 1
    shape.check(virtual)
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if len(devices) != shape.stages:
        raise SystemExit(f"jax_bench: {shape.stages} stages need {shape.stages} devices, "
                         f"the job has {len(devices)}")
    mesh = jax.make_mesh((shape.stages,), ("stage",), devices=devices)
    schedule = pl.schedule_by_name(ARGS.schedule, virtual_stages=virtual)
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
    x, y = to_mesh(host_x, P()), to_mesh(host_y, P())
    f = pl.shard_value_and_grad(chunk_fn, mse, mesh, schedule, axis_name="stage")
    compiled = jax.jit(f).lower(params, x, y).compile()
    value, grads = compiled(params, x, y)
    grads = jax.tree.map(lambda g: np.asarray(multihost_utils.process_allgather(g, tiled=True)),
                         grads)

    def unstacked(g: np.ndarray) -> np.ndarray:  # back to model order [L, ...]
        g = g[:, None] if V == 1 else g
        return g.swapaxes(0, 1).reshape(shape.layers, *g.shape[3:])

    # The mean loss is the same on every stage: any local shard holds it.
    loss_value = float(np.asarray(value.addressable_data(0)).ravel()[0])
    steps = time_steps(lambda: compiled(params, x, y), ARGS.steps, ARGS.warmup, ARGS.repeats)
    bound = schedule.bind(S, M) if hasattr(schedule, "bind") else schedule
    return {"layout": (f"{jax.process_count()} process(es) x {jax.local_device_count()} "
                       f"device(s)" + (" (mpirun)" if jax.process_count() > 1 else "")),
            "loss": loss_value, "grads_w": unstacked(grads["w"]),
            "grads_b": unstacked(grads["b"]), "step_seconds": steps,
            "temp_bytes": temp_bytes(compiled),
            "bubble_fraction_theory": float(getattr(bound, "bubble_fraction", float("nan"))),
            "peak_stash_theory": list(getattr(bound, "peak_stash", ()))}


def main() -> int:
    if any(v in os.environ for v in _MPI_RANK_VARS):
        jax.distributed.initialize()
    shape = Shape(ARGS.layers, ARGS.width, ARGS.batch, ARGS.stages, ARGS.microbatches,
                  ARGS.seed)
    shape.check(1)
    problem = make_problem(shape)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = baseline(shape, problem) if ARGS.schedule == "baseline" else pipelined(shape,
                                                                                     problem)
    want_loss, want_gw, want_gb = reference_loss_and_grads(problem)
    grad_diff = max(relative_difference(result.pop("grads_w"), want_gw),
                    relative_difference(result.pop("grads_b"), want_gb))
    loss_diff = abs(result.pop("loss") - want_loss) / abs(want_loss)
    ok = grad_diff <= 1e-4 and loss_diff <= 1e-5
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        mem = np.asarray(multihost_utils.process_allgather(np.array([peak, rss_before])))
        peaks, befores = mem.reshape(-1, 2)[:, 0], mem.reshape(-1, 2)[:, 1]
    else:
        peaks, befores = [peak], [rss_before]
    if jax.process_index() == 0:
        virtual = ARGS.virtual_stages if ARGS.schedule == "interleaved-1f1b" else 1
        result.update({
            "framework": "jax", "schedule": ARGS.schedule, "virtual_stages": virtual,
            "processes": jax.process_count(), "devices_per_process": jax.local_device_count(),
            "jax": jax.__version__, "shape": shape.as_dict(),
            "check": {"ok": ok, "grad_rel_diff": grad_diff, "loss_rel_diff": loss_diff},
            "memory": {"kind": "XLA memory_analysis temp bytes of one device's program; "
                               "peak RSS per process (getrusage ru_maxrss)",
                       "peak_rss_bytes": [int(v) for v in peaks],
                       "rss_before_compile_bytes": [int(v) for v in befores]},
        })
        Path(ARGS.out).write_text(json.dumps(result, indent=1))
        median = np.median(np.concatenate(result["step_seconds"]))
        print(f"jax {ARGS.schedule} [{result['layout']}]: check {'PASS' if ok else 'FAIL'} "
              f"(grads {grad_diff:.1e}, loss {loss_diff:.1e}), median step "
              f"{median * 1e3:.2f} ms, temp {result['temp_bytes']} B", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
