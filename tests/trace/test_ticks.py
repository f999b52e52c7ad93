"""A pipeline's ticks in the timeline: the executor marks each tick's start and the step's
end (jax_cpu_mpi._src.ops.marks), so the merged timeline holds every tick of every device,
with its action, as the plan says, and its span; GPU programs carry no mark."""

from __future__ import annotations

import itertools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cpu_mpi
from conftest import make_mesh
from jax_cpu_mpi import pipeline as pl
from jax_cpu_mpi._src.cli import trace as timeline
from jax_cpu_mpi._src.ops.marks import ACTION_NAMES, MARK_TARGET, mark
from jax_cpu_mpi._src.pipeline.executor import tick_labels
from jax_cpu_mpi._src.pipeline.plan import make_plan

WIDTH = 16


def stage(w, x):
    return jnp.tanh(x @ w)


def loss(y, t):
    return jnp.mean((y - t) ** 2)


def step(schedule, stages, microbatches, **kwargs):
    mesh = make_mesh((stages, "stage"))
    V = schedule.virtual_stages
    lead = (stages, V) if V > 1 else (stages,)
    w = jax.device_put(np.full((*lead, WIDTH, WIDTH), 0.05, np.float32),
                       NamedSharding(mesh, P("stage")))
    xs = np.ones((microbatches, 4, WIDTH), np.float32)
    f = jax.jit(pl.shard_value_and_grad(stage, loss, mesh, schedule, **kwargs))
    return f, (w, xs, np.zeros_like(xs))


@pytest.mark.parametrize("name,stages,microbatches,kwargs", [
    ("1f1b", 4, 6, {}),
    ("interleaved-1f1b:2", 2, 4, {"remat": False}),
    ("zero-bubble", 3, 4, {"return_input_grads": True}),
])
def test_every_tick_of_every_device_with_its_action(tmp_path, name, stages, microbatches,
                                                    kwargs):
    """Each device has each tick once, labelled as the plan's table says (the executor's
    idle cells idle), the ticks of a device follow each other without a gap (a tick ends
    where the next one's mark is), and every psend/precv of the step lies inside a tick of
    its device."""
    kind, _, v = name.partition(":")
    schedule = pl.schedule_by_name(kind, int(v or 1))
    f, args = step(schedule, stages, microbatches, **kwargs)
    jax.block_until_ready(f(*args))  # compiled, not recorded
    for i in range(2):
        with jax_cpu_mpi.trace(tmp_path / str(i)):
            jax.block_until_ready(f(*args))
    merged = timeline.merge(tmp_path / "1")
    plan = make_plan(schedule.bind(stages, microbatches),
                     kwargs.get("return_input_grads", False), kwargs.get("remat", True))
    labels = tick_labels(plan)
    assert sorted({t.device for t in merged.ticks}) == list(range(stages))
    for s in range(stages):
        mine = sorted((t for t in merged.ticks if t.device == s), key=lambda t: t.start_us)
        assert [t.tick for t in mine] == list(range(plan.ticks)), s
        for t in mine:
            _, action, m, v = labels[t.tick, s]
            assert (t.action, t.microbatch, t.virtual_stage) == (ACTION_NAMES[action], m, v), t
            assert 0 <= t.messages_us <= t.end_us - t.start_us
        assert all(a.end_us == b.start_us for a, b in itertools.pairwise(mine))
        for m in (m for m in merged.messages if m.device == s):
            assert any(t.start_us <= m.start_us and m.end_us <= t.end_us for t in mine), m
    # Each table cell that computes is one non-idle tick.
    cells = sum(a is not None and plan.actions[t, s, 0] != 0
                for t, row in enumerate(plan.schedule.table) for s, a in enumerate(row))
    assert sum(t.action != "idle" for t in merged.ticks) == cells
    # The bubble as the table counts it: between 0 and 1, and at least the idle cells'
    # share of the ticks where every action takes a tick.
    assert 0 < merged.idle_fraction() < 1
    # Labels as the schedule's table writes its cells (a virtual stage where there are
    # several).
    written = {(t, s): a.label(schedule.virtual_stages)
               for t, row in enumerate(plan.schedule.table) for s, a in enumerate(row) if a}
    for t in merged.ticks:
        if t.action != "idle":
            assert t.label == written[(t.tick, t.device)], t
    # The Chrome trace holds the ticks, each named by its action.
    slices = [e for e in merged.chrome_trace()["traceEvents"] if e.get("cat") == "pipeline"]
    assert len(slices) == len(merged.ticks)
    assert {e["name"] for e in slices} >= {"idle"} | {
        t.label for t in merged.ticks if t.action != "idle"}


def test_the_picture_draws_the_actions(tmp_path):
    pytest.importorskip("matplotlib")
    f, args = step(pl.OneFOneB(), 2, 4)
    jax.block_until_ready(f(*args))
    with jax_cpu_mpi.trace(tmp_path):
        jax.block_until_ready(f(*args))
    merged = timeline.merge(tmp_path)
    png = timeline.draw(merged, tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = json.loads((timeline.write_json(merged, tmp_path / "t.json")).read_text())
    assert any(e.get("cat") == "pipeline" for e in written["traceEvents"])


def test_no_marks_outside_a_recording(tmp_path):
    f, args = step(pl.GPipe(), 2, 2)
    jax.block_until_ready(f(*args))
    with jax_cpu_mpi.trace(tmp_path):
        pass
    jax.block_until_ready(f(*args))  # not recorded
    with jax_cpu_mpi.trace(tmp_path / "later"):
        pass
    assert timeline.merge(tmp_path / "later").ticks == []


def test_mark_is_the_identity_for_values_gradients_and_vmap():
    label = jnp.asarray([3, 1, 2, 0], jnp.int32)
    x = jnp.arange(6.0).reshape(2, 3)
    got_label, got_x = jax.jit(mark)(label, x)
    np.testing.assert_array_equal(got_label, label)
    np.testing.assert_array_equal(got_x, x)
    grad = jax.grad(lambda x: jnp.sum(mark(label, x)[1] ** 2))(x)
    np.testing.assert_allclose(grad, 2 * x)
    batched = jax.vmap(lambda x: mark(label, x)[1])(x)
    np.testing.assert_array_equal(batched, x)


def test_gpu_programs_carry_no_mark():
    """The pipeline exported for CUDA holds no CPU-only call; for CPU, one mark per tick in
    the loop and one after it."""
    mesh = make_mesh((2, "stage"))
    f = jax.jit(pl.shard_value_and_grad(stage, loss, mesh, pl.OneFOneB()))
    shapes = (jax.ShapeDtypeStruct((2, WIDTH, WIDTH), np.float32),
              jax.ShapeDtypeStruct((4, 4, WIDTH), np.float32),
              jax.ShapeDtypeStruct((4, 4, WIDTH), np.float32))
    gpu = jax.export.export(f, platforms=["cuda"])(*shapes).mlir_module()
    assert MARK_TARGET not in gpu
    cpu = f.lower(*shapes).as_text()
    assert cpu.count(f"@{MARK_TARGET}(") == 2, cpu.count(MARK_TARGET)


def test_steps_recorded_together_are_told_apart(tmp_path, capsys):
    """Two steps in one recording: each tick knows its step, the idle share is each step's
    (the host's time between them counts in neither) averaged, and the command's summary
    says so."""
    schedule = pl.OneFOneB()
    f, args = step(schedule, 2, 4)
    jax.block_until_ready(f(*args))
    with jax_cpu_mpi.trace(tmp_path):
        jax.block_until_ready(f(*args))
        time.sleep(0.05)  # the host between the steps: no stage's bubble
        jax.block_until_ready(f(*args))
    merged = timeline.merge(tmp_path)
    T = make_plan(schedule.bind(2, 4)).ticks
    assert sorted({t.step for t in merged.ticks}) == [0, 1]
    for k in (0, 1):
        for device in (0, 1):
            assert [t.tick for t in merged.ticks if t.step == k and t.device == device] == \
                list(range(T))
    shares = []
    for k in (0, 1):
        ticks = [t for t in merged.ticks if t.step == k]
        span = max(t.end_us for t in ticks) - min(t.start_us for t in ticks)
        shares.append(1 - sum(t.compute_us for t in ticks if t.action != "idle") / (2 * span))
    assert merged.idle_fraction() == pytest.approx(sum(shares) / 2)
    assert merged.idle_fraction() < 1 - sum(
        t.compute_us for t in merged.ticks if t.action != "idle") / (
        2 * (max(t.end_us for t in merged.ticks) - min(t.start_us for t in merged.ticks)))
    assert f"pipeline: 2 step(s) of {T} ticks per device" in timeline.format_summary(merged)
