"""The rendezvous path of MPI messages (256 KiB and more, and from 16 KiB on for a psend
whose operand a precv keeps): every way it can go.

``rendezvous.py CASE[,CASE...]`` under ``mpirun -n 2`` (``ring``: ``-n 3``), the cases one
after the other, each between ``== case NAME: start`` and ``== case NAME: done`` lines
(tests/runtime/test_reliability.py runs the first three, ``ordering`` and ``prefault`` in one
launch, with 4 devices per rank; the cases that say 1 device per rank use the first device of
each rank, ``prefault`` the last). After each case but ``never-received``, every rank checks
that the case left no message that nobody took (``ok   case NAME: every message taken``):
one left would be taken by a later case's precv of its channel, as its own. The cases:

* ``paths`` (1 device per rank): the receiver ready first (waiting) and the receiver late:
  a one-way psend whose operand its precv keeps is framed straight from the operand either
  way (its chunk header, then the payload), without waiting for a ready signal, and
  received as a staged message: the psend returns before it completes (``kept_sends``
  grows), and neither ``mpi_direct_sends`` (no direct receive takes it) nor
  ``mpi_staged_large_sends`` (no staging copy) does, at 64 KiB + 8 B (below the plain
  rendezvous size), 1 MiB and 8 MiB + 4 KiB,
  and at 8 KiB (below that size: staged whoever comes first, neither count moves);
  byte-count mismatches with the receiver ready first (the sender must stage, the receiver
  reports the same error as on the plain path, the sender does not hang), a 8 B message
  into a 8 MiB precv that is ready first (a ready signal the sender never reads), and
  afterwards the channel still delivers both ways, direct, with the right bytes.
* ``ordering`` (2 devices per rank, and the first of each): the wait of a one-way framed
  send's keeper precv for its receiver (mpi/rendezvous.cc, FinishDirect) under a 5 s
  receive timeout: a 64 KiB + 8 B hop between two psums that do not depend on it, over
  MPI and over gloo, and two one-way ops between the ranks in opposite directions in one
  step with a psum between, their precvs in the order of their psends and reversed; each
  with either rank late, every byte and sum checked, the psends framed.
* ``many-channels`` (4 devices per rank): every device of rank 0 sends 512 KiB to every
  device of rank 1 and back, all psends before the precvs (GPU parity off), 16 channels
  each way used from 4 device threads at once, some messages direct and some staged, 6
  rounds; every message carries (source, destination, round).
* ``exchange`` (1 device per rank): both ranks send and receive in the same step, one op
  with the cycle [(0, 1), (1, 0)] (GPU parity off) and two ops in opposite directions, in a
  ``lax.scan`` of 4 steps, at 8 B and 4 KiB (staged), 16 KiB and 100 KiB + 8 B (below the
  plain rendezvous size: every kept psend framed from its operand, as a one-way one, no
  direct receive, no staging copy: counted), 256 KiB, 1 MiB and 8 MiB + 4 KiB: a psend
  of the cycle that finds its receiver not ready defers its send to the receive loops, which
  post it straight from the operand once the ready signal comes (two ops: staged or direct,
  as one-way sends); every byte checked, each step's bytes differ. The two ops once more
  with their results kept apart in the loop carry (a psend2/scan step), 8 B to 8 MiB +
  4 KiB: the received result and the other op's zeros, over a carry that starts as other
  bytes, checked on each rank.
  Then byte-count mismatches in a cycle (each side waits for another size than the other
  sends, small or large): both precvs report the mismatch instead of waiting for a ready
  signal that never comes, and the channel still delivers both ways afterwards.
* ``ring`` (1 device per rank, run under ``mpirun -n 3``): every rank sends to the next and
  receives from the previous one, one op with the ring's cycle and one op per pair, in a
  ``lax.scan`` of 4 steps, at 8 B to 8 MiB + 4 KiB: a receive whose own deferred send goes
  to another rank than it receives from; every byte checked, some sends direct.
* ``prefault`` (1 device per rank, the last of each): a 6 MiB precv whose sender is late
  faults its output in while it waits (``prefaulted_bytes``), over the one-way framed path
  and the plain rendezvous, both directions, either rank late; the bytes of
  ``lax.ppermute``.
* ``never-received``: rank 0's psends of 8 B and then 8 MiB return although rank 1 never
  posts their precvs; rank 0's precv of a reply that never comes fails after the timeout;
  at exit rank 0 meets rank 1 (waiting at its exit) in the exit barrier with its 8 MiB send
  undelivered (the 8 B one completed, eager), reports that send, rank 1 the first message
  it never took (the 8 B one), and both end normally: nobody hangs.
"""

from __future__ import annotations

import functools
import operator
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import _mpi_common as common
import jax
import jax.numpy as jnp
import numpy as np
from _mpi_common import P
from jax.experimental import multihost_utils

import jax_cpu_mpi
from jax_cpu_mpi import _jax_cpu_mpi as _ext
from jax_cpu_mpi import config

CASES = sys.argv[1].split(",")
me = jax.process_index()
FWD, BWD = [(0, 1)], [(1, 0)]


def local(x: jax.Array) -> np.ndarray:
    return np.asarray(x.addressable_shards[0].data)


def barrier(name: str) -> None:
    multihost_utils.sync_global_devices(name)


#: Where the rank that goes first tells the late one that it is in its call (a file per
#: turn): both ranks of these cases run on one host. The file's name has the launch's
#: coordinator port and the ranks' parent (mpirun's proxy on this host).
_TURNS = Path(tempfile.gettempdir()) / (
    f"jcm-rendezvous-{os.environ.get('JCM_TEST_COORDINATOR_PORT', '')}-{os.getppid()}")
#: The longest a late rank waits for that word (a rank that never says it is waiting is a
#: failure its checks name); then it goes anyway.
LATE_LIMIT = 30.0
_turn = [0]
#: Seconds this rank waited, late, for the other rank's word (printed after each case).
_waited = [0.0]


def waiting(before: dict, now: dict) -> bool:
    """This process is waiting in the transport (its waits went on to yield or sleep), or
    it sent: the peer that comes late comes after that."""
    return any(now[k] > before[k] for k in ("wait_yields", "wait_sleeps", "mpi_direct_sends",
                                             "mpi_staged_large_sends", "kept_sends"))


def in_turn(late: bool, call, ready=waiting):
    """``call()`` on this rank, after the peer's own call has got far enough if this rank is
    ``late``: the peer's rank (not late) watches its transport's counters on a thread while
    its call runs, and once ``ready(counters before, counters now)`` holds (or its call has
    returned) says so in a file, which the late rank waits for. Instead of a fixed sleep, so
    that the order the case asks for holds however loaded the machine, and no longer than
    it takes. Every rank calls it in the same order (the turn's number names the file)."""
    _turn[0] += 1
    said = _TURNS.with_name(f"{_TURNS.name}-{_turn[0]}")
    if late:
        start = time.monotonic()
        while not said.exists() and time.monotonic() < start + LATE_LIMIT:
            time.sleep(0.005)
        _waited[0] += time.monotonic() - start
        said.unlink(missing_ok=True)
        return call()
    before = jax_cpu_mpi.stats()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set() and not ready(before, jax_cpu_mpi.stats()):
            time.sleep(0.002)
        said.touch()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        return call()
    finally:
        done.set()
        watcher.join()


def counters() -> tuple[int, int, int]:
    """Direct sends, staged large sends, and psends left in flight for their precv."""
    s = jax_cpu_mpi.stats()
    return s["mpi_direct_sends"], s["mpi_staged_large_sends"], s["kept_sends"]


def one_way(mesh, n: int, recv_n: int | None = None):
    """psend uint8[n] 0 -> 1 into a precv of uint8[recv_n]; device 1 returns what it got."""
    recv_n = n if recv_n is None else recv_n

    def body(v):
        got = jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", FWD),
                                jax.ShapeDtypeStruct((recv_n,), v.dtype), "x", FWD)
        return got[:n] if recv_n >= n else jnp.concatenate([got, v[recv_n:]])

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))


#: Where a kept psend's message is framed from its operand (one-way from the first; in a
#: cycle up to the second, from which it defers: mpi/transport.h, SentFramed).
FRAMED_MIN, RENDEZVOUS_MIN = 16 << 10, 256 << 10


def pair_mesh(*, last: bool = False) -> jax.sharding.Mesh:
    """The first device of each rank (the last one with `last`), as axis "x" (rank 0's
    first)."""
    pick = max if last else min
    devices = [pick((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
               for p in range(jax.process_count())]
    return jax.sharding.Mesh(np.array(devices), ("x",))


def pattern(n: int, salt: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * 7 + salt) % 251).astype(np.uint8)


def run_paths() -> None:
    mesh = pair_mesh()
    for n in (8 << 10, (64 << 10) + 8, 1 << 20, (8 << 20) + 4096):
        f = one_way(mesh, n)
        for mode, salt in (("receiver ready first", 1), ("receiver late", 2)):
            x = common.global_array(mesh, P("x"), np.concatenate([pattern(n, salt)] * 2))
            f.lower(x).compile()
            barrier(f"{n} {mode}")
            before = counters()
            # Rank 0 dispatches late (its peer is then waiting in precv), or rank 1 does
            # (rank 0's psend finds nobody, looks for the ready signal while it copies, and
            # sends the copy).
            got = local(in_turn((me == 0) == (mode == "receiver ready first"),
                                lambda f=f, x=x: jax.block_until_ready(f(x))))
            after = counters()
            if me == 1:
                np.testing.assert_array_equal(got, pattern(n, salt), err_msg=f"{n} {mode}")
            else:
                direct, staged, kept = (a - b for a, b in zip(after, before, strict=True))
                # A one-way psend whose operand its precv keeps is framed from the operand
                # at once, whoever comes first (no ready signal, no staging copy for a late
                # receiver, received as a staged message: not a direct send), the psend
                # returning while the receiver copies (the precv that takes its token
                # finishes it).
                want = (0, 0, 1)
                if n < 16 << 10:  # the plain small path: copied, sent, never kept
                    want = (0, 0, 0)
                assert (direct, staged, kept) == want, (n, mode, direct, staged, kept)
                assert jax_cpu_mpi.stats()["kept_sends_unfinished"] == 0
            path = "framed" if n >= 16 << 10 else "staged"
            print(f"ok   {n} bytes, {mode}: {path}", flush=True)
            barrier(f"{n} {mode} done")

    # Byte-count mismatches with the receiver ready first: the ready signal says another
    # count, so the sender stages; the receiver reports it as on the plain path.
    for send_n, recv_n in ((8 << 20, 6 << 20), (8 << 20, 8), (8, 8 << 20),
                           (64 << 10, 48 << 10)):
        f = one_way(mesh, send_n, recv_n)
        x = common.global_array(mesh, P("x"), np.ones(2 * send_n, np.uint8))
        f.lower(x).compile()
        barrier(f"mismatch {send_n} {recv_n}")
        start = time.perf_counter()
        try:
            in_turn(me == 0, lambda f=f, x=x: jax.block_until_ready(f(x)))
        except jax.errors.JaxRuntimeError as e:
            assert me == 1, f"rank 0 must not fail: {e}"
            for part in (f"uint8[{recv_n}]", f"({recv_n} bytes)",
                         f"sent uint8[{send_n}] ({send_n} bytes)"):
                assert part in str(e), (part, str(e))
            print(f"ok   mismatch {send_n} -> {recv_n}: {str(e).splitlines()[0][:160]}",
                  flush=True)
        else:
            assert me == 0, "rank 1 must report the mismatch"
            print(f"ok   mismatch {send_n} -> {recv_n}: sender returned after "
                  f"{time.perf_counter() - start:.2f} s", flush=True)
        barrier(f"mismatch {send_n} {recv_n} done")

    # The channel still works both ways, straight from the operand, right bytes (stale
    # ready signals of the mismatched messages must not match these).
    n = 4 << 20

    def pingpong(v):
        like = jax.ShapeDtypeStruct(v.shape, v.dtype)
        y = jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", FWD), like, "x", FWD)
        z = jax_cpu_mpi.precv(jax_cpu_mpi.psend(y + 1, "x", BWD), like, "x", BWD)
        return y + z

    g = jax.jit(jax.shard_map(pingpong, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = common.global_array(mesh, P("x"), np.concatenate([pattern(n, 3), pattern(n, 4)]))
    for _ in range(3):
        before = counters()
        got = local(jax.block_until_ready(g(x)))
        after = counters()
        # device 0: z = y(device 1) + 1 = pattern(3) + 1 (its y is zeros); device 1: y.
        want = pattern(n, 3) + (1 if me == 0 else 0)
        np.testing.assert_array_equal(got, want.astype(np.uint8))
        print(f"ok   channel after errors: direct {after[0] - before[0]}, "
              f"staged {after[1] - before[1]}", flush=True)
        barrier("pingpong")


def run_many_channels() -> None:
    devices = sorted(jax.devices(), key=lambda d: d.id)
    per = len(devices) // 2
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    count = 128 << 10  # int32 -> 512 KiB
    # Pair i of `shift` s: device i of rank 0 <-> device (i + s) % per of rank 1.
    shifts = range(per)

    def body(v, r):
        i = jax.lax.axis_index("x")
        out = jnp.zeros_like(v)
        tokens = []
        for s in shifts:
            fwd = [(a, per + (a + s) % per) for a in range(per)]
            bwd = [(b, a) for a, b in fwd]
            for perm in (fwd, bwd):
                payload = v + (i * 1000 + r * 10 + s).astype(v.dtype)
                tokens.append((jax_cpu_mpi.psend(payload, "x", perm), perm))
        for tok, perm in tokens:
            out = out + jax_cpu_mpi.precv(tok, jax.ShapeDtypeStruct(v.shape, v.dtype), "x", perm)
        return out

    with config.overrides(gpu_parity=False):
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))
        x = common.global_array(mesh, P("x"), np.tile(np.arange(count, dtype=np.int32),
                                                      len(devices)))
        before = counters()
        for r in range(6):
            got = jax.block_until_ready(f(x, jnp.int32(r)))
            for shard in got.addressable_shards:
                d = shard.index[0].start // count
                # Every device receives once per shift from each direction it is target of:
                # as a rank-1 device it gets fwd messages, as a rank-0 device bwd ones.
                if d >= per:
                    sources = [(d - per - s) % per for s in shifts]
                else:
                    sources = [per + (d + s) % per for s in shifts]
                want = sum(np.arange(count, dtype=np.int64) + src * 1000 + r * 10 + s
                           for src, s in zip(sources, shifts, strict=True))
                np.testing.assert_array_equal(np.asarray(shard.data), want.astype(np.int32),
                                              err_msg=f"device {d}, round {r}")
            barrier(f"round {r}")
        after = counters()
    print(f"ok   many channels: {per * per} each way, 6 rounds, direct {after[0] - before[0]}, "
          f"staged {after[1] - before[1]}", flush=True)
    barrier("many channels done")


def run_never_received() -> None:
    mesh = pair_mesh()
    n = 8 << 20
    x = common.global_array(mesh, P("x"), np.ones(2 * n, np.uint8))
    x8 = common.global_array(mesh, P("x"), np.ones(16, np.uint8))
    with config.overrides(gpu_parity=False):
        send = jax.jit(jax.shard_map(_send_only, mesh=mesh, in_specs=P("x"),
                                     out_specs=P("x")))
        send.lower(x8).compile()
        reply = jax.jit(jax.shard_map(
            lambda v: jax_cpu_mpi.precv(jax.lax.create_token(),
                                        jax.ShapeDtypeStruct((8,), v.dtype), "x", BWD),
            mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        send.lower(x).compile()
        reply.lower(x).compile()
    barrier("compiled")
    if me == 1:
        print("process 1: never receives; exits", flush=True)
        common.ok()
        return
    # First 8 B, eager: its send completes with nobody receiving, so only rank 1's exit
    # can name it.
    jax.block_until_ready(send(x8))
    start = time.perf_counter()
    jax.block_until_ready(send(x))
    print(f"process 0: psend of {n} bytes returned after {time.perf_counter() - start:.2f} s "
          f"with nobody receiving; stats {jax_cpu_mpi.stats()}", flush=True)
    start = time.perf_counter()
    try:
        jax.block_until_ready(reply(x))
    except jax.errors.JaxRuntimeError as e:
        print(f"process 0: precv failed after {time.perf_counter() - start:.1f} s: "
              f"{str(e).splitlines()[0][:200]}", flush=True)
    else:
        raise AssertionError("the precv of a reply nobody sends must fail")
    common.ok()


def scanned(mesh, step, steps: int = 4):
    """``steps`` of ``step`` in a jitted ``lax.scan`` over ``mesh``, each step adding 1 to
    what it received, so that each step's message differs."""
    def body(v):
        def one(c, _):
            got = jax.lax.pcast(step(c), "x", to="varying")
            return got + jnp.uint8(1), None

        return jax.lax.scan(one, v, None, length=steps)[0]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))


def run_exchange() -> None:
    mesh = pair_mesh()
    cycle = [(0, 1), (1, 0)]

    def step_one_op(v):
        like = jax.ShapeDtypeStruct(v.shape, v.dtype)
        return jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", cycle), like, "x", cycle)

    def step_two_ops(v):
        like = jax.ShapeDtypeStruct(v.shape, v.dtype)
        t1, t2 = jax_cpu_mpi.psend(v, "x", FWD), jax_cpu_mpi.psend(v, "x", BWD)
        # The device that is not a destination of a pair gets zeros from its precv.
        return (jax_cpu_mpi.precv(t1, like, "x", FWD) | jax_cpu_mpi.precv(t2, like, "x", BWD))

    for name, step in (("one op", step_one_op), ("two ops", step_two_ops)):
        with config.overrides(gpu_parity=False):
            f = scanned(mesh, step)
            for n in (8, 4 << 10, 16 << 10, (100 << 10) + 8, 256 << 10, 1 << 20,
                      (8 << 20) + 4096):
                x = common.global_array(mesh, P("x"),
                                        np.concatenate([pattern(n, 5), pattern(n, 6)]))
                for _ in range(2):
                    before = counters()
                    got = local(jax.block_until_ready(f(x)))
                    # Four swaps bring each device its own bytes back, each step adding 1.
                    mine = pattern(n, 5 if me == 0 else 6)
                    np.testing.assert_array_equal(got, mine + np.uint8(4), err_msg=(name, n))
                    if FRAMED_MIN <= n < RENDEZVOUS_MIN:
                        # Below the plain rendezvous size a cycle's kept psend is framed
                        # from its operand at once, as a one-way one: no ready signal, no
                        # deferral, neither a direct receive nor a staging copy; each of
                        # the 4 steps' psends kept, and finished by its precv.
                        direct, staged, kept = (a - b for a, b in
                                                zip(counters(), before, strict=True))
                        assert (direct, staged, kept) == (0, 0, 4), (name, n, direct, staged,
                                                                     kept)
                        assert jax_cpu_mpi.stats()["kept_sends_unfinished"] == 0
                print(f"ok   exchange {name} {n} bytes", flush=True)
                barrier(f"exchange {name} {n}")

    # Two ops with their results kept apart in the loop carry (what psend2/scan and a
    # pipeline keep, not ORed as above): the precv that is no destination writes zeros into
    # a carry that starts as other bytes (a skipped zero-fill fails here from 8 B on, where
    # the OR above passes at 8 B and 4 KiB), and each device's received result is checked.
    def apart(v, steps: int = 4):
        like = jax.ShapeDtypeStruct(v.shape, v.dtype)

        def one(carry, _):
            c, _, _ = carry
            t1, t2 = jax_cpu_mpi.psend(c, "x", FWD), jax_cpu_mpi.psend(c, "x", BWD)
            a = jax.lax.pcast(jax_cpu_mpi.precv(t1, like, "x", FWD), "x", to="varying")
            b = jax.lax.pcast(jax_cpu_mpi.precv(t2, like, "x", BWD), "x", to="varying")
            return ((a | b) + jnp.uint8(1), a, b), None

        poison = jnp.full_like(v, 0xAB)
        return jax.lax.scan(one, (v, poison, poison), None, length=steps)[0]

    with config.overrides(gpu_parity=False):
        f = jax.jit(jax.shard_map(apart, mesh=mesh, in_specs=P("x"),
                                  out_specs=(P("x"), P("x"), P("x"))))
        for n in (8, 4 << 10, 16 << 10, 256 << 10, (8 << 20) + 4096):
            x = common.global_array(mesh, P("x"), np.concatenate([pattern(n, 5), pattern(n, 6)]))
            for _ in range(2):
                c, a, b = (local(out) for out in jax.block_until_ready(f(x)))
                mine = pattern(n, 5 if me == 0 else 6)
                got, zeros = (b, a) if me == 0 else (a, b)
                np.testing.assert_array_equal(c, mine + np.uint8(4), err_msg=("apart", n))
                np.testing.assert_array_equal(got, mine + np.uint8(3), err_msg=("apart", n))
                np.testing.assert_array_equal(zeros, np.zeros_like(mine), err_msg=("zeros", n))
            print(f"ok   exchange two ops apart {n} bytes", flush=True)
            barrier(f"exchange apart {n}")

    # Mismatches in a cycle: nobody may wait for a ready signal that never comes.
    # Across the cycle's rendezvous size too: a deferring psend into a staged precv, a staged
    # psend into a precv that signals, and two that signal different sizes.
    for send_n, recv_n in ((8 << 20, 8), (1 << 20, 2 << 20), (64 << 10, 8), (8, 64 << 10),
                           (16 << 10, 32 << 10)):
        def body(v, recv_n=recv_n):
            like = jax.ShapeDtypeStruct((recv_n,), v.dtype)
            return jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", cycle), like, "x", cycle)[:8]

        with config.overrides(gpu_parity=False):
            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
            x = common.global_array(mesh, P("x"), np.ones(2 * send_n, np.uint8))
            f.lower(x).compile()
        barrier(f"cycle mismatch {send_n} {recv_n}")
        try:
            jax.block_until_ready(f(x))
        except jax.errors.JaxRuntimeError as e:
            for part in (f"({recv_n} bytes)", f"sent uint8[{send_n}] ({send_n} bytes)"):
                assert part in str(e), (part, str(e))
            print(f"ok   cycle mismatch {send_n} -> {recv_n}", flush=True)
        else:
            raise AssertionError("a precv of another size must fail")
        barrier(f"cycle mismatch {send_n} {recv_n} done")
    with config.overrides(gpu_parity=False):
        f = scanned(mesh, step_one_op)
        n = 1 << 20
        x = common.global_array(mesh, P("x"), np.concatenate([pattern(n, 7), pattern(n, 8)]))
        got = local(jax.block_until_ready(f(x)))
    np.testing.assert_array_equal(got, pattern(n, 7 if me == 0 else 8) + np.uint8(4))
    print("ok   exchange after mismatches", flush=True)


def run_ring() -> None:
    """Every rank sends to the next and receives from the previous one (a ring of all the
    job's ranks, 1 device each): one op with the ring's cycle (GPU parity off) and one op per
    pair, in a ``lax.scan`` of 4 steps, each step's message differing. With 3 ranks or more a
    receive's own deferred send goes to another peer than the one it receives from: the
    receive waits for the sends deferred before it (mpi/transport.h) and posts its receives
    once they have started, and every byte must still arrive."""
    mesh = pair_mesh()
    ranks = jax.process_count()
    ring = [(i, (i + 1) % ranks) for i in range(ranks)]
    steps = 4

    def step_one_op(v):
        like = jax.ShapeDtypeStruct(v.shape, v.dtype)
        return jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", ring), like, "x", ring)

    def step_op_per_pair(v):
        like = jax.ShapeDtypeStruct(v.shape, v.dtype)
        tokens = [jax_cpu_mpi.psend(v, "x", [pair]) for pair in ring]
        # A device is the destination of one pair; the others' precvs give it zeros.
        got = [jax_cpu_mpi.precv(t, like, "x", [pair])
               for t, pair in zip(tokens, ring, strict=True)]
        return functools.reduce(operator.or_, got)

    direct_before = counters()[0]
    for name, step in (("one op", step_one_op), ("op per pair", step_op_per_pair)):
        with config.overrides(gpu_parity=False):
            f = scanned(mesh, step, steps)
            for n in (8, 16 << 10, (100 << 10) + 8, 1 << 20, (8 << 20) + 4096):
                x = common.global_array(
                    mesh, P("x"), np.concatenate([pattern(n, 20 + r) for r in range(ranks)]))
                for _ in range(2):
                    got = local(jax.block_until_ready(f(x)))
                    # After `steps` shifts each device holds the block that started `steps`
                    # ranks before it, each step adding 1.
                    origin = (me - steps) % ranks
                    np.testing.assert_array_equal(got, pattern(n, 20 + origin) + np.uint8(steps),
                                                  err_msg=(name, n))
                print(f"ok   ring of {ranks} {name} {n} bytes", flush=True)
                barrier(f"ring {name} {n}")
    direct = counters()[0] - direct_before
    # The deferred sends of the cycle went straight from their operands, at least some.
    assert direct > 0, jax_cpu_mpi.stats()
    print(f"ok   ring of {ranks}: {direct} direct sends", flush=True)


def run_ordering() -> None:
    """A one-way kept psend of 16 KiB or more is framed from its operand, and the precv
    that keeps the operand waits until the receiver's precv takes it (MPI cannot cancel a
    send): nothing the receiver runs before that precv may wait for the sender past it.
    Under a short receive timeout, so that such a wait fails the case instead of hanging:
    a hop between two psums that do not depend on it (MPI collectives, then gloo), with
    either rank late; and, on 2 devices per rank, two one-way ops between the ranks in
    opposite directions in one step, their precvs in the other order than their psends
    (and in the same), with a psum in between. Each checks its bytes and that the psends
    went framed (kept, neither direct nor staged-copied)."""
    before_timeout = config.current().recv_timeout
    jax_cpu_mpi.configure(recv_timeout=ORDERING_TIMEOUT)
    try:
        _ordering_cases()
    finally:
        jax_cpu_mpi.configure(recv_timeout=before_timeout)


ORDERING_TIMEOUT = 5.0
ORDERING_BYTES = (64 << 10) + 8


def _framed_check(name: str, before: tuple[int, int, int], sends: int) -> None:
    direct, staged, kept = (a - b for a, b in zip(counters(), before, strict=True))
    assert (direct, staged, kept) == (0, 0, sends), (name, direct, staged, kept)


def _each_rank_late(name: str, f, *args):
    """Compiles ``f`` for ``args``, then runs it once with each rank late in turn: yields
    (the late rank, the transport's counters before the call, the call's results)."""
    f.lower(*args).compile()
    for late in (0, 1):
        barrier(f"ordering {name} {late}")
        before = counters()
        if me == late:
            time.sleep(0.2)
        yield late, before, jax.block_until_ready(f(*args))


def _ordering_cases() -> None:
    n = ORDERING_BYTES
    mesh = pair_mesh()

    def hop_between_psums(v, w):
        like = jax.ShapeDtypeStruct(v.shape, v.dtype)
        a = jax.lax.psum(w, "x")
        got = jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", FWD), like, "x", FWD)
        b = jax.lax.psum(w * 2, "x")
        return got, a, b

    x = common.global_array(mesh, P("x"), np.concatenate([pattern(n, 9), pattern(n, 10)]))
    w = common.global_array(mesh, P("x"), np.arange(8, dtype=np.float32))
    for collectives in ("mpi", "gloo"):
        # The calls too under the setting, as the lowering reads it: a call outside could
        # lower the program again with the default collectives.
        with config.overrides(collectives=collectives):
            f = jax.jit(jax.shard_map(hop_between_psums, mesh=mesh, in_specs=(P("x"), P("x")),
                                      out_specs=(P("x"), P("x"), P("x"))))
            for late, before, outs in _each_rank_late(f"hop {collectives}", f, x, w):
                got, a, b = (local(out) for out in outs)
                if me == 1:
                    np.testing.assert_array_equal(got, pattern(n, 9))
                else:
                    _framed_check(f"hop {collectives}", before, 1)
                np.testing.assert_array_equal(a, [4, 6, 8, 10])
                np.testing.assert_array_equal(b, [8, 12, 16, 20])
                print(f"ok   ordering hop between psums ({collectives}), rank {late} late",
                      flush=True)
        barrier(f"ordering hop {collectives} done")

    # Mesh positions 0, 1 on rank 0 and 2, 3 on rank 1: 0 -> 2 and 3 -> 1 are one-way
    # (their senders receive nothing in the step), each from a device whose sibling
    # receives.
    firsts = [sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)[:2]
              for p in range(2)]
    mesh4 = jax.sharding.Mesh(np.array(firsts[0] + firsts[1]), ("x",))
    across, back = [(0, 2)], [(3, 1)]

    def opposite(v, w, *, precvs_reversed: bool):
        like = jax.ShapeDtypeStruct(v.shape, v.dtype)
        t1, t2 = jax_cpu_mpi.psend(v, "x", across), jax_cpu_mpi.psend(v, "x", back)
        s = jax.lax.psum(w, "x")
        if precvs_reversed:
            r2 = jax_cpu_mpi.precv(t2, like, "x", back)
            r1 = jax_cpu_mpi.precv(t1, like, "x", across)
        else:
            r1 = jax_cpu_mpi.precv(t1, like, "x", across)
            r2 = jax_cpu_mpi.precv(t2, like, "x", back)
        return r1 | r2, s

    blocks = [pattern(n, 11 + i) for i in range(4)]
    x4 = common.global_array(mesh4, P("x"), np.concatenate(blocks))
    w4 = common.global_array(mesh4, P("x"), np.arange(8, dtype=np.float32))
    for precvs_reversed in (True, False):
        order = "reversed" if precvs_reversed else "same"
        with config.overrides(gpu_parity=False):
            f = jax.jit(jax.shard_map(
                functools.partial(opposite, precvs_reversed=precvs_reversed), mesh=mesh4,
                in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x"))))
            for late, before, outs in _each_rank_late(f"opposite {order}", f, x4, w4):
                got, s = (common.gather(out) for out in outs)
                _framed_check(f"opposite {order}", before, 1)  # one one-way sender per rank
                zeros = np.zeros(n, np.uint8)
                want = np.concatenate([zeros, blocks[3], blocks[0], zeros])
                np.testing.assert_array_equal(got, want, err_msg=order)
                np.testing.assert_array_equal(s, np.tile([12, 16], 4))
                print(f"ok   ordering two one-way ops, precvs in {order} order, rank {late} "
                      "late", flush=True)
        barrier(f"ordering opposite {order} done")


def _send_only(v, perm=FWD):
    jax_cpu_mpi.psend(v, "x", perm)  # side-effecting: stays in the program
    return v


def assert_nothing_left(case: str) -> None:
    """Every message of the case was taken by its precv: no send of this rank is still in
    flight (one that nobody takes never completes), and, once every rank got here, no peer's
    message waits here (an eager one completes at its sender untaken). A message left behind
    would be taken by a later case's precv of the same channel: its own check would fail
    with a mismatch, or, at the same shape, pass on the old bytes. Ready signals left are
    not messages: a sender that staged discards the stale ones by number."""
    deadline = time.monotonic() + 5
    while jax_cpu_mpi.stats()["mpi_inflight_sends"] and time.monotonic() < deadline:
        time.sleep(0.01)
    in_flight = jax_cpu_mpi.stats()["mpi_inflight_sends"]
    barrier(f"case {case} sends done")
    left = [u for u in _ext.mpi_unreceived() if u[0] != "ready"]
    barrier(f"case {case} probed")
    if in_flight or left:
        # Printed first: the abort that the failure starts may cut the traceback short.
        message = (f"case {case} left messages nobody took: {in_flight} sends of process "
                   f"{me} in flight; unreceived here (kind, MPI rank, tag, bytes): {left}")
        print(f"FAIL {message}", flush=True)
        raise AssertionError(message)
    print(f"ok   case {case}: every message taken", flush=True)


def output_in_memory(before: dict, now: dict) -> bool:
    """A waiting precv of the prefault case has its whole output in memory."""
    return sum(now[k] - before[k] for k in ("prefaulted_bytes", "prefault_present_bytes")) >= (
        PREFAULT_BYTES)


PREFAULT_BYTES = 6 << 20


def run_prefault() -> None:
    """A precv that waits for a late sender faults in its large output meanwhile
    (cpp/common/keep_freed_memory.h, OutputPrefault), a huge page per poll, so that MPI's
    copy, once the message comes, takes no page faults: 6 MiB each way, over the one-way
    framed path (a kept psend, received as a staged message) and the plain rendezvous (a
    psend and a precv in programs of their own: ready signal, direct receive), each with
    the sender late (it sends once the receiver's whole output was faulted in or found in
    memory already, which its waiting precv's counters show:
    ``prefaulted_bytes`` and ``prefault_present_bytes`` grow by at least its size together)
    and the receiver late (the message is there: nothing to do). The bytes
    equal ``lax.ppermute``'s, the other device's output is zeros. Then both paths once more
    into a warm output (a donated buffer that a program wrote, which XLA receives into), the
    sender late: every page is seen present and left alone (``prefault_present_bytes`` grows
    by the output's size, ``prefaulted_bytes`` not at all). On the last device of each
    rank (the first of each when there is one): channels the other cases do not use, so that
    a message another case left (which the check after each case would name) cannot be taken
    here as this case's own."""
    mesh = pair_mesh(last=True)
    n = PREFAULT_BYTES
    x = common.global_array(mesh, P("x"), np.concatenate([pattern(n, 30), pattern(n, 31)]))
    like = jax.ShapeDtypeStruct((n,), jnp.uint8)
    for perm, direction in ((FWD, "forward"), (BWD, "backward")):
        source, dest = perm[0]
        ref = jax.jit(jax.shard_map(lambda v, perm=perm: jax.lax.ppermute(v, "x", perm),
                                    mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        expected = local(jax.block_until_ready(ref(x)))
        np.testing.assert_array_equal(
            expected, pattern(n, 30 + source) if me == dest else np.zeros(n, np.uint8))
        hop = jax.jit(jax.shard_map(
            lambda v, perm=perm: jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", perm), like, "x",
                                                   perm),
            mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        with config.overrides(gpu_parity=False):
            send = jax.jit(jax.shard_map(functools.partial(_send_only, perm=perm), mesh=mesh,
                                         in_specs=P("x"), out_specs=P("x")))
            recv = jax.jit(jax.shard_map(
                lambda v, perm=perm: jax_cpu_mpi.precv(jax.lax.create_token(), like, "x",
                                                       perm),
                mesh=mesh, in_specs=P("x"), out_specs=P("x")))
            for f in (hop, send, recv):
                f.lower(x).compile()

            # Into a warm output: `w`, donated and otherwise unused, is the output's buffer.
            hop_warm = jax.jit(jax.shard_map(
                lambda v, w, perm=perm: jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", perm),
                                                          like, "x", perm),
                mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x")),
                donate_argnums=1, keep_unused=True)
            recv_warm = jax.jit(jax.shard_map(
                lambda w, perm=perm: jax_cpu_mpi.precv(jax.lax.create_token(), like, "x",
                                                       perm),
                mesh=mesh, in_specs=P("x"), out_specs=P("x")), donate_argnums=0,
                keep_unused=True)
            hop_warm.lower(x, x).compile()
            recv_warm.lower(x).compile()
        written = jax.jit(lambda v: v ^ np.uint8(0x5A), out_shardings=x.sharding)

        def plain(send=send, recv=recv):
            jax.block_until_ready(send(x))
            return jax.block_until_ready(recv(x))

        def framed_warm(hop_warm=hop_warm, w=None):
            return jax.block_until_ready(hop_warm(x, w))

        def plain_warm(send=send, recv_warm=recv_warm, w=None):
            jax.block_until_ready(send(x))
            return jax.block_until_ready(recv_warm(w))

        for path, run in (("framed", lambda hop=hop: jax.block_until_ready(hop(x))),
                          ("plain", plain)):
            for late in ("sender late", "receiver late"):
                barrier(f"prefault {direction} {path} {late}")
                s0 = jax_cpu_mpi.stats()
                # The sender late: it sends once the receiver has its whole output in
                # memory (faulted in, or found there), what the check below asks.
                got = local(in_turn((me == source) == (late == "sender late"), run,
                                    output_in_memory if late == "sender late" else waiting))
                s1 = jax_cpu_mpi.stats()
                prefaulted = s1["prefaulted_bytes"] - s0["prefaulted_bytes"]
                present = s1["prefault_present_bytes"] - s0["prefault_present_bytes"]
                np.testing.assert_array_equal(got, expected, err_msg=(direction, path, late))
                if me == dest and late == "sender late":
                    # Faulted in, or in memory already (glibc may hand back a freed buffer).
                    assert prefaulted + present >= n, (direction, path, late, prefaulted,
                                                       present)
                print(f"ok   prefault {direction} {path}, {late}: {prefaulted} bytes "
                      f"prefaulted, {present} found present on rank {me}", flush=True)
                barrier(f"prefault {direction} {path} {late} done")
        for path, run in (("framed", framed_warm), ("plain", plain_warm)):
            w = jax.block_until_ready(written(x))  # every page written: in memory
            barrier(f"prefault {direction} {path} warm")
            s0 = jax_cpu_mpi.stats()
            got = local(in_turn(me == source, functools.partial(run, w=w),
                                output_in_memory))
            s1 = jax_cpu_mpi.stats()
            prefaulted = s1["prefaulted_bytes"] - s0["prefaulted_bytes"]
            present = s1["prefault_present_bytes"] - s0["prefault_present_bytes"]
            np.testing.assert_array_equal(got, expected, err_msg=(direction, path, "warm"))
            if me == dest:
                assert prefaulted == 0 and present >= n, (direction, path, prefaulted, present)
            print(f"ok   prefault {direction} {path}, warm output: {prefaulted} bytes "
                  f"prefaulted, {present} found present on rank {me}", flush=True)
            barrier(f"prefault {direction} {path} warm done")


RUN = {"paths": run_paths, "many-channels": run_many_channels, "exchange": run_exchange,
       "ring": run_ring, "ordering": run_ordering, "never-received": run_never_received,
       "prefault": run_prefault}
assert "never-received" not in CASES or CASES == ["never-received"], CASES  # it ends the job
for case in CASES:
    print(f"== case {case}: start", flush=True)
    RUN[case]()
    print(f"turns so far {_turn[0]}, this rank waited late {_waited[0]:.2f} s in all",
          flush=True)
    print(f"== case {case}: done", flush=True)
    if case != "never-received":
        assert_nothing_left(case)
    if case != CASES[-1]:
        barrier(f"case {case} done")
if CASES != ["never-received"]:
    common.ok()
