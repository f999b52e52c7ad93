"""Smoke tests of the benchmark tool, ``python -m jax_cpu_mpi.bench``.

Tiny sizes and few iterations: the tables and the JSON must be well-formed and every received
byte must pass validation. No assertion on timings.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jax_cpu_mpi import _jax_cpu_mpi as ext
from jax_cpu_mpi.bench import methods as bench_methods
from jax_cpu_mpi.bench import options, patterns, report, runner, targets
from jax_cpu_mpi.bench.stats import Measurement
from mpi_launcher import llvm_unoptimized, run_mpi

SIZES = [8, 4096]


def _measurement(method: str, kind: str, size: int, microseconds: list[float],
                 wrong: int = 0) -> Measurement:
    return Measurement(method=method, kind=kind, size=size,
                       seconds=np.array(microseconds) * 1e-6, warmup=1,
                       messages_per_sample=2, wrong=wrong, mode="mpi", description="test")


def test_sizes_are_anchored_at_the_top():
    assert options.size_range(8, 64 << 20, 4) == [8] + [4**k for k in range(2, 14)]
    assert options.size_range(8, 64, 2) == [8, 16, 32, 64]
    assert options.parse_sizes("16MiB,8,1K") == [8, 1024, 16 << 20]
    plan = options.parse(["--sizes", "8,16M"]).plan(16 << 20)
    assert (plan.iters, plan.window, plan.hops) == (32, 32, 256)


def test_progress_is_on_unless_no_progress_and_help_says_so():
    """--help printed "(default: True)" after --no-progress, the opposite of its effect."""
    assert options.parse([]).progress is True
    assert options.parse(["--no-progress"]).progress is False
    help_text = " ".join(options.build_parser().format_help().split())
    flag = help_text[help_text.index("--no-progress no progress bar"):][:90]
    assert "(default: True)" not in flag and "shown by default" in flag, flag


def test_osu_and_nccl_rows_hold_the_statistics():
    lat = _measurement("psend/scan", "latency", 8, [3.0, 1.0, 2.0])
    bw = _measurement("mpi4py", "bandwidth", 1 << 20, [1000.0, 500.0, 2000.0], wrong=3)
    osu = report.osu_tables([lat, bw]).splitlines()
    assert osu[1].split()[:4] == ["#", "Size", "Latency", "(us)"]
    row = osu[2].split()
    assert [row[0], *map(float, row[1:4]), row[-1]] == ["8", 2.0, 1.0, 3.0, "Pass"]
    bw_row = next(line for line in osu if line.startswith("1048576")).split()
    # 2^20 bytes in 1 ms -> 1048.58 MB/s (10^6 bytes/s), worst 2 ms, best 0.5 ms.
    assert [float(v) for v in bw_row[1:4]] == [1048.58, 524.29, 2097.15]
    assert bw_row[-1] == "Fail"
    nccl = report.nccl_tables([lat, bw]).splitlines()
    assert "#wrong" in nccl[2] and "algbw" in nccl[2]
    nccl_row = next(line for line in nccl if line.strip().startswith("1048576")).split()
    assert nccl_row[:5] == ["1048576", "1048576", "uint8", "none", "-1"]
    assert [float(v) for v in nccl_row[5:8]] == [1000.0, 1.05, 1.05]
    assert nccl_row[8] == "3"


def test_targets_compare_within_one_run():
    def goals(scan_us: float) -> dict[str, dict]:
        results = [_measurement("psend/scan", "latency", 8, [scan_us]),
                   _measurement("mpi4py", "latency", 8, [1.5]),
                   _measurement("mpi4jax/scan", "latency", 8, [3.0])]
        return {t["name"]: t for t in targets.evaluate(results)}

    met = goals(3.0)
    assert met["scan hop latency @ 8 B vs raw MPI"]["met"] is True
    assert met["scan hop latency @ 8 B vs mpi4jax"]["met"] is True
    missed = goals(3.6)
    assert missed["scan hop latency @ 8 B vs raw MPI"]["met"] is False
    assert missed["scan hop latency @ 8 B vs mpi4jax"]["met"] is False
    assert missed["scan hop latency @ 8 B vs raw MPI"]["ratio"] == pytest.approx(3.6 / 1.5)
    assert met["scan hop latency @ 8 B below raw MPI"]["met"] is False  # 3.0 us vs 1.5 us
    assert goals(1.0)["scan hop latency @ 8 B below raw MPI"]["met"] is True
    assert missed["window bandwidth @ 16 MiB vs raw MPI (psend/scan)"]["met"] is None
    assert missed["ping-pong hop @ 64 MiB vs raw MPI (psend/scan, bandwidth ratio)"][
        "met"] is None


def test_targets_take_the_median_of_per_round_ratios():
    def rounds(method: str, kind: str, size: int, per_round_us: list[float]) -> Measurement:
        ms = [_measurement(method, kind, size, [us, us]) for us in per_round_us]
        return runner.merge_rounds(ms)

    size = 4 << 20
    # Round by round ours/raw speed: 1/2, 4/4, 9/6 -> median 1.0. Ratio of the medians of
    # all samples (ours 4 us, raw 4 us) would be the same here; make them differ:
    ours = rounds("psend/scan", "latency", size, [2.0, 4.0, 6.0])
    raw = rounds("mpi4py", "latency", size, [1.0, 4.0, 9.0])
    assert ours.extra["round_medians_us"] == [2.0, 4.0, 6.0] and ours.samples == 6
    floor = rounds("hop-floor", "latency", size, [1.0, 2.0, 3.0])
    goals = {t["name"]: t for t in targets.evaluate([ours, raw, floor])}
    pingpong = goals["ping-pong hop @ 4 MiB vs raw MPI (psend/scan, bandwidth ratio)"]
    assert pingpong["ratio"] == pytest.approx(1.0) and pingpong["met"] is True
    assert "median of 3 per-round ratios" in pingpong["detail"]
    assert "4 MiB x0.50" in goals["psend/scan hop vs the floor (hop-floor)"]["detail"]
    local = [rounds("psend-local/scan", "latency", 8, [4.0, 3.0]),
             rounds("ppermute-local/scan", "latency", 8, [8.0, 9.0])]
    goals = {t["name"]: t for t in targets.evaluate(local)}
    assert goals["one process hop @ 8 B: psend-local/scan vs ppermute-local/scan"][
        "ratio"] == pytest.approx(2.5)
    assert goals["one process hop latency @ 8 B"]["met"] is True


def _read_outputs(out: Path) -> tuple[dict, list[dict], list[str]]:
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert lines[0]["type"] == "run"
    results = [r for r in lines if r["type"] == "result"]
    notes = [r["text"] for r in lines if r["type"] == "note"]
    assert [r for r in lines if r["type"] == "target"], "no targets in the JSON"
    return lines[0], results, notes


def _check_results(results: list[dict], methods: list[str], out: Path,
                   two_way: tuple[str, ...] = ()) -> None:
    got = {(r["method"], r["kind"], r["size"]) for r in results}
    for method in methods:
        kinds = (["latency"] if method in bench_methods.LATENCY_ONLY
                 else ["latency", "bandwidth"])
        if method not in bench_methods.METHODS:
            kinds = []
        if method in patterns.CPU_METHODS:
            kinds += list(two_way)
        for kind in kinds:
            for size in SIZES:
                assert (method, kind, size) in got, f"missing {method} {kind} {size}"
    for r in results:
        assert r["validation"] == "Pass" and r["wrong"] == 0, r
        stats = r["latency_us"]
        assert 0 < stats["min"] <= stats["median"] <= stats["max"], r
        assert r["samples"] >= 1 and r["size"] == r["count"]
        # The machine's phase when each round started (None without two usable CPUs).
        cores = r["round_core_to_core_ns"]
        assert len(cores) == len(r["round_medians_us"]), r
        assert all(ns is None or ns > 0 for ns in cores), cores
    osu = (out / "osu.txt").read_text()
    assert "# Size" in osu and "Latency (us)" in osu and "Bandwidth (MB/s)" in osu
    rows = [line.split() for line in osu.splitlines() if line and not line.startswith("#")]
    assert rows and all(row[-1] == "Pass" for row in rows)
    assert len(rows) == len(results)
    nccl = (out / "nccl.txt").read_text()
    assert "#wrong" in nccl and "busbw" in nccl
    assert "Out of bounds values : 0 OK" in nccl and "FAILED" not in nccl
    assert "Targets" in (out / "targets.txt").read_text()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pattern_option_and_pairs():
    """--pattern names OSU's and nccl-tests' patterns; each pattern's pairs of ranks."""
    kinds = options.parse(["--pattern", "pingpong,exchange,bibw", "--quick"]).kinds
    assert kinds == ("latency", "exchange", "bibw")
    with pytest.raises(SystemExit):
        options.parse(["--pattern", "alltoall"])
    assert patterns.pairs("exchange", 4) == [(0, 1), (1, 0), (2, 3), (3, 2)]
    assert patterns.pairs("ring", 3) == [(0, 1), (1, 2), (2, 0)]
    assert patterns.pairs("multi-pair", 4) == [(0, 2), (1, 3)]
    assert patterns.pairs("bibw", 2) == [(0, 1), (1, 0)]
    assert not patterns.available("psend/scan", "bibw", 4)
    assert not patterns.available("psend/call", "exchange", 2)


def test_core_to_core_round_trip_probe():
    """The probe behind the benchmark's phase line: a round trip between two CPUs this
    process may use, -1 for the same CPU twice or a CPU it cannot run on, never a hang."""
    assert ext.core_to_core_round_trip_ns(0, 0) == -1
    assert ext.core_to_core_round_trip_ns(0, 1 << 20) == -1
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        ns = ext.core_to_core_round_trip_ns(cpus[0], cpus[1], 2000)
        assert 0 < ns < 50e6, ns
        assert os.sched_getaffinity(0) == set(cpus), "the caller's CPUs are restored"


#: The benchmarks' launches here compile cheaply (llvm_unoptimized()): they are mostly
#: compiling their many small programs, and what is checked (every received byte, the
#: tables' and JSON's form, times finite and positive) does not depend on code generation.
_CHEAP = llvm_unoptimized()


def _bench(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_CPU_MPI_RECV_TIMEOUT="60", **_CHEAP)
    for var in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"):
        env.pop(var, None)
    return subprocess.run([sys.executable, "-m", "jax_cpu_mpi.bench", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.timeout(150)
def test_one_process_runs_the_in_process_methods(tmp_path):
    proc = _bench("--quick", "--sizes", "8,4K", "--out", str(tmp_path), "--format", "osu,nccl",
                  timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# Size" in proc.stdout and "#wrong" in proc.stdout and "Targets" in proc.stdout
    header, results, notes = _read_outputs(tmp_path)
    assert header["ranks"] == 1 and header["sizes"] == SIZES
    # What changes timings is on record: the settings, and features this JAX switched off.
    assert header["config"]["fast_dispatch"] is True and header["config"]["recv_timeout"] > 0
    assert header["features_not_active"] == [], header["features_not_active"]
    assert header["streaming_zero_fill_min_bytes"] == ext.streaming_zero_fill_min_bytes()
    assert header["zero_fill_drop_min_bytes"] == ext.zero_fill_drop_min_bytes()
    _check_results(results, list(options.LOCAL_METHODS), tmp_path)
    assert any("MPI methods skipped" in note for note in notes)


@pytest.mark.timeout(60)
def test_gpu_platform_without_two_gpus_says_so():
    proc = _bench("--platform", "gpu", "--quick", timeout=50)
    if proc.returncode == 0:
        pytest.skip("this machine has two GPUs")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--platform gpu" in proc.stderr and "GPU" in proc.stderr


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_two_ranks_run_every_method(tmp_path):
    # Every --pattern too: the two-way ones (bibw, exchange, ring, multi-pair) run psend/scan,
    # psend2/scan, mpi4py and gloo/scan, and check every received byte.
    run = run_mpi("jax_cpu_mpi.bench", "--quick", "--sizes", "8,4K", "--out", str(tmp_path),
                  "--pattern", ",".join(options.PATTERNS), "--no-progress", nprocs=2,
                  timeout=270, module=True, env=_CHEAP)
    assert run.returncode == 0, run.report()
    header, results, notes = _read_outputs(tmp_path)
    assert header["ranks"] == 2
    methods = [m for m in options.MPI_METHODS + options.LOCAL_METHODS
               if not m.startswith(("mpi4jax", "ppermute-local"))]
    assert any("ppermute-local skipped" in note for note in notes)
    if importlib.util.find_spec("mpi4jax") is not None:
        methods.append("mpi4jax/call")
        methods.append("mpi4jax/scan")
    else:
        assert any("mpi4jax skipped" in note for note in notes)
    _check_results(results, methods, tmp_path, two_way=patterns.KINDS)


@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_two_ranks_run_the_collectives_benchmark(tmp_path):
    """``python -m jax_cpu_mpi.bench.collectives``: every op's table and JSON, a row per
    size with every method's time finite. 8 B goes through the persistent calls, 64 KiB
    through the nonblocking ones polled by the collectives' own wait (beyond
    MpiTransport::kPersistentBytes and the adaptive spin's sizes)."""
    from jax_cpu_mpi.bench import collectives as bench_collectives

    sizes = [8, 64 << 10]
    run = run_mpi("jax_cpu_mpi.bench.collectives", "--devices", "1", "--min-bytes", "8",
                  "--max-bytes", str(sizes[-1]), "--factor", str(sizes[-1] // 8),
                  "--iters", "3", "--rounds", "2", "--warmup", "1", "--out", str(tmp_path),
                  nprocs=2, timeout=120, module=True, env=_CHEAP)
    assert run.returncode == 0, run.report()
    printed = run.by_rank()[0]
    columns = ["size (B)", "count", "type", "gloo us", "gloo busbw", "MPI (ours) us",
               "ours busbw", "mpi4py us", "mpi4py busbw", "mpi4py carried us",
               "carried busbw", "ours / mpi4py speed", "ours / carried speed",
               "gloo / ours time"]
    for op in bench_collectives.OPS:
        data = json.loads((tmp_path / f"{op}_perf-2x1.json").read_text())
        assert (data["op"], data["ranks"], data["devices_per_rank"]) == (op, 2, 1), data
        assert (data["iters"], data["rounds"], data["warmup"]) == (3, 2, 1), data
        # The benchmark re-executed itself with glibc's huge-page tunable (with_huge_pages).
        if platform.libc_ver()[0] == "glibc":
            assert bench_collectives.HUGE_PAGES_TUNABLE in data["glibc_tunables"].split(":")
        assert [r["bytes"] for r in data["rows"]] == sizes, data["rows"]
        factor = (2 if op == "all_reduce" else 1) * (2 - 1) / 2
        for r in data["rows"]:
            assert (r["count"], r["type"], r["devices"]) == (r["bytes"] // 4, "float32", 2)
            for m in bench_collectives.METHODS:
                us = r[f"{m}_us"]
                assert np.isfinite(us) and us > 0, (op, m, r)
                assert r[f"{m}_algbw_GBps"] == pytest.approx(r["bytes"] / us / 1e3), (op, m)
                assert r[f"{m}_busbw_GBps"] == pytest.approx(
                    r[f"{m}_algbw_GBps"] * factor), (op, m)
            assert r["mpi_vs_mpi4py"] == pytest.approx(r["mpi4py_us"] / r["mpi_us"])
            assert r["mpi_vs_carried"] == pytest.approx(r["mpi4py-carried_us"] / r["mpi_us"])
            assert r["gloo_vs_mpi"] == pytest.approx(r["gloo_us"] / r["mpi_us"])
            assert any(line.split()[:2] == [op, str(r["bytes"])] for line in printed), (
                op, r["bytes"], printed)
        table = (tmp_path / f"{op}_perf-2x1.md").read_text().splitlines()
        assert table[0].startswith(f"{op}_perf: ") and "2 ranks x 1 device(s)" in table[0]
        assert f"GLIBC_TUNABLES={data['glibc_tunables']}" in table[0] or not data[
            "glibc_tunables"], table[0]
        head = table.index("| " + " | ".join(columns) + " |")
        body = [line for line in table[head + 2:] if line.startswith("|")]
        cells = [[c.strip() for c in line.strip("|").split("|")] for line in body]
        assert [int(row[0]) for row in cells] == sizes, table
        for row in cells:
            assert len(row) == len(columns) and row[2] == "float32", row
            values = [float(c) for i, c in enumerate(row) if i != 2]
            assert all(np.isfinite(v) for v in values), row


class _RecordingComm:
    """mpi4py's calls of the collectives benchmark on one rank, recorded: each call's
    (name, operand, result), and a result of twice the operand (all_reduce, alltoall) so
    that a loop's values show whether it fed its results back."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, np.ndarray, np.ndarray]] = []

    def _call(self, name: str, send: np.ndarray, recv: np.ndarray) -> None:
        self.calls.append((name, send, recv))
        if send.size == recv.size:
            recv[...] = 2 * send

    def Allreduce(self, send, recv, op=None):
        self._call("Allreduce", send, recv)

    def Alltoall(self, send, recv):
        self._call("Alltoall", send, recv)

    def Allgather(self, send, recv):
        self._call("Allgather", send, recv)

    def Reduce_scatter_block(self, send, recv, op=None):
        self._call("Reduce_scatter_block", send, recv)


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "alltoall"])
@pytest.mark.parametrize("devices_per_rank", [1, 2])
def test_carried_reference_moves_its_operands_as_the_scan_does(op, devices_per_rank):
    """mpi4py-carried: all_reduce's and alltoall's calls take the last call's result as
    their operand (two buffers in turn), all_gather's and reduce_scatter's keep one
    unchanging operand, as the scan carries them; every loop (one launch) starts from the
    same values; the buffers have mpi_call's sizes."""
    from jax_cpu_mpi.bench import collectives as bench_collectives

    devices, elements = 2 * devices_per_rank, 8 * devices_per_rank
    comm = _RecordingComm()
    loop = bench_collectives.carried_loop(comm, op, elements, devices, devices_per_rank,
                                          reduction="sum")
    for _ in range(2):
        comm.calls.clear()
        loop(3)
        assert len(comm.calls) == 3
        sends = [c[1] for c in comm.calls]
        recvs = [c[2] for c in comm.calls]
        block = elements // devices * devices_per_rank
        sizes = {"all_reduce": (elements, elements),
                 "alltoall": (elements * devices_per_rank,) * 2,
                 "all_gather": (block, elements), "reduce_scatter": (elements, block)}[op]
        assert all((s.size, r.size) == sizes for s, r in zip(sends, recvs, strict=True))
        if op in ("all_reduce", "alltoall"):
            for before, after in zip(comm.calls, comm.calls[1:], strict=False):
                assert after[1] is before[2] and after[2] is before[1], op
            assert not np.shares_memory(sends[0], recvs[0])
            # Ones, doubled by each of the 3 calls: the loop started from the launch's
            # operand again.
            np.testing.assert_array_equal(recvs[-1], np.full(sizes[1], 8, np.float32))
        else:
            assert all(s is sends[0] for s in sends) and all(r is recvs[0] for r in recvs)
            assert not np.shares_memory(sends[0], recvs[0])


def test_gpu_methods_run_their_programs_on_any_two_devices():
    """The --platform gpu methods are the CPU programs on other devices: run them here on two
    CPU devices (JAX's NCCL lowering needs GPUs, this package's lowering stands in)."""
    import jax

    from jax_cpu_mpi.bench import methods
    from jax_cpu_mpi.bench.session import Session

    session = Session(platform="gpu", pair=(jax.devices()[0], jax.devices()[1]))
    plan = options.Options(sizes=(64,), methods=(), kinds=(), max_iters=3, min_iters=3,
                           max_hops=4, max_window=4, min_samples=2).plan(64)
    for name in options.GPU_METHODS:
        kinds = ["latency"] if name.startswith("jit-floor") else ["latency", "bandwidth"]
        for kind in kinds:
            m = methods.METHODS[name](methods.Context(session, plan, kind))
            assert (m.method, m.kind, m.mode, m.size) == (name, kind, "gpu", 64)
            assert m.valid and m.samples >= 2 and (m.seconds > 0).all(), (name, kind)


def test_donated_pattern_program_receives_into_the_donated_buffer():
    """psend-donated/scan's program on two devices of this process: each call's result takes
    the donated buffer of the previous one (which is deleted) and holds what was received,
    never what that buffer held: zeros where a device receives nothing (multi-pair's
    sender)."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_cpu_mpi._src.runtime.config import overrides
    from jax_cpu_mpi.bench.programs import AXIS

    mesh = Mesh(np.array(jax.devices()[:2]), (AXIS,))
    sharding = NamedSharding(mesh, P(AXIS))
    halves = np.arange(1, 17, dtype=np.uint8).reshape(2, 8)
    x = jax.device_put(halves.reshape(-1), sharding)
    wanted = {"exchange": [halves[1], halves[0]], "multi-pair": [np.zeros(8, np.uint8), halves[0]]}
    for kind, want in wanted.items():
        fn = patterns.donated_scan_program(mesh, "psend", patterns.pairs(kind, 2), 3)
        y = jax.device_put(np.full(16, 0xAB, np.uint8), sharding)
        for _ in range(2):
            with overrides(gpu_parity=False):  # the exchange is one op with a cycle
                result = fn(x, y)
            assert y.is_deleted(), kind
            np.testing.assert_array_equal(np.asarray(result), np.concatenate(want), kind)
            y = result


def test_donated_pingpong_program_receives_into_the_donated_buffers():
    """psend-donated/scan's ping-pong on two devices of this process: each call's results
    take the donated carries of the previous call (which are deleted); the first device's
    message comes back to it and reaches the second device, and each device's other result
    is the zeros of the hop it does not receive, never what its buffer held."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_cpu_mpi.bench import programs

    mesh = Mesh(np.array(jax.devices()[:2]), (programs.AXIS,))
    sharding = NamedSharding(mesh, P(programs.AXIS))
    message = np.arange(1, 9, dtype=np.uint8)
    fn = programs.pingpong_donated_scan(mesh, "psend", 4)
    z = jax.device_put(np.concatenate([message, np.full(8, 0xCD, np.uint8)]), sharding)
    y = jax.device_put(np.full(16, 0xAB, np.uint8), sharding)
    zeros = np.zeros(8, np.uint8)
    for _ in range(2):
        z_next, y_next = fn(z, y)
        assert z.is_deleted() and y.is_deleted()
        np.testing.assert_array_equal(np.asarray(z_next), np.concatenate([message, zeros]))
        np.testing.assert_array_equal(np.asarray(y_next), np.concatenate([zeros, message]))
        z, y = z_next, y_next


def _entry_copies(compiled, n: int) -> list[str]:
    """The copies of a whole u8[n] message in a compiled program's entry computation (the
    loop carry's copy of the operand, when the scan starts from it)."""
    import re

    entry = compiled.as_text().split("ENTRY", 1)[1]
    return [line for line in entry.splitlines()
            if re.search(rf"= u8\[{n}\]\{{0\}} copy\(", line)]


def test_pattern_program_copies_nothing_into_its_loop_carry():
    """psend/scan's and psend2/scan's programs on two devices of this process run their first
    step before the loop: XLA copies no operand into the loop's carry at every call (a pass
    over the message that raw MPI's loop does not have), and the result is still each
    device's message (zeros where a device receives nothing, multi-pair's sender; psend2
    ORs its two ops' results, of which a device receives in one)."""

    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_cpu_mpi._src.runtime.config import overrides
    from jax_cpu_mpi.bench.programs import AXIS

    mesh = Mesh(np.array(jax.devices()[:2]), (AXIS,))
    halves = (np.arange(1, 4097) % 251).astype(np.uint8).reshape(2, 2048)
    x = jax.device_put(halves.reshape(-1), NamedSharding(mesh, P(AXIS)))
    wanted = {"exchange": [halves[1], halves[0]],
              "multi-pair": [np.zeros(2048, np.uint8), halves[0]]}
    for transport in ("psend", "psend2"):
        for kind, want in wanted.items():
            with overrides(gpu_parity=False):  # the exchange is one op with a cycle
                fn = patterns._scan_program(mesh, transport, patterns.pairs(kind, 2), 4)
                compiled = fn.lower(x).compile()
                result = compiled(x)
            copies = _entry_copies(compiled, 2048)
            assert not copies, (transport, kind, copies)
            np.testing.assert_array_equal(np.asarray(result), np.concatenate(want),
                                          (transport, kind))


def test_hop_programs_copy_nothing_into_their_loop_carry():
    """The one-way hop's ping-pong scan and the stream's scan (psend/scan, ppermute/scan) run
    their first step before the loop: XLA copies no operand into the loop's carry at every
    call (a pass over the message that raw MPI's loop does not have), and each device still
    ends with what it received (the ping-pong: the message back on device 0 and the one
    device 1 received; the stream: the message on device 1, the acknowledgement on 0)."""

    import jax

    from jax_cpu_mpi.bench import programs

    mesh = programs.mesh_of(tuple(jax.devices()[:2]))
    n = 2048
    x = programs.sharded_pattern(mesh, n)
    message, zeros = programs.pattern(n), np.zeros(n, np.uint8)
    ack = np.concatenate([programs.pattern(n)[:programs.ACK_BYTES],
                          np.zeros(programs.ACK_BYTES, np.uint8)])
    for transport in ("psend", "ppermute"):
        for name, fn, want in (
                ("pingpong", programs.pingpong_scan(mesh, transport, 8),
                 [np.concatenate([message, zeros]), np.concatenate([zeros, message])]),
                ("stream", programs.stream_scan(mesh, transport, 8),
                 [np.concatenate([zeros, message]), ack])):
            compiled = fn.lower(x).compile()
            results = compiled(x)
            copies = _entry_copies(compiled, n)
            assert not copies, (transport, name, copies)
            for got, expected in zip(results, want, strict=True):
                np.testing.assert_array_equal(np.asarray(got), expected, (transport, name))


def test_multi_pair_windows_end_in_acknowledgements():
    """multi-pair as osu_mbw_mr: windows of messages, each followed by a 4-byte
    acknowledgement back from the receiver, several windows per call. On two devices of this
    process: the receiver ends with the message, the sender with the acknowledgement (the
    message's first bytes); the call copies no operand into a loop carry; and the compiled
    program moves a message of the acknowledgement's 4 bytes."""
    import re

    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_cpu_mpi._src.runtime.config import overrides
    from jax_cpu_mpi.bench.programs import AXIS

    mesh = Mesh(np.array(jax.devices()[:2]), (AXIS,))
    halves = (np.arange(1, 4097) % 251).astype(np.uint8).reshape(2, 2048)
    x = jax.device_put(halves.reshape(-1), NamedSharding(mesh, P(AXIS)))
    k = patterns.WINDOW_ACK_BYTES
    want_ack = np.concatenate([halves[0][:k], np.zeros(k, np.uint8)])
    perm = patterns.pairs("multi-pair", 2)
    for transport in ("psend", "psend2", "ppermute"):
        with overrides(gpu_parity=False):
            fn = patterns.window_program(mesh, transport, perm, window=4, windows=3)
            compiled = fn.lower(x).compile()
            y, ack = compiled(x)
        text = compiled.as_text()
        entry = text.split("ENTRY", 1)[1]
        copies = [line for line in entry.splitlines()
                  if re.search(r"= u8\[2048\]\{0\} copy\(", line)]
        assert not copies, (transport, copies)
        np.testing.assert_array_equal(np.asarray(y),
                                      np.concatenate([np.zeros(2048, np.uint8), halves[0]]),
                                      transport)
        np.testing.assert_array_equal(np.asarray(ack), want_ack, transport)
        assert re.search(rf"u8\[{k}\]", text), transport  # the acknowledgement's message
