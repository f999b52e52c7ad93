"""Pipeline schedules as plain data: a table tick x stage -> action, built, validated, drawn.

A model of ``C = P * V`` chunks runs on ``P`` stages (devices along the stage axis); chunk
``c`` lives on stage ``c % P`` as its virtual stage ``c // P`` (Megatron's looping
placement; ``V = 1`` for every schedule but :class:`Interleaved1F1B`). Each microbatch runs
through the chunks in order (forward, ``F``) and back (backward, ``B``); :class:`ZeroBubble`
splits the backward into the input gradient (``B``) and the weight gradient (``W``).

A schedule is built from one ordered list of actions per stage (or, for ZB-H1, a greedy rule):
a simulation runs every stage's next action as soon as its inputs are there (what a stage
sends during tick ``t`` can be used from tick ``t + 1`` on) and records the table. Every
action takes one tick; :attr:`Schedule.bubble_fraction` is the share of idle cells.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from functools import cached_property
from typing import ClassVar, Literal, NamedTuple

__all__ = [
    "Action",
    "FromTable",
    "GPipe",
    "Interleaved1F1B",
    "OneFOneB",
    "Schedule",
    "ScheduleError",
    "ZeroBubble",
    "schedule_by_name",
]

Kind = Literal["F", "B", "W"]


class ScheduleError(ValueError):
    """A schedule that cannot run: bad sizes, or a table that breaks a dependency."""


class Action(NamedTuple):
    """One cell of a schedule's table: what a stage does during one tick."""

    kind: Kind  # 'F' forward; 'B' backward (input gradient only when the schedule splits W)
    microbatch: int
    virtual_stage: int = 0

    def label(self, virtual_stages: int) -> str:
        """``F3`` (microbatch 3), ``F3.1`` (virtual stage 1) where there are several."""
        suffix = f".{self.virtual_stage}" if virtual_stages > 1 else ""
        return f"{self.kind}{self.microbatch}{suffix}"


Table = tuple[tuple[Action | None, ...], ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
    """Base class of the schedules: the sizes, the table and what follows from it.

    ``stages`` (P) and ``microbatches`` (M) may be left ``None``:
    :func:`jax_cpu_mpi.pipeline.value_and_grad` fills them in from the mesh axis and the
    microbatches (:meth:`bind`). The table and the figures need both.
    """

    stages: int | None = None
    microbatches: int | None = None

    #: Name on the command line of the example (``--schedule``).
    name: ClassVar[str] = ""
    #: Whether the backward is split into ``B`` (input gradient) and ``W`` (weight gradient).
    splits_weight_gradient: ClassVar[bool] = False

    @property
    def virtual_stages(self) -> int:
        """Chunks per stage (V); 1 except for :class:`Interleaved1F1B`."""
        return 1

    def bind(self, stages: int, microbatches: int) -> Schedule:
        """This schedule with ``stages`` and ``microbatches`` set; a :class:`ScheduleError`
        if it already names other values."""
        for field, value in (("stages", stages), ("microbatches", microbatches)):
            mine = getattr(self, field)
            if mine is not None and mine != value:
                raise ScheduleError(
                    f"{self._title()}: the schedule was built for {field}={mine}, but the "
                    f"pipeline runs with {field}={value}; build it without {field} (the "
                    f"pipeline fills it in) or with {field}={value}")
        return dataclasses.replace(self, stages=stages, microbatches=microbatches)

    # ------------------------------------------------------------------ sizes and table

    def _sizes(self) -> tuple[int, int, int]:
        if self.stages is None or self.microbatches is None:
            raise ScheduleError(
                f"{self._title()}: stages and microbatches are not set; use "
                f"schedule.bind(stages, microbatches) or pass the schedule to "
                f"jax_cpu_mpi.pipeline.value_and_grad, which binds it")
        P, M, V = self.stages, self.microbatches, self.virtual_stages
        if P < 1 or M < 1 or V < 1:
            raise ScheduleError(f"{self._title()}: stages={P}, microbatches={M} and "
                                f"virtual_stages={V} must all be >= 1")
        return P, M, V

    def _check_sizes(self, P: int, M: int, V: int) -> None:
        """Raise where a schedule cannot run these sizes (subclasses add their limits)."""

    def _orders(self, P: int, M: int, V: int) -> list[list[Action]]:
        """Each stage's actions in the order it runs them (schedules built from orders)."""
        raise NotImplementedError(f"{self._title()} builds its table another way")

    def _build(self, P: int, M: int, V: int) -> Table:
        return self._run_orders(self._orders(P, M, V), P, M, V)

    def _run_orders(self, orders: list[list[Action]], P: int, M: int, V: int) -> Table:
        """The table of per-stage action orders, each action as soon as it is ready."""
        position = [0] * P

        def next_in_order(s: int, ready: Callable[[Action, int], bool]) -> Action | None:
            if position[s] < len(orders[s]) and ready(orders[s][position[s]], s):
                position[s] += 1
                return orders[s][position[s] - 1]
            return None

        return _simulate(self, P, M, V, next_in_order,
                         lambda: [orders[s][position[s]] if position[s] < len(orders[s])
                                  else None for s in range(P)])

    @cached_property
    def table(self) -> Table:
        """``table[tick][stage]``: an :class:`Action`, or ``None`` where the stage idles."""
        P, M, V = self._sizes()
        self._check_sizes(P, M, V)
        table = self._build(P, M, V)
        validate_table(table, P, M, V, self.splits_weight_gradient, self._title())
        return table

    def validate(self) -> None:
        """Build the table and check it (:func:`validate_table`); raise
        :class:`ScheduleError` naming the first problem."""
        _ = self.table

    @property
    def ticks(self) -> int:
        """Number of ticks (rows of :attr:`table`)."""
        return len(self.table)

    @property
    def bubble_fraction(self) -> float:
        """Idle cells of the table over all cells: the bubble when every action takes the same
        time. ``(P - 1) / (M + P - 1)`` for GPipe and 1F1B, ``(P - 1) / (V M + P - 1)``
        interleaved, ``(P - 1) / (3 M + P - 1)`` for ZB-H1."""
        idle = sum(a is None for row in self.table for a in row)
        return idle / (len(self.table) * len(self.table[0]))

    def bubble_fraction_for(
        self,
        cost: Mapping[str, float] | Callable[[int, Action], float] | None = None,
        *,
        send: float = 0.0,
        receive: float = 0.0,
    ) -> float:
        """The bubble of this table with actions that take different times: the share of
        ``P x span`` the stages spend not computing, when every action starts as soon as its
        stage is free and the values it reads from other stages have arrived (no ticks).

        ``cost``: the time of each action kind (``{"F": 1, "B": 2, "W": 1}``, kinds left out
        take 1), or a function ``(stage, action) -> time`` for costs that differ by stage or
        chunk; ``None``: every action 1. ``send`` / ``receive``: the time a stage spends
        sending / receiving each value that crosses stages (communication, counted as not
        computing). With unit costs and free messages this is :attr:`bubble_fraction` for
        the schedules here; measured action and message times give the bubble this schedule
        can reach on a machine (``benchmarks/pipeline_bubbles.py``).
        """
        P, _, V = self._sizes()
        if cost is None or isinstance(cost, Mapping):
            kinds = {"F": 1.0, "B": 1.0, "W": 1.0, **(cost or {})}
            duration: Callable[[int, Action], float] = lambda s, a: float(kinds[a.kind])  # noqa: E731
        else:
            duration = cost
        clock, busy = dataflow_clock(self.table, P, V, duration, send=send, receive=receive)
        span = max(clock[-1])
        return 1.0 - busy / (P * span) if span > 0 else 0.0

    @property
    def peak_stash(self) -> tuple[int, ...]:
        """Per stage: the most (microbatch, chunk) forwards whose last backward action (``B``,
        or ``W`` where split) has not run yet, i.e. the stage inputs kept for the backward."""
        P = len(self.table[0])
        last = "W" if self.splits_weight_gradient else "B"
        live, peak = [0] * P, [0] * P
        for row in self.table:
            for s, a in enumerate(row):
                if a is not None and a.kind == "F":
                    live[s] += 1
                    peak[s] = max(peak[s], live[s])
            for s, a in enumerate(row):
                if a is not None and a.kind == last:
                    live[s] -= 1
        return tuple(peak)

    def describe(self) -> str:
        """One line: name, sizes, bubble fraction and peak stash."""
        P, M, V = self._sizes()
        sizes = f"P={P}, M={M}" + (f", V={V}" if V > 1 else "")
        return (f"{self._title()} ({sizes}): {self.ticks} ticks, bubble fraction "
                f"{self.bubble_fraction:.3f}, peak stash per stage {list(self.peak_stash)}")

    def __str__(self) -> str:
        if self.stages is None or self.microbatches is None:
            return f"{self._title()} (stages and microbatches not set: no table yet)"
        V = self.virtual_stages
        cells = [[a.label(V) if a is not None else "." for a in row] for row in self.table]
        width = max(len("stage 0"), *(len(c) for row in cells for c in row))
        head = "tick | " + " ".join(f"stage {s}".rjust(width) for s in range(self.stages))
        lines = [self.describe(), head, "-" * len(head)]
        for t, row in enumerate(cells):
            lines.append(f"{t:>4} | " + " ".join(c.rjust(width) for c in row))
        return "\n".join(lines)

    def _title(self) -> str:
        return type(self).__name__


def _chunk(a: Action, s: int, P: int) -> int:
    return a.virtual_stage * P + s


def _simulate(schedule: Schedule, P: int, M: int, V: int,
              choose: Callable[[int, Callable[[Action, int], bool]], Action | None],
              waiting: Callable[[], list[Action | None]]) -> Table:
    """Run every stage's choice tick by tick; an action is ready when its inputs were made
    in an earlier tick. Raises :class:`ScheduleError` when no stage can move."""
    C = P * V
    done: dict[tuple[str, int, int], int] = {}
    total = M * C * (3 if schedule.splits_weight_gradient else 2)
    table: list[tuple[Action | None, ...]] = []

    def ready(a: Action, s: int) -> bool:
        c = _chunk(a, s, P)
        if a.kind == "F":
            return c == 0 or ("F", a.microbatch, c - 1) in done
        if a.kind == "B":
            return ("F", a.microbatch, c) in done and (
                c == C - 1 or ("B", a.microbatch, c + 1) in done)
        return ("B", a.microbatch, c) in done

    while len(done) < total:
        row = tuple(choose(s, ready) for s in range(P))
        if all(a is None for a in row):
            stuck = ", ".join(f"stage {s} waits to run "
                              f"{a.label(V) if a is not None else 'nothing'}"
                              for s, a in enumerate(waiting()))
            raise ScheduleError(f"{schedule._title()} with P={P}, M={M}, V={V} deadlocks at "
                                f"tick {len(table)}: {stuck} (its inputs never come)")
        for s, a in enumerate(row):
            if a is not None:
                done[(a.kind, a.microbatch, _chunk(a, s, P))] = len(table)
        table.append(row)
    return tuple(table)


def dataflow_clock(
    table: Table, P: int, V: int, duration: Callable[[int, Action], float | None], *,
    send: float = 0.0, receive: float = 0.0,
) -> tuple[list[list[float]], float]:
    """Run ``table`` as dataflow (see :meth:`Schedule.bubble_fraction_for`): each action starts
    once its stage is free and the values it reads from other stages have arrived.

    ``duration(stage, action)`` is its time, or ``None`` for an action that computes nothing
    (the first chunk's ``B`` where the input needs no gradient): it neither waits nor takes
    time, and the value it would have read is waited for by the next action that reads it
    (its ``W``). A value is received once, by the first action of its stage that reads it.
    Returns ``(clock, busy)``: ``clock[t][s]``, stage ``s``'s time at the end of tick ``t``;
    ``busy``, the summed durations."""
    C = P * V
    now, busy = [0.0] * P, 0.0
    arrives: dict[tuple[str, int, int], float] = {}
    received: set[tuple[str, int, int]] = set()
    clock = []
    for row in table:
        for s, a in enumerate(row):
            work = None if a is None else duration(s, a)
            if work is None:
                continue
            c = _chunk(a, s, P)
            reads = []  # the values from other stages this action reads
            if a.kind == "F" and c > 0 and (c - 1) % P != s:
                reads.append(("F", a.microbatch, c - 1))
            if a.kind in ("B", "W") and c < C - 1 and (c + 1) % P != s:
                reads.append(("B", a.microbatch, c + 1))
            for value in reads:
                if value not in received:
                    received.add(value)
                    now[s] = max(now[s], arrives[value]) + receive
            now[s] += work
            busy += work
            sends = (a.kind == "F" and c < C - 1 and (c + 1) % P != s) or \
                (a.kind == "B" and c > 0 and (c - 1) % P != s)
            if sends:
                now[s] += send
                arrives[(a.kind, a.microbatch, c)] = now[s]
        clock.append(list(now))
    return clock, busy


def validate_table(table: Table, P: int, M: int, V: int, split: bool, title: str) -> None:
    """Check that ``table`` runs: every forward, backward (and weight gradient) of every
    microbatch and chunk exactly once, each after what it needs (``F`` of the chunk before,
    ``F`` before ``B`` of the same chunk, ``B`` of the chunk after before ``B``, ``B``
    before ``W``), in an earlier tick. The executor then sends exactly one message per
    value that crosses stages, from a stage to its neighbour, between the tick that makes
    it and the one that first reads it (see :mod:`.plan`); sends and receives match in order
    by construction. Raises :class:`ScheduleError`."""
    C = P * V
    kinds = ("F", "B", "W") if split else ("F", "B")
    when: dict[tuple[str, int, int], int] = {}
    for t, row in enumerate(table):
        if len(row) != P:
            raise ScheduleError(f"{title}: tick {t} has {len(row)} cells, not one per stage "
                                f"({P})")
        for s, a in enumerate(row):
            if a is None:
                continue
            if a.kind not in kinds or not 0 <= a.microbatch < M or not 0 <= a.virtual_stage < V:
                raise ScheduleError(f"{title}: tick {t}, stage {s}: {a.label(V)} is not an "
                                    f"action of this schedule (kinds {kinds}, M={M}, V={V})")
            key = (a.kind, a.microbatch, _chunk(a, s, P))
            if key in when:
                raise ScheduleError(f"{title}: {a.label(V)} runs twice on stage {s} (ticks "
                                    f"{when[key]} and {t})")
            when[key] = t
    for m in range(M):
        for c in range(C):
            s, v = c % P, c // P
            for k in kinds:
                if (k, m, c) not in when:
                    raise ScheduleError(f"{title}: {Action(k, m, v).label(V)} never runs on "
                                        f"stage {s}")
            needs = [("F", m, c, "F", m, c - 1)] if c else []
            needs.append(("B", m, c, "F", m, c))
            if c < C - 1:
                needs.append(("B", m, c, "B", m, c + 1))
            if split:
                needs.append(("W", m, c, "B", m, c))
            for k, _, _, k2, m2, c2 in needs:
                if when[(k2, m2, c2)] >= when[(k, m, c)]:
                    raise ScheduleError(
                        f"{title}: {Action(k, m, v).label(V)} on stage {s} at tick "
                        f"{when[(k, m, c)]} needs {Action(k2, m2, c2 // P).label(V)} of stage "
                        f"{c2 % P}, which runs at tick {when[(k2, m2, c2)]}, not before")


# ------------------------------------------------------------------------------ schedules


@dataclasses.dataclass(frozen=True)
class GPipe(Schedule):
    """GPipe: every microbatch forward, then every microbatch backward. Stashes all ``M``
    microbatches' stage inputs."""

    name: ClassVar[str] = "gpipe"

    def _orders(self, P: int, M: int, V: int) -> list[list[Action]]:
        return [[Action("F", m) for m in range(M)] + [Action("B", m) for m in range(M)]
                for _ in range(P)]


@dataclasses.dataclass(frozen=True)
class OneFOneB(Schedule):
    """1F1B (PipeDream-flush): stage ``s`` runs ``P - 1 - s`` warm-up forwards, then one
    forward and one backward in turn, then the remaining backwards. At most ``P - s``
    microbatches' stage inputs are stashed on stage ``s`` (``M`` for GPipe)."""

    name: ClassVar[str] = "1f1b"

    def _orders(self, P: int, M: int, V: int) -> list[list[Action]]:
        orders = []
        for s in range(P):
            warmup = min(P - 1 - s, M)
            order = [Action("F", m) for m in range(warmup)]
            for i in range(M - warmup):
                order += [Action("F", warmup + i), Action("B", i)]
            order += [Action("B", m) for m in range(M - warmup, M)]
            orders.append(order)
        return orders


@dataclasses.dataclass(frozen=True)
class Interleaved1F1B(Schedule):
    """Megatron's interleaved 1F1B: ``V`` chunks per stage (chunk ``c`` on stage ``c % P``),
    microbatches in groups of ``P``, each group through virtual stage 0, 1, ... in turn;
    the bubble shrinks ``V`` times. Needs ``M >= P``."""

    #: Chunks per stage (V >= 1; 1 is plain 1F1B).
    virtual_stages: int = 2  # type: ignore[assignment]
    name: ClassVar[str] = "interleaved-1f1b"

    def _check_sizes(self, P: int, M: int, V: int) -> None:
        if V > 1 and M < P:
            raise ScheduleError(
                f"Interleaved1F1B(virtual_stages={V}) needs at least as many microbatches as "
                f"stages: microbatches={M} < stages={P}; use microbatches >= {P}, or OneFOneB")

    def _title(self) -> str:
        return f"Interleaved1F1B(virtual_stages={self.virtual_stages})"

    def _build(self, P: int, M: int, V: int) -> Table:
        # Megatron's warm-up lengths assume M % P == 0; with a partial last group they can
        # deadlock. Then every stage warms up a little longer (at V * M the order is
        # all-forward-then-all-backward, which always runs).
        for extra in range(V * M + 1):
            try:
                return self._run_orders(self._orders(P, M, V, extra), P, M, V)
            except ScheduleError:
                if extra == V * M:
                    raise
        raise AssertionError("unreachable")

    def _orders(self, P: int, M: int, V: int, extra: int = 0) -> list[list[Action]]:
        forward, backward = [], []
        for start in range(0, M, P):
            group = range(start, min(start + P, M))
            forward += [Action("F", m, v) for v in range(V) for m in group]
            backward += [Action("B", m, v) for v in reversed(range(V)) for m in group]
        orders = []
        for s in range(P):
            warmup = min((P - 1 - s) * 2 + (V - 1) * P + extra, V * M)
            order = forward[:warmup]
            for i in range(V * M - warmup):
                order += [forward[warmup + i], backward[i]]
            order += backward[V * M - warmup:]
            orders.append(order)
        return orders


@dataclasses.dataclass(frozen=True)
class ZeroBubble(Schedule):
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): the backward split into the
    input gradient ``B`` (on the critical path, sent upstream at once) and the weight
    gradient ``W`` (no one waits for it), which fills the bubbles of 1F1B's cool-down.

    Each stage ``s`` takes, every tick, the first of: its next ``B`` if its cotangent is
    there; its next ``F`` if its input is there, fewer than ``P - s`` microbatches await their
    ``B`` (1F1B's bound) and fewer than ``2 P - 1 - s`` their ``W``; its oldest pending ``W``.
    Its bubble is ``(P - 1) / (3 M + P - 1)``, a third of 1F1B's in time; its peak stash is
    ``2 P - 1 - s`` stage inputs (a microbatch awaiting only ``W`` keeps its stage input and
    output cotangent)."""

    name: ClassVar[str] = "zero-bubble"
    splits_weight_gradient: ClassVar[bool] = True

    def _build(self, P: int, M: int, V: int) -> Table:
        next_f, next_b = [0] * P, [0] * P
        pending_w: list[list[int]] = [[] for _ in range(P)]
        forwarded = [0] * P

        def choose(s: int, ready: Callable[[Action, int], bool]) -> Action | None:
            if next_b[s] < next_f[s] and ready(Action("B", next_b[s]), s):
                next_b[s] += 1
                pending_w[s].append(next_b[s] - 1)
                return Action("B", next_b[s] - 1)
            in_flight = forwarded[s] - next_b[s]
            stashed = forwarded[s] - (next_b[s] - len(pending_w[s]))
            if (next_f[s] < M and in_flight < P - s and stashed < self._cap(P, s)
                    and ready(Action("F", next_f[s]), s)):
                next_f[s] += 1
                forwarded[s] += 1
                return Action("F", next_f[s] - 1)
            if pending_w[s]:
                return Action("W", pending_w[s].pop(0))
            return None

        def waiting() -> list[Action | None]:
            return [Action("B", next_b[s]) if next_b[s] < next_f[s] else
                    Action("F", next_f[s]) if next_f[s] < M else None for s in range(P)]

        return _simulate(self, P, M, V, choose, waiting)

    @staticmethod
    def _cap(P: int, s: int) -> int:
        # 1F1B's P - s microbatches awaiting B, plus up to P - 1 awaiting only their W: the
        # room ZB-H1 needs to reach its bubble (P - 1) / (3 M + P - 1); with none, W's
        # cannot be postponed and the bubble stays 1F1B's.
        return 2 * P - 1 - s


@dataclasses.dataclass(frozen=True, kw_only=True)
class FromTable(Schedule):
    """A schedule given by its table: ``rows[tick][stage]`` an :class:`Action` or ``None``.

    Validated like the built-in ones before it runs (:func:`validate_table`): write your own
    schedule, or load one made by another tool. ``stages`` and ``microbatches`` come from
    the table."""

    rows: Table = ()
    #: Chunks per stage, as in :class:`Interleaved1F1B`.
    virtual_stages: int = 1  # type: ignore[assignment]
    #: Whether the table has ``W`` actions (the backward split as in :class:`ZeroBubble`).
    weight_split: bool = False
    name: ClassVar[str] = "table"

    def __post_init__(self) -> None:
        rows = tuple(tuple(None if a is None else Action(*a) for a in row)
                     for row in self.rows)
        object.__setattr__(self, "rows", rows)
        if not rows or not rows[0]:
            raise ScheduleError("FromTable: the table is empty")
        if self.stages is None:
            object.__setattr__(self, "stages", len(rows[0]))
        if self.microbatches is None:
            object.__setattr__(self, "microbatches", 1 + max(
                (a.microbatch for row in rows for a in row if a is not None), default=0))

    @property
    def splits_weight_gradient(self) -> bool:  # type: ignore[override]
        return self.weight_split

    def _build(self, P: int, M: int, V: int) -> Table:
        return self.rows


_BY_NAME: dict[str, type[Schedule]] = {
    cls.name: cls for cls in (GPipe, OneFOneB, Interleaved1F1B, ZeroBubble)}


def schedule_by_name(name: str, virtual_stages: int = 1, stages: int | None = None,
                     microbatches: int | None = None) -> Schedule:
    """The schedule called ``name``: ``gpipe``, ``1f1b``, ``interleaved-1f1b`` (with
    ``virtual_stages``) or ``zero-bubble``."""
    if name not in _BY_NAME:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {sorted(_BY_NAME)}")
    if name == Interleaved1F1B.name:
        return Interleaved1F1B(virtual_stages, stages=stages, microbatches=microbatches)
    if virtual_stages != 1:
        raise ScheduleError(f"schedule {name!r} has one chunk per stage; virtual_stages="
                            f"{virtual_stages} needs 'interleaved-1f1b'")
    return _BY_NAME[name](stages=stages, microbatches=microbatches)
