"""jax.vmap from outside a reduced/unreduced shard_map, across processes (issue 28).

Run by tests/batching/test_batching_outer_vmap.py under ``mpirun -n 2`` (two devices per rank: the
4-device mesh's collectives cross the process boundary). Prints one line per check, then
JCM-OK.
"""

import sys

import _mpi_common as common
import jax
import numpy as np
import outer_vmap_cases as cases

gather = common.gather
failures: list[str] = []


def check(rows):
    for name, got, want in rows:
        try:
            assert got.shape == want.shape, (got.shape, want.shape)
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
            print(f"ok   {name}", flush=True)
        except AssertionError as e:
            failures.append(name)
            print(f"FAIL {name}: {e}", flush=True)


n = jax.device_count()
mesh = cases.explicit_mesh((n,), ("x",))
mesh2 = cases.explicit_mesh((2, n // 2), ("y", "x"))
with jax.set_mesh(mesh):
    check(cases.reduced_in_specs(mesh, gather, in_axes=(1, 2), out_axes=2))
    check(cases.reduced_in_specs(mesh, gather, in_axes=(None, 0)))
    check(cases.vmap_grad_reduced(mesh, gather, in_axes=(0, 0)))
    check(cases.unreduced_out_specs(mesh, gather, in_axes=(None, 1), out_axes=1))
    check(cases.psum_of_unreduced(mesh, gather, in_axes=(0, 0)))
    check(cases.scan_of_vmap(mesh, gather))
    check(cases.grad_accumulation(mesh, gather, in_axes=(0, 0)))
    check(cases.grad_accumulation(mesh, gather, in_axes=(None, 0)))
    check(cases.microbatch_grads_by_vmap(mesh, gather))
    try:
        cases.refused_spmd_over_reduced_axis(mesh)()
        failures.append("refusal")
        print("FAIL spmd_axis_name over a reduced axis was not refused", flush=True)
    except ValueError as e:
        print(f"ok   refused: {str(e)[:80]}", flush=True)
with jax.set_mesh(mesh2):
    if tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 12):
        # JAX 0.12's own lowering of spmd_axis_name on an Explicit mesh fails, plain specs too
        check(cases.spmd_axis_name(mesh2, gather))

if failures:
    print(f"{len(failures)} failed: {failures}", flush=True)
    sys.exit(1)
common.ok()
