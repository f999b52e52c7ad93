"""jax_cpu_mpi's batching rules across processes: every device of the job is one member.

Run by tests/batching/test_batching.py under ``mpirun -n 2`` (two devices per rank: a 4-device mesh
whose collectives and messages cross the process boundary). Prints one line per check,
then JCM-OK.
"""

import sys

import _mpi_common as common
import batching_cases as cases
import jax
import numpy as np

mesh = jax.make_mesh((jax.device_count(),), ("x",))
gather = common.gather
failures: list[str] = []


def check(rows):
    for name, got, want in rows:
        try:
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
            print(f"ok   {name}", flush=True)
        except AssertionError as e:
            failures.append(name)
            print(f"FAIL {name}: {e}", flush=True)


def check_count(name, got, want):
    if got == want:
        print(f"ok   {name}: {got}", flush=True)
    else:
        failures.append(name)
        print(f"FAIL {name}: {got}, want {want}", flush=True)


check(cases.reduced_gather(mesh, gather, axis=0, tiled=True, in_axes=0))
check(cases.reduced_gather(mesh, gather, axis=1, tiled=False, in_axes=1))
check(cases.vmap_grad(mesh, gather, axis=0, tiled=True, batch_w=True, batch_d=True))
check(cases.vmap_grad(mesh, gather, axis=1, tiled=False, batch_w=False, batch_d=True))
check(cases.unreduced_scatter(mesh, gather, tiled=True, in_axes=1))
check(cases.mixed_axes_gather(mesh, gather, names=("a", "x"), tiled=True))
check(cases.mixed_axes_scatter(mesh, gather, names=("x", "a"), tiled=False))
check(cases.p2p_batched(mesh, gather, in_axes=0))
check(cases.p2p_unbatched_operand(mesh, gather))
check_count("one all_gather_reduced in vmap", cases.reduced_gather_count(
    mesh, axis=0, tiled=True), 1)
check_count("one gather and one scatter in vmap(grad)", cases.vmap_grad_counts(
    mesh, axis=0, tiled=True), (1, 1))
check_count("one psend, one precv, token result", cases.p2p_counts(mesh),
            {"psend": 1, "precv": 1, "ppermute": 0, "non_token_psend": 0})

if failures:
    print(f"{len(failures)} failed: {failures}", flush=True)
    sys.exit(1)
common.ok()
