"""Every schedule computes the loss, gradients and outputs of the model on one device.

One process, the first devices of pytest's 8: 4 stages (pytree activations, M not a
multiple of P), 2 stages x 2 data shards, M = 1, P = 1, bfloat16, chunks whose parameters
differ in shape, and the gradients with respect to the microbatches. The mpirun
topologies run in test_pipeline_mpi.py. Reference: ``jax.value_and_grad`` of the chunks
composed without a pipeline (tests/mpi_programs/pipeline_cases.py). One compilation per
case: compiling the cases of one mesh as one function takes longer than compiling them one
by one.
"""

from __future__ import annotations

from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pipeline_cases import (
    Case,
    pipeline_program,
    precv_zero_fills,
    run_case,
    run_program,
    within,
)

from jax_cpu_mpi import pipeline as pl
from jax_cpu_mpi._src.ops import p2p
from jax_cpu_mpi._src.pipeline import executor

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b:2", "zero-bubble"]

CASES = (
    [Case(s, stages=4, microbatches=5) for s in SCHEDULES]
    + [Case("interleaved-1f1b:2", stages=2, microbatches=3, data=2)]
    + [Case("zero-bubble", stages=4, microbatches=1)]
    + [Case(s, stages=1, microbatches=3) for s in ("1f1b", "interleaved-1f1b:3")]
    + [Case("zero-bubble", stages=2, microbatches=2, dtype="bfloat16")]
    # 2 samples per microbatch: the activations' leaves {"h", "skip"} then had a shape and
    # dtype alike, and, sent as one psend per leaf on the same device pair, arrived swapped
    # in some compiled programs (the mailbox's size check could not tell them apart).
    + [Case("gpipe", stages=4, microbatches=5, samples=2)]
    # The microbatches' gradients: the first chunk's full and split (ZB) backward, data
    # shards (each gets its part, of the data-averaged loss), one stage.
    + [Case("zero-bubble", stages=4, microbatches=5, input_grads=True),
       Case("interleaved-1f1b:2", stages=2, microbatches=3, data=2, input_grads=True),
       Case("1f1b", stages=1, microbatches=3, input_grads=True)]
    # Interleaved 1F1B with two messages of one pair in some ticks (P = 4, M = 8): sent as
    # two psends on one channel, XLA CPU ran them in either order and they arrived swapped
    # (gradients 75 % off); they now go packed as one.
    + [Case("interleaved-1f1b:2", stages=4, microbatches=8)]
    # remat=False: the backward starts from the forward's kept residuals; ZB-H1's weight
    # part from what its input part kept (with and without the first chunk's dx).
    + [Case(s, stages=4, microbatches=5, remat=False) for s in SCHEDULES]
    + [Case("zero-bubble", stages=4, microbatches=5, input_grads=True, remat=False),
       Case("interleaved-1f1b:2", stages=2, microbatches=3, data=2, remat=False),
       Case("zero-bubble", stages=2, microbatches=2, dtype="bfloat16", remat=False),
       Case("1f1b", stages=1, microbatches=3, input_grads=True, remat=False)]
)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.name}-P{c.stages}-M{c.microbatches}"
                         f"-D{c.data}-{c.dtype}-S{c.samples}" + ("-dx" if c.input_grads else "")
                         + ("" if c.remat else "-kept"))
def test_matches_single_device(case):
    errors = run_case(case, jax.devices())
    assert within(case, errors), errors


# Both directions (activations, cotangents), two messages of one pair packed in a tick
# (interleaved, P = 2), a data axis, kept residuals, and 1 MiB messages (the in-process
# transport copies any size once; the mpirun sizes are in pipeline_exactness.py).
UNREAD_CASES = [Case("gpipe", stages=4, microbatches=5),
                Case("1f1b", stages=4, microbatches=5, input_grads=True),
                Case("interleaved-1f1b:2", stages=2, microbatches=4, data=2),
                Case("zero-bubble", stages=4, microbatches=5, remat=False),
                Case("gpipe", stages=2, microbatches=2, samples=1 << 14)]


@pytest.mark.parametrize("case", UNREAD_CASES,
                         ids=lambda c: f"{c.name}-P{c.stages}-D{c.data}-S{c.samples}")
def test_a_stage_that_receives_nothing_writes_no_zeros(case, monkeypatch):
    """A stage that is no destination of a tick's message stores what its precv gives in the
    scratch slot, which no tick reads: the executor's precvs are lowered with
    ``zero_fill = 0`` and leave their output unwritten there (poisoned in these tests,
    conftest.py), and the results are, bit for bit, those of precvs that write the zeros."""
    f, args, inputs = pipeline_program(case, jax.devices())
    fills = precv_zero_fills(f.lower(*args).as_text())
    assert fills and set(fills) == {0}, fills
    got = run_program(f, args, inputs)[1]
    monkeypatch.setattr(executor, "precv_unread_off_destinations", p2p.precv)
    f, args, inputs = pipeline_program(case, jax.devices())
    assert set(precv_zero_fills(f.lower(*args).as_text())) == {1}
    want = run_program(f, args, inputs)[1]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        bits = lambda v: np.atleast_1d(np.asarray(v)).view(np.uint8)  # noqa: E731
        np.testing.assert_array_equal(bits(a), bits(b))


def _dense(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def _bottleneck(p, x):
    return x + jnp.tanh(x @ p["down"]) @ p["up"]


def _two_layers(p, x):
    return _dense(p[1], _dense(p[0], x))


@cache
def different_shapes_problem():
    """A dense layer, a bottleneck, two dense layers, a dense layer: their functions and
    parameters, microbatches, targets, and jax.value_and_grad of the chunks composed."""
    width = 8
    rng = np.random.default_rng(0)

    def normal(*shape):
        return jnp.asarray(rng.normal(0, 0.4, shape), jnp.float32)

    def dense_params():
        return {"w": normal(width, width), "b": normal(width)}

    functions = [_dense, _bottleneck, _two_layers, _dense]
    params = [dense_params(), {"down": normal(width, 3), "up": normal(3, width)},
              (dense_params(), dense_params()), dense_params()]
    xs, ys = normal(5, 2, width), normal(5, 2, width)

    def model_loss(params):
        def one(x, y):
            for f, p in zip(functions, params, strict=True):
                x = f(p, x)
            return jnp.mean((x - y) ** 2)
        return jnp.mean(jax.vmap(one)(xs, ys))

    return functions, params, xs, ys, jax.jit(jax.value_and_grad(model_loss))(params)


@pytest.mark.parametrize("schedule,stages,remat",
                         [(pl.OneFOneB(), 4, True), (pl.Interleaved1F1B(2), 2, True),
                          (pl.ZeroBubble(), 4, False)],
                         ids=["1f1b-P4", "interleaved-P2xV2", "zero-bubble-P4-kept"])
def test_chunks_with_parameters_of_different_shapes(schedule, stages, remat):
    """One function and one parameter pytree per chunk, against the same chunks composed on
    one device. With remat=False every chunk keeps its own residuals (JAX's switch over the
    chunks keeps those of all of them)."""
    functions, params, xs, ys, (want_loss, want_grads) = different_shapes_problem()
    mesh = jax.make_mesh((stages,), ("stage",), devices=jax.devices()[:stages])
    f = jax.jit(pl.shard_value_and_grad(functions, lambda y, t: jnp.mean((y - t) ** 2), mesh,
                                        schedule, remat=remat))
    got_loss, got_grads = f(params, xs, ys)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    assert jax.tree.structure(got_grads) == jax.tree.structure(want_grads)
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_messages_pack_every_leaf_into_one_byte_vector():
    """The executor sends each tick's buffer as one byte vector (never one psend per leaf);
    packing and unpacking must be lossless for any leaf dtype and keep the tree."""
    from jax_cpu_mpi._src.pipeline.executor import _from_bytes, _to_bytes

    rng = np.random.default_rng(0)
    tree = {"h": jnp.asarray(rng.normal(size=(2, 3)), jnp.float32),
            "skip": jnp.asarray(rng.normal(size=(2, 3)), jnp.float32),
            "low": jnp.asarray(rng.normal(size=(5,)), jnp.bfloat16),
            "idx": jnp.asarray(rng.integers(-9, 9, size=(2, 2)), jnp.int32),
            "mask": jnp.asarray(rng.integers(0, 2, size=(3,)), jnp.bool_),
            "scalar": jnp.asarray(1.5, jnp.float16)}
    data = _to_bytes(tree)
    assert data.dtype == jnp.uint8 and data.ndim == 1
    back = _from_bytes(data, tree)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(tree), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
