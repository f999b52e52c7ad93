"""Launch a test program under ``mpirun`` from pytest, with a hard timeout.

A deadlock must become a failing test that shows what every rank printed, never a hung CI:
the job runs in its own process group and is killed at the timeout. Each rank writes its
stdout and stderr to a file of its own (``_rank_output.py`` redirects them before the program
starts), so the report shows every rank's output whole, never interleaved.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

PROGRAMS = Path(__file__).parent / "mpi_programs"
_RANK_OUTPUT = PROGRAMS / "_rank_output.py"


def mpirun_executable() -> str:
    """The mpirun of the MPI that mpi4py uses: next to this Python first (mpich wheel)."""
    local = Path(sys.executable).parent / "mpirun"
    if local.exists():
        return str(local)
    found = shutil.which("mpirun") or shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("no mpirun found next to the Python interpreter or on PATH")
    return found


def _open_mpi_flags(mpirun: str) -> list[str]:
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if "Open MPI" not in out.stdout + out.stderr:
        return []
    flags = ["--oversubscribe"]
    if os.geteuid() == 0:
        flags.append("--allow-run-as-root")
    return flags


@dataclass
class MpiRun:
    command: list[str]
    returncode: int | None  # None: killed at the timeout
    launcher_output: str
    rank_output: dict[int, str] = field(default_factory=dict)

    def by_rank(self) -> dict[int, list[str]]:
        """Output lines of each rank."""
        return {rank: text.splitlines() for rank, text in self.rank_output.items()}

    def report(self) -> str:
        status = "killed at timeout" if self.returncode is None else f"exit {self.returncode}"
        parts = [f"$ {' '.join(self.command)}  ({status})", "----- launcher -----",
                 self.launcher_output[-5000:]]
        for rank, text in sorted(self.rank_output.items()):
            parts.append(f"----- rank {rank} -----")
            parts.append("\n".join(text.splitlines()[-200:]))
        return "\n".join(parts)


def communicate_or_kill(command: list[str], timeout: float, *, stderr_apart: bool = False,
                        give_up_on: str | None = None,
                        **popen_kwargs: object) -> tuple[str, int | None]:
    """Run ``command`` in a session of its own: its output and exit status, or None as the
    status once ``timeout`` seconds passed and its whole process group was killed (mpirun's
    and srun's children too, so nothing outlives the test).

    The output is stdout with stderr folded in, or with ``stderr_apart`` stdout followed by a
    ``----- stderr -----`` section: a test that looks for a whole printed line needs that
    where several processes write to both streams at once (gloo writes its connection notice
    to stderr in pieces, and a rank's printed line can land between them). With
    ``give_up_on``, a launch whose output shows that text is killed as at the timeout, a
    few seconds after it (its last words kept): a failure known to leave the launch waiting
    forever need not use up the timeout."""
    # errors="replace": a launcher or library may print bytes that are not UTF-8 (a garbled
    # PMI message); the test must fail on what the job did, with its output, not on decoding.
    proc = subprocess.Popen(command, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE if stderr_apart else subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True, **popen_kwargs)
    if give_up_on is None:
        try:
            output, errors = proc.communicate(timeout=timeout)
            returncode: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, errors = proc.communicate()
            returncode = None
    else:
        output, errors, returncode = _watch_or_kill(proc, timeout, give_up_on)
    if errors:
        output += f"----- stderr -----\n{errors}"
    return output, returncode


def _watch_or_kill(proc: subprocess.Popen, timeout: float,
                   give_up_on: str) -> tuple[str, str, int | None]:
    """``proc``'s stdout, stderr and status (None: killed), read as they come: killed at
    ``timeout`` seconds or ``_GIVE_UP_GRACE`` seconds after ``give_up_on`` shows in either."""
    streams = [s for s in (proc.stdout, proc.stderr) if s is not None]
    texts: list[list[str]] = [[] for _ in streams]

    def read(stream: object, into: list[str]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            into.append(line)

    readers = [threading.Thread(target=read, args=(s, t), daemon=True)
               for s, t in zip(streams, texts, strict=True)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if any(give_up_on in "".join(t) for t in texts):
            deadline = min(deadline, time.monotonic() + _GIVE_UP_GRACE)
        time.sleep(0.2)
    returncode = proc.poll()
    if returncode is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for reader in readers:
        reader.join(timeout=10)
    joined = ["".join(t) for t in texts]
    return joined[0], joined[1] if len(joined) > 1 else "", returncode


#: Seconds a launch that showed ``give_up_on`` may go on printing before it is killed.
_GIVE_UP_GRACE = 3.0


def _cheap_compile_flags() -> str:
    # The older fusion emitters' switch is gone from the XLA of jaxlib 0.12, which aborts at
    # start on a flag it does not know; jaxlib 0.10 has it. 0.11 is not run by CI: left out.
    jaxlib = tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2])
    emitters = " --xla_cpu_use_fusion_emitters=false" if jaxlib < (0, 11) else ""
    return "--xla_backend_optimization_level=0" + emitters


#: XLA's flags for compiling cheaply (llvm_unoptimized(), and pytest's own process).
CHEAP_COMPILE_FLAGS = _cheap_compile_flags()


def llvm_unoptimized() -> dict[str, str]:
    """The environment of a launch whose ranks compile cheaply, as pytest's own process does
    (conftest.py): without LLVM's optimizations (XLA's ``--xla_backend_optimization_level=0``)
    and, where XLA still has them, with XLA CPU's older fusion emitters
    (``--xla_cpu_use_fusion_emitters=false``: LLVM IR written directly instead of each fusion
    lowered through MLIR's passes), on top of this
    process's flags. For programs whose launch is mostly compiling, and whose checks (results
    within a tolerance, or equal to another program of the same launch) do not depend on how
    the kernels are generated. Not for a launch that moves gigabytes through XLA's own loops:
    unoptimized, those run slower than their compilation saves."""
    return {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {CHEAP_COMPILE_FLAGS}".strip()}


def run_mpi(
    program: str,
    *args: str,
    nprocs: int = 2,
    devices_per_process: int = 1,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    module: bool = False,
) -> MpiRun:
    """Run ``tests/mpi_programs/<program>`` (or ``python -m <program>`` if ``module``) on
    ``nprocs`` ranks; never hangs past ``timeout`` seconds."""
    mpirun = mpirun_executable()
    target = program if module else str(PROGRAMS / program)
    outdir = tempfile.mkdtemp(prefix="jcm-mpirun-")
    command = [mpirun, "-n", str(nprocs), *_open_mpi_flags(mpirun), sys.executable, "-u",
               str(_RANK_OUTPUT), outdir, "-m" if module else "-f", target, *args]
    full_env = dict(os.environ)
    full_env.update({
        "JCM_TEST_DEVICES_PER_PROCESS": str(devices_per_process),
        # A lost message fails inside the job, well before the pytest timeout.
        "JAX_CPU_MPI_RECV_TIMEOUT": full_env.get("JAX_CPU_MPI_RECV_TIMEOUT", "60"),
        "PYTHONPATH": os.pathsep.join(
            p for p in [str(PROGRAMS), full_env.get("PYTHONPATH", "")] if p),
        "PYTHONUNBUFFERED": "1",
    })
    full_env.update(env or {})
    # JAX's mpi4py detection (_mpi_common.py) would take the coordinator's port from
    # hash(hostname) % 4096: two launches running at once share it once in 4096 and abort
    # each other ("different incarnation"). This port stays held until the job has ended.
    from jax_cpu_mpi._src.runtime.launchers import reserve_port  # not at import: scripts/

    with reserve_port() as held:
        full_env.setdefault("JCM_TEST_COORDINATOR_PORT", str(held.getsockname()[1]))
        output, returncode = communicate_or_kill(command, timeout, env=full_env)
    ranks = {}
    for path in sorted(Path(outdir).glob("rank-*.log")):
        ranks[int(path.stem.split("-")[1])] = path.read_text(errors="replace")
    shutil.rmtree(outdir, ignore_errors=True)
    return MpiRun(command, returncode, output, ranks)


def assert_mpi_ok(run: MpiRun, nprocs: int) -> None:
    """Every rank exited 0 and printed its ``JCM-OK`` line."""
    oks = sum(line.strip().endswith("JCM-OK") for lines in run.by_rank().values()
              for line in lines)
    assert run.returncode == 0 and oks == nprocs, run.report()
