"""Where each partition of an SPMD program runs: which device, which process.

In a program lowered under ``shard_map``, partition ``p`` is the ``p``-th device of the mesh
(in ``mesh.devices.flat`` order): JAX computes replica groups and source-target pairs on that
numbering, and the executable's device assignment follows it. The lowering bakes two small
tables into each custom call, so the runtime never depends on global state to route a
message:

* ``device_index[p]``: the device's position among all devices of the job, sorted by id.
  Mailbox channels and MPI tags are keyed by these, so programs running on other devices
  at the same time never see each other's messages.
* ``device_process[p]``: the device's ``process_index``, to pick the MPI peer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import jax
import numpy as np

from jax_cpu_mpi._src.compat import SPMDAxisContext, get_concrete_mesh


@dataclass(frozen=True)
class PartitionTables:
    """Per-partition routing tables of one lowered program."""

    device_index: np.ndarray  # int64[num_partitions]
    device_process: np.ndarray  # int64[num_partitions]
    num_devices: int  # devices in the whole job

    @property
    def num_partitions(self) -> int:
        return int(self.device_index.shape[0])

    @property
    def spans_processes(self) -> bool:
        return bool(np.unique(self.device_process).size > 1)


@cache
def _global_device_positions(backend_devices: tuple) -> dict[int, int]:
    ids = sorted(d.id for d in backend_devices)
    return {device_id: i for i, device_id in enumerate(ids)}


def _concrete_mesh(axis_context: SPMDAxisContext) -> jax.sharding.Mesh | None:
    mesh = axis_context.mesh
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    concrete = get_concrete_mesh()
    if isinstance(concrete, jax.sharding.Mesh) and not concrete.empty:
        return concrete
    return None


def partially_manual(axis_context: object) -> bool:
    """Whether ``axis_context`` is a partially manual ``shard_map`` (some mesh axes left to
    XLA's SPMD partitioner: ``axis_names=`` a subset, on jax 0.10.2 and 0.12). XLA refuses
    ``partition-id`` there ("PartitionId instruction is not supported for SPMD
    partitioning"), and our custom calls name their device by it."""
    if not isinstance(axis_context, SPMDAxisContext):
        return False
    manual = frozenset(axis_context.manual_axes)
    # Even auto axes of size 1 count: jax 0.12's partitioner then gives our side-effecting
    # calls a replicated sharding, which it refuses too.
    return bool(manual) and manual != frozenset(axis_context.mesh.axis_names)


def partition_tables(axis_context: object, op_name: str) -> PartitionTables:
    """The routing tables for a psend/precv lowered in ``axis_context``."""
    if not isinstance(axis_context, SPMDAxisContext):
        # Same condition and message as JAX's GPU lowering.
        raise NotImplementedError(f"{op_name} currently only supports manual sharding")
    mesh = _concrete_mesh(axis_context)
    if mesh is None:
        size = int(np.prod(list(axis_context.mesh.shape.values())))
        if jax.process_count() > 1:
            raise ValueError(
                f"{op_name}: the program was traced with an abstract mesh of {size} devices and "
                "no concrete mesh is known, so jax_cpu_mpi cannot tell which process runs each "
                "device. Pass a concrete jax.sharding.Mesh to shard_map (jax.make_mesh(...)) or "
                "lower under `with jax.set_mesh(mesh):`."
            )
        positions = np.arange(size, dtype=np.int64)
        return PartitionTables(positions, np.zeros(size, np.int64), size)
    devices = list(mesh.devices.flat)
    all_devices = tuple(jax.devices(devices[0].platform))
    positions = _global_device_positions(all_devices)
    return PartitionTables(
        device_index=np.array([positions[d.id] for d in devices], dtype=np.int64),
        device_process=np.array([d.process_index for d in devices], dtype=np.int64),
        num_devices=len(all_devices),
    )
