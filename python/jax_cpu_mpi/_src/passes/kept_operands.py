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

A precv whose token went through an ``optimization_barrier`` with arrays (JAX's "precv
after the ppermute" tip; the leaves of a pytree precv, ops/p2p.py) also gets those arrays
as operands: XLA CPU orders custom calls at run time by their buffers, not their tokens,
so only then does the precv really run after them.
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
from jax_cpu_mpi._src.lowering import collectives


def _token_sources(token: Any) -> list[Any]:
    """The ops that made ``token``, looking through ``after_all`` and the token results of
    ``optimization_barrier`` (the CPU barrier lowering of lowering/barrier_tokens.py)."""
    if not isinstance(token, ir.OpResult):
        return []  # a block argument: a loop carry, a function argument...
    op = token.owner.operation
    if op.name == "stablehlo.after_all":
        return [source for operand in op.operands for source in _token_sources(operand)]
    if op.name == "stablehlo.optimization_barrier":
        return _token_sources(op.operands[token.result_number])
    return [op]


def _moves_data(op: Any) -> bool:
    """A psend/precv of our lowering with pairs (not one that orders a barrier)."""
    return int_attribute(op, OPERAND_KEPT) is not None and array_attribute(op, "pairs").size > 0


def _sending_psend(precv: Any) -> Any | None:
    """The psend (of our lowering, moving data) whose token ``precv`` takes, in its block."""
    psends = [op for op in _token_sources(precv.operands[0])
              if call_target(op) == PSEND_TARGET and _moves_data(op)]
    if len(psends) != 1 or psends[0].block != precv.block:
        return None
    return psends[0]


def _layout(op: Any, index: int) -> Any:
    return ir.ArrayAttr(op.attributes["operand_layouts"])[index]


def _barrier_arrays(precv: Any) -> list[tuple[Any, Any]]:
    """``(array, layout)`` of each barrier array ``precv``'s token waits for, in its block.

    A barrier's token result waits for its arrays through our ordering psend of each, but
    XLA CPU orders custom calls at run time by their buffers alone, not by tokens: the
    array itself, an operand of the precv, is a dependency XLA keeps.
    """
    found = []
    for op in _token_sources(precv.operands[0]):
        if call_target(op) != PSEND_TARGET or _moves_data(op):
            continue
        array = op.operands[0]
        if isinstance(array, ir.OpResult) and array.owner.operation.block == precv.block:
            found.append((array, _layout(op, 0)))
    return found


def _psends_done(ordering: Any) -> list[tuple[Any, Any]]:
    """``(u32 result, layout)`` of each data psend that the ordering precv ``ordering`` (a
    barrier's array after its tokens) waits for by token, in its block: only that buffer
    makes the barrier's arrays wait for the psend at run time."""
    return [(op.results[1], _layout(ordering, 1))
            for op in _token_sources(ordering.operands[0])
            if call_target(op) == PSEND_TARGET and _moves_data(op)
            and len(op.results) == 2 and op.block == ordering.block]


def _rebuild_precv(precv: Any, extra: list[tuple[Any, Any]]) -> None:
    """Replaces ``precv`` by the same call with more last operands, ``(value, layout)`` each.
    The handler finishes any kept send of each such operand; for a value no psend sends
    that is a no-op, and the operand only orders the precv after it."""
    named = [precv.attributes[i] for i in range(len(precv.attributes))]
    attributes = {n.name: n.attr for n in named}
    attributes[BACKEND_CONFIG] = with_int_attribute(
        precv, OPERAND_KEPT, int_attribute(precv, OPERAND_KEPT) + len(extra))
    layouts = list(ir.ArrayAttr(precv.attributes["operand_layouts"]))
    layouts += [layout for _, layout in extra]
    attributes["operand_layouts"] = ir.ArrayAttr.get(layouts)
    new = ir.Operation.create(
        "stablehlo.custom_call", results=[r.type for r in precv.results],
        operands=[*precv.operands, *(value for value, _ in extra)], attributes=attributes,
        loc=precv.location, ip=ir.InsertionPoint(precv))
    for old, replacement in zip(precv.results, new.results, strict=True):
        old.replace_all_uses_with(replacement)
    precv.erase()


def keep_psend_operands(module: Any) -> int:
    """Runs the pass on a lowered module; returns how many precvs now keep an operand."""
    collectives.ppermutes_pending_for_pass = 0
    with module.context:
        precvs = [op for op in operations(module.operation)
                  if call_target(op) == PRECV_TARGET and int_attribute(op, OPERAND_KEPT) == 0]
        kept = 0
        # One at a time, each precv's extra operands found only when it is rebuilt: one may
        # be the result of a precv rebuilt (and erased) just before.
        for op in precvs:
            if not _moves_data(op):  # a barrier's ordering precv
                extra = _psends_done(op)
            else:
                psend = _sending_psend(op)
                extra = [(psend.operands[0], _layout(psend, 0))] if psend is not None else []
                extra += _barrier_arrays(op)
                if psend is not None:
                    set_int_attribute(psend, OPERAND_KEPT, 1)
                    kept += 1
            if extra:
                _rebuild_precv(op, extra)
        return kept


def wanted(platforms: Any, jaxpr: Any) -> bool:
    """CPU programs with psend/precv (they carry the effect; jit and shard_map propagate it),
    or with a ppermute lowered as psend/precv (no effect: lowering/collectives.py counts it)."""
    return "cpu" in tuple(platforms) and (single_side_collective_effect in jaxpr.effects
                                          or collectives.ppermutes_pending_for_pass > 0)
