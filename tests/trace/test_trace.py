"""The per-message timeline in one process (several devices): one event per executed psend
and precv with the right fields, valid JSON after every flush, bounded buffers, the debug
log, and the merge / summary / picture of ``python -m jax_cpu_mpi trace``."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cpu_mpi
from conftest import make_mesh
from jax_cpu_mpi import _jax_cpu_mpi as ext
from jax_cpu_mpi import config
from jax_cpu_mpi._src.cli import main as cli
from jax_cpu_mpi._src.cli import trace as timeline
from jax_cpu_mpi._src.runtime import trace as recorder

N = 4
RING = [(i, (i + 1) % N) for i in range(N)]


@pytest.fixture(autouse=True)
def cyclic_pairs_allowed():
    with config.overrides(gpu_parity=False):  # a ring in one op: CPU-only
        yield


def program(perm, n=N):
    mesh = make_mesh((n, "x"))

    def body(v):
        tok = jax_cpu_mpi.psend(v, "x", perm)
        return jax_cpu_mpi.precv(tok, jax.ShapeDtypeStruct(v.shape, v.dtype), "x", perm)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    return f, NamedSharding(mesh, P("x"))


def expected(perm, calls):
    """(op, device) -> executions, from the pairs: a device that is no source runs no psend
    message, one that is no destination receives none (it gets zeros)."""
    want = Counter()
    for src, dst in perm:
        want[("psend", src)] += calls
        want[("precv", dst)] += calls
    return want


def x_events(path):
    data = json.loads(path.read_text())  # valid JSON, whole
    return data, [e for e in data["traceEvents"] if e["ph"] == "X"]


def test_one_event_per_executed_psend_and_precv(tmp_path):
    f, sharding = program(RING)
    small = jax.device_put(np.arange(2 * N, dtype=np.float32), sharding)  # 8 B per device
    big = jax.device_put(np.ones(N << 18, np.float32), sharding)  # 1 MiB per device
    partial = [(0, 1), (2, 3)]
    g, _ = program(partial)
    kept_before = jax_cpu_mpi.stats()["kept_sends"]
    with jax_cpu_mpi.trace(tmp_path) as path:
        for _ in range(3):
            jax.block_until_ready(f(small))
        assert jax_cpu_mpi.trace_flush() == path
        _, first = x_events(path)  # valid after a flush, then appended to
        assert len(first) == 3 * 2 * N
        jax.block_until_ready(f(big))
        jax.block_until_ready(g(small))
    kept = jax_cpu_mpi.stats()["kept_sends"] - kept_before
    data, events = x_events(path)
    assert Counter((e["name"], e["tid"]) for e in events) == (
        expected(RING, 4) + expected(partial, 1))
    for e in events:
        assert e["pid"] == 0 and e["cat"] == "p2p" and e["dur"] >= e["args"]["wait_us"] >= 0
        want_bytes = (1 << 20) if e["args"]["bytes"] > 8 else 8
        assert e["args"]["bytes"] == want_bytes
        pair = (e["tid"], e["args"]["peer"]) if e["name"] == "psend" else (
            e["args"]["peer"], e["tid"])
        assert pair in RING + partial
    paths = Counter((e["name"], e["args"]["path"]) for e in events)
    # The 1 MiB psends return with their operand still read: kept, as the transport counted.
    assert paths[("psend", "kept")] == kept == N
    assert paths[("psend", "local")] + kept == paths[("precv", "local")] == 4 * N + 2
    # Each channel numbers its messages from 0 on both ends.
    for op in ("psend", "precv"):
        seqs = Counter()
        for e in sorted(events, key=lambda e: e["ts"]):
            if e["name"] == op:
                channel = (e["tid"], e["args"]["peer"])
                assert e["args"]["seq"] == seqs[channel]
                seqs[channel] += 1
    names = {e["name"]: e for e in data["traceEvents"] if e["ph"] == "M"}
    assert names["process_name"]["args"]["name"].startswith("process 0 (rank 0 on ")
    threads = {e["tid"]: e["args"]["name"] for e in data["traceEvents"]
               if e["name"] == "thread_name"}
    assert threads == {d: f"device {d}" for d in range(N)}
    facts = data["otherData"]["jax_cpu_mpi"]
    assert facts["events"] == len(events) and facts["dropped"] == 0 and not facts["mpi"]


def test_off_outside_the_block(tmp_path):
    f, sharding = program(RING)
    x = jax.device_put(np.arange(2 * N, dtype=np.float32), sharding)
    with jax_cpu_mpi.trace(tmp_path):
        pass
    assert not recorder.recording() and ext.trace_mode() == (False, False)
    jax.block_until_ready(f(x))
    table, dropped = ext.trace_take()
    assert (len(table), dropped) == (0, 0)
    assert jax_cpu_mpi.trace_flush() is None


def test_buffers_are_bounded_and_say_what_they_dropped(tmp_path, monkeypatch, capfd):
    capacity, calls = 100, 10_000
    monkeypatch.setattr(recorder, "_events_per_thread", capacity)
    f, sharding = program([(0, 1)], n=2)
    x = jax.device_put(np.arange(4, dtype=np.float32), sharding)
    with jax_cpu_mpi.trace(tmp_path) as path:
        for i in range(calls):
            out = f(x)
            if i % 100 == 99:
                jax.block_until_ready(out)
        jax.block_until_ready(out)
    data, events = x_events(path)
    dropped = data["otherData"]["jax_cpu_mpi"]["dropped"]
    assert len(events) + dropped == 2 * calls
    # Each device thread keeps at most `capacity` events (XLA runs a few threads).
    assert len(events) <= 16 * capacity and dropped >= 2 * calls - 16 * capacity
    assert f"dropped {dropped} psend/precv event(s)" in capfd.readouterr().err


def test_debug_log_one_line_per_message(monkeypatch, capfd):
    f, sharding = program(RING)
    x = jax.device_put(np.arange(2 * N, dtype=np.float32), sharding)
    jax.block_until_ready(f(x))  # compiled before the log starts
    capfd.readouterr()
    monkeypatch.setenv("JAX_CPU_MPI_DEBUG", "1")
    recorder.apply_environment()
    try:
        for _ in range(2):
            jax.block_until_ready(f(x))
    finally:
        monkeypatch.delenv("JAX_CPU_MPI_DEBUG")
        recorder.apply_environment()
    line = re.compile(r"^jax_cpu_mpi: process 0 device (\d) (psend|precv) peer (\d) bytes 8 "
                      r"path local [\d.]+ us \(waited [\d.]+ us\) seq \d+$")
    logged = [m for text in capfd.readouterr().err.splitlines() if (m := line.match(text))]
    assert Counter((m.group(2), int(m.group(1))) for m in logged) == expected(RING, 2)
    for m in logged:
        me, peer = int(m.group(1)), int(m.group(3))
        assert (me, peer) in RING if m.group(2) == "psend" else (peer, me) in RING


def test_merge_summary_picture_and_cli(tmp_path, capsys):
    f, sharding = program(RING)
    x = jax.device_put(np.arange(2 * N, dtype=np.float32), sharding)
    with jax_cpu_mpi.trace(tmp_path):
        for _ in range(8):
            jax.block_until_ready(f(x))
    merged = timeline.merge(tmp_path)
    assert len(merged.messages) == 8 * 2 * N and merged.messages[0].start_us == 0
    summary = timeline.summarize(merged)
    assert sorted(summary) == list(range(N))
    for s in summary.values():
        assert (s.sent, s.received, s.bytes_sent, s.bytes_received) == (8, 8, 64, 64)
        assert 0 <= s.wait_us <= s.recv_us + s.send_us <= s.span_us == merged.span_us
        assert s.by_path == {"local": 16}
    assert 0 <= timeline.bubble_fraction(merged) <= 1
    assert cli.main(["trace", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"{8 * 2 * N} messages from 1 process(es)" in out
    assert re.search(r"^\s+3\s+0\s+8\s+8\s+64\s+64\s", out, re.M), out
    merged_json = json.loads((tmp_path / timeline.TIMELINE_JSON).read_text())
    flows = [e for e in merged_json["traceEvents"] if e["ph"] == "s"]
    assert len(flows) == 8 * N  # every precv found its psend
    png = (tmp_path / timeline.TIMELINE_PNG).read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    import matplotlib.image

    height, width = matplotlib.image.imread(tmp_path / timeline.TIMELINE_PNG).shape[:2]
    assert width == 1200 and height > 200


def test_cli_without_matplotlib_or_files(tmp_path, monkeypatch, capsys):
    assert cli.main(["trace", str(tmp_path)]) == 1
    assert "holds no trace files" in capsys.readouterr().err
    f, sharding = program(RING)
    with jax_cpu_mpi.trace(tmp_path):
        jax.block_until_ready(f(jax.device_put(np.zeros(2 * N, np.float32), sharding)))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli.main(["trace", str(tmp_path)]) == 0
    assert "needs matplotlib: pip install matplotlib" in capsys.readouterr().err
    assert (tmp_path / timeline.TIMELINE_JSON).exists()
    assert not (tmp_path / timeline.TIMELINE_PNG).exists()


@pytest.mark.parametrize(("name", "value", "message"), [
    ("JAX_CPU_MPI_TRACE_EVENTS", "0", "JAX_CPU_MPI_TRACE_EVENTS='0' is not a positive number"),
    ("JAX_CPU_MPI_TRACE_EVENTS", "many", "is not a whole number"),
    ("JAX_CPU_MPI_DEBUG", "loud", "JAX_CPU_MPI_DEBUG='loud' is not a boolean"),
])
def test_bad_values(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        recorder.apply_environment()
