"""A psend/precv program compiled into JAX's persistent compilation cache, then loaded back.

``cached_p2p.py MODE CACHE_DIR EXPECT``: MODE ``local`` (one process, 4 CPU devices, run
directly) or ``mpi`` (``mpirun -n 2``, 2 devices per rank: mailbox and MPI hops); EXPECT
``compile`` (first run: the program is compiled) or ``hit`` (a later process: it must come
from the cache). Either way the loaded executable must move the right bytes: the
executable holds no communicator, pointer or process-local handle, only routing tables.

Under MPI only process 0 can hit: JAX writes cache entries from process 0 only, and on CPU
its cache key includes a topology fingerprint that differs between processes, so process 1
compiles afresh in every job. Process 0 then runs the executable it loaded from disk
against process 1's fresh one: the bytes must still arrive.
"""

# The device count must be set before JAX starts (local mode), hence imports below code.
# ruff: noqa: E402
from __future__ import annotations

import logging
import os
import sys

MODE, CACHE_DIR, EXPECT = sys.argv[1:4]
if MODE == "local":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4")
    import jax
else:
    import _mpi_common as common
    import jax

import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cpu_mpi

jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


class CacheLog(logging.Handler):
    """Records JAX's persistent-cache hit/miss log lines by module name."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.hits: list[str] = []
        self.misses: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.startswith("Persistent compilation cache hit for"):
            self.hits.append(text.split("'")[1])
        elif text.startswith("PERSISTENT COMPILATION CACHE MISS for"):
            self.misses.append(text.split("'")[1])


cache_log = CacheLog()
compiler_logger = logging.getLogger("jax._src.compiler")  # where JAX logs cache hits/misses
compiler_logger.addHandler(cache_log)
compiler_logger.setLevel(logging.DEBUG)
hit_events = []
jax.monitoring.register_event_listener(
    lambda event, **kw: hit_events.append(event)
    if event == "/jax/compilation_cache/cache_hits" else None)

N, WIDTH = 4, 8
mesh = jax.make_mesh((N,), ("x",))
forward = [(i, i + 1) for i in range(N - 1)]
backward = [(i + 1, i) for i in range(N - 1)]


def cached_exchange(x):
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    right = jax_cpu_mpi.precv(jax_cpu_mpi.psend(x, "x", forward), shape, "x", forward)
    left = jax_cpu_mpi.precv(jax_cpu_mpi.psend(x * 10, "x", backward), shape, "x", backward)
    return right + left


value = np.arange(N * WIDTH, dtype=np.int32) + 1
if MODE == "local":
    x = jax.device_put(value, NamedSharding(mesh, P("x")))
else:
    x = common.global_array(mesh, P("x"), value)
f = jax.jit(jax.shard_map(cached_exchange, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
out = f(x)
blocks = value.reshape(N, WIDTH)
want = np.zeros_like(blocks)
want[1:] += blocks[:-1]  # from the left neighbour
want[:-1] += 10 * blocks[1:]  # from the right neighbour
for shard in out.addressable_shards:
    device = shard.index[0].start // WIDTH
    np.testing.assert_array_equal(np.asarray(shard.data), want[device], err_msg=f"{device}")

ours = "jit_cached_exchange"
print(f"cache: hits {cache_log.hits}, misses {cache_log.misses}, "
      f"hit events {len(hit_events)}, files {sorted(os.listdir(CACHE_DIR))}", flush=True)
if EXPECT == "compile":
    assert ours in cache_log.misses and ours not in cache_log.hits, cache_log.__dict__
elif jax.process_index() == 0:
    assert ours in cache_log.hits and ours not in cache_log.misses, cache_log.__dict__
    assert hit_events, "JAX recorded no persistent cache hit"
outcome = "loaded from the cache" if ours in cache_log.hits else "compiled"
print(f"process {jax.process_index()}: {ours} {outcome}, results correct", flush=True)
if MODE == "local":
    print("JCM-OK", flush=True)
else:
    common.ok()
