"""Module pass: a precv keeps alive the operand of the psend whose token it takes.

A psend's custom call may return before its bytes have left its operand only if XLA keeps
that buffer alive and unchanged until something finishes the send. After JAX has lowered a
CPU program, this pass finds every precv whose token is the result of a psend of the same
block, gives that precv the psend's operand as an extra operand (XLA then keeps the buffer
until the precv has run) and marks the psend ``operand_kept`` (its keepers). At run time the psend
may then hand its operand itself to a receiver that is already waiting and return at once,
and the precv finishes the send before it returns (``cpp/ffi/kept_sends.h``).

The precv also gets the psend's ``u32`` result: XLA CPU orders custom calls at run time by
their buffers, so only that makes the precv run after the psend. The psends and precvs of
one step (a block's pairs whose psends depend on no precv among them: two ops in opposite
directions, a pipeline tick) form a group: each precv of the group keeps the operands of
the group's psends before it, a psend's ``operand_kept`` counts its keepers, and the last
keeper to run finishes the send, so that a device's sends of the step stay in flight
while it receives; ``group_pairs`` (the pairs of the keepers) tells a psend whether its
device receives in the group, where it may defer a send (mpi/transport.h).

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

from collections import Counter
from typing import Any

import numpy as np

from jax_cpu_mpi._src.compat import ir
from jax_cpu_mpi._src.ffi.custom_calls import (
    GROUP_PAIRS,
    OPERAND_KEPT,
    PRECV_TARGET,
    PROGRAM_RECEIVES,
    PROGRAM_SENDS,
    PSEND_TARGET,
    RUNS_COLLECTIVES,
    array_attribute,
    call_target,
    functions,
    int_attribute,
    is_private,
    operations,
    set_array_attribute,
    set_array_attributes,
    set_int_attribute,
    with_extra_operands,
    with_int_attribute,
)
from jax_cpu_mpi._src.lowering import collectives, rules
from jax_cpu_mpi._src.passes import selected_zeros


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
    with_extra_operands(precv, extra, with_int_attribute(
        precv, OPERAND_KEPT, int_attribute(precv, OPERAND_KEPT) + len(extra)))


def _defined_in(value: Any, block: Any) -> Any | None:
    """The op of ``block`` that defines ``value``, or None (a block argument, another block)."""
    if not isinstance(value, ir.OpResult):
        return None
    op = value.owner.operation
    return op if op.block == block else None


def _used_values(op: Any) -> list[Any]:
    """The values ``op`` reads: its operands and those its regions read from outside."""
    values = list(op.operands)
    for inner in operations(op):
        values.extend(inner.operands)
    return values


def _phases(block: Any, pairs: dict[Any, Any]) -> tuple[dict[Any, int], dict[Any, int]]:
    """``({psend: phase}, {op: position})`` of the kept pairs ``{precv: psend}`` of
    ``block`` and of its ops (their positions in the block).

    A psend's phase is one more than the highest phase of the pairs whose precv it depends
    on (0 if none), and a precv has its psend's phase: the psends and precvs of one step (of
    a tick) share a phase, and the next step's, which send what this one received, have
    the next.
    """
    partner = {psend: precv for precv, psend in pairs.items()}
    # Per op: 1 + the highest phase of a kept precv it depends on (0: none).
    above: dict[Any, int] = {}
    phase: dict[Any, int] = {}
    position: dict[Any, int] = {}
    for index, inner in enumerate(block.operations):
        op = inner.operation
        position[op] = index
        level = 0
        for value in _used_values(op):
            source = _defined_in(value, block)
            if source is not None:
                level = max(level, above.get(source, 0))
        if op in partner:
            phase[op] = level
        if op in pairs and pairs[op] in phase:
            level = max(level, phase[pairs[op]] + 1)
        above[op] = level
    return phase, position


def _groups(precvs: list[Any]) -> dict[Any, list[Any]]:
    """``{precv: the psends whose sends it helps finish}``.

    In each block, the kept pairs of one phase (:func:`_phases`) form a group, and each
    precv of a group keeps the operands of the group's psends that come before it in the
    block (its own psend's among them). The last of a send's keepers to run on the device
    finishes it, so that a device that sends and receives in one step (two ops in opposite
    directions, a GPipe/1F1B tick) has both directions in flight at once. Every new operand
    comes from earlier in the block, so the block stays in order and acyclic.
    """
    pairs_by_block: dict[Any, dict[Any, Any]] = {}
    for precv in precvs:
        if _moves_data(precv) and (psend := _sending_psend(precv)) is not None:
            pairs_by_block.setdefault(precv.block, {})[precv] = psend
    groups: dict[Any, list[Any]] = {}
    for block, pairs in pairs_by_block.items():
        if len(set(pairs.values())) == 1:  # one psend: its precvs keep it alone
            groups.update({precv: [psend] for precv, psend in pairs.items()})
            continue
        phase, position = _phases(block, pairs)
        by_phase: dict[int, list[Any]] = {}
        for psend in pairs.values():
            members = by_phase.setdefault(phase[psend], [])
            if psend not in members:
                members.append(psend)
        for precv, psend in pairs.items():
            groups[precv] = [p for p in by_phase[phase[psend]]
                             if position[p] < position[precv]]
    return groups


def _unique(values: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    found: list[tuple[Any, Any]] = []
    for value, layout in values:
        if all(value != seen for seen, _ in found):
            found.append((value, layout))
    return found


#: Operations whose region runs exactly once each time they run (shard_map's body, a named
#: computation), and those that run one of their regions at most once (a branch); any other
#: region (a loop's) may run its ops any number of times.
_RUN_ONCE_REGIONS = frozenset({"sdy.manual_computation", "sdy.named_computation"})
_BRANCHES = frozenset({"stablehlo.case", "stablehlo.if"})

#: A pair of one of our calls, by its call target: (target, source, destination).
Hop = tuple[str, int, int]


def _hops_of(ops: Any, funcs: dict[str, Any], calls: list[str]) -> tuple[Counter, set]:
    """How many psends and precvs of each pair run at most in one run of ``ops`` (a branch
    op counts its largest branch), and the pairs of those that may run more often (in a
    loop, a recursive call), each as (call target, source, destination)."""
    counts: Counter = Counter()
    repeat: set[Hop] = set()
    for op in ops:
        op = op.operation
        if (target := call_target(op)) in (PSEND_TARGET, PRECV_TARGET) and _moves_data(op):
            values = array_attribute(op, "pairs").tolist()
            counts.update((target, src, dst)
                          for src, dst in zip(values[::2], values[1::2], strict=True))
        elif op.name == "func.call":
            callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
            if callee in calls or callee not in funcs:
                inner, inner_repeat = Counter(), set()
                if callee in funcs:  # recursion: whatever it sends or receives may repeat
                    inner, inner_repeat = _hops_of(
                        _body(funcs[callee]), funcs, [*calls, callee, callee])
                repeat |= set(inner) | inner_repeat
            else:
                inner, inner_repeat = _hops_of(_body(funcs[callee]), funcs, [*calls, callee])
                counts.update(inner)
                repeat |= inner_repeat
        elif len(op.regions) > 0:
            regions = [_hops_of(_region_ops(r), funcs, calls) for r in op.regions]
            if op.name in _RUN_ONCE_REGIONS:
                for inner, inner_repeat in regions:
                    counts.update(inner)
                    repeat |= inner_repeat
            elif op.name in _BRANCHES:
                for inner, inner_repeat in regions:
                    counts |= inner  # the larger count of each pair
                    repeat |= inner_repeat
            else:
                for inner, inner_repeat in regions:
                    repeat |= set(inner) | inner_repeat
    return counts, repeat


def _region_ops(region: Any) -> list[Any]:
    return [op for block in region.blocks for op in block.operations]


def _body(func: Any) -> list[Any]:
    return _region_ops(func.regions[0])


def _program_hops(module: Any, runs_collectives: bool) -> tuple[np.ndarray, np.ndarray]:
    """PROGRAM_RECEIVES and PROGRAM_SENDS of the module: each pair as often as precvs
    (psends) of it run at most in a call (one of a branch counted in its branch), and
    ``(source, -1 - destination)`` for a pair whose precv (psend) may run any number of
    times (a failed call then leaves its channel suspect however many messages went through
    it); RUNS_COLLECTIVES last in the receives where the program runs collectives of ours."""
    funcs = functions(module)
    entries = [name for name, func in funcs.items() if not is_private(func)]
    counts: Counter = Counter()
    repeat: set[Hop] = set()
    for name in entries:
        inner, inner_repeat = _hops_of(_body(funcs[name]), funcs, [name])
        counts.update(inner)
        repeat |= inner_repeat

    def listed(target: str) -> list[int]:
        values = [v for (t, src, dst), n in sorted(counts.items()) if t == target
                  for v in (src, dst) * n]
        return values + [v for t, src, dst in sorted(repeat) if t == target
                         for v in (src, -1 - dst)]

    receives = listed(PRECV_TARGET) + (list(RUNS_COLLECTIVES) if runs_collectives else [])
    return (np.array(receives, dtype=np.int64),
            np.array(listed(PSEND_TARGET), dtype=np.int64))


#: Our collectives' calls (lowering/collectives.py): a program with one of them lists
#: RUNS_COLLECTIVES in PROGRAM_RECEIVES.
_COLLECTIVE_TARGETS = frozenset({collectives.ALL_REDUCE_TARGET, collectives.EXCHANGE_TARGET})


def keep_psend_operands(module: Any) -> int:
    """Runs the pass on a lowered module; returns how many precvs now keep an operand.
    Also gives every psend/precv of the module the program's receives and sends
    (PROGRAM_RECEIVES, PROGRAM_SENDS)."""
    rules.emitted_for_pass = 0
    with module.context:
        targets = [(call_target(op), op) for op in operations(module.operation)]
        ours = [op for target, op in targets if target in (PSEND_TARGET, PRECV_TARGET)
                and int_attribute(op, OPERAND_KEPT) is not None]
        runs_collectives = any(target in _COLLECTIVE_TARGETS for target, _ in targets)
        # A program with neither a psend nor a precv that moves data, nor a collective of
        # ours: its calls keep the empty lists they were lowered with, and its functions are
        # not walked again.
        if runs_collectives or any(_moves_data(op) for op in ours):
            receives, sends = _program_hops(module, runs_collectives)
            for op in ours:
                set_array_attributes(op, {PROGRAM_RECEIVES: receives, PROGRAM_SENDS: sends})
        precvs = [op for op in operations(module.operation)
                  if call_target(op) == PRECV_TARGET and int_attribute(op, OPERAND_KEPT) == 0]
        groups = _groups(precvs)
        keepers: dict[Any, list[Any]] = {}  # psend -> the precvs of its group
        for precv, group in groups.items():
            for psend in group:
                keepers.setdefault(psend, []).append(precv)
        for psend, its_keepers in keepers.items():
            set_int_attribute(psend, OPERAND_KEPT, len(its_keepers))
            receiving = np.concatenate([array_attribute(p, "pairs") for p in its_keepers])
            set_array_attribute(psend, GROUP_PAIRS, receiving)
        kept = 0
        # One at a time, each precv's extra operands found only when it is rebuilt: one may
        # be the result of a precv rebuilt (and erased) just before.
        for op in precvs:
            if not _moves_data(op):  # a barrier's ordering precv
                extra = _psends_done(op)
            else:
                group = groups.get(op, [])
                # Each psend's operand (the precv helps finish its send), and its u32
                # result: only a buffer orders the precv after the psend at run time.
                extra = _unique([(psend.operands[0], _layout(psend, 0)) for psend in group])
                extra += [(psend.results[1], _layout(op, 1)) for psend in group]
                extra += _barrier_arrays(op)
                if group:
                    # Its sender's psend is its own psend on the peer device: the sender
                    # defers where its device receives in that psend's group.
                    set_array_attribute(op, GROUP_PAIRS,
                                        array_attribute(_sending_psend(op), GROUP_PAIRS))
                    kept += 1
            if extra:
                _rebuild_precv(op, extra)
        # On the rebuilt precvs (the kept operands change no use of a result); those whose
        # caller reads no non-destination's result first: they need no select.
        selected_zeros.unread_off_destinations(module)
        selected_zeros.select_zeros(module)
        return kept


def wanted(platforms: Any, jaxpr: Any) -> bool:
    """CPU programs whose lowering emitted psend/precv calls (lowering/rules.py counts them:
    jax_cpu_mpi's and JAX's psend/precv, and a ppermute lowered as psend/precv, which carries
    no psend/precv effect)."""
    return "cpu" in tuple(platforms) and rules.emitted_for_pass > 0
