"""Every pipeline test here runs with the kept residuals' slots poisoned.

With ``remat=False`` the slots start uninitialized (``jax_cpu_mpi_uninitialized``): a read
of a slot before its forward wrote it would read whatever the memory held, often zeros or
an earlier step's values, and could pass unseen. Poisoned (NaN in floats, an extreme value
in integers, at every run) such a read shows in the results: the tests compare them with
NaN-aware checks (``np.testing.assert_allclose``, ``pipeline_cases.within``). The setting
costs no compilation (the handler reads it at each call); the poison itself is checked in
test_pipeline_poison.py.
"""

from __future__ import annotations

import pytest

from jax_cpu_mpi._src.runtime import config


@pytest.fixture(autouse=True)
def poisoned_kept_slots():
    with config.overrides(poison_uninitialized=True):
        yield
