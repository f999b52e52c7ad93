"""jax_cpu_mpi.batching: vmap of reduced/unreduced collectives and of psend/precv.

The scenarios live in tests/mpi_programs/batching_cases.py and run here on 4 virtual CPU
devices of this process, and under ``mpirun -n 2`` (two devices per rank).
"""

from __future__ import annotations

import gc

import batching_cases as cases
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cpu_mpi
from conftest import make_mesh
from jax_cpu_mpi._src.batching import p2p as _batching_p2p
from jax_cpu_mpi._src.batching import rules as batching
from jax_cpu_mpi._src.compat import fancy_primitive_batchers, parallel
from jax_cpu_mpi._src.ops import primitives
from jax_cpu_mpi._src.ops.primitives import psend_p
from mpi_launcher import assert_mpi_ok, llvm_unoptimized, run_mpi

B = cases.B


def gather(x: jax.Array) -> np.ndarray:
    return np.asarray(x)


def assert_rows(rows: list[cases.Check]) -> None:
    for name, got, want in rows:
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=name)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh((4, "x"))


# ------------------------------------------------- installation and upstream detection


def test_every_rule_is_installed():
    patches = {spec.name: True for spec in batching.PATCHES}  # test_batching_outer_vmap.py
    assert batching.status() == {**{spec.primitive.name: True for spec in batching.RULES},
                                 **patches}


@pytest.mark.parametrize("spec", batching.RULES, ids=lambda s: s.primitive.name)
def test_jax_rule_is_still_broken_upstream(spec):
    """Fails when JAX ships a real rule: then drop ours (install() already leaves it alone)."""
    upstream = batching.UPSTREAM_RULES.get(spec.primitive)
    if primitives.OURS and spec.primitive in (primitives.psend_p, primitives.precv_p):
        assert upstream is None  # our own primitive: our rule is its only rule
        return
    assert upstream is not None and spec.replaces(upstream), (
        f"JAX {jax.__version__} now has a real batching rule for {spec.primitive.name}: "
        "remove ours from jax_cpu_mpi.batching.RULES and its tests.")


def test_no_placeholder_rule_left_uncovered():
    """A new JAX placeholder batcher (e.g. for an async *_start primitive) shows up here."""
    ours = {spec.primitive for spec in batching.RULES}
    stubs = [p.name for p, rule in fancy_primitive_batchers.items()
             if p not in ours and batching.is_raising_stub(rule)]
    assert stubs == [], f"JAX placeholder batchers without a jax_cpu_mpi rule: {stubs}"


def test_jax_rules_fail_where_ours_work(mesh):
    """Before/after: with JAX's own rule back in place, vmap fails; with ours it runs."""
    prim = parallel.all_gather_reduced_p
    f = jax.vmap(jax.shard_map(
        lambda w: jax.lax.pcast(jax.lax.all_gather(w, "x", to="reduced"), "x", to="varying"),
        mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    xs = jax.device_put(np.ones((B, 8), np.float32), NamedSharding(mesh, P(None, "x")))
    ours = fancy_primitive_batchers[prim]
    fancy_primitive_batchers[prim] = batching.UPSTREAM_RULES[prim]
    try:
        with pytest.raises(NotImplementedError, match="Please file an issue"):
            jax.make_jaxpr(f)(xs)
    finally:
        fancy_primitive_batchers[prim] = ours
    assert cases.count_eqns(f, xs, name="all_gather_reduced") == 1


def test_install_never_replaces_a_real_rule():
    prim = parallel.all_gather_reduced_p
    ours = fancy_primitive_batchers[prim]

    def real_rule(axis_data, vals_in, dims_in, **params):
        return prim.bind(*vals_in, **params), dims_in[0]

    fancy_primitive_batchers[prim] = real_rule
    try:
        batching.install()
        assert fancy_primitive_batchers[prim] is real_rule
        assert batching.status()[prim.name] is False
    finally:
        fancy_primitive_batchers[prim] = ours
    assert batching.install()[prim.name] is True  # idempotent, ours again


def test_stub_detection():
    def stub(vals_in, dims_in, *, axes):
        raise NotImplementedError("Please file an issue")

    def bare(axis_data, vals_in, dims_in, axes):
        raise NotImplementedError

    def real(vals_in, dims_in, *, axes):
        if not vals_in:
            raise NotImplementedError
        return jnp.sum(vals_in[0]), None

    def wrapper_of(batcher):  # the shape of JAX's primitive_batchers shim
        def wrapped(axis_data, vals, dims, **params):
            return batcher(vals, dims, **params)
        return wrapped

    assert batching.is_raising_stub(stub) and batching.is_raising_stub(bare)
    assert batching.is_raising_stub(wrapper_of(stub))
    assert not batching.is_raising_stub(real)
    assert not batching.is_raising_stub(wrapper_of(real))
    assert not batching.is_raising_stub(None)
    assert not batching.is_raising_stub(fancy_primitive_batchers[parallel.all_gather_p])
    assert batching.unwrap_rule(wrapper_of(stub)) is stub


# ---------------------------------- all_gather(to='reduced'): vmapped axis is not the mesh axis


@pytest.mark.parametrize(("axis", "tiled", "in_axes"),
                         [(0, False, 0), (0, False, 1), (1, False, 1), (0, True, 1),
                          (-1, True, 0)])
def test_reduced_gather_matches_map_and_plain_gather(mesh, axis, tiled, in_axes):
    assert_rows(cases.reduced_gather(mesh, gather, axis=axis, tiled=tiled, in_axes=in_axes))


@pytest.mark.parametrize("tiled", [False, True])
def test_reduced_gather_is_one_collective(mesh, tiled):
    assert cases.reduced_gather_count(mesh, axis=0, tiled=tiled) == 1


@pytest.mark.parametrize(("axis", "tiled"), [(0, False), (1, True)])
def test_vmap_inside_shard_map_keeps_reduced_output(mesh, axis, tiled):
    assert_rows(cases.inner_vmap_gather(mesh, gather, axis=axis, tiled=tiled))


@pytest.mark.parametrize(("axis", "tiled", "batch_w", "batch_d"),
                         [(0, True, True, True), (1, True, True, False),
                          (0, False, False, True), (2, False, True, True)])
def test_vmap_of_grad_matches_map_of_grad(mesh, axis, tiled, batch_w, batch_d):
    assert_rows(cases.vmap_grad(mesh, gather, axis=axis, tiled=tiled,
                                batch_w=batch_w, batch_d=batch_d))


def test_vmap_of_grad_is_one_gather_and_one_scatter(mesh):
    assert cases.vmap_grad_counts(mesh, axis=0, tiled=True) == (1, 1)


@pytest.mark.parametrize(("tiled", "in_axes"), [(False, 0), (False, 2), (True, 1)])
def test_unreduced_psum_scatter(mesh, tiled, in_axes):
    assert_rows(cases.unreduced_scatter(mesh, gather, tiled=tiled, in_axes=in_axes))


# ------------------------------------------- vmap(..., axis_name=a) over the collective axis


@pytest.mark.parametrize(("axis", "tiled"), [(0, False), (1, False), (0, True), (1, True)])
@pytest.mark.parametrize("in_axes", [0, 2])
def test_gather_over_the_vmapped_axis_is_all_gathers_value(axis, tiled, in_axes):
    x = cases.sample((4, 2, 3), seed=80)
    ours = jax.vmap(lambda v: jax.lax.all_gather(v, "a", axis=axis, tiled=tiled, to="reduced"),
                    axis_name="a", in_axes=in_axes)(np.moveaxis(x, 0, in_axes))
    plain = jax.vmap(lambda v: jax.lax.all_gather(v, "a", axis=axis, tiled=tiled),
                     axis_name="a")(x)
    want = cases.numpy_gather(x, axis, tiled)
    np.testing.assert_array_equal(ours, plain)
    np.testing.assert_array_equal(ours, np.broadcast_to(want, ours.shape))


def test_grad_of_vmap_over_the_gathered_axis():
    x, d = cases.sample((4, 2, 3), seed=81), cases.sample((4, 5, 8), seed=82)

    def loss(to):
        def one(v, dd):
            y = jax.lax.all_gather(v, "a", tiled=True, **({"to": to} if to else {}))
            return jnp.sum(jnp.sin(dd @ y) ** 2)
        return lambda v: jax.vmap(one, axis_name="a")(v, d).sum()

    grad = {to: jax.jit(jax.grad(loss(to)))(x) for to in ("reduced", None)}
    np.testing.assert_allclose(grad["reduced"], grad[None], rtol=1e-5)


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("in_axes", [0, 1])
def test_scatter_over_the_vmapped_axis_is_psum_scatters_value(tiled, in_axes):
    z = cases.sample((4, 8 if tiled else 4, 3), seed=83)

    def run(fn):
        return jax.vmap(lambda v: fn(v, "a", scatter_dimension=0, tiled=tiled),
                        axis_name="a", in_axes=in_axes)(np.moveaxis(z, 0, in_axes))

    ours = run(parallel.unreduced_psum_scatter)
    np.testing.assert_allclose(ours, run(jax.lax.psum_scatter), rtol=1e-6)
    np.testing.assert_allclose(ours.reshape(z.shape[1], -1), z.sum(0).reshape(z.shape[1], -1),
                               rtol=1e-5)


@pytest.mark.parametrize("tiled", [False, True])
def test_gather_over_vmapped_axis_with_spmd_axis_name(tiled):
    # An Auto mesh: with an Explicit one, JAX's own all_gather fails the same way here
    # (DuplicateSpecError from vmap's out_axes sharding).
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4], axis_types=(AxisType.Auto,))
    x = cases.sample((4, 2, 3), seed=84)

    def run(**kw):
        f = jax.vmap(lambda v: jax.lax.all_gather(v, "a", tiled=tiled, **kw),
                     axis_name="a", spmd_axis_name="x")
        with jax.set_mesh(mesh):
            return np.asarray(jax.jit(f)(jax.device_put(x, NamedSharding(mesh, P("x")))))

    ours = run(to="reduced")
    np.testing.assert_array_equal(ours, run())
    np.testing.assert_array_equal(
        ours, np.broadcast_to(cases.numpy_gather(x, 0, tiled), ours.shape))


@pytest.mark.parametrize("names", [("a", "x"), ("x", "a")])
@pytest.mark.parametrize("tiled", [False, True])
def test_tuple_of_vmapped_and_mesh_axes(mesh, names, tiled):
    assert_rows(cases.mixed_axes_gather(mesh, gather, names=names, tiled=tiled))
    assert_rows(cases.mixed_axes_scatter(mesh, gather, names=names, tiled=tiled))


@pytest.fixture(scope="module")
def auto_mesh_yx():
    # spmd_axis_name splits the batch only over Auto axes (Explicit ones keep it whole).
    return jax.make_mesh((2, 4), ("y", "x"), devices=jax.devices()[:8],
                         axis_types=(AxisType.Auto, AxisType.Auto))


@pytest.mark.parametrize("tiled", [False, True])
def test_gather_over_vmapped_axis_split_by_spmd_axis_name(auto_mesh_yx, tiled):
    """vmap(shard_map(...), spmd_axis_name='y'): each device holds 2 of the 4 members along
    'a'; the gather over 'a' is a local gather plus one over 'y' (JAX's all_gather asserts)."""
    mesh = auto_mesh_yx

    def body(v):
        g = jax.lax.all_gather(v, "a", tiled=tiled, to="reduced")
        # The reduced value leaves the body as a psum over 'y' of identical copies.
        return jax.lax.psum(jax.lax.pcast(g, "y", to="varying"), "y") / 2

    f = jax.vmap(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")),
                 axis_name="a", spmd_axis_name="y")
    x = cases.sample((4, 8), seed=85)
    got = np.asarray(jax.jit(f)(jax.device_put(x, NamedSharding(mesh, P("y", "x")))))
    blocks = x.reshape(4, 4, 2)  # [member a, device i]
    want = np.concatenate([cases.numpy_gather(blocks[:, i], 0, tiled) for i in range(4)])
    np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), rtol=1e-6)


@pytest.mark.parametrize("tiled", [False, True])
def test_scatter_over_vmapped_axis_split_by_spmd_axis_name(auto_mesh_yx, tiled):
    mesh, chunk = auto_mesh_yx, 2 if tiled else 1

    def body(v):
        v = jax.lax.pcast(jax.lax.pcast(v, "x", to="varying"), "x", to="unreduced")
        return parallel.unreduced_psum_scatter(v, ("a", "x"), scatter_dimension=0, tiled=tiled)

    f = jax.vmap(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P("x")),
                 axis_name="a", spmd_axis_name="y")
    z = cases.sample((4, 16 * chunk, 5), seed=86)  # member (a, i) holds z[a]
    got = np.asarray(jax.jit(f)(jax.device_put(z, NamedSharding(mesh, P("y")))))
    total = (4 * z.sum(0)).reshape(16, chunk, 5)
    np.testing.assert_allclose(got.reshape(4, 4, chunk, 5), total.reshape(4, 4, chunk, 5),
                               rtol=1e-5, atol=1e-5)


def test_p2p_over_vmapped_axis_split_by_spmd_axis_name_is_refused(auto_mesh_yx):
    # psend_p directly: jax.lax.psend's pvary step rejects a vmap axis inside shard_map.
    f = jax.vmap(jax.shard_map(lambda v: psend_p.bind(v, axis_name=("a",), perm=((0, 1),)),
                               mesh=auto_mesh_yx, in_specs=P("x"), out_specs=P()),
                 axis_name="a", spmd_axis_name="y")
    x = jax.device_put(np.ones((4, 8), np.float32), NamedSharding(auto_mesh_yx, P("y", "x")))
    with pytest.raises(NotImplementedError, match="spmd_axis_name"):
        jax.make_jaxpr(f)(x)


# ------------------------------------------------------------------------- psend / precv


@pytest.mark.parametrize("in_axes", [0, 2])
def test_p2p_batch_is_one_message(mesh, in_axes):
    assert_rows(cases.p2p_batched(mesh, gather, in_axes=in_axes))


def test_p2p_unbatched_operand_still_sends_every_element(mesh):
    assert_rows(cases.p2p_unbatched_operand(mesh, gather))


def test_p2p_jaxpr_has_one_psend_with_a_token(mesh):
    assert cases.p2p_counts(mesh) == {"psend": 1, "precv": 1, "ppermute": 0,
                                      "non_token_psend": 0}


def test_p2p_vmap_inside_shard_map(mesh):
    perm = cases.chain(4)
    body = jax.vmap(lambda v: cases.sendrecv(v, "x", perm), in_axes=1, out_axes=1)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    ref = jax.jit(jax.shard_map(lambda v: jax.lax.ppermute(v, "x", perm), mesh=mesh,
                                in_specs=P("x"), out_specs=P("x")))
    x = jax.device_put(cases.sample((8, B, 3), seed=90), NamedSharding(mesh, P("x")))
    np.testing.assert_array_equal(f(x), ref(x))


def _numpy_permute(x: np.ndarray, perm) -> np.ndarray:
    out = np.zeros_like(x)
    for src, dst in perm:
        out[dst] = x[src]
    return out


@pytest.mark.parametrize("perm", [[(0, 1), (1, 2), (2, 3), (3, 0)], [(0, 2), (3, 0)]],
                         ids=["ring", "partial"])
@pytest.mark.parametrize("wrap", ["eager", "jit", "vmap_of_jit"])
def test_p2p_over_the_vmapped_axis_is_a_permutation(perm, wrap):
    x = cases.sample((4, 3), seed=91)

    def f(v):
        tok = jax_cpu_mpi.psend(v, "a", perm)
        assert isinstance(jax.typeof(tok), jax.extend.core.AbstractToken)
        return jax_cpu_mpi.precv(tok, jax.ShapeDtypeStruct(v.shape, v.dtype), "a", perm)

    if wrap == "eager":
        got = jax.vmap(f, axis_name="a")(x)
    elif wrap == "jit":
        got = jax.jit(jax.vmap(f, axis_name="a"))(x)
    else:
        got = jax.vmap(jax.jit(f), axis_name="a")(x)
    np.testing.assert_array_equal(got, _numpy_permute(x, perm))
    if len(perm) == 4:
        np.testing.assert_array_equal(
            got, jax.vmap(lambda v: jax.lax.ppermute(v, "a", perm), axis_name="a")(x))
    gc.collect()
    assert _batching_p2p.mailbox_size() == 0


def test_p2p_over_the_vmapped_axis_unbatched_operand():
    x, c = cases.sample((4, 3), seed=92), cases.sample((3,), seed=93)
    perm = [(0, 2), (1, 0)]
    got = jax.vmap(lambda v, s: cases.sendrecv(s, "a", perm) + 0 * v,
                   in_axes=(0, None), axis_name="a")(x, c)
    np.testing.assert_array_equal(got, _numpy_permute(np.broadcast_to(c, x.shape), perm))


def test_precv_over_vmapped_axis_needs_its_psend():
    x = np.ones((4, 3), np.float32)
    with pytest.raises(NotImplementedError, match="token returned by a psend"):
        jax.vmap(lambda v: jax_cpu_mpi.precv(jax.lax.create_token(),
                                             jax.ShapeDtypeStruct(v.shape, v.dtype), "a",
                                             [(0, 1)]), axis_name="a")(x)


def test_precv_over_vmapped_axis_checks_shape_and_perm():
    x = np.ones((4, 3), np.float32)

    def f(v):
        tok = jax_cpu_mpi.psend(v, "a", [(0, 1)])
        return jax_cpu_mpi.precv(tok, jax.ShapeDtypeStruct((2,), v.dtype), "a", [(0, 1)])

    with pytest.raises(ValueError, match=r"out_shape float32\[2\].*float32\[3\]"):
        jax.vmap(f, axis_name="a")(x)


def test_p2p_over_vmapped_and_mesh_axes_is_refused(mesh):
    body = jax.vmap(lambda v: psend_p.bind(v, axis_name=("a", "x"), perm=((0, 1),)),
                    axis_name="a")
    f = jax.shard_map(body, mesh=mesh, in_specs=P(None, "x"), out_specs=P())
    x = jax.device_put(np.ones((B, 8), np.float32), NamedSharding(mesh, P(None, "x")))
    with pytest.raises(NotImplementedError, match=r"psend: vmap over axis 'a'"):
        jax.make_jaxpr(f)(x)


# ----------------------------------------------------------------------------- mpirun


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_batching_rules_over_mpi():
    # Compiling the cases is most of the launch; they are checked within a tolerance.
    run = run_mpi("batching_rules.py", nprocs=2, devices_per_process=2, timeout=220,
                  env=llvm_unoptimized())
    assert_mpi_ok(run, 2)
    lines = [line for lines in run.by_rank().values() for line in lines]
    assert sum(line.startswith("ok ") for line in lines) >= 2 * 20, run.report()


# ------------------------------------------- unreduced_pmax / unreduced_pmin (JAX >= 0.12)


def _unreduced_extremum(op: str):
    """(primitive, UnreducedKind) for ``op``, or skip on a JAX without these primitives."""
    from jax_cpu_mpi._src import compat as _compat

    prim = getattr(_compat, f"unreduced_p{op}_p")
    if not _compat.available(prim):
        pytest.skip(f"jax {jax.__version__} has no unreduced_p{op} primitive (JAX >= 0.12)")
    from jax._src.partition_spec import UnreducedKind

    return prim, getattr(UnreducedKind, op)


def _explicit_mesh():
    return jax.make_mesh((4,), ("x",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:4])


def _extremum_program(op: str, kind, body):
    """Partial maxima/minima unreduced over 'x' (kind ``op``), then ``body`` in shard_map."""
    def f(a):
        u = getattr(jax.lax, f"reduce_{op}")(
            a, axes=(0,),
            out_sharding=P(*[None] * (a.ndim - 1), unreduced={"x"}, unreduced_kind=kind))
        return jax.shard_map(body, out_specs=P())(u)
    return jax.jit(f)


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("in_axes", [0, 1])
def test_unreduced_pmax_pmin_batch_is_one_collective(op, in_axes):
    prim, kind = _unreduced_extremum(op)
    reduce = getattr(jax.lax, f"p{op}")
    a = cases.sample((4, B, 5), seed=11)  # 4 partial results per element, one per device

    def vmapped():  # a new program each time (jit caches traces)
        return _extremum_program(op, kind, lambda v: jax.vmap(
            lambda r: reduce(r, "x"), in_axes=in_axes, out_axes=in_axes)(v))

    with jax.set_mesh(_explicit_mesh()):
        arr = jax.device_put(a, P("x", None, None))
        batched = vmapped()
        # Each example on its own: slice the input before the partial reduction (JAX 0.11
        # cannot slice an unreduced max value), one reduce + pmax per example.
        one = _extremum_program(op, kind, lambda v: reduce(v, "x"))
        per_example = jax.jit(lambda a: jnp.stack(
            [one(jax.lax.index_in_dim(a, i, in_axes + 1, keepdims=False))
             for i in range(a.shape[in_axes + 1])], axis=in_axes))
        got, want = np.asarray(batched(arr)), np.asarray(per_example(arr))
        assert cases.count_eqns(batched, arr, name=prim.name) == 1
        assert cases.count_eqns(per_example, arr, name=prim.name) == (B, 5)[in_axes]
        # Before: JAX's own rule.
        ours = fancy_primitive_batchers[prim]
        fancy_primitive_batchers[prim] = batching.UPSTREAM_RULES[prim]
        try:
            with pytest.raises(NotImplementedError):
                jax.make_jaxpr(vmapped())(arr)
        finally:
            fancy_primitive_batchers[prim] = ours
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, getattr(a, op)(axis=0))


@pytest.mark.parametrize("op", ["max", "min"])
def test_unreduced_pmax_pmin_over_the_vmapped_axis_is_refused(op):
    """``lax.pmax(r, ('a', 'x'))`` is refused by JAX's type check (a vmapped axis has no
    unreduced state); the primitive bound over both axes is refused by our rule."""
    prim, kind = _unreduced_extremum(op)
    a = cases.sample((4, B, 5), seed=12)
    with jax.set_mesh(_explicit_mesh()):
        arr = jax.device_put(a, P("x", None, None))
        f = _extremum_program(op, kind, lambda v: jax.vmap(
            lambda r: prim.bind(r, axes=("a", "x")), axis_name="a", out_axes=None)(v))
        with pytest.raises(NotImplementedError, match=f"unreduced_p{op} over the vmapped"):
            f(arr)
        g = _extremum_program(op, kind, lambda v: jax.vmap(
            lambda r: getattr(jax.lax, f"p{op}")(r, ("a", "x")), axis_name="a")(v))
        with pytest.raises(ValueError, match="can only accept axis_name"):
            g(arr)
