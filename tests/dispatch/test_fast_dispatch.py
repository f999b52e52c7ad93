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
from conftest import forget_refused_channels, make_mesh
from jax_cpu_mpi import config
from jax_cpu_mpi._src import compat as _compat
from jax_cpu_mpi._src.dispatch import device_thread_hint as _device_thread_hint

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


@pytest.mark.parametrize("case", ["cheap", "cheap-switched-off", "compute",
                                  "compute-sync-dispatch"])
def test_single_device_program_dispatch_and_its_error_type(case, short_recv_timeout,
                                                          python_dispatches):
    """XLA runs a cheap one-device program (under 1000 flops) inline, and JAX's C++ path
    would turn its error into a ValueError. The device-thread hint gives a program of little
    more than psend/precv a few thousand flops (XLA's count), so XLA runs it on a device
    thread: it takes the C++ path, and its error is still a JaxRuntimeError (a ValueError
    here would mean XLA ran it inline after all). With fast dispatch switched off, no hint:
    the cheap program keeps JAX's Python dispatch, whose error is the JaxRuntimeError too.
    One with more flops of its own takes the C++ path. With JAX's asynchronous CPU dispatch
    off, XLA runs every program inline: no hint, and JAX's dispatch again."""
    go, stop = jnp.array([1]), jnp.array([0])
    sync = case == "compute-sync-dispatch"
    fast = case != "cheap-switched-off"
    previous = jax.config.values["jax_cpu_enable_async_dispatch"]
    with config.overrides(gpu_parity=False, fast_dispatch=fast):
        try:
            # (The CPU client keeps the mode it was made with: this only changes our choice.)
            jax.config.update("jax_cpu_enable_async_dispatch", not sync)
            f, x = single_device_program(64 if case.startswith("compute") else 4)
            lowered = f.lower(x, go)
            hinted = _device_thread_hint.HINT_TARGET in lowered.as_text()
            assert hinted == (fast and not sync), lowered.as_text()
            flops = lowered.compile().cost_analysis()["flops"]
            # XLA's threshold of inline runs: over it with the hint or the product.
            assert (flops >= 1000) == (case != "cheap-switched-off"), flops
            python_dispatches.reset()
            for _ in range(3):  # successful calls first: they would set up JAX's C++ path
                out, product = f(x, go)
                np.testing.assert_array_equal(np.asarray(out), np.arange(4.0))
            with pytest.raises(jax.errors.JaxRuntimeError, match=r"precv.*waited 2"):
                np.asarray(f(x, stop)[0])
            # The timed-out precv's channel is refused (its message might still come): at
            # once, through the same dispatch path.
            with pytest.raises(jax.errors.JaxRuntimeError, match=r"refused: .* timed out"):
                np.asarray(f(x, stop)[0])
            forget_refused_channels()  # no psend ran: no message was left behind
            out, product = f(x, go)  # the device works again
            np.testing.assert_array_equal(np.asarray(out), np.arange(4.0))
        finally:
            jax.config.update("jax_cpu_enable_async_dispatch", previous)
    compute = 64 if case.startswith("compute") else 4
    np.testing.assert_array_equal(np.asarray(product), np.full((1, 16), float(compute)))
    if case in ("cheap", "compute"):
        assert python_dispatches() <= 1, python_dispatches()  # the call that compiled
    else:
        assert python_dispatches() == 6, python_dispatches()


def test_device_thread_hint_changes_no_result_and_is_not_in_gpu_programs():
    """The hint goes only where it pays: a CPU program on one device of this process whose
    arrays are all 256 KiB or less. Its results are those of the unhinted program; programs
    for GPU, with a larger array, on two devices of this process, or without psend/precv
    get none."""
    mesh1 = make_mesh((1, "x"))

    def body(v):
        y = jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", [(0, 0)]),
                              jax.ShapeDtypeStruct(v.shape, v.dtype), "x", [(0, 0)])
        return y * 3 + v

    def program(mesh):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

    x = jax.device_put(jnp.arange(6.0), NamedSharding(mesh1, P("x")))
    with config.overrides(gpu_parity=False):
        hinted = program(mesh1)
        assert _device_thread_hint.HINT_TARGET in hinted.lower(x).as_text()
        with config.overrides(fast_dispatch=False):
            plain = program(mesh1)
            assert _device_thread_hint.HINT_TARGET not in plain.lower(x).as_text()
        np.testing.assert_array_equal(np.asarray(hinted(x)), np.asarray(plain(x)))
        np.testing.assert_array_equal(np.asarray(hinted(x)), 4 * np.arange(6.0))
        gpu = jax.jit(jax.shard_map(body, mesh=mesh1, in_specs=P("x"), out_specs=P("x")))
        exported = jax.export.export(gpu, platforms=["cuda"])(
            jax.ShapeDtypeStruct((6,), jnp.float32, sharding=NamedSharding(mesh1, P("x"))))
        assert _device_thread_hint.HINT_TARGET not in exported.mlir_module()
        # Arrays over 256 KiB: XLA had better allocate them in the calling thread.
        large = jax.device_put(jnp.zeros(_device_thread_hint.SMALL_ARRAY_BYTES // 4 + 1),
                               NamedSharding(mesh1, P("x")))
        assert _device_thread_hint.HINT_TARGET not in program(mesh1).lower(large).as_text()
        largest = jax.device_put(jnp.zeros(_device_thread_hint.SMALL_ARRAY_BYTES // 4),
                                 NamedSharding(mesh1, P("x")))
        assert _device_thread_hint.HINT_TARGET in program(mesh1).lower(largest).as_text()
    mesh2 = make_mesh((2, "x"))
    assert _device_thread_hint.HINT_TARGET not in pingpong(mesh2).lower(
        sharded(mesh2, 0)).as_text()
    no_p2p = jax.jit(lambda v: v + 1)
    assert _device_thread_hint.HINT_TARGET not in no_p2p.lower(jnp.arange(3.0)).as_text()


def test_device_thread_hint_is_the_same_whichever_process_lowers(monkeypatch):
    """Every process lowers every program, for its devices and the others': the hint goes
    into all of them or none (it looks at every process's devices, not the lowering one's),
    since processes that compile different programs never meet in XLA's own collectives
    (jax 0.12.1). Here the lowering process pretends to be another one than the mesh's."""
    mesh1 = make_mesh((1, "x"))
    x = jax.device_put(jnp.arange(6.0), NamedSharding(mesh1, P("x")))

    def lowered_text() -> str:
        program = jax.jit(jax.shard_map(
            lambda v: jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", [(0, 0)]),
                                        jax.ShapeDtypeStruct(v.shape, v.dtype), "x", [(0, 0)]),
            mesh=mesh1, in_specs=P("x"), out_specs=P("x")))
        return program.lower(x).as_text()

    with config.overrides(gpu_parity=False):
        here = lowered_text()
        monkeypatch.setattr(jax, "process_index", lambda *args, **kwargs: 1)
        elsewhere = lowered_text()
    assert _device_thread_hint.HINT_TARGET in here
    assert elsewhere == here


@pytest.mark.parametrize("custom_calls", [0, 5, 3000])
def test_device_thread_hint_outweighs_the_custom_calls(custom_calls):
    """XLA counts a custom call as -1 flop: the hint's add grows with them, and stays over
    XLA's threshold of inline runs even with a few thousand."""
    elements = _device_thread_hint.hint_elements(custom_calls)
    assert elements % 256 == 0
    assert elements - custom_calls >= 2 * _device_thread_hint.XLA_CPU_INLINE_FLOPS


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
        # The second call takes the C++ path. Its precv is refused at once: the first one
        # timed out on the same channel (its message might still come).
        for error in (r"precv.*waited 2", r"refused: .* timed out"):
            with pytest.raises(jax.errors.JaxRuntimeError, match=error):
                np.asarray(f(x))
    assert python_dispatches() <= 1
    forget_refused_channels()  # no psend ran: no message was left behind
    # The devices are usable afterwards, on the fast path.
    np.testing.assert_array_equal(np.asarray(run(pingpong(mesh), mesh, 2)[1][1]),
                                  np.asarray(run(pingpong(mesh, ppermute), mesh, 2)[1][1]))


@pytest.mark.parametrize("manual", [("x", "y"), ("x",)], ids=["every-axis", "partly-auto"])
def test_device_thread_hint_only_in_a_shard_map_manual_over_every_axis(manual):
    """In a partly automatic shard_map, XLA's SPMD partitioner would ask the hint's
    side-effecting call for a sharding: the hint goes only into fully manual ones."""
    mesh = make_mesh((2, "x"), (1, "y"))
    f = jax.jit(jax.shard_map(lambda v: jax.lax.ppermute(v, "x", [(0, 1), (1, 0)]),
                              mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                              axis_names=set(manual)))
    module = f.lower(jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("x")))).compiler_ir()
    with module.context:
        main = next(op for op in module.body.operations
                    if op.operation.name == "func.func"
                    and "main" in str(op.operation.attributes["sym_name"]))
        (computation,) = [op.operation for op in main.regions[0].blocks[0].operations
                          if op.operation.name == "sdy.manual_computation"]
        full = _device_thread_hint._manual_over_every_axis(module, computation)
    assert full == (manual == ("x", "y"))
