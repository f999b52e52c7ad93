"""Measured pipeline bubbles: the message timeline of the pipeline example vs the schedules' theory.

One process with ``--stages`` CPU devices runs the example's training step
(:mod:`jax_cpu_mpi.examples.pipeline`) for each schedule; after a compilation step each of
``--steps`` steps is recorded into a directory of its own with :func:`jax_cpu_mpi.trace`,
so each timeline is exactly one step. Per step and device, from
:func:`jax_cpu_mpi.read_timeline`:

* ``wait``: the share of the step the device spent blocked on a peer inside psend/precv
  (``Timeline.bubble_fraction()``, the mean over devices);
* ``not computing``: the share spent inside psend/precv at all (waits plus copies), i.e.
  one minus the share outside them, where the device computes its tick's action.

Both are compared with ``Schedule.bubble_fraction`` (idle cells of the table). Figures only,
no assertion. ``--pictures DIR`` also draws one step of each schedule (``timeline-NAME.png``).

    python benchmarks/pipeline_bubbles.py --width 512 --batch 1024 --steps 3
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedules", default="gpipe,1f1b,interleaved-1f1b,zero-bubble")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3, help="recorded steps per schedule")
    p.add_argument("--pictures", default=None, help="directory for timeline-NAME.png")
    return p.parse_args()


ARGS = parse_args()
flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={ARGS.stages}"

import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_cpu_mpi  # noqa: E402
from jax_cpu_mpi import pipeline  # noqa: E402
from jax_cpu_mpi._src.cli import trace as trace_cli  # noqa: E402
from jax_cpu_mpi.examples import pipeline as example  # noqa: E402


def measure(name: str, root: Path) -> dict[str, object]:
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
    step = example.make_pipeline_step(mesh, schedule, 0.1)
    params, loss = step(params, xs, ys)  # compilation
    jax.block_until_ready((params, loss))
    waits, outside, spans = [], [], []
    for i in range(ARGS.steps):
        directory = root / f"{name}-{i}"
        with jax_cpu_mpi.trace(directory):
            params, loss = step(params, xs, ys)
            jax.block_until_ready((params, loss))
        timeline = jax_cpu_mpi.read_timeline(directory)
        summary = timeline.summary().values()
        waits.append(timeline.bubble_fraction())
        outside.append(statistics.mean(1 - s.busy_us / s.span_us for s in summary))
        spans.append(timeline.span_us / 1e3)
        if i == ARGS.steps - 1 and ARGS.pictures:
            trace_cli.draw(timeline, Path(ARGS.pictures) / f"timeline-{name}.png",
                           title=f"{name}: {S} stages, {M} microbatches, one step "
                                 f"(theory: bubble {schedule.bubble_fraction:.3f})")
    return {"schedule": name, "ticks": schedule.ticks, "theory": schedule.bubble_fraction,
            "wait": statistics.median(waits), "wait_all": waits,
            "not_computing": statistics.median(outside), "step_ms": statistics.median(spans)}


def main() -> int:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ARGS.schedules.split(","):
            rows.append(measure(name, Path(tmp)))
            r = rows[-1]
            print(f"{name}: theory {r['theory']:.3f}  wait {r['wait']:.3f} "
                  f"{[round(w, 3) for w in r['wait_all']]}  not computing "
                  f"{r['not_computing']:.3f}  step {r['step_ms']:.1f} ms",
                  flush=True)
    print()
    print(f"P={ARGS.stages}, M={ARGS.microbatches}, width {ARGS.width}, batch {ARGS.batch}, "
          f"{jax.device_count()} CPU devices in one process, median of {ARGS.steps} steps")
    print()
    print("| schedule | ticks | theory | measured wait | wait / theory | not computing "
          "| step ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['schedule']} | {r['ticks']} | {r['theory']:.3f} | {r['wait']:.3f} | "
              f"{r['wait'] / r['theory']:.2f} | {r['not_computing']:.3f} | "
              f"{r['step_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
