"""Stage functions that draw random numbers (dropout) get the reference's keys.

``key=`` gives every (microbatch, chunk, data shard) its own key
(:func:`jax_cpu_mpi.pipeline.microbatch_key`); every schedule, with the forward recomputed
and with its residuals kept, with a data axis, must then equal
:func:`jax_cpu_mpi.pipeline.reference_value_and_grad` given the same key. Small shapes,
one compilation per case.
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


@cache
def problem(chunks: int, microbatches: int):
    rng = np.random.default_rng(1)
    params = [{"w": jnp.asarray(rng.normal(0, 0.5, (WIDTH, WIDTH)), jnp.float32),
               "b": jnp.asarray(rng.normal(0, 0.1, (WIDTH,)), jnp.float32)}
              for _ in range(chunks)]
    xs = jnp.asarray(rng.normal(size=(microbatches, SAMPLES, WIDTH)), jnp.float32)
    ys = jnp.asarray(rng.normal(size=(microbatches, SAMPLES, WIDTH)), jnp.float32)
    return params, xs, ys


CASES = [("gpipe", 4, 1, True), ("1f1b", 4, 1, True), ("interleaved-1f1b:2", 2, 2, True),
         ("zero-bubble", 4, 1, True), ("zero-bubble", 4, 1, False), ("1f1b", 2, 2, False),
         ("interleaved-1f1b:2", 2, 2, False)]


@pytest.mark.parametrize("name,stages,data,remat", CASES,
                         ids=[f"{n}-P{p}-D{d}" + ("" if r else "-kept") for n, p, d, r in CASES])
def test_keyed_stages_match_the_reference(name, stages, data, remat):
    schedule_name, _, v = name.partition(":")
    V = int(v or 1)
    M = 3
    schedule = pl.schedule_by_name(schedule_name, V)
    chunks, xs, ys = problem(stages * V, M)
    params = pl.stack_stages(chunks, stages, V)
    key = jax.random.key(7)
    devices = np.asarray(jax.devices()[:stages * data]).reshape(stages, data)
    mesh = jax.sharding.Mesh(devices, ("stage", "data"))
    f = jax.jit(pl.shard_value_and_grad(dropout_stage, mse, mesh, schedule,
                                        data_axis_name="data", return_input_grads=True,
                                        remat=remat))
    loss, grads, dxs = f(params, xs, ys, key)
    want_loss, want_grads, want_dxs = pl.reference_value_and_grad(
        dropout_stage, mse, params, xs, ys, V, return_input_grads=True, key=key,
        data_shards=data)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for got, want in zip(jax.tree.leaves((grads, dxs)), jax.tree.leaves((want_grads, want_dxs)),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    # Another key draws other masks: the key reaches the stages.
    other = pl.reference_value_and_grad(dropout_stage, mse, params, xs, ys, V,
                                        key=jax.random.key(8), data_shards=data)[0]
    assert abs(float(other) - float(want_loss)) > 1e-4


def test_keys_per_microbatch_chunk_and_shard_differ():
    key = jax.random.key(0)
    seen = {tuple(np.asarray(jax.random.key_data(pl.microbatch_key(key, m, c, d))))
            for m in range(3) for c in range(4) for d in (None, 0, 1)}
    assert len(seen) == 3 * 4 * 3
