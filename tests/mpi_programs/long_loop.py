"""10,000 psend/precv steps in one ``lax.scan``: values exact, memory flat, nothing piles up.

``long_loop.py local``: one process, 2 CPU devices (mailbox).
``long_loop.py mpi``: under ``mpirun -n 2`` with 2 devices per rank; the loop runs between
the first device of each rank (MPI).

Each step is a ping-pong: device 0 sends ``carry + step`` to device 1, which sends it back
plus one; the carry is int32, so the NumPy replay of the same data flow is exact. The
program runs once to warm up (compile, first allocations), then ``RUNS`` more times; after
each run it records VmRSS and the transport counters. It fails if resident memory grows by
more than ``RSS_SLACK`` over the runs after the warm-up, or if messages stay queued.
Under MPI it then dispatches independent programs back to back (no blocking in between), on
the same devices and on disjoint ones (the second device of each rank, so two device threads
of a process call MPI at once); payloads encode (program, call, source device) and every
received value is checked.
"""

# The device count must be set before JAX starts (local mode), hence imports below code.
# ruff: noqa: E402
from __future__ import annotations

import itertools
import os
import sys
import time

MODE = sys.argv[1]
if MODE == "local":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2")
    import jax

    import jax_cpu_mpi
else:
    import _mpi_common as common
    import jax
    from jax.experimental import multihost_utils

    import jax_cpu_mpi

import jax.numpy as jnp
import numpy as np
from _reliability import rss_bytes
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

STEPS = 10_000
WIDTH = 1024  # int32 -> 4 KiB per message
RUNS = 5
RSS_SLACK = 8 << 20
# Under AddressSanitizer (scripts/sanitize.sh) freed memory sits in a quarantine of
# hundreds of MiB, so resident memory is not a measure of leaks there: not checked.
UNDER_ASAN = "libasan" in os.environ.get("LD_PRELOAD", "")
FWD, BWD = [(0, 1)], [(1, 0)]

if MODE == "local":
    mesh = jax.make_mesh((2,), ("x",))
else:  # device k of each process
    by_process = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    meshes = [jax.sharding.Mesh(np.array([by_process[k], by_process[2 + k]]), ("x",))
              for k in range(2)]
    mesh = meshes[0]
spec = P("x")


def put(value: np.ndarray, on: jax.sharding.Mesh = mesh) -> jax.Array:
    if MODE == "local":
        return jax.device_put(value, NamedSharding(on, spec))
    return common.global_array(on, spec, value)


def local_shards(x: jax.Array) -> dict[int, np.ndarray]:
    """This process's shards by mesh position."""
    return {s.index[0].start // (x.shape[0] // 2): np.asarray(s.data)
            for s in x.addressable_shards}


def ping_pong(x):
    def step(carry, i):
        shape = jax.ShapeDtypeStruct(carry.shape, carry.dtype)
        # dev 1 gets dev 0's carry + i; dev 0 gets dev 1's a + 1
        a = jax_cpu_mpi.precv(jax_cpu_mpi.psend(carry + i, "x", FWD), shape, "x", FWD)
        b = jax_cpu_mpi.precv(jax_cpu_mpi.psend(a + 1, "x", BWD), shape, "x", BWD)
        return lax.pcast(a + b, "x", to="varying"), None

    out, _ = lax.scan(step, x, jnp.arange(STEPS, dtype=jnp.int32))
    return out


def replay(x0: np.ndarray, x1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same data flow in NumPy: device 0 and device 1 after STEPS steps."""
    c0, c1 = x0.astype(np.int64), x1.astype(np.int64)
    for i in range(STEPS):
        a1 = c0 + i  # device 1 receives; device 0 receives zeros
        b0 = a1 + 1  # device 0 receives; device 1 receives zeros
        c0, c1 = b0, a1
    return c0.astype(np.int32), c1.astype(np.int32)


def barrier(name: str) -> None:
    if MODE != "local":
        multihost_utils.sync_global_devices(name)


x_host = (np.arange(2 * WIDTH, dtype=np.int32) * 7) % 1000
x = put(x_host)
f = jax.jit(jax.shard_map(ping_pong, mesh=mesh, in_specs=spec, out_specs=spec))
want = dict(enumerate(replay(x_host[:WIDTH], x_host[WIDTH:])))


def run_once() -> float:
    start = time.perf_counter()
    got = local_shards(jax.block_until_ready(f(x)))
    seconds = time.perf_counter() - start
    for device, value in got.items():
        np.testing.assert_array_equal(value, want[device], err_msg=f"device {device}")
    return seconds


run_once()  # warm-up: compile, first buffers
barrier("warm")
rss = [rss_bytes()]
counters = [jax_cpu_mpi.stats()]
times = []
for _ in range(RUNS):
    times.append(run_once())
    barrier("run")
    rss.append(rss_bytes())
    counters.append(jax_cpu_mpi.stats())

growth = max(rss) - rss[0]
print(f"RESULT mode={MODE} process={jax.process_index()} steps={STEPS} runs={RUNS} "
      f"seconds_per_run={np.median(times):.2f} us_per_step={1e6 * np.median(times) / STEPS:.0f} "
      f"rss_mib_after_warmup={rss[0] / 2**20:.1f} rss_growth_kib={growth / 1024:.0f}",
      flush=True)
print("rss (MiB) after each run:", [round(r / 2**20, 2) for r in rss], flush=True)
print("stats after each run:", counters, flush=True)
assert UNDER_ASAN or growth <= RSS_SLACK, f"RSS grew by {growth} bytes over {RUNS} runs: {rss}"
for c in counters:
    assert c["mailbox_queued_messages"] == 0 and c["mailbox_queued_bytes"] == 0, c
    # Ping-pong: at most the last send of each direction is still counted (its completion
    # is noticed on the next MPI call).
    assert c["mpi_inflight_sends"] <= 1, c
    assert c["mpi_peak_inflight_bytes"] <= 2 * WIDTH * 4, c
if MODE != "local":
    sent = [c["mpi_sends_completed"] for c in counters]
    # Each run completes STEPS sends of this rank (give or take the one not yet noticed).
    assert all(abs(b - a - STEPS) <= 1 for a, b in itertools.pairwise(sent)), sent
if MODE == "local":
    print("JCM-OK", flush=True)
    sys.exit(0)
print("loop done", flush=True)


# Back-to-back dispatch of independent programs.
def payload(program: int, call: int) -> np.ndarray:
    """int32[2 * WIDTH]: device d's half encodes (program, call, d, element)."""
    device = np.repeat(np.arange(2), WIDTH)
    element = np.tile(np.arange(WIDTH), 2)
    return (program * 10**8 + call * 10**5 + device * 10**4 + element).astype(np.int32)


def transfer(v):
    shape = jax.ShapeDtypeStruct(v.shape, v.dtype)
    return jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", FWD), shape, "x", FWD)


CALLS = 8
# Programs 0 and 1 share mesh 0 (the same channels); program 2 runs on mesh 1.
plan = [(0, meshes[0]), (1, meshes[0]), (2, meshes[1])]
programs = {p: jax.jit(jax.shard_map(transfer, mesh=m, in_specs=spec, out_specs=spec))
            for p, m in plan}
inputs = {(p, c): put(payload(p, c), m) for p, m in plan for c in range(CALLS)}
for p, _ in plan:
    jax.block_until_ready(programs[p](inputs[p, 0]))  # compile outside the burst
barrier("compiled")
outputs = {}
for c in range(CALLS):  # interleaved, nothing blocks until all are dispatched
    for p, _ in plan:
        outputs[p, c] = programs[p](inputs[p, c])
for (p, c), out in outputs.items():
    for device, value in local_shards(out).items():
        want = payload(p, c)[:WIDTH] if device == 1 else np.zeros(WIDTH, np.int32)
        np.testing.assert_array_equal(value, want, err_msg=f"program {p}, call {c}")
print(f"{len(outputs)} back-to-back calls of {len(plan)} programs: every message matched",
      flush=True)
common.ok()
