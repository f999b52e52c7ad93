"""From a schedule's table to the executor's static plan: integer tables per tick x stage.

Every tick each stage runs at most one action and so produces at most one buffer shaped like
a stage activation: a forward's output (for the next chunk), a backward's input cotangent
(for the chunk before), or, for the last chunk's forward, the loss cotangent (kept on the
stage). The buffer goes into the stage's stash: into the slot its reader takes it from when
that reader is on the same stage, else into an outbox slot until it is sent.

**When a message is sent.** A tick is: the action, then the tick's messages. A message goes
from its producing stage to its consuming stage in one op (a psend and its precv, adjacent,
as XLA GPU requires) at some tick ``tm`` from the tick that produces the value up to the
tick before the first action that reads it. On CPU the psend returns at once and the precv
waits, so a message at ``tm`` holds the consumer, at the end of its tick ``tm``, until the
producer has finished its tick ``tm``. Sent as soon as it is made, a message makes the
consumer wait for the producer's progress although it needs the value only ticks later;
sent just before it is needed, it makes the consumer wait for the producer's later actions.
The plan therefore times a dataflow run of the table (every action starts once its stage is
free and its inputs are made) with a cost model of the actions (:data:`ACTION_COST`), and
sends each message, of the ticks in its range at which that run has the producer done no
later than the consumer (the receive then costs the run no wait), at the one where the
consumer is furthest behind: a producer late by less than that margin (a busy core, a
device that starts its step late) still costs no wait. Where no tick has the producer
done in time, at the tick with the shortest wait. For two stages this reproduces the
dataflow run exactly for every schedule; with more, the consumer still waits for actions of
the producer it does not need, but less than when every message is sent as it is made.
Costs off the model cost GPipe and 1F1B no wait at all, the others little (tested).

**Ops.** One op per direction between neighbours, ``s -> s + 1`` and ``s + 1 -> s``, and for
interleaved schedules with ``P > 2`` the wrap-around ``P - 1 -> 0`` and ``0 -> P - 1`` (one op
each, so no op's pairs form a cycle, which XLA GPU rejects). A tick runs an op only with the
pairs that carry a message in that tick (``Plan.messages``), and none where none does: a
stage waits only for a message it receives, never for a neighbour's tick as such. Where two
messages of one pair fall into the same tick, the op packs both into its one psend
(``Plan.packed``): one channel never carries two psends in one tick. Every device runs a
tick's ops in the same program order: messages match in order and no receive waits on a
send that comes later.

**Slots.** Each value occupies a stash slot from its write to its last read; a slot is
reused as soon as its value is read for the last time, so the stash holds the schedule's
live values, not all ``M`` microbatches. Within a tick the action reads first, then its
buffer is written, then the messages read what they send, then what they bring is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jax_cpu_mpi._src.pipeline.schedules import Action, Schedule, ScheduleError, dataflow_clock

__all__ = [
    "ACTION_COST",
    "BACKWARD",
    "BACKWARD_FIRST",
    "BACKWARD_FIRST_WITH_INPUT",
    "BACKWARD_INPUT",
    "BACKWARD_INPUT_FIRST",
    "FORWARD",
    "FORWARD_LAST",
    "IDLE",
    "KEPT_ACTION_COST",
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
BACKWARD_FIRST_WITH_INPUT = 7  # the first chunk, input gradients asked for: both cotangents
BACKWARD_INPUT_FIRST = 8  # split, the first chunk, input gradients asked for: its input's
BRANCHES = 9

#: The cost model that times the dataflow run which places the messages (module docstring),
#: in forwards: a backward recomputes its chunk's forward under ``jax.vjp`` (1), then forms
#: the parameter and the input cotangent, each about a forward's work for dense layers.
ACTION_COST = {IDLE: 0.0, FORWARD: 1.0, FORWARD_LAST: 1.0, BACKWARD: 3.0, BACKWARD_FIRST: 2.0,
               BACKWARD_INPUT: 2.0, WEIGHT: 2.0, BACKWARD_FIRST_WITH_INPUT: 3.0,
               BACKWARD_INPUT_FIRST: 2.0}

#: The same with ``remat=False``: a backward starts from the kept residuals (no forward).
KEPT_ACTION_COST = {IDLE: 0.0, FORWARD: 1.0, FORWARD_LAST: 1.0, BACKWARD: 2.0,
                    BACKWARD_FIRST: 1.0, BACKWARD_INPUT: 1.0, WEIGHT: 1.0,
                    BACKWARD_FIRST_WITH_INPUT: 2.0, BACKWARD_INPUT_FIRST: 1.0}

# Columns of Plan.actions[tick, stage, :]; slots are stash indices, Plan.slots the scratch
# slot (written, never read). ``kept_slot``: with ``remat=False``, where the (microbatch,
# chunk)'s residuals are kept from its forward to its last backward action; 0 in a cell
# that keeps nothing (idle, or ``remat=True``). The kept residuals have no scratch slot: only
# a forward writes them, into its own slot, so one would be a whole slot of every residual
# (a fifth of them with 4 slots) zeroed every step for nothing.
COLUMNS = ("branch", "microbatch", "virtual", "first", "x_slot", "g_slot", "out_slot",
           "kept_slot")

# Phases of a tick, for slot lifetimes (module docstring).
_READ, _WRITE, _SEND, _ARRIVE = range(4)


@dataclass(frozen=True)
class Plan:
    """The executor's static tables (NumPy int32) for one schedule."""

    schedule: Schedule
    #: Whether the first chunk's backward also forms the microbatches' cotangents.
    input_grads: bool
    #: ``[ticks, P, len(COLUMNS)]``: per tick and stage, what to compute and where things are.
    actions: np.ndarray
    #: The message ops: pairs ``(src, dst)`` of each, in the order every device runs them.
    ops: tuple[tuple[tuple[int, int], ...], ...]
    #: Per tick, the ops it runs in program order: ``(k, pairs)``, ``pairs`` those of
    #: ``ops[k]`` that carry a message in that tick; ops with none are left out. Each op runs
    #: at most once per tick.
    messages: tuple[tuple[tuple[int, tuple[tuple[int, int], ...]], ...], ...]
    #: ``[ticks, P, entries, packed]``: per tick, stage and entry of ``messages[tick]``, the
    #: slots the stage sends from, in the order they are packed (the scratch slot where it
    #: sends nothing).
    sends: np.ndarray
    #: ``[ticks, P, entries, packed]``: the slots what the entry brings goes into (scratch
    #: where nothing).
    receives: np.ndarray
    #: Stash slots per stage; index ``slots`` is the scratch slot.
    slots: int
    #: Per message ``(src, dst, made, sent, needed)``: the ticks its value is made in, sent
    #: in, and first read in.
    schedule_of_messages: tuple[tuple[int, int, int, int, int], ...]
    #: Per tick and entry of ``messages``: how many buffers its psend packs (2 where a pair
    #: of the op has two messages in that tick, the earlier made first; 1 mostly).
    packed: tuple[tuple[int, ...], ...]
    #: Whether the backward recomputes the forward (else it starts from kept residuals).
    remat: bool = True
    #: Slots of kept residuals per stage (``remat=False``; 0 with remat).
    kept_slots: int = 0

    @property
    def ticks(self) -> int:
        return int(self.actions.shape[0])


def _message_ops(P: int, V: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    ops = [tuple((s, s + 1) for s in range(P - 1)), tuple((s + 1, s) for s in range(P - 1))]
    if V > 1 and P > 2:  # for P = 2 the wrap-around pairs are those of the two ops above
        ops += [((P - 1, 0),), ((0, P - 1),)]
    return tuple(op for op in ops if op)


def _branch(a: Action, c: int, C: int, split: bool, input_grads: bool, remat: bool) -> int:
    if a.kind == "F":
        return FORWARD_LAST if c == C - 1 else FORWARD
    if a.kind == "W":
        # The first chunk's W after a B that computed nothing forms the parameter cotangent
        # alone: from kept residuals that is the whole backward, not its weight part.
        return BACKWARD_FIRST if (c == 0 and not input_grads and not remat) else WEIGHT
    if split:
        if c > 0:
            return BACKWARD_INPUT
        return BACKWARD_INPUT_FIRST if input_grads else IDLE
    if c > 0:
        return BACKWARD
    return BACKWARD_FIRST_WITH_INPUT if input_grads else BACKWARD_FIRST


@dataclass
class _Value:
    """A buffer one action makes and later actions read (see :func:`make_plan`)."""

    src: int  # the stage that makes it
    dst: int  # the stage that reads it
    made: int  # tick
    reads: list[int]  # ticks of the actions that read it
    sent: int = -1  # tick of its message (src != dst)
    out_slot: int = -1  # where it is written on src
    in_slot: int = -1  # where it arrives on dst

    @property
    def read_slot(self) -> int:
        """Where its readers (on ``dst``) find it."""
        return self.out_slot if self.src == self.dst else self.in_slot


def _place_messages(values: list[_Value], end: np.ndarray) -> None:
    """Each message's tick (module docstring): of the ticks in ``[made, first read)`` at
    which the dataflow run has its producer done no later than its consumer, the one where
    the consumer is furthest behind; else the one with the shortest wait."""
    for v in values:
        if v.src == v.dst:
            continue
        need = min(v.reads)

        def rank(t: int, v: _Value = v) -> tuple[float, float, int]:
            ahead = end[t, v.src] - end[t, v.dst]  # > 0: the consumer waits this long
            return max(0.0, ahead), min(0.0, ahead), t

        v.sent = min(range(v.made, need), key=rank)


class _Slots:
    """Greedy slot allocation by write time (optimal for intervals): a value holds its slot
    from its write to its last read, both in ``4 * tick + phase`` units."""

    def __init__(self) -> None:
        self.free_after: list[int] = []

    def take(self, write: int, last_read: int) -> int:
        for i, t in enumerate(self.free_after):
            if t < write:
                self.free_after[i] = last_read
                return i
        self.free_after.append(last_read)
        return len(self.free_after) - 1


def make_plan(schedule: Schedule, input_grads: bool = False, remat: bool = True) -> Plan:
    """The tables of a bound schedule (see the module docstring); ``input_grads``: the first
    chunk's backward also forms its input's cotangent (kept on stage 0, sent nowhere);
    ``remat=False``: the forward keeps its residuals for the backward, which then reads no
    stage input (``kept_slot``)."""
    table = schedule.table
    P, M, V = schedule.stages, schedule.microbatches, schedule.virtual_stages
    assert P is not None and M is not None
    C, split = P * V, schedule.splits_weight_gradient
    T = len(table)
    when: dict[tuple[str, int, int], int] = {}
    branches = np.zeros((T, P), np.int32)
    for t, row in enumerate(table):
        for s, a in enumerate(row):
            if a is not None:
                c = a.virtual_stage * P + s
                when[(a.kind, a.microbatch, c)] = t
                branches[t, s] = _branch(a, c, C, split, input_grads, remat)

    def reading(m: int, c: int, kinds: tuple[str, ...]) -> list[int]:
        """Ticks of the actions of (m, c) among ``kinds`` that compute something."""
        return [when[(k, m, c)] for k in kinds if branches[when[(k, m, c)], c % P] != IDLE]

    # The values: the input activation of (m, c) for c > 0, read by its F, B (and W); the
    # output cotangent of (m, c), read by its B (and W), made by B of c + 1 or, for the last
    # chunk, by its own F.
    backward = ("B", "W") if split else ("B",)
    activation: dict[tuple[int, int], _Value] = {}
    cotangent: dict[tuple[int, int], _Value] = {}
    for m in range(M):
        for c in range(C):
            if c > 0:
                activation[(m, c)] = _Value((c - 1) % P, c % P, when[("F", m, c - 1)],
                                            reading(m, c, ("F", *backward) if remat
                                                        else ("F",)))
            made, src = ((when[("F", m, c)], c % P) if c == C - 1
                         else (when[("B", m, c + 1)], (c + 1) % P))
            cotangent[(m, c)] = _Value(src, c % P, made, reading(m, c, backward))
    values = [*activation.values(), *cotangent.values()]
    for v in values:
        if not v.reads or min(v.reads) <= v.made:  # validate_table rules this out
            raise ScheduleError(f"{schedule._title()}: a value made at tick {v.made} on stage "
                                f"{v.src} is read at ticks {v.reads}, not after it is made")
    # When each stage finishes each tick in a dataflow run under the cost model (an action
    # the executor leaves idle waits for nothing).
    def cost(s: int, a: Action) -> float | None:
        branch = int(branches[when[(a.kind, a.microbatch, a.virtual_stage * P + s)], s])
        return None if branch == IDLE else (ACTION_COST if remat else KEPT_ACTION_COST)[branch]

    _place_messages(values, np.asarray(dataflow_clock(table, P, V, cost)[0]))

    # Slots: on the producer from its write to its send (or to its last read when it stays),
    # on the consumer from its arrival to its last read.
    lifetimes: list[list[tuple[int, int, _Value, str]]] = [[] for _ in range(P)]
    for v in values:
        last = 4 * max(v.reads) + _READ
        if v.src == v.dst:
            lifetimes[v.src].append((4 * v.made + _WRITE, last, v, "out"))
        else:
            lifetimes[v.src].append((4 * v.made + _WRITE, 4 * v.sent + _SEND, v, "out"))
            lifetimes[v.dst].append((4 * v.sent + _ARRIVE, last, v, "in"))
    allocators = [_Slots() for _ in range(P)]
    for s in range(P):
        for write, last, v, side in sorted(lifetimes[s], key=lambda x: x[:2]):
            slot = allocators[s].take(write, last)
            if side == "out":
                v.out_slot = slot
            else:
                v.in_slot = slot
    slots = max([1, *(len(a.free_after) for a in allocators)])
    scratch = slots
    # Kept residuals: from the forward's write to the last backward action's read.
    kept_at: dict[tuple[int, int], int] = {}
    kept_slots = 0
    if not remat:
        kept_pool = [_Slots() for _ in range(P)]
        for (m, c) in sorted(((m, c) for m in range(M) for c in range(C)),
                             key=lambda mc: when[("F", *mc)]):
            last = max(reading(m, c, backward))
            kept_at[(m, c)] = kept_pool[c % P].take(4 * when[("F", m, c)] + _WRITE,
                                                    4 * last + _READ)
        kept_slots = max(len(a.free_after) for a in kept_pool)

    # Each tick's message entries: per op, the pairs with a message. Where a pair has two
    # messages in a tick (or more), the entry packs them into one psend, the earlier made
    # first: two psends on one channel in one tick would be ordered by nothing but data, and
    # XLA CPU runs independent thunks in any order (an optimization barrier between them is
    # gone by then), so two messages of one shape could be matched swapped, silently.
    ops = _message_ops(P, V)
    op_of_pair = {pair: i for i, op in enumerate(ops) for pair in op}
    by_tick: dict[int, list[_Value]] = {}
    for v in values:
        if v.src != v.dst:
            by_tick.setdefault(v.sent, []).append(v)
    entries: list[list[tuple[int, list[list[_Value]]]]] = [[] for _ in range(T)]
    for t, sent in by_tick.items():
        per_pair: dict[tuple[int, int], list[_Value]] = {}
        for v in sorted(sent, key=lambda v: v.made):
            per_pair.setdefault((v.src, v.dst), []).append(v)
        per_op: dict[int, list[list[_Value]]] = {}
        for pair, vs in per_pair.items():
            per_op.setdefault(op_of_pair[pair], []).append(vs)
        entries[t] = [(k, sorted(groups, key=lambda vs: ops[k].index((vs[0].src, vs[0].dst))))
                      for k, groups in sorted(per_op.items())]
    width = max([1, *(len(e) for e in entries)])
    depth = max([1, *(len(vs) for e in entries for _, groups in e for vs in groups)])
    sends = np.full((T, P, width, depth), scratch, np.int32)
    receives = np.full((T, P, width, depth), scratch, np.int32)
    for t in range(T):
        for e, (_, groups) in enumerate(entries[t]):
            for vs in groups:
                for j, v in enumerate(vs):
                    sends[t, v.src, e, j] = v.out_slot
                    receives[t, v.dst, e, j] = v.in_slot
    messages = tuple(tuple((k, tuple((vs[0].src, vs[0].dst) for vs in groups))
                           for k, groups in entries[t]) for t in range(T))
    packed = tuple(tuple(max(len(vs) for vs in groups) for _, groups in entries[t])
                   for t in range(T))

    actions = np.zeros((T, P, len(COLUMNS)), np.int32)
    actions[..., COLUMNS.index("out_slot")] = scratch
    actions[..., COLUMNS.index("kept_slot")] = 0
    for t, row in enumerate(table):
        for s, a in enumerate(row):
            if a is None:
                continue
            c, m = a.virtual_stage * P + s, a.microbatch
            branch = int(branches[t, s])
            cell = actions[t, s]
            cell[:4] = (branch, m, a.virtual_stage, int(c == 0))
            if c > 0:
                cell[4] = activation[(m, c)].read_slot
            cell[5] = cotangent[(m, c)].read_slot
            made = (cotangent.get((m, c)) if branch == FORWARD_LAST
                    else activation.get((m, c + 1)) if branch == FORWARD
                    else cotangent.get((m, c - 1)) if branch in (BACKWARD, BACKWARD_INPUT)
                    else None)
            if made is not None:
                cell[6] = made.out_slot
            if not remat:
                cell[7] = kept_at[(m, c)]
    schedule_of_messages = tuple(sorted((v.src, v.dst, v.made, v.sent, min(v.reads))
                                        for v in values if v.src != v.dst))
    return Plan(schedule, input_grads, actions, ops, messages, sends, receives, slots,
                schedule_of_messages, packed, remat, kept_slots)
