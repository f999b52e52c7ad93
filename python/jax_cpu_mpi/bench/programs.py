"""The jitted SPMD programs the JAX methods time, on a mesh of two devices.

Device 0 of the mesh is the sender, device 1 the receiver. A *hop* moves one message one
way, with ``psend``+``precv`` (this package on CPU, NCCL on GPU) or with ``ppermute``
(gloo across processes, XLA's in-process collectives within one):

* ``pingpong``: a hop 0 -> 1 then a hop 1 -> 0 (one round trip), returning ``(z, y)``:
  ``z`` is what came back to device 0 and ``y`` what device 1 received;
* ``pingpong_scan``: ``hops / 2`` round trips, the first before a ``lax.scan`` of the others
  (what pipelines do);
* ``pingpong_donated_scan``: the same round trips from donated carries ``(z, y)``, so that
  the caller receives into the same buffers at every call (``psend-donated/scan``);
* ``one_way`` + ``ack``: one message 0 -> 1 per call; a few bytes back once the window of
  calls is done;
* ``stream_scan``: a window of hops 0 -> 1 inside one ``lax.scan``, then the acknowledgement.

Every message carries :func:`pattern`, so the receivers' bytes can be checked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_cpu_mpi._src.ops.p2p import precv, psend

AXIS = "x"
FORWARD = [(0, 1)]
BACKWARD = [(1, 0)]
ACK_BYTES = 8


def pattern(n: int) -> np.ndarray:
    """The bytes every message of ``n`` bytes carries (few zeros: a missed receive shows)."""
    period = ((np.arange(251, dtype=np.int64) * 131 + 7 + n) % 251 + 1).astype(np.uint8)
    return np.resize(period, n)  # byte i is ((131 i + 7 + n) mod 251) + 1


def mesh_of(pair: tuple[Any, Any]) -> Mesh:
    return Mesh(np.array(pair), (AXIS,))


def sharded_pattern(mesh: Mesh, n: int) -> jax.Array:
    """A global ``uint8[2n]`` whose shard on each device of ``mesh`` is ``pattern(n)``."""
    value = pattern(n)
    return jax.make_array_from_callback((2 * n,), NamedSharding(mesh, P(AXIS)),
                                        lambda index: value)


def shard_on(array: jax.Array, device: Any) -> np.ndarray | None:
    """The shard of ``array`` on ``device``, or None if this process does not hold it."""
    for shard in array.addressable_shards:
        if shard.device == device:
            return np.asarray(shard.data)
    return None


def count_wrong(got: np.ndarray | None, expected: np.ndarray) -> int:
    """Bytes of ``got`` that differ from ``expected`` (0 when ``got`` is not held here)."""
    if got is None:
        return 0
    got = np.asarray(got).reshape(-1)
    if got.shape != expected.shape:
        return int(expected.size)
    return int(np.count_nonzero(got != expected))


def _hop(transport: str, x: jax.Array, perm: list[tuple[int, int]]) -> jax.Array:
    if transport == "ppermute":
        return jax.lax.ppermute(x, AXIS, perm)
    # jax_cpu_mpi.psend/precv: jax.lax.psend/precv without JAX 0.12's deprecation (the same
    # primitives while JAX has them, so the same programs and timings; ours after).
    token = psend(x, AXIS, perm)
    y = precv(token, jax.ShapeDtypeStruct(x.shape, x.dtype), AXIS, perm)
    # precv's result is typed as invariant over the axis; loop carries need it varying.
    return jax.lax.pcast(y, AXIS, to="varying")


def _spmd(mesh: Mesh, body: Callable, outputs: int) -> Callable:
    out_specs = P(AXIS) if outputs == 1 else tuple(P(AXIS) for _ in range(outputs))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=out_specs))


def pingpong(mesh: Mesh, transport: str) -> Callable:
    def body(x):
        y = _hop(transport, x, FORWARD)
        z = _hop(transport, y, BACKWARD)
        return z, y

    return _spmd(mesh, body, 2)


def pingpong_scan(mesh: Mesh, transport: str, hops: int) -> Callable:
    def body(x):
        def round_trip(z):
            y = _hop(transport, z, FORWARD)
            return _hop(transport, y, BACKWARD), y

        # The first round trip runs before the loop and its results start the carry: a
        # carry that starts from x is a copy of x (a parameter, which XLA cannot update in
        # place) into the call's fresh carry buffer at every call, and a second copy for y,
        # passes over the message whose pages fault in and that MPI's loop does not have.
        first = round_trip(x)
        if hops // 2 <= 1:
            return first
        (z, y), _ = jax.lax.scan(lambda carry, _: (round_trip(carry[0]), None), first, None,
                                 length=hops // 2 - 1)
        return z, y

    return _spmd(mesh, body, 2)


def pingpong_donated_scan(mesh: Mesh, transport: str, hops: int) -> Callable:
    """``(z, y) -> (z', y')``: the round trips of :func:`pingpong_scan` in a scan whose carry
    starts from ``(z, y)``, both donated (``z`` holds the message on the first device), so
    that a caller passing the result back receives into the same, warm buffers at every
    call, as the MPI baseline receives into one buffer (psend-donated/scan: what XLA's
    fresh per-call buffers cost the hop)."""
    def body(z0, y0):
        def round_trip(carry, _):
            y = _hop(transport, carry[0], FORWARD)
            return (_hop(transport, y, BACKWARD), y), None

        return jax.lax.scan(round_trip, (z0, y0), None, length=max(1, hops // 2))[0]

    spec = P(AXIS)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec),
                                 out_specs=(spec, spec)), donate_argnums=(0, 1))


def one_way(mesh: Mesh, transport: str) -> Callable:
    return _spmd(mesh, lambda x: _hop(transport, x, FORWARD), 1)


def ack(mesh: Mesh, transport: str) -> Callable:
    return _spmd(mesh, lambda y: _hop(transport, y[:ACK_BYTES], BACKWARD), 1)


def repeated_in_scan(step: Callable[[jax.Array], Any], x: jax.Array,
                     steps: int, first: Any = None) -> Any:
    """``step(x)`` run ``steps`` times in a ``lax.scan`` (the last result): each one on the
    same ``x``, which a barrier keeps XLA from hoisting out of the loop as invariant.
    ``first``: the result's value before the first step (``x`` if None; a tuple of arrays
    like ``x`` where ``step`` returns a tuple), whose buffer the results then take (a
    donated ``first`` is received into in place)."""
    def one(carry, _):
        source, _ = carry
        source = jax.lax.optimization_barrier(source)
        return (source, step(source)), None

    (_, y), _ = jax.lax.scan(one, (x, x if first is None else first), None, length=steps)
    return y


def first_then_scan(step: Callable[[jax.Array], Any], x: jax.Array, steps: int) -> Any:
    """``steps`` steps of ``step(x)``: the first one before the loop, the others in a
    ``lax.scan`` (:func:`repeated_in_scan`) whose carry starts from the first one's result.

    A loop carry that starts from ``x`` itself is a copy of ``x`` into the carry's buffer
    at every call (XLA cannot update ``x``, a parameter, in place), which MPI's loop does
    not have: a pass over the message into the call's fresh output buffer, whose pages
    fault in, per call. Started from the first step's result, the call's output buffer is
    the first receive's, as in a program that receives once per call."""
    first = step(x)
    return first if steps <= 1 else repeated_in_scan(step, x, steps - 1, first=first)


def stream_scan(mesh: Mesh, transport: str, window: int) -> Callable:
    def body(x):
        y = first_then_scan(lambda v: _hop(transport, v, FORWARD), x, window)
        return y, _hop(transport, y[:ACK_BYTES], BACKWARD)

    return _spmd(mesh, body, 2)


def floor(mesh: Mesh) -> Callable:
    """No communication: a fresh output of the message size (JAX's per-call floor)."""
    return _spmd(mesh, lambda x: x + np.uint8(1), 1)
