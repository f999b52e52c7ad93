"""Compile time of each schedule's training step (jit lower + compile), one process, 4
devices, P = 4, the memory test's sizes (width 64, batch 32): run with the executor to
compare on PYTHONPATH. Prints one JSON line."""

import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax
import jax.numpy as jnp

import jax_cpu_mpi  # noqa: F401
from jax_cpu_mpi import pipeline as pl


def stage(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def loss(y, t):
    return jnp.mean((y - t) ** 2)


P = 4
mesh = jax.make_mesh((P,), ("stage",))
out = {"file": pl.__file__}
for M in (int(m) for m in sys.argv[1:] or ["5", "16"]):
    for schedule in (pl.GPipe(), pl.OneFOneB(), pl.Interleaved1F1B(2), pl.ZeroBubble()):
        lead = (P, 2) if schedule.virtual_stages > 1 else (P,)
        params = {"w": jax.ShapeDtypeStruct((*lead, 64, 64), jnp.float32),
                  "b": jax.ShapeDtypeStruct((*lead, 64), jnp.float32)}
        xs = jax.ShapeDtypeStruct((M, 32, 64), jnp.float32)
        f = jax.jit(pl.shard_value_and_grad(stage, loss, mesh, schedule))
        start = time.perf_counter()
        compiled = f.lower(params, xs, xs).compile()
        out[f"{schedule.name} M={M}"] = round(time.perf_counter() - start, 2)
        out[f"{schedule.name} M={M} temp"] = compiled.memory_analysis().temp_size_in_bytes
print(json.dumps(out))
