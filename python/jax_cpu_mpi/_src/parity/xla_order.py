"""The order in which XLA GPU's deadlock verifier meets the ops of a lowered module.

``VerifyNoCollectiveDeadlocks`` (XLA's ``hlo_verifier.cc``, at the commit jaxlib 0.10.2
pins, openxla/xla 5a9e73cb) walks ``computation->instructions()``: the order in which
instructions were *inserted* into each HLO computation, not the order JAX emitted them.
By the time the GPU compiler verifies, the computations holding psend/precv have been
rebuilt by passes that visit them depth-first from the root:

* ``CallInliner`` clones each callee (a ``func.call``, the body of a ``shard_map``) into
  its caller with ``HloComputation::Accept`` and appends the clones at the end of the
  caller's instruction list;
* the SPMD partitioner rebuilds every computation it partitions (the entry computation,
  loop bodies and conditions, conditional branches) from ``Accept`` as well:
  instructions enter the new computation in the order the visit finishes them.

``Accept`` first visits the *unreachable roots* (instructions that nothing uses: after
``HloDCE`` only side-effecting ones survive, e.g. a psend whose token is dropped), in
instruction-list order, then the root; each visit is a post-order depth-first search,
operands in operand order. So a precv comes right after the psend its token comes from,
whatever order JAX emitted them in. Later passes keep this order (a pass that rebuilds a
computation from ``MakeInstructionPostOrder`` reproduces it, since the list is already in
that post-order), so it is the order the verifier walks.

This module models that order on the StableHLO module JAX lowers (the CPU module holds
our custom calls where the GPU module holds ``send``/``recv``; the graphs are the same):

* ``func.call`` and ``sdy.manual_computation`` are inlined: a use of their result ``i``
  is a use of the callee's returned value ``i`` (XLA's tuple simplifier folds the
  ``get-tuple-element(tuple(...))`` the inliner leaves), and their side-effecting ops
  come after the caller's own in the list of unreachable roots;
* every other op with regions (``while``, ``case``, ``if``, reductions) stays one node, its
  inputs being its operands then the values its regions use from outside (XLA's export
  passes them as operands); its regions are ordered as computations of their own;
* an op is side-effecting if it is a custom call with ``has_side_effect`` (not the
  ordering-only calls of ``lowering/barrier_tokens.py``, which do not exist on GPU), a
  send/recv/infeed/outfeed, or an op with regions that holds one.

What XLA versions after 5a9e73cb change (their verifier walks the *schedule* when the
module has one, test ``VerifySendRecvDeadlockOnScheduleButNotInstructionOrder``) is
described in docs/gpu-parity.md; the schedule of XLA's GPU scheduler is not something the
StableHLO module determines.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jax_cpu_mpi._src.compat import ir

#: Ops whose bodies XLA inlines into the enclosing computation before it verifies.
_INLINED = ("func.call", "sdy.manual_computation", "sdy.named_computation")
#: StableHLO ops with side effects besides custom calls.
_SIDE_EFFECT_OPS = frozenset({
    "stablehlo.send", "stablehlo.recv", "stablehlo.infeed", "stablehlo.outfeed",
})
_TERMINATORS = frozenset({"func.return", "stablehlo.return", "sdy.return"})


#: Where an operand comes from: ``(True, block, argument number, None)`` for a block
#: argument, ``(False, producing op, result number, the op's block)`` for a result.
_Source = tuple[bool, Any, int, Any]
#: A node of a computation: the inlined call sites (keys, outermost first) and the op.
_Node = tuple[tuple[Any, ...], Any]


def _source(value: Any) -> _Source:
    owner = value.owner
    if isinstance(owner, ir.Block):
        return (True, owner, ir.BlockArgument(value).arg_number, None)
    operation = owner.operation
    return (False, operation, ir.OpResult(value).result_number, operation.block)


@dataclass
class _OpInfo:
    """What the ordering needs of one op, read from the IR once."""

    op: Any  # the op view (what callers get back)
    name: str
    #: Sources of the operands then, for an op with regions, of the values its regions
    #: use from outside it (XLA's export makes those operands too).
    sources: list[_Source]
    side_effect: bool = False
    #: The body XLA inlines in place of this op (func.call, manual computation).
    inlined: Any | None = None


class ModuleOrder:
    """Orders the ops of one lowered module as XLA's deadlock verifier meets them.

    ``is_pure_custom_call(op)`` says which side-effecting custom calls to treat as pure
    (ours that only order values and move no data).
    """

    def __init__(self, module: Any, is_pure_custom_call: Callable[[Any], bool]) -> None:
        self.functions = {
            ir.StringAttr(op.attributes["sym_name"]).value: op
            for op in module.body.operations
            if op.operation.name == "func.func"
        }
        self._is_pure_custom_call = is_pure_custom_call
        self._info: dict[Any, _OpInfo] = {}
        self._function_effects: dict[str, bool] = {}

    # ---------------------------------------------------------------- reading the IR

    def entry_block(self, name: str = "main") -> Any | None:
        function = self.functions.get(name)
        return None if function is None else function.regions[0].blocks[0]

    def info(self, op: Any) -> _OpInfo:
        """``op`` may be an op view or an operation (the cache is keyed by operation)."""
        operation = op.operation
        cached = self._info.get(operation)
        if cached is not None:
            return cached
        name = operation.name
        values = list(operation.operands)
        info = _OpInfo(op=op, name=name, sources=[], side_effect=self._own_effect(op))
        if name == "func.call":
            info.inlined = self.entry_block(self.callee(op))
        elif name in _INLINED:
            info.inlined = operation.regions[0].blocks[0]
        elif len(operation.regions):
            captures, nested_effect = self._captures_and_effect(operation)
            values += captures
            info.side_effect = info.side_effect or nested_effect
        info.sources = [_source(v) for v in values]
        self._info[operation] = info
        return info

    def _own_effect(self, op: Any) -> bool:
        operation = op.operation
        name = operation.name
        if name == "stablehlo.custom_call":
            if "has_side_effect" not in operation.attributes:
                return False
            flag = ir.BoolAttr(operation.attributes["has_side_effect"]).value
            return bool(flag) and not self._is_pure_custom_call(op)
        if name == "func.call":
            return self._function_has_effect(self.callee(op))
        return name in _SIDE_EFFECT_OPS

    def _captures_and_effect(self, operation: Any) -> tuple[list[Any], bool]:
        """The values the regions of ``operation`` use from outside it (in program
        order), and whether an op inside them has a side effect."""
        defined: set[Any] = set()
        captures: dict[Any, None] = {}  # ordered set
        effect = self._scan_regions(operation, defined, captures)
        return [v for v in captures if v not in defined], effect

    def _scan_regions(self, operation: Any, defined: set[Any],
                      captures: dict[Any, None]) -> bool:
        effect = False
        for region in operation.regions:
            for block in region.blocks:
                defined.update(block.arguments)
                for inner in block.operations:
                    for value in inner.operation.operands:
                        if value not in defined:
                            captures.setdefault(value)
                    effect = self._own_effect(inner) or effect
                    if len(inner.operation.regions) and inner.operation.name != "func.call":
                        effect = self._scan_regions(inner.operation, defined,
                                                    captures) or effect
                    defined.update(inner.operation.results)
        return effect

    def callee(self, call: Any) -> str:
        return ir.FlatSymbolRefAttr(call.operation.attributes["callee"]).value

    def _function_has_effect(self, name: str) -> bool:
        if name in self._function_effects:
            return self._function_effects[name]
        self._function_effects[name] = False  # recursion guard
        block = self.entry_block(name)
        effect = block is not None and any(self.info(op).side_effect
                                           for op in block.operations)
        self._function_effects[name] = effect
        return effect

    # ---------------------------------------------------------------- ordering

    def computation(self, block: Any) -> list[Any]:
        """The ops of the computation whose body is ``block``, in the verifier's order.

        Inlined bodies are expanded in place (an op of a callee appears once per call
        site); ops with regions of their own appear once, their regions ordered by
        calling this again on each region's block.
        """
        return _Computation(self, block).order()


class _Computation:
    """One HLO computation: ``block`` with every inlined body expanded."""

    def __init__(self, order: ModuleOrder, block: Any) -> None:
        self.order_of = order
        self.block = block
        # context -> (body block, info of the inlining op, parent context)
        self.contexts: dict[tuple[Any, ...], tuple[Any, _OpInfo | None, tuple[Any, ...]]] = {
            (): (block, None, ())}
        self._inputs: dict[_Node, list[_Node]] = {}

    def _enter(self, context: tuple[Any, ...], info: _OpInfo) -> tuple[Any, ...]:
        child = (*context, info.op.operation)
        if child not in self.contexts:
            self.contexts[child] = (info.inlined, info, context)
        return child

    def nodes(self) -> list[_Node]:
        """Every node in instruction-list order: the block's own ops in program order,
        then each inlined body's (the inliner appends them, in call order)."""
        info_of = self.order_of.info
        listed: list[_Node] = []
        pending: list[tuple[Any, ...]] = [()]
        while pending:
            context = pending.pop(0)
            inlined: list[tuple[Any, ...]] = []
            for op in self.contexts[context][0].operations:
                info = info_of(op)
                if info.inlined is not None:
                    inlined.append(self._enter(context, info))
                elif info.name not in _TERMINATORS:
                    listed.append((context, op.operation))
            pending[0:0] = inlined
        return listed

    def resolve(self, source: _Source, context: tuple[Any, ...]) -> _Node | None:
        """The node that produces ``source`` in ``context``; None for a parameter."""
        info_of = self.order_of.info
        while True:
            is_argument, owner, index, owner_block = source
            body, inliner, parent = self.contexts[context]
            if is_argument:
                if inliner is None or owner != body:
                    return None  # a parameter of this computation (or from outside it)
                source = inliner.sources[index]
                context = parent
                continue
            if owner_block != body:
                return None  # defined outside this computation: reaches it as operand
            info = info_of(owner)
            if info.inlined is None:
                return (context, owner)
            context = self._enter(context, info)
            operations = info.inlined.operations
            source = info_of(operations[len(operations) - 1]).sources[index]

    def inputs(self, node: _Node) -> list[_Node]:
        cached = self._inputs.get(node)
        if cached is None:
            context, operation = node
            cached = [producer for source in self.order_of.info(operation).sources
                      if (producer := self.resolve(source, context)) is not None]
            self._inputs[node] = cached
        return cached

    def order(self) -> list[Any]:
        info_of = self.order_of.info
        listed = self.nodes()
        operations = self.block.operations
        root_inputs = [n for source in info_of(operations[len(operations) - 1]).sources
                       if (n := self.resolve(source, ())) is not None]
        effects = [n for n in listed if info_of(n[1]).side_effect]
        used = self._used(root_inputs, effects)
        unreachable_roots = [n for n in effects if n not in used]
        visited: set[_Node] = set()
        ordered: list[_Node] = []
        for start in (*unreachable_roots, *root_inputs):
            self._post_order(start, visited, ordered)
        return [info_of(operation).op for _, operation in ordered]

    def _used(self, root_inputs: list[_Node], effects: list[_Node]) -> set[_Node]:
        """Nodes that a live node (or the root) uses, after XLA's dead-code removal."""
        used = set(root_inputs)
        live: set[_Node] = set()
        stack = [*root_inputs, *effects]
        while stack:
            node = stack.pop()
            if node in live:
                continue
            live.add(node)
            producers = self.inputs(node)
            used.update(producers)
            stack.extend(producers)
        return used

    def _post_order(self, start: _Node, visited: set[_Node], ordered: list[_Node]) -> None:
        # Iterative depth-first search, operands in order, as HloInstruction::Accept.
        if start in visited:
            return
        visited.add(start)
        stack = [(start, iter(self.inputs(start)))]
        while stack:
            node, children = stack[-1]
            for child in children:
                if child not in visited:
                    visited.add(child)
                    stack.append((child, iter(self.inputs(child))))
                    break
            else:
                stack.pop()
                ordered.append(node)
