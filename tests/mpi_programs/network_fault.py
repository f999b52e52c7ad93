"""A psend/precv ping-pong loop between two hosts while the test injects a network fault.

``network_fault.py MODE`` under the two-host test bed (``tests/netns_hosts.py``), one rank
per host, one device each. Every rank runs jitted calls of a ``lax.scan`` of ping-pong hops
(rank 0 -> rank 1 -> rank 0, int32 payload, each value checked against a NumPy replay) and
prints ``JCM-LOOPING`` once the loop runs; the test then takes the link down, kills a rank,
or takes the link down and up again. Each rank prints ``JCM-CALLS n`` as calls complete, and
``JCM-LONGEST-CALL`` (the longest call, seconds) when its loop ends.

MODE:

* ``uncaught``: the loop runs until the fault makes a precv raise; the error is not caught
  (jax_cpu_mpi's abort-on-uncaught-exception ends the job).
* ``catch-exit``: the program catches the error, prints ``JCM-CAUGHT`` and the message, and
  calls ``sys.exit(1)``: the process must end within seconds with status 1.
* ``flap``: like ``catch-exit``, but the loop stops after ``JCM_FLAP_CALLS`` calls: the test
  takes the link down for less than the receive timeout and brings it back; the loop either
  completes every call with exact values (``JCM-OK``) or fails with a clear error.
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
HOPS = 50  # ping-pong hops per call
WIDTH = 256  # int32 -> 1 KiB per message
FWD, BWD = [(0, 1)], [(1, 0)]
me = jax.process_index()
mesh = jax.make_mesh((2,), ("x",))


def ping_pong(x):
    def hop(carry, i):
        there = lax.precv(lax.psend(carry + i, "x", FWD),
                          jax.ShapeDtypeStruct(carry.shape, carry.dtype), "x", FWD)
        back = lax.precv(lax.psend(there + 1, "x", BWD),
                         jax.ShapeDtypeStruct(carry.shape, carry.dtype), "x", BWD)
        return lax.pcast(back, "x", to="varying"), None

    out, _ = lax.scan(hop, x, jnp.arange(HOPS, dtype=jnp.int32))
    return out


def expected(carry: np.ndarray) -> np.ndarray:
    """Device 0's carry after one more call (device 1 relays, and ends with zeros)."""
    return carry + sum(i + 1 for i in range(HOPS))


f = jax.jit(jax.shard_map(ping_pong, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
start = np.zeros((2, WIDTH), np.int32)
x = common.global_array(mesh, P("x"), start)
limit = int(os.environ.get("JCM_FLAP_CALLS", "0")) if MODE == "flap" else None
print(f"process {me}: pid {os.getpid()} on {os.uname().nodename}", flush=True)


def loop() -> int:
    global x
    calls = 0
    want = start[0]
    longest = 0.0
    while limit is None or calls < limit:
        t = time.perf_counter()
        x = f(x)
        local = np.asarray(x.addressable_shards[0].data)[0]
        longest = max(longest, time.perf_counter() - t)
        want = expected(want)
        if me == 0:
            np.testing.assert_array_equal(local, want)
        calls += 1
        if calls == 3:
            print(f"process {me}: JCM-LOOPING at {time.time():.3f}", flush=True)
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
        sys.exit(1)
    print(f"process {me}: completed {calls} calls", flush=True)
    common.ok()
else:
    raise SystemExit(f"unknown mode {MODE}")
