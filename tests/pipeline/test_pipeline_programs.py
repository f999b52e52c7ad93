"""What the compiled pipeline programs are: their memory (XLA's analysis), their GPU lowering
(exported for CUDA, passing the GPU-parity check), and their trace-time errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jax_cpu_mpi
from jax_cpu_mpi import pipeline as pl
from jax_cpu_mpi._src.pipeline.plan import make_plan

SCHEDULES = [pl.GPipe(), pl.OneFOneB(), pl.Interleaved1F1B(2), pl.ZeroBubble()]


def stage(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def loss(y, t):
    return jnp.mean((y - t) ** 2)


def abstract_args(P: int, V: int, M: int, width: int, batch: int):
    lead = (P, V) if V > 1 else (P,)
    params = {"w": jax.ShapeDtypeStruct((*lead, width, width), jnp.float32),
              "b": jax.ShapeDtypeStruct((*lead, width), jnp.float32)}
    xs = jax.ShapeDtypeStruct((M, batch, width), jnp.float32)
    return params, xs, xs


def mesh(P: int) -> jax.sharding.Mesh:
    return jax.make_mesh((P,), ("stage",), devices=jax.devices()[:P])


def test_one_f_one_b_needs_at_most_half_of_gpipes_memory():
    """XLA's temp bytes per device at M = 16, P = 4: GPipe stashes 16 stage inputs (and 16
    loss cotangents), 1F1B at most 4 (the plan's slots are reused)."""
    P, M = 4, 16
    temp = {}
    for schedule in (pl.GPipe(), pl.OneFOneB()):
        f = jax.jit(pl.shard_value_and_grad(stage, loss, mesh(P), schedule))
        # The sizes of docs/pipelines.md's example (8 KiB per stashed microbatch): with
        # smaller ones (a 64-byte activation) XLA's fixed temporaries of the scan, each
        # aligned to 64 bytes, outweigh the stash this test is about.
        args = abstract_args(P, schedule.virtual_stages, M, width=64, batch=32)
        temp[type(schedule).__name__] = f.lower(*args).compile().memory_analysis() \
            .temp_size_in_bytes
    print("temp bytes per device, P=4, M=16:", temp,
          f"1F1B / GPipe = {temp['OneFOneB'] / temp['GPipe']:.3f}")
    assert temp["OneFOneB"] <= 0.5 * temp["GPipe"], temp


def ops_of_distinct_ticks(plan) -> int:
    """The send/recv pairs the program has: one per op of each distinct tick (its messages
    and how many buffers each op packs), each a branch of the tick's message switch."""
    return sum(len(tick) for tick, _ in set(zip(plan.messages, plan.packed, strict=True)))


def export_and_check(f, *args) -> str:
    """Export ``f`` for CUDA (no GPU needed; the module text), and run jax_cpu_mpi's
    GPU-parity check (XLA GPU's send/recv verifier, rebuilt) on that export itself: the
    stablehlo.send/recv XLA GPU compiles."""
    exported = jax.export.export(jax.jit(f), platforms=["cuda"])(*args)
    jax_cpu_mpi.check(exported)
    return exported.mlir_module()


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: type(s).__name__)
def test_every_schedule_exports_for_cuda_and_passes_the_gpu_parity_check(schedule):
    P = 4
    f = pl.shard_value_and_grad(stage, loss, mesh(P), schedule)
    M = 4
    text = export_and_check(f, *abstract_args(P, schedule.virtual_stages, M, 8, 2))
    # One send/recv per op of each distinct set of a tick's messages (the plan's), not one
    # per direction as when every op ran every tick.
    plan = make_plan(schedule.bind(P, M))
    ops = ops_of_distinct_ticks(plan)
    assert text.count('"stablehlo.send"') == text.count('"stablehlo.recv"') == ops, text


@pytest.mark.parametrize("schedule", [pl.OneFOneB(), pl.ZeroBubble()],
                         ids=lambda s: type(s).__name__)
def test_kept_residuals_export_for_cuda_and_pass_the_gpu_parity_check(schedule):
    """remat=False changes what a tick computes and keeps, not its messages."""
    P, M = 4, 4
    f = pl.shard_value_and_grad(stage, loss, mesh(P), schedule, remat=False)
    text = export_and_check(f, *abstract_args(P, 1, M, 8, 2))
    plan = make_plan(schedule.bind(P, M), remat=False)
    ops = ops_of_distinct_ticks(plan)
    assert text.count('"stablehlo.send"') == text.count('"stablehlo.recv"') == ops, text


@pytest.mark.parametrize("input_grads", [False, True])
def test_two_messages_of_one_pair_in_a_tick_go_as_one_and_pass_the_gpu_parity_check(
        input_grads):
    """Interleaved 1F1B on two stages sends some messages after the tick that makes them
    (.plan), so a tick can carry two on one pair: its op packs both into one psend (two
    psends on one channel in one tick could be matched swapped). XLA GPU's verifier
    (rebuilt) accepts that program, with one send/recv per op of each distinct tick."""
    P, M, schedule = 2, 4, pl.Interleaved1F1B(2)
    plan = make_plan(schedule.bind(P, M), input_grads)
    assert any(n > 1 for tick in plan.packed for n in tick)
    assert any(made < sent for _, _, made, sent, _ in plan.schedule_of_messages)
    f = pl.shard_value_and_grad(stage, loss, mesh(P), schedule, return_input_grads=input_grads)
    text = export_and_check(f, *abstract_args(P, 2, M, 8, 2))
    ops = ops_of_distinct_ticks(plan)
    assert text.count('"stablehlo.send"') == text.count('"stablehlo.recv"') == ops, text


def test_the_gpu_parity_check_can_fail():
    """The check above rejects what XLA GPU rejects: a ring in one psend's pairs."""
    ring = [(s, (s + 1) % 4) for s in range(4)]

    def cycle(x):
        token = jax_cpu_mpi.psend(x, "stage", ring)
        return jax_cpu_mpi.precv(token, jax.ShapeDtypeStruct(x.shape, x.dtype), "stage", ring)

    m = mesh(4)
    f = jax.shard_map(cycle, mesh=m, in_specs=jax.P("stage"), out_specs=jax.P("stage"))
    x = jax.ShapeDtypeStruct((4,), jnp.float32,
                             sharding=jax.sharding.NamedSharding(m, jax.P("stage")))
    with pytest.raises(jax_cpu_mpi.GpuParityError, match="non-cyclical"):
        export_and_check(f, x)


# ------------------------------------------------------------------------- trace-time errors


def lower(schedule, P=4, V=None, M=4, width=8, stage_fn=stage, params=None, targets=None,
          **kwargs):
    args = list(abstract_args(P, schedule.virtual_stages if V is None else V, M, width, 2))
    if params is not None:
        args[0] = params
    if targets is not None:
        args[2] = targets
    f = pl.shard_value_and_grad(stage_fn, loss, mesh(P), schedule, **kwargs)
    return jax.jit(f).lower(*args)


def test_stage_output_must_fit_the_next_stage_input():
    def widen(p, x):
        return jnp.concatenate([stage(p, x), x], axis=-1)

    with pytest.raises(pl.PipelineError, match=r"a stage's output does not fit the next "
                       r"stage's input: .*float32\[2, 8\].* to .*float32\[2, 16\]"):
        lower(pl.OneFOneB(), stage_fn=widen)


def test_stage_count_must_be_the_mesh_axis():
    with pytest.raises(pl.PipelineError, match="stages=2 x virtual_stages=2, but the mesh "
                       "axis 'stage' has 4 devices"):
        lower(pl.Interleaved1F1B(2, stages=2))


def test_parameters_must_be_stacked_stages_by_virtual_stages():
    # [P, ...] parameters for an interleaved schedule: no virtual-stage axis.
    with pytest.raises(pl.PipelineError, match=r"does not fit 4 stages x 2 virtual stage.*"
                       r"\[P, V, \.\.\.\]"):
        lower(pl.Interleaved1F1B(2), V=1)


def test_too_few_microbatches_for_interleaving():
    with pytest.raises(pl.ScheduleError, match="microbatches=2 < stages=4"):
        lower(pl.Interleaved1F1B(2), M=2)


def test_targets_must_have_the_microbatch_axis():
    with pytest.raises(pl.PipelineError, match="4 microbatches but targets"):
        lower(pl.GPipe(), targets=jax.ShapeDtypeStruct((3, 2, 8), jnp.float32))


def test_mesh_without_the_stage_axis():
    with pytest.raises(pl.PipelineError, match="no stage axis 'pp'"):
        pl.shard_value_and_grad(stage, loss, mesh(4), pl.GPipe(), axis_name="pp")


def test_one_function_per_chunk():
    with pytest.raises(pl.PipelineError, match=r"3 stage functions for 4 stages x 1 virtual "
                       r"stages; give one per chunk \(P x V = 4\)"):
        pl.shard_value_and_grad([stage] * 3, loss, mesh(4), pl.GPipe())


def test_outside_shard_map():
    params, xs, ys = abstract_args(1, 1, 2, 4, 2)
    with pytest.raises(pl.PipelineError, match="the stage axis 'stage' is not bound"):
        jax.eval_shape(lambda p, x, y: pl.value_and_grad(stage, p, loss, x, y, pl.GPipe()),
                       params, xs, ys)


def test_input_gradients_need_floating_microbatches():
    params, _, ys = abstract_args(2, 1, 4, 8, 2)
    tokens = jax.ShapeDtypeStruct((4, 2, 8), jnp.int32)
    f = pl.shard_value_and_grad(stage, loss, mesh(2), pl.OneFOneB(), return_input_grads=True)
    with pytest.raises(pl.PipelineError, match=r"return_input_grads=True needs floating "
                       r"microbatches .*int32\[4, 2, 8\].*embedding before the pipeline"):
        jax.jit(f).lower(params, tokens, ys)


def test_a_data_parallel_step_reduces_in_three_collectives():
    """Stages x data shards, with a loss's parameters and the input gradients: what one
    stage holds goes to every stage in one psum (loss, the loss parameters' gradients, the
    input gradients), and the data mean in two (the stage's own gradients, and what every
    stage holds alike), however many leaves: over MPI each psum is a custom call XLA does
    not merge, a meeting of a process's devices per leaf otherwise."""
    P_, D, M, width, batch = 2, 2, 4, 8, 4
    mesh = jax.make_mesh((P_, D), ("stage", "data"), devices=jax.devices()[:P_ * D])
    spec = jax.sharding.PartitionSpec

    def head_loss(head, y, t):
        return jnp.mean((y @ head["w"] + head["b"] - t) ** 2) + 0.0 * jnp.sum(head["s"])

    def body(params, head, xs, ts):
        return pl.value_and_grad(stage, params, head_loss, xs, ts, pl.OneFOneB(),
                                 axis_name="stage", data_axis_name="data",
                                 return_input_grads=True, loss_params=head)

    f = jax.jit(jax.shard_map(
        body, mesh=mesh,
        in_specs=(spec("stage"), spec(), spec(None, "data"), spec(None, "data")),
        out_specs=(spec(), spec("stage"), spec(), spec(None, "data"))))

    def arg(shape, *axes):
        return jax.ShapeDtypeStruct(shape, jnp.float32,
                                    sharding=jax.sharding.NamedSharding(mesh, spec(*axes)))

    params = {"w": arg((P_, width, width), "stage"), "b": arg((P_, width), "stage")}
    head = {"w": arg((width, width)), "b": arg((width,)), "s": arg((3,))}
    xs = arg((M, batch * D, width), None, "data")
    text = f.lower(params, head, xs, xs).as_text()
    assert text.count("stablehlo.all_reduce") == 3, text
