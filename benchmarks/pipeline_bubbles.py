"""Measured pipeline bubbles: the message timeline of the pipeline example vs the schedules' theory.

The example's training step (:mod:`jax_cpu_mpi.examples.pipeline`: ``P * V`` layers
``tanh(h @ w + b)``, SGD) runs for each schedule, in one process with ``--stages`` CPU
devices, or under ``mpirun -n P`` with ``--devices 1`` (one stage per process). After a
compilation step each of ``--steps`` steps is recorded into a directory of its own with
:func:`jax_cpu_mpi.trace`, so each timeline is exactly one step, and read with
:func:`jax_cpu_mpi.read_timeline`. Per step:

* ``idle``: the share of the step in which the devices run no action (the mean over
  devices), read off the marks the executor records at each tick's start
  (``Timeline.ticks``): a tick's span less its psend/precv is its action's time (with the
  tick's own bookkeeping), exactly, on every device. This is the bubble as the schedule's
  table counts it. ``from the entry``: the same with the step starting when stage 0 does
  (``skew``: how much later that was than the first device's start);
* ``wait``: the share of the step the devices spent blocked on a peer inside psend/precv
  (``Timeline.bubble_fraction()``, the mean over devices), which misses the idle time
  before a device's first message and after its last;
* ``not computing``: the share spent inside psend/precv at all (waits plus copies).

Figures to compare ``idle`` with:

* ``theory``: ``Schedule.bubble_fraction``, idle cells of the table (every action one tick,
  an idle tick free);
* ``unit sim``: the executor simulated (each device computes its tick's action, then runs
  the tick's message ops in program order; a precv waits for its psend, a device with no
  message in a tick goes on to the next) with every action costing 1 and idle 0, messages
  free;
* ``weighted sim``: the same simulation with each tick's measured time and the measured time
  of each psend/precv outside its wait: the executor on this machine;
* ``dataflow``: the schedule's table run as pure dataflow with those same costs (an action
  starts once its stage is free and the values it reads have arrived; no ticks at all):
  the least idle any executor of this table gets on this machine, the theory of the
  schedule with this model's action costs and this transport's message costs
  (``free msgs``: the same with messages that cost nothing; ``median costs``: the same with
  each action at the median time of its kind on its stage, without the step-to-step and
  tick-to-tick variation of the measured times: what a quiet machine would give).

``psend`` in the printed line is the part of ``wait`` spent in psend (the model counts none).

Figures only, no assertion. ``--pictures DIR`` also draws one step of each schedule
(``timeline-NAME.png``); ``--json FILE`` writes every number.

    python benchmarks/pipeline_bubbles.py --width 512 --batch 2048 --steps 5
    mpirun -n 2 -bind-to core -genv GLIBC_TUNABLES glibc.malloc.hugetlb=1 \
        python benchmarks/pipeline_bubbles.py --stages 2 --devices 1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedules", default="gpipe,1f1b,interleaved-1f1b,zero-bubble")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--devices", type=int, default=None,
                   help="CPU devices per process (default: --stages, one process)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5, help="recorded steps per schedule")
    p.add_argument("--trace-dir", default="/tmp/jax-cpu-mpi-pipeline-bubbles",
                   help="where the steps are recorded (emptied first; shared by the ranks)")
    p.add_argument("--pictures", default=None, help="directory for timeline-NAME.png")
    p.add_argument("--json", default=None, help="write every figure to this file")
    p.add_argument("--depth", type=int, default=1,
                   help="dense layers per chunk (1: the example's model); deeper chunks make "
                        "messages and per-tick overheads small next to the actions")
    p.add_argument("--scan-layers", action="store_true",
                   help="a chunk's --depth layers under lax.scan (else a Python loop)")
    p.add_argument("--keep-residuals", action="store_true",
                   help="remat=False: the forwards keep their residuals and the backward "
                        "starts from them (ZB-H1's B and W then each cost about a forward, "
                        "the premise of its theory)")
    p.add_argument("--input-grads", action="store_true",
                   help="also form the microbatches' gradient (return_input_grads=True, as "
                        "for layers before the pipeline): the first stage's backward then "
                        "does the work of every other stage's, the theory's premise")
    return p.parse_args()


ARGS = parse_args()
DEVICES = ARGS.devices or ARGS.stages
flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={DEVICES}"

import jax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_cpu_mpi  # noqa: E402
from jax_cpu_mpi import pipeline  # noqa: E402
from jax_cpu_mpi._src.cli import trace as trace_cli  # noqa: E402
from jax_cpu_mpi._src.pipeline import plan as plan_mod  # noqa: E402
from jax_cpu_mpi.examples import pipeline as example  # noqa: E402

jax_cpu_mpi.initialize_distributed()
MAIN = jax.process_index() == 0
ACTION = {plan_mod.IDLE: "idle", plan_mod.FORWARD: "F", plan_mod.FORWARD_LAST: "F+loss",
          plan_mod.BACKWARD: "B", plan_mod.BACKWARD_FIRST: "B(dW only)",
          plan_mod.BACKWARD_INPUT: "B(dx)", plan_mod.WEIGHT: "W",
          plan_mod.BACKWARD_FIRST_WITH_INPUT: "B(first, with dx)",
          plan_mod.BACKWARD_INPUT_FIRST: "B(first dx)"}


def tick_costs(timeline, plan) -> dict[tuple[int, int], float]:
    """Each (stage, tick)'s time outside psend/precv (us), read off the executor's marks:
    its action, and the tick's own bookkeeping. The timeline numbers devices process by
    process, as ``example.stage_mesh`` orders the stages (JAX's own device ids are not
    contiguous across processes); one recorded step holds each tick once per device."""
    stage_of = {d: s for s, d in enumerate(timeline.devices)}
    costs = {(stage_of[t.device], t.tick): t.compute_us for t in timeline.ticks}
    if len(costs) != plan.ticks * plan.schedule.stages:
        raise SystemExit(f"pipeline_bubbles: the step's timeline has {len(costs)} ticks, the "
                         f"plan {plan.ticks} x {plan.schedule.stages}")
    return costs


def op_costs(timeline) -> dict[tuple[int, str], float]:
    """Median time (us) of each stage's psend and precv outside their waits."""
    stage_of = {d: s for s, d in enumerate(timeline.devices)}
    ops: dict[tuple[int, str], list[float]] = defaultdict(list)
    for m in timeline.messages:
        ops[(stage_of[m.device], m.op)].append(m.dur_us - m.wait_us)
    return {k: statistics.median(v) for k, v in ops.items()}


def measured_idle(timeline, plan) -> tuple[float, float, float]:
    """The step's bubble as the table counts it, from the ticks' marks: the mean over
    devices of the share of the step in which the device runs no action (idle ticks,
    waits, messages).

    Returns ``(idle, idle from the entry, skew)``: the step from the first device's first
    tick (``Timeline.idle_fraction()``), and from stage 0's (the pipeline's entry: no stage
    has anything to do before stage 0's first forward), and how much later (us) stage 0
    started than the first device. In one process the runtime launches the devices'
    programs one after the other, stage 0's (the first device's) last: the other stages
    wait for that too, which no schedule can change."""
    stage_of = {d: s for s, d in enumerate(timeline.devices)}
    S = plan.schedule.stages
    starts = {stage_of[t.device]: t.start_us for t in timeline.ticks if t.tick == 0}
    end = max(t.end_us for t in timeline.ticks)
    busy = sum(t.compute_us for t in timeline.ticks if t.action != "idle")
    first = min(starts.values())
    return (timeline.idle_fraction(), 1 - busy / (S * (end - starts[0])), starts[0] - first)


def simulate(plan, cost, send_us, recv_us) -> float:
    """(wait, idle) of the executor with ``cost(s, t)`` per action and fixed op times: the
    mean over stages of the time blocked in precv, and of the time not computing an action,
    over the span. Each tick's message ops, in program order, couple only the devices they
    name."""
    S = plan.schedule.stages
    now, wait = [0.0] * S, [0.0] * S
    for t in range(plan.ticks):
        for s in range(S):
            now[s] += cost(s, t)
        for _, pairs in plan.messages[t]:
            ready = {}
            for a, b in pairs:  # each device's psend of an op runs before its precv
                now[a] += send_us(a)
                ready[(a, b)] = now[a]
            for a, b in pairs:
                late = max(0.0, ready[(a, b)] - now[b])
                wait[b] += late
                now[b] += late + recv_us(b)
    span = max(now)
    if span <= 0:
        return 0.0, 0.0
    busy = sum(cost(s, t) for s in range(S) for t in range(plan.ticks))
    return sum(wait) / (S * span), 1 - busy / (S * span)


def chunk(p, h):
    """``--depth`` of the example's layers (``p``: leaves ``[depth, ...]``): a Python loop,
    or with ``--scan-layers`` a ``lax.scan`` over them."""
    if ARGS.scan_layers:
        def layer(h, wb):
            return example.stage_forward(example.Params(*wb), h), None

        return jax.lax.scan(layer, h, (p.w, p.b))[0]
    for k in range(ARGS.depth):
        h = example.stage_forward(example.Params(p.w[k], p.b[k]), h)
    return h


def make_step(mesh, schedule):
    """An SGD step of the example's model with ``--depth`` layers per chunk; with
    ``--input-grads`` its pipeline also returns the microbatches' gradient (returned by the
    step, so XLA keeps it)."""
    value_and_grad = pipeline.shard_value_and_grad(
        chunk, example.mse, mesh, schedule, axis_name=example.AXIS,
        return_input_grads=ARGS.input_grads, remat=not ARGS.keep_residuals)

    @jax.jit
    def step(params, xs, ys):
        loss, grads, *dxs = value_and_grad(params, xs, ys)
        new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return (new, dxs), loss

    def run(params, xs, ys):
        (new, _), loss = step(params, xs, ys)
        return new, loss

    return run


def dataflow(plan, cost, send_us, recv_us) -> float:
    """Idle share of the table run as pure dataflow (module docstring):
    ``Schedule.bubble_fraction_for`` with each action's measured cost (a cell the executor
    leaves idle, the first chunk's B where split without input gradients, costs nothing) and
    the stages' mean psend / precv times per message."""
    schedule = plan.schedule
    tick = {(s, a): t for t, row in enumerate(schedule.table) for s, a in enumerate(row) if a}

    def work(s, a):
        t = tick[(s, a)]
        return 0.0 if plan.actions[t, s, 0] == plan_mod.IDLE else cost(s, t)

    stages = range(schedule.stages)
    return schedule.bubble_fraction_for(work, send=statistics.mean(map(send_us, stages)),
                                        receive=statistics.mean(map(recv_us, stages)))


def measure(name: str, root: Path) -> dict[str, object] | None:
    V = 2 if name == "interleaved-1f1b" else 1
    S, M = ARGS.stages, ARGS.microbatches
    mesh = example.stage_mesh(S)
    K = ARGS.depth
    problem = example.make_problem(0, S * V * K, ARGS.width, ARGS.batch)
    stacked, replicated = NamedSharding(mesh, P(example.AXIS)), NamedSharding(mesh, P())
    put = lambda a, sh: jax.make_array_from_callback(a.shape, sh, lambda i: a[i])  # noqa: E731
    chunks = example.Params(*(a.reshape(S * V, K, *a.shape[1:]) for a in problem.init))
    params = example.Params(*(put(a, stacked)
                              for a in example.to_pipeline_layout(chunks, S, V)))
    xs = put(problem.x.reshape(M, -1, ARGS.width), replicated)
    ys = put(problem.y.reshape(M, -1, ARGS.width), replicated)
    schedule = pipeline.schedule_by_name(name, V).bind(S, M)
    plan = plan_mod.make_plan(schedule, ARGS.input_grads, remat=not ARGS.keep_residuals)
    step = make_step(mesh, schedule)
    params, loss = step(params, xs, ys)  # compilation
    jax.block_until_ready((params, loss))
    waits, outside, spans, units, weighted, flows, free = [], [], [], [], [], [], []
    steady: list[float] = []
    spread: dict[str, list[float]] = defaultdict(list)  # every tick's time, by action
    psend_waits, idles, entry_idles, skews = [], [], [], []
    step_costs: list[dict] = []
    for i in range(ARGS.steps):
        directory = root / f"{name}-{i}"
        multihost_utils.sync_global_devices(f"{name}-{i}-start")
        with jax_cpu_mpi.trace(directory):
            params, loss = step(params, xs, ys)
            jax.block_until_ready((params, loss))
        multihost_utils.sync_global_devices(f"{name}-{i}-written")
        if not MAIN:
            continue
        timeline = jax_cpu_mpi.read_timeline(directory)
        summary = timeline.summary().values()
        waits.append(timeline.bubble_fraction())
        outside.append(statistics.mean(1 - s.busy_us / s.span_us for s in summary))
        spans.append(timeline.span_us / 1e3)
        per_tick = tick_costs(timeline, plan)
        op_med = op_costs(timeline)

        def cost(s: int, t: int, per_tick=per_tick) -> float:
            return per_tick[(s, t)]

        send_us = lambda s, o=op_med: o.get((s, "psend"), 0.0)  # noqa: E731
        recv_us = lambda s, o=op_med: o.get((s, "precv"), 0.0)  # noqa: E731
        weighted.append(simulate(plan, cost, send_us, recv_us)[1])
        flows.append(dataflow(plan, cost, send_us, recv_us))
        free.append(dataflow(plan, cost, lambda s: 0.0, lambda s: 0.0))
        by_kind: dict[tuple[int, int], list[float]] = defaultdict(list)
        for (s, t), v in per_tick.items():
            by_kind[(s, int(plan.actions[t, s, 0]))].append(v)
        median = {k: statistics.median(v) for k, v in by_kind.items()}

        def median_cost(s: int, t: int, median=median) -> float:
            return median[(s, int(plan.actions[t, s, 0]))]

        steady.append(dataflow(plan, median_cost, send_us, recv_us))
        for (s, b), v in by_kind.items():
            spread[f"{ACTION[b]}@{s}"].extend(v)
        idle, entry_idle, skew = measured_idle(timeline, plan)
        idles.append(idle)
        entry_idles.append(entry_idle)
        skews.append(skew / 1e3)
        psend_waits.append(sum(m.wait_us for m in timeline.messages if m.op == "psend")
                           / (len(timeline.devices) * timeline.span_us))
        units.append(simulate(plan, lambda s, t: float(plan.actions[t, s, 0] != plan_mod.IDLE),
                              lambda s: 0.0, lambda s: 0.0)[1])
        step_costs.append({f"{ACTION[b]}@{s}": round(v / 1e3, 3)
                           for (s, b), v in sorted(median.items())})
        if i == ARGS.steps - 1 and ARGS.pictures:
            trace_cli.draw(timeline, Path(ARGS.pictures) / f"timeline-{name}.png",
                           title=f"{name}: {S} stages, {M} microbatches, one step "
                                 f"(theory: bubble {schedule.bubble_fraction:.3f})")
    if not MAIN:
        return None
    kinds = defaultdict(list)  # ms per action kind, all stages, median over steps
    for c in step_costs:
        for k, v in c.items():
            kinds[k.split("@")[0]].append(v)
    return {"schedule": name, "ticks": schedule.ticks, "theory": schedule.bubble_fraction,
            "unit_sim": statistics.median(units), "weighted_sim": statistics.median(weighted),
            "weighted_all": weighted, "dataflow": statistics.median(flows),
            "dataflow_all": flows, "dataflow_free_messages": statistics.median(free),
            "dataflow_median_costs": statistics.median(steady), "dataflow_median_costs_all": steady,
            # Coefficient of variation of each action's time over its ticks and the steps.
            "action_cv": {k: statistics.pstdev(v) / statistics.mean(v)
                          for k, v in sorted(spread.items()) if len(v) > 1 and statistics.mean(v)},
            "op_us": {f"{op}@{s}": v for (s, op), v in sorted(op_med.items())},
            "psend_wait": statistics.median(psend_waits),
            "wait": statistics.median(waits), "wait_all": waits,
            "idle": statistics.median(idles), "idle_all": idles,
            "idle_from_entry": statistics.median(entry_idles), "idle_from_entry_all": entry_idles,
            "entry_skew_ms": statistics.median(skews), "entry_skew_ms_all": skews,
            "not_computing": statistics.median(outside), "step_ms": statistics.median(spans),
            "action_ms": {k: statistics.median(v) for k, v in sorted(kinds.items())},
            "action_ms_by_stage": step_costs[-1]}


def main() -> int:
    root = Path(ARGS.trace_dir)
    if MAIN:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    multihost_utils.sync_global_devices("trace-dir")
    rows = []
    for name in ARGS.schedules.split(","):
        r = measure(name, root)
        if r is None:
            continue
        rows.append(r)
        print(f"{name}: theory {r['theory']:.3f}  unit sim {r['unit_sim']:.3f}  weighted sim "
              f"{r['weighted_sim']:.3f}  dataflow {r['dataflow']:.3f} (at median costs "
              f"{r['dataflow_median_costs']:.3f})  idle {r['idle']:.3f} "
              f"{[round(w, 3) for w in r['idle_all']]}  from the entry "
              f"{r['idle_from_entry']:.3f} (skew {r['entry_skew_ms']:.2f} ms)  "
              f"wait {r['wait']:.3f} "
              f"(psend {r['psend_wait']:.3f}) "
              f"{[round(w, 3) for w in r['wait_all']]}  not computing "
              f"{r['not_computing']:.3f}  step {r['step_ms']:.1f} ms  actions (ms) "
              f"{ {k: round(v, 2) for k, v in r['action_ms'].items()} }", flush=True)
    if not MAIN:
        return 0
    layout = f"{jax.process_count()} process(es) x {DEVICES} CPU device(s)"
    print()
    print(f"P={ARGS.stages}, M={ARGS.microbatches}, width {ARGS.width}, batch {ARGS.batch}, "
          f"{ARGS.depth} layer(s) per chunk{' (lax.scan)' if ARGS.scan_layers else ''}, "
          + ("residuals kept (remat=False), " if ARGS.keep_residuals else "remat, ")
          + f"{layout}, median of {ARGS.steps} steps, load average {os.getloadavg()[0]:.2f}"
          + (", input gradients formed (every stage's backward alike)" if ARGS.input_grads
             else ", no input gradient (the first stage's backward is lighter)"))
    print()
    print("| schedule | ticks | theory | median costs | unit sim | weighted sim | free msgs | "
          "dataflow | "
          "measured idle | idle / theory | from the entry | / theory | / dataflow | "
          "entry skew ms | measured wait | step ms | action ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        acts = ", ".join(f"{k} {v:.2f}" for k, v in r["action_ms"].items())
        print(f"| {r['schedule']} | {r['ticks']} | {r['theory']:.3f} | "
              f"{r['dataflow_median_costs']:.3f} | {r['unit_sim']:.3f} | "
              f"{r['weighted_sim']:.3f} | {r['dataflow_free_messages']:.3f} | "
              f"{r['dataflow']:.3f} | {r['idle']:.3f} | "
              f"{r['idle'] / r['theory']:.2f} | {r['idle_from_entry']:.3f} | "
              f"{r['idle_from_entry'] / r['theory']:.2f} | "
              f"{r['idle_from_entry'] / r['dataflow']:.2f} | {r['entry_skew_ms']:.2f} | "
              f"{r['wait']:.3f} | "
              f"{r['step_ms']:.1f} | {acts} |")
    if ARGS.json:
        Path(ARGS.json).write_text(json.dumps({"args": vars(ARGS), "layout": layout,
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
