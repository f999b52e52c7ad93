"""Module pass: our collectives run in program order, the same on every device and process.

XLA CPU runs independent custom calls in whatever order its thunk executor picks (it orders
them at run time by their buffers alone), and not necessarily the same order on every
process: two all-reduces of one group would then meet the wrong partner (MPI matches
collectives by order). After JAX has lowered a CPU program, this pass gives each collective
call of ``lowering/collectives.py`` the result of the previous one as an extra operand
(unread by the handler: a buffer dependency XLA keeps), and numbers the calls of the
program (``site``, modulo ``SITES``): calls with different numbers use different
communicators and local rounds.

First it inlines every ``func.call`` whose callee (or a function it calls) holds one of our
collectives: a nested ``jax.jit``, a jnp function or a custom_vjp rule lowers to a private
function that XLA inlines only later, so its collectives would sit in a block of their own,
unordered against the caller's (two devices of one process meeting two psums in opposite
orders wait for each other), and a callee called twice would give both calls one ``site``.

Loops and conditionals are blocks of their own too; the chain goes through them. A
``stablehlo.while`` carries the previous collective's result as one more loop value, passed
through unchanged: the loop reads it, so it starts after that collective, and the first
collective of the body reads it. The loop then carries one more value out, an s32 token
that an order-token call at the end of the body computes from the body's last collective,
and the next collective reads it: XLA writes a loop's results when all of it has run, and a
custom call's result is one it can neither fold nor replace by the value before the loop.
A conditional's branches read the previous result from above, and it gives out such a
token too (0 from a branch without collectives).

A ``shard_map`` is an ``sdy.manual_computation`` (the pass runs before Shardy's export),
whose body reads nothing from outside it: two sibling ``shard_map``s of one ``jit`` would
each chain only their own collectives, and the devices could run the two chains in opposite
orders. So a manual computation takes the previous collective's result as one more operand
and gives out its own last collective's as one more result, both replicated (each device
keeps its own value, its local type the global one), and the chain runs through it as
through a loop.

Last, each function's chain ends in one more custom call, ``collectives_end``, which reads
the last collective's result: on a node with more busy threads than cores, a device that
did not lead its process's meeting in a collective returns a pending future and resumes when
another device of the meeting enters its next one; after the last collective of a program
there is none, and this call resumes them instead. A program's devices park only where
nothing else in it can wait for another device (``park_safety``: its calls' ``park``), and
only such a program gets this call.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jax_cpu_mpi._src.compat import ir, sdy
from jax_cpu_mpi._src.ffi.custom_calls import (
    ORDER_TOKEN_TARGET,
    attribute_dict,
    call_target,
    functions,
    is_a,
    is_private,
    operations,
    partitioned,
    row_major_layout,
    set_int_attribute,
    with_extra_operands,
    with_int_attribute,
)
from jax_cpu_mpi._src.lowering import collectives
from jax_cpu_mpi._src.passes import combined_all_reduces, park_safety


def wanted(platforms: Any, jaxpr: Any) -> bool:
    """CPU programs lowered since a collective went over MPI (no module walk otherwise)."""
    return "cpu" in tuple(platforms) and collectives.pending_for_pass > 0


def _callee(call: Any) -> str:
    return ir.FlatSymbolRefAttr(call.attributes["callee"]).value


def _with_collectives(functions: dict[str, Any]) -> set[str]:
    """The functions that hold one of our collectives, or call one that does."""
    calls: dict[str, set[str]] = {}
    found: set[str] = set()
    for name, func in functions.items():
        calls[name] = set()
        for op in operations(func):
            if call_target(op) in collectives.TARGETS:
                found.add(name)
            elif op.name == "func.call":
                calls[name].add(_callee(op))
    grew = True
    while grew:
        grew = False
        for name, callees in calls.items():
            if name not in found and callees & found:
                found.add(name)
                grew = True
    return found


def _inline(call: Any, callee: Any) -> bool:
    """Replace ``call`` by a copy of its callee's body; False (nothing done) for a callee
    of several blocks (JAX lowers none)."""
    if len(callee.regions[0].blocks) != 1:
        return False
    copy = callee.clone(ip=False)
    body = copy.regions[0].blocks[0]
    for argument, operand in zip(body.arguments, call.operands, strict=True):
        argument.replace_all_uses_with(operand)
    ops = [op.operation for op in body.operations]
    returned = ops[-1]  # func.return
    for op in ops[:-1]:
        op.move_before(call)
    for result, value in zip(call.results, returned.operands, strict=True):
        result.replace_all_uses_with(value)
    call.erase()
    copy.erase()
    return True


def _symbols(attr: Any, into: set[str]) -> None:
    """The symbols ``attr`` refers to (nested in arrays and dictionaries too)."""
    if is_a(attr, ir.FlatSymbolRefAttr):
        into.add(ir.FlatSymbolRefAttr(attr).value)
    elif is_a(attr, ir.ArrayAttr):
        for a in ir.ArrayAttr(attr):
            _symbols(a, into)
    elif is_a(attr, ir.DictAttr):
        d = ir.DictAttr(attr)
        for i in range(len(d)):
            _symbols(d[i].attr, into)


def inline_calls(module: Any) -> int:
    """Inline every call of a function that holds our collectives (nested calls too), then
    erase the private functions no longer referenced; returns how many calls it inlined."""
    funcs = functions(module)
    wanted_callees = _with_collectives(funcs)
    inlined = 0
    while True:
        calls = [op for op in operations(module.operation)
                 if op.name == "func.call" and _callee(op) in wanted_callees]
        calls = [c for c in calls if _inline(c, funcs[_callee(c)])]
        if not calls:
            break
        inlined += len(calls)
    if inlined:
        used: set[str] = set()
        for op in operations(module.operation):
            for i in range(len(op.attributes)):
                if op.attributes[i].name != "sym_name":
                    _symbols(op.attributes[i].attr, used)
        for name in wanted_callees - used:
            if is_private(funcs[name]):
                funcs[name].erase()
    return inlined


#: A dependency: a value and the layout the custom call declares for it.
_Link = tuple[Any, Any]


def _link_to_result(op: Any) -> _Link | None:
    """A result of ``op`` a later collective can read (XLA runs a loop or a conditional as
    one step: reading any of its results orders the reader after all of it)."""
    for result in op.results:
        if is_a(result.type, ir.RankedTensorType):
            return result, row_major_layout(result)
    return None


def _rebuild(op: Any, site: int, previous: _Link | None) -> Any:
    return with_extra_operands(op, [previous] if previous is not None else [],
                               with_int_attribute(op, "site", site))


def _regrown(op: Any, operands: list[Any], attributes: dict[str, Any], returned: Any,
             *, every_region: list[Any] | None = None) -> Any:
    """``op`` (an op with regions, their blocks given their new arguments already) rebuilt
    with ``operands``, ``attributes`` and one more result, which its last region's
    terminator gives as ``returned`` (or, with ``every_region``, each region's terminator
    as its own value there: a conditional's branches); the uses of its results go to the
    new op's."""
    new = ir.Operation.create(
        op.name, results=[*(r.type for r in op.results), returned.type], operands=operands,
        attributes=attributes, regions=len(op.regions), loc=op.location,
        ip=ir.InsertionPoint(op))
    for old_region, new_region in zip(op.regions, new.regions, strict=True):
        old_region.blocks[0].append_to(new_region)
    values = every_region if every_region is not None else [returned]
    for region, value in zip(new.regions[len(new.regions) - len(values):], values,
                             strict=True):
        terminator = _terminator(region)
        ir.Operation.create(terminator.name, operands=[*terminator.operands, value],
                            loc=terminator.location, ip=ir.InsertionPoint(terminator))
        terminator.erase()
    for old, replacement in zip(op.results, new.results, strict=False):
        old.replace_all_uses_with(replacement)
    op.erase()
    return new


def _carry(loop: Any, link: _Link) -> tuple[Any, list[Any]]:
    """``loop`` (a stablehlo.while) rebuilt with one more loop-carried value, ``link``'s,
    passed through unchanged: the loop then reads it, so it starts after the collective
    that made it. Returns the new loop and that value's arguments in the condition and in
    the body."""
    value, _ = link
    arguments = [region.blocks[0].add_argument(value.type, loop.location)
                 for region in loop.regions]
    new = _regrown(loop, [*loop.operands, value], attribute_dict(loop), arguments[1])
    return new, arguments


def _scalar() -> Any:
    return ir.RankedTensorType.get([], ir.IntegerType.get_signless(32))


def _no_layout() -> Any:
    """A scalar's layout, as operand_layouts spells it."""
    return ir.DenseIntElementsAttr.get(
        np.zeros(0, dtype=np.int64), type=ir.RankedTensorType.get([0], ir.IndexType.get()))


def _zero(location: Any, before: Any) -> Any:
    """An s32 0 created before the op ``before``."""
    scalar = _scalar()
    return ir.Operation.create(
        "stablehlo.constant", results=[scalar],
        attributes={"value": ir.DenseElementsAttr.get_splat(
            scalar, ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 0))},
        loc=location, ip=ir.InsertionPoint(before)).results[0]


def _token(last: _Link, location: Any, before: Any) -> Any:
    """An order-token call reading ``last`` (a collective's result), created before the op
    ``before``: an s32 whose value XLA cannot know."""
    return ir.Operation.create(
        "stablehlo.custom_call", results=[_scalar()], operands=[last[0]],
        attributes={
            "call_target_name": ir.StringAttr.get(ORDER_TOKEN_TARGET),
            "api_version": ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 4),
            "has_side_effect": ir.BoolAttr.get(False),
            "backend_config": ir.DictAttr.get({}),
            "operand_layouts": ir.ArrayAttr.get([last[1]]),
            "result_layouts": ir.ArrayAttr.get([_no_layout()]),
        },
        loc=location, ip=ir.InsertionPoint(before)).results[0]


def _terminator(region: Any) -> Any:
    return list(region.blocks[0].operations)[-1].operation


def _token_out(loop: Any, last: _Link) -> _Link:
    """``loop`` (a stablehlo.while whose body has just been chained, ``last`` its body's
    last collective) rebuilt with one more loop value: an s32 token, 0 before the loop, that
    the body sets from ``last`` with an order-token call. Returns the link to the loop's
    token result, which the next collective after the loop reads.

    Neither a value the loop passes through unchanged nor the loop's trip counter will do:
    XLA replaces the first by the value before the loop and folds the second into a constant
    (both seen in compiled programs), and the collective after the loop would no longer
    wait for the loop's collectives. A custom call's result is opaque to XLA."""
    token = _token(last, loop.location, _terminator(loop.regions[1]))
    zero = _zero(loop.location, loop)
    for region in loop.regions:
        region.blocks[0].add_argument(_scalar(), loop.location)
    new = _regrown(loop, [*loop.operands, zero], attribute_dict(loop), token)
    return new.results[-1], _no_layout()


def _branch_tokens_out(conditional: Any, lasts: list[_Link | None]) -> _Link:
    """``conditional`` (a stablehlo.case or .if whose branches have just been chained,
    ``lasts`` each branch's last collective or None) rebuilt with one more result, an s32
    token: an order-token call on the branch's last collective, 0 in a branch without any.
    Returns the link to it. (A result of the conditional itself will not do: XLA and JAX
    drop results that the branches pass through, and a conditional may have none left.)"""
    values = [_token(last, conditional.location, _terminator(region)) if last is not None
              else _zero(conditional.location, _terminator(region))
              for region, last in zip(conditional.regions, lasts, strict=True)]
    new = _regrown(conditional, list(conditional.operands), attribute_dict(conditional),
                   values[0], every_region=values)
    return new.results[-1], _no_layout()


class _Chain:
    """Numbers the calls (``site``) and counts those given a dependency."""

    def __init__(self) -> None:
        self.site = 0
        self.chained = 0
        #: The last manual computation chained: its link out and its body's last link
        #: (where the chain's end goes when it ends there: SPMD wants a sharding on a
        #: side-effecting call outside one).
        self.manual_end: tuple[Any, _Link] | None = None

    def block(self, block: Any, previous: _Link | None) -> _Link | None:
        """Chain the collectives of ``block`` (and of the loops and conditionals in it)
        after ``previous``, in program order; returns the last link."""
        for op in [o.operation for o in block.operations]:
            if call_target(op) in collectives.TARGETS:
                new = _rebuild(op, self.site % collectives.SITES, previous)
                self.site += 1
                self.chained += previous is not None
                previous = new.results[0], ir.ArrayAttr(new.attributes["result_layouts"])[0]
            elif len(op.regions) and any(call_target(o) in collectives.TARGETS
                                         for o in operations(op)):
                previous = self.region_op(op, previous)
        return previous

    def region_op(self, op: Any, previous: _Link | None) -> _Link | None:
        if op.name == "stablehlo.while":
            arguments: list[Any] = [None, None]
            if previous is not None:
                op, arguments = _carry(op, previous)
            # The condition's collectives (a psum in the loop's test) read the value in the
            # condition's own region, the body's in the body's.
            lasts = []
            for region, argument in zip(op.regions, arguments, strict=True):
                inner = (argument, previous[1]) if argument is not None else None
                lasts.append(self.block(region.blocks[0], inner))
            body_last = lasts[1]
            if body_last is not None and (previous is None or body_last[0] != arguments[1]):
                return _token_out(op, body_last)
            # Collectives in the test alone (the body's would have given a token): the
            # pass-through value, or a result of the loop, as before.
            return (op.results[-1], previous[1]) if previous is not None else (
                _link_to_result(op))
        if op.name == "sdy.manual_computation" and (mesh := _mesh(op)) is not None:
            return self.manual(op, mesh, previous)
        # A conditional's branches read values from above: each branch's first collective
        # reads the previous one's result, so the conditional starts after it. (A manual
        # computation that names no mesh, which JAX does not lower, starts a chain of its
        # own.)
        if op.name in ("stablehlo.case", "stablehlo.if"):
            lasts = [self.block(region.blocks[0], previous) for region in op.regions]
            return _branch_tokens_out(op, [
                last if last is not None and (previous is None or last[0] != previous[0])
                else None for last in lasts])
        for region in op.regions:
            for block in region.blocks:
                self.block(block, None)
        return _link_to_result(op) or previous

    def manual(self, op: Any, mesh: Any, previous: _Link | None) -> _Link | None:
        """Chain the body of ``op`` (an sdy.manual_computation over ``mesh``) after
        ``previous``, through one more operand (a block argument in the body) and one more
        result."""
        body = op.regions[0].blocks[0]
        inner = None
        if previous is not None:
            inner = body.add_argument(previous[0].type, op.location), previous[1]
        last = self.block(body, inner)
        if last is None:  # nothing in the body to carry out (never: a collective has one)
            return previous
        link = _manual_link(op, mesh, previous, last)
        self.manual_end = (link[0], last)
        return link


def _shardings(op: Any, name: str) -> list[Any]:
    return list(sdy.TensorShardingPerValueAttr(op.attributes[name]).shardings)


def _mesh(op: Any) -> Any | None:
    """The mesh (or its name) of an sdy.manual_computation's shardings, None without any."""
    shardings = [*_shardings(op, "in_shardings"), *_shardings(op, "out_shardings")]
    return sdy.TensorShardingAttr(shardings[0]).mesh_or_ref if shardings else None


def _replicated(mesh: Any, value: Any) -> Any:
    """``value``'s sharding over ``mesh`` with every dimension replicated (closed)."""
    rank = ir.RankedTensorType(value.type).rank
    return sdy.TensorShardingAttr.get(
        mesh, [sdy.DimensionShardingAttr.get([], is_closed=True) for _ in range(rank)])


def _manual_link(op: Any, mesh: Any, previous: _Link | None, last: _Link) -> _Link:
    """``op`` (an sdy.manual_computation whose body has just been chained, given one more
    block argument if ``previous``) rebuilt with ``previous``'s value as one more operand
    and ``last`` (a value of its body) as one more result; returns the link to that
    result."""
    attributes = attribute_dict(op)
    ins, outs = _shardings(op, "in_shardings"), _shardings(op, "out_shardings")
    operands = list(op.operands)
    if previous is not None:
        operands.append(previous[0])
        ins.append(_replicated(mesh, previous[0]))
    outs.append(_replicated(mesh, last[0]))
    attributes["in_shardings"] = sdy.TensorShardingPerValueAttr.get(ins)
    attributes["out_shardings"] = sdy.TensorShardingPerValueAttr.get(outs)
    new = _regrown(op, operands, attributes, last[0])
    return new.results[-1], last[1]


def _end_chain(block: Any, last: _Link) -> None:
    """``collectives_end(last, *returned)`` before ``block``'s terminator: a side effect
    (XLA keeps it) that reads the last collective's result and every tensor the block
    returns, so that it runs after all of them. (``last`` alone may not do: a loop's link
    can be its trip count, which XLA may fold into a constant.)"""
    terminator = list(block.operations)[-1].operation
    links = [last]
    for value in terminator.operands:
        if is_a(value.type, ir.RankedTensorType) and all(value != v for v, _ in links):
            links.append((value, row_major_layout(value)))
    ir.Operation.create(
        "stablehlo.custom_call", results=[], operands=[v for v, _ in links],
        attributes={
            "call_target_name": ir.StringAttr.get(collectives.END_TARGET),
            "has_side_effect": ir.BoolAttr.get(True),
            "api_version": ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 4),
            "backend_config": ir.DictAttr.get({}),
            "operand_layouts": ir.ArrayAttr.get([lay for _, lay in links]),
            "result_layouts": ir.ArrayAttr.get([]),
        },
        loc=terminator.location, ip=ir.InsertionPoint(terminator))


def _multi_platform(module: Any) -> bool:
    """Whether the module was lowered for several platforms at once (``jax.export`` with
    ``platforms=["cpu", "cuda"]``): its main function then takes the platform's index, and
    each collective sits in a ``stablehlo.case`` over it, whose CPU branch alone holds our
    call."""
    for func in functions(module).values():
        if "arg_attrs" in func.attributes and "_platform_index" in str(
                func.attributes["arg_attrs"]):
            return True
    return False


def order_collectives(module: Any) -> int:
    """Runs the pass on a lowered module; returns how many calls it chained."""
    collectives.pending_for_pass = 0
    with module.context, ir.Location.unknown():
        inline_calls(module)
        combined_all_reduces.combine_all_reduces(module)
        chain = _Chain()
        # No chain's end where the program is lowered for other platforms too: outside the
        # per-platform branches it would run on all of them (no GPU has the target), and
        # such a program does not park anyway (its GPU branches hold XLA's collectives).
        ends = not _multi_platform(module)
        # Where each function's chain ends (its block, its last link, the manual
        # computation it ends in): the ends go in once the whole program is chained.
        lasts: list[tuple[Any, _Link, tuple[Any, _Link] | None]] = []
        for func in functions(module).values():
            for block in func.regions[0].blocks:
                last = chain.block(block, None)
                if last is not None:
                    lasts.append((block, last, chain.manual_end))
        # Whether its devices may park in its meetings (the lowering said no: park = 0),
        # on the whole program as the chain leaves it. Only such a program gets its chain's
        # end: it exists to resume parked devices, and elsewhere it would only be one more
        # side effect ordering the program's end and one more target of ours in an export.
        parks = park_safety.may_park(module)
        if parks:
            for op in operations(module.operation):
                if call_target(op) in collectives.TARGETS:
                    set_int_attribute(op, "park", 1)
        for block, last, manual_end in lasts if parks and ends else ():
            if manual_end is not None and manual_end[0] == last[0]:
                # The body as the rebuilt computation holds it (_regrown moved it).
                manual = last[0].owner
                _end_chain(manual.regions[0].blocks[0], manual_end[1])
            elif call_target(last[0].owner) in collectives.TARGETS and not partitioned(
                    module):
                _end_chain(block, last)
            # Otherwise (the chain ends in a loop or conditional of an SPMD program) no
            # end: parked devices resume a little later (Resumer::kResumeAfter).
    return chain.chained
