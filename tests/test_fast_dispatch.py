"""Fast dispatch: jitted CPU programs with psend/precv skip JAX's Python dispatch.

psend/precv carry an unordered effect, which keeps ``jax.jit`` off its C++ fast path: every
call of such a program would go through ``ExecuteReplicated.__call__`` in Python (about
100 to 200 us a call). python/jax_cpu_mpi/_fast_dispatch.py records no unordered effect for
a CPU program whose only one is psend/precv's, which has outputs and which XLA never runs
inline: two or more devices of the process, or one device and 1000 flops or more. These
tests count the calls that reach the Python dispatch, and check that values and errors are
those of the Python dispatch, and that the switch, programs without outputs, with a
callback, and cheap programs on one device keep JAX's dispatch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cpu_mpi
from conftest import make_mesh
from jax_cpu_mpi import _compat, config

pytestmark = pytest.mark.skipif(not _compat.FAST_DISPATCH.active,
                                reason="fast_dispatch is off with this JAX")

FORWARD, BACKWARD = [(0, 1)], [(1, 0)]


@pytest.fixture
def python_dispatches(monkeypatch):
    """Counts the calls that go through JAX's Python dispatch: ``count()``, ``count.reset()``."""

    class Count:
        calls = 0

        def __call__(self) -> int:
            return self.calls

        def reset(self) -> None:
            self.calls = 0

    count = Count()
    original = _compat.ExecuteReplicated.__call__

    @functools.wraps(original)
    def counting(self, *args):
        count.calls += 1
        return original(self, *args)

    monkeypatch.setattr(_compat.ExecuteReplicated, "__call__", counting)
    return count


def hop(x, perm):
    token = jax_cpu_mpi.psend(x, "x", perm)
    y = jax_cpu_mpi.precv(token, jax.ShapeDtypeStruct(x.shape, x.dtype), "x", perm)
    return jax.lax.pcast(y, "x", to="varying")


def pingpong(mesh, transport=hop):
    def body(x):
        y = transport(x, FORWARD)
        return transport(y * 2, BACKWARD), y

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P("x"))))


def ppermute(x, perm):
    return jax.lax.ppermute(x, "x", perm)


def sharded(mesh, salt):
    return jax.device_put(jnp.arange(8.0) + salt, NamedSharding(mesh, P("x")))


def run(f, mesh, calls=5, count=None):
    """``calls`` calls of ``f`` on fresh inputs; ``count`` (a python_dispatches) counts only
    the calls of ``f``, not the making of the inputs."""
    inputs = [sharded(mesh, i) for i in range(calls)]
    if count is not None:
        count.reset()
    return [jax.block_until_ready(f(x)) for x in inputs]


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "switched-off"])
def test_calls_after_the_first_skip_python_dispatch(fast, python_dispatches):
    mesh = make_mesh((2, "x"))
    with config.overrides(fast_dispatch=fast):
        f = pingpong(mesh)  # compiled (and its dispatch chosen) under the setting
        got = run(f, mesh, count=python_dispatches)
    python_calls = python_dispatches()
    if fast:
        # The first call compiles through Python; JAX's C++ path runs the others.
        assert python_calls <= 1, python_calls
    else:
        assert python_calls == len(got), python_calls
    expected = run(pingpong(mesh, ppermute), mesh)
    for (z, y), (z_ref, y_ref) in zip(got, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(z), np.asarray(z_ref))
        np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))


def test_program_without_outputs_keeps_jax_dispatch(python_dispatches):
    """Nothing to block on: jax.effects_barrier() must still wait for it, as in JAX."""
    mesh = make_mesh((2, "x"))

    def body(x):
        hop(x, FORWARD)
        return ()

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=()))
    x = sharded(mesh, 0)
    python_dispatches.reset()
    for _ in range(3):
        f(x)
    jax.effects_barrier()
    assert python_dispatches() == 3


def test_program_with_another_unordered_effect_keeps_jax_dispatch(python_dispatches):
    mesh = make_mesh((2, "x"))
    seen = []

    def body(x):
        y = hop(x, FORWARD)
        jax.debug.callback(lambda v: seen.append(np.asarray(v)), y)
        return y

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = sharded(mesh, 0)
    python_dispatches.reset()
    for _ in range(3):
        jax.block_until_ready(f(x))
    jax.effects_barrier()
    assert python_dispatches() == 3
    assert len(seen) == 6  # one callback per device and call


def single_device_program(compute: int):
    """A self-send on one device when ``go`` is 1, an unmatched precv (a timeout) when it is
    0, next to a ``(1, compute) x (compute, 16)`` product (2 * 16 * compute flops)."""
    mesh = make_mesh((1, "x"))

    def body(v, go):
        def self_send(v):
            return jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", [(0, 0)]),
                                     jax.ShapeDtypeStruct(v.shape, v.dtype), "x", [(0, 0)])

        def lost(v):  # a precv that no psend matches: it times out
            return jax_cpu_mpi.precv(jax.lax.create_token(),
                                     jax.ShapeDtypeStruct(v.shape, v.dtype), "x", [(0, 0)])

        row = jnp.full((1, compute), jax.lax.axis_index("x").astype(jnp.float32) + 1)
        return jax.lax.cond(go[0] > 0, self_send, lost, v), row @ jnp.ones((compute, 16))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()),
                              out_specs=(P("x"), P("x"))))
    return f, jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("x")))


@pytest.mark.parametrize("case", ["cheap", "compute", "compute-sync-dispatch"])
def test_single_device_program_dispatch_and_its_error_type(case, short_recv_timeout,
                                                          python_dispatches):
    """XLA runs a cheap one-device program (under 1000 flops) inline, and JAX's C++ path
    would turn its error into a ValueError: such a program keeps JAX's Python dispatch, whose
    error is the JaxRuntimeError users catch, on every call. One with more flops runs on a
    device thread, takes the C++ path, and its error is still a JaxRuntimeError (a
    ValueError here would mean XLA ran it inline after all). With JAX's asynchronous CPU
    dispatch off, XLA runs every program inline: JAX's dispatch again."""
    go, stop = jnp.array([1]), jnp.array([0])
    sync = case == "compute-sync-dispatch"
    previous = jax.config.values["jax_cpu_enable_async_dispatch"]
    with config.overrides(gpu_parity=False):
        try:
            # (The CPU client keeps the mode it was made with: this only changes our choice.)
            jax.config.update("jax_cpu_enable_async_dispatch", not sync)
            f, x = single_device_program(4 if case == "cheap" else 64)
            flops = f.lower(x, go).compile().cost_analysis()["flops"]
            assert (flops < 1000) == (case == "cheap"), flops  # XLA's threshold of inline runs
            python_dispatches.reset()
            for _ in range(3):  # successful calls first: they would set up JAX's C++ path
                out, product = f(x, go)
                np.testing.assert_array_equal(np.asarray(out), np.arange(4.0))
            for _ in range(2):
                with pytest.raises(jax.errors.JaxRuntimeError, match=r"precv.*waited 2"):
                    np.asarray(f(x, stop)[0])
            out, product = f(x, go)  # the device works again
            np.testing.assert_array_equal(np.asarray(out), np.arange(4.0))
        finally:
            jax.config.update("jax_cpu_enable_async_dispatch", previous)
    if case == "compute":
        assert python_dispatches() <= 1, python_dispatches()  # the call that compiled
        np.testing.assert_array_equal(np.asarray(product), np.full((1, 16), 64.0))
    else:
        assert python_dispatches() == 6, python_dispatches()


def test_errors_of_a_fast_dispatched_program_reach_the_caller(short_recv_timeout,
                                                              python_dispatches):
    mesh = make_mesh((2, "x"))

    def body(v):  # a precv that no psend matches: it times out
        return jax_cpu_mpi.precv(jax.lax.create_token(), jax.ShapeDtypeStruct(v.shape, v.dtype),
                                 "x", FORWARD)

    with config.overrides(gpu_parity=False):
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        x = sharded(mesh, 0)
        python_dispatches.reset()
        for _ in range(2):  # the second call takes the C++ path
            with pytest.raises(jax.errors.JaxRuntimeError, match=r"precv.*waited 2"):
                np.asarray(f(x))
    assert python_dispatches() <= 1
    # The devices are usable afterwards, on the fast path.
    np.testing.assert_array_equal(np.asarray(run(pingpong(mesh), mesh, 2)[1][1]),
                                  np.asarray(run(pingpong(mesh, ppermute), mesh, 2)[1][1]))
