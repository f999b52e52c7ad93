"""The per-message timeline and debug log: switching them, and writing this process's file.

The extension times every psend/precv execution into bounded per-thread buffers
(``cpp/common/trace.h``) while recording is on; :func:`flush` takes the events out and
appends them to this process's file in the Chrome Trace Event format (it opens in the
Perfetto UI and chrome://tracing). One file per process and directory,
``DIR/process<P>-<host>-<pid>.json``; ``python -m jax_cpu_mpi trace DIR`` merges them
(:mod:`jax_cpu_mpi._src.cli.trace`).

Each file's events carry this process's steady clock (microseconds); its
``otherData.jax_cpu_mpi`` says how far that clock is from MPI rank 0's (measured when MPI
was attached), so the merge can line the processes up.

Switched on by ``JAX_CPU_MPI_TRACE=DIR`` (the whole run) or :func:`trace` (a block), the log
by ``JAX_CPU_MPI_DEBUG=1``. Files are written at each :func:`flush`, at the end of a
:func:`trace` block and at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jax_cpu_mpi import _jax_cpu_mpi as ext
from jax_cpu_mpi._src.runtime import config

#: Format tag of the files (``otherData.jax_cpu_mpi.format``).
FORMAT = "jax_cpu_mpi.trace/1"
#: Events each device thread keeps between two flushes unless JAX_CPU_MPI_TRACE_EVENTS says.
DEFAULT_EVENTS_PER_THREAD = 1 << 16

_COLUMNS = tuple(ext.trace_columns())
_PATHS = tuple(ext.trace_path_names())
_OPS = ("psend", "precv", "mark", "all_reduce", "all_gather", "reduce_scatter",
        "all_to_all")  # by op code (cpp/common/trace.h)


@dataclass
class _Session:
    """A directory being recorded into, and what this process has written there."""

    directory: Path
    path: Path | None = None  # this process's file, once written
    tail_bytes: int = 0       # length of the closing part rewritten by each flush
    events: int = 0
    dropped: int = 0
    named: set[tuple[int, int]] = field(default_factory=set)  # (pid, tid) given a name


_lock = threading.RLock()
_sessions: list[_Session] = []  # innermost last; only the last one records
_log = False
_events_per_thread = DEFAULT_EVENTS_PER_THREAD
_atexit_registered = False


def _push_mode() -> None:
    ext.trace_set_mode(bool(_sessions), _log, _events_per_thread)


def apply_environment() -> None:
    """Read ``JAX_CPU_MPI_TRACE``, ``JAX_CPU_MPI_TRACE_EVENTS`` and ``JAX_CPU_MPI_DEBUG``
    (ConfigError for a bad value) and switch recording and logging accordingly."""
    global _log, _events_per_thread
    directory = config.BY_NAME["JAX_CPU_MPI_TRACE"].read()
    events = config.BY_NAME["JAX_CPU_MPI_TRACE_EVENTS"].read()
    log = config.BY_NAME["JAX_CPU_MPI_DEBUG"].read()
    with _lock:
        _log = bool(log)
        if events is not None:
            _events_per_thread = events
        if directory is not None and not _sessions:
            _start(Path(directory))
        _push_mode()


def _start(directory: Path) -> _Session:
    global _atexit_registered
    directory.mkdir(parents=True, exist_ok=True)
    session = _Session(directory)
    if _sessions:
        _write(_sessions[-1])  # what the outer session recorded so far goes to its file
    _sessions.append(session)
    if not _atexit_registered:
        atexit.register(_flush_at_exit)
        _atexit_registered = True
    return session


def recording() -> bool:
    """Whether psend/precv executions are being recorded now."""
    return bool(_sessions)


@contextlib.contextmanager
def trace(directory: str | os.PathLike[str]) -> Iterator[Path]:
    """Record every psend/precv this process executes inside the block into ``directory``.

    Yields the path of this process's file (written when the block ends, and by
    :func:`trace_flush`). Under ``mpirun`` every process writes its own file into the
    directory; merge them with ``python -m jax_cpu_mpi trace DIR``. Inside a recording
    started by ``JAX_CPU_MPI_TRACE`` the block records into ``directory`` only, and the
    outer recording resumes after it. A program's psend/precv run when XLA executes it:
    block on its outputs inside the block (``jax.block_until_ready``).
    """
    with _lock:
        session = _start(Path(directory))
        _push_mode()
    try:
        yield _file_of(session)
    finally:
        with _lock:
            _write(session)
            _sessions.remove(session)
            _push_mode()


def flush() -> Path | None:
    """Write the events recorded so far to this process's file; returns its path (None when
    nothing is being recorded)."""
    with _lock:
        if not _sessions:
            return None
        return _write(_sessions[-1])


def _flush_at_exit() -> None:
    with _lock:
        while _sessions:
            session = _sessions.pop()
            try:
                _write(session)
            except OSError as e:  # a full disk must not hide the program's own exit status
                print(f"jax_cpu_mpi: could not write the trace into {session.directory}: {e}",
                      file=sys.stderr)
        ext.trace_set_mode(False, _log, _events_per_thread)


_attached_facts: dict[str, object] | None = None


def _process_facts() -> dict[str, object]:
    """Rank, host and clock offset; those seen while MPI was attached are kept, since the
    file is written once more at exit, after MPI is detached."""
    global _attached_facts
    clock = ext.trace_clock()
    if not clock["measured"] and _attached_facts is not None:
        return _attached_facts
    hosts = ext.rank_hosts()
    rank = int(clock["rank"])
    facts = {
        "host": hosts[rank] if rank < len(hosts) else socket.gethostname(),
        "rank": rank,
        "mpi": bool(ext.mpi_attached()),
        "clock_synced": bool(clock["measured"]),
        "clock_offset_us": int(clock["offset_ns"]) / 1e3,
        "clock_sync_rtt_us": int(clock["rtt_ns"]) / 1e3,
    }
    if clock["measured"]:
        _attached_facts = facts
    return facts


def _file_of(session: _Session, process: int | None = None) -> Path:
    if session.path is None:
        if process is None:
            process = int(_process_facts()["rank"])
        session.path = session.directory / (
            f"process{process}-{socket.gethostname()}-{os.getpid()}.json")
    return session.path


def _take() -> tuple[np.ndarray, int]:
    table, dropped = ext.trace_take()
    rows = np.frombuffer(table, dtype=np.int64).reshape(-1, len(_COLUMNS))
    return rows, int(dropped)


_MARK = 2  # the op code of a mark (cpp/common/trace.h)
_ALL_REDUCE = 3  # a collective between processes


@functools.cache
def _devices_by_ordinal() -> dict[int, int]:
    """This process's CPU devices: the device ordinal XLA gives a mark's handler (the JAX
    device id; tested under mpirun, where process 1's ids start at 2048) -> the id that
    psend/precv events give the device, its position among the job's CPU devices sorted by
    id (as the lowering's tables number them, :mod:`jax_cpu_mpi._src.lowering.topology`)."""
    import jax

    position = {i: n for n, i in enumerate(sorted(d.id for d in jax.devices("cpu")))}
    return {d.id: position[d.id] for d in jax.local_devices(backend="cpu")}


def _global_device(ordinal: int) -> int:
    return _devices_by_ordinal().get(ordinal, ordinal)


def _event_json(row: np.ndarray) -> dict[str, object]:
    r = dict(zip(_COLUMNS, (int(v) for v in row), strict=True))
    if r["op"] == _MARK:
        return {"name": "mark", "cat": "pipeline", "ph": "i", "s": "t",
                "pid": r["process"], "tid": _global_device(r["device"]),
                "ts": r["start_ns"] / 1e3,
                "args": {"tick": r["seq"], "action": r["label0"], "microbatch": r["label1"],
                         "virtual_stage": r["label2"]}}
    if r["op"] >= _ALL_REDUCE:  # the collectives
        return {"name": _OPS[r["op"]], "cat": "collective", "ph": "X",
                "pid": r["process"], "tid": r["device"],
                "ts": r["start_ns"] / 1e3, "dur": r["dur_ns"] / 1e3,
                "args": {"bytes": r["bytes"], "wait_us": r["wait_ns"] / 1e3,
                         "site": r["seq"], "ok": bool(r["ok"])}}
    return {
        "name": _OPS[r["op"]], "cat": "p2p", "ph": "X",
        "pid": r["process"], "tid": r["device"],
        "ts": r["start_ns"] / 1e3, "dur": r["dur_ns"] / 1e3,
        "args": {"peer": r["peer"], "bytes": r["bytes"], "path": _PATHS[r["path"]],
                 "wait_us": r["wait_ns"] / 1e3, "seq": r["seq"], "ok": bool(r["ok"])},
    }


def _names(session: _Session, pid: int, tid: int, facts: dict[str, object]) -> list[dict]:
    """Metadata events naming the process and the device, the first time each appears."""
    out: list[dict] = []
    if (pid, -1) not in session.named:
        session.named.add((pid, -1))
        out.append({"name": "process_name", "ph": "M", "pid": pid,
                    "args": {"name": f"process {pid} (rank {facts['rank']} on {facts['host']})"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": pid,
                    "args": {"sort_index": pid}})
    if (pid, tid) not in session.named:
        session.named.add((pid, tid))
        out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                    "args": {"name": f"device {tid}"}})
        out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                    "args": {"sort_index": tid}})
    return out


def _write(session: _Session) -> Path:
    """Appends the events taken from the extension to the session's file (written whole the
    first time): its closing part, which holds the counters, is rewritten each time, so a
    flush costs the new events only and the file is valid JSON after every flush."""
    rows, dropped = _take()
    facts = _process_facts()
    process = int(rows[0, _COLUMNS.index("process")]) if len(rows) else None
    path = _file_of(session, process)
    session.dropped += dropped
    session.events += len(rows)
    if dropped:
        print(f"jax_cpu_mpi: the trace dropped {dropped} psend/precv event(s): a device "
              f"thread's buffer ({_events_per_thread} events) filled up between two flushes. "
              "Call jax_cpu_mpi.trace_flush() more often or raise JAX_CPU_MPI_TRACE_EVENTS.",
              file=sys.stderr)
    items: list[dict] = []
    for row in rows:
        event = _event_json(row)
        items.extend(_names(session, int(event["pid"]), int(event["tid"]), facts))
        items.append(event)
    other = {"jax_cpu_mpi": {"format": FORMAT, **facts, "events": session.events,
                             "dropped": session.dropped,
                             "events_per_thread": _events_per_thread}}
    tail = ("\n],\n\"displayTimeUnit\": \"ms\",\n\"otherData\": "
            + json.dumps(other) + "\n}\n").encode()
    body = ",\n".join(json.dumps(item, separators=(",", ":")) for item in items).encode()
    if not path.exists() or session.tail_bytes == 0:
        with open(path, "wb") as f:
            f.write(b"{\"traceEvents\": [\n" + body + tail)
    else:
        with open(path, "r+b") as f:
            f.seek(0, os.SEEK_END)
            f.truncate(f.tell() - session.tail_bytes)
            f.seek(0, os.SEEK_END)
            # A comma only between two events: the file may still hold none.
            f.write((b",\n" if body and session.events > len(rows) else b"") + body + tail)
    session.tail_bytes = len(tail)
    return path
