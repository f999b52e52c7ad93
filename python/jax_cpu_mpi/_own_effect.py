"""The effect of psend/precv, for a JAX that has dropped it with its primitives.

JAX's ``SingleSideCollectiveEffect`` marks every jaxpr that holds a psend or precv: jit,
shard_map and control flow propagate it, loops accept it, and jax_cpu_mpi's GPU-parity
check looks for it. Where JAX has dropped it, our own primitives carry this equivalent
(registered where JAX registers its own); while JAX has it, ours carry JAX's.
"""

from __future__ import annotations

from . import _compat


class SingleSideCollectiveEffect(_compat.Effect):
    """One-sided communication (psend/precv), as JAX's effect of that name."""

    def __str__(self) -> str:
        return "one-sided communication"

    def __hash__(self) -> int:
        return hash(SingleSideCollectiveEffect)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SingleSideCollectiveEffect)


def _register() -> SingleSideCollectiveEffect:
    for registry in (_compat.control_flow_allowed_effects, _compat.lowerable_effects):
        if _compat.available(registry):
            registry.add_type(SingleSideCollectiveEffect)
    return SingleSideCollectiveEffect()


single_side_collective_effect = _register()

__all__ = ["SingleSideCollectiveEffect", "single_side_collective_effect"]
