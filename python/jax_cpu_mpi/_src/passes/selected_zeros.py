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

A loop carry is the exception where the reading comes after the loop: a precv in a
``while`` body whose result only becomes the next carry (directly, or returned from the
private function the body calls), where the loop never reads that carry and the carry's
first value is a precv with the same destinations (which still writes its zeros, once per
call), has every user of the loop's result read ``select(is_destination, result, 0)``
when they all fuse it: the precv in the body then writes no zeros at any step. A
non-destination's carry holds zeros before the loop and whatever its unwritten buffer holds
after it, and the select gives zeros for both; on a destination it is the received bytes
(a two-op exchange keeping each op's result in the carry and combining them after the loop,
as ``psend2/scan`` does, or a pipeline keeping each received buffer).

A precv whose caller says it never reads a non-destination's result
(``ops.p2p.precv_unread_off_destinations``: the pipeline executor, whose non-destinations
store what they get in a slot no tick reads) is marked ``zero_fill = 0`` with nothing
selected: the call's location names the scope (a call without it fills, as before).
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
from jax_cpu_mpi._src.ops.p2p import UNREAD_OFF_DESTINATIONS

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


def _unused(value: Any, funcs: dict[str, Any], depth: int = 0) -> bool:
    """Whether nothing reads ``value``: it has no use but as the argument of private
    functions (a loop body's ``closed_call``) that do not read it either."""
    for use in value.uses:
        user = _user(use)
        if user.name != "func.call" or depth >= 4:
            return False
        callee = funcs.get(ir.FlatSymbolRefAttr(user.attributes["callee"]).value)
        if callee is None or not is_private(callee):
            return False
        if not _unused(callee.regions[0].blocks[0].arguments[use.operand_number], funcs,
                       depth + 1):
            return False
    return True


def _call_sites(module: Any) -> dict[str, list[Any]]:
    """The ``func.call`` operations of the module, by callee."""
    sites: dict[str, list[Any]] = {}
    for op in operations(module.operation):
        if op.name == "func.call":
            sites.setdefault(ir.FlatSymbolRefAttr(op.attributes["callee"]).value, []).append(op)
    return sites


def _carry_of(value: Any, funcs: dict[str, Any], sites: dict[str, list[Any]],
              depth: int = 0) -> tuple[Any, int] | None:
    """``(loop, k)`` where ``value``'s one use makes it the next value of the ``k``-th carry
    of a ``stablehlo.while`` that neither its body nor its condition reads: returned by the
    body, directly or
    from the private functions it calls (each called once, so that the rewrite changes no
    other call), else None."""
    uses = list(value.uses)
    if len(uses) != 1 or depth >= 4:
        return None
    use = uses[0]
    user = _user(use)
    owner = user.parent
    if user.name == "func.return":
        if owner is None or owner.name != "func.func" or not is_private(owner):
            return None
        called = sites.get(ir.StringAttr(owner.attributes["sym_name"]).value, [])
        if len(called) != 1:
            return None
        return _carry_of(called[0].results[use.operand_number], funcs, sites, depth + 1)
    if user.name != "stablehlo.return" or owner is None or owner.name != "stablehlo.while":
        return None
    k = use.operand_number
    cond, body = (region.blocks[0] for region in owner.regions)
    if (user.block != body or not _unused(body.arguments[k], funcs)
            or not _unused(cond.arguments[k], funcs)):
        return None
    return owner, k


def _destinations(op: Any) -> tuple[int, frozenset[int]]:
    """A precv's partition count and destination partitions."""
    pairs = array_attribute(op, "pairs").reshape(-1, 2)
    return array_attribute(op, "device_index").size, frozenset(int(d) for d in pairs[:, 1])


def _carried(op: Any, funcs: dict[str, Any], sites: dict[str, list[Any]]) -> Any | None:
    """The loop result that carries ``op``'s result out of its loop (module docstring), where
    every use of it fuses a select and the carry starts from a precv with the same
    destinations that writes its zeros; else None."""
    found = _carry_of(op.results[0], funcs, sites)
    if found is None:
        return None
    loop, k = found
    first = loop.operands[k].owner  # a Block where the carry starts from an argument
    first = getattr(first, "operation", first)
    if (isinstance(first, ir.Block) or call_target(first) != PRECV_TARGET
            or int_attribute(first, OPERAND_KEPT) is None
            or int_attribute(first, ZERO_FILL) != 1
            or _destinations(first) != _destinations(op)):
        return None
    result = loop.results[k]
    uses = list(result.uses)
    if not uses or not all(_fuses_select(u, funcs) and _user(u).block == loop.block
                           for u in uses):
        return None
    return result


def _zero(element: Any) -> Any | None:
    """The zero of an integer or float element type, None for any other (complex)."""
    if is_a(element, ir.IntegerType):
        return ir.IntegerAttr.get(element, 0)
    if is_a(element, ir.FloatType):
        return ir.FloatAttr.get(element, 0.0)
    return None


def _candidates(module: Any) -> list[tuple[Any, Any]]:
    """``(precv, value)``: the precvs that move data and still fill, with the value whose
    every use fuses a select: the precv's result, or the loop result that carries it
    (:func:`_carried`)."""
    found = []
    funcs = functions(module)
    sites = _call_sites(module)
    for op in operations(module.operation):
        if call_target(op) != PRECV_TARGET or int_attribute(op, OPERAND_KEPT) is None:
            continue
        if int_attribute(op, ZERO_FILL) != 1 or array_attribute(op, "pairs").size == 0:
            continue
        result = op.results[0]
        if not is_a(result.type, ir.RankedTensorType):
            continue
        if _zero(ir.RankedTensorType(result.type).element_type) is None:
            continue
        uses = list(result.uses)
        if uses and all(_fuses_select(u, funcs) and _user(u).block == op.block
                        for u in uses):
            found.append((op, result))
        elif (carried := _carried(op, funcs, sites)) is not None:
            found.append((op, carried))
    return found


def _first_user(value: Any) -> Any:
    """The first op of the block that defines ``value`` that uses it (every use is in that
    block)."""
    users = [_user(u) for u in value.uses]
    # _candidates kept only values whose every use is in their block: one is found.
    return next(inner.operation for inner in _user(value).block.operations
                if inner.operation in users)


def unread_off_destinations(module: Any) -> int:
    """Marks ``zero_fill = 0`` the precvs whose caller never reads a non-destination's result
    (module docstring); returns how many. Runs inside the module's context."""
    marked = 0
    for op in operations(module.operation):
        if call_target(op) != PRECV_TARGET or int_attribute(op, OPERAND_KEPT) is None:
            continue
        if int_attribute(op, ZERO_FILL) != 1 or array_attribute(op, "pairs").size == 0:
            continue
        # JAX lowers the call inline, located at its equation: the scope is in the name.
        if UNREAD_OFF_DESTINATIONS in str(op.location):
            set_int_attribute(op, ZERO_FILL, 0)
            marked += 1
    return marked


def select_zeros(module: Any) -> int:
    """Rewrites the precvs whose users all fuse a select (module docstring); returns how many.
    Runs inside the module's context."""
    rewritten = 0
    with ir.Location.unknown():
        candidates = _candidates(module)
    for op, result in candidates:
        tensor = ir.RankedTensorType(result.type)
        pairs = array_attribute(op, "pairs").reshape(-1, 2)
        partitions = array_attribute(op, "device_index").size
        is_destination = np.zeros(partitions, dtype=np.int32)
        is_destination[pairs[:, 1]] = 1
        if is_destination.all():  # a cycle: every device receives, nothing to select
            continue
        with ir.Location.unknown(), ir.InsertionPoint(_first_user(result)):
            i1 = ir.IntegerType.get_signless(1)
            table = hlo.constant(ir.DenseElementsAttr.get(is_destination))
            # The precv's own partition id (operand 1), as the handler looks itself up; a
            # loop result's, outside the loop, of its own (the same value).
            partition = (op.operands[1] if result == op.results[0]
                         else hlo.partition_id())
            picked = hlo.dynamic_slice(table, [partition], ir.DenseI64ArrayAttr.get([1]))
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
