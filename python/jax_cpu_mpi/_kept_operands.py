"""Module pass: a precv keeps alive the operand of the psend whose token it takes.

A psend's custom call may return before its bytes have left its operand only if XLA keeps
that buffer alive and unchanged until something finishes the send. After JAX has lowered a
CPU program, this pass finds every precv whose token is the result of a psend of the same
block, gives that precv the psend's operand as an extra operand (XLA then keeps the buffer
until the precv has run) and marks the psend ``operand_kept = 1``. At run time the psend
may then hand its operand itself to a receiver that is already waiting and return at once,
and the precv finishes the send before it returns (``cpp/kept_sends.h``).

The psend and precv must share a block: a precv of the same block runs whenever the psend
does (a precv in a branch of a ``cond`` might not). The pass runs on the finished module
because JAX lowers each equation in a function of its own, where a precv's token is a block
argument. Programs the pass does not change (the feature off, a token passed through a loop
or a call) behave the same, their psends finishing their sends before they return.
"""

from __future__ import annotations

from typing import Any

from . import _compat
from ._compat import ir, mlir, single_side_collective_effect
from ._module_pass import after_lowering, call_target, operations
from .lowering import OPERAND_KEPT, PRECV_TARGET, PSEND_TARGET

_BACKEND_CONFIG = "mhlo.backend_config"


def _config(op: Any) -> dict[str, Any]:
    attr = ir.DictAttr(op.attributes[_BACKEND_CONFIG])
    return {attr[i].name: attr[i].attr for i in range(len(attr))}


def _kept_count(config: dict[str, Any]) -> int | None:
    value = config.get(OPERAND_KEPT)
    return None if value is None else ir.IntegerAttr(value).value


def _sending_psend(precv: Any) -> Any | None:
    """The psend (of our lowering, moving data) whose token ``precv`` takes, in its block."""
    token = precv.operands[0]
    if not isinstance(token, ir.OpResult):
        return None  # a block argument: a loop carry, a function argument...
    psend = token.owner.operation
    if call_target(psend) != PSEND_TARGET or psend.block != precv.block:
        return None
    config = _config(psend)
    if _kept_count(config) is None or len(ir.DenseIntElementsAttr(config["pairs"])) == 0:
        return None  # not ours, or one that orders a barrier and sends nothing
    return psend


def _with_int(config: dict[str, Any], value: int) -> Any:
    entries = dict(config)
    entries[OPERAND_KEPT] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), value)
    return ir.DictAttr.get(entries)


def _rebuild_precv(precv: Any, psend: Any) -> None:
    """Replaces ``precv`` by the same call with the psend's operand as a last operand."""
    operand = psend.operands[0]
    named = [precv.attributes[i] for i in range(len(precv.attributes))]
    attributes = {n.name: n.attr for n in named}
    attributes[_BACKEND_CONFIG] = _with_int(_config(precv), 1)
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
            if call_target(op) == PRECV_TARGET and _kept_count(_config(op)) == 0:
                psend = _sending_psend(op)
                if psend is not None:
                    pairs.append((op, psend))
        for precv, psend in pairs:
            psend.attributes[_BACKEND_CONFIG] = _with_int(_config(psend), 1)
            _rebuild_precv(precv, psend)
        return len(pairs)


def _wanted(platforms: Any, jaxpr: Any) -> bool:
    return "cpu" in tuple(platforms) and single_side_collective_effect in jaxpr.effects


def install() -> None:
    """Run the pass on every CPU program JAX lowers from now on (idempotent).

    Wraps JAX's ``mlir.lower_jaxpr_to_module`` (as the GPU-parity check does). Called
    through ``_compat.enable("kept_operands", ...)``. If the pass fails on a program, the
    feature switches off with a warning and the program is left as JAX lowered it.
    """
    _compat.wrap_once(mlir, "lower_jaxpr_to_module", "_jax_cpu_mpi_keeps",
                      after_lowering(_compat.KEPT_OPERANDS, _wanted, keep_psend_operands))
