"""Batching (``jax.vmap``) rules that JAX lacks, installed on import of jax_cpu_mpi.

JAX 0.10 ships placeholder batchers that only raise ``NotImplementedError`` for the
reduced / unreduced collectives, so ``vmap`` (and ``vmap`` of ``grad``) of code that uses
``jax.lax.all_gather(x, axis_name, to='reduced')`` fails on every backend. It also gives
``psend`` / ``precv`` the batcher of ``ppermute``, which breaks their token semantics.

:func:`install` puts our rules in place, platform-independent (they only rebind JAX
primitives), and **only where JAX's current rule is still the placeholder**: a rule JAX has
made real is never overwritten. :func:`status` tells which rules are ours.

=============================  =====================================================
primitive                      rule
=============================  =====================================================
``all_gather_reduced``         one gather of the batched operand, reduced type kept;
                               over the vmapped axis: the gathered value
``unreduced_reduce_scatter``   one reduce-scatter of the batched operand; over the
                               vmapped axis: local sum over the batch, then scatter
``unreduced_psum``             one psum of the batched operand; over the vmapped
                               axis: local sum over the batch
``unreduced_pmax``,            (JAX >= 0.12) one pmax / pmin of the batched operand;
``unreduced_pmin``             over the vmapped axis: local max / min over the batch
``preduced``,                  no-op casts: the value with its batch dimension (a
``vary_unreduced_cast``,       vmapped axis has no varying/reduced state and is
``reduced_vary_cast``          dropped from ``axes``)
``psend`` / ``precv``          see :mod:`jax_cpu_mpi._batching_p2p`
=============================  =====================================================

Besides these primitive rules, :mod:`.outer_vmap` makes ``vmap`` from outside a
``shard_map`` with reduced/unreduced specs work (features ``batching:shard_map``,
``batching:vmap_in_axes``, ``batching:broadcast``; :data:`PATCHES`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jax_cpu_mpi._src import compat
from jax_cpu_mpi._src.batching import collectives, outer_vmap, p2p
from jax_cpu_mpi._src.batching.outer_vmap import PATCHES
from jax_cpu_mpi._src.compat import (
    all_gather_reduced_p,
    available,
    fancy_primitive_batchers,
    ppermute_batcher,
    preduced_p,
    reduced_vary_cast_p,
    unreduced_pmax_p,
    unreduced_pmin_p,
    unreduced_psum_p,
    unreduced_reduce_scatter_p,
    vary_unreduced_cast_p,
)
from jax_cpu_mpi._src.ops.primitives import OURS as _OUR_PRIMITIVES
from jax_cpu_mpi._src.ops.primitives import precv_p, psend_p

Rule = Callable[..., object]


unwrap_rule = compat.unwrap_batcher


def is_raising_stub(rule: Rule | None) -> bool:
    """Whether ``rule`` is a placeholder that can only raise ``NotImplementedError``.

    The function may refer to no global name but ``NotImplementedError`` (so it can do
    nothing else, and calling it is harmless), and calling it must raise that error.
    """
    fn = unwrap_rule(rule)
    code = getattr(fn, "__code__", None)
    if fn is None or code is None or set(code.co_names) != {"NotImplementedError"}:
        return False
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    args = [None for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            and p.default is p.empty]
    kwargs = {p.name: None for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty}
    try:
        fn(*args, **kwargs)
    except NotImplementedError:
        return True
    except Exception:
        return False
    return False


def _is_ppermute_batcher(rule: Rule | None) -> bool:
    return rule is not None and unwrap_rule(rule) is ppermute_batcher


def _p2p_rule_replaces(rule: Rule | None) -> bool:
    """JAX's psend/precv carry ppermute's batcher; ours (:mod:`.primitives`) carry none."""
    return _is_ppermute_batcher(rule) or (_OUR_PRIMITIVES and rule is None)


@dataclass(frozen=True)
class RuleSpec:
    """One rule of ours and how to recognise the JAX rule it may replace."""

    name: str  # the primitive's name, also the feature ``batching:<name>`` in _compat
    primitive: Any  # a JAX Primitive, or a compat.Missing where this JAX lacks it
    rule: Rule
    replaces: Callable[[Rule | None], bool]
    why: str

    @property
    def feature(self) -> str:
        return f"batching:{self.name}"


_STUB = "JAX's rule raises NotImplementedError"
_ALL_RULES: tuple[RuleSpec, ...] = (
    RuleSpec("all_gather_reduced", all_gather_reduced_p, collectives.all_gather_reduced_rule,
             is_raising_stub, _STUB + "('Please file an issue')"),
    RuleSpec("unreduced_reduce_scatter", unreduced_reduce_scatter_p,
             collectives.unreduced_reduce_scatter_rule, is_raising_stub,
             _STUB + "('Please file an issue')"),
    RuleSpec("unreduced_psum", unreduced_psum_p, collectives.unreduced_psum_rule,
             is_raising_stub, _STUB),
    RuleSpec("unreduced_pmax", unreduced_pmax_p,
             collectives.unreduced_extremum_rule(unreduced_pmax_p, "max"), is_raising_stub,
             _STUB),
    RuleSpec("unreduced_pmin", unreduced_pmin_p,
             collectives.unreduced_extremum_rule(unreduced_pmin_p, "min"), is_raising_stub,
             _STUB),
    RuleSpec("preduced", preduced_p, collectives.cast_rule(preduced_p), is_raising_stub, _STUB),
    RuleSpec("vary_unreduced_cast", vary_unreduced_cast_p,
             collectives.cast_rule(vary_unreduced_cast_p), is_raising_stub, _STUB),
    RuleSpec("reduced_vary_cast", reduced_vary_cast_p, collectives.cast_rule(reduced_vary_cast_p),
             is_raising_stub, _STUB),
    RuleSpec("psend", psend_p, p2p.psend_rule, _p2p_rule_replaces,
             "JAX reuses ppermute's rule: vmap(psend) returns data, not a token"
             if not _OUR_PRIMITIVES else "our psend primitive's rule"),
    RuleSpec("precv", precv_p, p2p.precv_rule, _p2p_rule_replaces,
             "JAX reuses ppermute's rule: vmap(precv) is a TypeError"
             if not _OUR_PRIMITIVES else "our precv primitive's rule"),
)

#: Our rules for the primitives this JAX has (a primitive it lacks has no rule to fix).
RULES: tuple[RuleSpec, ...] = tuple(s for s in _ALL_RULES if available(s.primitive))

#: JAX's rule for each primitive where ours was installed, as it was before.
UPSTREAM_RULES: dict[Any, Rule | None] = {}


_NOT_NEEDED = "JAX's own rule is not a placeholder: ours steps aside"


def _install_rule(spec: RuleSpec) -> bool | str:
    """Put ``spec.rule`` in place if JAX's rule is still the broken one (else why not)."""
    current = fancy_primitive_batchers.get(spec.primitive)
    if current is spec.rule:
        return True
    if not spec.replaces(current):
        return _NOT_NEEDED
    UPSTREAM_RULES[spec.primitive] = current
    fancy_primitive_batchers[spec.primitive] = spec.rule
    return True


def install() -> dict[str, bool]:
    """Install every rule of :data:`RULES` whose JAX rule is still the broken one.

    Each rule is a feature of its own (``batching:<primitive>`` in ``python -m jax_cpu_mpi
    info``): a rule whose JAX names are missing is off, with one warning, and the others
    are installed. A rule JAX has made real is left alone ("not needed"). Idempotent.
    Returns ``{primitive name: ours is installed}``.
    """
    for spec in _ALL_RULES:
        feature = compat.get_feature(spec.feature)
        if not feature.problems and available(spec.primitive):
            # What JAX has registered now decides, on every call.
            if feature.not_needed == _NOT_NEEDED:
                feature.not_needed = None
            feature.installed = fancy_primitive_batchers.get(spec.primitive) is spec.rule
        compat.enable(spec.feature, lambda spec=spec: _install_rule(spec))
    outer_vmap.install()
    return status()


def status() -> dict[str, bool]:
    """``{primitive name: our rule is the active one}`` for every rule of :data:`RULES`,
    then ``{name: ours is active}`` for each feature of :data:`PATCHES` (``shard_map``,
    ``vmap_in_axes``, ``broadcast``: vmap from outside a reduced/unreduced shard_map)."""
    if not available(fancy_primitive_batchers):
        rules = {spec.primitive.name: False for spec in RULES}
    else:
        rules = {spec.primitive.name: fancy_primitive_batchers.get(spec.primitive) is spec.rule
                 for spec in RULES}
    return {**rules, **outer_vmap.status()}


__all__ = ["PATCHES", "RULES", "UPSTREAM_RULES", "RuleSpec", "install", "is_raising_stub", "status",
           "unwrap_rule"]
