"""From a schedule's table to the executor's static plan: integer tables per tick x stage.

Every tick each stage runs at most one action and so produces at most one buffer shaped like
a stage activation: a forward's output (for the next chunk), a backward's input cotangent
(for the chunk before), or, for the last chunk's forward, the loss cotangent (kept on the
stage). It goes to the neighbour that owns the chunk after (before) it, or stays on the
stage (P = 1, or the loss cotangent). The receiver keeps it in a stash slot until the last
action that reads it; slots are reused as soon as they are read for the last time, so the
stash holds the schedule's live values, not all ``M`` microbatches.

Messages: one op per direction between neighbours, ``s -> s + 1`` and ``s + 1 -> s``, and for
interleaved schedules with ``P > 2`` the wrap-around ``P - 1 -> 0`` and ``0 -> P - 1`` (one op
each, so no op's pairs form a cycle, which XLA GPU rejects). A tick runs an op only with the
pairs that carry a message in that tick (``Plan.messages``), and none where none does: a
stage then waits only for a message it receives, never for a neighbour's tick as such. Each
device pair carries at most one message per tick, and every device runs the ops in the same
program order: messages match in order and no receive waits on a send that comes later.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jax_cpu_mpi._src.pipeline.schedules import Action, Schedule, ScheduleError

__all__ = [
    "BACKWARD",
    "BACKWARD_FIRST",
    "BACKWARD_INPUT",
    "FORWARD",
    "FORWARD_LAST",
    "IDLE",
    "WEIGHT",
    "Plan",
    "make_plan",
]

# What a stage computes in a tick (the branches of the executor's lax.switch).
IDLE = 0
FORWARD = 1  # y = stage(p, x), sent on
FORWARD_LAST = 2  # the last chunk: y, the microbatch's loss and the loss cotangent
BACKWARD = 3  # parameter and input cotangents
BACKWARD_FIRST = 4  # the first chunk: parameter cotangents only (no one needs the input's)
BACKWARD_INPUT = 5  # split backward (ZB): input cotangent only
WEIGHT = 6  # split backward (ZB): parameter cotangent only
BRANCHES = 7

# Where a buffer goes / what a received buffer is.
NOWHERE, ACTIVATION, COTANGENT = 0, 1, 2

# Columns of Plan.actions[tick, stage, :].
COLUMNS = ("branch", "microbatch", "virtual", "first", "x_slot", "g_slot", "local_kind",
           "local_slot")


@dataclass(frozen=True)
class Plan:
    """The executor's static tables (NumPy int32) for one schedule."""

    schedule: Schedule
    #: ``[ticks, P, len(COLUMNS)]``: per tick and stage, what to compute and where things are.
    actions: np.ndarray
    #: The message ops: pairs ``(src, dst)`` of each, in the order every device runs them.
    ops: tuple[tuple[tuple[int, int], ...], ...]
    #: ``[ticks, P, len(ops), 2]``: per receiving stage and op, (kind, slot) of what arrives.
    receives: np.ndarray
    #: Per tick, the ops it runs: ``(k, pairs)``, ``pairs`` those of ``ops[k]`` that carry a
    #: message in that tick; ops with none are left out.
    messages: tuple[tuple[tuple[int, tuple[tuple[int, int], ...]], ...], ...]
    activation_slots: int
    cotangent_slots: int

    @property
    def ticks(self) -> int:
        return int(self.actions.shape[0])


def _message_ops(P: int, V: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    ops = [tuple((s, s + 1) for s in range(P - 1)), tuple((s + 1, s) for s in range(P - 1))]
    if V > 1 and P > 2:  # for P = 2 the wrap-around pairs are those of the two ops above
        ops += [((P - 1, 0),), ((0, P - 1),)]
    return tuple(op for op in ops if op)


class _Slots:
    """Greedy slot allocation: a value occupies a slot from its arrival tick to its last
    read; a slot read for the last time in tick t can take a value that arrives in tick t
    (a tick reads before it writes)."""

    def __init__(self) -> None:
        self.free_from: list[int] = []

    def take(self, arrive: int, last_read: int) -> int:
        for i, t in enumerate(self.free_from):
            if t <= arrive:
                self.free_from[i] = last_read
                return i
        self.free_from.append(last_read)
        return len(self.free_from) - 1


def make_plan(schedule: Schedule) -> Plan:
    """The tables of a bound schedule (see the module docstring)."""
    table = schedule.table
    P, M, V = schedule.stages, schedule.microbatches, schedule.virtual_stages
    assert P is not None and M is not None
    C, split = P * V, schedule.splits_weight_gradient
    T = len(table)
    when: dict[tuple[str, int, int], int] = {}
    for t, row in enumerate(table):
        for s, a in enumerate(row):
            if a is not None:
                when[(a.kind, a.microbatch, a.virtual_stage * P + s)] = t

    # Values: the input activation of (m, c) for c > 0, and the output cotangent of (m, c).
    # Each arrives at the end of the tick that produced it and is read by later actions.
    act_slot: dict[tuple[int, int], int] = {}
    cot_slot: dict[tuple[int, int], int] = {}
    act_alloc = [_Slots() for _ in range(P)]
    cot_alloc = [_Slots() for _ in range(P)]
    events = []
    for m in range(M):
        for c in range(C):
            last_read = when[("W" if split else "B", m, c)]
            if c > 0:
                events.append((when[("F", m, c - 1)], 0, m, c, last_read))
            made = when[("F", m, c)] if c == C - 1 else when[("B", m, c + 1)]
            events.append((made, 1, m, c, last_read))
    for arrive, kind, m, c, last_read in sorted(events):
        if last_read <= arrive:  # validate_table rules this out; a plan must never rely on it
            raise ScheduleError(f"{schedule._title()}: a value of microbatch {m}, chunk {c} is "
                                f"read at tick {last_read}, before it arrives ({arrive})")
        alloc, slots = (act_alloc, act_slot) if kind == 0 else (cot_alloc, cot_slot)
        slots[(m, c)] = alloc[c % P].take(arrive, last_read)

    ops = _message_ops(P, V)
    op_of_pair = {pair: i for i, op in enumerate(ops) for pair in op}
    actions = np.zeros((T, P, len(COLUMNS)), np.int32)
    receives = np.zeros((T, P, max(len(ops), 1), 2), np.int32)
    for t, row in enumerate(table):
        for s, a in enumerate(row):
            if a is None:
                continue
            c = a.virtual_stage * P + s
            m = a.microbatch
            branch = _branch(a, c, C, split)
            cell = actions[t, s]
            cell[:4] = (branch, m, a.virtual_stage, int(c == 0))
            cell[4] = act_slot.get((m, c), 0)
            cell[5] = cot_slot[(m, c)]
            # Where this action's buffer goes.
            if branch == FORWARD_LAST:
                dest, kind, slot = s, COTANGENT, cot_slot[(m, c)]
            elif branch == FORWARD:
                dest, kind, slot = (c + 1) % P, ACTIVATION, act_slot[(m, c + 1)]
            elif branch in (BACKWARD, BACKWARD_INPUT):
                dest, kind, slot = (c - 1) % P, COTANGENT, cot_slot[(m, c - 1)]
            else:
                continue
            if dest == s:
                cell[6:8] = (kind, slot)
            else:
                receives[t, dest, op_of_pair[(s, dest)]] = (kind, slot)
    messages = tuple(
        tuple((k, sent) for k, pairs in enumerate(ops)
              if (sent := tuple((a, b) for a, b in pairs if receives[t, b, k, 0] != NOWHERE)))
        for t in range(T))
    return Plan(schedule, actions, ops, receives, messages,
                max(1, *(len(a.free_from) for a in act_alloc)),
                max(1, *(len(a.free_from) for a in cot_alloc)))


def _branch(a: Action, c: int, C: int, split: bool) -> int:
    if a.kind == "F":
        return FORWARD_LAST if c == C - 1 else FORWARD
    if a.kind == "W":
        return WEIGHT
    if split:
        return BACKWARD_INPUT if c > 0 else IDLE  # the first chunk's input needs no gradient
    return BACKWARD if c > 0 else BACKWARD_FIRST
