"""The transformer benchmark's compute alone: one device, no pipeline, JAX against torch.

The forward and backward of one microbatch through the benchmark's model (the example's
embedding, ``--layers`` blocks, head and cross entropy; torch: ``torch_bench.py``'s same
model), jitted on one CPU device for JAX, eager for torch; no optimizer, no pipeline, no
communication. Each side runs in its own process, one after the other, round by round::

    python benchmarks/transformer/compute.py --torch-python .venv-torch/bin/python

Parts timed (``--parts``): ``model`` (loss and all gradients, one microbatch), ``block``
(one block's forward and backward: what a 1x4 stage does per microbatch with its residuals
kept), ``block-remat`` (the forward, then the backward computing the forward again: what
it does by default). Threads: JAX with XLA's defaults (an intra-op pool of the machine's
cores) and with one thread (``--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1``); torch with ``torch.set_num_threads`` 1 (what each of the
pipeline benchmark's 4 processes uses on 2 cores) and the machine's cores. Prints
milliseconds per call (median over ``--reps`` calls, median over rounds) and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SINGLE = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])


def timed(fn, reps: int) -> float:
    """The median call's CPU seconds (this process's, all its threads): on a loaded machine
    what a call costs, where wall time is how long it waited for a core."""
    for _ in range(3):
        fn()
    out = []
    for _ in range(reps):
        t = time.process_time()
        fn()
        out.append(time.process_time() - t)
    return median(out)


def run_jax(a: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jax_cpu_mpi.examples import transformer as ex

    args = ex.parse_args(["--stages", "1", "--data", "1", "--layers", str(a.layers),
                          "--width", str(a.width), "--heads", str(a.heads),
                          "--seq-len", str(a.seq_len), "--batch", str(a.micro),
                          "--microbatches", "1", "--dropout", str(a.dropout)])
    model, _, _ = ex.make_model(96, args)
    rng = jax.random.key(1)
    ids = jax.random.randint(rng, (a.micro, a.seq_len), 0, 96)
    targets = jax.random.randint(jax.random.fold_in(rng, 1), (a.micro, a.seq_len), 0, 96)
    key = jax.random.key(2)
    graphdef, state = nnx.split(model)
    out = {}

    if "model" in a.parts:
        def loss_fn(state, ids, targets, key):
            m = nnx.merge(graphdef, state)
            h = m.embed(ids)
            for i, b in enumerate(m.blocks):
                h = b(h, rngs=nnx.Rngs(dropout=jax.random.fold_in(key, i)))
            return ex.cross_entropy(m.head(h), targets)
        f = jax.jit(jax.value_and_grad(loss_fn))
        out["model"] = timed(lambda: jax.block_until_ready(f(state, ids, targets, key)),
                             a.reps)

    block = model.blocks[0]
    bdef, bstate = nnx.split(block)
    x = jax.random.normal(rng, (a.micro, a.seq_len, a.width), jnp.float32)
    g = jax.random.normal(key, x.shape, jnp.float32)

    def apply(s, x, key):
        return nnx.merge(bdef, s)(x, rngs=nnx.Rngs(dropout=key))

    if "block" in a.parts:
        def fb(s, x, g, key):
            y, vjp = jax.vjp(lambda s, x: apply(s, x, key), s, x)
            return y, vjp(g)
        f = jax.jit(fb)
        out["block"] = timed(lambda: jax.block_until_ready(f(bstate, x, g, key)), a.reps)
    if "block-remat" in a.parts:
        fwd = jax.jit(apply)

        def bwd(s, x, g, key):
            return jax.vjp(lambda s, x: apply(s, x, key), s, x)[1](g)
        bwd = jax.jit(bwd)
        out["block-remat"] = timed(lambda: jax.block_until_ready(
            (fwd(bstate, x, key), bwd(bstate, x, g, key))), a.reps)
    return out


def run_torch(a: argparse.Namespace) -> dict:
    import torch

    sys.path.insert(0, str(HERE))
    import torch_bench as tb

    torch.set_num_threads(a.threads)
    ns = argparse.Namespace(seed=0, vocab=96, width=a.width, seq_len=a.seq_len,
                            layers=a.layers, heads=a.heads, dropout=a.dropout, stages=1,
                            virtual_stages=1)
    (chunk,) = tb.make_model(ns)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (a.micro, a.seq_len), generator=gen)
    targets = torch.randint(0, 96, (a.micro, a.seq_len), generator=gen)
    out = {}
    if "model" in a.parts:
        def step():
            chunk.zero_grad(set_to_none=False)
            tb.cross_entropy(chunk(ids), targets).backward()
        out["model"] = timed(step, a.reps)
    block = chunk.blocks[0]
    x = torch.randn(a.micro, a.seq_len, a.width, requires_grad=True)
    g = torch.randn(a.micro, a.seq_len, a.width)
    if "block" in a.parts:
        def fb():
            block.zero_grad(set_to_none=False)
            block(x).backward(g)
        out["block"] = timed(fb, a.reps)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/transformer/compute.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro", type=int, default=8,
                   help="sequences per microbatch (8: the benchmark's 32 in 4)")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--parts", default="model,block,block-remat")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--torch-python", default=os.environ.get("TORCH_PYTHON", ""))
    p.add_argument("--xla-flags", default="", help="extra XLA_FLAGS for every JAX launch")
    p.add_argument("--out", default=None, help="also write the table into OUT/compute.md")
    p.add_argument("--note", default="", help="a line for the notes (e.g. machine shared)")
    p.add_argument("--side", choices=["jax", "torch"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.side:
        print(json.dumps(run_jax(a) if a.side == "jax" else run_torch(a)))
        return 0
    own = [x for i, x in enumerate(sys.argv[1:]) if x not in ("--out", "--note")
           and sys.argv[i] not in ("--out", "--note")]
    cores = os.cpu_count() or 1
    launches = [("jax, XLA default threads", sys.executable, "jax", 1, a.xla_flags),
                ("jax, 1 thread", sys.executable, "jax", 1, f"{a.xla_flags} {SINGLE}")]
    if a.torch_python:
        launches += [("torch, 1 thread", a.torch_python, "torch", 1, ""),
                     (f"torch, {cores} threads", a.torch_python, "torch", cores, "")]
    results: dict[str, list[dict]] = {name: [] for name, *_ in launches}
    for _ in range(a.rounds):
        for name, python, side, threads, flags in launches:
            env = dict(os.environ, XLA_FLAGS=flags.strip())
            r = subprocess.run([python, __file__, *own, "--side", side, "--threads",
                                str(threads)], env=env, capture_output=True, text=True,
                               check=False)
            if r.returncode:
                print(r.stderr[-3000:], file=sys.stderr)
                return 1
            results[name].append(json.loads(r.stdout.strip().splitlines()[-1]))
    parts = a.parts.split(",")
    lines = [f"CPU ms per call (median of {a.reps} calls, median of {a.rounds} rounds); "
             f"microbatch {a.micro} x {a.seq_len}, width {a.width}, {a.heads} heads, "
             f"{a.layers} blocks, dropout {a.dropout}; {cores} cores", "",
             "| launch | " + " | ".join(parts) + " |",
             "| --- |" + " ---: |" * len(parts)]
    for name, rs in results.items():
        cells = [f"{median([r[p] for r in rs]) * 1e3:.2f}" if p in rs[0] else "-"
                 for p in parts]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        notes = ["command: python benchmarks/transformer/compute.py " +
                 shlex.join(sys.argv[1:]), *([a.note] if a.note else [])]
        (out / "compute.md").write_text(
            "# The transformer's compute alone (one device, no pipeline)\n\n" +
            "\n".join(lines) + "\n\n## Notes\n\n" + "".join(f"- {n}\n" for n in notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
