"""Stage functions that draw random numbers (dropout) get the reference's keys, and a loss
with parameters (a head) gets their gradient.

``key=`` gives every (microbatch, chunk, data shard) its own key
(:func:`jax_cpu_mpi.pipeline.microbatch_key`); ``loss_params=`` passes the loss its
parameters. Every schedule, with the forward recomputed and with its residuals kept, with a
data axis, must then equal :func:`jax_cpu_mpi.pipeline.reference_value_and_grad` given the
same. Small shapes, one compilation per case.
"""

from __future__ import annotations

from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cpu_mpi import pipeline as pl

WIDTH, SAMPLES, RATE = 8, 4, 0.5


def dropout_stage(p, x, key):
    """A dense layer and dropout: the mask depends on the key (a wrong key is a wrong
    result), and the backward must see the forward's mask."""
    h = jnp.tanh(x @ p["w"] + p["b"])
    keep = jax.random.bernoulli(key, 1.0 - RATE, h.shape)
    return jnp.where(keep, h / (1.0 - RATE), 0.0)


def mse(y, t):
    return jnp.mean((y - t) ** 2)


def head_mse(head, y, t):
    return jnp.mean((y @ head["w"] + head["b"] - t) ** 2)


@cache
def problem(chunks: int, microbatches: int):
    rng = np.random.default_rng(1)
    params = [{"w": jnp.asarray(rng.normal(0, 0.5, (WIDTH, WIDTH)), jnp.float32),
               "b": jnp.asarray(rng.normal(0, 0.1, (WIDTH,)), jnp.float32)}
              for _ in range(chunks)]
    xs = jnp.asarray(rng.normal(size=(microbatches, SAMPLES, WIDTH)), jnp.float32)
    ys = jnp.asarray(rng.normal(size=(microbatches, SAMPLES, WIDTH)), jnp.float32)
    return params, xs, ys


CASES = [("gpipe", 4, 1, True, False), ("1f1b", 4, 1, True, True),
         ("interleaved-1f1b:2", 2, 2, True, True), ("zero-bubble", 4, 1, True, True),
         ("zero-bubble", 4, 1, False, True), ("1f1b", 2, 2, False, False),
         ("interleaved-1f1b:2", 2, 2, False, True)]


@pytest.mark.parametrize("name,stages,data,remat,head", CASES,
                         ids=[f"{n}-P{p}-D{d}" + ("" if r else "-kept") + ("-head" if h else "")
                              for n, p, d, r, h in CASES])
def test_keyed_stages_match_the_reference(name, stages, data, remat, head):
    schedule_name, _, v = name.partition(":")
    V = int(v or 1)
    M = 3
    schedule = pl.schedule_by_name(schedule_name, V)
    chunks, xs, ys = problem(stages * V, M)
    params = pl.stack_stages(chunks, stages, V)
    key = jax.random.key(7)
    devices = np.asarray(jax.devices()[:stages * data]).reshape(stages, data)
    mesh = jax.sharding.Mesh(devices, ("stage", "data"))
    rng = np.random.default_rng(2)
    lp = {"w": jnp.asarray(rng.normal(0, 0.5, (WIDTH, WIDTH)), jnp.float32),
          "b": jnp.asarray(rng.normal(0, 0.5, (WIDTH,)), jnp.float32)} if head else None
    loss_fn = head_mse if head else mse
    f = jax.jit(pl.shard_value_and_grad(dropout_stage, loss_fn, mesh, schedule,
                                        data_axis_name="data", return_input_grads=True,
                                        remat=remat))
    got = f(params, xs, ys, key, lp)
    # The reference as one program, run for both keys: op by op, each of its primitives was
    # a compilation of its own.
    reference = jax.jit(lambda k: pl.reference_value_and_grad(
        dropout_stage, loss_fn, params, xs, ys, V, return_input_grads=True, key=k,
        data_shards=data, loss_params=lp))
    want = reference(key)
    assert len(got) == len(want) == (4 if head else 3)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:]), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6)
    want_loss = want[0]
    # Another key draws other masks: the key reaches the stages.
    other = reference(jax.random.key(8))[0]
    assert abs(float(other) - float(want_loss)) > 1e-4


def test_keys_per_microbatch_chunk_and_shard_differ():
    key = jax.random.key(0)
    seen = {tuple(np.asarray(jax.random.key_data(pl.microbatch_key(key, m, c, d))))
            for m in range(3) for c in range(4) for d in (None, 0, 1)}
    assert len(seen) == 3 * 4 * 3
