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

The sender side (sender_case): a call that fails on the sending device before its psends
run, while their receivers' precvs in the other process wait; the next call's messages
reached those precvs, which returned them as the failed call's (``STALE``). Now the next
call's psends are refused and the waiting precvs time out. Over MPI in both directions, and
in process (no gap there: a call ends on every device of the process before the next one
starts, so the receivers timed out already; the psends are refused all the same), 8 B,
4 KiB, 64 KiB framed and 1 MiB direct, on devices 4 and 7 of the failing rank and 0-3 of
the other.

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


#: The sender-side cases: one psend of each size from the failing device, each to a receiver
#: of its own: 8 B (eager), 4 KiB (staged), 64 KiB (a kept one-way send, framed from its
#: operand) and 1 MiB on the plain path (a psend whose precv does not take its token keeps
#: no operand: over MPI a direct send into the receiver's output once it is ready).
SENDER_SIZES = ((8, "kept"), (4 << 10, "kept"), (64 << 10, "kept"), (1 << 20, "plain"))
#: The receivers' timeout in the sender-side cases: their precv of the failed call waits
#: that long (the next call comes well before).
SENDER_TIMEOUT_S = 1.0


def sender_programs(devices: list):
    """F and G on the devices [S, bad, R0, R1, R2, R3]: in F, S's precv from bad fails
    (float32[2] expected, int32[2] sent), and only then would S's psends to each R run (one
    per size of SENDER_SIZES: their operands depend on the failed precv's result), so XLA
    skips them while each R's precv waits. G sends the same hops, with other bytes."""
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))

    def hops(vs, after):
        out = []
        for k, ((_, how), v) in enumerate(zip(SENDER_SIZES, vs, strict=True)):
            perm = [(0, 2 + k)]
            token = jax_cpu_mpi.psend(after(v), "x", perm)
            if how == "plain":
                token = jax.lax.create_token()  # the precv keeps no operand of the psend
            y = jax_cpu_mpi.precv(token, jax.ShapeDtypeStruct(v.shape, v.dtype), "x", perm)
            out.append(jax.lax.pcast(y, "x", to="varying"))
        return tuple(out)

    def failing(w, *vs):
        bad = jax_cpu_mpi.precv(jax_cpu_mpi.psend(w, "x", [(1, 0)]),
                                jax.ShapeDtypeStruct((2,), jnp.float32), "x", [(1, 0)])
        never = bad[0] == bad[0] + 1  # false for finite values, but XLA cannot know it
        return hops(vs, lambda v: jnp.where(never, v + 1, v))

    def correct(*vs):
        return hops(vs, lambda v: v)

    specs = (P("x"),) * len(SENDER_SIZES)
    f = jax.jit(jax.shard_map(failing, mesh=mesh, in_specs=(P("x"), *specs), out_specs=specs))
    g = jax.jit(jax.shard_map(correct, mesh=mesh, in_specs=specs, out_specs=specs))
    return mesh, f, g


def received(name: str, call: str, outs, salt: int) -> list[str]:
    """What each receiver's shard of `outs` holds here: the bytes S sends in the call with
    `salt` (its own call's, or the other call's), or its error."""
    found = []
    for k, ((n, _), out) in enumerate(zip(SENDER_SIZES, outs, strict=True)):
        for shard in out.addressable_shards:
            if shard.index[0].start // n != 2 + k:  # R_k's shard
                continue
            try:
                data = np.asarray(shard.data)
            except jax.errors.JaxRuntimeError as e:
                found.append(f"{n} bytes: error {str(e).splitlines()[0][:60]}")
                continue
            if np.array_equal(data, pattern(n, salt)):
                found.append(f"{n} bytes: its own")
            else:
                other = 50 if salt == 10 else 10
                what = "the other call's" if np.array_equal(data, pattern(n, other)) else "other"
                print(f"STALE {name}: {call}'s precv of {n} bytes returned {what} bytes",
                      flush=True)
    return found


def sender_case(name: str, devices: list) -> None:
    """A call fails on the sending device S before its psends run, while each receiver's
    precv of that call waits; the caller calls G (same hops, other bytes). Before the fix the
    receivers' waiting precvs of F took G's messages and F returned G's bytes there as its
    own (``STALE``), and G's precvs then timed out. Now S's psends of G are refused (the
    failed op marked their channels), the receivers' precvs of F time out (and mark their
    channels) and those of G are refused: no call returns another call's data. Prints
    "sender F/G err|ok NAME: ..." lines for the test."""
    mesh, f, g = sender_programs(devices)
    xs1, xs2 = ([common.global_array(mesh, P("x"), np.concatenate(
        [pattern(n, salt + p) for p in range(len(devices))])) for n, _ in SENDER_SIZES]
        for salt in (10, 50))
    w = common.global_array(mesh, P("x"), np.arange(2 * len(devices), dtype=np.int32))
    f, g = f.lower(w, *xs1).compile(), g.lower(*xs2).compile()
    marked = jax_cpu_mpi.stats()["refused_send_channels"]
    multihost_utils.sync_global_devices(name)
    for call, run, salt in (("F", lambda: f(w, *xs1), 10), ("G", lambda: g(*xs2), 50)):
        outs = run()
        try:
            jax.block_until_ready(outs)
        except jax.errors.JaxRuntimeError as e:
            print(f"sender {call} err {name}: {str(e).splitlines()[0]}", flush=True)
        else:
            print(f"sender {call} ok  {name}", flush=True)
        print(f"sender {call} got {name}: {received(name, call, outs, salt)}", flush=True)
    marked = jax_cpu_mpi.stats()["refused_send_channels"] - marked
    print(f"sender marks {name}: {marked}", flush=True)


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
        # The sender side (sender_case): from device 7 to devices 0-3, bad 4 -> 7.
        with config.overrides(recv_timeout=SENDER_TIMEOUT_S):
            sender_case("in process", [local[7], local[4], *local[:4]])
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
        # The sender side over MPI: from the failing rank's device 7 to the other rank's
        # devices 0-3 (channels no case above used), bad 4 -> 7.
        with config.overrides(recv_timeout=SENDER_TIMEOUT_S):
            for failing_rank in (0, 1):
                mine = [d for d in everywhere if d.process_index == failing_rank]
                theirs = [d for d in everywhere if d.process_index != failing_rank]
                sender_case(f"rank {failing_rank} failing", [mine[7], mine[4], *theirs[:4]])
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
