"""Entry point: parse, start, run, report (rank 0 prints and writes everything)."""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from typing import Any

from . import options as options_mod
from . import report, runner, session, targets
from .options import Options
from .plot import write_plot


def _write_outputs(opts: Options, header: dict[str, Any], outcome: runner.Outcome,
                   goals: list[dict[str, Any]]) -> list[str]:
    """Prints the tables and writes the files; returns notes about what was skipped."""
    notes: list[str] = []
    text = report.tables(outcome.results, opts.formats)
    summary = targets.summary(goals)
    sys.stdout.write(text + "\n")
    for note in outcome.notes:
        sys.stdout.write(f"# note: {note}\n")
    sys.stdout.write(summary)
    if opts.json:
        if opts.json == "-":
            report.write_json_lines(sys.stdout, header, outcome.results, outcome.notes, goals)
        else:
            with open(opts.json, "w") as f:
                report.write_json_lines(f, header, outcome.results, outcome.notes, goals)
    plot_path = opts.plot
    if opts.out:
        os.makedirs(opts.out, exist_ok=True)
        with open(os.path.join(opts.out, "results.jsonl"), "w") as f:
            report.write_json_lines(f, header, outcome.results, outcome.notes, goals)
        for fmt in ("osu", "nccl"):
            with open(os.path.join(opts.out, f"{fmt}.txt"), "w") as f:
                f.write(report.tables(outcome.results, [fmt]))
        with open(os.path.join(opts.out, "targets.txt"), "w") as f:
            f.write(summary)
            f.writelines(f"# note: {note}\n" for note in outcome.notes)
        plot_path = plot_path or os.path.join(opts.out, "plot.png")
    if plot_path and outcome.results:
        title = (f"jax_cpu_mpi.bench on {header.get('host')} ({header.get('cpus')} CPUs), "
                 f"{header.get('ranks')} rank(s), jax {header.get('jax')}, {header.get('date')}")
        why = write_plot(outcome.results, plot_path, title)
        if why:
            notes.append(why)
    return notes


def main(argv: list[str] | None = None) -> int:
    opts = options_mod.parse(argv)
    try:
        sess = session.start(opts.platform, opts.local_devices)
    except session.BenchSetupError as e:
        print(f"jax_cpu_mpi.bench: {e}", file=sys.stderr)
        return 2
    header = dict(sess.describe(),
                  date=datetime.datetime.now().isoformat(timespec="seconds"),
                  command=" ".join([sys.executable, "-m", "jax_cpu_mpi.bench",
                                    *(sys.argv[1:] if argv is None else argv)]),
                  sizes=list(opts.sizes), methods=list(opts.methods), kinds=list(opts.kinds),
                  repeat=opts.repeat, load_average_start=list(os.getloadavg()))
    on_result = None
    if opts.out and sess.is_root:
        # Each result is on disk as soon as it is measured: a failure late in a long run
        # keeps what was measured before it.
        os.makedirs(opts.out, exist_ok=True)
        partial = open(os.path.join(opts.out, "results.partial.jsonl"), "w")

        def on_result(m: Any) -> None:
            partial.write(json.dumps(m.to_json()) + "\n")
            partial.flush()
    try:
        outcome = runner.run(opts, sess, on_result)
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        if sess.comm is not None and sess.nranks > 1:
            # The other ranks wait in a receive: end the whole job now.
            sess.comm.Abort(1)
        return 1
    if not sess.is_root:
        return 0
    if on_result is not None:
        partial.close()
        os.remove(os.path.join(opts.out, "results.partial.jsonl"))
    header["load_average_end"] = list(os.getloadavg())
    goals = targets.evaluate(outcome.results)
    for note in _write_outputs(opts, header, outcome, goals):
        print(f"# note: {note}")
    failed = [f"{m.method} {m.kind} {m.size}" for m in outcome.results if not m.valid]
    if failed:
        print(f"jax_cpu_mpi.bench: validation failed for: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
