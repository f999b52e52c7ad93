"""The benchmark's model and data, in NumPy only, so that the JAX and torch sides build the
same float32 arrays from the same seed.

The model: ``layers`` layers of ``width`` features, each ``h -> tanh(h @ w + b)``; the loss:
the mean squared error against the targets over the whole batch (equal microbatches make it
the mean of the microbatches' means). The layers are split evenly into ``stages`` pipeline
stages (``stages x virtual`` chunks for interleaved schedules): chunk ``c`` holds the layers
``c * per_chunk ... (c + 1) * per_chunk - 1``.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Shape:
    """The benchmark's model and pipeline: layers, width, batch, stages, microbatches."""

    layers: int
    width: int
    batch: int
    stages: int
    microbatches: int
    seed: int = 0

    def check(self, virtual: int = 1) -> None:
        """Raise ``ValueError`` when the layers or the batch do not split evenly."""
        chunks = self.stages * virtual
        if self.layers % chunks:
            raise ValueError(f"pipeline benchmark: {self.layers} layers do not split into "
                             f"{self.stages} stages x {virtual} virtual stages; use a "
                             f"multiple of {chunks} layers")
        if self.batch % self.microbatches:
            raise ValueError(f"pipeline benchmark: batch {self.batch} is not a multiple of "
                             f"{self.microbatches} microbatches")

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class Problem:
    """Parameters ``w [L, W, W]``, ``b [L, W]`` and data ``x, y [B, W]``, float32."""

    w: np.ndarray
    b: np.ndarray
    x: np.ndarray
    y: np.ndarray


def make_problem(shape: Shape) -> Problem:
    """The same arrays in every process, from ``shape.seed``."""
    rng = np.random.default_rng(shape.seed)
    L, W, B = shape.layers, shape.width, shape.batch
    # 1/sqrt(W) keeps tanh out of saturation, so the gradients of every layer matter.
    w = rng.normal(0.0, 1.0 / np.sqrt(W), (L, W, W)).astype(np.float32)
    b = rng.normal(0.0, 0.1, (L, W)).astype(np.float32)
    x = rng.normal(0.0, 1.0, (B, W)).astype(np.float32)
    y = rng.normal(0.0, 0.5, (B, W)).astype(np.float32)
    return Problem(w, b, x, y)


def chunk_layers(shape: Shape, virtual: int, chunk: int) -> slice:
    """The layers of pipeline chunk ``chunk`` (of ``stages x virtual``)."""
    per_chunk = shape.layers // (shape.stages * virtual)
    return slice(chunk * per_chunk, (chunk + 1) * per_chunk)


def reference_loss_and_grads(problem: Problem) -> tuple[float, np.ndarray, np.ndarray]:
    """Loss and gradients in float64 NumPy: the yardstick both frameworks are checked against."""
    w, b = problem.w.astype(np.float64), problem.b.astype(np.float64)
    h = problem.x.astype(np.float64)
    outs = [h]
    for layer in range(w.shape[0]):
        h = np.tanh(h @ w[layer] + b[layer])
        outs.append(h)
    diff = h - problem.y
    loss = float(np.mean(diff**2))
    g = 2.0 * diff / diff.size
    gw, gb = np.zeros_like(w), np.zeros_like(b)
    for layer in reversed(range(w.shape[0])):
        g = g * (1.0 - outs[layer + 1] ** 2)  # through tanh
        gw[layer] = outs[layer].T @ g
        gb[layer] = g.sum(0)
        g = g @ w[layer].T
    return loss, gw, gb


def relative_difference(got: np.ndarray, want: np.ndarray) -> float:
    """``max|got - want| / max|want|``."""
    scale = float(np.max(np.abs(want)))
    diff = float(np.max(np.abs(np.asarray(got, np.float64) - want)))
    return diff / scale if scale else diff


def add_model_arguments(parser: argparse.ArgumentParser, *, stages: bool = True) -> None:
    """The model and split options every script of the benchmark takes, with one set of
    defaults, so that the driver and the two sides cannot disagree on the model.
    ``stages=False`` for torch, whose stage count is its process count."""
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=512)
    if stages:
        parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--virtual-stages", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
