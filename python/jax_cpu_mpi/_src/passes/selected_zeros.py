"""Module pass step: the zeros of a precv on a device that is no destination, selected by
the program where it reads them rather than written by the precv.

A precv's output on a device that is no destination of its pairs is zeros (``ppermute``'s
semantics). Written by the precv (``cpp/local/zero_fill.cc``), they are a pass over the output
in every step, on the critical path of a two-op exchange: each device is no destination of
one of the two ops, and both devices fill in the same phase of the step.

Where every user of the result is an elementwise op that XLA fuses with its operands (an
``add``/``or``/... of the two ops' results, a ``select`` such as ``jnp.where(axis_index == 0,
a, b)``, the update of a ``dynamic_update_slice``), the users here read
``select(is_destination, result, 0)`` instead, ``is_destination`` looked up by the precv's
partition id, and the precv is marked ``zero_fill = 0``: XLA fuses the select into each user,
which reads zeros without anything writing them, and the precv leaves its output unwritten
on a device that is no destination. Nothing else reads that output, so no one sees its
bytes. A result that anything else uses (a loop carry, a program output, a call, a slice)
keeps the precv's fill: there the select would be a pass of its own on the destination too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jax_cpu_mpi._src.compat import hlo, ir
from jax_cpu_mpi._src.ffi.custom_calls import (
    OPERAND_KEPT,
    PRECV_TARGET,
    ZERO_FILL,
    array_attribute,
    call_target,
    functions,
    int_attribute,
    is_a,
    is_private,
    operations,
    set_int_attribute,
)

#: Elementwise ops that XLA fuses with an elementwise operand (any operand position).
_ELEMENTWISE = frozenset(f"stablehlo.{name}" for name in (
    "add", "subtract", "multiply", "and", "or", "xor", "maximum", "minimum"))


def _user(use: Any) -> Any:
    """The operation that has ``use``, or that defines a value (the bindings give an OpView
    or an Operation)."""
    return getattr(use.owner, "operation", use.owner)


def _is_bitcast(op: Any) -> bool:
    """A reshape, or a broadcast that only adds dimensions of size 1 (JAX's
    ``expand_dims``, as in ``dynamic_update_index_in_dim``): the same elements."""
    if op.name == "stablehlo.reshape":
        return True
    if op.name != "stablehlo.broadcast_in_dim":
        return False
    source, target = (ir.RankedTensorType(v.type) for v in (op.operands[0], op.results[0]))
    return int(np.prod(source.shape)) == int(np.prod(target.shape))


def _fuses_select(use: Any, funcs: dict[str, Any], depth: int = 0) -> bool:
    """Whether the user of ``use`` reads the operand elementwise, fused with its producer:
    directly, through a reshape (:func:`_is_bitcast`), or in a private
    function it calls (``jnp.where`` is such a call; XLA inlines calls before it fuses),
    whose every use of that argument does."""
    user = _user(use)
    name = user.name
    if _is_bitcast(user) and depth < 4:  # fused as well
        uses = list(user.results[0].uses)
        return bool(uses) and all(_fuses_select(u, funcs, depth + 1) for u in uses)
    if name == "func.call" and depth < 4:
        callee = funcs.get(ir.FlatSymbolRefAttr(user.attributes["callee"]).value)
        if callee is None or not is_private(callee):
            return False
        argument = callee.regions[0].blocks[0].arguments[use.operand_number]
        uses = list(argument.uses)
        return bool(uses) and all(_fuses_select(u, funcs, depth + 1) for u in uses)
    if name in _ELEMENTWISE:
        return True
    if name == "stablehlo.select":  # the values, not the predicate
        return use.operand_number in (1, 2)
    if name == "stablehlo.dynamic_update_slice":  # the update, not the operand it goes into
        return use.operand_number == 1
    return False


def _zero(element: Any) -> Any | None:
    """The zero of an integer or float element type, None for any other (complex)."""
    if is_a(element, ir.IntegerType):
        return ir.IntegerAttr.get(element, 0)
    if is_a(element, ir.FloatType):
        return ir.FloatAttr.get(element, 0.0)
    return None


def _candidates(module: Any) -> list[Any]:
    """The precvs that move data, still fill, and whose every use fuses a select."""
    found = []
    funcs = functions(module)
    for op in operations(module.operation):
        if call_target(op) != PRECV_TARGET or int_attribute(op, OPERAND_KEPT) is None:
            continue
        if int_attribute(op, ZERO_FILL) != 1 or array_attribute(op, "pairs").size == 0:
            continue
        result = op.results[0]
        if not is_a(result.type, ir.RankedTensorType):
            continue
        uses = list(result.uses)
        if not uses or not all(_fuses_select(u, funcs) and _user(u).block == op.block
                               for u in uses):
            continue
        if _zero(ir.RankedTensorType(result.type).element_type) is None:
            continue
        found.append(op)
    return found


def _first_user(op: Any) -> Any:
    """The first op of ``op``'s block that uses its result (every use is in that block)."""
    users = [_user(u) for u in op.results[0].uses]
    # _candidates kept only precvs whose every use is in their block: one is found.
    return next(inner.operation for inner in op.block.operations
                if inner.operation in users)


def select_zeros(module: Any) -> int:
    """Rewrites the precvs whose users all fuse a select (module docstring); returns how many.
    Runs inside the module's context."""
    rewritten = 0
    with ir.Location.unknown():
        candidates = _candidates(module)
    for op in candidates:
        result = op.results[0]
        tensor = ir.RankedTensorType(result.type)
        pairs = array_attribute(op, "pairs").reshape(-1, 2)
        partitions = array_attribute(op, "device_index").size
        is_destination = np.zeros(partitions, dtype=np.int32)
        is_destination[pairs[:, 1]] = 1
        if is_destination.all():  # a cycle: every device receives, nothing to select
            continue
        with ir.Location.unknown(), ir.InsertionPoint(_first_user(op)):
            i1 = ir.IntegerType.get_signless(1)
            table = hlo.constant(ir.DenseElementsAttr.get(is_destination))
            # The precv's own partition id (operand 1), as the handler looks itself up.
            picked = hlo.dynamic_slice(table, [op.operands[1]],
                                       ir.DenseI64ArrayAttr.get([1]))
            one = hlo.reshape(ir.RankedTensorType.get([], table.type.element_type), picked)
            scalar = hlo.compare(one, hlo.constant(ir.DenseElementsAttr.get(np.int32(0))),
                                 hlo.ComparisonDirectionAttr.get("NE"))
            mask = hlo.broadcast_in_dim(ir.RankedTensorType.get(tensor.shape, i1), scalar,
                                        ir.DenseI64ArrayAttr.get([]))
            zero = hlo.constant(ir.DenseElementsAttr.get_splat(
                ir.RankedTensorType.get([], tensor.element_type),
                _zero(tensor.element_type)))
            zeros = hlo.broadcast_in_dim(tensor, zero, ir.DenseI64ArrayAttr.get([]))
            selected = hlo.select(mask, result, zeros)
        result.replace_all_uses_except(selected, _user(selected))
        set_int_attribute(op, ZERO_FILL, 0)
        rewritten += 1
    return rewritten
