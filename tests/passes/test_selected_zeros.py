"""Selected zeros: a precv whose result is only read elementwise writes no zeros.

On a device that is no destination of a precv's pairs, the result is zeros. Where every
user of the result fuses a select (an elementwise op, a ``jnp.where``, the update of a
dynamic_update_slice), the kept-operands pass (passes/selected_zeros.py) has the users read
``select(is_destination, result, 0)`` and marks the precv ``zero_fill = 0``: it then leaves
the output unwritten there. These tests pin where it applies (and where the precv must keep
filling), and that results equal ``lax.ppermute`` bit for bit on every path of the
in-process transport, both directions. Over MPI: tests/mpi_programs/p2p_semantics.py (the
two-op exchange's "combined" and "selected" forms, 8 B to 9 MiB).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cpu_mpi
from conftest import make_mesh
from jax_cpu_mpi import config
from jax_cpu_mpi._src.ffi import custom_calls as _custom_calls

UP, DOWN = [(0, 1)], [(1, 0)]


@pytest.fixture(autouse=True)
def no_parity_check():
    with config.overrides(gpu_parity=False):
        yield


def two_ops(v):
    """One psend/precv per direction: each device receives in one, gets zeros from the other."""
    like = jax.ShapeDtypeStruct(v.shape, v.dtype)
    tokens = [jax_cpu_mpi.psend(v, "x", pairs) for pairs in (UP, DOWN)]
    return [jax.lax.pcast(jax_cpu_mpi.precv(t, like, "x", pairs), "x", to="varying")
            for t, pairs in zip(tokens, (UP, DOWN), strict=True)]


def combined(v):
    up, down = two_ops(v)
    return up + 3 * down


def selected(v):
    up, down = two_ops(v)
    return jnp.where(jax.lax.axis_index("x") == 0, down, up)


def into_stash(v):
    """Each result written into a row of a buffer (a pipeline's stash)."""
    up, down = two_ops(v)
    stash = jnp.ones((2, *v.shape), v.dtype)
    stash = jax.lax.dynamic_update_index_in_dim(stash, up, 0, 0)
    return jax.lax.dynamic_update_index_in_dim(stash, down, 1, 0)


def returned(v):
    return tuple(two_ops(v))


def sliced(v):
    up, down = two_ops(v)
    return up[1:] + down[1:]


def spmd(body, mesh, outputs=1):
    out_specs = P("x") if outputs == 1 else tuple(P("x") for _ in range(outputs))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=out_specs))


def sharded(mesh, n, dtype):
    x = (np.arange(2 * n) % 251 + 1).astype(dtype)
    return jax.device_put(x, NamedSharding(mesh, P("x")))


def zero_fills(f, x) -> list[int]:
    """The zero_fill field of each precv of the lowered program, in program order."""
    fills = []
    for line in f.lower(x).as_text().splitlines():
        if "stablehlo.custom_call @jax_cpu_mpi_precv" in line:
            values = re.search(r"routing = dense<\[([-\d, ]+)\]>", line).group(1)
            fields = _custom_calls.unpack_routing(np.array([int(v) for v in values.split(",")]))
            fills.append(fields[_custom_calls.ZERO_FILL])
    return fills


@pytest.mark.parametrize("body, outputs, fills", [
    (combined, 1, [0, 0]),
    (selected, 1, [0, 0]),
    (into_stash, 1, [0, 0]),
    # The result itself leaves the program, or is sliced: the precv writes the zeros.
    (returned, 2, [1, 1]),
    (sliced, 1, [1, 1]),
])
def test_precvs_read_elementwise_write_no_zeros(body, outputs, fills):
    mesh = make_mesh((2, "x"))
    f = spmd(body, mesh, outputs)
    x = sharded(mesh, 16, np.float32)
    assert zero_fills(f, x) == fills
    assert ("stablehlo.select" in f.lower(x).as_text()) == (0 in fills) or body is selected


def test_a_result_also_used_otherwise_keeps_its_fill():
    mesh = make_mesh((2, "x"))

    def body(v):
        up, down = two_ops(v)
        return up + down, up  # up also leaves the program as it is

    f = spmd(body, mesh, 2)
    assert zero_fills(f, sharded(mesh, 16, np.float32)) == [1, 0]


def test_a_complex_result_keeps_its_fill():
    mesh = make_mesh((2, "x"))
    x = jax.device_put(np.arange(4, dtype=np.complex64), NamedSharding(mesh, P("x")))
    assert zero_fills(spmd(combined, mesh), x) == [1, 1]


# 8 B, 64 KiB, and 1 MiB (the in-process transport's sizes alike: one copy between the
# device threads), uint8 and float32 (-0.0 and NaN stay as they are: a select, not
# arithmetic, gives the zeros).
@pytest.mark.parametrize("nbytes", [8, 64 << 10, 1 << 20])
@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
@pytest.mark.parametrize("body", [combined, selected, into_stash])
def test_equals_ppermute(body, dtype, nbytes):
    mesh = make_mesh((2, "x"))
    n = nbytes // np.dtype(dtype).itemsize
    x = sharded(mesh, n, dtype)
    if dtype == np.float32:
        x = jax.device_put(np.where(np.arange(2 * n) % 7 == 0, -0.0, np.asarray(x))
                           .astype(dtype), NamedSharding(mesh, P("x")))

    def reference(v):
        up = jax.lax.ppermute(v, "x", UP)
        down = jax.lax.ppermute(v, "x", DOWN)
        if body is combined:
            return up + 3 * down
        if body is selected:
            return jnp.where(jax.lax.axis_index("x") == 0, down, up)
        stash = jnp.ones((2, *v.shape), v.dtype)
        stash = jax.lax.dynamic_update_index_in_dim(stash, up, 0, 0)
        return jax.lax.dynamic_update_index_in_dim(stash, down, 1, 0)

    f = spmd(body, mesh)
    assert zero_fills(f, x) == [0, 0]
    # Earlier calls leave their values in the buffers XLA hands the next call's precvs.
    for _ in range(3):
        got, want = np.asarray(f(x)), np.asarray(spmd(reference, mesh)(x))
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_in_a_scan_equals_ppermute():
    """Each step's results read into the next step's message: the buffers reused from step
    to step held other values before."""
    mesh = make_mesh((2, "x"))

    def steps(exchange):
        def body(v):
            return jax.lax.scan(lambda c, _: (exchange(c) + 1, None), v, None, length=4)[0]
        return spmd(body, mesh)

    def reference(v):
        return (jax.lax.ppermute(v, "x", UP) + 3 * jax.lax.ppermute(v, "x", DOWN))

    x = sharded(mesh, 64 << 10, np.int32)
    f = steps(combined)
    assert zero_fills(f, x) == [0, 0]
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(steps(reference)(x)))


def test_a_cycle_keeps_its_fill_flag():
    """Every device receives: nothing to select, the call is left as it was."""
    mesh = make_mesh((2, "x"))

    def body(v):
        like = jax.ShapeDtypeStruct(v.shape, v.dtype)
        y = jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", UP + DOWN), like, "x", UP + DOWN)
        return jax.lax.pcast(y, "x", to="varying") + 1

    f = spmd(body, mesh)
    x = sharded(mesh, 16, np.float32)
    assert zero_fills(f, x) == [1]
    assert "stablehlo.select" not in f.lower(x).as_text()
