"""The project's speed goals, as ratios measured in one run (reported, never asserted).

* per-hop latency at 8 B inside a scan below raw MPI's (and <= raw MPI + 2 us), no worse
  than mpi4jax;
* over MPI, the ping-pong hop inside a scan at 1, 4, 16 and 64 MiB, and the window
  bandwidth (osu_bw style) at 1 MiB and more, >= 0.8 x raw MPI (mpi4py);
* in one process, psend-local/scan >= 1.0 x XLA's in-process ppermute at every size, and
  an 8 B hop under 5 us.

Ratios are speed ratios (reference time / our time: for bandwidth, ours / reference). With
``--rounds N`` each ratio is the median over the rounds of the ratio within each round
(the two methods measured minutes apart would see different phases of a shared machine).
Next to them, for information: each method's hop against the floor of a hop (one copy of
the message plus the zero-fill of the device that is no destination, on one core), raw
MPI's 16 MiB hop (the phase of the machine), the cost of one jitted psend+precv round trip
against JAX's per-call floor plus the MPI time, and the gains over ppermute and mpi4jax.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .stats import Measurement

SMALL = 8
LARGE = 16 << 20
PINGPONG_SIZES = (1 << 20, 4 << 20, 16 << 20, 64 << 20)
WINDOW_MIN = 1 << 20
MPI_GOAL = 0.8
LOCAL_GOAL = 1.0
LOCAL_8B_US = 5.0


def _size_text(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


class _Lookup:
    def __init__(self, results: list[Measurement]) -> None:
        self._by_key = {(m.method, m.kind, m.size): m for m in results}

    def get(self, method: str, kind: str, size: int) -> Measurement | None:
        return self._by_key.get((method, kind, size))

    @property
    def results(self) -> list[Measurement]:
        return list(self._by_key.values())

    def sizes(self, method: str, kind: str) -> list[int]:
        return sorted(size for (m, k, size) in self._by_key if m == method and k == kind)

    def speed_ratio(self, ours: str, ref: str, size: int, kind: str,
                    ref_kind: str | None = None) -> tuple[float, int] | None:
        """(reference time / our time, rounds it is the median of), or None if either is
        missing. Per round when both have the same rounds, else from the two medians."""
        a, b = self.get(ours, kind, size), self.get(ref, ref_kind or kind, size)
        if a is None or b is None:
            return None
        ra, rb = a.extra.get("round_medians_us"), b.extra.get("round_medians_us")
        if ra and rb and len(ra) == len(rb):
            return float(np.median(np.asarray(rb) / np.asarray(ra))), len(ra)
        return float(np.median(b.seconds) / np.median(a.seconds)), 1

    def latency(self, method: str, size: int) -> float | None:
        m = self._by_key.get((method, "latency", size))
        return None if m is None else float(np.median(m.seconds)) * 1e6

    def bandwidth(self, method: str, size: int) -> float | None:
        m = self._by_key.get((method, "bandwidth", size))
        return None if m is None else m.bandwidth_mbps()["median"]


def _target(name: str, goal: str, ours: str, ref: str, a: float | None, b: float | None,
            ratio: float | None, met: bool | None, detail: str) -> dict[str, Any]:
    return dict(name=name, goal=goal, method=ours, reference=ref, value=a, reference_value=b,
                ratio=ratio, met=met, detail=detail)


def _missing(name: str, goal: str, ours: str, ref: str, what: str) -> dict[str, Any]:
    return _target(name, goal, ours, ref, None, None, None, None,
                   f"not measured ({what}); run both methods at that size")


def _ratio_target(look: _Lookup, name: str, goal_ratio: float, ours: str, ref: str,
                  size: int, kind: str) -> dict[str, Any] | None:
    got = look.speed_ratio(ours, ref, size, kind)
    if got is None:
        return None
    ratio, rounds = got
    a, b = look.get(ours, kind, size), look.get(ref, kind, size)
    assert a is not None and b is not None
    if kind == "latency":
        va, vb = float(np.median(a.seconds)) * 1e6, float(np.median(b.seconds)) * 1e6
        values = f"{va:.2f} us vs {vb:.2f} us"
    else:
        va, vb = a.bandwidth_mbps()["median"], b.bandwidth_mbps()["median"]
        values = f"{va:.0f} MB/s vs {vb:.0f} MB/s"
    how = f"median of {rounds} per-round ratios" if rounds > 1 else "ratio of medians"
    return _target(name, f">= {goal_ratio} x {ref}", ours, ref, va, vb, ratio,
                   ratio >= goal_ratio, f"{values}: x{ratio:.2f} ({how})")


def evaluate(results: list[Measurement]) -> list[dict[str, Any]]:
    """The targets and the informational ratios, from the results of one run."""
    look = _Lookup(results)
    out: list[dict[str, Any]] = []

    name, goal = "scan hop latency @ 8 B vs raw MPI", "<= mpi4py + 2 us"
    ours, ref = look.latency("psend/scan", SMALL), look.latency("mpi4py", SMALL)
    if ours is None or ref is None:
        out.append(_missing(name, goal, "psend/scan", "mpi4py", "8 B latency"))
    else:
        out.append(_target(name, goal, "psend/scan", "mpi4py", ours, ref, ours / ref,
                           ours <= ref + 2.0,
                           f"{ours:.2f} us vs {ref:.2f} us: {ours - ref:+.2f} us"))
        got = look.speed_ratio("psend/scan", "mpi4py", SMALL, "latency")
        assert got is not None
        out.append(_target("scan hop latency @ 8 B below raw MPI", "< mpi4py", "psend/scan",
                           "mpi4py", ours, ref, got[0], got[0] > 1.0,
                           f"{ours:.2f} us vs {ref:.2f} us: x{got[0]:.2f} faster"
                           if got[0] >= 1 else f"{ours:.2f} us vs {ref:.2f} us: "
                           f"x{1 / got[0]:.2f} slower"))

    name, goal = "scan hop latency @ 8 B vs mpi4jax", "<= mpi4jax/scan"
    ref = look.latency("mpi4jax/scan", SMALL)
    if ours is None or ref is None:
        out.append(_missing(name, goal, "psend/scan", "mpi4jax/scan", "8 B latency"))
    else:
        out.append(_target(name, goal, "psend/scan", "mpi4jax/scan", ours, ref, ours / ref,
                           ours <= ref, f"{ours:.2f} us vs {ref:.2f} us: x{ours / ref:.2f}"))

    for size in PINGPONG_SIZES:
        name = f"ping-pong hop @ {_size_text(size)} vs raw MPI (psend/scan, bandwidth ratio)"
        t = _ratio_target(look, name, MPI_GOAL, "psend/scan", "mpi4py", size, "latency")
        out.append(t or _missing(name, f">= {MPI_GOAL} x mpi4py", "psend/scan", "mpi4py",
                                 f"{_size_text(size)} latency"))
    window_sizes = [s for s in look.sizes("psend/scan", "bandwidth") if s >= WINDOW_MIN]
    for size in window_sizes or [LARGE]:
        name = f"window bandwidth @ {_size_text(size)} vs raw MPI (psend/scan)"
        t = _ratio_target(look, name, MPI_GOAL, "psend/scan", "mpi4py", size, "bandwidth")
        out.append(t or _missing(name, f">= {MPI_GOAL} x mpi4py", "psend/scan", "mpi4py",
                                 f"{_size_text(size)} bandwidth"))

    local = False
    for kind in ("latency", "bandwidth"):
        for size in look.sizes("psend-local/scan", kind):
            what = "hop" if kind == "latency" else "stream bandwidth"
            t = _ratio_target(look, f"one process {what} @ {_size_text(size)}: psend-local/scan "
                              "vs ppermute-local/scan", LOCAL_GOAL, "psend-local/scan",
                              "ppermute-local/scan", size, kind)
            if t is not None:
                out.append(t)
                local = True
    if not local:
        out.append(_missing("one process: psend-local/scan vs ppermute-local/scan",
                            f">= {LOCAL_GOAL} x ppermute-local/scan", "psend-local/scan",
                            "ppermute-local/scan", "both, at the same sizes"))
    hop = look.latency("psend-local/scan", SMALL)
    name, goal = "one process hop latency @ 8 B", f"< {LOCAL_8B_US:g} us"
    if hop is None:
        out.append(_missing(name, goal, "psend-local/scan", "-", "8 B latency"))
    else:
        out.append(_target(name, goal, "psend-local/scan", "-", hop, LOCAL_8B_US,
                           hop / LOCAL_8B_US, hop < LOCAL_8B_US, f"{hop:.2f} us"))

    out.extend(_floors(look))
    out.extend(_information(look))
    return out


def _floors(look: _Lookup) -> list[dict[str, Any]]:
    """Each method's hop (and stream) against the floor of a hop, size by size."""
    info: list[dict[str, Any]] = []
    for method, floor in (("mpi4py", "hop-floor"), ("psend/scan", "hop-floor"),
                          ("psend-local/scan", "hop-floor-local"),
                          ("ppermute-local/scan", "hop-floor-local")):
        if not look.sizes(floor, "latency"):
            floor = "hop-floor" if floor == "hop-floor-local" else "hop-floor-local"
        for kind in ("latency", "bandwidth"):
            parts = []
            for size in look.sizes(method, kind):
                got = look.speed_ratio(method, floor, size, kind, ref_kind="latency")
                if got is not None:
                    parts.append(f"{_size_text(size)} x{got[0]:.2f}")
            if parts:
                what = "hop" if kind == "latency" else "window"
                info.append(_target(f"{method} {what} vs the floor ({floor})", "information",
                                    method, floor, None, None, None, None,
                                    "fraction of the floor's speed: " + ", ".join(parts)))
    phase = look.get("mpi4py", "latency", LARGE)
    if phase is not None:
        rounds = phase.extra.get("round_medians_us") or []
        per_round = ", ".join(f"{us / 1000:.2f}" for us in rounds)
        info.append(_target("phase of the machine: raw MPI 16 MiB hop", "information",
                            "mpi4py", "-", float(np.median(phase.seconds)) * 1e6, None, None,
                            None, f"{np.median(phase.seconds) * 1e3:.2f} ms"
                            + (f" (rounds: {per_round} ms)" if len(rounds) > 1 else "")))
    cores = sorted({ns for m in look.results for ns in m.extra.get("round_core_to_core_ns", [])
                    if ns is not None})
    if cores:
        info.append(_target(
            "phase of the machine: core-to-core round trip", "information", "-", "-",
            float(np.median(cores)), None, None, None,
            f"{np.median(cores):.0f} ns, {cores[0]:.0f} to {cores[-1]:.0f} ns over the rounds "
            "(about 100 ns: the two CPUs share a cache; several times that: the host runs "
            "them apart, and the 8 B and 1 MiB hops slow down)"))
    return info


def _information(look: _Lookup) -> list[dict[str, Any]]:
    info: list[dict[str, Any]] = []
    call, floor, mpi = (look.latency("psend/call", SMALL), look.latency("jit-floor", SMALL),
                        look.latency("mpi4py", SMALL))
    if call is not None and floor is not None and mpi is not None:
        expected = floor + 2 * mpi
        info.append(_target(
            "jitted psend+precv round trip @ 8 B vs JAX floor + MPI", "~ floor + 2 x mpi4py",
            "psend/call", "jit-floor + 2 x mpi4py", 2 * call, expected, 2 * call / expected,
            None, f"round trip {2 * call:.1f} us = floor {floor:.1f} us + 2 x MPI {mpi:.2f} us "
                  f"+ {2 * call - expected:.1f} us"))
    for ours, ref, size, kind in (
        ("psend/call", "mpi4jax/call", SMALL, "latency"),
        ("psend/scan", "gloo/scan", SMALL, "latency"),
        ("psend/call", "gloo/call", SMALL, "latency"),
        ("psend/scan", "gloo/scan", LARGE, "bandwidth"),
        ("psend-local/scan", "ppermute-local/scan", LARGE, "bandwidth"),
    ):
        get = look.latency if kind == "latency" else look.bandwidth
        a, b = get(ours, size), get(ref, size)
        if a is None or b is None:
            continue
        size_text = "8 B" if size == SMALL else "16 MiB"
        if kind == "latency":
            speed = f"{b / a:.1f}x faster" if b >= a else f"{a / b:.1f}x slower"
            detail = f"{a:.2f} us vs {b:.2f} us: {speed}"
        else:
            detail = f"{a:.0f} MB/s vs {b:.0f} MB/s: {a / b:.1f}x"
        info.append(_target(f"{kind} @ {size_text}: {ours} vs {ref}", "information", ours,
                            ref, a, b, a / b, None, detail))
    return info


def summary(targets: list[dict[str, Any]]) -> str:
    lines = ["# Targets (ratios measured in this run; reported, not asserted)"]
    for t in targets:
        status = {True: "MET", False: "MISSED", None: "n/a"}[t["met"]]
        if t["goal"] == "information":
            status = "info"
        lines.append(f"#   [{status:^6}] {t['name']}: {t['detail']} (goal: {t['goal']})")
    return "\n".join(lines) + "\n"
