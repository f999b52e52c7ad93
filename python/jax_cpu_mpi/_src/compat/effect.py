"""The effect of psend/precv, for a JAX that has dropped it with its primitives.

JAX's ``SingleSideCollectiveEffect`` marks every jaxpr that holds a psend or precv: jit,
shard_map and control flow propagate it, loops accept it, and the GPU-parity check looks
for it. Where JAX has dropped it, our own primitives carry this equivalent, registered
where JAX registers its own; while JAX has it, ours carry JAX's.

The class derives from JAX's private ``Effect``, so it is made here, in the compat room,
from the names :mod:`.names` resolved (passed in: this module imports nothing of ours).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def make_single_side_collective_effect(effect_base: type, registries: Iterable[Any]) -> Any:
    """An instance of ``SingleSideCollectiveEffect(effect_base)``, its class registered in
    each of ``registries`` (JAX's sets of allowed effect types)."""

    class SingleSideCollectiveEffect(effect_base):  # type: ignore[misc, valid-type]
        """One-sided communication (psend/precv), as JAX's effect of that name."""

        def __str__(self) -> str:
            return "one-sided communication"

        def __hash__(self) -> int:
            return hash(SingleSideCollectiveEffect)

        def __eq__(self, other: object) -> bool:
            return isinstance(other, SingleSideCollectiveEffect)

    for registry in registries:
        registry.add_type(SingleSideCollectiveEffect)
    return SingleSideCollectiveEffect()
