"""``jax_cpu_mpi.psend`` / ``precv``: JAX's API without JAX's deprecation.

While JAX has ``psend_p``/``precv_p``, ours bind them: the same equations, results and
lowered StableHLO as ``jax.lax.psend``/``precv``, mixed freely in one program, and no
``DeprecationWarning``. The GPU lowering is checked without a GPU through
``jax.export.export(..., platforms=["cuda"/"rocm"])``. The same file also runs with JAX's
psend/precv removed (tests/ops/test_without_jax_p2p.py), where the comparisons with JAX's
functions skip and the rest checks our own primitives.
"""

from __future__ import annotations

import json
import os
import subprocess
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import p2p_programs as programs
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax_p2p_removal import python_prefix

import jax_cpu_mpi
from conftest import make_mesh, needs_jax_p2p
from jax_cpu_mpi import config
from jax_cpu_mpi._src.cli import info
from jax_cpu_mpi._src.compat import parallel, single_side_collective_effect
from jax_cpu_mpi._src.ops import primitives

CHAIN = [(0, 1), (1, 2), (2, 3)]


def jax_functions():
    """JAX's (deprecated) functions, without letting their warning reach the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return jax.lax.psend, jax.lax.precv


def ours():
    return jax_cpu_mpi.psend, jax_cpu_mpi.precv


def leaves_equal(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _parity(name: str):
    return config.overrides(gpu_parity=name not in programs.PARITY_OFF)


# ----------------------------------------------------------------- while JAX has its own


@needs_jax_p2p
def test_ours_are_jax_primitives():
    assert primitives.psend_p is parallel.psend_p
    assert primitives.precv_p is parallel.precv_p
    assert not primitives.OURS
    assert primitives.in_use()["primitives"] == "jax"


@needs_jax_p2p
@pytest.mark.parametrize("name", sorted(programs.PROGRAMS))
def test_same_jaxpr_results_and_cpu_stablehlo_as_jax(name):
    build = programs.PROGRAMS[name]
    f_ours, args = build(*ours())
    f_jax, _ = build(*jax_functions())
    jaxpr_ours, jaxpr_jax = str(jax.make_jaxpr(f_ours)(*args)), str(jax.make_jaxpr(f_jax)(*args))
    with _parity(name):
        if name in programs.ORDERED_LEAVES:  # ours orders the leaves' sends, JAX's does not
            assert "optimization_barrier" in jaxpr_ours
            assert "optimization_barrier" not in jaxpr_jax
        else:
            assert jaxpr_ours == jaxpr_jax
            assert f_ours.lower(*args).as_text() == f_jax.lower(*args).as_text()
        leaves_equal(f_ours(*args), f_jax(*args))


@needs_jax_p2p
@pytest.mark.parametrize("name", sorted(programs.PROGRAMS))
def test_gpu_export_same_send_recv_as_jax(name):
    build = programs.PROGRAMS[name]
    f_ours, args = build(*ours())
    f_jax, _ = build(*jax_functions())
    for platform in programs.GPU_PLATFORMS:
        mine = programs.gpu_export(f_ours, args, platform)
        theirs = programs.gpu_export(f_jax, args, platform)
        if name in programs.ORDERED_LEAVES:  # the same sends and receives, and barriers
            assert "ops" in theirs and mine.get("ops") == theirs["ops"], mine
        else:
            assert mine == theirs
        if name != "barrier_pipeline" or jax.__version_info__ >= (0, 11):
            assert mine["ops"], f"no stablehlo.send/recv in the {platform} export of {name}"


@needs_jax_p2p
def test_one_program_mixes_jax_and_ours():
    """A token of jax.lax.psend feeds jax_cpu_mpi.precv and the other way round."""
    mesh = make_mesh((4, "x"))
    jax_psend, jax_precv = jax_functions()
    back = [(3, 2), (2, 1), (1, 0)]

    def step(x):
        like = jax.ShapeDtypeStruct(x.shape, x.dtype)
        a = jax_cpu_mpi.precv(jax_psend(x, "x", CHAIN), like, "x", CHAIN)
        b = jax_precv(jax_cpu_mpi.psend(x, "x", back), like, "x", back)
        return a + 10 * b

    def ref(x):
        return jax.lax.ppermute(x, "x", CHAIN) + 10 * jax.lax.ppermute(x, "x", back)

    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
    run = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"),  # noqa: E731
                                           out_specs=P("x")))(x)
    np.testing.assert_array_equal(run(step), run(ref))


def test_no_deprecation_warning_from_ours():
    mesh = make_mesh((4, "x"))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f, args = programs.chain(*ours())
        f.lower(*args)
        np.asarray(f(x))
        jax_cpu_mpi.psend  # noqa: B018  (attribute access is what warns in jax.lax)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert deprecations == [], [str(w.message) for w in deprecations]


@needs_jax_p2p
@pytest.mark.skipif(jax.__version_info__ < (0, 12), reason="JAX deprecates psend in 0.12")
def test_jax_lax_psend_does_warn():
    """The warning the test above checks for exists (so that test can fail)."""
    # JAX warns once per process (its module __getattr__ is functools.cache'd): forget that.
    getattr(jax.lax.__getattr__, "cache_clear", lambda: None)()
    with pytest.warns(DeprecationWarning, match="jax.lax.psend is deprecated"):
        jax.lax.psend  # noqa: B018


# ------------------------------------------------------------------- in every mode


def test_chain_equals_ppermute():
    f, (x,) = programs.chain(*ours())
    mesh = x.sharding.mesh
    ref = jax.jit(jax.shard_map(lambda v: jax.lax.ppermute(v, "x", CHAIN), mesh=mesh,
                                in_specs=P("x"), out_specs=P("x")))
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(ref(x)))


def test_equations_have_jax_params_and_effects():
    f, args = programs.chain(*ours())
    inner = jax.make_jaxpr(f)(*args).eqns[0].params["jaxpr"].eqns[0].params["jaxpr"]
    eqns = {e.primitive.name: e for e in inner.eqns if e.primitive.name in ("psend", "precv")}
    assert set(eqns) == {"psend", "precv"}
    for eqn in eqns.values():
        assert eqn.params["axis_name"] == ("x",)
        assert eqn.params["perm"] == tuple(CHAIN)
        assert single_side_collective_effect in eqn.effects
    assert eqns["precv"].params["out_shape"] == jax.core.ShapedArray((2, 2), jnp.float32)
    assert eqns["psend"].primitive is primitives.psend_p
    assert eqns["precv"].primitive is primitives.precv_p


def test_pytree_out_shape_and_token_tree():
    mesh = make_mesh((4, "x"))

    def step(a, b):
        tokens = jax_cpu_mpi.psend({"a": a, "b": b}, "x", CHAIN)
        shapes = {"a": jax.ShapeDtypeStruct(a.shape, a.dtype),
                  "b": jax.ShapeDtypeStruct(b.shape, b.dtype)}
        return jax_cpu_mpi.precv(tokens, shapes, "x", CHAIN)

    def ref(a, b):
        return {"a": jax.lax.ppermute(a, "x", CHAIN), "b": jax.lax.ppermute(b, "x", CHAIN)}

    a = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
    b = jax.device_put(jnp.arange(4, dtype=jnp.int32), NamedSharding(mesh, P("x")))
    run = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("x"), P("x")),  # noqa: E731
                                           out_specs=P("x")))(a, b)
    with config.overrides(gpu_parity=False):  # two psends with the same pairs in flight
        leaves_equal(run(step), run(ref))


def test_precv_rejects_a_token_tree_of_another_shape():
    mesh = make_mesh((4, "x"))

    def step(a):
        tokens = jax_cpu_mpi.psend((a, a, a), "x", CHAIN)
        like = jax.ShapeDtypeStruct(a.shape, a.dtype)
        return jax_cpu_mpi.precv(tokens, (like, like), "x", CHAIN)[0]

    a = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
    with pytest.raises(ValueError, match="precv: token must be one token or a pytree"):
        jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(a)


def test_name_error_outside_shard_map():
    with pytest.raises(NameError, match=r"unbound axis name: x\. To fix this, please call psend"):
        jax.jit(lambda v: jax_cpu_mpi.psend(v, "x", CHAIN)).lower(jnp.zeros(2))


def test_parity_error_locates_the_users_line():
    """The op is located at the caller's line, not inside jax_cpu_mpi (as jax.lax.psend)."""
    mesh = make_mesh((2, "x"))

    def cycle(v):
        return jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", [(0, 1), (1, 0)]),
                                 jax.ShapeDtypeStruct(v.shape, v.dtype), "x", [(0, 1), (1, 0)])

    f = jax.jit(jax.shard_map(cycle, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    with pytest.raises(jax_cpu_mpi.GpuParityError) as err:
        f.lower(jax.device_put(jnp.zeros(4), NamedSharding(mesh, P("x"))))
    assert f"{os.path.basename(__file__)}:" in str(err.value)
    assert "jax_cpu_mpi/p2p.py" not in str(err.value)


def test_info_says_whose_primitives():
    report = info.local_report()
    assert report["activation"]["primitives"] == primitives.in_use()
    text = info.format_process(report)
    want = "jax_cpu_mpi's own psend/precv" if primitives.OURS else "JAX's psend_p/precv_p"
    assert f"primitives:    {want}" in text


# ------------------------------------------------- JAX_CPU_MPI_PRIMITIVES=ours (forced)

_FORCED = """
import json, os, warnings
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jax_cpu_mpi
from jax_cpu_mpi._src.ops import primitives
from jax_cpu_mpi._src.compat import parallel
mesh = jax.make_mesh((4,), ("x",))
perm = [(0, 1), (1, 2), (2, 3)]
x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
def program(psend, precv):
    step = lambda v: precv(psend(v, "x", perm), jax.ShapeDtypeStruct(v.shape, v.dtype), "x", perm)
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
out = {"in_use": primitives.in_use(),
       "distinct": primitives.psend_p is not getattr(parallel, "psend_p", None),
       "ours": np.asarray(program(jax_cpu_mpi.psend, jax_cpu_mpi.precv)(x)).tolist()}
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        program(jax.lax.psend, jax.lax.precv)(x)
        out["jax"] = "ran"
    except NotImplementedError as e:
        out["jax"] = str(e)
print("JCM-FORCED " + json.dumps(out))
"""


@needs_jax_p2p
@pytest.mark.timeout(120)
def test_forced_ours_mode_behaves_as_after_the_removal():
    env = dict(os.environ, JAX_CPU_MPI_PRIMITIVES="ours",
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run([*python_prefix(), "-c", _FORCED], capture_output=True, text=True,
                          env=env, timeout=110)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("JCM-FORCED ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    out = json.loads(lines[0].split(" ", 1)[1])
    assert out["in_use"]["primitives"] == "jax_cpu_mpi", out
    assert out["in_use"]["reason"] == "JAX_CPU_MPI_PRIMITIVES=ours"
    assert out["distinct"]
    assert out["ours"] == [0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    # A leftover jax.lax.psend fails on CPU, as it will once JAX drops it: found now.
    assert "only implemented on GPU" in out["jax"], out


def test_bad_primitives_mode_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(primitives.MODE_ENV, "jax-please")
    with pytest.raises(ValueError, match=r"JAX_CPU_MPI_PRIMITIVES='jax-please' is not one of "
                       r"'auto', 'ours': set auto"):
        primitives.requested_mode()
