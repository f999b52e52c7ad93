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
device receives in the group, where it may defer a send (mpi/transport.h). Between
processes each precv of a group of several also carries the others' byte counts, pairs and
descriptions (``announce``): the first of them to run on a device sends the ready signals
of the others' receives before its own zero-fill or receive, so that their senders need not
wait for it (cpp/ffi/p2p_handlers.cc).

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

import numpy as np

from jax_cpu_mpi._src.compat import ir
from jax_cpu_mpi._src.ffi.custom_calls import (
    ANNOUNCE,
    ANNOUNCE_OPERANDS,
    GROUP_PAIRS,
    OPERAND_KEPT,
    PRECV_TARGET,
    PSEND_TARGET,
    array_attribute,
    call_target,
    int_attribute,
    operations,
    set_array_attribute,
    set_int_attribute,
    set_string_attribute,
    string_attribute,
    with_extra_operands,
    with_int_attribute,
)
from jax_cpu_mpi._src.lowering import rules
from jax_cpu_mpi._src.passes.combined_all_reduces import _bytes


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


def _groups(precvs: list[Any]) -> tuple[dict[Any, list[Any]], dict[Any, list[Any]]]:
    """``({precv: the psends whose sends it helps finish}, {precv: its group's precvs})``.

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
    members: dict[Any, list[Any]] = {}
    for block, pairs in pairs_by_block.items():
        if len(set(pairs.values())) == 1:  # one psend: its precvs keep it alone
            groups.update({precv: [psend] for precv, psend in pairs.items()})
            together = list(pairs)
            members.update(dict.fromkeys(together, together))
            continue
        phase, position = _phases(block, pairs)
        by_phase: dict[int, list[Any]] = {}
        precvs_by_phase: dict[int, list[Any]] = {}
        for precv, psend in pairs.items():
            psends = by_phase.setdefault(phase[psend], [])
            if psend not in psends:
                psends.append(psend)
            precvs_by_phase.setdefault(phase[psend], []).append(precv)
        for precv, psend in pairs.items():
            groups[precv] = [p for p in by_phase[phase[psend]]
                             if position[p] < position[precv]]
            members[precv] = precvs_by_phase[phase[psend]]
    return groups, members


def _one_process(op: Any) -> bool:
    """Whether the program of ``op`` runs in one process: its messages go through the
    mailbox, which reads no ready signals."""
    return bool(np.unique(array_attribute(op, "device_process")).size < 2)


def _announced(members: list[Any], key: int) -> dict[Any, tuple[np.ndarray, str]]:
    """The ``announce`` and ``announce_operands`` attributes of each precv of the group
    ``key`` (numbered in the module) whose precvs are ``members``; empty if none announces.

    ``announce``: ``[key, len(members)]``, then, for each other member whose receive the
    precv may announce at run time (its ready signal sent before the precv's own zero-fill
    or receive: cpp/ffi/p2p_handlers.cc), that member's output's byte count, its pair count
    and its pairs; ``announce_operands``: those members' descriptions, one a line. XLA runs
    the group's precvs of a device in an order of its choosing: the first of them to run
    announces the others, and every member counts itself.

    A member that shares a pair with another member is announced by none: the two would
    share a channel, and a signal sent for the channel's next message, with one member's
    byte count and description, might meet the other's.
    """
    if len(members) < 2 or _one_process(members[0]):
        return {}
    pairs = [[tuple(p) for p in array_attribute(op, "pairs").reshape(-1, 2).tolist()]
             for op in members]
    uses: dict[tuple[int, int], int] = {}
    for found in pairs:
        for pair in set(found):
            uses[pair] = uses.get(pair, 0) + 1
    records: list[tuple[list[int], str] | None] = []
    for op, found in zip(members, pairs, strict=True):
        try:
            size = _bytes(ir.RankedTensorType(op.results[0].type))
        except ValueError:  # no width known: not announced (it signals when it receives)
            size = None
        if size is None or any(uses[pair] > 1 for pair in found):
            records.append(None)
            continue
        records.append(([size, len(found), *(i for pair in found for i in pair)],
                        string_attribute(op, "operand")))
    if sum(r is not None for r in records) == 0:
        return {}
    result = {}
    for op in members:
        flat, descriptions = [key, len(members)], []
        for other, record in zip(members, records, strict=True):
            if other != op and record is not None:
                flat += record[0]
                descriptions.append(record[1])
        result[op] = (np.asarray(flat, dtype=np.int64), "\n".join(descriptions))
    return result


def _unique(values: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    found: list[tuple[Any, Any]] = []
    for value, layout in values:
        if all(value != seen for seen, _ in found):
            found.append((value, layout))
    return found


def keep_psend_operands(module: Any) -> int:
    """Runs the pass on a lowered module; returns how many precvs now keep an operand."""
    rules.emitted_for_pass = 0
    with module.context:
        precvs = [op for op in operations(module.operation)
                  if call_target(op) == PRECV_TARGET and int_attribute(op, OPERAND_KEPT) == 0]
        groups, members = _groups(precvs)
        # By position, read before any call changes: an MLIR operation's hash follows its
        # attributes, so a changed one is no longer found as a key.
        by_group: dict[int, tuple[np.ndarray, str]] = {}
        group_lists = {id(m): m for m in members.values()}
        for key, group_members in enumerate(group_lists.values(), start=1):
            by_group.update({id(op): a for op, a in _announced(group_members, key).items()})
        announced = [by_group.get(id(op)) for op in precvs]
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
        for op, announce in zip(precvs, announced, strict=True):
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
                if announce is not None:
                    set_array_attribute(op, ANNOUNCE, announce[0])
                    set_string_attribute(op, ANNOUNCE_OPERANDS, announce[1])
            if extra:
                _rebuild_precv(op, extra)
        return kept


def wanted(platforms: Any, jaxpr: Any) -> bool:
    """CPU programs whose lowering emitted psend/precv calls (lowering/rules.py counts them:
    jax_cpu_mpi's and JAX's psend/precv, and a ppermute lowered as psend/precv, which carries
    no psend/precv effect)."""
    return "cpu" in tuple(platforms) and rules.emitted_for_pass > 0
