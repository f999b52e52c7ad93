"""Module pass: a precv keeps alive the operand of the psend whose token it takes.

A psend's custom call may return before its bytes have left its operand only if XLA keeps
that buffer alive and unchanged until something finishes the send. After JAX has lowered a
CPU program, this pass finds every precv whose token is the result of a psend of the same
block, gives that precv the psend's operand as an extra operand (XLA then keeps the buffer
until the precv has run) and marks the psend ``operand_kept = 1``. At run time the psend
may then hand its operand itself to a receiver that is already waiting and return at once,
and the precv finishes the send before it returns (``cpp/ffi/kept_sends.h``).

The psend and precv must share a block: a precv of the same block runs whenever the psend
does (a precv in a branch of a ``cond`` might not). The pass runs on the finished module
because JAX lowers each equation in a function of its own, where a precv's token is a block
argument. Programs the pass does not change (the feature off, a token passed through a loop
or a call) behave the same, their psends finishing their sends before they return.
"""

from __future__ import annotations

from typing import Any

from jax_cpu_mpi._src.compat import ir, single_side_collective_effect
from jax_cpu_mpi._src.ffi.custom_calls import (
    BACKEND_CONFIG,
    OPERAND_KEPT,
    PRECV_TARGET,
    PSEND_TARGET,
    array_attribute,
    call_target,
    int_attribute,
    operations,
    set_int_attribute,
    with_int_attribute,
)


def _sending_psend(precv: Any) -> Any | None:
    """The psend (of our lowering, moving data) whose token ``precv`` takes, in its block."""
    token = precv.operands[0]
    if not isinstance(token, ir.OpResult):
        return None  # a block argument: a loop carry, a function argument...
    psend = token.owner.operation
    if call_target(psend) != PSEND_TARGET or psend.block != precv.block:
        return None
    if int_attribute(psend, OPERAND_KEPT) is None or array_attribute(psend, "pairs").size == 0:
        return None  # not ours, or one that orders a barrier and sends nothing
    return psend


def _rebuild_precv(precv: Any, psend: Any) -> None:
    """Replaces ``precv`` by the same call with the psend's operand as a last operand."""
    operand = psend.operands[0]
    named = [precv.attributes[i] for i in range(len(precv.attributes))]
    attributes = {n.name: n.attr for n in named}
    attributes[BACKEND_CONFIG] = with_int_attribute(precv, OPERAND_KEPT, 1)
    layouts = list(ir.ArrayAttr(precv.attributes["operand_layouts"]))
    layouts.append(ir.ArrayAttr(psend.attributes["operand_layouts"])[0])
    attributes["operand_layouts"] = ir.ArrayAttr.get(layouts)
    new = ir.Operation.create(
        "stablehlo.custom_call", results=[r.type for r in precv.results],
        operands=[*precv.operands, operand], attributes=attributes, loc=precv.location,
        ip=ir.InsertionPoint(precv))
    for old, replacement in zip(precv.results, new.results, strict=True):
        old.replace_all_uses_with(replacement)
    precv.erase()


def keep_psend_operands(module: Any) -> int:
    """Runs the pass on a lowered module; returns how many precvs now keep an operand."""
    with module.context:
        pairs = []
        for op in operations(module.operation):
            if call_target(op) == PRECV_TARGET and int_attribute(op, OPERAND_KEPT) == 0:
                psend = _sending_psend(op)
                if psend is not None:
                    pairs.append((op, psend))
        for precv, psend in pairs:
            set_int_attribute(psend, OPERAND_KEPT, 1)
            _rebuild_precv(precv, psend)
        return len(pairs)


def wanted(platforms: Any, jaxpr: Any) -> bool:
    """CPU programs with psend/precv (they carry the effect; jit and shard_map propagate it)."""
    return "cpu" in tuple(platforms) and single_side_collective_effect in jaxpr.effects
