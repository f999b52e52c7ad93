"""Poison mode (``JAX_CPU_MPI_POISON_UNINITIALIZED``): the buffers that start uninitialized
(the slots of a pipeline's kept residuals) hold values no computation would leave there,
so that a read before a write shows in results.

The pipeline tests of this folder run poisoned (conftest.py): every schedule with
``remat=False`` (virtual stages, ZB-H1's split backward, input gradients, a data axis,
bfloat16, one stage) against the one-device reference, in one process and under mpirun
(test_pipeline_mpi.py). These tests check the poison itself and that the comparisons see it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pipeline_cases import Case, within

from jax_cpu_mpi._src.ops.uninitialized import uninitialized
from jax_cpu_mpi._src.runtime import config

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.complex64, jnp.float8_e4m3fn,
          jnp.float8_e4m3fnuz, jnp.int32, jnp.int8, jnp.uint8, jnp.uint32, jnp.bool_]


def _poison(dtype) -> float | int | bool:
    """The value every element of a poisoned buffer of ``dtype`` holds (NaN: any NaN)."""
    if jnp.issubdtype(dtype, jnp.inexact):
        return math.nan
    if dtype == jnp.bool_:
        return True
    info = jnp.iinfo(dtype)
    return int(info.min) if info.min < 0 else int(info.max)


def test_poisoned_buffers_hold_nan_or_an_extreme_value():
    """NaN in every float type (the FNUZ float8 types' own NaN too), the most negative value
    in signed integers, the largest in unsigned ones, true in booleans; the setting is read
    at each run, so the same compiled program gives it once the setting is on."""
    f = jax.jit(lambda: [uninitialized((5, 3), dtype, i) for i, dtype in enumerate(DTYPES)])
    with config.overrides(poison_uninitialized=False):
        f()  # compiled while off
    assert config.current().poison_uninitialized  # conftest.py
    for dtype, got in zip(DTYPES, f(), strict=True):
        got = np.asarray(got)
        assert got.dtype == dtype and got.shape == (5, 3)
        want = _poison(dtype)
        if isinstance(want, float):
            assert np.isnan(got.astype(np.complex64)).all(), (dtype, got)
        else:
            assert (got == np.asarray(want, got.dtype)).all(), (dtype, got)


def test_a_nan_error_is_not_within_tolerance():
    """Python's ``max`` keeps its first value against a later NaN: a NaN gradient (a
    poisoned residual read) would have passed ``max(errors.values()) <= tolerance``."""
    case = Case("gpipe", stages=2, microbatches=2, remat=False)
    assert max({"loss": 0.0, "grads": math.nan}.values()) <= 2e-5  # the trap
    assert not within(case, {"loss": 0.0, "grads": math.nan, "outputs": 0.0})
    assert within(case, {"loss": 0.0, "grads": 1e-6, "outputs": 0.0})
    assert not within(case, {"loss": 0.0, "grads": 1e-3, "outputs": 0.0})


@pytest.mark.parametrize("bad", ["2", "poison"])
def test_a_bad_value_names_the_variable(monkeypatch, bad):
    monkeypatch.setenv("JAX_CPU_MPI_POISON_UNINITIALIZED", bad)
    with pytest.raises(config.ConfigError, match="JAX_CPU_MPI_POISON_UNINITIALIZED"):
        config.from_environment()
