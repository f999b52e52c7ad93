"""Pipeline cases shared by the single-process tests and the mpirun program.

A small residual MLP whose activations are a pytree (``{"h": ..., "skip": ...}``) runs
through :func:`jax_cpu_mpi.pipeline.shard_value_and_grad`; the reference is
``jax.value_and_grad`` of the same chunks composed on one device, without a pipeline and
without psend/precv (:func:`reference`, written here, not the library's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_cpu_mpi import pipeline as pl
from jax_cpu_mpi._src.ffi import custom_calls

WIDTH, MICROBATCH = 8, 4


def stage(params, x):
    """One chunk: a dense layer with tanh on ``h``, ``skip`` carried and mixed in."""
    h = jnp.tanh(x["h"] @ params["w"] + params["b"]) + 0.5 * x["skip"]
    return {"h": h, "skip": x["skip"] * params["gate"]}


def loss(y, target):
    return jnp.mean((y["h"] - target) ** 2) + 0.1 * jnp.mean(y["skip"] ** 2)


@dataclass(frozen=True)
class Case:
    name: str
    stages: int
    microbatches: int
    data: int = 1
    dtype: str = "float32"
    samples: int = MICROBATCH  # per microbatch and data shard
    input_grads: bool = False  # also the gradient with respect to the microbatches
    remat: bool = True  # False: the forwards keep their residuals for the backward

    def schedule(self) -> pl.Schedule:
        kind, _, v = self.name.partition(":")
        return pl.schedule_by_name(kind, int(v or 1))


def make_params(P: int, V: int, dtype, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    lead = (P, V) if V > 1 else (P,)
    return {"w": rng.normal(0, 0.6, (*lead, WIDTH, WIDTH)).astype(dtype),
            "b": rng.normal(0, 0.2, (*lead, WIDTH)).astype(dtype),
            "gate": rng.uniform(0.5, 1.0, (*lead, WIDTH)).astype(dtype)}


def make_data(M: int, batch: int, dtype, seed: int = 1):
    rng = np.random.default_rng(seed)
    xs = {"h": rng.normal(size=(M, batch, WIDTH)).astype(dtype),
          "skip": rng.normal(size=(M, batch, WIDTH)).astype(dtype)}
    ys = rng.normal(size=(M, batch, WIDTH)).astype(dtype)
    return xs, ys


def chunks(params, P: int, V: int):
    """Model order: chunk c = v * P + s sits at [s, v]."""
    if V == 1:
        return [jax.tree.map(lambda a, s=s: a[s], params) for s in range(P)]
    return [jax.tree.map(lambda a, c=c: a[c % P, c // P], params) for c in range(P * V)]


@cache
def _reference_fn(P: int, V: int):
    def total(params, xs, ys):
        def one(x, y):
            for chunk in chunks(params, P, V):
                x = stage(chunk, x)
            return loss(x, y).astype(jnp.float32), x

        losses, outs = jax.vmap(one)(xs, ys)
        return jnp.mean(losses), outs

    return jax.jit(jax.value_and_grad(total, argnums=(0, 1), has_aux=True))


def reference(params, xs, ys, P: int, V: int):
    """(loss, grads, outputs, input grads) on one device, in float32."""
    up = lambda t: jax.tree.map(lambda a: np.asarray(a, np.float32), t)  # noqa: E731
    device = jax.local_devices()[0]
    args = jax.device_put((up(params), up(xs), up(ys)), device)
    (value, outs), (grads, input_grads) = _reference_fn(P, V)(*args)
    return (float(value), jax.tree.map(np.asarray, grads), jax.tree.map(np.asarray, outs),
            jax.tree.map(np.asarray, input_grads))


def put(mesh, spec, value):
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec),
                                        lambda index: value[index])


def pipeline_program(case: Case, devices) -> tuple:
    """``case`` on ``devices`` (stages x data): the jitted pipeline, its arguments (global
    arrays) and its inputs (NumPy)."""
    schedule = case.schedule()
    S, V, M, D = case.stages, schedule.virtual_stages, case.microbatches, case.data
    dtype = jnp.bfloat16 if case.dtype == "bfloat16" else np.float32
    mesh = jax.make_mesh((S, D), ("stage", "data"), devices=devices[:S * D])
    params = make_params(S, V, np.float32)
    xs, ys = make_data(M, case.samples * D, np.float32)
    cast = lambda t: jax.tree.map(lambda a: np.asarray(a).astype(dtype), t)  # noqa: E731
    params, xs, ys = cast(params), cast(xs), cast(ys)
    # Results replicated on every device: each process holds them whole, gathered in the
    # same compiled program (a gather per leaf afterwards would be a compilation per leaf).
    f = jax.jit(pl.shard_value_and_grad(stage, loss, mesh, schedule,
                                        data_axis_name="data" if D > 1 else None,
                                        return_outputs=True,
                                        return_input_grads=case.input_grads,
                                        remat=case.remat),
                out_shardings=NamedSharding(mesh, P()))
    data = P(None, "data") if D > 1 else P()
    args = (jax.tree.map(lambda a: put(mesh, P("stage"), a), params),
            jax.tree.map(lambda a: put(mesh, data, a), xs), put(mesh, data, ys))
    return f, args, (params, xs, ys)


def run_program(f, args, inputs) -> tuple:
    """Run a :func:`pipeline_program`; returns its inputs (NumPy) and results (loss,
    gradients, outputs[, input gradients]: NumPy, whole on every process)."""
    results = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), f(*args))
    return inputs, results


def run_pipeline(case: Case, devices) -> tuple:
    """Run ``case`` on ``devices`` (stages x data): :func:`run_program` of its
    :func:`pipeline_program`."""
    return run_program(*pipeline_program(case, devices))


def worst(errors) -> float:
    """The largest of ``errors``, NaN if any is NaN. Not Python's ``max``: it keeps its
    first value against a later NaN (``max([0.0, nan]) == 0.0``), and a NaN is what a read
    of a poisoned kept residual gives (``JAX_CPU_MPI_POISON_UNINITIALIZED``)."""
    return float(np.max(np.asarray(list(errors), np.float64)))


def within(case: Case, errors: dict[str, float]) -> bool:
    """Whether every error of :func:`compare` is within :func:`tolerance` (a NaN is not)."""
    return bool(worst(errors.values()) <= tolerance(case))


def compare(case: Case, inputs: tuple, results: tuple) -> dict[str, float]:
    """The largest relative differences of loss, gradients, outputs (and input gradients)
    from :func:`reference`."""
    V = case.schedule().virtual_stages
    got_loss, got_grads, got_outs, *got_inputs = results
    want_loss, want_grads, want_outs, want_inputs = reference(*inputs, case.stages, V)
    assert len(got_inputs) == case.input_grads

    def rel(got, want):
        got = got.astype(np.float32)
        scale = float(np.max(np.abs(want))) or 1.0
        return float(np.max(np.abs(got - want))) / scale

    grad_err = worst(jax.tree.leaves(jax.tree.map(rel, got_grads, want_grads)))
    out_err = worst(jax.tree.leaves(jax.tree.map(rel, got_outs, want_outs)))
    loss_err = abs(float(got_loss) - want_loss) / abs(want_loss)
    errors = {"loss": loss_err, "grads": grad_err, "outputs": out_err}
    if case.input_grads:
        errors["inputs"] = worst(jax.tree.leaves(jax.tree.map(rel, got_inputs[0], want_inputs)))
    return errors


def run_case(case: Case, devices) -> dict[str, float]:
    """:func:`run_pipeline` and :func:`compare`."""
    return compare(case, *run_pipeline(case, devices))


def tolerance(case: Case) -> float:
    return 2e-2 if case.dtype == "bfloat16" else 2e-5


def precv_zero_fills(text: str) -> list[int]:
    """The ``zero_fill`` field of each precv custom call in a lowered program's text, in
    program order: 0 where a device that is no destination leaves the output unwritten."""
    fills = []
    for line in text.splitlines():
        if "stablehlo.custom_call @jax_cpu_mpi_precv" in line:
            values = re.search(r"routing = dense<\[([-\d, ]+)\]>", line).group(1)
            routing = np.array([int(v) for v in values.split(",")])
            fills.append(custom_calls.unpack_routing(routing)[custom_calls.ZERO_FILL])
    return fills
