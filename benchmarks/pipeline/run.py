"""Pipeline schedules of ``jax_cpu_mpi.pipeline`` next to ``torch.distributed.pipelining``.

One command runs every configuration, in interleaved rounds, and writes one table::

    python benchmarks/pipeline/run.py                              # defaults below
    python benchmarks/pipeline/run.py --layers 8 --width 512 --batch 512 --microbatches 8 \
        --rounds 3 --torch-python /work/venv-torch/bin/python --out benchmarks/results/NAME

The model (``model.py``): ``--layers`` layers of ``--width`` features, ``h -> tanh(h @ w + b)``,
mean squared error against targets, float32, the same NumPy init from ``--seed`` on both
sides, split evenly into ``--stages`` stages (x ``--virtual-stages`` for interleaved 1F1B);
``--microbatches`` microbatches of the ``--batch`` samples. Every configuration computes the
loss and the gradients of one batch per step (no optimizer update) and is first checked
against a float64 NumPy reference of the whole model.

Configurations (one launch per layout, with a timeout; the schedules of a launch take turns,
a repeat each, so that a change of the shared machine's load falls on all of them alike):

* ``jax baseline``: ``jit(value_and_grad)`` of the whole model, full batch, 1 device;
* ``jax <schedule>`` for GPipe, 1F1B, Interleaved1F1B, ZeroBubble (``jax_cpu_mpi.pipeline``)
  in the layouts of ``--layouts``: ``1x4`` (one process, 4 CPU devices), ``2x2``
  (``mpirun -n 2``, 2 devices each), ``4x1`` (``mpirun -n 4``);
* ``torch <schedule>`` for ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B on gloo,
  ``torchrun --nproc-per-node P`` (one stage, or V looping stages, per process), with
  ``--torch-python`` (a Python with torch; skipped with a note when it has none).

Each round runs every launch once (``--steps`` timed steps x ``--repeats`` per schedule
after ``--warmup``); the figure is the median step time over all steps of all rounds, shown as
samples/s (batch / median step); the spread is the range of the rounds' medians. A ratio
(targets) is the median over rounds of the ratio within each round, so that a change of
phase of a shared machine moves both sides together. Memory: XLA's compiled memory analysis
(temp bytes of one device's program) for JAX; for both, the peak RSS of the job's largest
process (``getrusage``).

Writes ``OUT/pipeline.md`` (the table, the targets, the notes), ``OUT/pipeline.json``
(everything, every step) and ``OUT/pipeline.png`` (needs matplotlib; skipped with a note).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
from model import add_model_arguments  # noqa: E402

JAX_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
TORCH_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
LAYOUTS = {"1x4": (1, 4), "2x2": (2, 2), "4x1": (4, 1)}
NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B",
         "zero-bubble": "ZeroBubble", "baseline": "single device"}
# NAME-kept: the schedule with remat=False (jax_bench.py).
NAMES.update({f"{k}-kept": f"{v}, remat=False" for k, v in list(NAMES.items())})


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/pipeline/run.py",
                                description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, default=2, help="repeats per configuration and round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layouts", default="1x4,2x2,4x1",
                   help="JAX layouts: processes x devices, comma separated (1x4,2x2,4x1)")
    p.add_argument("--schedules", default=",".join(JAX_SCHEDULES),
                   help="JAX schedules, comma separated; NAME-kept runs NAME with remat=False "
                        "(the forwards keep their residuals)")
    p.add_argument("--torch-python", default=os.environ.get("TORCH_PYTHON",
                                                            "/work/venv-torch/bin/python"),
                   help="a Python with torch for the torch side ('' skips it)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per launch")
    p.add_argument("--out", default=None,
                   help="output folder (default benchmarks/results/pipeline/<machine>)")
    p.add_argument("--note", default="", help="a line for the notes (e.g. machine shared)")
    p.add_argument("--from-json", default=None, metavar="PIPELINE_JSON",
                   help="measure nothing: write the table and plot again from a recorded "
                        "pipeline.json (into its folder)")
    return p.parse_args(argv)


def mpirun() -> str:
    local = Path(sys.executable).parent / "mpirun"
    return str(local) if local.exists() else (shutil.which("mpirun") or "mpirun")


def launch(cmd: list[str], timeout: float, env: dict[str, str]) -> tuple[int | None, str]:
    """Run ``cmd`` in its own process group; kill the group at ``timeout`` (returns None)."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=REPO, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        log.seek(0)
        return rc, log.read()


def launches(a: argparse.Namespace, torch_ok: bool) -> list[dict]:
    """One launch per layout; each runs several configurations (its schedules take turns)."""
    common = ["--layers", a.layers, "--width", a.width, "--batch", a.batch,
              "--microbatches", a.microbatches, "--virtual-stages", a.virtual_stages,
              "--steps", a.steps, "--repeats", a.repeats, "--warmup", a.warmup,
              "--seed", a.seed]
    common = [str(c) for c in common]
    jax_script = str(HERE / "jax_bench.py")
    schedules = [s for s in a.schedules.split(",") if s]
    out = [{"framework": "jax", "layout": "1x1", "schedules": ["baseline"],
            "cmd": [sys.executable, jax_script, "--schedule", "baseline",
                    "--stages", str(a.stages), *common]}]
    for layout in filter(None, a.layouts.split(",")):
        procs, devs = LAYOUTS[layout]
        if procs * devs != a.stages:
            continue
        prefix = [mpirun(), "-n", str(procs)] if procs > 1 else []
        out.append({"framework": "jax", "layout": layout, "schedules": schedules,
                    "cmd": [*prefix, sys.executable, jax_script,
                            "--schedule", ",".join(schedules), "--devices", str(devs),
                            "--stages", str(a.stages), *common]})
    if torch_ok:
        torchrun = [a.torch_python, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", str(a.stages)]
        out.append({"framework": "torch", "layout": f"{a.stages}x1",
                    "schedules": list(TORCH_SCHEDULES),
                    "cmd": [*torchrun, str(HERE / "torch_bench.py"),
                            "--schedule", ",".join(TORCH_SCHEDULES), *common]})
    for launch_ in out:
        launch_["keys"] = [f"{launch_['framework']}/{s}/{launch_['layout']}"
                           for s in launch_["schedules"]]
    return out


def git_state() -> dict:
    """The commit measured, and the package files that differ from it."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                  timeout=30).stdout.rstrip()
        except (OSError, subprocess.TimeoutExpired):
            return ""
    changed = git("status", "--porcelain", "--", "python", "cpp", "benchmarks/pipeline")
    return {"head": git("rev-parse", "--short", "HEAD") or "unknown",
            "uncommitted": [line[3:] for line in changed.splitlines()]}


def torch_available(python: str) -> tuple[bool, str]:
    if not python:
        return False, "torch side skipped (--torch-python '')"
    try:
        r = subprocess.run([python, "-c", "import torch; print(torch.__version__)"],
                           capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"torch side skipped: {python} does not run ({e})"
    if r.returncode:
        return False, f"torch side skipped: {python} cannot import torch"
    return True, f"torch {r.stdout.strip()} from {python}"


def summarize(cfg: dict, batch: int) -> dict:
    rounds = cfg["rounds"]
    ok = [r for r in rounds if r.get("step_seconds")]
    if not ok:
        return {"samples_per_s": None}
    steps = np.concatenate([np.concatenate(r["step_seconds"]) for r in ok])
    round_medians = [float(np.median(np.concatenate(r["step_seconds"]))) for r in ok]
    last = ok[-1]
    peak = max(last["memory"]["peak_rss_bytes"])
    return {"median_step_s": float(np.median(steps)),
            "samples_per_s": batch / float(np.median(steps)),
            "round_samples_per_s": [batch / m for m in round_medians],
            "temp_bytes": last.get("temp_bytes"), "peak_rss_bytes": peak,
            "cpu_per_wall": float(np.median([sum(r["cpu_seconds_per_step"]) /
                                             np.mean(np.concatenate(r["step_seconds"]))
                                             for r in ok if "cpu_seconds_per_step" in r]
                                            or [np.nan])),
            "check": all(r["check"]["ok"] for r in ok),
            "grad_rel_diff": max(r["check"]["grad_rel_diff"] for r in ok),
            "bubble_fraction_theory": last.get("bubble_fraction_theory"),
            "layout_text": last.get("layout")}


def round_ratio(num: dict, den: dict) -> float | None:
    """Median over rounds of (num samples/s) / (den samples/s) within each round."""
    ratios = []
    for a, b in zip(num["rounds"], den["rounds"], strict=False):
        if a.get("step_seconds") and b.get("step_seconds"):
            ratios.append(float(np.median(np.concatenate(b["step_seconds"])) /
                                np.median(np.concatenate(a["step_seconds"]))))
    return float(np.median(ratios)) if ratios else None


def bubble(fraction: float | None) -> str:
    return "" if fraction is None or fraction != fraction else f"{fraction:.3f}"


def mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def write_outputs(a, out: Path, cfgs: list[dict], notes: list[str], meta: dict) -> None:
    by_key = {c["key"]: c for c in cfgs}
    base = by_key.get("jax/baseline/1x1")
    base_sps = base["summary"].get("samples_per_s") if base else None
    lines = ["# Pipeline schedules: jax_cpu_mpi.pipeline vs torch.distributed.pipelining",
             "",
             f"{meta['date']}, {meta['machine']}. Model: {a.layers} layers x width {a.width}, "
             f"batch {a.batch}, float32, MSE; {a.stages} stages, {a.microbatches} "
             f"microbatches of {a.batch // a.microbatches}, {a.virtual_stages} virtual stages "
             f"for Interleaved1F1B. One step = loss and gradients of one batch. "
             f"{a.rounds} rounds x {a.repeats} repeats x {a.steps} steps after {a.warmup} "
             f"warm-up steps per configuration.",
             "",
             "| framework | schedule | layout (processes x devices) | samples/s (median) | "
             "rounds' range | vs single device | bubble (theory) | CPU busy (cores) | "
             "XLA temp MiB (per device) | peak RSS MiB (largest process) | "
             "check (max grad rel. diff) |",
             "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for c in cfgs:
        s = c["summary"]
        if s.get("samples_per_s") is None:
            lines.append(f"| {c['framework']} | {NAMES[c['schedule']]} | {c['layout']} | "
                         f"failed: {c.get('error', '?')} | | | | | | | |")
            continue
        rng = s["round_samples_per_s"]
        rel = f"{s['samples_per_s'] / base_sps:.2f}x" if base_sps else "n/a"
        launcher = {"jax": {"1x1": "1 x 1", "1x4": "1 x 4", "2x2": "2 x 2 (mpirun)",
                            "4x1": "4 x 1 (mpirun)"}.get(c["layout"], c["layout"]),
                    "torch": f"{a.stages} x 1 (torchrun, gloo)"}[c["framework"]]
        lines.append(
            f"| {c['framework']} | {NAMES[c['schedule']]} | {launcher} | "
            f"{s['samples_per_s']:.0f} | {min(rng):.0f}-{max(rng):.0f} | {rel} | "
            f"{bubble(s.get('bubble_fraction_theory'))} | {s['cpu_per_wall']:.2f} | "
            f"{mib(s['temp_bytes'])} | "
            f"{mib(s['peak_rss_bytes'])} | "
            f"{'PASS' if s['check'] else 'FAIL'} ({s['grad_rel_diff']:.1e}) |")
    lines += ["", "## Targets (issue 25)", ""]
    targets = []

    def target(ours: dict | None, theirs: dict | None, goal: float, text: str) -> None:
        r = round_ratio(ours, theirs) if ours and theirs else None
        if r is not None:
            targets.append({"target": text, "ratio": r, "goal": goal, "met": r >= goal})

    for layout in filter(None, a.layouts.split(",")):
        one = by_key.get(f"jax/1f1b/{layout}")
        target(one, by_key.get(f"jax/gpipe/{layout}"), 1.0,
               f"jax 1F1B >= jax GPipe, M={a.microbatches}, P={a.stages}, layout {layout}")
        target(by_key.get(f"jax/1f1b-kept/{layout}"), by_key.get(f"jax/gpipe-kept/{layout}"),
               1.0, f"jax 1F1B >= jax GPipe, both remat=False, M={a.microbatches}, "
                    f"P={a.stages}, layout {layout}")
        target(one, by_key.get(f"torch/1f1b/{a.stages}x1"), 1.5,
               f"jax 1F1B (layout {layout}) >= 1.5x torch 1F1B (gloo, {a.stages} x 1)")
    for t in targets:
        lines.append(f"- {t['target']}: ratio {t['ratio']:.2f} "
                     f"(median over rounds of the within-round ratio) -> "
                     f"{'met' if t['met'] else 'NOT met'}")
    if not targets:
        lines.append("- no target could be computed (missing configurations)")
    lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    (out / "pipeline.md").write_text("\n".join(lines) + "\n")
    dump = {"meta": meta, "args": vars(a), "targets": targets, "notes": notes,
            "configurations": [{k: v for k, v in c.items()} for c in cfgs]}
    (out / "pipeline.json").write_text(json.dumps(dump, indent=1))
    plot(out, cfgs, notes)


def plot(out: Path, cfgs: list[dict], notes: list[str]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("pipeline: matplotlib is not installed, no plot (pip install matplotlib); "
              "the table is in pipeline.md", file=sys.stderr)
        notes.append("no plot: matplotlib is not installed")
        (out / "pipeline.md").write_text((out / "pipeline.md").read_text() +
                                         f"- {notes[-1]}\n")
        return
    done = [c for c in cfgs if c["summary"].get("samples_per_s")]
    labels = [f"{c['framework']} {NAMES[c['schedule']]}\n{c['layout']}" for c in done]
    values = [c["summary"]["samples_per_s"] for c in done]
    colors = ["tab:gray" if c["schedule"] == "baseline" else
              ("tab:orange" if c["framework"] == "torch" else "tab:blue") for c in done]
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(done)), 4.5))
    ax.bar(range(len(done)), values, color=colors)
    ax.set_xticks(range(len(done)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("samples/s (median step)")
    ax.set_title("Pipeline schedules: jax_cpu_mpi.pipeline (blue) vs torch gloo (orange)")
    fig.tight_layout()
    fig.savefig(out / "pipeline.png", dpi=120)
    plt.close(fig)


def rerender(path: Path) -> int:
    """Write pipeline.md/.png again from a recorded pipeline.json (the summaries recomputed)."""
    dump = json.loads(path.read_text())
    a = argparse.Namespace(**dump["args"])
    cfgs = dump["configurations"]
    for c in cfgs:
        c["summary"] = summarize(c, a.batch)
    derived = ("CPU busy:", "code:", "throughput:", "load average", "no plot")
    notes = [n for n in dump["notes"] if not n.startswith(derived)]
    notes += derived_notes(dump["meta"])
    notes.append(f"table written again from {path.name} by run.py --from-json")
    write_outputs(a, path.parent, cfgs, notes, dump["meta"])
    print((path.parent / "pipeline.md").read_text())
    return 0


def derived_notes(meta: dict) -> list[str]:
    dirty = meta["git"]["uncommitted"]
    return [f"code: commit {meta['git']['head']}" +
            (f", with uncommitted changes to {', '.join(dirty)}" if dirty else ""),
            "CPU busy: the CPU time of all the job's processes per step (all threads) / "
            "the mean step's wall time (median over rounds): how many of the machine's cores "
            "the configuration keeps busy, computing or spinning while it waits",
            "throughput: samples/s = batch / median step time; JAX processes use XLA's "
            "default CPU threading, torch processes torch.set_num_threads(cores / processes)",
            f"load average at start {meta['loadavg_start'][0]:.2f}, at end "
            f"{meta['loadavg_end'][0]:.2f} (1 min)"]


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.from_json:
        return rerender(Path(a.from_json))
    date = datetime.datetime.now(datetime.UTC)
    out = Path(a.out or REPO / "benchmarks" / "results" / "pipeline" /
               f"dev-{os.cpu_count()}core")
    out.mkdir(parents=True, exist_ok=True)
    torch_ok, torch_note = torch_available(a.torch_python)
    notes = [torch_note]
    if a.note:
        notes.append(a.note)
    import jax

    meta = {"date": f"{date:%Y-%m-%d %H:%M} UTC",
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "jax": jax.__version__, "python": platform.python_version(),
            "loadavg_start": os.getloadavg()}
    meta["git"] = git_state()
    plan = launches(a, torch_ok)
    cfgs = [{"key": key, "framework": L["framework"], "schedule": sched, "layout": L["layout"],
             "cmd": L["cmd"], "rounds": []}
            for L in plan for key, sched in zip(L["keys"], L["schedules"], strict=True)]
    by_key = {c["key"]: c for c in cfgs}
    env = dict(os.environ)
    env.setdefault("JAX_CPU_MPI_RECV_TIMEOUT", "120")  # a lost message fails, never hangs
    for rnd in range(a.rounds):
        for L in plan:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "r.json"
                start = time.perf_counter()
                rc, log = launch([*L["cmd"], "--out", str(path)], a.timeout, env)
                took = time.perf_counter() - start
                got = json.loads(path.read_text())["results"] if path.exists() else []
                done = {f"{L['framework']}/{r['schedule']}/{L['layout']}": r for r in got}
                for line in log.splitlines():
                    if line.startswith(("jax ", "torch ")):
                        print(f"[round {rnd + 1}/{a.rounds}] {line}", flush=True)
                print(f"[round {rnd + 1}/{a.rounds}] {L['framework']} {L['layout']}: "
                      f"{took:.0f} s", flush=True)
                why = "timed out" if rc is None else f"exit {rc}"
                if rc != 0:
                    print(f"{' '.join(L['cmd'])}: {why}\n{log[-3000:]}", file=sys.stderr,
                          flush=True)
                for key in L["keys"]:
                    if key in done:  # its check says PASS or FAIL
                        by_key[key]["rounds"].append(done[key])
                    else:
                        by_key[key]["error"] = why
                        by_key[key]["rounds"].append({"error": why, "log_tail": log[-3000:]})
    meta["loadavg_end"] = os.getloadavg()
    for c in cfgs:
        c["summary"] = summarize(c, a.batch)
        c["cmd"] = " ".join(c["cmd"])
    notes.append("command: " + " ".join(["python", "benchmarks/pipeline/run.py",
                                          *(argv if argv is not None else sys.argv[1:])]))
    notes += derived_notes(meta)
    write_outputs(a, out, cfgs, notes, meta)
    print((out / "pipeline.md").read_text())
    print(f"pipeline: wrote {out}/pipeline.md, pipeline.json"
          + (", pipeline.png" if (out / "pipeline.png").exists() else ""))
    failed = [c["key"] for c in cfgs if "error" in c or not c["summary"].get("check", False)]
    if failed:
        print(f"pipeline: failed or did not match the reference: {', '.join(failed)}",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
