"""JAX's C++ dispatch over MPI (2 devices per rank, ``mpirun -n 2``).

A program on two devices of each process takes jit's C++ path (python/jax_cpu_mpi/
_fast_dispatch.py): after the first call, no call reaches ``ExecuteReplicated.__call__``.
The program sends 0 -> 2 (process 0 to process 1) when ``go`` is 1, and leaves device 2's
precv unmatched when it is 0: after successful calls on the C++ path, that precv's timeout
reaches process 1 as the ``jax.errors.JaxRuntimeError`` of JAX's own dispatch, naming the op
and the peer, and the same program then works again with the right values. When it is 0,
device 1 also sends to device 3 (a psend whose pairs no precv matches): the timeout's
transport state finds that message unreceived on its own tag, and a precv of its pair then
takes it whole.

Then the same with one device of each process (the usual MPI job) and little more than
psend/precv: under 1000 flops XLA would run it inline, and JAX's C++ path would raise its
error as a ValueError. The device-thread hint (python/jax_cpu_mpi/_device_thread_hint.py,
inside the shard_map's body of this 2-partition program) makes XLA count 2048 flops and
run it on a device thread, so it takes the C++ path too, and its timeout is still a
``JaxRuntimeError``.
"""

from __future__ import annotations

import functools

import _mpi_common as common
import jax
import jax.numpy as jnp
import numpy as np
from _mpi_common import P
from jax.experimental import multihost_utils

import jax_cpu_mpi
from jax_cpu_mpi import _jax_cpu_mpi, config
from jax_cpu_mpi._src import compat as _compat
from jax_cpu_mpi._src.dispatch import device_thread_hint as _device_thread_hint

assert jax.local_device_count() == 2, jax.local_devices()
me = jax.process_index()
PAIR = [(0, 2)]  # device 0 (process 0) -> device 2 (process 1)
# Device 1 (process 0) -> device 3 (process 1), when device 2's precv is lost: MPI tag
# 1 * 4 + 3 (the devices' positions in the job), where the lost precv waits on tag 0 * 4 + 2.
STRAY = [(1, 3)]

python_calls = [0]
_original = _compat.ExecuteReplicated.__call__


@functools.wraps(_original)
def _counting(self, *args):
    python_calls[0] += 1
    return _original(self, *args)


_compat.ExecuteReplicated.__call__ = _counting

mesh = jax.make_mesh((4,), ("x",))


def hop_or_lose(v, go, pair, stray=None):
    """The hop over ``pair`` when ``go`` is 1; else a precv nothing sends to: it times out
    (after a psend over the pairs ``stray``, if given, which nothing receives)."""

    def send(v):
        token = jax_cpu_mpi.psend(v, "x", pair)
        return jax_cpu_mpi.precv(token, jax.ShapeDtypeStruct(v.shape, v.dtype), "x", pair)

    def lost(v):
        token = jax.lax.create_token() if stray is None else jax_cpu_mpi.psend(v, "x", stray)
        return jax_cpu_mpi.precv(token, jax.ShapeDtypeStruct(v.shape, v.dtype), "x", pair)

    return jax.lax.cond(go[0] > 0, send, lost, v) + 0 * v


def reference(mesh, pair):
    return jax.jit(jax.shard_map(lambda v: jax.lax.ppermute(v, "x", pair), mesh=mesh,
                                 in_specs=P("x"), out_specs=P("x")))


def body(v, go):  # device 2's precv times out when go is 0
    return hop_or_lose(v, go, PAIR, STRAY)


config.configure(gpu_parity=False)  # GPU rejects the unmatched precv when compiling
f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))
value = np.arange(16, dtype=np.float32)
x = common.global_array(mesh, P("x"), value)
go, stop = jnp.array([1]), jnp.array([0])
expected = common.gather(reference(mesh, PAIR)(x))


def check(out: jax.Array) -> None:
    np.testing.assert_array_equal(common.gather(out), expected)


def run_and_lose_one(f, x, check, what: str, receiver: int, state=()) -> None:
    """4 calls on the C++ path, a lost message (process 1's precv times out, its error
    holding the parts ``state`` too), 2 calls more."""
    check(f(x, go))  # compiles, through JAX's Python dispatch
    python_calls[0] = 0
    for _ in range(4):
        check(f(x, go))
    assert python_calls[0] == 0, f"{what}: {python_calls[0]} calls went through Python"
    multihost_utils.sync_global_devices(f"{what}: before the lost message")
    try:
        jax.block_until_ready(f(x, stop))
    except jax.errors.JaxRuntimeError as e:
        assert me == 1, f"process {me} has no receive to fail: {e}"
        for part in ("precv", f"partition {receiver} (process 1)", "partition 0 (process 0)",
                     "waited", *state):
            assert part in str(e), (part, str(e))
        print(f"process {me}: {what}: raised as expected", flush=True)
    else:
        assert me == 0, f"{what}: process 1's precv must time out"
    # The timed-out precv left its channel refused (a late message would be taken as the
    # next precv's); nothing sent on it here, so the calls after it may use it again.
    _jax_cpu_mpi.forget_refused_channels()
    multihost_utils.sync_global_devices(f"{what}: after the lost message")
    python_calls[0] = 0
    for _ in range(2):
        check(f(x, go))
    assert python_calls[0] == 0, f"{what}: {python_calls[0]} calls went through Python"


run_and_lose_one(f, x, check, "2 devices per process", receiver=2,
                 state=("\n    receives from rank 0, tag 2: the latest, #",
                        "\n    unreceived from rank 0 now: a staged message or chunk on tag 7 ("))
# The stray message waited whole for a precv of its pair (device 1's block of x).
take_stray = jax.jit(jax.shard_map(
    lambda v: jax_cpu_mpi.precv(jax.lax.create_token(), jax.ShapeDtypeStruct(v.shape, v.dtype),
                                "x", STRAY),
    mesh=mesh, in_specs=P("x"), out_specs=P("x")))
np.testing.assert_array_equal(common.gather(take_stray(x))[12:], value[4:8])

# One device of each process: partition 0 (process 0) -> partition 1 (process 1).
mesh1 = jax.sharding.Mesh(np.array([jax.devices()[0], jax.devices()[2]]), ("x",))
PAIR1 = [(0, 1)]


def body1(v, go):
    return hop_or_lose(v, go, PAIR1)


f1 = jax.jit(jax.shard_map(body1, mesh=mesh1, in_specs=(P("x"), P()), out_specs=P("x")))
x1 = common.global_array(mesh1, P("x"), value[:8])
lowered = f1.lower(x1, go)
assert _device_thread_hint.HINT_TARGET in lowered.as_text(), lowered.as_text()
flops = lowered.compile().cost_analysis()["flops"]
assert flops >= 1000, flops
expected1 = common.gather(reference(mesh1, PAIR1)(x1))


def check1(out) -> None:
    np.testing.assert_array_equal(common.gather(out), expected1)


run_and_lose_one(f1, x1, check1, "1 device per process", receiver=1)
common.ok()
