"""pytest setup: 8 virtual CPU devices in this process, short receive timeouts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Must happen before JAX initializes its CPU backend.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
# A lost message fails the test quickly instead of waiting the production default.
os.environ.setdefault("JAX_CPU_MPI_RECV_TIMEOUT", "30")

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "mpi_programs"))

import jax
import pytest

import jax_cpu_mpi


def make_mesh(*shape_and_names: tuple[int, str]) -> jax.sharding.Mesh:
    """A mesh over the first devices of this process, e.g. ``make_mesh((2, 'x'), (4, 'y'))``."""
    shape = tuple(s for s, _ in shape_and_names)
    names = tuple(n for _, n in shape_and_names)
    count = 1
    for s in shape:
        count *= s
    return jax.make_mesh(shape, names, devices=jax.devices()[:count])


@pytest.fixture
def short_recv_timeout():
    """Make precv give up after 2 s for tests that expect a timeout."""
    before = jax_cpu_mpi.config.current()
    jax_cpu_mpi.configure(recv_timeout=2.0)
    yield
    jax_cpu_mpi.configure(recv_timeout=before.recv_timeout)
