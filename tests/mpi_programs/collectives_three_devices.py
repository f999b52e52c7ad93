"""Collectives over MPI with 3 devices per process, each led by the third device.

Run by tests/runtime/test_collectives_mpi.py under ``mpirun -n 2`` with 3 devices per
process. The group's devices in a process meet, and the last to arrive leads: it reduces or
packs every local operand. collectives_cases.py runs 1 and 2 devices per process, where
the leader is the first or second of its process; a leader at position 2 or later reduced
the all-reduce into its own operand's buffer (the result is aliased to the operand) before
reading that operand, so every psum it led was wrong. Here the third device of each
process spins before each collective (its operand depends on the previous collective's
result, so the spin cannot move earlier) and so arrives last and leads. Every result is
checked against NumPy, exactly (integers), on every device, in each of a few calls of the
compiled program. Prints one line per case, then JCM-OK.
"""

import _mpi_common as common
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_cpu_mpi import config

config.configure(collectives="mpi")
n = jax.device_count()
per = n // jax.process_count()
assert per == 3, f"this program needs 3 devices per process, not {per}"
# Process after process, so that axis index i % 3 is the device's position in its process.
devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
mesh = Mesh(np.array(devices), ("x",))
TURNS = 200  # 32x32 products: long enough for the other two devices to arrive first
CALLS = 4


def _late(x: jax.Array, after: jax.Array) -> jax.Array:
    """``x`` unchanged, once the third device of each process has spun for a while, after
    ``after`` (a float scalar of the previous collective's result) is known."""
    turns = jnp.where(jax.lax.axis_index("x") % per == per - 1, TURNS, 0)
    m = jnp.full((32, 32), 0.01, jnp.float32) + 0 * after
    _, w = jax.lax.while_loop(lambda c: c[0] < turns,
                              lambda c: (c[0] + 1, jnp.tanh(c[1] @ m)), (0, m))
    return x + (0 * jnp.sum(w)).astype(x.dtype)


GROUPS = [[0, 2, 4], [5, 3, 1]]  # 2 + 1 members per process, out of order
# name -> (function of the shard, NumPy of device i from all operands, operand shape)
CASES = {
    "psum int32[64]": (lambda x: jax.lax.psum(x, "x"), lambda v, i: v.sum(0), (64,)),
    "psum int32[3,5]": (lambda x: jax.lax.psum(x, "x"), lambda v, i: v.sum(0), (3, 5)),
    "pmax int32[64]": (lambda x: jax.lax.pmax(x, "x"), lambda v, i: v.max(0), (64,)),
    "psum int32[8192] (MPI_Iallreduce)": (lambda x: jax.lax.psum(x, "x"),
                                          lambda v, i: v.sum(0), (8192,)),
    "psum axis_index_groups": (
        lambda x: jax.lax.psum(x, "x", axis_index_groups=GROUPS),
        lambda v, i: sum(v[j] for g in GROUPS if i in g for j in g), (16,)),
    "all_gather tiled": (lambda x: jax.lax.all_gather(x, "x", tiled=True),
                         lambda v, i: np.concatenate(list(v)), (8,)),
    "psum_scatter tiled": (lambda x: jax.lax.psum_scatter(x, "x", tiled=True),
                           lambda v, i: np.split(v.sum(0), n)[i], (n * 4,)),
    # More than 4 KiB per device: point-to-point partial sums between the processes.
    "psum_scatter tiled (point-to-point)": (
        lambda x: jax.lax.psum_scatter(x, "x", tiled=True),
        lambda v, i: np.split(v.sum(0), n)[i], (n * 4096,)),
    "psum_scatter axis_index_groups (point-to-point)": (
        lambda x: jax.lax.psum_scatter(x, "x", axis_index_groups=GROUPS, tiled=True),
        lambda v, i: np.split(sum(v[j] for j in next(g for g in GROUPS if i in g)), 3)[
            next(g for g in GROUPS if i in g).index(i)], (3 * 8192,)),
    "all_to_all split=0 concat=0 (in place)": (
        lambda x: jax.lax.all_to_all(x, "x", 0, 0, tiled=True),
        lambda v, i: np.concatenate([np.split(v[j], n)[i] for j in range(n)]), (n * 4,)),
    "all_to_all split=0 concat=1": (
        lambda x: jax.lax.all_to_all(x, "x", 0, 1, tiled=True),
        lambda v, i: np.concatenate([np.split(v[j], n)[i] for j in range(n)], axis=1),
        (n * 2, 3)),
}
rng = np.random.default_rng(3)
operands = {k: rng.integers(-1000, 1000, (n, *shape), dtype=np.int32)
            for k, (_, _, shape) in CASES.items()}


def body(tree):
    after = jnp.float32(0)
    outs = {}
    for k in CASES:  # in this order, each after the one before
        r = CASES[k][0](_late(tree[k][0], after))
        after = jnp.sum(r).astype(jnp.float32)
        outs[k] = r[None]
    return outs


f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                          check_vma=False))  # psum with groups needs check_vma=False
x = {k: common.global_array(mesh, P("x"), v) for k, v in operands.items()}
wrong = {k: 0 for k in CASES}
for _ in range(CALLS):
    got = jax.block_until_ready(f(x))
    for k, (_, ref, _) in CASES.items():
        g = common.gather_over_mpi(got[k])  # no program per shape
        want = np.stack([ref(operands[k], i) for i in range(n)])
        wrong[k] += int(g.shape != want.shape or not np.array_equal(g, want))
failed = False
for k, w in wrong.items():
    if w:
        failed = True
        print(f"FAIL {k}: wrong in {w} of {CALLS} calls", flush=True)
    else:
        print(f"ok   mpi  {k}, 3 devices per process, {CALLS} calls", flush=True)
if not failed:
    common.ok()
