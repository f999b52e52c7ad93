"""The pipeline benchmark's yardstick: its float64 NumPy reference agrees with JAX's autodiff.

Both sides of ``benchmarks/pipeline`` are checked against ``reference_loss_and_grads``
before they are timed, so a wrong reference would pass a wrong pipeline or fail a right one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "pipeline"))
from model import Shape, chunk_layers, make_problem, reference_loss_and_grads


def test_reference_matches_jax_value_and_grad() -> None:
    shape = Shape(layers=4, width=8, batch=12, stages=2, microbatches=3, seed=1)
    problem = make_problem(shape)

    def loss(params, x, y):
        h = x
        for layer in range(shape.layers):
            h = jnp.tanh(h @ params["w"][layer] + params["b"][layer])
        return jnp.mean((h - y) ** 2)

    with jax.enable_x64():
        params = {"w": jnp.asarray(problem.w, jnp.float64),
                  "b": jnp.asarray(problem.b, jnp.float64)}
        want_loss, want = jax.value_and_grad(loss)(params, jnp.asarray(problem.x, jnp.float64),
                                                   jnp.asarray(problem.y, jnp.float64))
    got_loss, gw, gb = reference_loss_and_grads(problem)
    np.testing.assert_allclose(got_loss, float(want_loss), rtol=1e-12)
    np.testing.assert_allclose(gw, np.asarray(want["w"]), rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(gb, np.asarray(want["b"]), rtol=1e-10, atol=1e-14)


def test_chunks_cover_the_layers_in_order() -> None:
    shape = Shape(layers=8, width=4, batch=4, stages=2, microbatches=2)
    layers = [i for c in range(4) for i in range(8)[chunk_layers(shape, 2, c)]]
    assert layers == list(range(8))
