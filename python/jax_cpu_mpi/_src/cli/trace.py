"""``python -m jax_cpu_mpi trace DIR``: one timeline from the per-process trace files.

:func:`merge` reads every process's file of a directory (written by ``JAX_CPU_MPI_TRACE`` or
:func:`jax_cpu_mpi.trace`), moves each process's events onto MPI rank 0's clock (the offset
each process measured when MPI was attached) and starts the timeline at 0. The result:

* :meth:`Timeline.chrome_trace` / :func:`write_json`: ``timeline.json`` in the Chrome Trace
  Event format (Perfetto UI, chrome://tracing), with each op's wait drawn as a slice inside
  it and an arrow from each psend to the precv that took its message;
* :func:`summarize`: per device, the time spent sending, receiving and waiting, bytes and
  messages, and the share of the timeline spent waiting on a peer (a pipeline's bubbles);
* :func:`draw`: ``timeline.png``, one row per device (needs matplotlib);
* :attr:`Timeline.ticks` / :func:`idle_fraction`: a pipeline's ticks, from the marks its
  executor records at each tick's start (:mod:`jax_cpu_mpi._src.ops.marks`), paired into
  spans per device.

Where a wait sits inside its op is not recorded, only how long it lasted: the picture and
``timeline.json`` put a precv's wait at its start (the message had not arrived) and a
psend's at its end (the receiver had not taken it yet).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from jax_cpu_mpi._src.ops.marks import ACTION_NAMES

#: What ``trace DIR`` writes into DIR.
TIMELINE_JSON = "timeline.json"
TIMELINE_PNG = "timeline.png"

_OPS = ("psend", "precv")


class TraceError(ValueError):
    """A trace directory jax_cpu_mpi cannot merge (no files, a file that is no trace)."""


@dataclass(frozen=True)
class Message:
    """One psend or precv execution, on the merged clock (microseconds from the start)."""

    op: str          # "psend" or "precv"
    process: int
    device: int      # global device id
    peer: int        # global device id at the other end
    start_us: float
    dur_us: float
    wait_us: float   # blocked on the peer
    bytes: int
    path: str        # local, staged, direct or kept
    seq: int         # the message's number on its (source, destination) channel
    ok: bool = True

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


@dataclass(frozen=True)
class Tick:
    """One tick of a pipeline on one device: from the executor's mark at its start to the
    next mark of that device (the next tick's, or the step's end), on the merged clock.
    The tick runs its action, then its psend/precv (``messages_us`` of the span)."""

    process: int
    device: int         # global device id, as the messages'
    tick: int
    action: str         # "F", "B", "W" or "idle"
    microbatch: int     # -1 where idle
    virtual_stage: int  # -1 where idle
    start_us: float
    end_us: float
    messages_us: float = 0.0  # inside this device's psend/precv during the tick
    step: int = 0             # which run of the pipeline on this device, from 0
    virtual_stages: int = 1   # of the pipeline that ran it (as many as its ticks name)

    @property
    def compute_us(self) -> float:
        """The span outside psend/precv: the action, and the tick's own bookkeeping."""
        return max(0.0, self.end_us - self.start_us - self.messages_us)

    @property
    def label(self) -> str:
        """``F3`` (microbatch 3), ``B2.1`` (virtual stage 1 of an interleaved schedule),
        ``idle``: as :meth:`jax_cpu_mpi.pipeline.Action.label` writes the schedule's cells."""
        if self.action == "idle":
            return "idle"
        return f"{self.action}{self.microbatch}" + (
            f".{self.virtual_stage}" if self.virtual_stages > 1 else "")


@dataclass(frozen=True)
class ProcessInfo:
    """What a process's file says about it."""

    process: int
    rank: int
    host: str
    file: str
    clock_offset_us: float  # its clock minus rank 0's
    clock_sync_rtt_us: float
    clock_synced: bool
    events: int
    dropped: int


@dataclass
class DeviceSummary:
    """Where one device's time went on the merged timeline."""

    device: int
    process: int
    sent: int = 0
    received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    send_us: float = 0.0     # inside psend
    recv_us: float = 0.0     # inside precv
    wait_us: float = 0.0     # of which blocked on the peer
    span_us: float = 0.0     # the whole timeline (same for every device)
    by_path: dict[str, int] = field(default_factory=dict)

    @property
    def wait_fraction(self) -> float:
        """Share of the timeline this device spent blocked on a peer: with the work split
        evenly, a pipeline stage's bubble fraction."""
        return self.wait_us / self.span_us if self.span_us > 0 else 0.0

    @property
    def busy_us(self) -> float:
        """Time outside psend/precv (computing, or idle outside any message)."""
        return max(0.0, self.span_us - self.send_us - self.recv_us)


@dataclass
class Timeline:
    """The merged messages of every process, and the processes they came from."""

    messages: list[Message]
    processes: list[ProcessInfo]
    span_us: float
    #: The ticks of the pipelines run while recording (:class:`Tick`), by device and time.
    ticks: list[Tick] = field(default_factory=list)

    @property
    def devices(self) -> list[int]:
        return sorted({m.device for m in self.messages} | {t.device for t in self.ticks})

    @property
    def dropped(self) -> int:
        """Events the processes could not keep (full buffers): the timeline lacks them."""
        return sum(p.dropped for p in self.processes)

    def summary(self) -> dict[int, DeviceSummary]:
        """Per device: messages, bytes, time in psend / precv / waiting (:func:`summarize`)."""
        return summarize(self)

    def bubble_fraction(self) -> float:
        """Mean over devices of the share of the timeline spent blocked on a peer."""
        return bubble_fraction(self)

    def idle_fraction(self) -> float:
        """A pipeline's bubble as its schedule counts it: the mean over devices of the share
        of a step (its first tick's start to its last tick's end, on any device) in which
        the device runs no action (idle ticks, waits and messages), averaged over the steps
        recorded (the host's time between steps is in none). 0 when no pipeline ran (no
        ticks)."""
        return idle_fraction(self)

    def chrome_trace(self) -> dict[str, object]:
        """The timeline as a Chrome trace (what ``timeline.json`` holds)."""
        events: list[dict[str, object]] = []
        for p in self.processes:
            events.append({"name": "process_name", "ph": "M", "pid": p.process,
                           "args": {"name": f"process {p.process} (rank {p.rank} on {p.host})"}})
            events.append({"name": "process_sort_index", "ph": "M", "pid": p.process,
                           "args": {"sort_index": p.process}})
        for device, process in sorted({(m.device, m.process) for m in self.messages}
                                      | {(t.device, t.process) for t in self.ticks}):
            events.append({"name": "thread_name", "ph": "M", "pid": process, "tid": device,
                           "args": {"name": f"device {device}"}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": process,
                           "tid": device, "args": {"sort_index": device}})
        # A tick holds its psend/precv: Perfetto draws them nested in it.
        for t in self.ticks:
            events.append({"name": t.label, "cat": "pipeline", "ph": "X", "pid": t.process,
                           "tid": t.device, "ts": t.start_us, "dur": t.end_us - t.start_us,
                           "args": {"tick": t.tick, "compute_us": t.compute_us}})
        sends = {}
        for m in self.messages:
            events.append({"name": m.op, "cat": "p2p", "ph": "X", "pid": m.process,
                           "tid": m.device, "ts": m.start_us, "dur": m.dur_us,
                           "args": {"peer": m.peer, "bytes": m.bytes, "path": m.path,
                                    "wait_us": m.wait_us, "seq": m.seq, "ok": m.ok}})
            if m.wait_us > 0:
                start = m.start_us if m.op == "precv" else m.end_us - m.wait_us
                events.append({"name": "wait", "cat": "wait", "ph": "X", "pid": m.process,
                               "tid": m.device, "ts": start, "dur": m.wait_us,
                               "args": {"peer": m.peer}})
            if m.op == "psend":
                sends[(m.device, m.peer, m.seq)] = m
        # An arrow from each psend to the precv that took its message (same channel, same
        # sequence number).
        flow_id = 0
        for m in self.messages:
            send = sends.get((m.peer, m.device, m.seq)) if m.op == "precv" else None
            if send is None:
                continue
            flow_id += 1
            events.append({"name": "message", "cat": "flow", "ph": "s", "id": flow_id,
                           "pid": send.process, "tid": send.device, "ts": send.start_us})
            events.append({"name": "message", "cat": "flow", "ph": "f", "bp": "e",
                           "id": flow_id, "pid": m.process, "tid": m.device,
                           "ts": m.end_us})
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"jax_cpu_mpi": {
                    "merged": True, "span_us": self.span_us, "dropped": self.dropped,
                    "processes": [asdict(p) for p in self.processes]}}}


def _trace_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise TraceError(f"{directory} is not a directory: run the program with "
                         f"JAX_CPU_MPI_TRACE={directory} (or inside jax_cpu_mpi.trace(...)) "
                         "first")
    files = sorted(p for p in directory.glob("process*.json"))
    if not files:
        raise TraceError(
            f"{directory} holds no trace files (process*.json): run the program with "
            f"JAX_CPU_MPI_TRACE={directory} (or inside jax_cpu_mpi.trace(...)); each process "
            "writes its file at exit and on jax_cpu_mpi.trace_flush()")
    return files


def _read(path: Path) -> tuple[ProcessInfo, list[dict]]:
    try:
        data = json.loads(path.read_text())
        facts = data["otherData"]["jax_cpu_mpi"]
        events = [e for e in data["traceEvents"] if e.get("ph") == "X"
                  or (e.get("ph") == "i" and e.get("name") == "mark")]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TraceError(f"{path} is not a jax_cpu_mpi trace file ({e})") from None
    pids = {int(e["pid"]) for e in events}
    process = pids.pop() if len(pids) == 1 else int(facts.get("rank", 0))
    info = ProcessInfo(
        process=process, rank=int(facts.get("rank", 0)), host=str(facts.get("host", "")),
        file=path.name, clock_offset_us=float(facts.get("clock_offset_us", 0.0)),
        clock_sync_rtt_us=float(facts.get("clock_sync_rtt_us", 0.0)),
        clock_synced=bool(facts.get("clock_synced", False)),
        events=len(events), dropped=int(facts.get("dropped", 0)))
    return info, events


def merge(directory: str | os.PathLike[str]) -> Timeline:
    """Read every process's trace file in ``directory`` into one :class:`Timeline`, on MPI
    rank 0's clock, starting at 0 (TraceError if there is nothing to merge).

    Public as ``jax_cpu_mpi.read_timeline``: ``read_timeline(DIR).summary()`` gives each
    device's sending, receiving and waiting time, ``.bubble_fraction()`` the mean share
    of the timeline the devices spent waiting on a peer. Where a pipeline of
    :mod:`jax_cpu_mpi.pipeline` ran, ``.ticks`` lists every tick of every device (its
    action ``F``/``B``/``W``/``idle``, microbatch, virtual stage, span, and time inside
    psend/precv), and ``.idle_fraction()`` is the share of the pipeline's span the devices
    ran no action: the bubble as the schedule's table counts it.
    """
    infos, raw = [], []
    for path in _trace_files(Path(directory)):
        info, events = _read(path)
        infos.append(info)
        raw.extend((info.clock_offset_us, e) for e in events)
    messages = [
        Message(op=str(e["name"]), process=int(e["pid"]), device=int(e["tid"]),
                peer=int(e["args"]["peer"]), start_us=float(e["ts"]) - offset,
                dur_us=float(e["dur"]), wait_us=float(e["args"]["wait_us"]),
                bytes=int(e["args"]["bytes"]), path=str(e["args"]["path"]),
                seq=int(e["args"]["seq"]), ok=bool(e["args"].get("ok", True)))
        for offset, e in raw if e.get("name") in _OPS]
    marks = [(int(e["pid"]), int(e["tid"]), float(e["ts"]) - offset, e["args"])
             for offset, e in raw if e.get("name") == "mark"]
    origin = min([*(m.start_us for m in messages), *(t for _, _, t, _ in marks)], default=0.0)
    messages = sorted((_shift(m, -origin) for m in messages),
                      key=lambda m: (m.start_us, m.device))
    ticks = _ticks([(p, d, t - origin, a) for p, d, t, a in marks], messages)
    span = max([*(m.end_us for m in messages), *(t.end_us for t in ticks)], default=0.0)
    infos.sort(key=lambda p: p.process)
    return Timeline(messages, infos, span, ticks)


def _ticks(marks: list[tuple[int, int, float, dict]], messages: list[Message]) -> list[Tick]:
    """Each device's marks in time order: a tick runs from its mark to the device's next
    (the last of a step is an ``end`` mark, which starts nothing)."""
    by_device: dict[int, list[tuple[int, float, dict]]] = {}
    for process, device, time, args in marks:
        by_device.setdefault(device, []).append((process, time, args))
    ops: dict[int, list[Message]] = {}
    for m in messages:  # sorted by start
        ops.setdefault(m.device, []).append(m)
    ticks = []
    for device, items in sorted(by_device.items()):
        items.sort(key=lambda item: item[1])
        mine = ops.get(device, [])
        starts = [m.start_us for m in mine]
        longest = max((m.dur_us for m in mine), default=0.0)
        step = -1
        for (process, start, args), (_, end, _) in itertools.pairwise(items):
            action = ACTION_NAMES.get(int(args["action"]), "idle")
            if action == "end":
                continue
            step += int(args["tick"]) == 0  # each run of the pipeline starts at tick 0
            # Only ops that start within the longest op's time before the tick can reach
            # into it: a long recording holds many steps' messages per device.
            near = mine[bisect.bisect_left(starts, start - longest):
                        bisect.bisect_left(starts, end)]
            inside = sum(min(m.end_us, end) - max(m.start_us, start)
                         for m in near if m.end_us > start)
            ticks.append(Tick(process, device, int(args["tick"]), action,
                              int(args["microbatch"]), int(args["virtual_stage"]), start, end,
                              inside, max(step, 0)))
    # Virtual stages per (device, step): those its ticks name (for the labels).
    count: dict[tuple[int, int], int] = {}
    for t in ticks:
        key = (t.device, t.step)
        count[key] = max(count.get(key, 1), t.virtual_stage + 1)
    return [dataclasses.replace(t, virtual_stages=count[(t.device, t.step)]) for t in ticks]


def _shift(m: Message, by_us: float) -> Message:
    return Message(**{**asdict(m), "start_us": m.start_us + by_us})


def summarize(timeline: Timeline) -> dict[int, DeviceSummary]:
    """Per device: messages, bytes, time in psend / precv / waiting, over the timeline."""
    out: dict[int, DeviceSummary] = {}
    for m in timeline.messages:
        s = out.setdefault(m.device, DeviceSummary(m.device, m.process,
                                                   span_us=timeline.span_us))
        if m.op == "psend":
            s.sent += 1
            s.bytes_sent += m.bytes
            s.send_us += m.dur_us
        else:
            s.received += 1
            s.bytes_received += m.bytes
            s.recv_us += m.dur_us
        s.wait_us += m.wait_us
        s.by_path[m.path] = s.by_path.get(m.path, 0) + 1
    return dict(sorted(out.items()))


def bubble_fraction(timeline: Timeline) -> float:
    """Mean over devices of the share of the timeline spent blocked on a peer."""
    summary = summarize(timeline)
    if not summary:
        return 0.0
    return sum(s.wait_fraction for s in summary.values()) / len(summary)


def idle_fraction(timeline: Timeline) -> float:
    """:meth:`Timeline.idle_fraction`."""
    steps: dict[int, list[Tick]] = {}
    for t in timeline.ticks:
        steps.setdefault(t.step, []).append(t)
    shares = []
    for ticks in steps.values():
        span = max(t.end_us for t in ticks) - min(t.start_us for t in ticks)
        busy = sum(t.compute_us for t in ticks if t.action != "idle")
        if span > 0:
            shares.append(1.0 - busy / (len({t.device for t in ticks}) * span))
    return sum(shares) / len(shares) if shares else 0.0


def write_json(timeline: Timeline, path: str | os.PathLike[str]) -> Path:
    """Write the merged timeline as a Chrome trace; returns its path."""
    path = Path(path)
    path.write_text(json.dumps(timeline.chrome_trace(), separators=(",", ":")))
    return path


#: Colours of the picture, by kind (colour-blind-safe Okabe-Ito hues).
COLOURS = {"outside": "#BBBBBB", "psend": "#0072B2", "precv": "#009E73", "wait": "#D55E00",
           "F": "#56B4E9", "B": "#E69F00", "W": "#CC79A7"}


def draw(timeline: Timeline, path: str | os.PathLike[str], title: str | None = None) -> Path:
    """Draw ``timeline`` into a PNG: one row per device, psend / precv / waits coloured by
    kind, and in grey the time between two of a device's messages, outside psend/precv
    (where a pipeline stage computes; between recorded steps, the host's time too). Where
    a pipeline marked its ticks, each action (F, B, W, with its microbatch) in its colour
    instead of the grey. Raises ImportError naming the package when matplotlib is
    missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError("drawing timeline.png needs matplotlib: pip install matplotlib "
                          "(timeline.json and the summary do not)") from e
    devices = timeline.devices
    row = {d: i for i, d in enumerate(devices)}
    scale, unit = (1e3, "ms") if timeline.span_us >= 2e3 else (1.0, "us")
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.45 * max(1, len(devices))), dpi=100)
    bars: dict[str, list[tuple[int, tuple[float, float]]]] = {k: [] for k in COLOURS}
    # Every op at least about a pixel wide: a psend that hands its bytes over at once is
    # shorter than a pixel of a pipeline step, but still a message to see.
    least = timeline.span_us / scale / 1500
    last_end: dict[int, float] = {}
    marked = {t.device for t in timeline.ticks}
    labels = []
    for t in timeline.ticks:
        if t.action in ("F", "B", "W"):
            bars[t.action].append((row[t.device], (t.start_us / scale, t.compute_us / scale)))
            if t.compute_us > timeline.span_us / 60:  # room for the label
                labels.append((row[t.device], (t.start_us + t.compute_us / 2) / scale,
                               t.label))
    for m in sorted(timeline.messages, key=lambda m: m.start_us):
        if m.device in marked:
            continue
        if m.device in last_end and m.start_us > last_end[m.device]:
            bars["outside"].append((row[m.device], (last_end[m.device] / scale,
                                                   (m.start_us - last_end[m.device]) / scale)))
        last_end[m.device] = max(last_end.get(m.device, 0.0), m.end_us)
    for m in timeline.messages:
        y = row[m.device]
        bars[m.op].append((y, (m.start_us / scale, max(m.dur_us / scale, least))))
        if m.wait_us > 0:
            start = m.start_us if m.op == "precv" else m.end_us - m.wait_us
            bars["wait"].append((y, (start / scale, m.wait_us / scale)))
    for kind, items in bars.items():
        height = 0.36 if kind == "wait" else 0.8
        by_row: dict[int, list[tuple[float, float]]] = {}
        for y, span in items:
            by_row.setdefault(y, []).append(span)
        for y, spans in by_row.items():
            ax.broken_barh(spans, (y - height / 2, height), facecolors=COLOURS[kind],
                           linewidth=0)
    for y, x, text in labels:
        ax.text(x, y, text, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(devices)))
    ax.set_yticklabels([f"device {d}" for d in devices])
    ax.set_ylim(len(devices) - 0.5, -0.5)  # device 0 on top
    ax.set_xlim(0, max(timeline.span_us / scale, 1e-9))
    ax.set_xlabel(f"time ({unit})")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title or f"psend/precv timeline: {len(timeline.messages)} messages, "
                 f"{len(timeline.processes)} process(es), {len(devices)} device(s)")
    handles = [Patch(color=COLOURS["outside"], label="between messages (computing)")] \
        if set(devices) - marked else []
    handles += [Patch(color=COLOURS[k], label=name) for k, name in (
        ("F", "forward"), ("B", "backward"), ("W", "weight gradient"))
        if any(t.action == k for t in timeline.ticks)]
    handles += [Patch(color=COLOURS["psend"], label="psend"),
                Patch(color=COLOURS["precv"], label="precv"),
                Patch(color=COLOURS["wait"], label="waiting on the peer")]
    ax.legend(handles=handles,
              loc="upper center", bbox_to_anchor=(0.5, -0.2 - 0.3 / max(1, len(devices))),
              ncol=min(len(handles), 6), frameon=False)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def format_summary(timeline: Timeline) -> str:
    """The per-device table ``trace DIR`` prints."""
    lines = [f"{len(timeline.messages)} messages from {len(timeline.processes)} process(es) "
             f"over {timeline.span_us / 1e3:.3f} ms"]
    if timeline.dropped:
        lines.append(f"WARNING: {timeline.dropped} event(s) were dropped (full buffers): "
                     "raise JAX_CPU_MPI_TRACE_EVENTS or call trace_flush() more often")
    unsynced = [p for p in timeline.processes if not p.clock_synced and len(timeline.processes) > 1]
    if unsynced:
        lines.append("WARNING: process(es) " + ", ".join(str(p.process) for p in unsynced)
                     + " had no measured clock offset: their times are not aligned")
    if timeline.ticks:
        steps = len({t.step for t in timeline.ticks})
        ticks = len(timeline.ticks) // max(1, steps * len({t.device for t in timeline.ticks}))
        lines.append(f"pipeline: {steps} step(s) of {ticks} ticks per device; no action "
                     f"running {100 * idle_fraction(timeline):.1f} % of a step on average "
                     "(the bubble as the schedule's table counts it)")
    header = ("device", "process", "sent", "recvd", "bytes sent", "bytes recvd",
              "send ms", "recv ms", "wait ms", "wait %", "paths")
    rows = [header]
    for s in summarize(timeline).values():
        rows.append((str(s.device), str(s.process), str(s.sent), str(s.received),
                     str(s.bytes_sent), str(s.bytes_received), f"{s.send_us / 1e3:.3f}",
                     f"{s.recv_us / 1e3:.3f}", f"{s.wait_us / 1e3:.3f}",
                     f"{100 * s.wait_fraction:.1f}",
                     " ".join(f"{k}={v}" for k, v in sorted(s.by_path.items()))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        lines.append("  ".join(c.rjust(w) if i < len(r) - 1 else c
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    return "\n".join(lines)


def run(directory: str, *, picture: bool = True, as_json: bool = False) -> int:
    """``trace DIR``: merge, write timeline.json (and timeline.png), print the summary."""
    try:
        timeline = merge(directory)
    except TraceError as e:
        print(f"jax-cpu-mpi trace: {e}", file=sys.stderr)
        return 1
    written = [write_json(timeline, Path(directory) / TIMELINE_JSON)]
    note = None
    if picture:
        try:
            written.append(draw(timeline, Path(directory) / TIMELINE_PNG))
        except ImportError as e:
            note = f"no {TIMELINE_PNG}: {e}"
    if as_json:
        print(json.dumps({"files": [str(p) for p in written], "span_us": timeline.span_us,
                          "dropped": timeline.dropped, "bubble_fraction": bubble_fraction(timeline),
                          "idle_fraction": idle_fraction(timeline),
                          "devices": [{**asdict(s), "wait_fraction": s.wait_fraction}
                                      for s in summarize(timeline).values()]}))
    else:
        print(format_summary(timeline))
        print("wrote " + ", ".join(str(p) for p in written))
    if note:
        print(f"jax-cpu-mpi trace: {note}", file=sys.stderr)
    return 0
