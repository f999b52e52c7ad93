"""Measured pipeline bubbles: the message timeline of the pipeline example vs the schedules' theory.

The example's training step (:mod:`jax_cpu_mpi.examples.pipeline`: ``P * V`` layers
``tanh(h @ w + b)``, SGD) runs for each schedule, in one process with ``--stages`` CPU
devices, or under ``mpirun -n P`` with ``--devices 1`` (one stage per process). After a
compilation step each of ``--steps`` steps is recorded into a directory of its own with
:func:`jax_cpu_mpi.trace`, so each timeline is exactly one step, and read with
:func:`jax_cpu_mpi.read_timeline`. Per step:

* ``wait``: the share of the step the devices spent blocked on a peer inside psend/precv
  (``Timeline.bubble_fraction()``, the mean over devices): the measured bubble;
* ``not computing``: the share spent inside psend/precv at all (waits plus copies).

Every message op runs every tick, so each channel carries one message per tick and a
message's number on its channel (``seq``) is its tick. That cuts each device's timeline into
ticks: the time between the last message of tick ``t - 1`` and the first of tick ``t`` is
the device's action of tick ``t`` (from the plan: idle, F, the last chunk's F with the loss,
B, ...). Their medians, per stage and action, are the measured action costs.

Three figures to compare ``wait`` with:

* ``theory``: ``Schedule.bubble_fraction``, idle cells of the table (every action one tick,
  an idle tick free);
* ``unit sim``: the executor's tick loop simulated (each device computes its action, then
  runs the tick's ops in program order; a precv waits for its psend) with every action
  costing 1 and idle 0, messages free;
* ``weighted sim``: the same simulation with the measured action costs (the median per
  stage and action) and the measured time of each psend/precv outside its wait: the theory
  of this schedule on this machine;
* ``replay sim``: the same with each tick's own measured duration (a check of the model:
  where it matches ``wait`` and ``weighted sim`` does not, the difference is the ticks'
  spread around their median, e.g. the load of other jobs).

``psend`` in the printed line is the part of ``wait`` spent in psend (the model counts none).

Figures only, no assertion. ``--pictures DIR`` also draws one step of each schedule
(``timeline-NAME.png``); ``--json FILE`` writes every number.

    python benchmarks/pipeline_bubbles.py --width 512 --batch 2048 --steps 5
    mpirun -n 2 -bind-to core python benchmarks/pipeline_bubbles.py --stages 2 --devices 1
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
          plan_mod.BACKWARD_INPUT: "B(dx)", plan_mod.WEIGHT: "W"}


def ticks_of(timeline) -> dict[int, dict[int, list]]:
    """Per stage and tick, that device's messages (a channel's n-th message is tick n).

    The timeline numbers devices process by process, as ``example.stage_mesh`` orders the
    stages (JAX's own device ids are not contiguous across processes)."""
    stage_of = {d: s for s, d in enumerate(timeline.devices)}
    first_seq: dict[tuple, int] = {}
    for m in timeline.messages:
        key = (m.op, m.device, m.peer)
        first_seq[key] = min(first_seq.get(key, m.seq), m.seq)
    out: dict[int, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    for m in timeline.messages:
        out[stage_of[m.device]][m.seq - first_seq[(m.op, m.device, m.peer)]].append(m)
    return out


def action_costs(by_tick, plan) -> tuple[dict, dict, dict]:
    """Measured durations (us) of each (stage, branch), and of each stage's psend and precv
    outside their waits: lists over the step's ticks; and each (stage, tick)'s action."""
    costs: dict[tuple[int, int], list[float]] = defaultdict(list)
    ops: dict[tuple[int, str], list[float]] = defaultdict(list)
    cells: dict[tuple[int, int], float] = {}
    for s, ticks in by_tick.items():
        for t in sorted(ticks):
            for m in ticks[t]:
                ops[(s, m.op)].append(m.dur_us - m.wait_us)
            if t == 0 or t - 1 not in ticks:
                continue  # the action of tick 0 starts before the timeline does
            gap = min(m.start_us for m in ticks[t]) - max(m.end_us for m in ticks[t - 1])
            costs[(s, int(plan.actions[t, s, 0]))].append(gap)
            cells[(s, t)] = gap
    return costs, ops, cells


def simulate(plan, cost, send_us, recv_us) -> float:
    """Wait share (mean over stages of the time blocked in precv / the span) of the
    executor's tick loop with ``cost(s, t)`` per action and fixed op times."""
    S = plan.schedule.stages
    now, wait = [0.0] * S, [0.0] * S
    for t in range(plan.ticks):
        for s in range(S):
            now[s] += cost(s, t)
        for op in plan.ops:
            ready = {}
            for a, b in op:  # each device's psend of an op runs before its precv
                now[a] += send_us(a)
                ready[(a, b)] = now[a]
            for a, b in op:
                late = max(0.0, ready[(a, b)] - now[b])
                wait[b] += late
                now[b] += late + recv_us(b)
    span = max(now)
    return sum(wait) / (S * span) if span > 0 else 0.0


def measure(name: str, root: Path) -> dict[str, object] | None:
    V = 2 if name == "interleaved-1f1b" else 1
    S, M = ARGS.stages, ARGS.microbatches
    mesh = example.stage_mesh(S)
    problem = example.make_problem(0, S * V, ARGS.width, ARGS.batch)
    stacked, replicated = NamedSharding(mesh, P(example.AXIS)), NamedSharding(mesh, P())
    put = lambda a, sh: jax.make_array_from_callback(a.shape, sh, lambda i: a[i])  # noqa: E731
    params = example.Params(*(put(a, stacked)
                              for a in example.to_pipeline_layout(problem.init, S, V)))
    xs = put(problem.x.reshape(M, -1, ARGS.width), replicated)
    ys = put(problem.y.reshape(M, -1, ARGS.width), replicated)
    schedule = pipeline.schedule_by_name(name, V).bind(S, M)
    plan = plan_mod.make_plan(schedule)
    step = example.make_pipeline_step(mesh, schedule, 0.1)
    params, loss = step(params, xs, ys)  # compilation
    jax.block_until_ready((params, loss))
    waits, outside, spans, units, weighted = [], [], [], [], []
    replays, psend_waits = [], []
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
        costs, ops, cells = action_costs(ticks_of(timeline), plan)
        med = {k: statistics.median(v) for k, v in costs.items()}
        by_branch = defaultdict(list)
        for (_, b), v in costs.items():
            by_branch[b] += v
        any_stage = {b: statistics.median(v) for b, v in by_branch.items()}
        op_med = {k: statistics.median(v) for k, v in ops.items()}

        def cost(s: int, t: int, med=med, any_stage=any_stage) -> float:
            b = int(plan.actions[t, s, 0])
            return med.get((s, b), any_stage.get(b, 0.0))

        send_us = lambda s, o=op_med: o.get((s, "psend"), 0.0)  # noqa: E731
        recv_us = lambda s, o=op_med: o.get((s, "precv"), 0.0)  # noqa: E731
        weighted.append(simulate(plan, cost, send_us, recv_us))
        replays.append(simulate(plan, lambda s, t, c=cells, f=cost: c.get((s, t), f(s, t)),
                                send_us, recv_us))
        psend_waits.append(sum(m.wait_us for m in timeline.messages if m.op == "psend")
                           / (len(timeline.devices) * timeline.span_us))
        units.append(simulate(plan, lambda s, t: float(plan.actions[t, s, 0] != plan_mod.IDLE),
                              lambda s: 0.0, lambda s: 0.0))
        step_costs.append({f"{ACTION[b]}@{s}": round(v / 1e3, 3)
                           for (s, b), v in sorted(med.items())})
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
            "weighted_all": weighted, "replay_sim": statistics.median(replays),
            "psend_wait": statistics.median(psend_waits),
            "wait": statistics.median(waits), "wait_all": waits,
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
              f"{r['weighted_sim']:.3f}  replay sim {r['replay_sim']:.3f}  wait {r['wait']:.3f} "
              f"(psend {r['psend_wait']:.3f}) "
              f"{[round(w, 3) for w in r['wait_all']]}  not computing "
              f"{r['not_computing']:.3f}  step {r['step_ms']:.1f} ms  actions (ms) "
              f"{ {k: round(v, 2) for k, v in r['action_ms'].items()} }", flush=True)
    if not MAIN:
        return 0
    layout = f"{jax.process_count()} process(es) x {DEVICES} CPU device(s)"
    print()
    print(f"P={ARGS.stages}, M={ARGS.microbatches}, width {ARGS.width}, batch {ARGS.batch}, "
          f"{layout}, median of {ARGS.steps} steps, load average {os.getloadavg()[0]:.2f}")
    print()
    print("| schedule | ticks | theory | unit sim | weighted sim | replay sim | measured wait | "
          "wait / theory | wait / weighted | not computing | step ms | action ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        acts = ", ".join(f"{k} {v:.2f}" for k, v in r["action_ms"].items())
        print(f"| {r['schedule']} | {r['ticks']} | {r['theory']:.3f} | {r['unit_sim']:.3f} | "
              f"{r['weighted_sim']:.3f} | {r['replay_sim']:.3f} | {r['wait']:.3f} | "
              f"{r['wait'] / r['theory']:.2f} | "
              f"{r['wait'] / r['weighted_sim']:.2f} | {r['not_computing']:.3f} | "
              f"{r['step_ms']:.1f} | {acts} |")
    if ARGS.json:
        Path(ARGS.json).write_text(json.dumps({"args": vars(ARGS), "layout": layout,
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
