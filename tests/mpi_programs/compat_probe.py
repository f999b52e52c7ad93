"""One private JAX name goes missing; does JAX still work, and what does jax_cpu_mpi report?

``python compat_probe.py HOW PATH`` (tests/compat/test_compat.py runs it in a fresh interpreter
with 4 virtual CPU devices), PATH as in jax_cpu_mpi._src.compat (``module:attribute`` or a
module), HOW one of

* ``none``: remove nothing (the baseline);
* ``delete``: delete the attribute from JAX's module (as a JAX release that dropped it);
* ``hide``: hide it from jax_cpu_mpi's lookup only, for names JAX itself needs to run a
  jitted program (as a release that moved them: JAX uses the new place, we look in the
  old one). A module is hidden by making its import fail;
* ``change``: replace a function by one with another signature;
* ``break-parity`` / ``break-barrier``: make the GPU-parity check / the token barrier fail
  while a program is lowered (a changed internal seen only at run time);
* ``drop-rule``: PATH names a primitive; remove JAX's lowering rule for it (as a release
  that moved the rule elsewhere);
* ``make-high``: as ``drop-rule``, and give the primitive a ``to_lojax`` of its own (as jax
  0.12.1 did to ``unreduced_reduce_scatter``: rewritten into other primitives before
  lowering, with no rule of its own).

Then, without importing jax_cpu_mpi by hand (JAX's plugin discovery does): ``jax.devices()``,
a jitted program, a shard_map with psum, a psend/precv program, a barrier over a token,
``jax_cpu_mpi.features()``, and ``python -m jax_cpu_mpi info --json`` (run in this process
with runpy, so that the name is missing there too). Prints ``PROBE <json>``.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import runpy
import sys
import types
import warnings

how, path = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "-"

import jax  # noqa: E402  (importing jax does not start its backends or load plugins)

assert "jax_cpu_mpi" not in sys.modules


class _Hiding(types.ModuleType):
    """``module`` without ``hidden`` for whoever looks it up in sys.modules."""

    def __init__(self, module: types.ModuleType, hidden: str) -> None:
        super().__init__(module.__name__, module.__doc__)
        object.__setattr__(self, "_real", module)
        object.__setattr__(self, "_hidden", hidden)

    def __getattr__(self, name: str):
        if name == self._hidden:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        return getattr(self._real, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._real, name, value)


module_name, _, attr = path.partition(":")
if how == "delete":
    delattr(importlib.import_module(module_name), attr)
elif how == "hide" and attr:
    sys.modules[module_name] = _Hiding(importlib.import_module(module_name), attr)
elif how == "hide":
    sys.modules[module_name] = None  # type: ignore[assignment]  # import fails
elif how == "change":
    module = importlib.import_module(module_name)
    original = getattr(module, attr)

    def changed(ctx, *, axis_names, permutation, name):  # renamed parameters
        return original(ctx, axis_name=axis_names, perm=permutation, op_name=name)

    setattr(module, attr, changed)
elif how in ("drop-rule", "make-high"):
    from jax._src.interpreters import mlir as _mlir

    primitive = getattr(importlib.import_module(module_name), attr)
    _mlir._lowerings.pop(primitive, None)  # jax 0.12.1 has none for some
    if how == "make-high":
        primitive.to_lojax = lambda hi_val, **params: hi_val
elif how not in ("none", "break-parity", "break-barrier"):
    raise SystemExit(f"unknown HOW {how!r}")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

facts: dict = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    facts["devices"] = len(jax.devices())  # JAX's plugin discovery imports jax_cpu_mpi here
facts["loaded_by_jax"] = "jax_cpu_mpi" in sys.modules

import jax_cpu_mpi  # noqa: E402
from jax_cpu_mpi._src.lowering import barrier_tokens as _barrier_tokens  # noqa: E402
from jax_cpu_mpi._src.parity import check as validation  # noqa: E402

if how == "break-parity":
    def broken(*args, **kwargs):
        raise TypeError("simulated: a JAX internal the check reads changed")

    validation.collect_events = broken
elif how == "break-barrier":
    def broken_order(*args, **kwargs):
        raise AttributeError("simulated: a JAX internal the barrier uses changed")

    _barrier_tokens._ordered = broken_order

x = np.arange(8.0, dtype=np.float32)
facts["jit_ok"] = bool(np.allclose(jax.jit(lambda v: jnp.sin(v) * 2 + v.sum())(x),
                                   np.sin(x) * 2 + x.sum()))
mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
xs = jax.device_put(x, NamedSharding(mesh, P("x")))
psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"),
                             out_specs=P()))
facts["shard_map_psum_ok"] = bool(np.allclose(psum(xs), x.reshape(4, 2).sum(0)))

perm = [(0, 1), (1, 2), (2, 3)]
facts["p2p_reference"] = [0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # ppermute of arange(8)


def _p2p(v):
    token = jax.lax.psend(v, "x", perm)
    return jax.lax.precv(token, jax.ShapeDtypeStruct(v.shape, v.dtype), "x", perm)


def _outcome(fn) -> dict:
    with warnings.catch_warnings(record=True) as more:
        warnings.simplefilter("always")
        try:
            return fn()
        except Exception as e:
            return {"error_type": type(e).__name__, "error": str(e)[:2000]}
        finally:
            caught.extend(more)


facts["p2p"] = _outcome(lambda: {"result": np.asarray(jax.jit(jax.shard_map(
    _p2p, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(xs)).tolist()})


def _barrier(v):
    token = jax.lax.psend(v, "x", perm)
    v, token = jax.lax.optimization_barrier((v, token))
    return v + jax.lax.precv(token, jax.ShapeDtypeStruct(v.shape, v.dtype), "x", perm)


facts["barrier"] = _outcome(lambda: {"hlo": jax.jit(jax.shard_map(
    _barrier, mesh=mesh, in_specs=P("x"), out_specs=P("x"))).lower(xs).as_text()})

# The CPU lowering rules jax_cpu_mpi's collectives registered (all of them or none).
from jax._src.interpreters import mlir as _mlir  # noqa: E402

facts["cpu_mpi_rules"] = sorted(
    p.name for p, entry in _mlir._platform_specific_lowerings.get("cpu", {}).items()
    if getattr(getattr(entry, "rule", entry), "__name__", "").endswith("_lowering_cpu_mpi"))

facts["features"] = jax_cpu_mpi.features()
facts["states"] = {f["feature"]: f["state"] for f in facts["features"]}

out = io.StringIO()
sys.argv = ["jax_cpu_mpi", "info", "--json"]
with contextlib.redirect_stdout(out):
    try:
        runpy.run_module("jax_cpu_mpi", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        facts["info_exit"] = e.code
info = json.loads(out.getvalue().strip().splitlines()[-1])
(report,) = info["processes"]
facts["info_features"] = report["activation"]["features"]
facts["info_lowerings"] = report["activation"]["lowerings"]

facts["compat_warnings"] = [str(w.message) for w in caught
                            if issubclass(w.category, jax_cpu_mpi.JaxCompatWarning)]
print("PROBE " + json.dumps(facts))
