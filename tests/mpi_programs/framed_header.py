"""Framed messages sent bare (without their chunk header) when the header is the channel's
last one (cpp/mpi/framing.h), over mpirun -n 2. With one device per rank the pairs below
cross MPI; with two (``paths`` and ``changes`` only) they are devices 0 and 1 of rank 0,
in-process (never framed: the results alone are checked).

- ``paths``: a one-way kept hop from 16 KiB up to direct sizes (16 MiB), each way, and a
  cycle's exchange of 16 to 128 KiB (framed) and 512 KiB (deferred: never bare), in a loop
  of STEPS: equal to ``lax.ppermute`` bit for bit; the first message of a run of one header
  on the channel has its header, every later one goes bare (the stats count them on both
  ends); a second call's messages are all bare.
- ``changes``: one loop step sends, on one channel, float32[4096], int32[4096] (the same byte
  count, another type), float32[8192] (another size), float32[4096] twice, uint8[16320]
  (staged: sent as a header and a chunk after a framed message, as the receiver may have
  posted its receive for a bare payload), float32[4096] and uint8[8] twice (the first one
  staged as a header and a chunk, the second as one message again, from the channel's
  spare copy, which the first did not give back), each right.
- ``mismatch``: a bare message the receiver expects as int32 (or half the size) is refused,
  naming the sender's description, and the channel stays usable.
- ``timeout``: a precv that waits for a bare payload (its receive posted first) that never
  comes times out, and the channel's next messages arrive right.
"""

from __future__ import annotations

import sys

import _mpi_common as common
import jax
import jax.numpy as jnp
import numpy as np
from _mpi_common import P
from jax.experimental import multihost_utils

import jax_cpu_mpi
from jax_cpu_mpi import config

CASES = sys.argv[1].split(",")
me = jax.process_index()
FWD, BWD, BOTH = [(0, 1)], [(1, 0)], [(0, 1), (1, 0)]
STEPS = 5
mesh = jax.make_mesh((jax.device_count(),), ("x",))
OVER_MPI = jax.local_device_count() == 1
jax_cpu_mpi.configure(gpu_parity=False)  # a cycle in one psend (CPU only)


def barrier(name: str) -> None:
    multihost_utils.sync_global_devices(name)


def bare() -> tuple[int, int]:
    s = jax_cpu_mpi.stats()
    return s["mpi_bare_sends"], s["mpi_bare_receives"]


def bare_during(f, x, want, label: str) -> tuple[int, int]:
    """The messages sent and received bare while ``f(x)`` ran (all ranks start it together),
    once its result has been checked against ``want`` bit for bit."""
    barrier(label)
    before = bare()
    got = common.gather(f(x))
    after = bare()
    np.testing.assert_array_equal(got, want)
    return after[0] - before[0], after[1] - before[1]


def stepped(perm, ours: bool):
    """STEPS steps of: v <- 3 v + (v from the peer), int32 (wraps: every bit counts)."""

    def step(v, _):
        if ours:
            got = jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", perm),
                                    jax.ShapeDtypeStruct(v.shape, v.dtype), "x", perm)
        else:
            got = jax.lax.ppermute(v, "x", perm)
        return v * 3 + got, None

    def body(v):
        return jax.lax.scan(step, v, None, length=STEPS)[0]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))


def start(n: int, salt: int) -> jax.Array:
    value = (np.arange(jax.device_count() * n, dtype=np.int64) * 2654435761 + salt).astype(
        np.int32)
    return common.global_array(mesh, P("x"), value)


def run_paths() -> None:
    cases = [(FWD, n) for n in (4 << 10, 16 << 10, 256 << 10, 4 << 20)]
    cases += [(BWD, n) for n in (4 << 10, 256 << 10)]
    cases += [(BOTH, n) for n in (4 << 10, 16 << 10, 32 << 10, 128 << 10)]
    for perm, n in cases:  # n int32 elements a device: 16 KiB to 16 MiB
        ours, ref = stepped(perm, True), stepped(perm, False)
        x = start(n, len(perm) + n)
        want = common.gather(ref(x))
        ours.lower(x).compile()
        for call in (1, 2):
            sent, received = bare_during(ours, x, want, f"paths {perm} {n} {call}")
            # The messages this rank sent and received, framed (a cycle's from 256 KiB on
            # defer instead).
            framed = OVER_MPI and (4 * n < (256 << 10) if perm == BOTH else True)
            sends = STEPS if any(s == me for s, _ in perm) and framed else 0
            receives = STEPS if any(d == me for _, d in perm) and framed else 0
            # Each size's first call starts with a header (the channel's last was another
            # size's); its second call starts where the first left off.
            first = 1 if call == 1 else 0
            assert sent == max(sends - first, 0), (perm, n, call, sent, received)
            assert received == max(receives - first, 0), (perm, n, call, sent, received)
            print(f"ok   paths {perm} {4 * n} B call {call}: bare {sent} sent,"
                  f" {received} received", flush=True)


def run_changes() -> None:
    def sent(v, like):
        return jnp.broadcast_to(v.reshape(-1)[:1], like.shape).astype(like.dtype) + jnp.arange(
            like.size, dtype=like.dtype).reshape(like.shape)

    kinds = [jnp.zeros(4096, jnp.float32), jnp.zeros(4096, jnp.int32),
             jnp.zeros(8192, jnp.float32), jnp.zeros(4096, jnp.float32),
             jnp.zeros(4096, jnp.float32), jnp.zeros(16320, jnp.uint8),
             jnp.zeros(4096, jnp.float32), jnp.zeros(8, jnp.uint8), jnp.zeros(8, jnp.uint8)]

    def make(ours: bool):
        def step(v, _):
            total = v
            for like in kinds:  # each message after the last one's receive: in this order
                payload = sent(total, like)
                if ours:
                    got = jax_cpu_mpi.precv(jax_cpu_mpi.psend(payload, "x", FWD),
                                            jax.ShapeDtypeStruct(like.shape, like.dtype), "x",
                                            FWD)
                else:
                    got = jax.lax.ppermute(payload, "x", FWD)
                total = total * 5 + jnp.sum(got.astype(jnp.int32) * 7)
            return total, None

        def body(v):
            return jax.lax.scan(step, v, None, length=STEPS)[0]

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

    x = common.global_array(mesh, P("x"), np.arange(3, 3 + jax.device_count(), dtype=np.int32))
    want = common.gather(make(False)(x))
    ours = make(True)
    for call in (1, 2):
        n_sent, n_received = bare_during(ours, x, want, f"changes {call}")
        # Bare: the second float32[4096] in a row, once a step.
        count = n_sent if me == 0 else n_received
        assert count == (STEPS if OVER_MPI else 0), (call, n_sent, n_received)
        print(f"ok   changes call {call}: {count} bare", flush=True)


def run_mismatch() -> None:
    n = 16 << 10

    def make(send_n, want, ours=True):
        def body(v):
            payload = jnp.broadcast_to(v[:1], (send_n,)) + jnp.arange(send_n, dtype=v.dtype)
            if ours:
                got = jax_cpu_mpi.precv(jax_cpu_mpi.psend(payload, "x", FWD), want, "x", FWD)
            else:
                got = jax.lax.ppermute(payload, "x", FWD)
            return v + got.reshape(-1)[:2].astype(v.dtype)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

    x = common.global_array(mesh, P("x"), np.array([1, 2, 3, 4], dtype=np.float32))
    right = make(n, jax.ShapeDtypeStruct((n,), jnp.float32))
    want = common.gather(make(n, None, ours=False)(x))
    calls = [
        (right, None, 0),  # a header (another size's went last)
        (right, None, 1),  # bare
        (make(n, jax.ShapeDtypeStruct((n,), jnp.int32)),  # bare, refused: another dtype
         [f"expected int32[{n}]", f"sent float32[{n}]", f"the sender's float32[{n}]"], 1),
        (make(2 * n, jax.ShapeDtypeStruct((n,), jnp.float32)),  # a header, refused: size
         [f"expected float32[{n}] ({4 * n} bytes)", f"sent float32[{2 * n}] ({8 * n} bytes)"],
         0),
        (make(2 * n, jax.ShapeDtypeStruct((n,), jnp.float32)),  # bare, refused as above
         [f"expected float32[{n}] ({4 * n} bytes)", f"sent float32[{2 * n}] ({8 * n} bytes)"],
         1),
        (right, None, 0),  # a header again, right
        (right, None, 1),  # bare, right
    ]
    for i, (f, parts, bare_now) in enumerate(calls):
        barrier(f"mismatch {i}")
        before = bare()
        try:
            got = common.gather(f(x)) if parts is None else f(x).block_until_ready()
            assert parts is None or me == 0, f"call {i}: rank 1 must fail"
            if parts is None:
                np.testing.assert_array_equal(got, want)
        except jax.errors.JaxRuntimeError as e:
            assert me == 1 and parts is not None, (i, str(e))
            for part in parts:
                assert part in str(e), (i, part, str(e))
        barrier(f"mismatch {i} done")
        after = bare()
        count = after[0] - before[0] if me == 0 else after[1] - before[1]
        assert count == bare_now, (i, before, after)
        print(f"ok   mismatch call {i}: {count} bare", flush=True)


def run_timeout() -> None:
    """A precv of the last header's size that no psend matches (its receive was posted into
    its output before any message came): it times out, its receive is cancelled, and the
    channel's next message (bare) arrives right."""
    n = 8 << 10

    def hop(ours: bool):
        def body(v):
            payload = jnp.broadcast_to(v[:1], (n,)) * 3 + jnp.arange(n, dtype=v.dtype)
            if ours:
                got = jax_cpu_mpi.precv(jax_cpu_mpi.psend(payload, "x", FWD),
                                        jax.ShapeDtypeStruct((n,), v.dtype), "x", FWD)
            else:
                got = jax.lax.ppermute(payload, "x", FWD)
            return v + got[:2]

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

    def dangling(v):
        got = jax_cpu_mpi.precv(jax.lax.create_token(), jax.ShapeDtypeStruct((n,), v.dtype),
                                "x", FWD)
        return v + got[:2]

    x = common.global_array(mesh, P("x"), np.array([5, 6, 7, 8], dtype=np.float32))
    want = common.gather(hop(False)(x))
    ours = hop(True)
    for i in range(2):  # a header (another size's went last), then bare
        barrier(f"timeout before {i}")
        np.testing.assert_array_equal(common.gather(ours(x)), want)
    barrier("timeout dangling")
    before = bare()
    with config.overrides(recv_timeout=2):
        f = jax.jit(jax.shard_map(dangling, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        try:
            f(x).block_until_ready()
            assert me == 0, "rank 1's precv must time out"
        except jax.errors.JaxRuntimeError as e:
            assert me == 1 and "waited 2" in str(e), str(e)
    barrier("timeout dangling done")
    jax_cpu_mpi._jax_cpu_mpi.forget_refused_channels()  # nothing was left in the channel
    for i in range(2):  # bare, both
        barrier(f"timeout after {i}")
        np.testing.assert_array_equal(common.gather(ours(x)), want)
    after = bare()
    count = after[0] - before[0] if me == 0 else after[1] - before[1]
    assert count == 2, (before, after)
    print(f"ok   timeout: {count} bare after it", flush=True)


for case in CASES:
    {"paths": run_paths, "changes": run_changes, "mismatch": run_mismatch,
     "timeout": run_timeout}[case]()
    barrier(f"after {case}")
print("framed_header done", flush=True)
common.ok()
