"""Pipeline-parallel (GPipe) training of a small MLP, with ``psend``/``precv`` between stages.

It uses ``jax_cpu_mpi.psend``/``precv``: ``jax.lax.psend``/``precv`` are deprecated since JAX
0.12 and will be removed; ours keep the program working, on CPU and on GPU alike.

One process with 4 virtual CPU devices (the file sets the device count itself)::

    python -m jax_cpu_mpi.examples.pipeline

The same file on 4 MPI ranks of 1 device, or 2 ranks of 2 devices::

    mpirun -n 4 python -m jax_cpu_mpi.examples.pipeline
    mpirun -n 2 python -m jax_cpu_mpi.examples.pipeline

``--check`` trains the same model on one device without pipelining and compares the loss
curves and the final parameters (exit code 1 when they disagree).

The model: ``P`` stages, stage ``s`` computes ``h -> tanh(h @ w[s] + b[s])`` on ``width``
features; the parameters of all stages are stacked on a leading axis, sharded over the mesh
axis ``'stage'`` (one stage per device). The data: a fixed random "teacher" network of the same
shape labels Gaussian inputs; everything comes from ``--seed`` with NumPy, so every process
builds the same arrays.

The GPipe schedule, with ``M`` microbatches and ``T = M + P - 1`` ticks per pass::

    forward,  tick t:  stage s runs microbatch t - s          (0 <= t - s < M)
                       and psends its output to stage s + 1
    backward, tick u:  stage s runs microbatch M-1-u+(P-1-s)  (reverse order)
                       with jax.vjp and psends the input cotangent to stage s - 1

Every stage computes on every tick (SPMD); ticks outside a stage's range compute on zeros or
stale values and are masked out of the gradients.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

#: Environment variables by which mpirun/srun tell a process its rank and the job size.
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line of the example."""
    p = argparse.ArgumentParser(
        prog="python -m jax_cpu_mpi.examples.pipeline",
        description="GPipe training of an MLP with psend/precv on CPU devices (and MPI ranks).",
    )
    p.add_argument("--stages", type=int, default=4, help="pipeline stages = devices (4)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step (8)")
    p.add_argument("--steps", type=int, default=100, help="SGD steps (100)")
    p.add_argument("--width", type=int, default=128, help="features of every layer (128)")
    p.add_argument("--batch", type=int, default=1024, help="samples per step (1024)")
    p.add_argument("--lr", type=float, default=2.0,
                   help="SGD learning rate (2.0; the loss is a mean over features)")
    p.add_argument("--seed", type=int, default=0, help="seed of data and parameters (0)")
    p.add_argument("--check", action="store_true",
                   help="compare with single-device training without pipelining")
    args = p.parse_args(argv)
    if args.stages < 1 or args.microbatches < 1 or args.steps < 1 or args.width < 1:
        p.error("--stages, --microbatches, --steps and --width must be >= 1")
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

AXIS = "stage"


class Params(NamedTuple):
    """The parameters of every stage, stacked on a leading stage axis."""

    w: jax.Array | np.ndarray  # [stages, width, width]
    b: jax.Array | np.ndarray  # [stages, width]


def stage_forward(w: jax.Array, b: jax.Array, h: jax.Array) -> jax.Array:
    """One pipeline stage: a dense layer and tanh."""
    return jnp.tanh(h @ w + b)


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
    """Deterministic data (a random teacher network labels Gaussian inputs) and a student."""
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


def make_pipeline_step(
    mesh: jax.sharding.Mesh, microbatches: int, lr: float
) -> Callable[[Params, jax.Array, jax.Array], tuple[Params, jax.Array]]:
    """A jitted SGD step ``(params, x, y) -> (new_params, loss)`` pipelined over ``mesh``.

    ``params`` are sharded ``P('stage')``; ``x``, ``y`` replicated. ``loss`` has one entry
    per stage: the step's loss (before the update) on stage 0, zero elsewhere; the last stage
    computes it and sends it to the first.
    """
    stages, M = mesh.shape[AXIS], microbatches
    ticks = M + stages - 1
    downstream = [(s, s + 1) for s in range(stages - 1)]  # activations: s -> s + 1
    upstream = [(s + 1, s) for s in range(stages - 1)]  # cotangents: s + 1 -> s
    to_first = [(stages - 1, 0)]  # the loss: last -> first

    def shift(x: jax.Array, perm: list[tuple[int, int]]) -> jax.Array:
        """psend ``x`` along ``perm`` and precv it; stages that are no destination get 0.

        Messages from one device to another are matched in the order their ops run, and XLA
        orders side-effecting ops by data dependencies only (XLA CPU drops an
        ``optimization_barrier`` over arrays before scheduling). So one scan tick sends at
        most once from a device to another, the ticks of a scan run one after the other, and
        the backward scan reads the results of the forward scan, so it cannot start before
        it ends.
        """
        if not perm:
            return jnp.zeros_like(x)
        token = jax_cpu_mpi.psend(x, AXIS, perm)
        y = jax_cpu_mpi.precv(token, jax.ShapeDtypeStruct(x.shape, x.dtype), AXIS, perm)
        return jax.lax.pcast(y, AXIS, to="varying")  # precv's result is typed as unvarying

    def per_stage(w, b, x, y):
        w, b = w[0], b[0]  # this stage's block of the stacked parameters
        s = jax.lax.axis_index(AXIS)
        is_first, is_last = s == 0, s == stages - 1
        xs = x.reshape(M, -1, x.shape[-1])  # [M, microbatch, width]
        ys = y.reshape(M, -1, y.shape[-1])
        zeros = jax.lax.pcast(jnp.zeros_like(xs[0]), AXIS, to="varying")

        def forward_tick(received, t):
            h_in = jnp.where(is_first, xs[jnp.minimum(t, M - 1)], received)
            h_out = stage_forward(w, b, h_in)
            # The last stage finishes microbatch t - (P - 1): its loss and output cotangent.
            m = t - (stages - 1)
            loss, cotangent = jax.value_and_grad(mse)(h_out, ys[jnp.maximum(m, 0)])
            loss = jnp.where(is_last & (m >= 0), loss / M, 0.0)
            # The loss goes to stage 0 for printing, inside the tick: see `shift`.
            report = loss if stages == 1 else shift(loss, to_first)
            return shift(h_out, downstream), (h_in, cotangent / M, report)

        _, (h_ins, cotangents, reports) = jax.lax.scan(forward_tick, zeros, jnp.arange(ticks))
        inputs = jax.lax.dynamic_slice_in_dim(h_ins, s, M)  # microbatch m ran at tick m + s
        out_cotangents = cotangents[stages - 1:]  # last stage: microbatch m at tick m + P - 1
        loss = jnp.sum(reports)  # the step's loss on stage 0, zero elsewhere

        def backward_tick(carry, u):
            received, (gw, gb) = carry
            m = M - 1 - u + (stages - 1 - s)
            active = (m >= 0) & (m < M)
            m = jnp.clip(m, 0, M - 1)
            cotangent = jnp.where(is_last, out_cotangents[m], received)
            _, vjp = jax.vjp(stage_forward, w, b, inputs[m])
            dw, db, dh = vjp(cotangent)
            grads = (gw + jnp.where(active, dw, 0.0), gb + jnp.where(active, db, 0.0))
            return (shift(dh, upstream), grads), None

        init = (zeros, (jnp.zeros_like(w), jnp.zeros_like(b)))
        (_, (gw, gb)), _ = jax.lax.scan(backward_tick, init, jnp.arange(ticks))
        return (w - lr * gw)[None], (b - lr * gb)[None], loss[None]

    sharded = jax.shard_map(per_stage, mesh=mesh, in_specs=(P(AXIS), P(AXIS), P(), P()),
                            out_specs=(P(AXIS), P(AXIS), P(AXIS)))

    @jax.jit
    def step(params: Params, x: jax.Array, y: jax.Array) -> tuple[Params, jax.Array]:
        w, b, loss = sharded(params.w, params.b, x, y)
        return Params(w, b), loss

    return step


# ----------------------------------------------------------------------------- reference


def make_reference_step(
    microbatches: int, lr: float
) -> Callable[[Params, jax.Array, jax.Array], tuple[Params, jax.Array]]:
    """The same SGD step on one device: ``jax.grad`` of the composed stages, no pipeline."""

    def loss_fn(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
        h = x.reshape(microbatches, -1, x.shape[-1])
        for s in range(params.w.shape[0]):
            h = stage_forward(params.w[s], params.b[s], h)
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


def first_stage_value(loss: jax.Array) -> float | None:
    """The loss held by stage 0, or ``None`` where this process does not hold stage 0."""
    for shard in loss.addressable_shards:
        if (shard.index[0].start or 0) == 0:
            return float(np.asarray(shard.data)[0])
    return None


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
    parameters stage by stage (:func:`relative_difference`); all must be ``<= rtol``.
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
    say(f"  {'stage':>5}  {'w rel diff':>16}  {'b rel diff':>16}")
    param_diffs = []
    for s in range(args.stages):
        dw = relative_difference(np.asarray(final.w[s]), np.asarray(params.w[s]))
        db = relative_difference(np.asarray(final.b[s]), np.asarray(params.b[s]))
        param_diffs += [dw, db]
        say(f"  {s:>5}  {dw:>16.2e}  {db:>16.2e}")
    worst = max(loss_diffs + param_diffs)
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
    problem = make_problem(args.seed, args.stages, args.width, args.batch)
    stacked = NamedSharding(mesh, P(AXIS))
    replicated = NamedSharding(mesh, P())

    def to_mesh(a: np.ndarray, sharding: NamedSharding) -> jax.Array:
        return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

    params = Params(to_mesh(problem.init.w, stacked), to_mesh(problem.init.b, stacked))
    x, y = to_mesh(problem.x, replicated), to_mesh(problem.y, replicated)
    step = make_pipeline_step(mesh, args.microbatches, args.lr)

    say(f"pipeline: {args.stages} stages on {jax.process_count()} process(es) x "
        f"{jax.local_device_count()} CPU device(s), {args.microbatches} microbatches of "
        f"{args.batch // args.microbatches}, width {args.width}, {args.steps} steps, "
        f"lr {args.lr:g}, seed {args.seed}")
    ours = {f["feature"]: f["state"] for f in jax_cpu_mpi.features()}["own_primitives"]
    say(f"psend/precv: {'jax_cpu_mpi' if ours == 'active' else 'JAX'}'s primitives")
    losses: list[float] = []
    timed = 0.0
    for i in range(args.steps):
        start = time.perf_counter()
        params, loss = step(params, x, y)
        jax.block_until_ready((params, loss))
        seconds = time.perf_counter() - start
        value = first_stage_value(loss)
        losses.append(value if value is not None else float("nan"))
        note = " (includes compilation)" if i == 0 else ""
        timed += seconds if i else 0.0
        say(f"step {i + 1:>4}/{args.steps} {progress_bar(i + 1, args.steps)} "
            f"loss {losses[-1]:.9e}  {args.batch / seconds:>9.1f} samples/s{note}")
    if args.steps > 1:
        say(f"throughput: {args.batch * (args.steps - 1) / timed:.1f} samples/s "
            f"(steps 2..{args.steps})")

    if not args.check:
        return 0
    from jax.experimental import multihost_utils

    final = Params(*(multihost_utils.process_allgather(p, tiled=True) for p in params))
    ok = run_check(args, problem, losses, final, say) if is_main else True
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
