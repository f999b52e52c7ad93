"""Several ``mpirun`` launches of one test module at once, each test checking its own.

Some tests need an MPI launch of their own that mostly waits: a rank sleeps, a receive times
out, a network fault runs its course, the launch ends at an abort. One after the other,
those waits add up to minutes while the 2-core machine idles, so a module lists such launches
by name (:class:`Launches`) and gets two fixtures from :meth:`Launches.fixtures`: the launches
of the selected tests start at the first test that wants one, at most ``at_once`` at a time,
queued in the order of the list; each test then takes the result of its own launch (its
parameter, given ``indirect``) and checks it as if it had run the launch itself:

* each launch has its own limit, past which its launcher kills it, its whole process group
  included (:func:`mpi_launcher.communicate_or_kill`, :meth:`netns_hosts.TwoHosts.run`);
  a test whose launch still runs well past that limit fails instead of waiting on;
* the launch's report (:meth:`MpiRun.report`: the launcher's and every rank's output) starts
  with the launch's name and how long it ran, so a failing test names its job; an exception
  raised by a launch fails its test only, with the launch's name;
* launches that no selected test wants never start; those still queued when the module ends
  (a run stopped at its first failure) are dropped, and the module's teardown waits for the
  running ones, each bounded by its own limit: nothing outlives the test session.

Usage, in a test module::

    JOBS = Launches("fault job", {"a": mpi_launch("prog.py", "a", limit=60), ...}, at_once=3)
    _fault_jobs, fault_job = JOBS.fixtures("fault_job")

    @pytest.mark.parametrize("fault_job", ["a"], indirect=True)
    def test_a(fault_job: Finished): ...
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import pytest

from mpi_launcher import MpiRun, run_mpi

#: Seconds a launch may run past its own limit before its test stops waiting for it: its
#: launcher's kill, reading every rank's output, cleaning up (a two-host launch waits up
#: to 15 s for the ranks on the other host and 30 s for its fault injector).
GRACE = 60.0


@dataclass(frozen=True)
class Launch:
    """One job: ``start(limit)`` runs it and returns its :class:`MpiRun`, its launcher
    killing it at ``limit`` seconds (``returncode`` None then)."""

    start: Callable[[float], MpiRun]
    limit: float


def mpi_launch(program: str, *args: str, limit: float, **run_mpi_keywords: Any) -> Launch:
    """``run_mpi(program, *args, timeout=limit, **run_mpi_keywords)`` as a :class:`Launch`
    (2 ranks unless ``nprocs`` says otherwise)."""
    return Launch(lambda timeout: run_mpi(program, *args, timeout=timeout, **run_mpi_keywords),
                  limit)


@dataclass
class Finished:
    """A launch that has ended: what a test of it checks."""

    name: str
    run: MpiRun  # its report names the launch
    elapsed: float  # seconds from the launch's start to its launcher's end
    ended: float  # time.time() at the launcher's end


class Launches:
    """The named launches of one test module, run ``at_once`` at a time (see module doc);
    ``unavailable()``, if given, returns why they cannot run here (their tests skip)."""

    def __init__(self, kind: str, launches: Mapping[str, Launch], *, at_once: int,
                 unavailable: Callable[[], str | None] | None = None) -> None:
        if at_once < 1:
            raise ValueError(f"at_once must be at least 1, not {at_once}")
        self.kind = kind
        self.launches = dict(launches)
        self.at_once = at_once
        self.unavailable = unavailable

    def label(self, name: str, detail: str = "") -> str:
        """How reports and errors name the launch ``name``."""
        return f"[{self.kind} {name!r}{', ' + detail if detail else ''}]"

    def run(self, names: Iterable[str]) -> Running:
        """Start the launches ``names`` (in this object's order, each once)."""
        wanted = set(names)
        unknown = wanted - self.launches.keys()
        if unknown:
            raise KeyError(f"no {self.kind} named {sorted(unknown)} (known: "
                           f"{sorted(self.launches)})")
        return Running(self, [name for name in self.launches if name in wanted])

    def fixtures(self, argname: str) -> tuple[Any, Any]:
        """Two pytest fixtures for a test module (assign both to module names): the
        module's running launches, started at the first test whose (indirect) parameter
        ``argname`` names one, for the launches named by the module's selected tests; and
        ``argname``, the :class:`Finished` launch that the test's parameter names."""
        queue_name = f"_{argname}_launches"

        @pytest.fixture(scope="module", name=queue_name)
        def queue(request: pytest.FixtureRequest) -> Iterator[Running]:
            reason = self.unavailable() if self.unavailable is not None else None
            if reason is not None:
                pytest.skip(reason)
            with self.run(parameters(request, argname)) as running:
                yield running

        @pytest.fixture(name=argname)
        def one(request: pytest.FixtureRequest) -> Finished:
            return request.getfixturevalue(queue_name).result(request.param)

        return queue, one


def parameters(request: pytest.FixtureRequest, argname: str) -> list[str]:
    """The values of the parameter ``argname`` of the selected tests of the requesting
    test's module, in the order they run."""
    values: list[str] = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if (getattr(item, "module", None) is request.module and callspec is not None
                and argname in callspec.params and callspec.params[argname] not in values):
            values.append(callspec.params[argname])
    return values


class Running:
    """The launches of a :meth:`Launches.run`, running or queued; a context manager whose
    exit drops the queued ones and waits for the running ones."""

    def __init__(self, launches: Launches, names: list[str]) -> None:
        self._launches = launches
        self._started: dict[str, float] = {}  # time.monotonic() at each launch's start
        self._started_event = {name: threading.Event() for name in names}
        self._pool = ThreadPoolExecutor(launches.at_once,
                                        thread_name_prefix=launches.kind.replace(" ", "-"))
        self._futures: dict[str, Future[Finished]] = {
            name: self._pool.submit(self._launch, name) for name in names}

    def __enter__(self) -> Running:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _launch(self, name: str) -> Finished:
        launch, label = self._launches.launches[name], self._launches.label(name)
        self._started[name] = start = time.monotonic()
        self._started_event[name].set()
        try:
            run = launch.start(launch.limit)
        except Exception as e:
            raise AssertionError(f"{label} the launch failed: {e}") from e
        elapsed = time.monotonic() - start
        # The report's first line names the launch.
        run.command.insert(0, self._launches.label(
            name, f"{elapsed:.0f} s of its {launch.limit:.0f} s limit"))
        return Finished(name, run, elapsed, time.time())

    def result(self, name: str, grace: float = GRACE) -> Finished:
        """The launch ``name`` once it has ended. Fails, naming it, if it runs more than
        ``grace`` seconds past its limit (its launcher did not end it)."""
        label = self._launches.label(name)
        if name not in self._futures:
            raise KeyError(f"{label} was not started: no selected test of the module asked "
                           "for it (an indirect parameter of the fixture names it)")
        # Queued behind other launches: each of those ends by its own limit.
        self._started_event[name].wait()
        limit = self._launches.launches[name].limit
        remaining = self._started[name] + limit + grace - time.monotonic()
        try:
            return self._futures[name].result(timeout=max(remaining, 0.0))
        except FutureTimeout:
            raise AssertionError(f"{label} still runs {limit + grace:.0f} s after its start, "
                                 f"past its {limit:.0f} s limit: its launcher did not end "
                                 "it") from None
