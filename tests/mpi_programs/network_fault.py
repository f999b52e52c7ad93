"""A psend/precv ping-pong loop between two hosts while the test injects a network fault.

``network_fault.py MODE [BYTES [DIRECTION]]`` under the two-host test bed
(``tests/netns_hosts.py``), one rank per host, one device each. Every rank runs jitted calls
of a ``lax.scan`` of ping-pong hops (rank 0 -> rank 1 -> rank 0, int32 payload, each value
checked against a NumPy replay) and prints ``JCM-LOOPING`` once the loop runs; the test then
takes the link down, kills a rank, or takes the link down and up again. Each rank prints
``JCM-CALLS n`` as calls complete, and ``JCM-LONGEST-CALL`` (the longest call, seconds) when
its loop ends.

BYTES (default 1024, a multiple of 4) is the size of the message, which picks the transport's
path: below 16 KiB copy-and-Isend; from 16 KiB (the precv of each hop keeps its psend's
operand) the rendezvous (direct from the operand when the receiver is ready first, else
staged); staged messages of 4 MiB or more are chunked.
DIRECTION says which way the BYTES go:

* ``pingpong`` (default): both hops carry BYTES;
* ``0to1``: BYTES from rank 0 to rank 1, and a 4-byte reply back (so a link that dies
  mid-message most likely dies while rank 1, on the other host, is receiving);
* ``1to0``: a 4-byte ping from rank 0, BYTES back from rank 1 (the receiver then is rank 0,
  on the launcher's host).

``JCM-LOOPING`` and ``JCM-CAUGHT`` come with ``JCM-STATS`` (the transport's counters:
direct or staged sends so far) and, after a caught error, ``JCM-BROKEN`` (job_broken()).

MODE:

* ``uncaught``: the loop runs until the fault makes a precv raise; the error is not caught
  (jax_cpu_mpi's abort-on-uncaught-exception ends the job).
* ``catch-exit``: the program catches the error, prints ``JCM-CAUGHT`` and the message, and
  calls ``sys.exit(1)``: the process must end within seconds with status 1.
* ``flap``: like ``catch-exit``, but the loop ends: the test takes the link down for less
  than the receive timeout, brings it back, then creates the file ``JCM_FLAP_UNTIL``; the
  loop runs until rank 0 sees that file (every 10th call rank 0 tells rank 1 over psend/precv
  whether it has, so both stop after the same call), then 20 calls more, at most
  ``JCM_FLAP_CALLS`` calls in all. So the outage always falls inside the loop, however fast
  or slow the calls run. The loop either completes every call with exact values
  (``JCM-OK``) or fails with a clear error.
"""

from __future__ import annotations

import os
import sys
import time

import _mpi_common as common
import jax
import jax.numpy as jnp
import numpy as np
from _mpi_common import P
from jax import lax

MODE = sys.argv[1]
BYTES = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
DIRECTION = sys.argv[3] if len(sys.argv) > 3 else "pingpong"
if BYTES < 4 or BYTES % 4 or DIRECTION not in ("pingpong", "0to1", "1to0"):
    raise SystemExit(f"bad BYTES {BYTES} or DIRECTION {DIRECTION}")
HOPS = 50  # ping-pong hops per call
WIDTH = BYTES // 4  # int32 per carry (the 1 KiB default: 256)
# Elements of the ping (rank 0 -> 1) and the reply (rank 1 -> 0).
PING = 1 if DIRECTION == "1to0" else WIDTH
PONG = 1 if DIRECTION == "0to1" else WIDTH
FWD, BWD = [(0, 1)], [(1, 0)]
me = jax.process_index()
mesh = jax.make_mesh((2,), ("x",))


def ping_pong(x):
    def hop(carry, i):
        if DIRECTION == "pingpong":
            there = lax.precv(lax.psend(carry + i, "x", FWD),
                              jax.ShapeDtypeStruct(carry.shape, carry.dtype), "x", FWD)
            back = lax.precv(lax.psend(there + 1, "x", BWD),
                             jax.ShapeDtypeStruct(carry.shape, carry.dtype), "x", BWD)
            return lax.pcast(back, "x", to="varying"), None
        # One way BYTES, the other 4 bytes. Device 0's carry stays uniform (every element
        # equal), so carry + (reply - carry[0, 0]) is the ping-pong's carry + i + 1.
        row = carry[0]  # this device's shard is one row of WIDTH
        there = lax.precv(lax.psend(row[:PING] + i, "x", FWD),
                          jax.ShapeDtypeStruct((PING,), carry.dtype), "x", FWD)
        reply = jnp.broadcast_to(there[:1] + 1, (PONG,))
        back = lax.precv(lax.psend(reply, "x", BWD),
                         jax.ShapeDtypeStruct((PONG,), carry.dtype), "x", BWD)
        return carry + (back - row[0]), None

    out, _ = lax.scan(hop, x, jnp.arange(HOPS, dtype=jnp.int32))
    return out


def expected(carry: np.ndarray) -> np.ndarray:
    """Device 0's carry after one more call (device 1 relays, and ends with zeros)."""
    return carry + sum(i + 1 for i in range(HOPS))


def rank0_flag(v):
    """Rank 0's value on both devices (device 1's own value is 0)."""
    got = lax.precv(lax.psend(v, "x", FWD), jax.ShapeDtypeStruct(v.shape, v.dtype), "x", FWD)
    return v + got


f = jax.jit(jax.shard_map(ping_pong, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
share_flag = jax.jit(jax.shard_map(rank0_flag, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
start = np.zeros((2, WIDTH), np.int32)
x = common.global_array(mesh, P("x"), start)
limit = int(os.environ.get("JCM_FLAP_CALLS", "0")) if MODE == "flap" else None
until = os.environ.get("JCM_FLAP_UNTIL") if MODE == "flap" else None
FLAG_EVERY, CALLS_AFTER_FLAG = 10, 20


def told_to_stop() -> bool:
    """Whether rank 0 has seen the file ``until``, the same answer on both ranks."""
    mine = int(me == 0 and os.path.exists(until))
    flag = share_flag(common.global_array(mesh, P("x"), np.array([[mine], [0]], np.int32)))
    return bool(np.asarray(flag.addressable_shards[0].data)[0, 0])
print(f"process {me}: pid {os.getpid()} on {os.uname().nodename}, {BYTES} bytes {DIRECTION}",
      flush=True)


def stats() -> str:
    from jax_cpu_mpi import _jax_cpu_mpi

    d = _jax_cpu_mpi.stats()
    keys = ("mpi_direct_sends", "mpi_staged_large_sends", "mpi_sends_completed",
            "mpi_inflight_sends", "kept_sends")
    return " ".join(f"{k}={d[k]}" for k in keys)


def loop() -> int:
    global x
    calls = 0
    want = start[0]
    longest = 0.0
    stop_at = None
    while (limit is None or calls < limit) and (stop_at is None or calls < stop_at):
        t = time.perf_counter()
        x = f(x)
        local = np.asarray(x.addressable_shards[0].data)[0]
        if until and stop_at is None and calls % FLAG_EVERY == 0 and told_to_stop():
            stop_at = calls + CALLS_AFTER_FLAG
        longest = max(longest, time.perf_counter() - t)  # the flag's exchange included
        want = expected(want)
        if me == 0:
            np.testing.assert_array_equal(local, want)
        calls += 1
        if calls == 3:
            print(f"process {me}: JCM-LOOPING at {time.time():.3f}", flush=True)
            print(f"process {me}: JCM-STATS {stats()}", flush=True)
        if calls % 100 == 0:
            print(f"process {me}: JCM-CALLS {calls}", flush=True)
    print(f"process {me}: JCM-LONGEST-CALL {longest:.3f} s", flush=True)
    return calls


if MODE == "uncaught":
    loop()
elif MODE in ("catch-exit", "flap"):
    t0 = time.time()
    try:
        calls = loop()
    except jax.errors.JaxRuntimeError as e:
        print(f"process {me}: JCM-CAUGHT at {time.time():.3f} after {time.time() - t0:.1f} s: "
              f"{e}", flush=True)
        from jax_cpu_mpi import _jax_cpu_mpi

        print(f"process {me}: JCM-STATS {stats()}", flush=True)
        print(f"process {me}: JCM-BROKEN {_jax_cpu_mpi.job_broken()}", flush=True)
        sys.exit(1)
    print(f"process {me}: completed {calls} calls", flush=True)
    common.ok()
else:
    raise SystemExit(f"unknown mode {MODE}")
