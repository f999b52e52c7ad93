"""The pipeline benchmark with a data axis across processes: step time with the cross-process
gradient average over gloo (JAX's path) and over MPI (``JAX_CPU_MPI_COLLECTIVES``).

    python benchmarks/pipeline/data_axis.py                       # defaults below
    python benchmarks/pipeline/data_axis.py --stages 2 --data 2 --schedules 1f1b,gpipe \\
        --rounds 5 --out benchmarks/results/pipeline/dev-2core/data-axis

The model is ``run.py``'s (``model.py``: ``--layers`` x ``--width``, ``--batch`` samples in
``--microbatches``). A launch is ``mpirun -n D jax_bench.py --devices S --stages S --data D
--collectives SETTING``: a ``stage x data`` mesh with the ``S`` stages inside each process and
the ``D`` data shards across the processes, every schedule compiled with
``JAX_CPU_MPI_COLLECTIVES`` = ``gloo`` or ``mpi`` (read when a program is lowered) and checked
against the float64 reference before it is timed. The only collective between processes is
the ``pmean`` of the loss and the gradients over ``data`` (the stages' sends stay inside a
process), so the difference is the transport of that average. Each round launches both
settings, in alternating order (gloo, mpi; mpi, gloo; ...); the launches' digests of the
loss and gradients must agree (bit-equal: two shards sum in one order). ``--together``
instead compiles both settings in one launch per round and times them in turn (the runs then
share the processes; the table says which).

The figure is the median step time over all steps of all rounds; the ratio (gloo / MPI,
> 1: MPI faster) is the median over rounds of the ratio of the rounds' medians. Writes
``OUT/data-axis.md`` (the table, the notes) and ``OUT/data-axis.json`` (everything).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from model import add_model_arguments  # noqa: E402
from run import NAMES, git_state, launch, mpirun, round_ratio  # noqa: E402

SETTINGS = ("gloo", "mpi")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/pipeline/data_axis.py",
                                description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.set_defaults(stages=2)
    p.add_argument("--data", type=int, default=2,
                   help="data-parallel shards = MPI processes (each holds every stage)")
    p.add_argument("--schedules", default="1f1b,gpipe",
                   help=f"comma-separated, of {', '.join(SCHEDULES)}")
    p.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, default=2, help="repeats per run and launch")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4,
                   help="rounds, each launching both settings (their order alternates)")
    p.add_argument("--together", action="store_true",
                   help="both settings in one launch per round, timed in turn")
    p.add_argument("--timeout", type=float, default=300, help="seconds per launch")
    p.add_argument("--out", default=None, help="output folder (default "
                   "benchmarks/results/pipeline/dev-<cores>core/data-axis)")
    p.add_argument("--note", default="", help="a line for the notes (e.g. machine shared)")
    p.add_argument("--from-json", default=None, metavar="DATA_AXIS_JSON",
                   help="measure nothing: write the table again from a recorded "
                        "data-axis.json (into its folder)")
    a = p.parse_args(argv)
    schedules = [s for s in a.schedules.split(",") if s]
    bad = [s for s in schedules if s not in SCHEDULES]
    if bad or not schedules:
        p.error(f"--schedules: unknown {', '.join(bad) or '(none)'}; use {', '.join(SCHEDULES)}")
    if a.data < 2:
        p.error("--data must be at least 2 (the data axis crosses processes)")
    if a.batch % (a.microbatches * a.data):
        p.error(f"--batch {a.batch} must be a multiple of --microbatches x --data = "
                f"{a.microbatches * a.data}")
    return a


def command(a: argparse.Namespace, order: tuple[str, ...], launcher: str) -> list[str]:
    """One launch: ``D`` processes x ``S`` devices, every schedule under both settings."""
    model = ["--layers", a.layers, "--width", a.width, "--batch", a.batch,
             "--microbatches", a.microbatches, "--virtual-stages", a.virtual_stages,
             "--seed", a.seed, "--stages", a.stages, "--data", a.data,
             "--devices", a.stages, "--steps", a.steps, "--repeats", a.repeats,
             "--warmup", a.warmup]
    return [launcher, "-n", str(a.data), sys.executable, str(HERE / "jax_bench.py"),
            "--schedule", a.schedules, "--collectives", ",".join(order),
            *(str(v) for v in model)]


def orders(rounds: int) -> list[tuple[str, ...]]:
    """The settings' order in each round, alternating (a warm-up effect falls on both)."""
    return [SETTINGS if r % 2 == 0 else SETTINGS[::-1] for r in range(rounds)]


def round_launches(order: tuple[str, ...], together: bool) -> list[tuple[str, ...]]:
    """The launches of one round: each setting alone, in order, or both in one."""
    return [order] if together else [(s,) for s in order]


def _median_ms(rounds: list[dict]) -> float | None:
    steps = [np.concatenate(r["step_seconds"]) for r in rounds if r.get("step_seconds")]
    return float(np.median(np.concatenate(steps))) * 1e3 if steps else None


def summarize(runs: dict[str, list[dict]], schedules: list[str]) -> list[dict]:
    """One row per schedule: both settings' median step, the ratio, the checks."""
    rows = []
    for s in schedules:
        gloo, mpi = runs.get(f"{s}@gloo", []), runs.get(f"{s}@mpi", [])
        both = gloo + mpi
        checks = [r["check"] for r in both if "check" in r]
        digests = {r["digest"] for r in both if "digest" in r}
        ratios = []
        for g, m in zip(gloo, mpi, strict=False):
            if g.get("step_seconds") and m.get("step_seconds"):
                ratios.append(round_ratio({"rounds": [m]}, {"rounds": [g]}))
        rows.append({
            "schedule": s, "gloo_ms": _median_ms(gloo), "mpi_ms": _median_ms(mpi),
            "ratio": float(np.median(ratios)) if ratios else None,
            "round_ratios": ratios,
            "check": (bool(checks) and len(checks) == len(both) and len(digests) <= 1
                      and all(c["ok"] for c in checks)),
            "grad_rel_diff": max((c["grad_rel_diff"] for c in checks), default=None),
            # In one launch (--together): each setting against the first one, not itself.
            "gloo_vs_mpi_grads_max_abs_diff": max(
                (r["check"]["same_as_first_setting"]["grads_max_abs_diff"] for r in both
                 if "same_as_first_setting" in r.get("check", {})
                 and r["check"]["same_as_first_setting"]["against"] != r.get("collectives")),
                default=None),
            # Across launches: one digest of loss and gradients for every run, or several.
            "digests": len(digests),
            "mpi_all_reduce_calls": max((r.get("mpi_all_reduce_calls", 0) for r in mpi),
                                        default=0),
            "errors": sorted({r["error"] for r in both if "error" in r}),
        })
    return rows


def table(a: argparse.Namespace, rows: list[dict], meta: dict, notes: list[str]) -> str:
    per = a.batch // (a.microbatches * a.data)
    lines = [
        "# Pipeline with a data axis across processes: gradient average over gloo vs MPI",
        "",
        f"{meta['date']}, {meta['machine']}. Model: {a.layers} layers x width {a.width}, "
        f"batch {a.batch}, float32, MSE; {a.stages} stages inside each process x {a.data} data "
        f"shards across processes (`mpirun -n {a.data}`, {a.stages} CPU devices each); "
        f"{a.microbatches} microbatches of {per} samples per data shard. One step = loss and "
        f"gradients of one batch, averaged over the data axis (`pmean`, the one collective "
        f"between processes). {a.rounds} launches x {a.repeats} repeats x {a.steps} steps "
        f"after {a.warmup} warm-up steps per run, "
        + ("gloo and MPI taking turns in each launch." if getattr(a, "together", False) else
           "gloo and MPI in separate launches (JAX_CPU_MPI_COLLECTIVES), alternating."),
        "",
        "| schedule | step, gloo (ms) | step, MPI (ms) | gloo / MPI (speed-up) | "
        "rounds' ratios | check vs reference (max grad rel. diff) | gloo vs MPI gradients |",
        "| --- | ---: | ---: | ---: | --- | --- | --- |"]
    for r in rows:
        if r["gloo_ms"] is None or r["mpi_ms"] is None:
            lines.append(f"| {NAMES[r['schedule']]} | failed: "
                         f"{', '.join(r['errors']) or 'no result'} | | | | | |")
            continue
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "n/a"
        spread = (f"{min(r['round_ratios']):.2f}-{max(r['round_ratios']):.2f}"
                  if r["round_ratios"] else "")
        diff = r["gloo_vs_mpi_grads_max_abs_diff"]
        if diff is not None:  # compared in one launch (--together)
            same = "bit-equal" if diff == 0 else f"max |diff| {diff:.1e}"
        else:
            same = {0: "n/a", 1: "bit-equal"}.get(r.get("digests", 0), "DIFFER")
        lines.append(f"| {NAMES[r['schedule']]} | {r['gloo_ms']:.2f} | {r['mpi_ms']:.2f} | "
                     f"{ratio} | {spread} | {'PASS' if r['check'] else 'FAIL'} "
                     f"({r['grad_rel_diff']:.1e}) | {same} |")
    # Notes as a list, no heading: docs/benchmarks.md includes the file inside a section.
    lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def derived_notes(a: argparse.Namespace, meta: dict, rows: list[dict]) -> list[str]:
    dirty = meta["git"]["uncommitted"]
    calls = max((r["mpi_all_reduce_calls"] for r in rows), default=0)
    return [f"code: commit {meta['git']['head']}" +
            (f", with uncommitted changes to {', '.join(dirty)}" if dirty else ""),
            f"the MPI runs' compiled programs hold {calls} MPI all-reduce(s) "
            "(jax_cpu_mpi_all_reduce: the loss and the gradients), the gloo runs' none",
            "ratio: per launch, gloo's median step / MPI's; the median over launches "
            "(> 1: the step is faster with MPI)",
            f"load average at start {meta['loadavg_start'][0]:.2f}, at end "
            f"{meta['loadavg_end'][0]:.2f} (1 min)"]


def write(a: argparse.Namespace, out: Path, runs: dict[str, list[dict]], notes: list[str],
          meta: dict) -> str:
    schedules = [s for s in a.schedules.split(",") if s]
    rows = summarize(runs, schedules)
    text = table(a, rows, meta, notes + derived_notes(a, meta, rows))
    (out / "data-axis.md").write_text(text)
    (out / "data-axis.json").write_text(json.dumps(
        {"meta": meta, "args": vars(a), "notes": notes, "rows": rows, "runs": runs}, indent=1))
    return text


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.from_json:
        path = Path(a.from_json)
        dump = json.loads(path.read_text())
        text = write(argparse.Namespace(**dump["args"]), path.parent, dump["runs"],
                     dump["notes"], dump["meta"])
        print(text)
        return 0
    out = Path(a.out or HERE.parent / "results" / "pipeline" / f"dev-{os.cpu_count()}core" /
               "data-axis")
    out.mkdir(parents=True, exist_ok=True)
    import jax

    meta = {"date": f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "jax": jax.__version__, "python": platform.python_version(),
            "loadavg_start": os.getloadavg(), "git": git_state()}
    notes = [a.note] if a.note else []
    notes.append("command: " + " ".join(["python", "benchmarks/pipeline/data_axis.py",
                                          *(argv if argv is not None else sys.argv[1:])]))
    env = dict(os.environ)
    env.setdefault("JAX_CPU_MPI_RECV_TIMEOUT", "120")  # a lost message fails, never hangs
    runs: dict[str, list[dict]] = {}
    failed = False
    for rnd, order in enumerate(orders(a.rounds)):
        for settings in round_launches(order, a.together):
            cmd = command(a, settings, mpirun())
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "r.json"
                start = time.perf_counter()
                rc, log = launch([*cmd, "--out", str(path)], a.timeout, env)
                took = time.perf_counter() - start
                got = json.loads(path.read_text())["results"] if path.exists() else []
            for line in log.splitlines():
                if line.startswith("jax "):
                    print(f"[round {rnd + 1}/{a.rounds}] {line}", flush=True)
            print(f"[round {rnd + 1}/{a.rounds}] {','.join(settings)}: {took:.0f} s", flush=True)
            if rc != 0:
                failed = True
                why = "timed out" if rc is None else f"exit {rc}"
                print(f"{' '.join(cmd)}: {why}\n{log[-3000:]}", file=sys.stderr, flush=True)
            done = {f"{r['schedule']}@{r['collectives']}": r for r in got}
            for s in filter(None, a.schedules.split(",")):
                for setting in settings:
                    key = f"{s}@{setting}"
                    runs.setdefault(key, []).append(
                        done.get(key) or {"error": "timed out" if rc is None else f"exit {rc}"})
    meta["loadavg_end"] = os.getloadavg()
    print(write(a, out, runs, notes, meta))
    print(f"data_axis: wrote {out}/data-axis.md, data-axis.json")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
