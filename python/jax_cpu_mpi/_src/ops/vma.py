"""Which mesh axes a value varies over inside ``shard_map`` (``check_vma``), and marking it
varying: values that JAX cannot type (a custom call's results, a loop's zeros) must carry
the same types as the values they meet in a ``cond``, ``switch`` or loop carry."""

from __future__ import annotations

from typing import Any

import jax


def vma_of(x: Any) -> frozenset:
    """The mesh axes ``x`` is typed as varying over: ``aval.vma`` (newer JAX) or
    ``aval.manual_axis_type.varying`` (JAX 0.10); empty where untracked."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return frozenset(vma or ())


def vary(tree: Any, axes: frozenset) -> Any:
    """Mark every leaf varying over ``axes`` (a no-op where untracked or already so)."""

    def one(x: Any) -> Any:
        missing = tuple(sorted(axes - vma_of(x), key=str))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(one, tree)
