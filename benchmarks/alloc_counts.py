"""Heap allocations and user-mode instructions per message of ``psend/scan``, per process.

    cc -O2 -shared -fPIC -o /tmp/malloc_count.so benchmarks/malloc_count.c
    mpirun -n 2 -genv LD_PRELOAD /tmp/malloc_count.so \\
        python benchmarks/alloc_counts.py --sizes 8,64K,16M --kinds hop,exchange

For each pattern (``hop``: the one-way hops of ``--pattern pingpong``, a message one way per
hop; ``exchange``: the two-way step of ``--pattern exchange`` as one op; ``mixed``: the hop of
the size, then an 8-byte hop on the same channel, both ways) and size, two
programs that differ only in their number of steps (``--short`` and ``--long``) are each
called ``--calls`` times, and the difference of their counts divided by the difference of
their steps is what one more psend and precv cost a process (both ranks print): what a call
costs whatever its length (JAX's dispatch, XLA's run) cancels out. Allocations are counted by
benchmarks/malloc_count.c (LD_PRELOAD; without it only instructions are counted), the
instructions by ``perf_event_open`` on every thread of the process (user mode only; "n/a"
where the machine exposes no PMU, as a VM may not). The instructions include the polling
waits' (more where the peer is late): each count is the lowest of ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import struct
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_cpu_mpi._src.runtime.config import overrides, parse_bytes
from jax_cpu_mpi.bench import patterns, programs
from jax_cpu_mpi.bench import session as bench_session

_LIBC = ctypes.CDLL(None, use_errno=True)
_SYS_PERF_EVENT_OPEN = 298  # x86_64


def _malloc_counter() -> Callable[[], int] | None:
    try:
        f = _LIBC.jcm_malloc_count
    except AttributeError:
        return None
    f.restype = ctypes.c_uint64
    return lambda: int(f())


class _Instructions:
    """User-mode instructions of every thread of this process (those alive at creation)."""

    def __init__(self) -> None:
        # perf_event_attr, version 0 (64 bytes): type, size, config, then the flags word
        # (bit 5: exclude_kernel, bit 6: exclude_hv).
        attr = struct.pack("IIQQQQQ", 0, 64, 1, 0, 0, 0, (1 << 5) | (1 << 6))
        attr += b"\0" * (64 - len(attr))
        self._buf = ctypes.create_string_buffer(attr, 64)
        self._fds: list[int] = []
        syscall = _LIBC.syscall
        syscall.restype = ctypes.c_long
        for tid in os.listdir("/proc/self/task"):
            fd = syscall(_SYS_PERF_EVENT_OPEN, self._buf, int(tid), -1, -1, 0)
            if fd >= 0:
                self._fds.append(int(fd))

    @property
    def opened(self) -> bool:
        return bool(self._fds)

    def read(self) -> int:
        return sum(struct.unpack("Q", os.read(fd, 8))[0] for fd in self._fds)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)


def _programs(session: Any, kind: str, n: int, steps: int) -> tuple[Callable[[], Any], int]:
    mesh = patterns._mesh(session)
    value = programs.pattern(n)
    x = jax.make_array_from_callback((session.nranks * n,), NamedSharding(mesh, P(programs.AXIS)),
                                     lambda index: value)
    with overrides(gpu_parity=False):
        if kind == "mixed":
            fn = _mixed_scan(mesh, steps)
            # a round trip per two steps: a process sends two messages and receives two in it
            return (lambda: jax.block_until_ready(fn(x))), steps
        if kind == "hop":
            fn = programs.pingpong_scan(mesh, "psend", steps)
            # a round trip per two hops: a process sends one message and receives one
            return (lambda: jax.block_until_ready(fn(x))), steps // 2
        fn = patterns._scan_program(mesh, "psend", patterns.pairs(kind, session.nranks),
                                    steps).lower(x).compile()
    # every step, a process sends one message and receives one
    return (lambda: jax.block_until_ready(fn(x))), steps


def _mixed_scan(mesh: Any, steps: int) -> Callable:
    """Round trips of an ``n``-byte hop followed by an 8-byte hop on the same channel, each way:
    a framed message (from 16 KiB), then a staged one on a channel whose last header lets
    framed payloads go bare, so the staged one goes as a chunk header and its chunk
    (cpp/mpi/framing.h)."""

    def hops(z, perm):
        y = programs._hop("psend", z, perm)
        small = programs._hop("psend", y[:8], perm)
        return y.at[:8].set(small)

    def body(x):
        def round_trip(z):
            y = hops(z, programs.FORWARD)
            return hops(y, programs.BACKWARD), y

        first = round_trip(x)
        (z, y), _ = jax.lax.scan(lambda carry, _: (round_trip(carry[0]), None), first, None,
                                 length=max(steps // 2 - 1, 1))
        return z, y

    return programs._spmd(mesh, body, 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="8,64K,16M")
    p.add_argument("--kinds", default="hop,exchange")
    p.add_argument("--short", type=int, default=32)
    p.add_argument("--long", type=int, default=160)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    session = bench_session.start("cpu", 1)
    mallocs = _malloc_counter()
    lines = []
    for kind in args.kinds.split(","):
        for n in (parse_bytes(s) for s in args.sizes.split(",")):
            runs = [_programs(session, kind, n, s) for s in (args.short, args.long)]
            for run, _ in runs:  # compile, warm the pools and the threads
                for _ in range(3):
                    run()
            session.barrier()
            counter = _Instructions()
            best: dict[str, float] = {}
            for _ in range(args.rounds):
                got = []
                for run, _ in runs:
                    session.barrier()
                    m0, i0 = (mallocs() if mallocs else 0), counter.read()
                    for _ in range(args.calls):
                        run()
                    got.append(((mallocs() if mallocs else 0) - m0, counter.read() - i0))
                pairs = args.calls * (runs[1][1] - runs[0][1])  # a psend and a precv each
                per = {"allocs": (got[1][0] - got[0][0]) / pairs,
                       "instr": (got[1][1] - got[0][1]) / pairs}
                for k, v in per.items():
                    best[k] = min(best.get(k, v), v)
            counter.close()
            allocs = f"{best['allocs']:.2f}" if mallocs else "n/a"
            instr = f"{best['instr']:.0f}" if counter.opened else "n/a (no PMU)"
            lines.append(f"rank {session.rank} {kind} {n} B: per psend + precv: "
                         f"allocations {allocs}, instructions {instr}")
    gathered = session.comm.gather("\n".join(lines), root=0)
    if session.rank == 0:
        print("\n".join(gathered), flush=True)


if __name__ == "__main__":
    main()
