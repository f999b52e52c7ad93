"""The link between two hosts dies mid-loop: does every launch end, and say why?

    python scripts/two_host_faults.py [--trials N] [--timeout S] [--sizes 8,262144,...]
                                      [--directions 0to1,1to0] [--modes uncaught,caught]
                                      [--out DIR] [--table-only JSONL]

Runs ``tests/mpi_programs/network_fault.py`` on the two network-namespace hosts of the test
suite (``tests/netns_hosts.py``: one rank per host, MPI over TCP on a veth link; needs root)
and takes the link down at a random moment of the loop: ``JCM-LOOPING`` (the loop runs),
then a delay drawn uniformly from [0, --max-delay] s, then both ends of the link go down and
stay down. The launcher (MPICH's mpiexec) runs on host A with rank 0; rank 1 is on host B.

The matrix: message size (default 8 B, 256 KiB, 1 MiB, 4 MiB) x direction x caught/uncaught,
``--trials`` each. Direction is the way the message of that size goes (network_fault.py's
DIRECTION): ``0to1``, rank 0 sends it and rank 1 (host B) receives it, with a 4-byte reply;
``1to0``, rank 0 (host A, the launcher's) receives it, after a 4-byte ping. As the big
message is most of the traffic, the link most likely dies while it is on the wire, its
receiver mid-message (at 8 B the two directions differ only by 8 vs 4 bytes). ``uncaught``:
the precv error ends the program; ``caught``: the program catches it and calls
``sys.exit(1)``, with the default JAX_CPU_MPI_ABORT_ON_ERROR (the exit aborts the launch).

Per trial: whether mpiexec ended by itself, the seconds from link-down to its end, its exit
status, whether rank 0 (the launcher's host) printed a timeout error (a precv's
DEADLINE_EXCEEDED, or a psend's send timeout), the error line of each rank, the transport's
counters and job_broken() where the program printed them. A trial passes when mpiexec ends
by itself within JAX_CPU_MPI_RECV_TIMEOUT + 30 s of link-down with a non-zero status and
rank 0 printed the timeout error. A launch still running then is dumped (``py-spy dump
--native`` of every rank and of mpiexec, if py-spy is installed), killed with everything in
both namespaces, and counted failed: the script never hangs.

Writes ``two-host-faults-DATE.jsonl`` (one record per trial, appended as trials end) and
``two-host-faults-DATE.md`` (the table) to --out (default
``benchmarks/results/two-hosts-tcp``), the outputs of failed trials to
``two-host-faults-DATE-failures/``, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from netns_hosts import TwoHosts, _ip, unavailable_reason  # noqa: E402

SIZES = [8, 256 << 10, 1 << 20, 4 << 20]
DIRECTIONS = ["0to1", "1to0"]
MODES = ["uncaught", "caught"]
#: Seconds allowed after link-down beyond the receive timeout.
SLACK = 30.0
#: What a rank prints when a psend/precv gave up at its deadline.
TIMEOUT_ERROR = re.compile(
    r"DEADLINE_EXCEEDED: precv|before the timeout \(JAX_CPU_MPI_RECV_TIMEOUT\)|"
    r"gave up waiting for earlier sends|did not complete in time")
ERROR_LINE = re.compile(r"^(?:.*JCM-CAUGHT at [\d.]+ after [\d.]+ s: |\S*JaxRuntimeError: )"
                        r"(.*)$", re.MULTILINE)


def size_name(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def pyspy() -> str | None:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return found if Path(found).exists() else None


def dump_stuck(hosts: TwoHosts) -> str:
    """What every process still running in the two namespaces does: the command line of
    each; for the ranks, ``py-spy dump --native`` (the Python threads) and gdb's backtraces
    of every thread (XLA's device threads, where psend/precv wait, are no Python threads)."""
    tool = pyspy()
    gdb = shutil.which("gdb")
    parts = []
    for h, ns in hosts.namespaces.items():
        for pid in _ip("netns", "pids", ns, check=False).stdout.split():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            cmd = b" ".join(argv).decode(errors="replace")
            parts.append(f"=== host {h} pid {pid}: {cmd[:300]}")
            if not (Path(argv[0].decode()).name.startswith("python")
                    and "network_fault.py" in cmd):
                continue
            for what in ([tool, "dump", "--native", "--pid", pid] if tool else None,
                         [gdb, "-p", pid, "-batch", "-ex", "thread apply all bt"]
                         if gdb else None):
                if what is None:
                    continue
                try:
                    out = subprocess.run(what, capture_output=True, text=True, timeout=60)
                    parts.append(out.stdout + out.stderr)
                except subprocess.TimeoutExpired:
                    parts.append(f"({what[0]} did not finish within 60 s)")
    return "\n".join(parts)


def run_trial(size: int, direction: str, mode: str, recv_timeout: float, max_delay: float,
              failures: Path, label: str, slack: float = SLACK) -> dict:
    limit = recv_timeout + slack
    delay = random.uniform(0.0, max_delay)
    rec: dict = {"size": size, "direction": direction, "mode": mode, "delay_s": round(delay, 3),
                 "recv_timeout_s": recv_timeout, "killed": False, "stuck_dump": None}
    env = {"JAX_CPU_MPI_RECV_TIMEOUT": str(recv_timeout)}
    with TwoHosts() as hosts:
        def cut(job) -> None:
            job.wait_for(0, "JCM-LOOPING", timeout=150)
            time.sleep(delay)
            job.mark("down")
            hosts.set_link(False)
            # The guard: past the limit (and a little), dump what still runs and kill it all.
            give_up = job.marks["down"] + limit + 5.0
            while job.proc.poll() is None and time.time() < give_up:
                time.sleep(0.1)
            if job.proc.poll() is None:
                rec["killed"] = True
                rec["stuck_dump"] = dump_stuck(hosts)
                os.killpg(job.proc.pid, signal.SIGKILL)
                for ns in hosts.namespaces.values():
                    for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                        try:
                            os.kill(int(pid), signal.SIGKILL)
                        except (ProcessLookupError, ValueError):
                            pass

        program = "catch-exit" if mode == "caught" else "uncaught"
        started = time.time()
        try:
            run = hosts.run("network_fault.py", program, str(size), direction, env=env,
                            during=cut, timeout=150 + max_delay + limit + 30)
        except AssertionError as e:  # the injection failed: the loop never started
            rec.update(ok=False, ended=False, error=f"setup: {str(e)[:3000]}")
            (failures / f"{label}.txt").write_text(str(e))
            return rec
    job = run.job
    down = job.marks.get("down")
    ended = run.returncode is not None and not rec["killed"]
    rec.update(
        ended=ended,
        returncode=run.returncode,
        launch_s=round(job.ended_at - started, 2),
        down_to_end_s=round(job.ended_at - down, 2) if down else None,
        down_to_ranks_end_s=round(job.ranks_ended_at - down, 2) if down else None,
        rank_exits={r: [s, round(t - down, 2)] for r, (s, t) in job.exits.items()},
    )
    for rank in (0, 1):
        text = run.rank_output.get(rank, "")
        errors = ERROR_LINE.findall(text)
        rec[f"rank{rank}_timeout_error"] = bool(TIMEOUT_ERROR.search(text))
        rec[f"rank{rank}_error"] = errors[-1][:400] if errors else None
        stats = re.findall(r"JCM-STATS (.*)", text)
        rec[f"rank{rank}_stats_looping"] = stats[0] if stats else None
        rec[f"rank{rank}_stats_end"] = stats[1] if len(stats) > 1 else None
        broken = re.search(r"JCM-BROKEN (\w+)", text)
        rec[f"rank{rank}_job_broken"] = broken.group(1) if broken else None
    rec["mpi_abort"] = "MPI_Abort" in run.launcher_output + "".join(run.rank_output.values())
    rec["ok"] = bool(ended and run.returncode != 0 and rec["down_to_end_s"] is not None
                     and rec["down_to_end_s"] <= limit and rec["rank0_timeout_error"])
    if not rec["ok"]:
        (failures / f"{label}.txt").write_text(
            json.dumps(rec, indent=1) + "\n" + run.report() + "\n\n=== stuck dump ===\n"
            + (rec["stuck_dump"] or "(none)"))
    return rec


def table(records: list[dict]) -> str:
    rows = ["| size | direction (receiver of the size) | error | pass | ended | rank 0 printed "
            "timeout error | max s link-down to end | exit statuses | rank 1 (host B) exited "
            "by itself, max s | job_broken() rank 0, rank 1 | rank 0 errors |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    keys = []
    for r in records:
        k = (r["size"], r["direction"], r["mode"])
        if k not in keys:
            keys.append(k)
    for size, direction, mode in keys:
        rs = [r for r in records if (r["size"], r["direction"], r["mode"]) == (size, direction,
                                                                               mode)]
        n = len(rs)
        times = [r["down_to_end_s"] for r in rs if r.get("down_to_end_s") is not None]
        kinds = sorted({_kind(r.get("rank0_error")) for r in rs})
        codes = sorted({str(r.get("returncode")) for r in rs})
        recv = "rank 1, host B" if direction == "0to1" else "rank 0, launcher's host A"
        # Host B's rank: mpiexec cannot reach it over the dead link; it must end by itself
        # (the harness kills what still runs 15 s after mpiexec ended).
        b_exits = [r["rank_exits"]["1"][1] for r in rs if "1" in (r.get("rank_exits") or {})]
        b_col = f"{len(b_exits)}/{n}, {max(b_exits)}" if b_exits else f"0/{n}"
        # Printed after a caught error only: True when a request MPI could not cancel (a
        # message cut mid-way) was abandoned at the deadline.
        if mode == "caught":
            broken = ", ".join(f"{sum(r.get(f'rank{k}_job_broken') == 'True' for r in rs)}/{n}"
                               for k in (0, 1))
        else:
            broken = "not printed"
        rows.append(
            f"| {size_name(size)} | {direction} ({recv}) | {mode} | "
            f"{sum(bool(r.get('ok')) for r in rs)}/{n} | "
            f"{sum(bool(r.get('ended')) for r in rs)}/{n} | "
            f"{sum(bool(r.get('rank0_timeout_error')) for r in rs)}/{n} | "
            f"{max(times) if times else '-'} | {', '.join(codes)} | {b_col} | {broken} | "
            f"{'; '.join(kinds)} |")
    return "\n".join(rows)


def _kind(error: str | None) -> str:
    if not error:
        return "none"
    m = re.match(r"(\w+): (precv|psend)", error)
    if m:
        extra = ""
        if "started to arrive" in error:
            extra = " (mid-message)"
        return f"{m.group(1)} {m.group(2)}{extra}"
    return error[:60]


def markdown(records: list[dict], jsonl_name: str, max_delay: float) -> str:
    timeouts = sorted({r["recv_timeout_s"] for r in records})
    trials = max((r.get("trial", 1) for r in records), default=0)
    loads = [r["load"] for r in records if "load" in r]
    return (f"# Link down mid-loop between two hosts ({time.strftime('%Y-%m-%d %H:%M')})\n\n"
            f"`python scripts/two_host_faults.py --trials {trials}`: network namespaces on one "
            f"2-core machine (shared; 1-min load during the trials {min(loads, default=0)}-"
            f"{max(loads, default=0)}), MPICH (hydra) + UCX_TLS=tcp,self over a veth link; "
            f"JAX_CPU_MPI_RECV_TIMEOUT={', '.join(f'{t:g}' for t in timeouts)} s; the link "
            f"goes down 0-{max_delay:g} s after the loop runs and stays down. Direction: the way "
            f"the message of that size goes (a 4-byte message the other way). Pass: mpiexec "
            f"(host A) ends by itself within the timeout + {SLACK:g} s of link-down with a "
            f"non-zero status, and rank 0 (host A) printed a timeout error. Records: "
            f"{jsonl_name}.\n\n" + table(records) + "\n")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--timeout", type=float, default=10.0, help="JAX_CPU_MPI_RECV_TIMEOUT")
    p.add_argument("--max-delay", type=float, default=3.0)
    p.add_argument("--slack", type=float, default=SLACK,
                   help="seconds allowed after link-down beyond the timeout (a negative one "
                        "checks the guard: the launch is dumped and killed)")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--directions", default=",".join(DIRECTIONS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "two-hosts-tcp"))
    p.add_argument("--name", default=f"two-host-faults-{time.strftime('%Y-%m-%d')}")
    p.add_argument("--table-only", metavar="JSONL", help="print the table of recorded trials")
    a = p.parse_args(argv)
    if a.table_only:  # also rewrites the .md next to the records
        jsonl = Path(a.table_only)
        records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
        text = markdown(records, jsonl.name, a.max_delay)
        jsonl.with_suffix(".md").write_text(text)
        print(text)
        return 0
    reason = unavailable_reason()
    if reason is not None:
        print(f"two_host_faults: cannot make two hosts here: {reason}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / f"{a.name}.jsonl"
    failures = out / f"{a.name}-failures"
    failures.mkdir(exist_ok=True)
    records = []
    if jsonl.exists():  # resume: keep what earlier runs recorded
        records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    plan = [(int(s), d, m) for s in a.sizes.split(",") for d in a.directions.split(",")
            for m in a.modes.split(",")]
    print(f"# {len(plan)} cells x {a.trials} trials, JAX_CPU_MPI_RECV_TIMEOUT={a.timeout}, "
          f"limit {a.timeout + a.slack} s after link-down; py-spy: {pyspy() or 'not installed'}",
          flush=True)
    for trial in range(a.trials):  # rounds: every cell gets trial k before any gets k+1
        for size, direction, mode in plan:
            done = sum((r["size"], r["direction"], r["mode"]) == (size, direction, mode)
                       for r in records)
            if done > trial:
                continue
            label = f"{size}-{direction}-{mode}-{done + 1}"
            rec = run_trial(size, direction, mode, a.timeout, a.max_delay, failures, label,
                            a.slack)
            rec["trial"] = done + 1
            rec["load"] = round(os.getloadavg()[0], 2)
            records.append(rec)
            with open(jsonl, "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"{label}: {'PASS' if rec.get('ok') else 'FAIL'} "
                  f"end {rec.get('down_to_end_s')} s after down (delay {rec['delay_s']} s), "
                  f"status {rec.get('returncode')}, killed {rec['killed']}, rank0: "
                  f"{rec.get('rank0_error')!s:.160} | rank1: {rec.get('rank1_error')!s:.120} "
                  f"| load {rec['load']}", flush=True)
    text = markdown(records, jsonl.name, a.max_delay)
    (out / f"{a.name}.md").write_text(text)
    print(text)
    return 0 if all(r.get("ok") for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
