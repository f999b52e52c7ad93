"""The transformer example's training step next to the same model in torch.

Tokens/s and peak memory of the example's model (``python -m
jax_cpu_mpi.examples.transformer``: Flax NNX blocks, ``jax_cpu_mpi.pipeline`` 1F1B, Optax
AdamW) and of the same decoder-only model written in torch
(``torch.distributed.pipelining``'s Schedule1F1B with DDP over the data axis, ``torchrun``,
gloo), with the same split over stages, microbatches, data-parallel degree, sizes and
dropout::

    python benchmarks/transformer/run.py --torch-python .venv-torch/bin/python \
        --out benchmarks/results/transformer/dev-2core

Layouts (``--layouts``), ``stages x data`` mesh -> how each side runs it:

* ``1x4``: 4 stages x 1 data shard; ours in one process with 4 CPU devices, torch in 4
  processes (one stage each);
* ``2x2``: 2 stages x 2 data shards; ours under ``mpirun -n 2`` with 2 devices each
  (the example's default ``--process-axis data``: a process per data shard, its devices
  the shard's 2 stages, so only the step's gradient sums cross processes), torch in 4
  processes (DDP over each stage's 2).

Every launch first checks one step's loss and gradients (ours: the example's ``--check``
against the model on one device without a pipeline; torch's: against the same torch model
unpipelined), then times ``--steps`` steps after ``--warmup-steps``; a launch that fails
its check is not timed. Each round runs every launch once (ours, then torch, layout by
layout), so that a change of a shared machine's load falls on both. Tokens/s: tokens per
step / the median step time over all rounds; the ratio is the median over rounds of the
ratio within a round. Memory: every process's peak RSS (``getrusage``), the largest and
the sum over the job's processes.

Writes ``OUT/transformer.md`` (table, target, notes), ``OUT/transformer.json``
(everything) and ``OUT/transformer.png`` (needs matplotlib). ``--from-json FILE`` measures
nothing and writes the table and plot again from a recorded ``transformer.json``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def _pipeline_run():
    """benchmarks/pipeline/run.py (its launcher, git state and torch probe)."""
    spec = importlib.util.spec_from_file_location("pipeline_run", HERE.parent / "pipeline" /
                                                  "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: layout -> (stages, data); torch runs stages x data processes, ours one process, or
#: several under mpirun (--mpi-layouts: one per stage unless given).
LAYOUTS = {"1x4": (4, 1), "2x2": (2, 2)}
#: our variants -> the example's option.
VARIANTS = {"kept": ["--no-remat"], "remat": ["--remat"]}
MODEL = {"--layers": 4, "--width": 128, "--heads": 4, "--seq-len": 64, "--batch": 32,
         "--microbatches": 4, "--dropout": 0.1, "--seed": 0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/transformer/run.py",
                                description=__doc__.split("\n\n")[0])
    for flag, default in MODEL.items():
        p.add_argument(flag, type=type(default), default=default,
                       help=f"the model and step, both sides ({default}: the example's)")
    p.add_argument("--layouts", default="1x4,2x2",
                   help="stages x data, comma separated: " + ", ".join(LAYOUTS))
    p.add_argument("--jax-variants", default="kept,remat",
                   help="our step: 'kept' (the forwards keep their residuals, as torch's: "
                        "the example's default) and/or 'remat' (recomputed in the backward)")
    p.add_argument("--mpi-layouts", default="2x2",
                   help="layouts whose JAX side runs under mpirun, comma separated, each "
                        "LAYOUT (one process per stage) or LAYOUT:PROCESSES (e.g. 1x4:2, "
                        "2 processes of 2 stages each); default 2x2; the others in one "
                        "process with stages x data devices")
    p.add_argument("--xla-flags", default="",
                   help="extra XLA_FLAGS for our processes (e.g. "
                        "--xla_cpu_multi_thread_eigen=false)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per launch (10)")
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed steps (3)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every launch (3)")
    p.add_argument("--torch-python", default=os.environ.get("TORCH_PYTHON", ""),
                   help="a Python with torch ('' or one without torch: our side only)")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="torch.set_num_threads per process (0: cores / processes)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per launch (600)")
    p.add_argument("--out", default=None,
                   help="output folder (default benchmarks/results/transformer/dev-Ncore)")
    p.add_argument("--note", default="", help="a line for the notes (e.g. machine shared)")
    p.add_argument("--from-json", default=None, metavar="TRANSFORMER_JSON",
                   help="measure nothing: write table and plot again from a recorded run")
    p.add_argument("--dry-run", action="store_true", help="print the launches and exit")
    a = p.parse_args(argv)
    try:
        a.mpi_processes = mpi_processes(a.mpi_layouts)
    except ValueError as e:
        p.error(f"--mpi-layouts {a.mpi_layouts}: {e}")
    bad = [x for x in a.layouts.split(",") if x and x not in LAYOUTS]
    if set(a.jax_variants.split(",")) - set(VARIANTS):
        p.error(f"--jax-variants {a.jax_variants}: use some of {', '.join(VARIANTS)}")
    small = [x for x in a.layouts.split(",") if x in LAYOUTS and a.microbatches < LAYOUTS[x][0]]
    if small:
        p.error(f"--microbatches {a.microbatches}: torch's Schedule1F1B needs at least as "
                f"many microbatches as stages (layout {small[0]})")
    if bad:
        p.error(f"--layouts: unknown {', '.join(bad)}; use some of {', '.join(LAYOUTS)}")
    return a


def mpi_processes(spec: str) -> dict[str, int]:
    """``--mpi-layouts`` (``2x2,1x4:2``) -> layout -> our processes under mpirun, each
    holding stages x data / processes devices (one per stage where no count is given)."""
    out = {}
    for item in filter(None, spec.split(",")):
        layout, _, count = item.partition(":")
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout}; use some of {', '.join(LAYOUTS)}")
        stages, data = LAYOUTS[layout]
        procs = int(count) if count.isdigit() else stages if not count else 0
        if procs < 1 or (stages * data) % procs:
            raise ValueError(f"{item}: the process count must be a positive divisor of the "
                             f"layout's {stages * data} devices")
        out[layout] = procs
    return out


def model_args(a: argparse.Namespace) -> list[str]:
    return [str(x) for flag in MODEL for x in (flag, getattr(a, flag[2:].replace("-", "_")))]


def launches(a: argparse.Namespace, torch_python: str | None, mpirun: str) -> list[dict]:
    """Per layout: our launch, then torch's (when there is a torch)."""
    common = [*model_args(a), "--steps", str(a.steps), "--warmup-steps", str(a.warmup_steps)]
    out = []
    for layout in a.layouts.split(","):
        stages, data = LAYOUTS[layout]
        procs = a.mpi_processes.get(layout, 1)
        mesh = ["--stages", str(stages), "--data", str(data)]
        prefix = [mpirun, "-n", str(procs)] if procs > 1 else []
        for variant in a.jax_variants.split(","):
            out.append({"framework": "jax", "variant": variant, "layout": layout,
                        "launch": f"{procs} process(es) x {stages * data // procs} devices" +
                                  (" (mpirun)" if procs > 1 else ""),
                        "cmd": [*prefix, sys.executable, str(HERE / "jax_bench.py"), *mesh,
                                "--schedule", "1f1b", *VARIANTS[variant], *common]})
        if torch_python:
            out.append({"framework": "torch", "variant": "", "layout": layout,
                        "launch": f"{stages * data} processes (torchrun, gloo)",
                        "cmd": [torch_python, "-m", "torch.distributed.run", "--standalone",
                                "--nproc-per-node", str(stages * data),
                                str(HERE / "torch_bench.py"), *mesh, *common,
                                "--threads", str(a.torch_threads)]})
    return out


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def summarize(cfg: dict) -> dict:
    ok = [r for r in cfg["rounds"] if r.get("step_seconds")]
    if not ok:
        return {}
    tokens = ok[-1]["tokens_per_step"]
    steps = [s for r in ok for s in r["step_seconds"]]
    peaks = [max(r["peak_rss_bytes"]) for r in ok]
    sums = [sum(r["peak_rss_bytes"]) for r in ok]
    return {"tokens_per_s": tokens / median(steps),
            "round_tokens_per_s": [tokens / median(r["step_seconds"]) for r in ok],
            "peak_rss_max_bytes": max(peaks), "peak_rss_sum_bytes": max(sums),
            "processes": len(ok[-1]["peak_rss_bytes"]),
            "cpu_busy": median([sum(r["cpu_seconds_per_step"]) / median(r["step_seconds"])
                                for r in ok]),
            "check": all(r["check"]["ok"] for r in cfg["rounds"]),
            "grad_rel_diff": max(r["check"]["grad_rel_diff"] for r in ok),
            "parameters": ok[-1]["parameters"]}


def round_ratio(ours: dict, theirs: dict) -> float | None:
    ratios = [median(b["step_seconds"]) / median(a["step_seconds"])
              for a, b in zip(ours["rounds"], theirs["rounds"], strict=False)
              if a.get("step_seconds") and b.get("step_seconds")]
    return median(ratios) if ratios else None


def write_outputs(a: argparse.Namespace, out: Path, cfgs: list[dict], notes: list[str],
                  meta: dict) -> list[dict]:
    for c in cfgs:
        c["summary"] = summarize(c)
    by = {(c["framework"], c["layout"]): c for c in cfgs}
    mib = lambda n: f"{n / 2**20:.0f}"  # noqa: E731
    lines = ["# The transformer example next to torch",
             "",
             f"{meta['date']}, {meta['machine']}; Python {meta['python']}, jax "
             f"{meta['jax']}, {meta['torch']}. Model: {a.layers} blocks of width {a.width}, "
             f"{a.heads} heads, {a.seq_len} characters, {a.batch} sequences per step in "
             f"{a.microbatches} microbatches, dropout {a.dropout}; 1F1B; a step is loss, "
             f"gradients, clipping and AdamW. {a.rounds} rounds x {a.steps} timed steps "
             f"after {a.warmup_steps} untimed ones per launch.",
             "",
             "| layout (stages x data) | framework | processes | tokens/s (median) | "
             "rounds' range | ours / torch | peak RSS MiB (largest process) | "
             "peak RSS MiB (all processes) | CPU busy (cores) | check (max rel. diff) |",
             "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    targets = []
    for c in cfgs:
        s = c["summary"]
        label = f"{c['layout']} ({LAYOUTS[c['layout']][0]} x {LAYOUTS[c['layout']][1]})"
        name = {"kept": "jax_cpu_mpi", "remat": "jax_cpu_mpi, remat",
                "": "torch"}[c["variant"]]
        if not s:
            lines.append(f"| {label} | {name} | {c['launch']} | failed: "
                         f"{c.get('error', '?')} | | | | | | |")
            continue
        ratio = ""
        if c["framework"] == "jax" and ("torch", c["layout"]) in by:
            r = round_ratio(c, by[("torch", c["layout"])])
            if r is not None:
                ratio = f"{r:.2f}x"
                targets.append({"layout": c["layout"], "variant": c["variant"],
                                "ratio": r, "goal": 1.5,
                                "met": r >= 1.5})
        rng = s["round_tokens_per_s"]
        lines.append(
            f"| {label} | {name} | {c['launch']} | {s['tokens_per_s']:.0f} | "
            f"{min(rng):.0f}-{max(rng):.0f} | {ratio} | {mib(s['peak_rss_max_bytes'])} | "
            f"{mib(s['peak_rss_sum_bytes'])} | {s['cpu_busy']:.2f} | "
            f"{'PASS' if s['check'] else 'FAIL'} ({s['grad_rel_diff']:.1e}) |")
    lines += ["", "## Target (issue 39)", ""]
    lines += [f"- our 1F1B ({'remat' if t['variant'] == 'remat' else 'residuals kept'}) "
              f">= 1.5x torch's Schedule1F1B, layout {t['layout']}: "
              f"{t['ratio']:.2f}x (median over rounds of the within-round ratio) -> "
              f"{'met' if t['met'] else 'NOT met'}" for t in targets] or \
        ["- no ratio could be computed (a side is missing)"]
    lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    (out / "transformer.md").write_text("\n".join(lines) + "\n")
    (out / "transformer.json").write_text(json.dumps(
        {"meta": meta, "args": vars(a), "notes": notes, "targets": targets,
         "configurations": cfgs}, indent=1))
    plot(out, cfgs)
    return targets


def plot(out: Path, cfgs: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("transformer bench: no matplotlib, no plot", file=sys.stderr)
        return
    done = [c for c in cfgs if c["summary"]]
    labels = [f"{c['layout']}\n{c['framework']}" + ("\nremat" if c["variant"] == "remat" else "")
              for c in done]
    colors = [{"kept": "tab:blue", "remat": "tab:cyan"}.get(c["variant"], "tab:orange")
              for c in done]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.8))
    ax1.bar(range(len(done)), [c["summary"]["tokens_per_s"] for c in done], color=colors)
    ax1.set_ylabel("tokens/s (median step)")
    ax2.bar(range(len(done)), [c["summary"]["peak_rss_sum_bytes"] / 2**20 for c in done],
            color=colors)
    ax2.set_ylabel("peak RSS, all processes (MiB)")
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(done)), labels, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Transformer, 1F1B: jax_cpu_mpi (blue) vs torch pipelining + DDP (orange)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "transformer.png", dpi=110)
    plt.close(fig)


def rerender(path: Path) -> int:
    dump = json.loads(path.read_text())
    a = argparse.Namespace(**dump["args"])
    notes = [n for n in dump["notes"] if not n.startswith("table written again")]
    notes.append(f"table written again from {path.name} by run.py --from-json")
    write_outputs(a, path.parent, dump["configurations"], notes, dump["meta"])
    print((path.parent / "transformer.md").read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.from_json:
        return rerender(Path(a.from_json))
    pr = _pipeline_run()
    torch_ok, torch_note = pr.torch_available(a.torch_python)
    plan = launches(a, a.torch_python if torch_ok else None, pr.mpirun())
    if a.dry_run:
        for L in plan:
            print(" ".join(L["cmd"]))
        return 0
    out = Path(a.out or REPO / "benchmarks" / "results" / "transformer" /
               f"dev-{os.cpu_count()}core")
    out.mkdir(parents=True, exist_ok=True)
    import jax

    meta = {"date": f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "python": platform.python_version(), "jax": jax.__version__,
            "torch": torch_note.split(" from ")[0] if torch_ok else "no torch",
            "git": pr.git_state(), "loadavg_start": os.getloadavg()}
    cfgs = [{**L, "rounds": []} for L in plan]
    env = dict(os.environ)
    env.setdefault("JAX_CPU_MPI_RECV_TIMEOUT", "120")  # a lost message fails, never hangs
    env.pop("XLA_FLAGS", None)
    if a.xla_flags:
        env["XLA_FLAGS"] = a.xla_flags
    env.setdefault("JAX_PLATFORMS", "cpu")  # where a GPU plugin is installed too
    for rnd in range(a.rounds):
        for c in cfgs:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "r.json"
                start = time.perf_counter()
                rc, log = pr.launch([*c["cmd"], "--out", str(path)], a.timeout, env)
                took = time.perf_counter() - start
                for line in log.splitlines():
                    if line.startswith(("jax ", "torch ", "check: FAIL")):
                        print(f"[round {rnd + 1}/{a.rounds}] {line}", flush=True)
                print(f"[round {rnd + 1}/{a.rounds}] {c['framework']} {c['variant']} "
                      f"{c['layout']}: "
                      f"{took:.0f} s", flush=True)
                if rc == 0 and path.exists():
                    c["rounds"].append(json.loads(path.read_text()))
                else:
                    why = "timed out" if rc is None else f"exit {rc}"
                    print(f"{' '.join(c['cmd'])}: {why}\n{log[-3000:]}", file=sys.stderr)
                    c["error"] = why
                    c["rounds"].append({"error": why, "log_tail": log[-3000:],
                                        "check": {"ok": False, "grad_rel_diff": float("nan")}})
    meta["loadavg_end"] = os.getloadavg()
    for c in cfgs:
        c["cmd"] = " ".join(c["cmd"])
    dirty = meta["git"]["uncommitted"]
    notes = [
        f"code: commit {meta['git']['head']}" +
        (f", with uncommitted changes to {', '.join(dirty)}" if dirty else ""),
        "command: python benchmarks/transformer/run.py " +
        shlex.join(argv if argv is not None else sys.argv[1:]),
        "checks: ours with dropout (the same keys as the one-device reference), torch with "
        "dropout off (its masks come from each process's generator), both before timing",
        "threads: our processes keep XLA's default CPU threading (one intra-op pool of the "
        "machine's cores per process" +
        (f"; XLA_FLAGS {a.xla_flags}" if a.xla_flags else "") +
        "); torch processes torch.set_num_threads(" +
        (str(a.torch_threads) if a.torch_threads else "cores / processes") + ")",
        "CPU busy: CPU time of all the job's processes per step / the median step's wall time",
        "torch's data: random ids over the example's vocabulary size (96); ours: the "
        "example's text (a step's time does not depend on the ids)",
        f"load average at start {meta['loadavg_start'][0]:.2f}, at end "
        f"{meta['loadavg_end'][0]:.2f} (1 min)"]
    if a.note:
        notes.insert(0, a.note)
    if not torch_ok:
        notes.insert(0, torch_note)
    targets = write_outputs(a, out, cfgs, notes, meta)
    print((out / "transformer.md").read_text())
    failed = [f"{c['framework']} {c['variant']} {c['layout']}" for c in cfgs if not c["summary"] or
              not c["summary"]["check"]]
    if failed:
        print(f"transformer bench: failed or did not match: {', '.join(failed)}",
              file=sys.stderr)
    return 1 if failed or (not targets and torch_ok) else 0


if __name__ == "__main__":
    sys.exit(main())
