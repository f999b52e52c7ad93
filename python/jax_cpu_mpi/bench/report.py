"""Output formats: OSU-style and nccl-tests-style tables, JSON lines.

* OSU (``osu_latency`` / ``osu_bw`` with ``-f`` and ``-c``): ``# Size  Latency (us)`` or
  ``# Size  Bandwidth (MB/s)``, then min/max/p99, the sample count and the Validation column.
  MB/s is 10^6 bytes per second, as OSU prints it.
* Two-way patterns (:mod:`.patterns`): ``exchange`` and ``ring`` as a time per step (the
  latency layout), ``bibw`` (``osu_bibw``) and ``multi-pair`` (``osu_mbw_mr``, with its
  message rate) in the bandwidth layout.
* nccl-tests (``sendrecv_perf``): ``size count type redop root time algbw busbw #wrong``;
  ``time`` is the median per message (one way) in microseconds, ``algbw = size / time`` in
  GB/s (10^9 bytes per second); for point to point ``busbw = algbw``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, TextIO

import numpy as np

from .stats import Measurement


def _groups(results: Iterable[Measurement]) -> list[tuple[str, str, list[Measurement]]]:
    """(method, kind, measurements by size) in run order."""
    groups: dict[tuple[str, str], list[Measurement]] = {}
    for m in results:
        groups.setdefault((m.method, m.kind), []).append(m)
    return [(method, kind, sorted(ms, key=lambda m: m.size))
            for (method, kind), ms in groups.items()]


#: Kinds whose OSU table shows a time per step, and their title.
_TIMED = {"latency": "one-way latency", "exchange": "exchange, time per step",
          "ring": "ring, time per step"}
_BANDWIDTH = {"bandwidth": "streaming bandwidth", "bibw": "bidirectional bandwidth",
              "multi-pair": "multi-pair aggregate bandwidth"}


def _title(method: str, kind: str, ms: list[Measurement]) -> str:
    unit = _TIMED.get(kind) or _BANDWIDTH.get(kind, kind)
    if method.startswith("jit-floor"):
        unit = "time per call"
    return f"# {method} ({unit}): {ms[0].description}"


def osu_tables(results: Iterable[Measurement]) -> str:
    lines: list[str] = []
    for method, kind, ms in _groups(results):
        lines.append(_title(method, kind, ms))
        if kind in _TIMED:
            lines.append(f"{'# Size':<12}{'Latency (us)':>16}{'Min Latency (us)':>18}"
                         f"{'Max Latency (us)':>18}{'P99 Latency (us)':>18}"
                         f"{'Iterations':>12}{'Validation':>12}")
            for m in ms:
                s = m.latency_us()
                lines.append(f"{m.size:<12d}{s['median']:>16.2f}{s['min']:>18.2f}"
                             f"{s['max']:>18.2f}{s['p99']:>18.2f}{m.samples:>12d}"
                             f"{'Pass' if m.valid else 'Fail':>12}")
        else:
            lines.append(f"{'# Size':<12}{'Bandwidth (MB/s)':>18}{'Min BW (MB/s)':>16}"
                         f"{'Max BW (MB/s)':>16}{'Window':>8}{'Iterations':>12}"
                         f"{'Validation':>12}")
            for m in ms:
                b = m.bandwidth_mbps()
                # multi-pair runs several windows per sample: the column is one window's.
                window = int(m.extra.get("window", m.messages_per_sample))
                lines.append(f"{m.size:<12d}{b['median']:>18.2f}{b['min']:>16.2f}"
                             f"{b['max']:>16.2f}{window:>8d}{m.samples:>12d}"
                             f"{'Pass' if m.valid else 'Fail':>12}")
            if kind == "multi-pair":  # osu_mbw_mr's second column
                rates = [m.size and 1e6 * m.bandwidth_mbps()['median'] / m.size for m in ms]
                lines.append("# Messages/s: " + "  ".join(
                    f"{m.size}: {rate:.0f}" for m, rate in zip(ms, rates, strict=True)))
        lines.append("")
    return "\n".join(lines)


def nccl_tables(results: Iterable[Measurement]) -> str:
    lines: list[str] = []
    for method, kind, ms in _groups(results):
        lines.append(_title(method, kind, ms))
        lines.append(f"#{'':>59}{'out-of-place':>14}")
        lines.append(f"#{'size':>11}{'count':>13}{'type':>8}{'redop':>8}{'root':>7}"
                     f"{'time':>9}{'algbw':>8}{'busbw':>8}{'#wrong':>8}")
        lines.append(f"#{'(B)':>11}{'(elements)':>13}{'':>8}{'':>8}{'':>7}"
                     f"{'(us)':>9}{'(GB/s)':>8}{'(GB/s)':>8}{'':>8}")
        busbws = []
        for m in ms:
            t = float(np.median(m.seconds))
            algbw = m.size / t / 1e9
            busbws.append(algbw)
            lines.append(f"{m.size:>12d}{m.size:>13d}{'uint8':>8}{'none':>8}{-1:>7d}"
                         f"{t * 1e6:>9.2f}{algbw:>8.2f}{algbw:>8.2f}{m.wrong:>8d}")
        wrong = sum(m.wrong for m in ms)
        lines.append(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
        lines.append(f"# Avg bus bandwidth    : {float(np.mean(busbws)):.4g}")
        lines.append("")
    return "\n".join(lines)


def tables(results: list[Measurement], formats: Iterable[str]) -> str:
    parts = []
    for fmt in formats:
        parts.append(osu_tables(results) if fmt == "osu" else nccl_tables(results))
    return "\n".join(parts)


def write_json_lines(stream: TextIO, header: dict[str, Any], results: list[Measurement],
                     notes: list[str], targets: list[dict[str, Any]]) -> None:
    """One JSON object per line: the run, each result, each note, each target."""
    stream.write(json.dumps(dict(type="run", **header)) + "\n")
    for m in results:
        stream.write(json.dumps(m.to_json()) + "\n")
    for note in notes:
        stream.write(json.dumps(dict(type="note", text=note)) + "\n")
    for target in targets:
        stream.write(json.dumps(dict(type="target", **target)) + "\n")
