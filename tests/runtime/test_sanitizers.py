"""The extension built with AddressSanitizer and UBSan runs clean (newest JAX only).

A file of its own, handed out late (``LONGEST_FILES`` in conftest.py): the test waits for
the sanitizer build that starts, niced, at collection (tests/background_builds.py); run
early (it was the last test of test_reliability.py, the second file handed out), its
worker idled until that build was done.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import background_builds
from conftest import newest_jax_only

ROOT = Path(__file__).resolve().parents[2]


def output_of(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"


@newest_jax_only
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_extension_built_with_asan_and_ubsan_runs_clean():
    """scripts/sanitize.sh QUICK=1: builds the extension with -DJAX_CPU_MPI_SANITIZE=ON and
    runs the smoke tests (one process and mpirun -n 2) and the 8-device stress test under
    ASan + UBSan; it fails on any sanitizer report. Without QUICK it runs more
    (docs/development.md).

    The build step (BUILD_ONLY=1) starts in the background, niced, when collection ends
    (tests/background_builds.py); the script then runs in full with the same WORK
    directory and compiler flags (unoptimized: background_builds.SANITIZER_CXXFLAGS), so
    CMake finds the extension built (or rebuilds it, showing the error, if that build
    failed)."""
    missing = background_builds.sanitizer_build_missing()
    if missing:
        pytest.skip(missing)
    started = background_builds.sanitized_extension()
    started.wait(timeout=400)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHON=sys.executable, QUICK="1", WORK=str(started.workdir),
               CXXFLAGS=background_builds.SANITIZER_CXXFLAGS)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "sanitize.sh")], env=env,
                          capture_output=True, text=True, timeout=580, cwd=ROOT)
    assert proc.returncode == 0 and "== sanitizers: clean" in proc.stdout, output_of(proc)
