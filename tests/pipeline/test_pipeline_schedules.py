"""Schedules as data: their tables run every action once, after its inputs, and their
figures (bubble, stash) are those of the literature; bad schedules fail with clear errors."""

from __future__ import annotations

import itertools

import pytest

from jax_cpu_mpi import pipeline as pl
from jax_cpu_mpi._src.pipeline.plan import make_plan


def all_schedules(P: int, M: int):
    out = [pl.GPipe(stages=P, microbatches=M), pl.OneFOneB(stages=P, microbatches=M),
           pl.ZeroBubble(stages=P, microbatches=M)]
    if M >= P:
        out += [pl.Interleaved1F1B(V, stages=P, microbatches=M) for V in (2, 3)]
    return out


def replay(schedule: pl.Schedule) -> None:
    """An independent check of the table: run it on a toy machine where each (microbatch,
    chunk) is a token that must have been made before it is used."""
    P, M, V = schedule.stages, schedule.microbatches, schedule.virtual_stages
    C = P * V
    made: set = set()
    for row in schedule.table:
        new = set()
        for s, a in enumerate(row):
            if a is None:
                continue
            c = a.virtual_stage * P + s
            need = {"F": [("F", a.microbatch, c - 1)] if c else [],
                    "B": [("F", a.microbatch, c)] + ([("B", a.microbatch, c + 1)]
                                                     if c < C - 1 else []),
                    "W": [("B", a.microbatch, c)]}[a.kind]
            assert all(n in made for n in need), (schedule, a, s)
            new.add((a.kind, a.microbatch, c))
        made |= new
    kinds = "FBW" if schedule.splits_weight_gradient else "FB"
    assert made == {(k, m, c) for k in kinds for m in range(M) for c in range(C)}


@pytest.mark.parametrize("P,M", list(itertools.product(range(1, 6), (1, 2, 3, 4, 5, 7, 8, 16))))
def test_tables_run_every_action_once_after_its_inputs(P, M):
    for schedule in all_schedules(P, M):
        replay(schedule)


@pytest.mark.parametrize("P,M", [(2, 4), (4, 8), (4, 16), (3, 7), (8, 16)])
def test_bubble_fractions_are_the_theory(P, M):
    assert pl.GPipe(stages=P, microbatches=M).bubble_fraction == pytest.approx(
        (P - 1) / (M + P - 1))
    assert pl.OneFOneB(stages=P, microbatches=M).bubble_fraction == pytest.approx(
        (P - 1) / (M + P - 1))
    assert pl.ZeroBubble(stages=P, microbatches=M).bubble_fraction == pytest.approx(
        (P - 1) / (3 * M + P - 1))
    if M % P == 0:
        for V in (2, 3):
            assert pl.Interleaved1F1B(V, stages=P, microbatches=M).bubble_fraction == \
                pytest.approx((P - 1) / (V * M + P - 1))


def test_peak_stash():
    P, M = 4, 16
    assert pl.GPipe(stages=P, microbatches=M).peak_stash == (M,) * P
    assert pl.OneFOneB(stages=P, microbatches=M).peak_stash == tuple(P - s for s in range(P))
    # ZB-H1: 1F1B's P - s awaiting B, and up to P - 1 more awaiting only W.
    assert pl.ZeroBubble(stages=P, microbatches=M).peak_stash == tuple(
        2 * P - 1 - s for s in range(P))


def test_str_draws_the_table():
    schedule = pl.OneFOneB(stages=2, microbatches=2)
    lines = str(schedule).splitlines()
    assert "bubble fraction 0.333" in lines[0]
    assert lines[1].split() == ["tick", "|", "stage", "0", "stage", "1"]
    rows = [line.split("|")[1].split() for line in lines[3:]]
    assert rows == [[a.label(1) if a else "." for a in row] for row in schedule.table]
    assert ["F0", "."] == rows[0] and "B1" in rows[-1]
    assert "F1.1" in str(pl.Interleaved1F1B(2, stages=2, microbatches=2))
    assert "not set" in str(pl.GPipe())


def test_from_table_validates():
    good = pl.OneFOneB(stages=2, microbatches=2).table
    assert pl.FromTable(rows=good).table == good
    swapped = [good[0], good[2], good[1], *good[3:]]  # B0 of stage 1 before its F0
    with pytest.raises(pl.ScheduleError, match="B0 on stage 1 at tick 1 needs F0 of stage 1"):
        pl.FromTable(rows=swapped).validate()
    missing = good[:-1]
    with pytest.raises(pl.ScheduleError, match="B1 never runs on stage 0"):
        pl.FromTable(rows=missing).validate()
    twice = [*good, (None, pl.Action("B", 1))]
    with pytest.raises(pl.ScheduleError, match="B1 runs twice on stage 1"):
        pl.FromTable(rows=twice).validate()
    with pytest.raises(pl.ScheduleError, match=r"W0 .*not an action"):
        pl.FromTable(rows=[*good, (pl.Action("W", 0), None)]).validate()


def test_size_errors():
    with pytest.raises(pl.ScheduleError, match="microbatches=2 < stages=4"):
        pl.Interleaved1F1B(2, stages=4, microbatches=2).validate()
    with pytest.raises(pl.ScheduleError, match="stages and microbatches are not set"):
        pl.GPipe().validate()
    with pytest.raises(pl.ScheduleError, match=r"built for stages=2.*stages=4"):
        pl.GPipe(stages=2).bind(4, 8)
    with pytest.raises(pl.ScheduleError, match="unknown schedule 'pipedream'"):
        pl.schedule_by_name("pipedream")
    with pytest.raises(pl.ScheduleError, match="needs 'interleaved-1f1b'"):
        pl.schedule_by_name("1f1b", virtual_stages=2)
    assert pl.schedule_by_name("interleaved-1f1b", 3).virtual_stages == 3


@pytest.mark.parametrize("P,M", [(2, 3), (3, 4), (4, 5), (4, 8)])
def test_a_tick_sends_only_its_messages(P, M):
    """Each tick's ops carry exactly the pairs whose source stage sends its action's output
    to another stage in that tick: a stage never waits for a neighbour it gets nothing
    from (the executor once ran every op with every pair, every tick)."""
    for schedule in all_schedules(P, M):
        plan = make_plan(schedule)
        C = P * schedule.virtual_stages
        for t, row in enumerate(schedule.table):
            want = set()
            for s, a in enumerate(row):
                c = None if a is None else a.virtual_stage * P + s
                if a is not None and a.kind == "F" and c < C - 1:
                    want.add((s, (c + 1) % P))
                elif a is not None and a.kind == "B" and c > 0:
                    want.add((s, (c - 1) % P))
            got = [pair for k, pairs in plan.messages[t] for pair in pairs
                   if pair in plan.ops[k]]
            assert len(got) == sum(len(pairs) for _, pairs in plan.messages[t])
            assert set(got) == {(a, b) for a, b in want if a != b}, (schedule, t)
            assert len(set(got)) == len(got)


def test_one_f_one_b_messages_by_tick():
    """P = 2, M = 3 (the table in docs/pipelines.md): op 0 is stage 0 -> 1, op 1 is 1 -> 0;
    the last stage's F keeps its loss cotangent and stage 0's B sends nothing."""
    plan = make_plan(pl.OneFOneB(stages=2, microbatches=3))
    down, up = (0, ((0, 1),)), (1, ((1, 0),))
    assert plan.messages == ((down,), (down,), (up,), (), (down, up), (), (up,), ())
