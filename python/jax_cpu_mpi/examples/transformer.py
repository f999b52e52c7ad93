"""Train a GPT-style character language model with Flax NNX, Optax and Orbax, pipelined.

A decoder-only transformer (token and position embeddings, ``--layers`` pre-norm blocks of
causal self-attention and an MLP, a final norm and a head) learns the characters of the
Python standard library's own sources, found at run time next to the Python that runs it.
Its blocks are split evenly over the ``--stages`` pipeline stages of a ``stage x data`` mesh
(:class:`jax_cpu_mpi.pipeline.NnxStages`); the embedding runs before the pipeline (its
gradient from the pipeline's ``return_input_grads``), the head and the loss on the last
stage (``loss_params``); every data shard runs the pipeline on its part of each
microbatch and the gradients are averaged over the data axis. Optax: AdamW, gradient
clipping, linear warm-up and cosine decay. Dropout draws one key per microbatch, chunk and
block (``key=``).

One process, 4 CPU devices (the file sets the count itself)::

    python -m jax_cpu_mpi.examples.transformer --stages 2 --data 2

The same under MPI (the devices split over the ranks), and across hosts::

    mpirun -n 2 python -m jax_cpu_mpi.examples.transformer --stages 2 --data 2

``--check`` compares one step's loss and gradients (embedding, every block, head) with the
same model on one device without a pipeline and prints ``check: PASS`` or ``check: FAIL``
(exit code 1). ``--checkpoint DIR`` saves parameters, optimizer state, step and vocabulary
with Orbax every ``--checkpoint-every`` steps, in the model's own tree, and resumes from the
last one: a run killed and started again ends with the parameters of one that ran through
(the data and dropout of step ``i`` depend only on ``--seed`` and ``i``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from jax_cpu_mpi.examples.pipeline import (
    SCHEDULES,
    mpi_world_size,
    progress_bar,
    resolve_virtual_stages,
)

#: Characters kept as they are; any other becomes "?" (the vocabulary: those that occur).
_KEPT = frozenset(chr(c) for c in range(32, 127)) | {"\n"}
PyTree = Any


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line of the example."""
    p = argparse.ArgumentParser(
        prog="python -m jax_cpu_mpi.examples.transformer",
        description="Train a character-level transformer language model (Flax NNX, Optax, "
                    "Orbax) with pipeline x data parallelism on CPU devices and MPI ranks.")
    a = p.add_argument
    a("--stages", type=int, default=2, help="pipeline stages (2)")
    a("--data", type=int, default=2, help="data-parallel shards (2)")
    a("--process-axis", default="data", choices=("data", "stage"),
      help="the mesh axis that goes across processes: data (a process holds consecutive "
           "stages of one data shard, so the pipeline's sends stay in the process and only "
           "the step's gradient sums cross) or stage (a process holds the data shards of "
           "one stage: every activation and cotangent crosses); data by default")
    a("--schedule", default="1f1b", choices=SCHEDULES, help="pipeline schedule (1f1b)")
    a("--virtual-stages", type=int, default=None,
      help="chunks per stage for interleaved-1f1b (2; 1 for the others)")
    a("--microbatches", type=int, default=4, help="microbatches per step (4)")
    a("--layers", type=int, default=4, help="transformer blocks (4)")
    a("--width", type=int, default=128, help="model width (128)")
    a("--heads", type=int, default=4, help="attention heads (4)")
    a("--seq-len", type=int, default=64, help="characters per sequence (64)")
    a("--batch", type=int, default=32, help="sequences per step (32)")
    a("--steps", type=int, default=300, help="optimizer steps (300)")
    a("--dropout", type=float, default=0.1, help="dropout rate in the blocks (0.1)")
    a("--seed", type=int, default=0, help="seed of parameters, batches and dropout (0)")
    a("--lr", type=float, default=3e-3, help="peak learning rate (3e-3)")
    a("--warmup", type=int, default=30, help="linear warm-up steps (30)")
    a("--weight-decay", type=float, default=0.1, help="AdamW weight decay (0.1)")
    a("--clip", type=float, default=1.0, help="gradient clipping: global norm (1.0)")
    a("--eval-every", type=int, default=50,
      help="validation loss every N steps and after the last (50; 0: never)")
    a("--eval-batches", type=int, default=4, help="validation batches (4)")
    a("--text-chars", type=int, default=2_000_000,
      help="characters of standard-library source to read (2000000)")
    a("--remat", action=argparse.BooleanOptionalAction, default=False,
      help="recompute each forward in its backward (less memory) instead of keeping its "
           "residuals for it (--no-remat, the default: a forward less per backward)")
    a("--plot", metavar="FILE", default=None, help="draw train and validation loss into FILE")
    a("--sample", type=int, default=0, metavar="N", help="print N generated characters")
    a("--check", action="store_true",
      help="compare one step's loss and gradients with one device without a pipeline")
    a("--checkpoint", metavar="DIR", default=None,
      help="save with Orbax into DIR every --checkpoint-every steps; resume from the last")
    a("--checkpoint-every", type=int, default=50, help="steps between checkpoints (50)")
    a("--trace", metavar="DIR", default=None,
      help="record the psend/precv timeline of the steps after the first into DIR (one "
           "file per process); 'python -m jax_cpu_mpi trace DIR' draws it")
    args = p.parse_args(argv)
    resolve_virtual_stages(p, args)
    if min(args.stages, args.data, args.microbatches, args.layers, args.width, args.heads,
           args.seq_len, args.batch, args.virtual_stages,
           args.checkpoint_every) < 1 or min(args.steps, args.eval_every) < 0:
        p.error("sizes must be >= 1 (--steps and --eval-every >= 0)")
    chunks = args.stages * args.virtual_stages
    if args.layers % chunks:
        p.error(f"--layers {args.layers} does not split evenly over {args.stages} stages x "
                f"{args.virtual_stages} virtual stage(s); use a multiple of {chunks}")
    if args.width % args.heads:
        p.error(f"--width {args.width} is not a multiple of --heads {args.heads}")
    if args.batch % (args.microbatches * args.data):
        p.error(f"--batch {args.batch} must be a multiple of --microbatches x --data = "
                f"{args.microbatches * args.data}")
    if not 0.0 <= args.dropout < 1.0:
        p.error("--dropout must be in [0, 1)")
    return args


def _set_device_count_before_jax(argv: Sequence[str]) -> None:
    """``stages x data / processes`` CPU devices for this process (read at backend start)."""
    args = parse_args(argv)
    devices, processes = args.stages * args.data, mpi_world_size() or 1
    if devices % processes:
        raise SystemExit(f"transformer: {devices} devices (--stages x --data) do not split "
                         f"over {processes} MPI processes")
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "",
                   os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = \
        f"{flags} --xla_force_host_platform_device_count={devices // processes}".strip()


if __name__ == "__main__":  # before JAX creates its CPU backend, which reads XLA_FLAGS
    _set_device_count_before_jax(sys.argv[1:])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_cpu_mpi  # noqa: E402
from jax_cpu_mpi import pipeline  # noqa: E402

STAGE, DATA = "stage", "data"


# ----------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Text:
    """The corpus as token ids, its fixed split, and the character vocabulary."""

    vocab: str  # the characters, in id order
    train: np.ndarray  # int32 ids
    val: np.ndarray

    def encode(self, s: str) -> np.ndarray:
        index = {c: i for i, c in enumerate(self.vocab)}
        return np.asarray([index.get(c, index.get("?", 0)) for c in s], np.int32)

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.vocab[int(i)] for i in ids)

    def unigram_loss(self) -> float:
        """The validation loss (nats per character) of the train set's character
        frequencies: what a model that ignores context reaches."""
        counts = np.bincount(self.train, minlength=len(self.vocab)) + 1.0
        logp = np.log(counts / counts.sum())
        return float(-logp[self.val].mean())


def stdlib_sources(max_chars: int) -> str:
    """The standard library's top-level ``.py`` files, by name, up to ``max_chars``
    characters: text that ships with this Python, never downloaded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    if not parts:
        raise SystemExit(f"transformer: no Python sources found in {root}")
    return "".join(parts)[:max_chars]


def load_text(max_chars: int, vocab: str | None = None) -> Text:
    """The corpus: 90 % train, the last 10 % validation. ``vocab``: a saved vocabulary
    (from a checkpoint), else the characters that occur."""
    raw = "".join(c if c in _KEPT else "?" for c in stdlib_sources(max_chars))
    vocab = vocab if vocab is not None else "".join(sorted(set(raw) | {"?"}))
    text = Text(vocab, np.zeros(0, np.int32), np.zeros(0, np.int32))
    ids = text.encode(raw)
    cut = int(0.9 * len(ids))
    return Text(vocab, ids[:cut], ids[cut:])


def batch_at(ids: np.ndarray, seed: int, index: int, batch: int, seq_len: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """Batch ``index``: ``batch`` random windows of ``ids`` and the characters after them,
    from ``(seed, index)`` alone (a resumed run draws what an uninterrupted one does)."""
    rng = np.random.default_rng([seed, index])
    starts = rng.integers(0, len(ids) - seq_len - 1, size=batch)
    windows = np.stack([ids[s:s + seq_len + 1] for s in starts])
    return windows[:, :-1], windows[:, 1:]


# ----------------------------------------------------------------------------- model


class Embedding(nnx.Module):
    """Token and position embeddings."""

    def __init__(self, vocab: int, seq_len: int, width: int, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.normal(0.02)
        self.tokens = nnx.Embed(vocab, width, embedding_init=init, rngs=rngs)
        self.positions = nnx.Embed(seq_len, width, embedding_init=init, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return self.tokens(ids) + self.positions(jnp.arange(ids.shape[-1]))


@jax.custom_vjp
def dense(x: jax.Array, kernel: jax.Array, bias: jax.Array) -> jax.Array:
    """``x @ kernel + bias`` over the last axis of ``x``: :class:`Linear`'s product."""
    return jnp.dot(x, kernel) + bias


def _dense_forward(x: jax.Array, kernel: jax.Array, bias: jax.Array
                   ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return dense(x, kernel, bias), (x, kernel)


def _dense_backward(saved: tuple[jax.Array, jax.Array], dy: jax.Array
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    x, kernel = saved
    rows, dy_rows = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    # The kernel's gradient is x^T dy, a product over the tokens. XLA:CPU gives a dot that
    # contracts its left operand's first axis to Eigen, which packs it slowly; transposed
    # into a buffer of its own first (the barrier keeps XLA from folding the transpose
    # back into the dot), the same product is one YNNPACK takes, cheaper than Eigen's
    # by more than the copy costs. Not when the input is wider than the output (the
    # MLP's down projection, [tokens, 4 x width]): XLA writes that transposed copy one
    # strided column at a time, fused with the GELU that produced x, and it then costs
    # more than the product itself; Eigen contracting the token axis in place is cheaper.
    if rows.shape[1] > dy_rows.shape[1]:
        dkernel = jax.lax.dot_general(rows, dy_rows, (((0,), (0,)), ((), ())))
    else:
        dkernel = jnp.dot(jax.lax.optimization_barrier(rows.T), dy_rows)
    return jnp.dot(dy, kernel.T), dkernel, dy_rows.sum(axis=0)


dense.defvjp(_dense_forward, _dense_backward)


class Linear(nnx.Linear):
    """``nnx.Linear`` (the same parameters, init and tree) through :func:`dense`."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return dense(x, self.kernel[...], self.bias[...])


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal softmax attention over ``[..., T, heads, head width]`` (the layout of
    ``jax.nn.dot_product_attention``, whose XLA form costs more on CPU here)."""
    T, D = q.shape[-3], q.shape[-1]
    logits = jnp.einsum("...thd,...shd->...hts", q, k) / jnp.sqrt(D).astype(q.dtype)
    logits = jnp.where(jnp.tril(jnp.ones((T, T), bool)), logits, -1e30)
    return jnp.einsum("...hts,...shd->...thd", jax.nn.softmax(logits, axis=-1), v)


class Dropout(nnx.Dropout):
    """``nnx.Dropout`` (the same attributes and tree) whose mask costs half the random bits.

    ``nnx.Dropout`` draws a 32-bit word (threefry) for every element and keeps the element
    where the uniform float made of it is below ``1 - rate``. Here each word of
    ``jax.random.bits`` (the same key, half as many words) gives two elements their 16
    bits each: threefry's bits were the larger part of dropout's cost, drawn in every
    forward and again in the forward that remat forms in the backward. The keep
    probability is ``1 - rate`` rounded to a multiple of 2^-16 (``nnx.Dropout``'s float
    comparison rounds it to 2^-23), and the kept elements are scaled by its inverse, so
    the mean is kept exactly. The pipeline's check compares the same ``Block`` on one
    device, so it sees the same masks; ``tests/test_transformer_example.py`` checks the
    masks' rate, scale and keys."""

    def __call__(self, inputs: jax.Array, *, deterministic: bool | None = None,
                 rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None) -> jax.Array:
        if self.broadcast_dims:
            raise NotImplementedError("transformer.Dropout: broadcast_dims is not supported; "
                                      "use nnx.Dropout")
        deterministic = self.deterministic if deterministic is None else deterministic
        if deterministic or self.rate == 0.0:
            return inputs
        rngs = self.rngs if rngs is None else rngs
        if isinstance(rngs, nnx.Rngs):
            key = rngs[self.rng_collection]()
        elif isinstance(rngs, nnx.RngStream):
            key = rngs()
        elif isinstance(rngs, jax.Array):
            key = rngs
        else:
            raise ValueError(f"transformer.Dropout: no rngs (got {type(rngs).__name__}); pass "
                             "rngs=nnx.Rngs(dropout=...), an RngStream or a key, or "
                             "deterministic=True")
        *lead, width = inputs.shape
        halves = -(-width // 2)
        words = jax.random.bits(key, (*lead, halves), jnp.uint32)
        bits = jnp.concatenate([words & 0xFFFF, words >> 16], axis=-1)[..., :width]
        threshold = max(1, round((1.0 - self.rate) * 65536))
        keep = bits < jnp.uint32(threshold)
        scale = jnp.asarray(65536 / threshold, inputs.dtype)
        return jax.lax.select(keep, inputs * scale, jnp.zeros_like(inputs))


class Block(nnx.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP, each residual."""

    def __init__(self, width: int, heads: int, dropout: float, rngs: nnx.Rngs) -> None:
        self.heads = heads
        self.norm1 = nnx.LayerNorm(width, rngs=rngs)
        self.qkv = Linear(width, 3 * width, rngs=rngs)
        self.proj = Linear(width, width, rngs=rngs)
        self.norm2 = nnx.LayerNorm(width, rngs=rngs)
        self.up = Linear(width, 4 * width, rngs=rngs)
        self.down = Linear(4 * width, width, rngs=rngs)
        self.drop = Dropout(dropout)

    def __call__(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        *lead, T, W = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
        heads = lambda a: a.reshape(*lead, T, self.heads, W // self.heads)  # noqa: E731
        att = causal_attention(heads(q), heads(k), heads(v))
        x = x + self.drop(self.proj(att.reshape(*lead, T, W)), rngs=rngs,
                          deterministic=rngs is None)
        h = self.down(jax.nn.gelu(self.up(self.norm2(x))))
        return x + self.drop(h, rngs=rngs, deterministic=rngs is None)


class Head(nnx.Module):
    """The final norm and the logits."""

    def __init__(self, width: int, vocab: int, rngs: nnx.Rngs) -> None:
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.out = Linear(width, vocab, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.norm(x))


class Transformer(nnx.Module):
    """The whole model; :func:`forward` runs it on one device (sampling, the check)."""

    def __init__(self, vocab: int, args: argparse.Namespace, rngs: nnx.Rngs) -> None:
        self.embed = Embedding(vocab, args.seq_len, args.width, rngs)
        self.blocks = nnx.List([Block(args.width, args.heads, args.dropout, rngs)
                                for _ in range(args.layers)])
        self.head = Head(args.width, vocab, rngs)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets).mean()


@dataclass
class Parts:
    """The model cut for the pipeline: graph definitions, and the stacked blocks' layout."""

    embed: Any  # GraphDef of Embedding
    head: Any  # GraphDef of Head
    stages: pipeline.NnxStages

    def head_loss(self, head: PyTree, y: jax.Array, targets: jax.Array) -> jax.Array:
        """The pipeline's loss (on the last stage): head and cross entropy."""
        return cross_entropy(nnx.merge(self.head, head)(y), targets)

    def train_tree(self, model_tree: PyTree) -> PyTree:
        """The model's own tree (``{"embed", "blocks": {0: ..}, "head"}``, plain dicts) as
        the training layout: the blocks stacked for the pipeline."""
        blocks = model_tree["blocks"]
        return {"embed": model_tree["embed"], "head": model_tree["head"],
                "blocks": self.stages.stack([blocks[i] for i in sorted(blocks)])}

    def model_tree(self, train_tree: PyTree) -> PyTree:
        """The inverse of :meth:`train_tree` (on host arrays)."""
        return {"embed": train_tree["embed"], "head": train_tree["head"],
                "blocks": dict(enumerate(self.stages.blocks(train_tree["blocks"])))}


def make_model(vocab: int, args: argparse.Namespace) -> tuple[Transformer, Parts, PyTree]:
    """The model from ``--seed``, its parts, and its parameters as the model's own tree."""
    model = Transformer(vocab, args, nnx.Rngs(args.seed))
    parts = Parts(nnx.graphdef(model.embed), nnx.graphdef(model.head),
                  pipeline.NnxStages(list(model.blocks), args.stages, args.virtual_stages))
    return model, parts, nnx.to_pure_dict(nnx.state(model, nnx.Param))


def make_optimizer(args: argparse.Namespace) -> optax.GradientTransformation:
    """AdamW with global-norm clipping (:func:`clip_by_global_norm`: give the norm as
    ``update(..., global_norm=norm)``), warm-up and cosine decay; no decay of norms and
    biases."""
    warmup = max(1, min(args.warmup, args.steps - 1))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup, max(args.steps, warmup + 1), end_value=args.lr / 10)

    def decayed(tree: PyTree) -> PyTree:
        return jax.tree_util.tree_map_with_path(
            lambda path, _: str(getattr(path[-1], "key", "")) in ("kernel", "embedding"),
            tree)

    return optax.chain(clip_by_global_norm(args.clip),
                       optax.adamw(schedule, weight_decay=args.weight_decay, mask=decayed))


def global_norm_squares(tree: PyTree) -> jax.Array:
    """The sum of the squares of every leaf (of this device's part, inside ``shard_map``)."""
    return sum(jnp.sum(jnp.square(a)) for a in jax.tree.leaves(tree))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """``optax.clip_by_global_norm``, with the same (empty) state, so checkpoints of either
    restore into the other, that takes the norm as ``update(..., global_norm=norm)``: the
    example's step computes it inside its ``shard_map`` (a ``psum`` over the stages).
    Without it, Optax's ``optax.tree.norm``."""
    def update(updates: PyTree, state: optax.EmptyState, params: PyTree | None = None,
               *, global_norm: jax.Array | None = None, **extra: Any
               ) -> tuple[PyTree, optax.EmptyState]:
        del params, extra
        g_norm = optax.tree.norm(updates) if global_norm is None else global_norm
        trigger = g_norm < max_norm
        clipped = jax.tree.map(
            lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm),
            updates)
        return clipped, state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


# ----------------------------------------------------------------------------- training


def make_mesh(args: argparse.Namespace) -> jax.sharding.Mesh:
    """``stage x data`` over the job's devices, process by process: with ``--process-axis
    data`` (the default) a process's devices are consecutive stages of one data shard, with
    ``stage`` the data shards of one stage (then the next stage's)."""
    need = args.stages * args.data
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if jax.process_count() == 1:
        devices = devices[:need]
    if len(devices) != need:
        raise SystemExit(f"transformer: --stages x --data = {need} devices, the job has "
                         f"{len(devices)}")
    order = np.asarray(devices)
    # Devices fill the mesh process by process, the other axis fastest: with the data axis
    # across processes, stage varies fastest, so a process holds a data shard's stages.
    grid = (order.reshape(args.data, args.stages).T if args.process_axis == "data"
            else order.reshape(args.stages, args.data))
    return jax.sharding.Mesh(grid, (STAGE, DATA))


def train_shardings(mesh: jax.sharding.Mesh, tree: PyTree) -> PyTree:
    """The blocks sharded over the stages, embedding and head replicated."""
    stage, rep = NamedSharding(mesh, P(STAGE)), NamedSharding(mesh, P())
    return {k: jax.tree.map(lambda _, k=k: stage if k == "blocks" else rep, v)
            for k, v in tree.items()}


def make_value_and_grad(parts: Parts, mesh: jax.sharding.Mesh, args: argparse.Namespace,
                        with_norm: bool = False) -> Callable[..., tuple[jax.Array, ...]]:
    """``(params, ids, targets, key) -> (loss, grads)`` (``with_norm``: ``(loss, grads,
    global norm of grads)``): the embedding, the pipeline, the head;
    ``ids``/``targets`` ``[M, batch / M, seq]``, the batch axis sharded over data. ``key``
    ``None``: no dropout.

    All of it is one ``shard_map`` (:func:`jax_cpu_mpi.pipeline.value_and_grad` inside), so
    every cross-device sum is a ``psum`` this package lowers (over MPI under ``mpirun``) and
    all of them are in one block of the program, which orders them the same on every
    device. Left to the partitioner (a ``jax.vjp`` of the replicated embedding over sharded
    ids, Optax's norm over stage-sharded gradients) they become all-reduces XLA inserts after
    lowering, on its own collectives (gloo's TCP loop under ``mpirun``, between a process's
    own devices too)."""
    schedule = pipeline.schedule_by_name(args.schedule, args.virtual_stages)
    rep, data = P(), P(None, DATA)
    param_specs = {"embed": rep, "blocks": P(STAGE), "head": rep}

    def body(params: PyTree, ids: jax.Array, targets: jax.Array, key: jax.Array | None
             ) -> tuple[jax.Array, ...]:
        # The shard's own embedding gradient (its parameters made varying over data), then
        # one psum of all of it.
        h, embed_vjp = jax.vjp(lambda p: nnx.merge(parts.embed, p)(ids),
                               jax.lax.pcast(params["embed"], DATA, to="varying"))
        loss, block_grads, head_grads, dh = pipeline.value_and_grad(
            parts.stages.stage_fn, params["blocks"], parts.head_loss, h, targets, schedule,
            axis_name=STAGE, data_axis_name=DATA, return_input_grads=True, remat=args.remat,
            key=key, loss_params=params["head"])
        flat, unflatten = ravel_pytree(embed_vjp(dh)[0])
        grads = {"embed": unflatten(jax.lax.psum(flat, DATA)), "blocks": block_grads,
                 "head": head_grads}
        if not with_norm:
            return loss, grads
        norm = jnp.sqrt(jax.lax.psum(global_norm_squares(block_grads), STAGE)
                        + global_norm_squares([grads["embed"], head_grads]))
        return loss, grads, norm

    def value_and_grad(params: PyTree, ids: jax.Array, targets: jax.Array,
                       key: jax.Array | None) -> tuple[jax.Array, ...]:
        out_specs = (rep, param_specs) + ((rep,) if with_norm else ())
        return jax.shard_map(body, mesh=mesh, in_specs=(param_specs, data, data, rep),
                             out_specs=out_specs)(params, ids, targets, key)

    return value_and_grad


def reference_value_and_grad(parts: Parts, args: argparse.Namespace
                             ) -> Callable[..., tuple[jax.Array, PyTree]]:
    """The same on one device, no pipeline, over the model's own tree: each microbatch's
    data shards through every block in order, block ``b`` with the key the pipeline gives
    it (chunk ``b // K``, place ``b % K`` in its chunk)."""
    K = parts.stages.per_chunk
    graphdef, rest = parts.stages.graphdef, parts.stages.rest

    def loss_fn(tree: PyTree, ids: jax.Array, targets: jax.Array, key: jax.Array
                ) -> jax.Array:
        embed, head = nnx.merge(parts.embed, tree["embed"]), nnx.merge(parts.head, tree["head"])
        losses = []
        for m in range(ids.shape[0]):
            for d, (x, t) in enumerate(zip(jnp.split(ids[m], args.data),
                                           jnp.split(targets[m], args.data), strict=True)):
                h = embed(x)
                for b in range(args.layers):
                    k = pipeline.microbatch_key(key, m, b // K, d)
                    block = nnx.merge(graphdef, tree["blocks"][b], rest)
                    h = block(h, rngs=nnx.Rngs(dropout=jax.random.fold_in(k, b % K)))
                losses.append(cross_entropy(head(h), t))
        return jnp.mean(jnp.stack(losses))

    return jax.jit(jax.value_and_grad(loss_fn))


def make_train_step(value_and_grad: Callable[..., Any], optimizer: optax.GradientTransformation,
                    shardings: tuple[PyTree, PyTree, Any], seed: int
                    ) -> Callable[..., tuple[PyTree, PyTree, jax.Array]]:
    """The jitted step (``value_and_grad``: :func:`make_value_and_grad` ``with_norm``, whose
    norm the clipping takes); its results keep the parameters' and optimizer state's
    shardings (``shardings``), so the next step runs the same compiled program.

    ``step(params, opt_state, ids, targets, index)``: ``index`` is the step's number, and
    its dropout key ``fold_in(key(seed), index)`` is drawn inside the step. A key drawn
    outside would be an array on one device that every step first copied to the whole mesh
    (JAX's Python path for an argument on other devices than the program's)."""
    @partial(jax.jit, out_shardings=shardings, donate_argnums=(0, 1))
    def step(params: PyTree, opt_state: PyTree, ids: jax.Array, targets: jax.Array,
             index: jax.Array) -> tuple[PyTree, PyTree, jax.Array]:
        key = jax.random.fold_in(jax.random.key(seed), index)
        loss, grads, norm = value_and_grad(params, ids, targets, key)
        updates, opt_state = optimizer.update(grads, opt_state, params, global_norm=norm)
        return optax.apply_updates(params, updates), opt_state, loss

    return lambda params, opt_state, ids, targets, index: step(
        params, opt_state, ids, targets, np.uint32(index))


def init_opt_state(optimizer: optax.GradientTransformation, params: PyTree,
                   mesh: jax.sharding.Mesh) -> PyTree:
    """The optimizer's state: moments sharded like the parameters, counters replicated.

    The shardings are given to ``jit`` as ``out_shardings``: left to itself it makes the
    moments (``zeros_like`` of the parameters) replicated, and every step then updated all
    the stages' moments on every device and gathered them (two all-gathers per block
    leaf, each a meeting of all the devices)."""
    rep = NamedSharding(mesh, P())
    param_shardings = jax.tree.map(lambda a: a.sharding, params)
    shardings = map_params_like(jax.tree.map(lambda _: rep, jax.eval_shape(optimizer.init,
                                                                           params)),
                                params, lambda _: param_shardings)
    return jax.jit(optimizer.init, out_shardings=shardings)(params)


def host(tree: PyTree) -> PyTree:
    """Every array of ``tree`` (global arrays, on the mesh) whole on every process, as
    NumPy."""
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, jax.device_get(tree))

    def whole(a: jax.Array) -> np.ndarray:
        # A replicated array (the loss, embedding, head) is whole on this process's devices:
        # no collective, which every step's loss would otherwise cost.
        if a.is_fully_replicated:
            return np.asarray(a.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))

    return jax.tree.map(whole, tree)


def map_params_like(tree: PyTree, like: PyTree, fn: Callable[[PyTree], PyTree]) -> PyTree:
    """``fn`` applied to every subtree of ``tree`` structured like ``like`` (an optimizer
    state's moments), the rest kept: the optimizer state in the model's own tree."""
    structure = jax.tree.structure(like)
    return jax.tree.map(lambda t: fn(t) if jax.tree.structure(t) == structure else t, tree,
                        is_leaf=lambda t: jax.tree.structure(t) == structure)


def relative_difference(got: np.ndarray, want: np.ndarray) -> float:
    scale = float(np.max(np.abs(want)))
    diff = float(np.max(np.abs(got - want)))
    return diff / scale if scale else diff


def run_check(parts: Parts, args: argparse.Namespace, params: PyTree, ids: np.ndarray,
              targets: np.ndarray, key: jax.Array, loss: float, grads: PyTree,
              say: Callable[[str], None], rtol: float = 2e-4,
              want: tuple[float, PyTree] | None = None) -> bool:
    """Compare the pipeline's loss and gradients (model's own tree, host arrays) with the
    one-device model's (``want``: computed already); print a table and PASS or FAIL."""
    if want is None:
        device = jax.local_devices()[0]
        put = lambda a: jax.device_put(a, device)  # noqa: E731
        want_loss, want_grads = reference_value_and_grad(parts, args)(
            jax.tree.map(put, params), put(ids), put(targets), put(key))
        # On this process's device only: fetched, not gathered from the processes.
        want = float(want_loss), jax.tree.map(np.asarray, jax.device_get(want_grads))
    want_loss, want = want
    say(f"check: {args.schedule}, {args.stages} stages x {args.data} data shards vs one "
        f"device without a pipeline (float32, rtol {rtol:g})")
    loss_diff = abs(loss - float(want_loss)) / abs(float(want_loss))
    say(f"  loss  pipeline {loss:.9e}  reference {float(want_loss):.9e}  rel diff "
        f"{loss_diff:.2e}")
    diffs = {"loss": loss_diff}
    for name in ["embed", *(f"block {b}" for b in range(args.layers)), "head"]:
        part = ("blocks", int(name.split()[1])) if name.startswith("block") else (name,)
        got_t, want_t = grads, want
        for k in part:
            got_t, want_t = got_t[k], want_t[k]
        # np.max, not max: Python's keeps its first value against a later NaN.
        diffs[name] = float(np.max([relative_difference(np.asarray(g), np.asarray(w))
                                    for g, w in zip(jax.tree.leaves(got_t),
                                                    jax.tree.leaves(want_t), strict=True)]))
        say(f"  {name:>8} gradients: largest relative difference {diffs[name]:.2e}")
    worst = float(np.max(list(diffs.values())))
    ok = all(d <= rtol for d in diffs.values())  # False for NaN too
    say(f"check: {'PASS' if ok else 'FAIL'} (largest relative difference {worst:.2e})")
    return ok


def sample(model: Transformer, text: Text, args: argparse.Namespace, n: int) -> str:
    """``n`` characters from the trained model on one device (temperature 0.8), after a
    prompt from the validation text."""
    model.eval()  # dropout off
    embed, head, blocks = model.embed, model.head, list(model.blocks)

    @jax.jit
    def next_logits(ids: jax.Array) -> jax.Array:
        h = embed(ids[None])
        for block in blocks:
            h = block(h)
        return head(h)[0, -1]

    rng = np.random.default_rng(args.seed)
    ids = list(text.val[:args.seq_len])
    out = []
    for _ in range(n):
        logits = np.asarray(next_logits(jnp.asarray(ids[-args.seq_len:], jnp.int32)),
                            np.float64) / 0.8
        p = np.exp(logits - logits.max())
        ids.append(int(rng.choice(len(p), p=p / p.sum())))
        out.append(ids[-1])
    return text.decode(out)


def plot(path: str, losses: list[float], evals: list[tuple[int, float]], unigram: float
         ) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(losses) + 1), losses, lw=0.8, label="train (per step)")
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="validation")
    ax.axhline(unigram, color="grey", ls="--", label=f"unigram baseline {unigram:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / character)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------- checkpoints


class Checkpoints:
    """Orbax: the model's own tree (parameters, optimizer state), the step and the
    vocabulary; every process takes part, the first writes."""

    def __init__(self, directory: str, every: int) -> None:
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.manager = ocp.CheckpointManager(
            Path(directory).absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=every))

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def vocab(self, step: int) -> str:
        meta = self.manager.restore(step, args=self.ocp.args.Composite(
            meta=self.ocp.args.JsonRestore()))
        return meta["meta"]["vocab"]

    def save(self, step: int, state: PyTree, vocab: str, force: bool = False) -> None:
        """Save and wait until it is complete: a job killed after this resumes from here."""
        ocp = self.ocp
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave({"vocab": vocab})),
            force=force)
        self.manager.wait_until_finished()

    def restore(self, step: int, like: PyTree) -> PyTree:
        ocp = self.ocp
        return self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(like)))["state"]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


# ----------------------------------------------------------------------------- driver


def main(argv: Sequence[str] | None = None) -> int:
    """Train; print progress (process 0); check, checkpoint, plot, sample as asked."""
    args = parse_args(argv)
    processes = mpi_world_size()
    if processes is not None and processes > 1 and not jax.distributed.is_initialized():
        jax.distributed.initialize()
    is_main = jax.process_index() == 0

    def say(line: str, end: str = "\n") -> None:
        if is_main:
            print(line, end=end, flush=True)

    checkpoints = Checkpoints(args.checkpoint, args.checkpoint_every) \
        if args.checkpoint else None
    start_step = checkpoints.latest() if checkpoints else None
    text = load_text(args.text_chars,
                     checkpoints.vocab(start_step) if start_step is not None else None)
    model, parts, model_tree = make_model(len(text.vocab), args)
    mesh = make_mesh(args)
    optimizer = make_optimizer(args)
    shardings = train_shardings(mesh, parts.train_tree(model_tree))
    params = jax.device_put(parts.train_tree(model_tree), shardings)
    opt_state = init_opt_state(optimizer, params, mesh)
    value_and_grad = make_value_and_grad(parts, mesh, args)
    M, B, T = args.microbatches, args.batch, args.seq_len
    data_spec = NamedSharding(mesh, P(None, DATA))

    def microbatches(a: np.ndarray) -> jax.Array:
        a = a.reshape(M, B // M, T)
        return jax.make_array_from_callback(a.shape, data_spec, lambda index: a[index])

    base_key = jax.random.key(args.seed)
    say(f"transformer: {args.layers} blocks of width {args.width} ({args.heads} heads), "
        f"{sum(a.size for a in jax.tree.leaves(model_tree)):,} parameters, vocabulary "
        f"{len(text.vocab)}; {args.stages} stages x {args.data} data shards on "
        f"{jax.process_count()} process(es) x {jax.local_device_count()} CPU device(s)"
        + (f", the {args.process_axis} axis across them" if jax.process_count() > 1 else ""))
    say(f"schedule: {pipeline.schedule_by_name(args.schedule, args.virtual_stages).bind(args.stages, M).describe()}")  # noqa: E501
    unigram = text.unigram_loss()
    say(f"data: {len(text.train):,} train / {len(text.val):,} validation characters of the "
        f"standard library's sources; unigram baseline {unigram:.3f} nats/char")

    ok = True
    if args.check:
        ids, targets = batch_at(text.train, args.seed, 0, B, T)
        ids_m, targets_m = ids.reshape(M, B // M, T), targets.reshape(M, B // M, T)
        key = jax.random.fold_in(base_key, 0)
        loss, grads = jax.jit(value_and_grad)(params, microbatches(ids), microbatches(targets),
                                              key)
        ok = run_check(parts, args, model_tree, ids_m, targets_m, key,
                       float(host(loss)), parts.model_tree(host(grads)), say)

    step0 = 0
    if start_step is not None:
        like = {"params": model_tree,
                "opt_state": map_params_like(host(opt_state), params, parts.model_tree),
                "step": 0}
        restored = checkpoints.restore(start_step, like)
        params = jax.device_put(parts.train_tree(restored["params"]), shardings)
        opt_state = map_params_like(restored["opt_state"], model_tree, parts.train_tree)
        opt_state = jax.tree.map(lambda a, b: jax.device_put(a, b.sharding),
                                 opt_state, init_opt_state(optimizer, params, mesh))
        step0 = int(restored["step"])
        say(f"checkpoint: resumed from step {step0} in {args.checkpoint}")

    def save(step: int, force: bool = False) -> None:
        host_params = host(params)
        state = {"params": parts.model_tree(host_params),
                 "opt_state": map_params_like(host(opt_state), params, parts.model_tree),
                 "step": step}
        checkpoints.save(step, state, text.vocab, force=force)
        say(f"checkpoint: step {step} saved in {args.checkpoint}")

    train_step = make_train_step(
        make_value_and_grad(parts, mesh, args, with_norm=True), optimizer,
        (shardings, jax.tree.map(lambda a: a.sharding, opt_state), NamedSharding(mesh, P())),
        args.seed)
    # The validation loss without dropout (no key); the pipeline forms gradients too.
    evaluate = jax.jit(lambda p, ids, t: value_and_grad(p, ids, t, None)[0])
    losses: list[float] = []
    evals: list[tuple[int, float]] = []
    tokens = B * T
    timed, counted = 0.0, 0
    recording = contextlib.ExitStack()
    for i in range(step0, args.steps):
        if i == step0 + 1 and args.trace:  # after the compiling step
            recording.enter_context(jax_cpu_mpi.trace(args.trace))
        ids, targets = batch_at(text.train, args.seed, i, B, T)
        start = time.perf_counter()
        params, opt_state, loss = train_step(params, opt_state, microbatches(ids),
                                             microbatches(targets), i)
        loss = float(host(loss))
        seconds = time.perf_counter() - start
        if i > step0:
            timed, counted = timed + seconds, counted + 1
        losses.append(loss)
        line = (f"step {i + 1:>5}/{args.steps} {progress_bar(i + 1, args.steps)} "
                f"loss {loss:.4f}  {tokens / seconds:>8.0f} tokens/s"
                + (" (includes compilation)" if i == step0 else ""))
        if args.eval_every and ((i + 1) % args.eval_every == 0 or i + 1 == args.steps):
            # The same validation batches every time.
            val = np.mean([float(host(evaluate(params, *map(microbatches, batch_at(
                text.val, args.seed, 10**6 + j, B, T))))) for j in range(args.eval_batches)])
            evals.append((i + 1, float(val)))
            line += f"  val {val:.4f}"
        say(line)
        if checkpoints is not None and (i + 1) % args.checkpoint_every == 0:
            save(i + 1)
    recording.close()
    if args.trace and counted:
        say(f"trace: steps {step0 + 2}..{args.steps} recorded into {args.trace}")
    if counted:
        say(f"throughput: {tokens * counted / timed:.0f} tokens/s (steps after the first "
            f"of this run, {counted} of them)")
    if evals:
        say(f"validation: {evals[-1][1]:.3f} nats/char after {evals[-1][0]} steps "
            f"(unigram baseline {unigram:.3f})")
    if checkpoints is not None:
        if args.steps > step0 and args.steps % args.checkpoint_every:
            save(args.steps, force=True)
        checkpoints.close()
    final = parts.model_tree(host(params))
    if args.plot and is_main:
        plot(args.plot, losses, evals, unigram)
        say(f"plot: {args.plot}")
    if args.sample:
        nnx.update(model, final)
        generated = sample(model, text, args, args.sample)
        say("sample:\n" + generated)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
