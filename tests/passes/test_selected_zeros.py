"""Selected zeros: a precv whose result is only read elementwise writes no zeros.

On a device that is no destination of a precv's pairs, the result is zeros. Where every
user of the result fuses a select (an elementwise op, a ``jnp.where``, the update of a
dynamic_update_slice), the kept-operands pass (passes/selected_zeros.py) has the users read
``select(is_destination, result, 0)`` and marks the precv ``zero_fill = 0``: it then leaves
the output unwritten there. These tests pin where it applies (and where the precv must keep
filling), and that results equal ``lax.ppermute`` bit for bit on every path of the
in-process transport, both directions. Over MPI: tests/mpi_programs/p2p_semantics.py (the
two-op exchange's "combined" and "selected" forms, 8 B to 9 MiB).

A precv under ``precv_unread_off_destinations`` (its caller reads nothing of a
non-destination's result: the pipeline executor) is marked without a select.
"""

from __future__ import annotations

import functools
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
from jax_cpu_mpi._src.ops import p2p

UP, DOWN = [(0, 1)], [(1, 0)]


@pytest.fixture(autouse=True)
def no_parity_check():
    # Poison mode: a precv that leaves its output unwritten (zero_fill = 0) writes poison
    # there instead, so that a read without the select shows (the buffer would often hold
    # the zeros of an earlier fill, such as the first step's in a loop carry).
    with config.overrides(gpu_parity=False, poison_uninitialized=True):
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


def signed_zeros_input(mesh, nbytes: int, dtype) -> jax.Array:
    """``nbytes`` per device of ``dtype``; as float32 with every 7th element -0.0 (a select,
    not arithmetic, must give the zeros: -0.0 and NaN stay as they are)."""
    n = nbytes // np.dtype(dtype).itemsize
    x = sharded(mesh, n, dtype)
    if dtype == np.float32:
        x = jax.device_put(np.where(np.arange(2 * n) % 7 == 0, -0.0, np.asarray(x))
                           .astype(dtype), NamedSharding(mesh, P("x")))
    return x


# 8 B, 64 KiB, and 1 MiB (the in-process transport's sizes alike: one copy between the
# device threads), uint8 and float32 (-0.0 and NaN stay as they are: a select, not
# arithmetic, gives the zeros).
@pytest.mark.parametrize("nbytes", [8, 64 << 10, 1 << 20])
@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
@pytest.mark.parametrize("body", [combined, selected, into_stash])
def test_equals_ppermute(body, dtype, nbytes):
    mesh = make_mesh((2, "x"))
    x = signed_zeros_input(mesh, nbytes, dtype)

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
    want = np.asarray(spmd(reference, mesh)(x))  # one compilation, not one per call
    # Earlier calls leave their values in the buffers XLA hands the next call's precvs.
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(x)).view(np.uint8), want.view(np.uint8))


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


def carried(v, steps=3, *, read=False, start=None):
    """``psend2/scan``'s form: each op's result in the loop carry (the first step before the
    loop), the two combined after it. ``read``: each step's message also adds the carried
    results; ``start``: the carry starts from these arrays instead of the first step's."""
    def step(carry, _):
        message, (up, down) = carry
        if read:
            message = message + up + down
        return (carry[0], tuple(two_ops(jax.lax.optimization_barrier(message)))), None

    first = tuple(two_ops(v)) if start is None else start
    (_, (up, down)), _ = jax.lax.scan(step, (v, first), None, length=steps - 1)
    return up + 3 * down


def carried_out(v):
    """The carried results leave the program as they are."""
    def step(carry, _):
        return (carry[0], tuple(two_ops(jax.lax.optimization_barrier(carry[0])))), None

    return jax.lax.scan(step, (v, tuple(two_ops(v))), None, length=2)[0][1]


def carried_tested(v):
    """The loop's condition reads one carried result."""
    def step(carry):
        i, message, _ = carry
        return i + 1, message, tuple(two_ops(jax.lax.optimization_barrier(message)))

    _, _, (up, down) = jax.lax.while_loop(lambda c: (c[0] < 3) & (c[2][0][0] >= 0), step,
                                          (0, v, tuple(two_ops(v))))
    return up + 3 * down


@pytest.mark.parametrize("body, outputs, fills", [
    # The first step's precvs (before the loop) write their zeros, the loop's do not.
    (carried, 1, [1, 1, 0, 0]),
    # The loop reads its carried results (the condition, only the first), they leave the
    # program, or the carry starts from arrays that are not zeros on a non-destination:
    # those precvs write their zeros.
    (lambda v: carried(v, read=True), 1, [1, 1, 1, 1]),
    (carried_out, 2, [1, 1, 1, 1]),
    (carried_tested, 1, [1, 1, 1, 0]),
    (lambda v: carried(v, start=(v, v)), 1, [1, 1]),
])
def test_precvs_carried_out_of_a_loop_and_read_elementwise_write_no_zeros(body, outputs, fills):
    mesh = make_mesh((2, "x"))
    f = spmd(body, mesh, outputs)
    assert zero_fills(f, sharded(mesh, 16, np.float32)) == fills


def _carried_reference(v, steps=3):
    up = jax.lax.ppermute(v, "x", UP)
    down = jax.lax.ppermute(v, "x", DOWN)
    return up + 3 * down


@functools.cache
def _carried_want(dtype: str, nbytes: int) -> np.ndarray:
    """_carried_reference's result on signed_zeros_input, computed once for both step
    counts (it does not depend on them)."""
    mesh = make_mesh((2, "x"))
    return np.asarray(spmd(_carried_reference, mesh)(signed_zeros_input(mesh, nbytes,
                                                                        np.dtype(dtype).type)))


# 8 B, 64 KiB and 1 MiB, uint8 and float32 (-0.0 kept), 2 and 4 steps (one loop step, and
# a loop whose buffers held the previous step's values), several calls of one program.
@pytest.mark.parametrize("nbytes", [8, 64 << 10, 1 << 20])
@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
@pytest.mark.parametrize("steps", [2, 4])
def test_carried_equals_ppermute(steps, dtype, nbytes):
    mesh = make_mesh((2, "x"))
    x = signed_zeros_input(mesh, nbytes, dtype)
    f = spmd(lambda v: carried(v, steps), mesh)
    assert zero_fills(f, x) == [1, 1, 0, 0]
    want = _carried_want(np.dtype(dtype).name, nbytes)
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(x)).view(np.uint8), want.view(np.uint8))


def test_carried_under_vmap_equals_ppermute():
    mesh = make_mesh((2, "x"))
    x = sharded(mesh, 4 * 1024, np.int32)

    def batched(body):
        return lambda v: jax.vmap(body)(v.reshape(4, -1)).reshape(-1)

    f = spmd(batched(carried), mesh)
    assert zero_fills(f, x) == [1, 1, 0, 0]
    np.testing.assert_array_equal(np.asarray(f(x)),
                                  np.asarray(spmd(batched(_carried_reference), mesh)(x)))


def test_carried_under_grad_equals_ppermute():
    """The received arrays weigh a parameter: its gradient is their combination."""
    mesh = make_mesh((2, "x"))
    x = sharded(mesh, 4 * 1024, np.float32)

    def gradient(body):
        return lambda v: jax.grad(lambda w: jnp.sum(w * body(v)))(jnp.ones_like(v))

    f = spmd(gradient(carried), mesh)
    assert zero_fills(f, x) == [1, 1, 0, 0]
    np.testing.assert_array_equal(np.asarray(f(x)),
                                  np.asarray(spmd(gradient(_carried_reference), mesh)(x)))


def unread_and_plain(v):
    """The same precv (pairs, shape) twice: under ``precv_unread_off_destinations``, and
    plain (JAX lowers both from one cached lowering: the scope must not leak)."""
    like = jax.ShapeDtypeStruct(v.shape, v.dtype)
    unread = p2p.precv_unread_off_destinations(jax_cpu_mpi.psend(v, "x", UP), like, "x", UP)
    plain = jax_cpu_mpi.precv(jax_cpu_mpi.psend(v + 1, "x", UP), like, "x", UP)
    return (jax.lax.pcast(unread, "x", to="varying"), jax.lax.pcast(plain, "x", to="varying"))


@pytest.mark.parametrize("nbytes", [8, 64 << 10, 1 << 20])
def test_a_precv_whose_caller_reads_no_zeros_leaves_them_unwritten(nbytes):
    """Marked zero_fill = 0 with nothing selected; on the destination the bytes of
    ppermute, on the other device whatever the buffer held: poison here (the fixture)."""
    mesh = make_mesh((2, "x"))
    f = spmd(unread_and_plain, mesh, 2)
    x = signed_zeros_input(mesh, nbytes, np.float32)
    assert zero_fills(f, x) == [0, 1]
    assert "stablehlo.select" not in f.lower(x).as_text()
    want = spmd(lambda v: jax.lax.ppermute(v, "x", UP), mesh)
    n = nbytes // 4
    for _ in range(2):
        unread, plain = (np.asarray(a) for a in f(x))
        expected = np.asarray(want(x))
        np.testing.assert_array_equal(unread[n:].view(np.uint8), expected[n:].view(np.uint8))
        assert np.isnan(unread[:n]).all()  # device 0, no destination: unwritten
        np.testing.assert_array_equal(plain, np.asarray(want(x + 1)))
