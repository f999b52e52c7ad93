"""Flax NNX blocks as pipeline stages (:class:`jax_cpu_mpi.pipeline.NnxStages`).

The stacked parameters go back to the blocks' own trees unchanged; every schedule's loss and
gradients, with dropout keyed per microbatch and chunk, equal ``jax.value_and_grad`` of the
NNX blocks called one after the other on one device (not through the library's reference),
given the keys :func:`jax_cpu_mpi.pipeline.microbatch_key` names.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cpu_mpi import pipeline as pl

nnx = pytest.importorskip("flax.nnx")

WIDTH, BLOCKS, M = 8, 4, 2


class Block(nnx.Module):
    def __init__(self, width: int, rngs):
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.dense = nnx.Linear(width, width, rngs=rngs)
        self.drop = nnx.Dropout(0.3)

    def __call__(self, x, rngs=None):
        return x + self.drop(jnp.tanh(self.dense(self.norm(x))), rngs=rngs,
                             deterministic=rngs is None)


def make_blocks():
    rngs = nnx.Rngs(0)
    return [Block(WIDTH, rngs) for _ in range(BLOCKS)]


def mse(y, t):
    return jnp.mean((y - t) ** 2)


def test_stack_and_back_is_the_blocks_own_tree():
    blocks = make_blocks()
    stages = pl.NnxStages(blocks, stages=2, virtual_stages=2)
    stacked = stages.params()
    assert jax.tree.leaves(stacked)[0].shape[:3] == (2, 2, 1)  # [P, V, K, ...]
    back = stages.blocks(stacked)
    for block, state in zip(blocks, back, strict=True):
        want = nnx.to_pure_dict(nnx.state(block, nnx.Param))
        assert jax.tree.structure(state) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)
    doubled = jax.tree.map(lambda a: 2 * a, stacked)
    stages.update(blocks, doubled)
    np.testing.assert_array_equal(blocks[3].dense.kernel[...], 2 * back[3]["dense"]["kernel"][...])
    with pytest.raises(ValueError, match="do not split evenly"):
        pl.NnxStages(blocks[:3], stages=2)


# The other schedules run with NNX blocks in the transformer example's --check test.
@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b"])
def test_every_schedule_matches_the_blocks_on_one_device(name):
    V = 2 if name == "interleaved-1f1b" else 1
    P = 2
    blocks = make_blocks()
    stages = pl.NnxStages(blocks, P, V)
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.normal(size=(M, 4, WIDTH)), jnp.float32)
    ys = jnp.asarray(rng.normal(size=(M, 4, WIDTH)), jnp.float32)
    key = jax.random.key(3)
    mesh = jax.make_mesh((P,), ("stage",), devices=jax.devices()[:P])
    f = jax.jit(pl.shard_value_and_grad(stages.stage_fn, mse, mesh,
                                        pl.schedule_by_name(name, V)))
    loss, grads = f(stages.params(), xs, ys, key)

    K = BLOCKS // (P * V)
    graphdef, _, rest = nnx.split(blocks[0], nnx.Param, ...)

    def model_loss(per_block):
        total = 0.0
        for m in range(M):
            x = xs[m]
            for b, state in enumerate(per_block):
                chunk_key = pl.microbatch_key(key, m, b // K)
                rngs = nnx.Rngs(dropout=jax.random.fold_in(chunk_key, b % K))
                x = nnx.merge(graphdef, state, rest)(x, rngs=rngs)
            total = total + mse(x, ys[m])
        return total / M

    per_block = [nnx.to_pure_dict(nnx.state(b, nnx.Param)) for b in blocks]
    want_loss, want_grads = jax.jit(jax.value_and_grad(model_loss))(per_block)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for got, want in zip(stages.blocks(jax.device_get(grads)), want_grads, strict=True):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
