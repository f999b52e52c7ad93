"""The project's speed goals, as ratios measured in one run (reported, never asserted).

* per-hop latency at 8 B inside a scan <= raw MPI latency + 2 us, and no worse than mpi4jax;
* bandwidth at 16 MiB >= 0.8 x raw MPI;
* in one process, device to device at 16 MiB >= 0.8 x memcpy.

Next to them, for information: the cost of one jitted psend+precv round trip against
JAX's per-call floor plus the MPI time, and the gains over ppermute (gloo / in-process).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .stats import Measurement

SMALL = 8
LARGE = 16 << 20


class _Lookup:
    def __init__(self, results: list[Measurement]) -> None:
        self._by_key = {(m.method, m.kind, m.size): m for m in results}

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

    name, goal = "scan hop latency @ 8 B vs mpi4jax", "<= mpi4jax/scan"
    ref = look.latency("mpi4jax/scan", SMALL)
    if ours is None or ref is None:
        out.append(_missing(name, goal, "psend/scan", "mpi4jax/scan", "8 B latency"))
    else:
        out.append(_target(name, goal, "psend/scan", "mpi4jax/scan", ours, ref, ours / ref,
                           ours <= ref, f"{ours:.2f} us vs {ref:.2f} us: x{ours / ref:.2f}"))

    ref_bw = look.bandwidth("mpi4py", LARGE)
    for method in ("psend/scan", "psend/call"):
        name, goal = f"bandwidth @ 16 MiB vs raw MPI ({method})", ">= 0.8 x mpi4py"
        bw = look.bandwidth(method, LARGE)
        if bw is None or ref_bw is None:
            out.append(_missing(name, goal, method, "mpi4py", "16 MiB bandwidth"))
        else:
            out.append(_target(name, goal, method, "mpi4py", bw, ref_bw, bw / ref_bw,
                               bw >= 0.8 * ref_bw,
                               f"{bw:.0f} MB/s vs {ref_bw:.0f} MB/s: x{bw / ref_bw:.2f}"))

    ref_bw = look.bandwidth("memcpy", LARGE)
    for method in ("psend-local/scan", "psend-local/call"):
        name, goal = f"one process @ 16 MiB vs memcpy ({method})", ">= 0.8 x memcpy"
        bw = look.bandwidth(method, LARGE)
        if bw is None or ref_bw is None:
            out.append(_missing(name, goal, method, "memcpy", "16 MiB bandwidth"))
        else:
            out.append(_target(name, goal, method, "memcpy", bw, ref_bw, bw / ref_bw,
                               bw >= 0.8 * ref_bw,
                               f"{bw:.0f} MB/s vs {ref_bw:.0f} MB/s: x{bw / ref_bw:.2f}"))

    out.extend(_information(look))
    return out


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
