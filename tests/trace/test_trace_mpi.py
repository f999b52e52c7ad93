"""The timeline under mpirun: one launch of 2 processes x 2 devices (tests/mpi_programs/
trace_cases.py), then the per-process files, the merge and the debug log are checked against
what each process says it executed and against the MPI transport's own counters."""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter

import pytest

from jax_cpu_mpi import pipeline as pl
from jax_cpu_mpi._src.cli import trace as timeline
from jax_cpu_mpi._src.ops.marks import ACTION_NAMES
from jax_cpu_mpi._src.pipeline.executor import tick_labels
from jax_cpu_mpi._src.pipeline.plan import make_plan
from mpi_launcher import assert_mpi_ok, llvm_unoptimized, run_mpi

pytestmark = pytest.mark.mpi

DEBUG_LINE = re.compile(r"^jax_cpu_mpi: process (\d+) device (\d+) (psend|precv) peer (\d+) "
                        r"bytes (\d+) path (\w+) [\d.]+ us")


def _lines_starting(lines: list[str], tag: str) -> str:
    return next(line.split(" ", 1)[1] for line in lines if line.startswith(tag))


def test_trace_under_mpirun(tmp_path):
    directory = tmp_path / "trace"
    run = run_mpi("trace_cases.py", nprocs=2, devices_per_process=2, timeout=120,
                  env={"JAX_CPU_MPI_TRACE": str(directory), "JAX_CPU_MPI_DEBUG": "1",
                       "JAX_CPU_MPI_GPU_PARITY": "0"})  # a ring in one op
    assert_mpi_ok(run, 2)
    merged = timeline.merge(directory)
    assert len(merged.processes) == 2, merged.processes
    stats = {}
    for rank, lines in run.by_rank().items():
        executed = json.loads(_lines_starting(lines, "EXECUTED"))
        stats[rank] = json.loads(_lines_starting(lines, "STATS"))
        data = json.loads(open(_lines_starting(lines, "TRACE-FILE")).read())
        events = [e for e in data["traceEvents"] if e["ph"] == "X"]
        assert Counter(e["name"] for e in events) == executed, (rank, executed)
        # Every event has the fields the Chrome trace and our merge need.
        for e in events:
            assert e["pid"] == rank and isinstance(e["tid"], int)
            assert e["dur"] >= e["args"]["wait_us"] >= 0
            assert {"peer", "bytes", "path", "wait_us", "seq"} <= set(e["args"])
        names = {(e["name"], e.get("tid")) for e in data["traceEvents"] if e["ph"] == "M"}
        assert ("process_name", None) in names
        assert {tid for name, tid in names if name == "thread_name"} == {
            e["tid"] for e in events}
        facts = data["otherData"]["jax_cpu_mpi"]
        assert facts["dropped"] == 0 and facts["clock_synced"] and facts["rank"] == rank
        # Same host, same CLOCK_MONOTONIC: Cristian's estimate lies within half its round
        # trip of the true offset, 0.
        assert abs(facts["clock_offset_us"]) <= facts["clock_sync_rtt_us"] / 2 + 0.01, facts
        # The debug log: one line per message, saying what the file says.
        logged = Counter(m.group(3, 6) for line in lines if (m := DEBUG_LINE.match(line)))
        assert logged == Counter((e["name"], e["args"]["path"]) for e in events), rank
    paths = Counter((m.op, m.path) for m in merged.messages)
    assert paths[("psend", "local")] == paths[("precv", "local")] == 2 * 5
    assert paths[("psend", "staged")] >= 2 * 5  # the ring's MPI hops
    # The one-way 1 MiB messages are framed from the operand and received staged, whoever
    # came first: the sender's transport counts none as direct; the cycle's go direct.
    assert paths[("precv", "staged")] >= 2 * 5 + 2
    direct = sum(s["mpi_direct_sends"] for s in stats.values())
    kept = sum(s["kept_sends"] for s in stats.values())
    assert direct >= 1, stats
    assert paths[("precv", "direct")] == direct
    assert paths[("psend", "kept")] == kept == 2 + 2 * 2, stats
    # Every precv has its psend (same channel, same sequence number), and it did not end
    # before that psend began on the merged clock.
    sends = {(m.device, m.peer, m.seq): m for m in merged.messages if m.op == "psend"}
    tolerance = max(p.clock_sync_rtt_us for p in merged.processes)
    for m in merged.messages:
        if m.op == "precv":
            send = sends[(m.peer, m.device, m.seq)]
            assert m.end_us + tolerance >= send.start_us, (send, m)
    flows = [e for e in merged.chrome_trace()["traceEvents"] if e["ph"] == "s"]
    assert len(flows) == sum(m.op == "precv" for m in merged.messages)


def test_pipeline_ticks_under_mpirun(tmp_path):
    """Every device of both processes has every tick of the 1F1B step once, in order and
    without a gap, labelled as the plan says, under the id its messages carry."""
    directory = tmp_path / "trace"
    # Compiling the pipeline is most of the launch; the ticks' order, labels and adjacency
    # do not depend on LLVM's optimizations.
    run = run_mpi("pipeline_ticks.py", str(directory), nprocs=2, devices_per_process=2,
                  timeout=180, env=llvm_unoptimized())
    assert_mpi_ok(run, 2)
    stage_devices = json.loads(_lines_starting(run.by_rank()[0], "STAGE-DEVICES"))
    merged = timeline.merge(directory)
    plan = make_plan(pl.OneFOneB(stages=4, microbatches=4))
    labels = tick_labels(plan)
    assert {t.device for t in merged.ticks} == set(stage_devices) == \
        {m.device for m in merged.messages}
    assert {t.process for t in merged.ticks} == {0, 1}
    for s, device in enumerate(stage_devices):
        mine = sorted((t for t in merged.ticks if t.device == device), key=lambda t: t.start_us)
        assert [t.tick for t in mine] == list(range(plan.ticks)), (s, mine)
        for t in mine:
            _, action, m, v = labels[t.tick, s]
            assert (t.action, t.microbatch, t.virtual_stage) == (ACTION_NAMES[action], m, v), t
        assert all(a.end_us == b.start_us for a, b in itertools.pairwise(mine))
    assert 0 < merged.idle_fraction() < 1
