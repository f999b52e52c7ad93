"""Pipeline-parallel training of a small MLP with :mod:`jax_cpu_mpi.pipeline`.

The library runs a schedule (GPipe, 1F1B, interleaved 1F1B or zero-bubble ZB-H1) over
``jax_cpu_mpi.psend``/``precv`` between stages: the same program on CPU (in-process and MPI)
and on GPU (NCCL).

One process with 4 virtual CPU devices (the file sets the device count itself)::

    python -m jax_cpu_mpi.examples.pipeline --schedule 1f1b

The same file on 4 MPI ranks of 1 device, or 2 ranks of 2 devices::

    mpirun -n 4 python -m jax_cpu_mpi.examples.pipeline
    mpirun -n 2 python -m jax_cpu_mpi.examples.pipeline --schedule interleaved-1f1b

``--check`` trains the same model on one device without pipelining and compares the loss
curves and the final parameters (exit code 1 when they disagree). ``--trace DIR`` records the
psend/precv timeline of the steps after the first (compilation) step into ``DIR`` (one file
per process, see :func:`jax_cpu_mpi.trace`); ``python -m jax_cpu_mpi trace DIR`` merges
and draws it.

The model: ``L = P * V`` layers ``h -> tanh(h @ w[l] + b[l])`` on ``width`` features
(``V = --virtual-stages``, 1 except for the interleaved schedule). Layer ``l`` is chunk
``l`` of the pipeline: on stage ``l % P`` as its virtual stage ``l // P``. The data: a fixed
random "teacher" network of the same shape labels Gaussian inputs; everything comes from
``--seed`` with NumPy, so every process builds the same arrays.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

#: The schedules of --schedule (jax_cpu_mpi.pipeline.schedule_by_name).
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
#: Environment variables by which mpirun/srun tell a process its rank and the job size.
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS")


def resolve_virtual_stages(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--virtual-stages``: 2 by default for interleaved 1F1B, 1 otherwise; other values
    only with interleaved 1F1B (the other schedules run one chunk per stage)."""
    if args.virtual_stages is None:
        args.virtual_stages = 2 if args.schedule == "interleaved-1f1b" else 1
    if args.virtual_stages != 1 and args.schedule != "interleaved-1f1b":
        parser.error(f"--virtual-stages {args.virtual_stages} needs --schedule interleaved-1f1b")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line of the example."""
    p = argparse.ArgumentParser(
        prog="python -m jax_cpu_mpi.examples.pipeline",
        description="Pipeline-parallel training of an MLP with jax_cpu_mpi.pipeline on CPU "
                    "devices (and MPI ranks).",
    )
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULES,
                   help="pipeline schedule (1f1b)")
    p.add_argument("--virtual-stages", type=int, default=None,
                   help="layers per stage for interleaved-1f1b (2; 1 for the others)")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages = devices (4)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step (8)")
    p.add_argument("--steps", type=int, default=100, help="SGD steps (100)")
    p.add_argument("--width", type=int, default=128, help="features of every layer (128)")
    p.add_argument("--batch", type=int, default=1024, help="samples per step (1024)")
    p.add_argument("--lr", type=float, default=2.0,
                   help="SGD learning rate (2.0; the loss is a mean over features)")
    p.add_argument("--seed", type=int, default=0, help="seed of data and parameters (0)")
    p.add_argument("--no-remat", dest="remat", action="store_false",
                   help="keep each forward's residuals for its backward instead of "
                        "recomputing the forward (faster, more memory)")
    p.add_argument("--check", action="store_true",
                   help="compare with single-device training without pipelining")
    p.add_argument("--trace", metavar="DIR", default=None,
                   help="record the psend/precv timeline of steps 2.. (after compilation) "
                        "into DIR, one file per process; then run "
                        "'python -m jax_cpu_mpi trace DIR' for timeline.json/.png and a "
                        "per-device summary")
    args = p.parse_args(argv)
    resolve_virtual_stages(p, args)
    if min(args.stages, args.microbatches, args.steps, args.width, args.virtual_stages) < 1:
        p.error("--stages, --microbatches, --steps, --width and --virtual-stages must be >= 1")
    if args.batch % args.microbatches:
        p.error(f"--batch {args.batch} is not a multiple of --microbatches {args.microbatches}")
    return args


def mpi_world_size() -> int | None:
    """The number of ranks when mpirun/srun started this process, else ``None``."""
    if not any(var in os.environ for var in _MPI_RANK_VARS):
        return None
    for var in _MPI_SIZE_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    from mpi4py import MPI  # launched by MPI, but by a launcher we do not know

    return MPI.COMM_WORLD.Get_size()


def devices_per_process(stages: int, processes: int) -> int:
    """CPU devices each process needs so that the job has one device per stage."""
    if stages % processes:
        raise SystemExit(
            f"pipeline: --stages {stages} cannot be split over {processes} MPI processes; "
            f"use a number of stages that is a multiple of the number of ranks "
            f"(e.g. --stages {processes * max(1, stages // processes)})."
        )
    return stages // processes


def _set_device_count_before_jax(argv: Sequence[str]) -> None:
    """Give this process ``stages / processes`` CPU devices (XLA reads this at JAX import)."""
    stages = parse_args(argv).stages
    count = devices_per_process(stages, mpi_world_size() or 1)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "",
                   os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


if __name__ == "__main__":  # before JAX creates its CPU backend, which reads XLA_FLAGS
    _set_device_count_before_jax(sys.argv[1:])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

# jax_cpu_mpi.psend/precv: jax.lax.psend/precv (deprecated in JAX 0.12, to be removed) kept
# alive, the same program on CPU (this package's transport) and GPU (NCCL). The import also
# registers the CPU lowerings.
import jax_cpu_mpi  # noqa: E402
from jax_cpu_mpi import pipeline  # noqa: E402

AXIS = "stage"


class Params(NamedTuple):
    """The parameters of every layer, stacked on a leading axis (model order in
    :class:`Problem`, the pipeline's ``[stages, virtual stages, ...]`` layout in training)."""

    w: jax.Array | np.ndarray  # [layers, width, width]
    b: jax.Array | np.ndarray  # [layers, width]


def stage_forward(p: Params, h: jax.Array) -> jax.Array:
    """One layer (a pipeline chunk): a dense layer and tanh."""
    return jnp.tanh(h @ p.w + p.b)


def mse(pred: jax.Array, target: jax.Array) -> jax.Array:
    """The loss of one microbatch: mean squared error. A step's loss: its microbatches' mean."""
    return jnp.mean((pred - target) ** 2)


@dataclass(frozen=True)
class Problem:
    """Training data and initial parameters, as NumPy float32 arrays."""

    x: np.ndarray  # [batch, width]
    y: np.ndarray  # [batch, width]
    init: Params


def make_problem(seed: int, stages: int, width: int, batch: int) -> Problem:
    """Deterministic data (a random teacher network of ``stages`` layers labels Gaussian
    inputs) and a student of as many layers (``stages`` = P x V)."""
    rng = np.random.default_rng(seed)
    scale = 1.0 / np.sqrt(width)
    teacher_w = rng.normal(0.0, 2.0 * scale, (stages, width, width))
    teacher_b = rng.normal(0.0, 0.5, (stages, width))
    x = rng.normal(0.0, 1.0, (batch, width))
    y = x
    for s in range(stages):
        y = np.tanh(y @ teacher_w[s] + teacher_b[s])
    init = Params(w=rng.normal(0.0, scale, (stages, width, width)).astype(np.float32),
                  b=np.zeros((stages, width), np.float32))
    return Problem(x.astype(np.float32), y.astype(np.float32), init)


# ----------------------------------------------------------------------------- pipeline


def to_pipeline_layout(params: Params, stages: int, virtual_stages: int) -> Params:
    """Model order ``[L, ...]`` to the pipeline's ``[P, ...]`` / ``[P, V, ...]`` (layer
    ``v * P + s`` at ``[s, v]``)."""
    if virtual_stages == 1:
        return params
    return Params(*(np.swapaxes(a.reshape(virtual_stages, stages, *a.shape[1:]), 0, 1)
                    for a in params))


def to_model_order(params: Params, virtual_stages: int) -> Params:
    """The inverse of :func:`to_pipeline_layout`."""
    if virtual_stages == 1:
        return params
    return Params(*(np.swapaxes(np.asarray(a), 0, 1).reshape(-1, *a.shape[2:])
                    for a in params))


def make_pipeline_step(
    mesh: jax.sharding.Mesh, schedule: pipeline.Schedule, lr: float, remat: bool = True
) -> Callable[[Params, jax.Array, jax.Array], tuple[Params, jax.Array]]:
    """A jitted SGD step ``(params, xs, ys) -> (new_params, loss)`` pipelined over ``mesh``.

    ``params`` in the pipeline layout, sharded ``P('stage')``; ``xs``, ``ys``: the
    microbatches ``[M, batch / M, width]``, replicated. ``loss`` (the step's, before the
    update) is replicated. ``remat``: as for :func:`jax_cpu_mpi.pipeline.value_and_grad`.
    """
    value_and_grad = pipeline.shard_value_and_grad(stage_forward, mse, mesh, schedule,
                                                   axis_name=AXIS, remat=remat)

    @jax.jit
    def step(params: Params, xs: jax.Array, ys: jax.Array) -> tuple[Params, jax.Array]:
        loss, grads = value_and_grad(params, xs, ys)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss

    return step


# ----------------------------------------------------------------------------- reference


def make_reference_step(
    microbatches: int, lr: float
) -> Callable[[Params, jax.Array, jax.Array], tuple[Params, jax.Array]]:
    """The same SGD step on one device: ``jax.grad`` of the composed layers, no pipeline."""

    def loss_fn(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
        h = x.reshape(microbatches, -1, x.shape[-1])
        for layer in range(params.w.shape[0]):
            h = stage_forward(Params(params.w[layer], params.b[layer]), h)
        return jnp.mean(jax.vmap(mse)(h, y.reshape(microbatches, -1, y.shape[-1])))

    @jax.jit
    def step(params: Params, x: jax.Array, y: jax.Array) -> tuple[Params, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss

    return step


# ----------------------------------------------------------------------------- driver


def stage_mesh(stages: int) -> jax.sharding.Mesh:
    """A 1-D mesh ``'stage'`` over all devices of the job, process by process."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if len(devices) != stages:
        raise SystemExit(f"pipeline: --stages {stages} needs {stages} devices, the job has "
                         f"{len(devices)}; set XLA_FLAGS=--xla_force_host_platform_device_count")
    return jax.make_mesh((stages,), (AXIS,), devices=devices)


def loss_value(loss: jax.Array) -> float:
    """The step's loss (replicated: every process holds it)."""
    return float(np.asarray(loss.addressable_data(0)))


def progress_bar(done: int, total: int, width: int = 20) -> str:
    filled = round(width * done / total)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def relative_difference(got: np.ndarray, want: np.ndarray) -> float:
    """``max|got - want| / max|want|``: the error relative to the array's scale."""
    scale = float(np.max(np.abs(want)))
    diff = float(np.max(np.abs(got - want)))
    return diff / scale if scale else diff


def run_check(args: argparse.Namespace, problem: Problem, losses: list[float],
              final: Params, say: Callable[[str], None], rtol: float = 1e-5) -> bool:
    """Train on one device without pipelining; print and return the agreement.

    Losses are compared step by step (``|pipeline - reference| / |reference|``), final
    parameters layer by layer (:func:`relative_difference`); all must be ``<= rtol``.
    """
    device = jax.local_devices()[0]
    put = lambda a: jax.device_put(a, device)  # noqa: E731
    step = make_reference_step(args.microbatches, args.lr)
    params, x, y = jax.tree.map(put, problem.init), put(problem.x), put(problem.y)
    ref_losses = []
    for _ in range(args.steps):
        params, loss = step(params, x, y)
        ref_losses.append(float(loss))

    say(f"check: pipeline vs one device without pipelining (float32, rtol {rtol:g})")
    say(f"  {'step':>5}  {'pipeline loss':>16}  {'reference loss':>16}  {'rel diff':>9}")
    loss_diffs = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)]
    shown = sorted({0, 1, 2, args.steps // 2, args.steps - 2, args.steps - 1} &
                   set(range(args.steps)))
    for i in shown:
        say(f"  {i + 1:>5}  {losses[i]:>16.9e}  {ref_losses[i]:>16.9e}  {loss_diffs[i]:>9.2e}")
    say(f"  {'layer':>5}  {'w rel diff':>16}  {'b rel diff':>16}")
    param_diffs = []
    for s in range(args.stages * args.virtual_stages):
        dw = relative_difference(np.asarray(final.w[s]), np.asarray(params.w[s]))
        db = relative_difference(np.asarray(final.b[s]), np.asarray(params.b[s]))
        param_diffs += [dw, db]
        say(f"  {s:>5}  {dw:>16.2e}  {db:>16.2e}")
    worst = float(np.max(loss_diffs + param_diffs))  # NaN if any is (max keeps its first)
    ok = all(d <= rtol for d in loss_diffs + param_diffs)  # False for NaN too
    say(f"check: {'PASS' if ok else 'FAIL'} (largest relative difference {worst:.2e})")
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    """Train, print loss and samples/s per step (process 0), optionally check; exit code."""
    args = parse_args(argv)
    processes = mpi_world_size()
    if processes is not None and processes > 1:
        # No arguments: srun and Open MPI 4 by JAX's detection, MPICH's and Open MPI 5's
        # mpirun by jax_cpu_mpi's (imported above, before this call).
        jax.distributed.initialize()
    is_main = jax.process_index() == 0

    def say(line: str) -> None:
        if is_main:
            print(line, flush=True)

    mesh = stage_mesh(args.stages)
    V, M = args.virtual_stages, args.microbatches
    problem = make_problem(args.seed, args.stages * V, args.width, args.batch)
    stacked = NamedSharding(mesh, P(AXIS))
    replicated = NamedSharding(mesh, P())

    def to_mesh(a: np.ndarray, sharding: NamedSharding) -> jax.Array:
        return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

    params = Params(*(to_mesh(a, stacked)
                      for a in to_pipeline_layout(problem.init, args.stages, V)))
    xs = to_mesh(problem.x.reshape(M, -1, args.width), replicated)  # [M, batch / M, width]
    ys = to_mesh(problem.y.reshape(M, -1, args.width), replicated)
    schedule = pipeline.schedule_by_name(args.schedule, V).bind(args.stages, M)
    try:
        schedule.validate()
    except pipeline.ScheduleError as e:
        raise SystemExit(f"pipeline: {e}") from None
    step = make_pipeline_step(mesh, schedule, args.lr, args.remat)

    say(f"pipeline: {args.stages} stages on {jax.process_count()} process(es) x "
        f"{jax.local_device_count()} CPU device(s), {args.microbatches} microbatches of "
        f"{args.batch // args.microbatches}, width {args.width}, {args.steps} steps, "
        f"lr {args.lr:g}, seed {args.seed}"
        + ("" if args.remat else ", residuals kept (remat=False)"))
    say(f"schedule: {schedule.describe()}")
    ours = {f["feature"]: f["state"] for f in jax_cpu_mpi.features()}["own_primitives"]
    say(f"psend/precv: {'jax_cpu_mpi' if ours == 'active' else 'JAX'}'s primitives")
    losses: list[float] = []
    timed = 0.0
    # Recording starts after the compilation step: the timeline holds steady steps only.
    with contextlib.ExitStack() as recording:
        for i in range(args.steps):
            if i == 1 and args.trace:
                recording.enter_context(jax_cpu_mpi.trace(args.trace))
            start = time.perf_counter()
            params, loss = step(params, xs, ys)
            jax.block_until_ready((params, loss))
            seconds = time.perf_counter() - start
            losses.append(loss_value(loss))
            note = " (includes compilation)" if i == 0 else ""
            timed += seconds if i else 0.0
            say(f"step {i + 1:>4}/{args.steps} {progress_bar(i + 1, args.steps)} "
                f"loss {losses[-1]:.9e}  {args.batch / seconds:>9.1f} samples/s{note}")
    if args.trace:
        say(f"trace: steps 2..{args.steps} recorded into {args.trace}" if args.steps > 1 else
            "trace: nothing recorded (--steps 1: the only step is the compilation step)")
    if args.steps > 1:
        say(f"throughput: {args.batch * (args.steps - 1) / timed:.1f} samples/s "
            f"(steps 2..{args.steps})")

    if not args.check:
        return 0
    from jax.experimental import multihost_utils

    final = to_model_order(
        Params(*(multihost_utils.process_allgather(p, tiled=True) for p in params)), V)
    ok = run_check(args, problem, losses, final, say) if is_main else True
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
