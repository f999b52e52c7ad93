"""Programs with collectives jitted anew three times each, with JAX's persistent compilation
cache on: one whose psum stays on gloo (XLA's own collective), one whose psum goes over MPI.

``gloo_cache.py CACHE_DIR``. Every call must finish with the right sum: with jaxlib 0.12.1
a gloo program that process 0 loads from the cache waits forever in its psum
(``scripts/jax_cache_gloo_hang.py``), so jax_cpu_mpi compiles such programs anew there
(``runtime/gloo_cache.py``) and warns once. Process 0 prints how many of each program's
later calls it loaded from the cache (only process 0 can: JAX writes entries from process 0,
and on CPU the cache key differs between processes)."""

from __future__ import annotations

import sys
import warnings

import _mpi_common as common  # collectives on gloo unless configured otherwise
import jax
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_cpu_mpi
from jax_cpu_mpi._src import compat

jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

hits: list[str] = []
jax.monitoring.register_event_listener(
    lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits"
    else None)

n = jax.device_count()
mesh = jax.make_mesh((n,), ("x",))
x = common.global_array(mesh, P("x"), np.arange(n * 4, dtype=np.float32))
want = np.arange(n * 4, dtype=np.float32).reshape(n, 4).sum(0)


def calls(label: str, scale: float) -> int:
    """Three new jits of the same program; how many of the last two came from the cache."""
    loaded = 0
    for call in range(3):
        before = len(hits)
        f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x") * scale, mesh=mesh,
                                  in_specs=P("x"), out_specs=P("x")))
        got = common.gather(f(x)).reshape(n, 4)
        np.testing.assert_array_equal(got, np.broadcast_to(want * scale, (n, 4)),
                                      err_msg=f"{label} call {call}")
        loaded += call > 0 and len(hits) > before
    print(f"ok   {label}: 3 calls, right sums", flush=True)
    return loaded


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    gloo_loaded = calls("gloo psum", 2.0)
    jax_cpu_mpi.configure(collectives="mpi")
    mpi_loaded = calls("mpi psum", 3.0)
warned = sum(issubclass(w.category, jax_cpu_mpi.GlooCacheWarning) for w in caught)
guarded = compat.has_gloo_cache_hang(compat.jaxlib_version())
print(f"process {jax.process_index()}: jaxlib guarded {guarded}, later calls loaded from the "
      f"cache: gloo {gloo_loaded}, mpi {mpi_loaded}; GlooCacheWarnings {warned}", flush=True)
if jax.process_index() == 0:
    assert mpi_loaded == 2, "a program over MPI must keep loading from the cache"
    # Guarded: found in the cache, compiled anew (one warning); else loaded as JAX does.
    assert (gloo_loaded, warned) == ((0, 1) if guarded else (2, 0)), (gloo_loaded, warned)
common.ok()
