"""psend/precv programs built from a given (psend, precv) pair, to compare APIs.

Each builder takes the two functions (``jax.lax``'s or ``jax_cpu_mpi``'s) and returns a
jitted ``shard_map`` program over 4 devices and its input, so that the same program can be
built with JAX's functions and with ours and compared: results, lowered CPU StableHLO, and
the GPU lowering from ``jax.export`` (``platforms=["cuda"]``), which needs no GPU.

Run as a script, it prints one JSON object ``{program: {platform: {"ops": [...], "module":
text}}}`` of the GPU exports with ``jax_cpu_mpi``'s functions (tests/ops/test_without_jax_p2p.py
runs it with JAX's psend/precv removed, and compares with JAX's lowering in the parent).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from typing import Any

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

Builder = Callable[[Callable, Callable], tuple[Callable, tuple]]
GPU_PLATFORMS = ("cuda", "rocm")
CHAIN = [(0, 1), (1, 2), (2, 3)]


def _mesh(shape=(4,), names=("x",)) -> jax.sharding.Mesh:
    count = int(np.prod(shape))
    return jax.make_mesh(shape, names, devices=jax.devices()[:count])


def _put(mesh, spec, value):
    return jax.device_put(value, NamedSharding(mesh, spec))


def _like(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def chain(psend, precv):
    """psend then precv along an open chain: equals ppermute."""
    mesh = _mesh()

    def step(x):
        return precv(psend(x, "x", CHAIN), _like(x), "x", CHAIN)

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    return f, (_put(mesh, P("x"), np.arange(16.0, dtype=np.float32).reshape(8, 2)),)


def two_messages(psend, precv):
    """Two messages between the same pair, a reply, int32 and bf16 payloads."""
    mesh = _mesh()
    back = [(1, 0), (3, 2)]

    def step(x, y):
        a = precv(psend(x, "x", CHAIN), _like(x), "x", CHAIN)
        t2 = psend(y.astype(jnp.bfloat16) + a[:, :1].astype(jnp.bfloat16), "x", CHAIN)
        b = precv(t2, jax.ShapeDtypeStruct(y.shape, jnp.bfloat16), "x", CHAIN)
        reply = precv(psend(a * 2, "x", back), _like(a), "x", back)
        return a + reply, b.astype(jnp.float32)

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("x"), P("x")),
                              out_specs=(P("x"), P("x"))))
    x = _put(mesh, P("x"), np.arange(8, dtype=np.int32).reshape(4, 2) + 1)
    y = _put(mesh, P("x"), np.linspace(1, 2, 12, dtype=np.float32).reshape(4, 3))
    return f, (x, y)


def scan_loop(psend, precv):
    """psend/precv in a scan body (the carry needs pcast, as on GPU)."""
    mesh = _mesh()

    def step(x):
        def body(c, _):
            y = precv(psend(c, "x", CHAIN), _like(c), "x", CHAIN)
            return jax.lax.pcast(y, "x", to="varying") + 1, None

        return jax.lax.scan(body, x, None, length=3)[0]

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    return f, (_put(mesh, P("x"), np.arange(8.0, dtype=np.float32)),)


def two_axes(psend, precv):
    """A 2x2 mesh: a send over 'y' within each 'x' row, one over ('x', 'y')."""
    mesh = _mesh((2, 2), ("x", "y"))

    def step(v):
        a = precv(psend(v, "y", [(0, 1)]), _like(v), "y", [(0, 1)])
        both = [(0, 3), (3, 1)]
        b = precv(psend(v, ("x", "y"), both), _like(v), ("x", "y"), both)
        return a + 10 * b

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P(("x", "y")),
                              out_specs=P(("x", "y"))))
    return f, (_put(mesh, P(("x", "y")), np.arange(8.0, dtype=np.float32)),)


def pytree(psend, precv):
    """psend of a dict (a dict of tokens), one precv per leaf."""
    mesh = _mesh()

    def step(a, b):
        tokens = psend({"a": a, "b": b}, "x", CHAIN)
        return (precv(tokens["a"], _like(a), "x", CHAIN),
                precv(tokens["b"], _like(b), "x", CHAIN))

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("x"), P("x")),
                              out_specs=(P("x"), P("x"))))
    return f, (_put(mesh, P("x"), np.arange(8.0, dtype=np.float32)),
               _put(mesh, P("x"), np.arange(4, dtype=np.int32) - 7))


def barrier_pipeline(psend, precv):
    """optimization_barrier over a psend's token and an array, then the precv, then a
    ppermute (no collective between a psend and its precv, as XLA GPU demands)."""
    mesh = _mesh()

    def step(x):
        token = psend(x, "x", CHAIN)
        x2, token = jax.lax.optimization_barrier((x * 2, token))
        y = precv(token, _like(x), "x", CHAIN)
        return jax.lax.ppermute(y, "x", [(3, 0)]) + x2

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    return f, (_put(mesh, P("x"), np.arange(8.0, dtype=np.float32)),)


PROGRAMS: dict[str, Builder] = {
    "chain": chain,
    "two_messages": two_messages,
    "scan_loop": scan_loop,
    "two_axes": two_axes,
    "pytree": pytree,
    "barrier_pipeline": barrier_pipeline,
}

#: Programs with a psend of a pytree: ``jax_cpu_mpi.psend`` runs its leaves' sends in order
#: (optimization barriers between them, ops/p2p.py) and ``jax.lax.psend`` does not, so their
#: jaxprs and module texts differ by those barriers; their send/recv ops and results do not.
ORDERED_LEAVES = {"pytree"}

#: Programs that XLA GPU's deadlock check rejects (two psends of one pytree in flight with the
#: same pairs): their CPU lowering needs ``gpu_parity=False``; they still export for GPU.
PARITY_OFF = {"pytree"}

_LOC = re.compile(r"\s*loc\([^\n]*$")


def module_text(module: Any) -> str:
    """A lowered module's text without debug locations (they name the caller's lines)."""
    from jax._src.interpreters import mlir

    return mlir.module_to_string(module, enable_debug_info=False)


def send_recv_ops(text: str) -> list[str]:
    """The ``stablehlo.send`` / ``stablehlo.recv`` ops of a module text, in order, with
    their pairs, channel handles, operand and result types (SSA names dropped)."""
    ops = []
    for line in text.splitlines():
        if '"stablehlo.send"' in line or '"stablehlo.recv"' in line:
            body = line.split("=", 1)[1] if line.lstrip().startswith("%") else line
            ops.append(re.sub(r"%[\w#:]+", "%", _LOC.sub("", body)).strip())
    return ops


def gpu_export(f: Callable, args: tuple, platform: str) -> dict[str, Any]:
    """The send/recv ops and the module text (no locations) of ``f`` exported for
    ``platform``; ``{"error": ...}`` where JAX's lowering fails (jax 0.10's GPU lowering of
    an optimization_barrier over tokens does: ours must fail alike)."""
    try:
        exported = jax.export.export(f, platforms=[platform])(*args)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}".split("\n")[0]}
    from jax._src.lib.mlir import ir

    with jax._src.interpreters.mlir.make_ir_context():  # type: ignore[attr-defined]
        module = ir.Module.parse(exported.mlir_module())
        text = module.operation.get_asm(enable_debug_info=False)
    return {"ops": send_recv_ops(text), "module": text}


def gpu_exports(psend, precv) -> dict[str, dict[str, Any]]:
    """``{program: {platform: export}}`` for every program of :data:`PROGRAMS`."""
    out = {}
    for name, build in PROGRAMS.items():
        f, args = build(psend, precv)
        out[name] = {p: gpu_export(f, args, p) for p in GPU_PLATFORMS}
    return out


if __name__ == "__main__":
    import jax_cpu_mpi

    print("JCM-EXPORTS " + json.dumps({
        "in_use": jax_cpu_mpi._src.ops.primitives.in_use(),
        "exports": gpu_exports(jax_cpu_mpi.psend, jax_cpu_mpi.precv)}))
    sys.stdout.flush()
