"""pytest setup: 8 virtual CPU devices in this process, short receive timeouts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "mpi_programs"))

from mpi_launcher import CHEAP_COMPILE_FLAGS

# Must happen before JAX initializes its CPU backend. This process also compiles cheaply (the
# flags are taken out again below, once XLA has read them).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 "
    + CHEAP_COMPILE_FLAGS
)
# A lost message fails the test quickly instead of waiting the production default.
os.environ.setdefault("JAX_CPU_MPI_RECV_TIMEOUT", "30")

import jax
import jax_p2p_removal
import pytest

import background_builds

# JCM_TEST_JAX_WITHOUT_P2P=1: the suite runs as on a JAX that dropped psend/precv
# (tests/ops/test_without_jax_p2p.py runs parts of it that way in a subprocess).
jax_p2p_removal.simulate_if_requested()

import jax_cpu_mpi  # noqa: E402

# Most of the suite's in-process time is compiling small test programs: LLVM's passes, and
# XLA CPU's MLIR fusion emitters (lowering each fusion through MLIR's passes; the older
# emitters write LLVM IR directly), slow it and never change what the tests check (results
# within a tolerance or against a program compiled the same way, the HLO, our FFI handlers,
# compiled apart). Only this process: XLA reads XLA_FLAGS once, when JAX first uses it (now),
# so with the flags taken out the programs and subprocesses the tests start compile as users'
# do (a launch that wants them says so, mpi_launcher.llvm_unoptimized()).
jax.devices()
os.environ["XLA_FLAGS"] = os.environ["XLA_FLAGS"].replace(f" {CHEAP_COMPILE_FLAGS}", "")

if jax_p2p_removal.requested() and not jax_cpu_mpi._src.ops.primitives.OURS:
    raise RuntimeError("JAX's psend/precv removal was simulated, but jax_cpu_mpi binds JAX's")
if os.environ.get(jax_p2p_removal.ENV) == "effect":
    assert jax_cpu_mpi._src.ops.primitives.in_use()["effect"] == "jax_cpu_mpi"

#: The suite's longest files, longest first (measured: ``--durations``, both Pythons; the
#: order of the first ones shifts with the load). ``--dist loadfile`` hands a worker one
#: file at a time, and by default the files with the MOST TESTS first, so these few-test
#: files came last: a worker ran the transformer example's minutes alone at the end while
#: the other one idled. Handed out first, the short files fill in around them, at the end.
#: Only the order changes: a stale list costs time, never a test.
LONGEST_FILES = (
    "runtime/test_collectives_mpi.py",
    "pipeline/test_pipeline_exactness.py",
    "runtime/test_reliability.py",
    "test_transformer_example.py",
    "pipeline/test_pipeline_residuals.py",
    "docs/test_examples.py",
    "ops/test_without_jax_p2p.py",
    "runtime/test_across_hosts.py",
    "compat/test_jaxlib_versions.py",  # waits for its build (started at collection)
    "test_packaging.py",
    "runtime/test_p2p_mpi.py",
    "compat/test_compat.py",
    "runtime/test_slurm.py",  # its batch jobs are seen done within 2 s now (MinJobAge)
    "pipeline/test_pipeline_keys.py",
    "pipeline/test_pipeline_mpi.py",
    "pipeline/test_pipeline_nnx.py",
    "runtime/test_stress.py",
    "runtime/test_cluster.py",
    "lowering/test_p2p_single_process.py",
    "docs/test_docs_build.py",
    # Not long, but it waits for its build (started at collection) if handed out early.
    "runtime/test_sanitizers.py",
)


def pytest_configure(config):
    # The builds directory of this run, before xdist starts its workers (they inherit it).
    background_builds.session_started()
    # xdist's loadfile scheduler: keep the order of pytest_collection_modifyitems below
    # instead of sorting the files by their number of tests.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _file_rank(item) -> int:
    tests = Path(__file__).resolve().parent
    try:
        path = Path(str(item.fspath)).resolve().relative_to(tests).as_posix()
    except ValueError:  # not under tests/
        return len(LONGEST_FILES)
    return LONGEST_FILES.index(path) if path in LONGEST_FILES else len(LONGEST_FILES)


def pytest_collection_modifyitems(config, items):
    # The longest files first; the others after them in collection order (a stable sort
    # keeps each file's tests together and in order).
    items.sort(key=_file_rank)


def pytest_collection_finish(session):
    # The builds that selected tests need start now, niced, in the background.
    if not session.config.option.collectonly:
        background_builds.start_for(session.items)


def pytest_sessionfinish(session):
    background_builds.stop_all()


def pytest_report_header(config):
    use = jax_cpu_mpi._src.ops.primitives.in_use()
    return f"jax_cpu_mpi primitives: {use['primitives']} ({use['reason']})"


def _newest_tested_series() -> bool:
    from jax_cpu_mpi import TESTED_JAX_VERSIONS

    series = lambda v: tuple(v.split(".")[:2])  # noqa: E731
    return series(jax.__version__) == max(map(series, TESTED_JAX_VERSIONS),
                                          key=lambda s: tuple(map(int, s)))


#: Runs a heavy test only on the newest JAX series jax_cpu_mpi was tested with (CI runs the
#: suite on the oldest and the newest): for checks whose subject does not depend on the JAX
#: version (our C++ under the sanitizers) or concerns the JAX to come (a JAX without
#: psend/precv), once per CI is the whole check, and twice costs minutes.
newest_jax_only = pytest.mark.skipif(
    not _newest_tested_series(),
    reason="runs on the newest tested JAX series only (CI's second run)")

#: Skips a test of plain ``jax.lax.psend``/``precv`` programs where JAX has none.
needs_jax_p2p = pytest.mark.skipif(
    not jax_cpu_mpi._src.ops.primitives.in_use()["jax_has_primitives"],
    reason="this JAX (or the simulated one) has no jax.lax.psend/precv")


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
    """Make precv give up after 2 s for tests that expect a timeout. A precv that timed out
    leaves its channel refused (its message might still come); these tests' precvs have no
    psend at all, so the channels are made usable again for the tests after them."""
    before = jax_cpu_mpi.config.current()
    jax_cpu_mpi.configure(recv_timeout=2.0)
    yield
    jax_cpu_mpi.configure(recv_timeout=before.recv_timeout)
    forget_refused_channels()


def forget_refused_channels() -> None:
    """Make the channels that timed-out precvs (with no psend) marked usable again."""
    from jax_cpu_mpi import _jax_cpu_mpi

    _jax_cpu_mpi.forget_refused_channels()


@pytest.fixture(autouse=True)
def poisoned_kept_slots(request):
    """Every pipeline test (``tests/pipeline/``) runs with the kept residuals' slots
    poisoned. With ``remat=False`` the slots start uninitialized
    (``jax_cpu_mpi_uninitialized``): a read of a slot before its forward wrote it would
    read whatever the memory held, often zeros or an earlier step's values, and could pass
    unseen. Poisoned (NaN in floats, an extreme value in integers, at every run) such a read
    shows in the results, which the tests compare with NaN-aware checks
    (``np.testing.assert_allclose``, ``pipeline_cases.within``). The setting costs no
    compilation (the handler reads it at each call); the poison itself is checked in
    ``tests/pipeline/test_pipeline_poison.py``. (Here, not in a ``tests/pipeline/conftest.py``:
    the tests import helpers ``from conftest``, and a second module of that name shadows
    this one.)"""
    if request.path.parent.name != "pipeline":
        yield
        return
    from jax_cpu_mpi._src.runtime import config

    with config.overrides(poison_uninitialized=True):
        yield
