"""Stress matrix: repeated MPI launches under CPU load and oversubscribed, and a long run.

Outside the test suite (it takes minutes to hours). For each program (the README example,
the pipeline example, the bodies of JAX's own psend/precv tests, the timeline example) and
each condition (``quiet``, ``load``: a busy loop on every core, ``oversub``: more ranks x
devices than cores), it launches the program ``--launches`` times and records, for each
launch, its time, its exit status, whether its result was right and whether it was
*stuck*: killed at the hard limit. A launch is *late* when it takes more than twice the
program's median quiet time (``--quiet-runs 0``: no quiet launches, so no launch is late
or on time: the tables show ``-``; only stuck and wrong count). The long run
(``--long-steps`` hops, one jitted hop per step, under ``mpirun -n 2``) samples resident
memory, open file descriptors and threads every 10^4 steps.

    .venv/bin/python scripts/stress_matrix.py --out benchmarks/results/stress/dev-2core
    .venv/bin/python scripts/stress_matrix.py --only jax-tests --conditions load --launches 5

Writes ``matrix.json`` (every launch), ``long_run.json`` and ``README.md`` (the tables)
into ``--out``. Exit status 1 if any launch was stuck, wrong or late, or the long run grew.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
sys.path.insert(0, str(ROOT / "tests"))
from mpi_launcher import communicate_or_kill  # noqa: E402  (the suite's kill-at-timeout launch)

MPIRUN = str(Path(PY).parent / "mpirun") if (Path(PY).parent / "mpirun").exists() else "mpirun"

# The bodies of JAX's test_psend_precv_basic_with_no_deadlock_cycle and
# test_psend_precv_basic_two_gpus (tests/shard_map_test.py), as a user runs them: the output
# is only checked for its shape (the back edge sends another shape than precv's out_shape).
JAX_TESTS = r'''
import sys
from functools import partial
import jax
import jax_cpu_mpi
jax_cpu_mpi.initialize_distributed()
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

def run(devices, fwd_perm, bwd_perm):
    n = len(devices)
    mesh = Mesh(np.array(devices), ("x",))
    # dtype given: a process outside the mesh (the two-device test under mpirun -n 4) has no
    # shard to take it from.
    a = jax.make_array_from_callback((n, n), NamedSharding(mesh, P("x", None)),
        lambda i: np.arange(n * n, dtype=np.float32).reshape(n, n)[i], dtype=np.float32)
    weights = jax.random.uniform(key=jax.random.key(0), shape=(n, 1), dtype=jnp.float32)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P("x", None),), out_specs=P("x", None))
    def fwd(a):
        like = jax.ShapeDtypeStruct.like(a)
        data = jax_cpu_mpi.precv(jax_cpu_mpi.psend(a, "x", fwd_perm), like, "x", fwd_perm)
        weights_, _ = jax.lax.optimization_barrier((weights, data))
        res = jnp.dot(weights_, data)
        back = jax_cpu_mpi.psend(res, "x", bwd_perm)
        return jax_cpu_mpi.precv(back, like, "x", bwd_perm)

    c = fwd(a)
    assert c.shape == a.shape
    return c

devs = jax.devices()
if sys.argv[1] == "cycle":
    c = run(devs[:8], [(i, i + 1) for i in range(7)], [(7, 0)])
else:  # two_gpus: one device of the first and one of the last process
    c = run([devs[0], devs[-1]], [(0, 1)], [(1, 0)])
print("STRESS-OK", sys.argv[1], c.shape)
'''


@dataclass
class Case:
    name: str
    args: list[str]  # the program and its arguments (after python)
    expect: str  # a line every rank 0 output must contain
    ranks: int = 2
    devices: int = 2
    env: dict[str, str] = field(default_factory=dict)
    after: list[str] | None = None  # a command run after the launch (timeline merge)


def cases(tmp: Path) -> dict[str, list[Case]]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- run: mpirun[^>]*-->\n```python\n(.*?)```", readme, re.S).group(1)
    (tmp / "readme_example.py").write_text(block)
    (tmp / "jax_tests.py").write_text(JAX_TESTS)
    trace = tmp / "trace"
    pipeline = ["-m", "jax_cpu_mpi.examples.pipeline", "--steps", "2", "--width", "64",
                "--batch", "256"]
    return {
        "readme": [Case("readme", [str(tmp / "readme_example.py")],
                        "[0. 0. 0. 1. 2. 3. 4. 5.]", devices=2)],
        "pipeline": [Case("pipeline", [*pipeline, "--check"], "", devices=2)],
        "jax-tests": [Case("jax-cycle", [str(tmp / "jax_tests.py"), "cycle"],
                           "STRESS-OK cycle", devices=4),
                      Case("jax-two", [str(tmp / "jax_tests.py"), "two"],
                           "STRESS-OK two", devices=4)],
        "timeline": [Case("timeline", pipeline, "", devices=2,
                          env={"JAX_CPU_MPI_TRACE": str(trace)},
                          after=[PY, "-m", "jax_cpu_mpi", "trace", str(trace), "--no-png"])],
    }


def oversubscribed(case: Case) -> Case:
    """4 ranks on the 2 cores: the same number of devices in all where the mesh needs it
    (the pipeline example gives each rank 4 stages / 4 ranks = 1 device itself), else 2
    devices per rank. JAX's two-device test keeps its mesh of one device of the first and
    one of the last process: processes 1 and 2 hold none of its devices (they compile its
    program and run nothing). A mesh whose other processes never lower its program at all
    is tests/runtime/test_exit.py's case."""
    total = case.ranks * case.devices
    fixed = ("readme", "jax-cycle", "pipeline", "timeline")
    devices = max(1, total // 4) if case.name in fixed else 2
    return Case(case.name, case.args, case.expect, 4, devices, case.env, case.after)


def launch(case: Case, limit: float) -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env.update(case.env)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={case.devices}"
    env.setdefault("JAX_CPU_MPI_RECV_TIMEOUT", "300")  # the default: a stuck op shows
    env["PYTHONWARNINGS"] = "ignore"
    if "JAX_CPU_MPI_TRACE" in case.env:
        shutil.rmtree(case.env["JAX_CPU_MPI_TRACE"], ignore_errors=True)
    cmd = [MPIRUN, "-n", str(case.ranks), PY, *case.args]
    load_before = round(os.getloadavg()[0], 2)
    start = time.monotonic()
    out, rc = communicate_or_kill(cmd, limit, env=env, cwd=ROOT)
    seconds = time.monotonic() - start
    ok = rc == 0 and case.expect in out
    if ok and case.after:
        merged = subprocess.run(case.after, capture_output=True, text=True, cwd=ROOT,
                                timeout=120)
        ok = merged.returncode == 0
        out += merged.stdout + merged.stderr
    return {"case": case.name, "ranks": case.ranks, "devices": case.devices, "rc": rc,
            "stuck": rc is None, "ok": ok, "seconds": round(seconds, 3),
            "loadavg_1min": load_before, "reported_at_exit": "at exit" in out,
            "tail": out[-1500:] if not ok else ""}


class Load:
    """``count`` busy loops (default: one on every core), for the duration of a `with`
    block."""

    def __init__(self, count: int | None = None) -> None:
        self.count = count or os.cpu_count() or 1

    def __enter__(self) -> Load:
        self.procs = [subprocess.Popen([PY, "-c", "while True: pass"])
                      for _ in range(self.count)]
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


LONG_RUN = r'''
import os, sys, time, resource
import jax
import jax_cpu_mpi
jax_cpu_mpi.initialize_distributed()
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
steps, every = int(sys.argv[1]), int(sys.argv[2])
mesh = jax.make_mesh((jax.device_count(),), ("x",))
n = jax.device_count()
def hop(x):  # a round trip 0 -> 1 -> 0: device 0 gets its value + 1, device 1 zeros
    like = jax.ShapeDtypeStruct(x.shape, x.dtype)
    y = jax_cpu_mpi.precv(jax_cpu_mpi.psend(x, "x", [(0, 1)]), like, "x", [(0, 1)])
    return jax_cpu_mpi.precv(jax_cpu_mpi.psend(y + 1, "x", [(1, 0)]), like, "x", [(1, 0)])
f = jax.jit(jax.shard_map(hop, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
x = jax.make_array_from_callback((n * 16,), NamedSharding(mesh, P("x")),
                                 lambda i: np.zeros(16 * n, np.float32)[i])
def rss_kib():
    with open("/proc/self/status") as fh:
        return next(int(l.split()[1]) for l in fh if l.startswith("VmRSS"))
t0 = time.monotonic()
for step in range(1, steps + 1):
    x = f(x)
    if step % 100 == 0:
        x.block_until_ready()
    if step % every == 0:
        x.block_until_ready()
        print("SAMPLE", jax.process_index(), step, rss_kib(), len(os.listdir("/proc/self/fd")),
              len(os.listdir("/proc/self/task")), round(time.monotonic() - t0, 2), flush=True)
v = float(np.asarray(x.addressable_shards[0].data)[0])
assert v == (steps if jax.process_index() == 0 else 0), v
print("STRESS-OK long", steps)
'''


def long_run(tmp: Path, steps: int, every: int, limit: float) -> dict:
    prog = tmp / "long_run.py"
    prog.write_text(LONG_RUN)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
               PYTHONWARNINGS="ignore")
    start = time.monotonic()
    try:
        proc = subprocess.run([MPIRUN, "-n", "2", PY, str(prog), str(steps), str(every)],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=limit)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        raw = e.stdout or ""
        out, rc = raw.decode() if isinstance(raw, bytes) else raw, None
    samples: dict[int, list[list[float]]] = {}
    # The ranks' lines may be interleaved on mpirun's output: match the samples anywhere.
    for proc_i, step, rss, fds, threads, t in re.findall(
            r"SAMPLE (\d+) (\d+) (\d+) (\d+) (\d+) ([\d.]+)", out):
        samples.setdefault(int(proc_i), []).append(
            [int(step), int(rss), int(fds), int(threads), float(t)])
    growth = {}
    for p, rows in samples.items():
        warm = rows[1:] if len(rows) > 2 else rows  # the first 10^4 steps warm up
        span = (warm[-1][0] - warm[0][0]) / 1e4 or 1  # in units of 10^4 steps
        growth[p] = {"rss_kib_per_1e4_steps": round((warm[-1][1] - warm[0][1]) / span, 1),
                     "fd_growth": warm[-1][2] - warm[0][2],
                     "thread_growth": warm[-1][3] - warm[0][3]}
    return {"steps": steps, "rc": rc, "ok": rc == 0 and "STRESS-OK long" in out,
            "seconds": round(time.monotonic() - start, 1), "samples": samples,
            "growth": growth, "tail": out[-1500:] if rc != 0 else ""}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=20)
    ap.add_argument("--quiet-runs", type=int, default=3, help="launches for the quiet time "
                    "(0: none, no launch is judged late)")
    ap.add_argument("--load-procs", type=int, default=None, help="busy loops of the load "
                    "condition (default: one per core)")
    ap.add_argument("--only", nargs="*", default=None,
                    help="programs: readme pipeline jax-tests timeline (or one case: "
                    "jax-cycle, jax-two)")
    ap.add_argument("--conditions", nargs="*", default=["load", "oversub"])
    ap.add_argument("--long-steps", type=int, default=100_000, help="0: no long run")
    ap.add_argument("--sample-every", type=int, default=10_000,
                    help="steps between two samples of the long run")
    ap.add_argument("--limit", type=float, default=400.0, help="seconds before a launch "
                    "counts as stuck and is killed (above the 300 s receive timeout)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--report", type=Path, default=None, metavar="DIR",
                    help="no launches: write DIR/README.md and the table of "
                    "docs/reliability.md from the runs in DIR/jax-*/ (one per JAX version)")
    args = ap.parse_args()
    if args.report:
        return report(args.report)
    tmp = Path(tempfile.mkdtemp(prefix="jcm-stress-"))
    import jax  # the version only (no backend)

    meta = {"jax": jax.__version__, "python": sys.version.split()[0],
            "started_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "cores": os.cpu_count(), "loadavg_1min_at_start": round(os.getloadavg()[0], 2),
            "args": sys.argv[1:]}
    all_cases = cases(tmp)
    chosen = [c for name, cs in all_cases.items() for c in cs
              if args.only is None or name in args.only or c.name in args.only]
    records: list[dict] = []
    quiet: dict[tuple[str, int], float] = {}
    for case in chosen:
        for cond in args.conditions:
            c = oversubscribed(case) if cond == "oversub" else case
            key = (c.name, c.ranks)
            if key not in quiet and args.quiet_runs > 0:
                times = [launch(c, args.limit) for _ in range(args.quiet_runs)]
                records += [dict(r, condition="quiet") for r in times]
                quiet[key] = statistics.median(r["seconds"] for r in times)
            for i in range(args.launches):
                if cond == "load":
                    with Load(args.load_procs):
                        r = launch(c, args.limit)
                else:
                    r = launch(c, args.limit)
                # No quiet time, no judgement: None (neither late nor on time).
                r.update(condition=cond, late=r["seconds"] > 2 * quiet[key]
                         if key in quiet else None)
                records.append(r)
                print(f"{c.name:10s} {cond:8s} n={c.ranks}x{c.devices} #{i + 1}: "
                      f"{r['seconds']:6.2f} s (quiet {_seconds(quiet.get(key))}) "
                      f"rc={r['rc']} ok={r['ok']}{' LATE' if r['late'] else ''}"
                      f"{' STUCK' if r['stuck'] else ''}", flush=True)
    long = long_run(tmp, args.long_steps, args.sample_every, 3600) if args.long_steps else None
    if long:
        print("long run:", json.dumps({k: long[k] for k in ("steps", "rc", "ok", "seconds",
                                                           "growth")}), flush=True)
    table = summarize(records, quiet, long)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta["loadavg_1min_at_end"] = round(os.getloadavg()[0], 2)
        meta["ended_utc"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
        (args.out / "meta.json").write_text(json.dumps(meta, indent=1))
        (args.out / "matrix.json").write_text(json.dumps(records, indent=1))
        if long:
            (args.out / "long_run.json").write_text(json.dumps(long, indent=1))
        (args.out / "README.md").write_text(table + "\n")
    shutil.rmtree(tmp, ignore_errors=True)
    bad = any(r["stuck"] or not r["ok"] or r.get("late") for r in records)
    grew = long and (not long["ok"] or any(
        g["rss_kib_per_1e4_steps"] > 1024 or g["fd_growth"] > 0 or g["thread_growth"] > 0
        for g in long["growth"].values()))
    return 1 if bad or grew else 0


def _seconds(value: float | None) -> str:
    """A time in the tables, ``-`` where there is none (no quiet launches)."""
    return "-" if value is None else f"{value:.2f}"


def _late(rs: list[dict]) -> str:
    """How many launches were late, ``-`` where none could be judged (no quiet time)."""
    if all(r.get("late") is None for r in rs):
        return "-"
    return str(sum(bool(r.get("late")) for r in rs))


def summarize(records: list[dict], quiet: dict, long: dict | None) -> str:
    lines = ["| program | condition | ranks x devices | launches | stuck | wrong | late "
             "(> 2x quiet) | quiet median s | median s | max s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r["condition"] != "quiet":
            groups.setdefault((r["case"], r["condition"], r["ranks"], r["devices"]), []).append(r)
    for (name, cond, ranks, devices), rs in groups.items():
        t = [r["seconds"] for r in rs]
        lines.append(f"| {name} | {cond} | {ranks} x {devices} | {len(rs)} | "
                     f"{sum(r['stuck'] for r in rs)} | {sum(not r['ok'] for r in rs)} | "
                     f"{_late(rs)} | {_seconds(quiet.get((name, ranks)))} | "
                     f"{statistics.median(t):.2f} | {max(t):.2f} |")
    if long:
        lines.append("")
        lines.append(f"Long run: {long['steps']} steps (mpirun -n 2 x 1 device, one "
                     f"jitted round trip per step), {long['seconds']} s, ok={long['ok']}.")
        for p, g in sorted(long["growth"].items()):
            lines.append(f"- process {p}: resident memory {g['rss_kib_per_1e4_steps']} KiB per "
                         f"10^4 steps after the first 10^4, file descriptors "
                         f"{g['fd_growth']:+d}, threads {g['thread_growth']:+d}")
    return "\n".join(lines)


def _from_log(sub: Path) -> tuple[dict, list[dict]]:
    """The launches of a run stopped before it wrote matrix.json, from its printed lines
    (``launches.log``; no load averages, the quiet medians as printed)."""
    records = []
    line_re = (r"^(\S+)\s+(\S+)\s+n=(\d+)x(\d+) #\d+:\s+([\d.]+) s \(quiet ([\d.]+|-)\) "
               r"rc=(\S+) ok=(\S+)( LATE)?( STUCK)?")
    for m in re.finditer(line_re, (sub / "launches.log").read_text(), re.M):
        name, cond, ranks, devices, secs, quiet, rc, ok, late, stuck = m.groups()
        common = {"case": name, "ranks": int(ranks), "devices": int(devices)}
        records.append({**common, "condition": cond, "seconds": float(secs),
                        "rc": None if rc == "None" else int(rc), "ok": ok == "True",
                        "late": bool(late) if quiet != "-" else None,
                        "stuck": bool(stuck)})
        if quiet != "-" and not any(r["condition"] == "quiet" and r["case"] == name and
                   r["ranks"] == int(ranks) for r in records):
            records.append({**common, "condition": "quiet", "seconds": float(quiet),
                            "ok": True, "stuck": False})
    meta = {"jax": sub.name.removeprefix("jax-"), "python": "?", "started_utc": "?",
            "args": ["(stopped before its end: from launches.log)"]}
    return meta, records


DOCS = ROOT / "docs" / "reliability.md"
BEGIN, END = "<!-- stress-matrix: begin -->", "<!-- stress-matrix: end -->"


def report(folder: Path) -> int:
    """The tables of every run in ``folder/jax-*/`` (matrix.json, meta.json,
    long_run.json): ``folder/README.md`` and the generated part of docs/reliability.md."""
    runs = []
    for sub in sorted(folder.glob("jax-*"), key=lambda d: d.name, reverse=True):
        if (sub / "matrix.json").exists():
            meta = json.loads((sub / "meta.json").read_text())
            records = json.loads((sub / "matrix.json").read_text())
        elif (sub / "launches.log").exists():  # a run stopped before its end
            meta, records = _from_log(sub)
        else:
            continue
        long_path = sub / "long_run.json"
        long = json.loads(long_path.read_text()) if long_path.exists() else None
        runs.append((sub, meta, records, long))
    head = ["| JAX | program | condition | ranks x devices | launches | stuck | wrong | "
            "late (> 2x quiet) | quiet median s | median s | max s | load avg (median) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows, longs, notes, total, bad = [], [], [], 0, 0
    counts = {"stuck": 0, "wrong": 0, "late": 0}
    for sub, meta, records, long in runs:
        quiet: dict[tuple[str, int], list[float]] = {}
        for r in records:
            if r["condition"] == "quiet":
                quiet.setdefault((r["case"], r["ranks"]), []).append(r["seconds"])
        groups: dict[tuple, list[dict]] = {}
        for r in records:
            if r["condition"] != "quiet":
                groups.setdefault((r["case"], r["condition"], r["ranks"], r["devices"]),
                                  []).append(r)
        quiet_median = {key: statistics.median(t) for key, t in quiet.items()}
        for (name, cond, ranks, devices), rs in groups.items():
            t = [r["seconds"] for r in rs]
            loads = [r["loadavg_1min"] for r in rs if "loadavg_1min" in r]
            load_text = f"{statistics.median(loads):.1f}" if loads else ""
            failed = sum(r["stuck"] or not r["ok"] or bool(r.get("late")) for r in rs)
            total, bad = total + len(rs), bad + failed
            counts["stuck"] += sum(r["stuck"] for r in rs)
            counts["wrong"] += sum(not r["ok"] for r in rs)
            counts["late"] += sum(bool(r.get("late")) for r in rs)
            rows.append(f"| {meta['jax']} | {name} | {cond} | {ranks} x {devices} | {len(rs)} | "
                        f"{sum(r['stuck'] for r in rs)} | {sum(not r['ok'] for r in rs)} | "
                        f"{_late(rs)} | {_seconds(quiet_median.get((name, ranks)))} | "
                        f"{statistics.median(t):.2f} | {max(t):.2f} | {load_text} |")
        quiet_runs = [r for r in records if r["condition"] == "quiet"]
        quiet_bad = sum(not r["ok"] or r["stuck"] for r in quiet_runs)
        notes.append(f"- JAX {meta['jax']} (Python {meta['python']}, `{sub.name}/`): "
                     f"{meta['started_utc']} to {meta.get('ended_utc', '?')} UTC, "
                     f"`stress_matrix.py {' '.join(meta['args'])}`; "
                     f"{len(quiet_runs)} quiet launches, "
                     f"{quiet_bad} of them stuck or wrong.")
        if long:
            for proc, g in sorted(long["growth"].items()):
                longs.append(f"| {meta['jax']} | {proc} | {long['steps']} | {long['seconds']} | "
                             f"{long['ok']} | {g['rss_kib_per_1e4_steps']} | "
                             f"{g['fd_growth']:+d} | {g['thread_growth']:+d} |")
    table = "\n".join(head + rows)
    long_table = "\n".join(
        ["| JAX | process | steps | seconds | ok | resident memory KiB per 10^4 steps (after "
         "the first 10^4) | file descriptors | threads |", "|---|---|---|---|---|---|---|---|",
         *longs]) if longs else "(no long run)"
    quiet_total = sum(len(r[2]) for r in runs) - total
    summary = (f"{total} launches: {counts['stuck']} stuck, {counts['wrong']} wrong, "
               f"{counts['late']} late ({quiet_total} quiet launches besides)." if quiet_total
               else f"{total} launches: {counts['stuck']} stuck, {counts['wrong']} wrong "
               "(no quiet launches: none judged late or on time).")
    generated = "\n".join([BEGIN, "", table, "", summary, "", "Long run (`mpirun -n 2` x 1 "
                           "device, one jitted round trip 0 -> 1 -> 0 per step):", "",
                           long_table, "", *notes, "", END])
    readme = folder / "README.md"
    text = (readme.read_text() if readme.exists()
            else f"# Stress matrix, {folder.name}\n\n{BEGIN}\n{END}\n")
    for path, old in ((readme, text), (DOCS, DOCS.read_text())):
        if BEGIN not in old or END not in old:
            print(f"{path}: no {BEGIN} ... {END} to replace", file=sys.stderr)
            return 1
        before, rest = old.split(BEGIN, 1)
        path.write_text(before + generated + rest.split(END, 1)[1])
    print(generated)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
