"""A message that a failed program run left in a channel is never taken as a later call's.

Under ``mpirun -n 2`` with 4 devices per rank (tests/runtime/test_reliability.py), or alone
(in process only). Each case builds a program F on three devices (partitions 0: the failing
device, 1: a device that sends it a message of another dtype, 2: its peer): the peer's
psend of ``perm`` (one-way 2 -> 0, or the cycle 0 <-> 2) runs, then device 0's precv from
device 1 fails (it expected float32[2], int32[2] came), so XLA runs no further op of F on
device 0: its precv of ``perm`` is skipped and the peer's message stays in the channel 2 ->
0. The caller catches the error and calls a correct program G on the same channel, same
shape, other bytes. Before the fix G's precv on device 0 took F's message and returned its
bytes as its own (``STALE``); now it refuses with an error that names the failed call.

Late senders (late_senders): a precv that timed out (its sender came later) leaves its
peer's message in the channel just the same; the next call's precv there took it as its own
(``STALE``), and now refuses, naming the timeout. On each rank's devices 4-7 (the cases
above use 0-3), in process and over MPI in both directions, 8 B, 4 KiB and 1 MiB (in
process only: see LATE_SIZES).

Cases: over MPI (devices 0 and 1 on one rank, 2 on the other) in both directions (rank 0
failing, then rank 1), and in process (all three on one rank, run on each rank at once on
its own devices), at 8 B (eager), 4 KiB (staged), 64 KiB and 1 MiB one-way (framed from the
operand over MPI: in process only, see OVER_MPI) and 1 MiB in a cycle (a deferred send,
direct). Each case uses channels into the failing device that no earlier case used: a
refused channel stays refused. In the cycle, the failed op also finishes device 0's send
that the skipped precv kept (its operand still alive): the peer gets its bytes.
"""

from __future__ import annotations

import sys
import time

import _mpi_common as common
import jax
import jax.numpy as jnp
import numpy as np
from _mpi_common import P
from jax.experimental import multihost_utils

import jax_cpu_mpi
from jax_cpu_mpi import config

me = jax.process_index()
SIZES = ((8, "one-way"), (4 << 10, "one-way"), (64 << 10, "one-way"), (1 << 20, "one-way"),
         (1 << 20, "cycle"))
#: The cases over MPI. Not the framed ones (a kept one-way psend, framed from its operand
#: from 16 KiB on): its sender waits in the precv that keeps it until the receiver takes the
#: message; the failing device never does, so the send times out, MPI cannot cancel it and
#: the sender's transport is broken (every later MPI op of that process fails): the job
#: would have to end here.
OVER_MPI = (0, 1, 4)


def pattern(n: int, salt: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * 7 + salt) % 251).astype(np.uint8)


def programs(devices: list, kind: str):
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    perm = [(2, 0)] if kind == "one-way" else [(0, 2), (2, 0)]

    def failing(v, w):
        token = jax_cpu_mpi.psend(v, "x", perm)
        w = jax.lax.optimization_barrier((token, w))[1]  # the bad op after the psend
        bad = jax_cpu_mpi.precv(jax_cpu_mpi.psend(w, "x", [(1, 0)]),
                                jax.ShapeDtypeStruct((2,), jnp.float32), "x", [(1, 0)])
        token = jax.lax.optimization_barrier((token, bad))[0]  # its precv runs after it
        y = jax_cpu_mpi.precv(token, jax.ShapeDtypeStruct(v.shape, v.dtype), "x", perm)
        return jax.lax.pcast(y, "x", to="varying"), bad

    def correct(v):
        y = jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", perm),
                              jax.ShapeDtypeStruct(v.shape, v.dtype), "x", perm)
        return jax.lax.pcast(y, "x", to="varying")

    f = jax.jit(jax.shard_map(failing, mesh=mesh, in_specs=(P("x"), P("x")),
                              out_specs=(P("x"), P("x"))))
    g = jax.jit(jax.shard_map(correct, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    return mesh, f, g


def run_case(name: str, devices: list, n: int, kind: str, *, mine: bool,
             strict: bool = True) -> None:
    """`mine`: this process holds the failing device (partition 0). Not `strict` (the framed
    launch): the errors of either call are printed, not checked."""
    mesh, f, g = programs(devices, kind)
    first = np.concatenate([pattern(n, 10 + p) for p in range(3)])
    second = np.concatenate([pattern(n, 50 + p) for p in range(3)])
    x1 = common.global_array(mesh, P("x"), first)
    x2 = common.global_array(mesh, P("x"), second)
    w = common.global_array(mesh, P("x"), np.arange(6, dtype=np.int32))
    try:
        got = jax.block_until_ready(f(x1, w))[0]
    except jax.errors.JaxRuntimeError as e:
        if not strict:
            print(f"F err {name}: {str(e).splitlines()[0][:100]}", flush=True)
        else:
            assert mine and "expected float32[2]" in str(e), f"{name}: {e}"
    else:
        assert not mine, f"{name}: the failing device's precv must fail"
        if kind == "cycle":
            # Device 0's psend of the cycle defers or leaves its send in flight, and the
            # precv that keeps its operand is skipped: the failed op finished that send
            # while the operand was alive, and the peer got the operand's bytes.
            shard = next(s for s in got.addressable_shards if s.index[0].start == 2 * n)
            np.testing.assert_array_equal(np.asarray(shard.data), pattern(n, 10),
                                          err_msg=name)
            print(f"ok   {name}: the failed op finished the kept send", flush=True)
    assert not strict or jax_cpu_mpi.stats()["kept_sends_unfinished"] == 0, name
    try:
        got = jax.block_until_ready(g(x2))
    except jax.errors.JaxRuntimeError as e:
        if not strict:
            print(f"G err {name}: {str(e).splitlines()[0][:100]}", flush=True)
            return
        assert mine, f"{name}: only the failing device refuses: {e}"
        print(f"ok   {name}: refused: {str(e).splitlines()[0]}", flush=True)
        return
    shard = next((s for s in got.addressable_shards if s.index[0].start == 0), None)
    if shard is None:
        print(f"ok   {name}: peer side returned", flush=True)
        return
    data = np.asarray(shard.data)
    if np.array_equal(data, pattern(n, 12)):
        print(f"STALE {name}: the second call returned the failed call's bytes", flush=True)
    elif np.array_equal(data, pattern(n, 52)):
        print(f"FRESH {name}: the second call got its own bytes", flush=True)
    else:
        print(f"OTHER {name}: {data[:8]}", flush=True)


#: How long the late senders wait before their psend, and their receivers' timeout.
LATE_S, LATE_TIMEOUT_S = 2.0, 1.0


#: The late senders' sizes, each with channels of its own. Over MPI not the 1 MiB one: a
#: message that large that nobody takes is a send that never completes; it breaks its
#: sender's transport at its deadline and the exit then ends the job with an error (it is
#: refused all the same: the MPI receive's timeout is the same code for every size).
LATE_SIZES = ((0, 8), (1, 4 << 10), (2, 1 << 20))


def late_senders(local: list, ranks: list | None, sizes=LATE_SIZES) -> None:
    """For each size, one program with two one-way pairs whose senders (partitions 1 and 2)
    wait LATE_S in a host callback before their psend: (1, 0) and (2, 3). In process on
    this rank's devices (`ranks` None), else over MPI on `ranks` (each rank's devices):
    partitions 0 and 2 on rank 0, 1 and 3 on rank 1, so rank 1 sends to rank 0 over (1, 0)
    and rank 0 to rank 1 over (2, 3). Every size on channels of its own. The first call's
    destinations time out; once the late messages are in, a second call on the same
    channels must refuse, not return them."""
    where = "over MPI" if ranks else "in process"
    for k, n in sizes:
        if ranks:
            devices = [ranks[0][4 + k], ranks[1][4 + k], ranks[0][5 + k], ranks[1][5 + k]]
        else:
            devices = [local[4 + (k + j) % 4] for j in range(4)]
        mesh = jax.sharding.Mesh(np.array(devices), ("x",))
        perm = [(1, 0), (2, 3)]

        def wait(i, v, delay):
            if int(i) in (1, 2):
                time.sleep(float(delay))
            return v

        def body(v, delay, perm=perm):
            v = jax.pure_callback(wait, jax.ShapeDtypeStruct(v.shape, v.dtype),
                                  jax.lax.axis_index("x"), v, delay[0])
            y = jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", perm),
                                  jax.ShapeDtypeStruct(v.shape, v.dtype), "x", perm)
            return jax.lax.pcast(y, "x", to="varying")

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))
        first = np.concatenate([pattern(n, 10 + p) for p in range(4)])
        second = np.concatenate([pattern(n, 50 + p) for p in range(4)])
        x1, x2 = (common.global_array(mesh, P("x"), v) for v in (first, second))
        late, now = (common.global_array(mesh, P(), np.array([d], np.float32))
                     for d in (LATE_S, 0.0))
        name = f"late sender {where} {n} bytes"
        multihost_utils.sync_global_devices(name)
        try:
            jax.block_until_ready(f(x1, late))
        except jax.errors.JaxRuntimeError as e:
            assert "DEADLINE_EXCEEDED" in str(e), f"{name}: {e}"
        else:
            raise AssertionError(f"{name}: the receivers must time out")
        time.sleep(LATE_S)  # the late messages are in the channels now
        multihost_utils.sync_global_devices(name + " sent")
        try:
            got = jax.block_until_ready(f(x2, now))
        except jax.errors.JaxRuntimeError as e:
            print(f"ok   {name}: refused: {str(e).splitlines()[0]}", flush=True)
            continue
        finally:
            # JAX keeps the last call with a host callback of each device until the exit,
            # which raises its error (and then skips JAX's shutdown): a call that passes.
            jax.block_until_ready(jax.jit(jax.shard_map(
                lambda v: jax.pure_callback(lambda a: a, jax.ShapeDtypeStruct(v.shape, v.dtype),
                                            v), mesh=mesh, in_specs=P("x"),
                out_specs=P("x")))(x1))
        for shard in got.addressable_shards:
            dst = shard.index[0].start // n
            if dst not in (0, 3):
                continue
            data, src = np.asarray(shard.data), 1 if dst == 0 else 2
            if np.array_equal(data, pattern(n, 10 + src)):
                print(f"STALE {name}: the second call returned the timed-out call's bytes",
                      flush=True)
            else:
                print(f"FRESH {name}: {np.array_equal(data, pattern(n, 50 + src))}",
                      flush=True)


def main() -> None:
    local = sorted(jax.local_devices(), key=lambda d: d.id)
    with config.overrides(gpu_parity=False):
        # In process: on each rank's own devices, channels 1 -> 0 (bad) and c -> 0.
        for i, (n, kind) in enumerate(SIZES):
            fail = local[i % 4]
            ring = [d for d in local if d != fail]
            bad, peer = ring[0], ring[1 + i // 4]
            run_case(f"in process {n} bytes {kind}", [fail, bad, peer], n, kind, mine=True)
        if jax.process_count() < 2:
            return
        everywhere = sorted(jax.devices(), key=lambda d: d.id)
        for failing_rank, i in [(rank, i) for rank in (0, 1) for i in OVER_MPI]:
            n, kind = SIZES[i]
            mine = [d for d in everywhere if d.process_index == failing_rank]
            theirs = [d for d in everywhere if d.process_index != failing_rank]
            fail, bad = mine[i % 4], mine[(i + 1) % 4]
            # A cycle's peer receives too: from a device whose channels no case marked.
            peer = theirs[3] if kind == "cycle" else theirs[i // 4]
            name = f"rank {failing_rank} failing {n} bytes {kind}"
            multihost_utils.sync_global_devices(name)
            run_case(name, [fail, bad, peer], n, kind, mine=me == failing_rank)
    with config.overrides(gpu_parity=False, recv_timeout=LATE_TIMEOUT_S):
        late_senders(local, None)
        late_senders(local, [[d for d in everywhere if d.process_index == p] for p in (0, 1)],
                     LATE_SIZES[:2])
    multihost_utils.sync_global_devices("stale after failure done")
    print("ok   stale after failure: done", flush=True)


def framed() -> None:
    """The framed cases over MPI, in a launch of their own (they break the transports): a
    64 KiB one-way psend framed from its operand, whose receiver is skipped after its
    device's op failed, between eager and staged cases, rank 0 failing and then rank 1. The
    sender's keeper precv times out and the send cannot be taken back: MPICH's UCX netmod
    crashed (SIGSEGV in MPI_Cancel) cancelling such a send once the other rank's transport
    was broken; it is now abandoned, the transport broken, and every call fails with an
    error. Each rank must get to the end."""
    everywhere = sorted(jax.devices(), key=lambda d: d.id)
    with config.overrides(gpu_parity=False, recv_timeout=3.0):
        for failing_rank, i in [(rank, i) for rank in (0, 1) for i in (2, 0, 1)]:
            n, kind = SIZES[i]
            mine = [d for d in everywhere if d.process_index == failing_rank]
            theirs = [d for d in everywhere if d.process_index != failing_rank]
            fail, bad = mine[i % 4], mine[(i + 1) % 4]
            name = f"framed launch, rank {failing_rank} failing {n} bytes {kind}"
            multihost_utils.sync_global_devices(name)
            run_case(name, [fail, bad, theirs[i // 4]], n, kind, mine=me == failing_rank,
                     strict=False)
    print("ok   framed launch: done", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["framed"]:
        framed()
    else:
        main()
    common.ok()
