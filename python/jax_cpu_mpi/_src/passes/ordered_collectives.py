"""Module pass: our collectives run in program order, the same on every device and process.

XLA CPU runs independent custom calls in whatever order its thunk executor picks (it orders
them at run time by their buffers alone), and not necessarily the same order on every
process: two all-reduces of one group would then meet the wrong partner (MPI matches
collectives by order). After JAX has lowered a CPU program, this pass gives each collective
call of ``lowering/collectives.py`` the result of the previous one in its block as an extra
operand (unread by the handler: a buffer dependency XLA keeps), and numbers the calls of the
program (``site``, modulo ``SITES``): calls with different numbers use different
communicators and local rounds, so that calls in different blocks (a loop body and the code
around it), which this pass cannot order, never meet each other's partner either.
"""

from __future__ import annotations

from typing import Any

from jax_cpu_mpi._src.compat import ir
from jax_cpu_mpi._src.ffi.custom_calls import (
    BACKEND_CONFIG,
    call_target,
    operations,
    with_int_attribute,
)
from jax_cpu_mpi._src.lowering import collectives


def wanted(platforms: Any, jaxpr: Any) -> bool:
    """CPU programs lowered since a collective went over MPI (no module walk otherwise)."""
    return "cpu" in tuple(platforms) and collectives.pending_for_pass > 0


def _rebuild(op: Any, site: int, previous: Any | None) -> Any:
    named = [op.attributes[i] for i in range(len(op.attributes))]
    attributes = {n.name: n.attr for n in named}
    attributes[BACKEND_CONFIG] = with_int_attribute(op, "site", site)
    operands = list(op.operands)
    if previous is not None:
        layouts = list(ir.ArrayAttr(op.attributes["operand_layouts"]))
        layouts.append(ir.ArrayAttr(previous.attributes["result_layouts"])[0])
        attributes["operand_layouts"] = ir.ArrayAttr.get(layouts)
        operands.append(previous.results[0])
    new = ir.Operation.create(
        "stablehlo.custom_call", results=[r.type for r in op.results], operands=operands,
        attributes=attributes, loc=op.location, ip=ir.InsertionPoint(op))
    for old, replacement in zip(op.results, new.results, strict=True):
        old.replace_all_uses_with(replacement)
    op.erase()
    return new


def order_collectives(module: Any) -> int:
    """Runs the pass on a lowered module; returns how many calls it chained."""
    collectives.pending_for_pass = 0
    chained = 0
    with module.context:
        calls = [op for op in operations(module.operation)
                 if call_target(op) in collectives.TARGETS]
        last_in_block: list[tuple[Any, Any]] = []  # (block, the last call there)
        for site, op in enumerate(calls):
            block = op.block
            previous = next((c for b, c in last_in_block if b == block), None)
            new = _rebuild(op, site % collectives.SITES, previous)
            last_in_block = [(b, c) for b, c in last_in_block if b != block] + [(block, new)]
            chained += previous is not None
    return chained
