"""Cost of a vmapped ``all_gather(to='reduced')`` against one unbatched gather of the same bytes.

Not a test: a quick measurement for the batching rules of jax_cpu_mpi. Four programs gather
B blocks of ``n`` float32 per device over a 1-D mesh ``'x'`` (inside ``shard_map``):

* ``vmap``   ``vmap`` of a reduced gather over the B blocks (our batching rule: ONE gather
             of the stacked operand, then a local transpose to put the batch first);
* ``single`` one reduced gather of the same B*n elements (the floor);
* ``map``    ``lax.map`` of the reduced gather: B gathers of n elements each;
* ``plain``  ``vmap`` of a plain (varying) ``all_gather``, batched by JAX's own rule.

Each program casts the gathered value back to varying (a no-op at run time) so that all four
have the same output (``lax.map`` cannot stack reduced values).

Usage (one process, 4 CPU devices)::

    python benchmarks/batched_reduced_gather.py
    mpirun -n 2 python benchmarks/batched_reduced_gather.py --mpi   # 1 device per rank
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mpi", action="store_true", help="under mpirun: one device per rank")
    parser.add_argument("--devices", type=int, default=4, help="devices (without --mpi)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--sizes", default="256,16384,262144",
                        help="floats per block and device, comma-separated")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if not args.mpi:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.devices}")
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if args.mpi:
        jax.distributed.initialize(cluster_detection_method="mpi4py")
    import jax_cpu_mpi  # noqa: F401  (installs the batching rules)

    devices = jax.devices() if args.mpi else jax.devices()[:args.devices]
    mesh = jax.make_mesh((len(devices),), ("x",), devices=devices)
    d, b = len(devices), args.batch

    def gather(w):
        return jax.lax.pcast(jax.lax.all_gather(w, "x", tiled=True, to="reduced"), "x",
                             to="varying")

    def program(body, in_spec):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=P("x")))

    def plain(w):
        return jax.lax.all_gather(w, "x", tiled=True)

    programs = {
        "vmap": (program(jax.vmap(gather), P(None, "x")), lambda n: (b, d * n)),
        "plain": (program(jax.vmap(plain), P(None, "x")), lambda n: (b, d * n)),
        "single": (program(gather, P("x")), lambda n: (d * b * n,)),
        "map": (program(lambda w: jax.lax.map(gather, w), P(None, "x")), lambda n: (b, d * n)),
    }

    def timed(fn, x) -> float:
        """Best of ``repeats`` (the machine may be shared: the minimum is the steadiest)."""
        jax.block_until_ready(fn(x))  # compile and warm up
        samples = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x))
            samples.append(time.perf_counter() - t0)
        return min(samples)

    lead = jax.process_index() == 0
    if lead:
        print(f"{d} devices ({'mpirun' if args.mpi else 'one process'}), batch {b}, "
              f"best of {args.repeats}")
        print(f"{'bytes/device':>13} {'vmap (us)':>10} {'single (us)':>12} {'map (us)':>10} "
              f"{'plain (us)':>11} {'vmap/single':>12} {'map/single':>11} "
              f"{'plain/single':>13}")
    for n in (int(s) for s in args.sizes.split(",")):
        times = {}
        for name, (fn, shape) in programs.items():
            spec = P(None, "x") if len(shape(n)) == 2 else P("x")
            value = np.ones(shape(n), np.float32)
            x = jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec),
                                             lambda i, v=value: v[i])
            times[name] = timed(fn, x)
        if lead:
            us = {k: 1e6 * v for k, v in times.items()}
            print(f"{4 * b * n:>13} {us['vmap']:>10.1f} {us['single']:>12.1f} {us['map']:>10.1f} "
                  f"{us['plain']:>11.1f} {us['vmap'] / us['single']:>12.2f} "
                  f"{us['map'] / us['single']:>11.2f} {us['plain'] / us['single']:>13.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
