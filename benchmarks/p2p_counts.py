"""Where a one-way or two-way message's time goes: counts per message, and the chain of a
message from its psend to the end of its precv, for ``psend/scan`` next to raw MPI.

    mpirun -n 2 -genv GLIBC_TUNABLES glibc.malloc.hugetlb=1 \\
        python benchmarks/p2p_counts.py --sizes 8,64K,1M --rounds 7 --trace /tmp/chain

Patterns (``--kinds``): ``multi-pair`` (osu_mbw_mr's windows, as ``--pattern multi-pair`` of
the benchmark: ``--window`` messages one way, then a 4-byte acknowledgement back,
``--windows`` windows per call), ``hop`` (the ping-pong scan of ``--pattern pingpong``,
``--hops`` one-way hops per call), ``ring`` (``--pattern ring``: every rank sends to the
next and receives from the previous one, ``--hops`` steps per call) and ``exchange``
(``--pattern exchange`` of 2 ranks, as one op and as two, ``psend2/scan``). Each is timed
for ``psend/scan`` and for ``mpi4py`` (windows of ``Isend``/``Irecv``, ``Send``/``Recv``,
``Sendrecv``), the hop also for ``psend-donated/scan`` (receiving into the previous call's
results, donated: no fresh buffers per call), in rounds that run every variant ``--calls``
times in turn after a barrier, so that a loaded machine slows them alike. Every rank prints,
per variant, the median and best time per message over the rounds and, per message (load
changes them much less than times): voluntary and involuntary context switches of the whole
process (``getrusage``: the progress thread's wake-ups, waits that slept, preemptions) and
minor page faults (fresh pages: XLA's per-call outputs), and the transport's own counts from
:func:`jax_cpu_mpi.stats` (rendezvous sends that went direct or staged, yields and sleeps of
the waits). The received bytes of every ``psend`` variant are checked.

With ``--trace DIR`` it then records ``--trace-calls`` calls of each ``psend`` variant
(``jax_cpu_mpi.trace``) and prints, per direction of each channel (rank 0 prints, from the
merged timeline): the median time from a message's psend start to the end of its precv,
how late the receiver came (its precv's start after the psend's start: negative when it
was waiting first), the psend's duration and the paths the messages took. A precv that
only writes zeros (a device that is no destination) has no event: the time between a
device's events holds it.
"""

from __future__ import annotations

import argparse
import resource
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cpu_mpi
from jax_cpu_mpi._src.runtime.config import overrides, parse_bytes
from jax_cpu_mpi.bench import methods, patterns, programs
from jax_cpu_mpi.bench import session as bench_session

#: jax_cpu_mpi.stats() counters reported per message.
STATS = ("mpi_direct_sends", "mpi_staged_large_sends", "wait_yields", "wait_sleeps")

#: name -> (one sample, messages in it, check of its result: wrong bytes, or None)
Variants = dict[str, tuple[Callable[[], Any], int, Callable[[Any], int] | None]]


def _variants(session: Any, args: argparse.Namespace, n: int) -> Variants:
    comm, rank, nranks = session.comm, session.rank, session.nranks
    mesh = patterns._mesh(session)
    me = mesh.devices.reshape(-1)[rank]
    value = programs.pattern(n)
    x = jax.make_array_from_callback((nranks * n,), NamedSharding(mesh, P(programs.AXIS)),
                                     lambda index: value)
    send, recv = value.copy(), np.zeros(n, np.uint8)

    def check(result: Any) -> int:
        return programs.count_wrong(programs.shard_on(result, me), value)

    out: Variants = {}
    kinds = args.kinds.split(",")
    if "multi-pair" in kinds:
        perm = patterns.pairs("multi-pair", nranks)
        dest = [d for s, d in perm if s == rank]
        source = [s for s, d in perm if d == rank]
        with overrides(gpu_parity=False):
            fn = patterns.window_program(mesh, "psend", perm, args.window,
                                         args.windows).lower(x).compile()

        ack = np.zeros(patterns.WINDOW_ACK_BYTES, np.uint8)

        def mpi_windows() -> None:
            patterns.mpi_windows(comm, send, recv, source, dest, args.window, args.windows,
                                 ack)

        messages = args.window * args.windows * max(1, nranks // 2)
        out["multi-pair psend/scan"] = (lambda: jax.block_until_ready(fn(x))[0], messages,
                                        check if source else None)
        out["multi-pair mpi4py"] = (mpi_windows, messages, None)
    if "hop" in kinds and nranks == 2:
        hop = programs.pingpong_scan(mesh, "psend", args.hops)

        round_trip = methods.mpi_round_trip(comm, rank, send, recv)

        def mpi_hops() -> None:
            for _ in range(args.hops // 2):
                round_trip()

        # (z, y): z is what came back to device 0, y what device 1 received.
        out["hop psend/scan"] = (lambda: jax.block_until_ready(hop(x))[rank], args.hops, check)
        out["hop mpi4py"] = (mpi_hops, args.hops, None)
        # The same hops receiving into the previous call's results, donated: no fresh
        # buffers per call (the page faults that XLA's per-call outputs cost).
        donated = programs.pingpong_donated_scan(mesh, "psend", args.hops)
        carries = [x + np.uint8(0), jax.numpy.zeros_like(x)]

        def donated_hops() -> Any:
            carries[:] = jax.block_until_ready(donated(*carries))
            return carries[rank]

        out["hop psend-donated/scan"] = (donated_hops, args.hops, check)
    if "exchange" in kinds and nranks == 2:
        # The two-way step of ``--pattern exchange``: as one op (a cycle) and as two ops,
        # one per direction (psend2: what GPU-parity programs and the pipeline executor
        # write; a device's precv of the other direction only writes zeros).
        perm = patterns.pairs("exchange", nranks)
        with overrides(gpu_parity=False):
            one_op = patterns._scan_program(mesh, "psend", perm, args.hops).lower(x).compile()
            two_ops = patterns._scan_program(mesh, "psend2", perm,
                                             args.hops).lower(x).compile()
        peer = rank ^ 1

        def mpi_exchange() -> None:
            for _ in range(args.hops):
                comm.Sendrecv(send, peer, 6, recv, peer, 6)

        out["exchange psend/scan"] = (lambda: jax.block_until_ready(one_op(x)), args.hops,
                                      check)
        out["exchange psend2/scan"] = (lambda: jax.block_until_ready(two_ops(x)), args.hops,
                                       check)
        out["exchange mpi4py"] = (mpi_exchange, args.hops, None)
    if "ring" in kinds:
        with overrides(gpu_parity=False):
            ring = patterns._scan_program(mesh, "psend", patterns.pairs("ring", nranks),
                                          args.hops).lower(x).compile()
        nxt, prev = (rank + 1) % nranks, (rank - 1) % nranks

        def mpi_ring() -> None:
            for _ in range(args.hops):
                comm.Sendrecv(send, nxt, 5, recv, prev, 5)

        out["ring psend/scan"] = (lambda: jax.block_until_ready(ring(x)), args.hops, check)
        out["ring mpi4py"] = (mpi_ring, args.hops, None)
    return out


def _measure(session: Any, args: argparse.Namespace, n: int, variants: Variants) -> list[str]:
    for run, _, _ in variants.values():
        for _ in range(3):  # compile, warm up
            run()
    times: dict[str, list[float]] = defaultdict(list)
    counts: dict[str, list[dict[str, float]]] = defaultdict(list)
    wrong: dict[str, int] = defaultdict(int)
    for _ in range(args.rounds):
        for name, (run, messages, check) in variants.items():
            session.barrier()
            before, stats_before = resource.getrusage(resource.RUSAGE_SELF), jax_cpu_mpi.stats()
            start = time.perf_counter()
            for _ in range(args.calls):
                result = run()
            times[name].append((time.perf_counter() - start) / args.calls / messages)
            after, stats_after = resource.getrusage(resource.RUSAGE_SELF), jax_cpu_mpi.stats()
            per = float(args.calls * messages)
            c = {"vcs": (after.ru_nvcsw - before.ru_nvcsw) / per,
                 "ivcs": (after.ru_nivcsw - before.ru_nivcsw) / per,
                 "minflt": (after.ru_minflt - before.ru_minflt) / per}
            c.update({k.removeprefix("mpi_"): (stats_after[k] - stats_before[k]) / per
                      for k in STATS})
            counts[name].append(c)
            if check is not None:
                wrong[name] += check(result)
    lines = []
    for name in variants:
        kind, method = name.split()
        if method != "mpi4py" and f"{kind} mpi4py" in variants:
            # The speed against MPI: the median over rounds of the ratio within each round,
            # as the benchmark's targets take it (a change of load moves both sides).
            ratios = [m / t for m, t in zip(times[f"{kind} mpi4py"], times[name], strict=True)]
            lines.append(f"rank {session.rank} {n:>9} B  {kind} {method} speed against "
                         f"mpi4py: x{np.median(ratios):.2f}")
        med = {k: float(np.median([c[k] for c in counts[name]])) for k in counts[name][0]}
        lines.append(f"rank {session.rank} {n:>9} B  {name:22s} "
                     f"{np.median(times[name]) * 1e6:9.2f} us/message "
                     f"(best {np.min(times[name]) * 1e6:8.2f})  "
                     + " ".join(f"{k}={v:.2f}" for k, v in med.items())
                     + (f"  WRONG BYTES {wrong[name]}" if wrong[name] else ""))
    return lines


def _chains(directory: Path) -> list[str]:
    """Per channel (source device -> destination device) of the merged timeline: medians of
    the psend start -> precv end time, the receiver's lateness and the psend's duration."""
    timeline = jax_cpu_mpi.read_timeline(directory)
    sends = {(m.device, m.peer, m.seq): m for m in timeline.messages if m.op == "psend"}
    rows: dict[tuple[int, int, int], dict[str, list[float]]] = defaultdict(
        lambda: defaultdict(list))
    paths: dict[tuple[int, int, int], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in timeline.messages:
        s = sends.get((r.peer, r.device, r.seq))
        if r.op != "precv" or s is None:
            continue
        key = (s.device, r.device, r.bytes)
        rows[key]["psend start -> precv end"].append(r.end_us - s.start_us)
        rows[key]["receiver late by"].append(r.start_us - s.start_us)
        rows[key]["psend"].append(s.dur_us)
        rows[key]["precv"].append(r.dur_us)
        paths[key][f"send {s.path}"] += 1
        paths[key][f"recv {r.path}"] += 1
    lines = []
    for (src, dst, nbytes), row in sorted(rows.items()):
        lines.append(f"  device {src} -> {dst}, {nbytes} B, {len(row['psend'])} messages: "
                     + ", ".join(f"{k} {np.median(v):.2f} us" for k, v in row.items())
                     + "; " + " ".join(f"{k}={v}" for k, v in sorted(paths[(src, dst,
                                                                              nbytes)].items())))
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="8,64K,1M")
    p.add_argument("--kinds", default="multi-pair,hop,ring")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=10, help="samples per variant per round")
    p.add_argument("--window", type=int, default=64, help="multi-pair: messages per window")
    p.add_argument("--windows", type=int, default=4, help="multi-pair: windows per call")
    p.add_argument("--hops", type=int, default=128, help="hop and ring: messages per call")
    p.add_argument("--trace", default=None, help="record the psend variants here too")
    p.add_argument("--trace-calls", type=int, default=3)
    args = p.parse_args()
    session = bench_session.start("cpu", 1)
    for n in (parse_bytes(s) for s in args.sizes.split(",")):
        variants = _variants(session, args, n)
        lines = session.comm.gather("\n".join(_measure(session, args, n, variants)), root=0)
        if session.rank == 0:
            print("\n".join(lines), flush=True)
        if not args.trace:
            continue
        for name, (run, _, _) in variants.items():
            if "mpi4py" in name:
                continue
            kind, method = name.split()
            directory = Path(args.trace) / f"{kind}-{method.replace('/', '-')}-{n}"
            if session.rank == 0:
                directory.mkdir(parents=True, exist_ok=True)
            session.barrier()
            with jax_cpu_mpi.trace(directory):
                for _ in range(args.trace_calls):
                    run()
            session.barrier()
            if session.rank == 0:
                print(f"{name}, {n} B ({directory}):", flush=True)
                print("\n".join(_chains(directory)), flush=True)


if __name__ == "__main__":
    main()
