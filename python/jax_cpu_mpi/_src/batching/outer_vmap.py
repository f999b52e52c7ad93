"""``jax.vmap`` from outside a ``shard_map`` whose specs carry reduced/unreduced sets.

JAX batches a ``shard_map`` by inserting the batch dimension into each of its ``in_specs``
and ``out_specs`` (``pxla.batch_spec``), and ``vmap`` reads the partition of each argument's
mapped dimension from its sharding (``api._mapped_axis_spec``) and broadcasts an unbatched
value that meets a batched one (``batching.broadcast``: a scan carry, a ``vmap(grad)``
cotangent). All three index or unpack a ``PartitionSpec`` (``spec[i]``, ``*spec``,
``spec + tuple``), which JAX 0.10 to 0.12 refuse for a spec with a ``reduced`` or
``unreduced`` set (``ValueError: Using pspec[...] is dangerous ...``): so ``vmap`` of the
reduced-weights pattern of JAX's sharding-and-AD docs fails before any collective is reached.

Ours do the same on ``spec.partitions`` and carry the sets over (a batch dimension is a new,
unsharded or ``spmd_axis_name``-sharded, array dimension: a value reduced or unreduced over
``'x'`` stays so, each batch element being the value it was). For a spec without sets they
call JAX's own function, so nothing else changes. Each is installed only where JAX's own
function is still the broken one (:data:`PATCHES`; :func:`jax_cpu_mpi.batching.status`).

What cannot be defined is refused with a clear error: a batch split over (or vmapped away
from) a mesh axis that a spec declares reduced/unreduced. Each device would hold other batch
elements, so the value would vary over that axis instead of being the same partial or full
value on every device of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_cpu_mpi._src import compat

# -------------------------------------------------------------------------------- specs


def has_sets(spec: Any) -> bool:
    """Whether ``spec`` is a PartitionSpec with a non-empty reduced or unreduced set."""
    return bool(getattr(spec, "reduced", None) or getattr(spec, "unreduced", None))


def _names(val: Any) -> tuple:
    """The mesh axis names in ``val`` (a name, a tuple of names, None, UNCONSTRAINED)."""
    if isinstance(val, str):
        return (val,)
    if isinstance(val, (tuple, list)):
        return tuple(n for n in val if isinstance(n, str))
    return ()


def refuse_batch_over_set_axes(names: Iterable[Any], spec: Any, where: str) -> None:
    """Raise if the batch is split over (or vmapped away from) an axis of ``spec``'s sets."""
    if not has_sets(spec):
        return
    clash = sorted(set(names) & (set(spec.reduced) | set(spec.unreduced)), key=str)
    if not clash:
        return
    kinds = " and ".join(k for k in ("reduced", "unreduced")
                         if set(getattr(spec, k)) & set(clash))
    raise ValueError(
        f"jax.vmap cannot batch {where} {spec}: the batch would be split over mesh axis "
        f"{clash}, which the spec declares {kinds}. A {kinds} value is the same (partial) "
        f"value on every device along {clash}, but with the batch split over it each device "
        "would hold other batch elements, so it cannot be defined. Split the batch over "
        "another mesh axis (spmd_axis_name=..., or shard the vmapped dimension of the "
        f"arguments over another axis), leave {clash} out of the spec's {kinds} set, or "
        "vmap inside the shard_map body.")


def batch_spec_rule(jax_batch_spec: Callable) -> Callable:
    """``pxla.batch_spec`` that keeps reduced/unreduced sets (JAX's own for other specs)."""

    def batch_spec(spec: Any, dim: int, val: Any) -> Any:
        if not has_sets(spec):
            return jax_batch_spec(spec, dim, val)
        refuse_batch_over_set_axes(_names(val), spec, "the shard_map spec")
        plain = jax_batch_spec(P(*spec.partitions), dim, val)
        return plain.update(unreduced=spec.unreduced, reduced=spec.reduced)

    return batch_spec


# ---------------------------------------------------------------- shard_map's batcher


def shard_map_batch_rule(jax_rule: Callable) -> Callable:
    """JAX's shard_map batcher, after a clear refusal of a batch split over an axis that an
    ``in_specs`` entry declares reduced/unreduced (JAX's own message says only that the
    axis "cannot appear in shard_map in_specs")."""

    def process_shard_map(trace: Any, prim: Any, fun: Callable, in_tracers: Any, mesh: Any,
                          in_specs: Any, *args: Any, **kwargs: Any) -> Any:
        axis_data = getattr(trace, "axis_data", None)
        names = (*(getattr(axis_data, "spmd_name", None) or ()),
                 *(getattr(axis_data, "explicit_mesh_axis", None) or ()))
        if names:
            for spec in in_specs:
                refuse_batch_over_set_axes(names, spec, "the shard_map in_specs entry")
        return jax_rule(trace, prim, fun, in_tracers, mesh, in_specs, *args, **kwargs)

    return process_shard_map


# ----------------------------------------------------------- vmap's mapped-axis spec


def _spec_of(arg: Any) -> Any:
    try:
        return jax.typeof(arg).sharding.spec
    except Exception:  # duck-typed arrays (BCOO...), as JAX's own reader forgives
        return None


def mapped_axis_spec_rule(jax_mapped_axis_spec: Callable) -> Callable:
    """``api._mapped_axis_spec`` for arguments whose sharding has reduced/unreduced sets.

    JAX reads ``spec[i]``, the partition of the mapped dimension: that is
    ``spec.partitions[i]`` whatever the sets. JAX's own function reads it from a stand-in
    with the same shape, dtype and partitions, without the sets.
    """

    def mapped_axis_spec(args_flat: Any, in_axes_flat: Any) -> Any:
        args_flat = list(args_flat)
        for k, (arg, i) in enumerate(zip(args_flat, in_axes_flat, strict=True)):
            if i is None or not has_sets(spec := _spec_of(arg)):
                continue
            aval = jax.typeof(arg)
            sharding = aval.sharding.update(spec=P(*spec.partitions))
            args_flat[k] = jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding)
        return jax_mapped_axis_spec(args_flat, in_axes_flat)

    return mapped_axis_spec


# ------------------------------------------------------------------ batching.broadcast


def broadcast_rule(jax_broadcast: Callable) -> Callable:
    """``batching.broadcast`` (an unbatched value given a batch dimension) that keeps the
    value's reduced/unreduced sets. A broadcast is linear, so it is defined on partial sums
    (unreduced) as on full copies (reduced); JAX's own function for other values.

    Which function runs for a value with sets is decided once, at the first such value:
    JAX's own, if it works there (JAX fixed it, ours steps aside), else ours.
    """
    state: dict[str, bool] = {}

    def broadcast(x: Any, sz: int, axis: int, mesh_axis: Any) -> Any:
        aval = jax.typeof(x)
        spec = aval.sharding.spec
        if not has_sets(spec) or state.get("jax_works"):
            return jax_broadcast(x, sz, axis, mesh_axis)
        if "jax_works" not in state:
            try:
                out = jax_broadcast(x, sz, axis, mesh_axis)
            except (ValueError, TypeError):
                state["jax_works"] = False
            else:
                state["jax_works"] = True
                compat.mark_not_needed(
                    "batching:broadcast", "JAX's own batching.broadcast keeps reduced/"
                    "unreduced sets: ours steps aside")
                return out
        if aval.sharding.mesh.empty:
            mesh_axis = None
        refuse_batch_over_set_axes(_names(mesh_axis), spec, "a value of sharding")
        shape = list(np.shape(x))
        shape.insert(axis, sz)
        dims = tuple(d for d in range(len(shape)) if d != axis)
        parts = list(spec.partitions) + [None] * (aval.ndim - len(spec.partitions))
        parts.insert(axis, mesh_axis)
        sharding = aval.sharding.update(
            spec=P(*parts, unreduced=spec.unreduced, reduced=spec.reduced))
        with jax.sharding.use_abstract_mesh(sharding.mesh):
            (y,) = compat.spmd_names_insert_pvary(
                lax.broadcast_in_dim(x, shape, dims, out_sharding=sharding))
        return y

    return broadcast


# ------------------------------------------------------------------------- installation


@dataclass(frozen=True)
class PatchSpec:
    """One JAX function of vmap's that ours wraps, where JAX's own is still broken."""

    name: str  # also the feature ``batching:<name>``
    owner: Callable[[], Any]  # the module or class holding it (a compat name)
    attr: str
    make: Callable[[Callable], Callable]  # JAX's function -> ours
    broken: Callable[[Callable], bool]  # whether JAX's function is still the broken one
    why: str

    @property
    def feature(self) -> str:
        return f"batching:{self.name}"


def _raises(fn: Callable[[], Any]) -> bool:
    try:
        fn()
    except (ValueError, TypeError):
        return True
    return False


def _probe_spec() -> Any:
    return P(None, reduced={"x"})


def _batch_spec_broken(jax_batch_spec: Callable) -> bool:
    """JAX's batch_spec on a reduced spec: raises, or loses the set."""
    try:
        out = jax_batch_spec(_probe_spec(), 0, None)
    except (ValueError, TypeError):
        return True
    return not (has_sets(out) and tuple(out.partitions) == (None, None))


def _mapped_axis_spec_broken(jax_mapped_axis_spec: Callable) -> bool:
    mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    arg = jax.ShapeDtypeStruct((2,), np.float32,
                               sharding=jax.sharding.NamedSharding(mesh, _probe_spec()))
    return _raises(lambda: jax_mapped_axis_spec([arg], [0]))


def _shard_map_batcher_broken(jax_rule: Callable) -> bool:
    """Ours is JAX's rule plus a clearer error; it goes with batch_spec's fix."""
    return _batch_spec_broken(compat.jax_batch_spec)


def _always_try(jax_broadcast: Callable) -> bool:
    """batching.broadcast cannot be probed without tracing a program: ours decides at the
    first value with sets (:func:`broadcast_rule`)."""
    return True


_DANGEROUS = "JAX's {} raises 'Using pspec[...] is dangerous' on a spec with reduced/unreduced"
PATCHES: tuple[PatchSpec, ...] = (
    PatchSpec("shard_map", lambda: compat.pxla, "batch_spec", batch_spec_rule,
              _batch_spec_broken, _DANGEROUS.format("pxla.batch_spec")),
    PatchSpec("shard_map", lambda: compat.BatchTrace, "process_shard_map",
              shard_map_batch_rule, _shard_map_batcher_broken,
              "JAX's shard_map batcher, with a clear refusal of a batch split over a "
              "reduced/unreduced axis"),
    PatchSpec("vmap_in_axes", lambda: compat.jax_api, "_mapped_axis_spec",
              mapped_axis_spec_rule, _mapped_axis_spec_broken,
              _DANGEROUS.format("api._mapped_axis_spec")),
    PatchSpec("broadcast", lambda: compat.batching_module, "broadcast", broadcast_rule,
              _always_try, _DANGEROUS.format("batching.broadcast")),
)

#: JAX's own function for each patched ``(owner, attr)`` where ours was installed.
UPSTREAM: dict[tuple[str, str], Callable] = {}
_MARKER = "_jax_cpu_mpi_outer_vmap"
_NOT_NEEDED = "JAX's own {} handles reduced/unreduced specs: ours steps aside"


def _key(spec: PatchSpec) -> tuple[str, str]:
    return spec.name, spec.attr


def _current(spec: PatchSpec) -> Any:
    return getattr(spec.owner(), spec.attr)


def is_ours(fn: Any) -> bool:
    return bool(getattr(fn, _MARKER, False))


def _install_patches(name: str) -> bool | str:
    """Put ours in place for the patches of feature ``batching:<name>`` (else why not)."""
    specs = [s for s in PATCHES if s.name == name]
    if all(is_ours(_current(s)) for s in specs):
        return True
    if not all(s.broken(_current(s)) for s in specs if not is_ours(_current(s))):
        return _NOT_NEEDED.format(", ".join(s.attr for s in specs))
    for s in specs:
        owner, jax_fn = s.owner(), _current(s)
        if is_ours(jax_fn):
            continue
        ours = s.make(jax_fn)
        setattr(ours, _MARKER, True)
        UPSTREAM[_key(s)] = jax_fn
        setattr(owner, s.attr, ours)
    return True


def install() -> None:
    """Install every patch of :data:`PATCHES` whose JAX function is still the broken one."""
    for name in dict.fromkeys(s.name for s in PATCHES):
        compat.enable(f"batching:{name}", lambda name=name: _install_patches(name))


def status() -> dict[str, bool]:
    """``{name: ours is in place}`` for each feature of :data:`PATCHES`."""
    out: dict[str, bool] = {}
    for s in PATCHES:
        try:
            ok = is_ours(_current(s)) and compat.state(s.feature) == compat.ACTIVE
        except Exception:  # an owner this JAX lacks (feature off)
            ok = False
        out[s.name] = out.get(s.name, True) and ok
    return out


__all__ = ["PATCHES", "UPSTREAM", "PatchSpec", "batch_spec_rule", "broadcast_rule",
           "has_sets", "install", "is_ours", "mapped_axis_spec_rule",
           "refuse_batch_over_set_axes", "shard_map_batch_rule", "status"]
