"""jax.vmap from OUTSIDE a shard_map with reduced/unreduced specs (issue 28).

The scenarios live in tests/mpi_programs/outer_vmap_cases.py and run here on 4 (and 8)
virtual CPU devices of this process, and under ``mpirun -n 2`` (two devices per rank).
"""

from __future__ import annotations

import jax
import numpy as np
import outer_vmap_cases as cases
import pytest
from jax.sharding import PartitionSpec as P

from jax_cpu_mpi import batching
from jax_cpu_mpi._src import compat
from jax_cpu_mpi._src.batching import outer_vmap
from mpi_launcher import assert_mpi_ok, llvm_unoptimized, run_mpi

JAX_012 = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12)
DANGEROUS = "is dangerous when PartitionSpec has non-empty unreduced/reduced"


def gather(x: jax.Array) -> np.ndarray:
    return np.asarray(x)


def assert_rows(rows: list) -> None:
    for name, got, want in rows:
        assert got.shape == want.shape, name
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=name)


@pytest.fixture(scope="module")
def mesh():
    m = cases.explicit_mesh((4,), ("x",))
    with jax.set_mesh(m):
        yield m


@pytest.fixture(scope="module")
def mesh2():
    return cases.explicit_mesh((2, 4), ("y", "x"))


# --------------------------------------------------- installation and upstream detection


def test_patches_are_installed_and_reported():
    status = batching.status()
    assert {k: status[k] for k in ("shard_map", "vmap_in_axes", "broadcast")} == {
        "shard_map": True, "vmap_in_axes": True, "broadcast": True}
    states = {f["feature"]: f["state"] for f in compat.report()}
    for name in ("shard_map", "vmap_in_axes", "broadcast"):
        assert states[f"batching:{name}"] == "active"


class _JaxOwn:
    """JAX's own functions back in place for the patches of one feature (then ours)."""

    def __init__(self, name: str) -> None:
        self.specs = [s for s in outer_vmap.PATCHES if s.name == name]

    def __enter__(self):
        self.ours = [getattr(s.owner(), s.attr) for s in self.specs]
        for s in self.specs:
            setattr(s.owner(), s.attr, outer_vmap.UPSTREAM[(s.name, s.attr)])

    def __exit__(self, *exc):
        for s, ours in zip(self.specs, self.ours, strict=True):
            setattr(s.owner(), s.attr, ours)


def _tiny(name: str, mesh):
    """The smallest program that needs the patches of feature ``name`` (as jaxpr)."""
    n = mesh.shape["x"]
    if name == "shard_map":  # unreduced out_specs; no argument has sets
        f = cases._partial_matmul(mesh, psum=False)
        a = cases.put(mesh, P(None, None, "x"), np.ones((2, 2, 2 * n), np.float32))
        b = cases.put(mesh, P(None, "x", None), np.ones((2, 2 * n, 2), np.float32))
        return lambda: jax.make_jaxpr(jax.vmap(f))(a, b)
    if name == "vmap_in_axes":  # a reduced argument, no shard_map
        w = cases.put(mesh, P(None, None, **cases.R), np.ones((2, 3), np.float32))
        return lambda: jax.make_jaxpr(jax.vmap(lambda v: v * 2))(w)
    # broadcast: the docs' step, one model on several data streams (a scan carry)
    step, _ = cases._step(mesh)
    ws = cases.put(mesh, cases.STEP_SPECS[0], np.ones((1, 4, 4), np.float32))
    xs = cases.put(mesh, P(None, None, "x", None), np.ones((2, 1, n, 4), np.float32))
    return lambda: jax.make_jaxpr(jax.vmap(step, in_axes=(None, 0)))(ws, xs)


@pytest.mark.parametrize("name", ["shard_map", "vmap_in_axes", "broadcast"])
def test_jax_is_still_broken_upstream(mesh, name):
    """Fails when JAX's own function works: then drop ours (install() leaves it alone)."""
    probe = _tiny(name, mesh)
    probe()  # ours
    with _JaxOwn(name):
        try:
            probe()
        except ValueError as e:
            assert DANGEROUS in str(e), e
        else:
            pytest.fail(f"JAX {jax.__version__} now handles {name} with reduced/unreduced "
                        f"specs itself: remove ours (batching:{name}) from "
                        "jax_cpu_mpi/_src/batching/outer_vmap.py and its tests.")


def test_install_steps_aside_where_jax_works():
    assert outer_vmap._batch_spec_broken(outer_vmap.UPSTREAM[("shard_map", "batch_spec")])

    def fixed(spec, dim, val):  # what a fixed JAX would do
        parts = list(spec.partitions)
        parts.insert(dim, val)
        return P(*parts, reduced=spec.reduced, unreduced=spec.unreduced)

    assert not outer_vmap._batch_spec_broken(fixed)
    ours = outer_vmap.batch_spec_rule(outer_vmap.UPSTREAM[("shard_map", "batch_spec")])
    spec_r = P("x", None, reduced={"y"})
    assert ours(spec_r, 1, "z") is fixed(spec_r, 1, "z")
    assert ours(P("x"), 0, None) is P(None, "x")


# ------------------------------------------------------------------ reduced in_specs


@pytest.mark.parametrize(("in_axes", "out_axes"),
                         [((0, 0), 0), ((1, 2), 2), ((None, 0), 0), ((0, None), 1)])
def test_reduced_in_specs(mesh, in_axes, out_axes):
    assert_rows(cases.reduced_in_specs(mesh, gather, in_axes=in_axes, out_axes=out_axes))


@pytest.mark.parametrize("in_axes", [(0, 0), (None, 1)])
def test_vmap_of_grad_wrt_reduced_weights(mesh, in_axes):
    assert_rows(cases.vmap_grad_reduced(mesh, gather, in_axes=in_axes))


# ------------------------------------------------------------------ unreduced results


@pytest.mark.parametrize(("in_axes", "out_axes"), [((0, 0), 0), ((None, 1), 1)])
def test_unreduced_out_specs(mesh, in_axes, out_axes):
    assert_rows(cases.unreduced_out_specs(mesh, gather, in_axes=in_axes, out_axes=out_axes))


@pytest.mark.parametrize("in_axes", [(0, 0), (0, None)])
def test_psum_of_unreduced_and_its_grad(mesh, in_axes):
    assert_rows(cases.psum_of_unreduced(mesh, gather, in_axes=in_axes))


# ---------------------------------------------------------- spmd_axis_name, jit, scan


@pytest.mark.xfail(JAX_012, strict=True, raises=ValueError,
                   reason="JAX 0.12's own lowering of vmap(spmd_axis_name=...) of a shard_map "
                   "on an Explicit mesh fails the sdy verifier, with plain specs too")
def test_spmd_axis_name(mesh2):
    with jax.set_mesh(mesh2):
        assert_rows(cases.spmd_axis_name(mesh2, gather))


def test_scan_of_vmap(mesh):
    assert_rows(cases.scan_of_vmap(mesh, gather))


def test_vmap_of_scan_over_layers(mesh):
    assert_rows(cases.vmap_of_predict(mesh, gather))


@pytest.mark.parametrize("in_axes", [(0, 0), (None, 0)])
def test_gradient_accumulation_step(mesh, in_axes):
    assert_rows(cases.grad_accumulation(mesh, gather, in_axes=in_axes))


def test_microbatch_grads_by_vmap(mesh):
    assert_rows(cases.microbatch_grads_by_vmap(mesh, gather))


# ---------------------------------------------------------------------------- refused


def test_batch_split_over_a_reduced_axis_is_refused(mesh):
    with pytest.raises(ValueError, match=r"split over mesh axis \['x'\], which the spec "
                                         r"declares reduced.*spmd_axis_name"):
        cases.refused_spmd_over_reduced_axis(mesh)()


def test_batch_spec_refuses_a_batch_over_a_set_axis():
    ours = outer_vmap.batch_spec_rule(outer_vmap.UPSTREAM[("shard_map", "batch_spec")])
    with pytest.raises(ValueError, match="declares unreduced"):
        ours(P(None, unreduced={"x"}), 0, ("x",))


def test_batch_sharded_over_an_explicit_axis(mesh2):
    """JAX 0.12 runs it; JAX 0.10's shard_map refuses it before any batching rule
    (docs/batching.md, Limits)."""
    with jax.set_mesh(mesh2):
        try:
            rows = cases.batch_sharded_over_explicit_axis(mesh2, gather)
        except NotImplementedError as e:
            assert JAX_012 is False and "full manual" in str(e), e
            return
    assert_rows(rows)


# ----------------------------------------------------------------------------- mpirun


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_outer_vmap_over_mpi():
    # Compiling the cases is most of the launch; they are checked within a tolerance.
    run = run_mpi("outer_vmap.py", nprocs=2, devices_per_process=2, timeout=180,
                  env=llvm_unoptimized())
    assert_mpi_ok(run, 2)
    lines = [line for lines in run.by_rank().values() for line in lines]
    assert sum(line.startswith("ok ") for line in lines) >= 2 * 12, run.report()
