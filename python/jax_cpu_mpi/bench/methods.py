"""One function per benchmark method: ``method(ctx) -> Measurement``.

``ctx.kind`` says what to measure:

* ``latency``: a ping-pong; the sample is half a round trip (OSU's ``osu_latency``), or,
  for ``/scan`` methods, one hop of a scan of ``plan.hops`` hops (call time / hops);
* ``bandwidth``: a window of ``plan.window`` one-way messages, then an acknowledgement back;
  the sample is the window's time / ``plan.window`` (OSU's ``osu_bw``).

Cross-process methods run on every rank in lockstep; the samples of rank 0 are reported and
the wrong-byte counts of all ranks are summed by the runner. Only rank 0 runs the in-process
(``-local``) methods.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_cpu_mpi import _jax_cpu_mpi as ext
from jax_cpu_mpi import config

from . import programs
from .options import Plan
from .programs import ACK_BYTES, count_wrong, pattern, shard_on
from .session import Session
from .stats import Measurement


@dataclass(frozen=True)
class Context:
    """What one method call measures."""

    session: Session
    plan: Plan
    kind: str  # "latency" | "bandwidth"


def _timed(step: Callable[[], None], count: int, warmup: int,
           sync: Callable[[], None]) -> np.ndarray:
    """Runs ``step`` ``warmup`` times, meets the other ranks, then times ``count`` steps."""
    for _ in range(warmup):
        step()
    sync()
    seconds = np.empty(count)
    clock = time.perf_counter
    for i in range(count):
        start = clock()
        step()
        seconds[i] = clock() - start
    return seconds


#: Calls in flight at once in the in-process per-call bandwidth test (must stay < 32).
_LOCAL_INFLIGHT = int(os.environ.get("JAX_CPU_MPI_BENCH_LOCAL_INFLIGHT", "8"))


def _no_sync() -> None:
    return None


def _measurement(ctx: Context, method: str, seconds: np.ndarray, warmup: int, messages: int,
                 wrong: int, mode: str, description: str, **extra: Any) -> Measurement:
    return Measurement(method=method, kind=ctx.kind, size=ctx.plan.size, seconds=seconds,
                       warmup=warmup, messages_per_sample=messages, wrong=wrong, mode=mode,
                       description=description, extra=extra)


# --------------------------------------------------------------------------- JAX, SPMD


def _jax_p2p(ctx: Context, method: str, pair: tuple[Any, Any], transport: str, scan: bool,
             mode: str, description: str) -> Measurement:
    """psend/precv or ppermute between the two devices of ``pair`` (see :mod:`.programs`)."""
    plan, n = ctx.plan, ctx.plan.size
    mesh = programs.mesh_of(pair)
    x = programs.sharded_pattern(mesh, n)
    sync = _no_sync if mode == "local" else ctx.session.barrier
    expected, expected_ack = pattern(n), pattern(n)[:ACK_BYTES]
    outputs: list[Any] = []

    if ctx.kind == "latency":
        if scan:
            fn = programs.pingpong_scan(mesh, transport, plan.hops)
            count, per_sample, warmup = plan.scan_samples, plan.hops, plan.scan_warmup
        else:
            fn = programs.pingpong(mesh, transport)
            count, per_sample, warmup = plan.iters, 2, plan.warmup

        def step() -> None:
            outputs[:] = [jax.block_until_ready(fn(x))]

        seconds = _timed(step, count, warmup, sync) / per_sample
        z, y = outputs[0]
        wrong = count_wrong(shard_on(z, pair[0]), expected) + count_wrong(
            shard_on(y, pair[1]), expected)
        return _measurement(ctx, method, seconds, warmup, per_sample, wrong, mode,
                            description, hops_per_call=per_sample if scan else None)

    # A scan sends as many messages per call as its ping-pong (the call's own cost fades);
    # one call per message keeps OSU's window.
    window = plan.hops if scan else plan.window
    if scan:
        stream = programs.stream_scan(mesh, transport, window)

        def step() -> None:
            outputs[:] = list(jax.block_until_ready(stream(x)))
    else:
        one, back = programs.one_way(mesh, transport), programs.ack(mesh, transport)

        # Calls run asynchronously. Between two devices of one process, more than 32 calls
        # in flight (XLA's per-device limit of running computations) deadlock: precvs
        # blocked in device threads hold every slot while the launch of their psends
        # waits behind them (see benchmarks/README.md). Bound them.
        inflight = _LOCAL_INFLIGHT if mode == "local" else window

        def step() -> None:
            ys: list[Any] = []
            for i in range(window):
                if i >= inflight:
                    jax.block_until_ready(ys[i - inflight])
                ys.append(one(x))
            acknowledgement = back(ys[-1])
            # Every call, not only the last: no message of this window may still be in
            # flight when the next measurement starts.
            jax.block_until_ready(ys)
            outputs[:] = [ys[-1], jax.block_until_ready(acknowledgement)]

    seconds = _timed(step, plan.window_samples, plan.window_warmup, sync) / window
    y, acknowledgement = outputs
    wrong = count_wrong(shard_on(y, pair[1]), expected) + count_wrong(
        shard_on(acknowledgement, pair[0]), expected_ack)
    return _measurement(ctx, method, seconds, plan.window_warmup, window, wrong, mode,
                        description, window=window)


def _jit_floor(ctx: Context, method: str, pair: tuple[Any, Any], mode: str) -> Measurement:
    plan, n = ctx.plan, ctx.plan.size
    mesh = programs.mesh_of(pair)
    x = programs.sharded_pattern(mesh, n)
    fn = programs.floor(mesh)
    outputs: list[Any] = []

    def step() -> None:
        outputs[:] = [jax.block_until_ready(fn(x))]

    sync = _no_sync if mode == "local" else ctx.session.barrier
    seconds = _timed(step, plan.iters, plan.warmup, sync)
    expected = pattern(n) + np.uint8(1)
    wrong = sum(count_wrong(shard_on(outputs[0], d), expected) for d in pair)
    return _measurement(ctx, method, seconds, plan.warmup, 0, wrong, mode,
                        "jitted call on the same two devices that writes a fresh output of "
                        "the message size (x + 1), no communication: JAX's per-call floor")


def psend_donated_scan(ctx: Context) -> Measurement:
    """The ping-pong scan of ``psend/scan`` receiving into the buffers of the previous call's
    results, donated back (:func:`.programs.pingpong_donated_scan`): warm memory at every
    call, as the MPI baseline's one receive buffer, where ``psend/scan`` receives into XLA's
    fresh per-call outputs (at 64 MiB fresh pages from the kernel at every call)."""
    plan, n, pair = ctx.plan, ctx.plan.size, ctx.session.pair
    mesh = programs.mesh_of(pair)
    x = programs.sharded_pattern(mesh, n)
    fn = programs.pingpong_donated_scan(mesh, "psend", plan.hops)
    copy = jax.jit(lambda v: v + np.uint8(0), out_shardings=x.sharding)
    zeros = jax.jit(jnp.zeros_like, out_shardings=x.sharding)

    def start() -> list[Any]:
        """Fresh carries: the message on the first device (a copy: the call donates it)."""
        return [jax.block_until_ready(copy(x)), jax.block_until_ready(zeros(x))]

    state = start()

    def step() -> None:
        state[:] = list(jax.block_until_ready(fn(*state)))

    per_sample = 2 * max(1, plan.hops // 2)
    seconds = _timed(step, plan.scan_samples, plan.scan_warmup, ctx.session.barrier)
    seconds /= per_sample
    # Checked on a call from zeros: the timed calls' buffers held the pattern already, where
    # a hop that did not happen would go unseen (the first device's z starts with it, so only
    # the receiver's y tells).
    state[:] = start()
    step()
    wrong = count_wrong(shard_on(state[1], pair[1]), pattern(n))
    return _measurement(ctx, "psend-donated/scan", seconds, plan.scan_warmup, per_sample,
                        wrong, "mpi", "jax_cpu_mpi psend/precv over MPI, hops inside one "
                        "jitted lax.scan receiving into the previous call's results, donated "
                        "(warm memory, as MPI's receive buffer)", hops_per_call=per_sample)


def psend_call(ctx: Context) -> Measurement:
    return _jax_p2p(ctx, "psend/call", ctx.session.pair, "psend", False, "mpi",
                    "jax_cpu_mpi psend/precv over MPI, one jitted call per round trip "
                    "(latency) or per message (bandwidth)")


def psend_scan(ctx: Context) -> Measurement:
    return _jax_p2p(ctx, "psend/scan", ctx.session.pair, "psend", True, "mpi",
                    "jax_cpu_mpi psend/precv over MPI, hops inside one jitted lax.scan")


def gloo_call(ctx: Context) -> Measurement:
    # ppermute across processes would otherwise take our psend/precv (JAX_CPU_MPI_COLLECTIVES).
    with config.overrides(collectives="gloo"):
        return _jax_p2p(ctx, "gloo/call", ctx.session.pair, "ppermute", False, "mpi",
                        "jax.lax.ppermute across processes (XLA CPU collectives over gloo), "
                        "one jitted call per round trip / message")


def gloo_scan(ctx: Context) -> Measurement:
    with config.overrides(collectives="gloo"):
        return _jax_p2p(ctx, "gloo/scan", ctx.session.pair, "ppermute", True, "mpi",
                        "jax.lax.ppermute over gloo, hops inside one jitted lax.scan")


def jit_floor(ctx: Context) -> Measurement:
    return _jit_floor(ctx, "jit-floor", ctx.session.pair, "mpi")


def psend_local_call(ctx: Context) -> Measurement:
    return _jax_p2p(ctx, "psend-local/call", ctx.session.local_pair, "psend", False, "local",
                    "jax_cpu_mpi psend/precv between two devices of one process, one "
                    "jitted call per round trip / message")


def psend_local_scan(ctx: Context) -> Measurement:
    return _jax_p2p(ctx, "psend-local/scan", ctx.session.local_pair, "psend", True, "local",
                    "jax_cpu_mpi psend/precv between two devices of one process, hops "
                    "inside one jitted lax.scan")


def ppermute_local_call(ctx: Context) -> Measurement:
    return _jax_p2p(ctx, "ppermute-local/call", ctx.session.local_pair, "ppermute", False,
                    "local", "jax.lax.ppermute between two devices of one process (XLA's "
                    "in-process collectives), one jitted call per round trip / message")


def ppermute_local_scan(ctx: Context) -> Measurement:
    return _jax_p2p(ctx, "ppermute-local/scan", ctx.session.local_pair, "ppermute", True,
                    "local", "jax.lax.ppermute between two devices of one process, hops "
                    "inside one jitted lax.scan")


def jit_floor_local(ctx: Context) -> Measurement:
    return _jit_floor(ctx, "jit-floor-local", ctx.session.local_pair, "local")


def psend_nccl_call(ctx: Context) -> Measurement:
    return _jax_p2p(ctx, "psend-nccl/call", ctx.session.pair, "psend", False, "gpu",
                    "jax_cpu_mpi.psend/precv on GPUs (JAX's NCCL lowering), one jitted call per "
                    "round trip / message")


def psend_nccl_scan(ctx: Context) -> Measurement:
    return _jax_p2p(ctx, "psend-nccl/scan", ctx.session.pair, "psend", True, "gpu",
                    "jax_cpu_mpi.psend/precv on GPUs (NCCL), hops inside one jitted lax.scan")


def ppermute_nccl_call(ctx: Context) -> Measurement:
    return _jax_p2p(ctx, "ppermute-nccl/call", ctx.session.pair, "ppermute", False, "gpu",
                    "jax.lax.ppermute on GPUs (NCCL), one jitted call per round trip / message")


def ppermute_nccl_scan(ctx: Context) -> Measurement:
    return _jax_p2p(ctx, "ppermute-nccl/scan", ctx.session.pair, "ppermute", True, "gpu",
                    "jax.lax.ppermute on GPUs (NCCL), hops inside one jitted lax.scan")


def jit_floor_gpu(ctx: Context) -> Measurement:
    return _jit_floor(ctx, "jit-floor-gpu", ctx.session.pair, "gpu")


# --------------------------------------------------------------------------- raw MPI, numpy


def mpi_round_trip(comm: Any, rank: int, send: np.ndarray, recv: np.ndarray
                   ) -> Callable[[], None]:
    """One round trip of raw MPI between ranks 0 and 1 of ``comm``: rank 0 sends ``send``
    and receives into ``recv``; rank 1 receives into ``recv`` and sends it back."""
    peer = 1 - rank
    if rank == 0:
        def step() -> None:
            comm.Send(send, peer, 1)
            comm.Recv(recv, peer, 1)
    else:
        def step() -> None:
            comm.Recv(recv, peer, 1)
            comm.Send(recv, peer, 1)
    return step


def mpi4py_p2p(ctx: Context) -> Measurement:
    """mpi4py Send/Recv on numpy buffers: ping-pong, or a window of Isend + acknowledgement."""
    session, plan, n = ctx.session, ctx.plan, ctx.plan.size
    comm = session.pair_comm
    rank = session.rank
    send = pattern(n)
    recv = np.zeros(n, np.uint8)
    ack = np.zeros(ACK_BYTES, np.uint8)
    peer = 1 - rank

    if ctx.kind == "latency":
        step = mpi_round_trip(comm, rank, send, recv)
        seconds = _timed(step, plan.iters, plan.warmup, session.barrier) / 2
        return _measurement(ctx, "mpi4py", seconds, plan.warmup, 2, count_wrong(recv, send),
                            "mpi", "mpi4py comm.Send/comm.Recv of numpy buffers "
                            "(the MPI library's limit, plus mpi4py's call overhead)")

    window = plan.window
    if rank == 0:
        def step() -> None:
            from mpi4py import MPI

            MPI.Request.Waitall([comm.Isend(send, peer, 2) for _ in range(window)])
            comm.Recv(ack, peer, 3)
    else:
        def step() -> None:
            from mpi4py import MPI

            MPI.Request.Waitall([comm.Irecv(recv, peer, 2) for _ in range(window)])
            comm.Send(recv[:ACK_BYTES], peer, 3)
    warmup = plan.window_warmup
    seconds = _timed(step, plan.window_samples, warmup, session.barrier) / window
    got = ack if rank == 0 else recv
    expected = send[:ACK_BYTES] if rank == 0 else send
    return _measurement(ctx, "mpi4py", seconds, warmup, window, count_wrong(got, expected),
                        "mpi", "mpi4py window of comm.Isend/comm.Irecv, then an "
                        "acknowledgement (OSU osu_bw)", window=window)


# --------------------------------------------------------------------------- mpi4jax


def mpi4jax_available() -> str | None:
    """None if mpi4jax imports, else why not."""
    try:
        import mpi4jax  # noqa: F401
    except Exception as e:  # ImportError, or its own checks failing
        return f"{type(e).__name__}: {e}"
    return None


def _mpi4jax_programs(ctx: Context, scan: bool) -> tuple[Callable, Callable | None]:
    """The per-rank jitted functions (rank 0 and rank 1 run different programs)."""
    import mpi4jax
    from mpi4py import MPI

    comm = ctx.session.pair_comm
    rank, plan = ctx.session.rank, ctx.plan
    peer = 1 - rank
    null = MPI.PROC_NULL

    # mpi4jax.sendrecv with MPI_PROC_NULL on one side is a plain send or a plain receive.
    def send(v: Any, dest: int = peer, tag: int = 4) -> Any:
        return mpi4jax.sendrecv(v, v, source=null, dest=dest, sendtag=tag, comm=comm)

    def recv(v: Any, source: int = peer, tag: int = 4) -> Any:
        return mpi4jax.sendrecv(v, v, source=source, dest=null, recvtag=tag, comm=comm)

    if ctx.kind == "latency":
        def round_trip(c):
            if rank == 0:
                send(c)
                return recv(c)
            c = recv(c)
            send(c)
            return c

        if not scan:
            return jax.jit(round_trip), None

        def loop(c):
            return jax.lax.scan(lambda c, _: (round_trip(c), None), c, None,
                                length=plan.hops // 2)[0]

        return jax.jit(loop), None

    ack_send = lambda v: send(v[:ACK_BYTES], 0, 5)  # noqa: E731
    ack_recv = lambda v: recv(v[:ACK_BYTES], 1, 5)  # noqa: E731
    if scan:
        if rank == 0:
            def stream(x):
                def body(c, _):
                    send(x)
                    return c, None
                jax.lax.scan(body, 0, None, length=plan.window)
                return ack_recv(x)
        else:
            def stream(x):
                c = jax.lax.scan(lambda c, _: (recv(c), None), x, None, length=plan.window)[0]
                ack_send(c)
                return c
        return jax.jit(stream), None
    if rank == 0:
        def one(x):
            send(x)
            return x[:1]
        return jax.jit(one), jax.jit(ack_recv)

    def back(y):
        ack_send(y)
        return y[:1]
    return jax.jit(recv), jax.jit(back)


def _mpi4jax(ctx: Context, method: str, scan: bool) -> Measurement:
    session, plan, n = ctx.session, ctx.plan, ctx.plan.size
    device = session.pair[session.rank]
    x = jax.device_put(pattern(n), device)
    fn, back = _mpi4jax_programs(ctx, scan)
    expected = pattern(n)
    out: list[Any] = []
    how = "hops inside one jitted lax.scan" if scan else "one jitted call per round trip / message"
    description = (f"mpi4jax.sendrecv (MPI_PROC_NULL on the idle side: a send, or a receive), "
                   f"{how}")

    if ctx.kind == "latency":
        def step() -> None:
            out[:] = [jax.block_until_ready(fn(x))]
        per_sample = plan.hops if scan else 2
        count = plan.scan_samples if scan else plan.iters
        warmup = plan.scan_warmup if scan else plan.warmup
        seconds = _timed(step, count, warmup, session.barrier) / per_sample
        wrong = count_wrong(np.asarray(out[0]), expected)
        return _measurement(ctx, method, seconds, warmup, per_sample, wrong, "mpi",
                            description, hops_per_call=per_sample if scan else None)

    window = plan.window
    if scan:
        def step() -> None:
            out[:] = [jax.block_until_ready(fn(x))]
    else:
        def step() -> None:
            ys = [fn(x) for _ in range(window)]
            acknowledgement = back(x if session.rank == 0 else ys[-1])
            jax.block_until_ready(ys)
            out[:] = [jax.block_until_ready(acknowledgement), ys[-1]]
    warmup = plan.window_warmup
    seconds = _timed(step, plan.window_samples, warmup, session.barrier) / window
    if session.rank == 0:
        wrong = count_wrong(np.asarray(out[0]), expected[:ACK_BYTES])
    else:
        wrong = count_wrong(np.asarray(out[0] if scan else out[1]), expected)
    return _measurement(ctx, method, seconds, warmup, window, wrong, "mpi", description,
                        window=window)


def mpi4jax_call(ctx: Context) -> Measurement:
    return _mpi4jax(ctx, "mpi4jax/call", scan=False)


def mpi4jax_scan(ctx: Context) -> Measurement:
    return _mpi4jax(ctx, "mpi4jax/scan", scan=True)


# --------------------------------------------------------------------------- memcpy, floor


def memcpy(ctx: Context) -> Measurement:
    """numpy copy of the message's bytes into a preallocated buffer (the in-process limit)."""
    plan, n = ctx.plan, ctx.plan.size
    source = pattern(n)
    target = np.zeros(n, np.uint8)
    seconds = _timed(lambda: np.copyto(target, source), plan.iters, plan.warmup, _no_sync)
    return _measurement(ctx, "memcpy", seconds, plan.warmup, 1, count_wrong(target, source),
                        "local", "numpy.copyto between two preallocated buffers of one process")


def _hop_floor(ctx: Context, method: str, mode: str) -> Measurement:
    """The bytes every hop must move, on one core: one copy of the message into the
    receiver's output, plus the zeros of the precv on the device that is no destination
    (``ppermute``'s semantics). Over MPI rank 0 measures while the other ranks sleep."""
    session, plan, n = ctx.session, ctx.plan, ctx.plan.size
    source = pattern(n)
    target = np.zeros(n, np.uint8)
    idle = np.ones(n, np.uint8)

    def step() -> None:
        np.copyto(target, source)
        ext.zero_fill(idle)

    description = ("memcpy of the message + zero-fill of the idle device's precv output (as "
                   "precv writes it), one core: the floor of one hop")
    if mode == "mpi" and not session.is_root:
        session.barrier(sleep=True)  # the one meeting of all ranks: rank 0 starts timing
        request = session.pair_comm.Ibarrier()  # rank 0 is done
        while not request.Test():
            time.sleep(0.002)
        return _measurement(ctx, method, np.array([1.0]), 0, 1, 0, mode, description)
    seconds = _timed(step, plan.iters, plan.warmup,
                     session.barrier if mode == "mpi" else _no_sync)
    if mode == "mpi":
        session.pair_comm.Ibarrier().Wait()  # (a blocking Barrier would not match it)
    wrong = count_wrong(target, source) + int(np.count_nonzero(idle))
    return _measurement(ctx, method, seconds, plan.warmup, 1, wrong, mode, description)


def hop_floor(ctx: Context) -> Measurement:
    return _hop_floor(ctx, "hop-floor", "mpi")


def hop_floor_local(ctx: Context) -> Measurement:
    return _hop_floor(ctx, "hop-floor-local", "local")


METHODS: dict[str, Callable[[Context], Measurement]] = {
    "mpi4py": mpi4py_p2p,
    "psend/call": psend_call,
    "psend/scan": psend_scan,
    "psend-donated/scan": psend_donated_scan,
    "mpi4jax/call": mpi4jax_call,
    "mpi4jax/scan": mpi4jax_scan,
    "gloo/call": gloo_call,
    "gloo/scan": gloo_scan,
    "jit-floor": jit_floor,
    "hop-floor": hop_floor,
    "memcpy": memcpy,
    "hop-floor-local": hop_floor_local,
    "psend-local/call": psend_local_call,
    "psend-local/scan": psend_local_scan,
    "ppermute-local/call": ppermute_local_call,
    "ppermute-local/scan": ppermute_local_scan,
    "jit-floor-local": jit_floor_local,
    "psend-nccl/call": psend_nccl_call,
    "psend-nccl/scan": psend_nccl_scan,
    "ppermute-nccl/call": ppermute_nccl_call,
    "ppermute-nccl/scan": ppermute_nccl_scan,
    "jit-floor-gpu": jit_floor_gpu,
}

#: Methods that measure one kind only.
LATENCY_ONLY = frozenset({"jit-floor", "jit-floor-local", "jit-floor-gpu", "hop-floor",
                          "hop-floor-local", "psend-donated/scan"})
