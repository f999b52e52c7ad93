"""Launch a test program under ``mpirun`` from pytest, with a hard timeout.

A deadlock must become a failing test that shows what every rank printed, never a hung CI:
the job runs in its own process group, is killed at the timeout, and the assertion message
holds each rank's output (MPICH's ``-prepend-rank`` / Open MPI's ``--tag-output`` prefix).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PROGRAMS = Path(__file__).parent / "mpi_programs"


def mpirun_executable() -> str:
    """The mpirun of the MPI that mpi4py uses: next to this Python first (mpich wheel)."""
    local = Path(sys.executable).parent / "mpirun"
    if local.exists():
        return str(local)
    found = shutil.which("mpirun") or shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("no mpirun found next to the Python interpreter or on PATH")
    return found


def _is_open_mpi(mpirun: str) -> bool:
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in (out.stdout + out.stderr)


@dataclass
class MpiRun:
    command: list[str]
    returncode: int | None  # None: killed at the timeout
    output: str

    def by_rank(self) -> dict[int, list[str]]:
        """Output lines grouped by rank (from the launcher's rank prefix)."""
        ranks: dict[int, list[str]] = {}
        for line in self.output.splitlines():
            if line.startswith("[") and "]" in line:
                head, _, rest = line.partition("]")
                tag = head.strip("[").split(",")[-1].split(":")[0].strip()
                if tag.isdigit():
                    ranks.setdefault(int(tag), []).append(rest.lstrip(" :<stdout>stderr"))
                    continue
            ranks.setdefault(-1, []).append(line)
        return ranks

    def report(self) -> str:
        status = "killed at timeout" if self.returncode is None else f"exit {self.returncode}"
        parts = [f"$ {' '.join(self.command)}  ({status})"]
        for rank, lines in sorted(self.by_rank().items()):
            name = "launcher" if rank < 0 else f"rank {rank}"
            parts.append(f"----- {name} -----")
            parts.extend(lines[-200:])
        return "\n".join(parts)


def run_mpi(
    program: str,
    *args: str,
    nprocs: int = 2,
    devices_per_process: int = 1,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> MpiRun:
    """Run ``tests/mpi_programs/<program>`` on ``nprocs`` ranks; never hangs past ``timeout``."""
    mpirun = mpirun_executable()
    tag = ["--tag-output", "--oversubscribe"] if _is_open_mpi(mpirun) else ["-prepend-rank"]
    if _is_open_mpi(mpirun) and os.geteuid() == 0:
        tag.append("--allow-run-as-root")
    command = [mpirun, "-n", str(nprocs), *tag, sys.executable, "-u",
               str(PROGRAMS / program), *args]
    full_env = dict(os.environ)
    full_env.update({
        "JCM_TEST_DEVICES_PER_PROCESS": str(devices_per_process),
        # A lost message fails inside the job, well before the pytest timeout.
        "JAX_CPU_MPI_RECV_TIMEOUT": full_env.get("JAX_CPU_MPI_RECV_TIMEOUT", "60"),
        "PYTHONPATH": os.pathsep.join(
            p for p in [str(PROGRAMS), full_env.get("PYTHONPATH", "")] if p),
    })
    full_env.update(env or {})
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=full_env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        return MpiRun(command, proc.returncode, output)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return MpiRun(command, None, output)


def assert_mpi_ok(run: MpiRun, nprocs: int) -> None:
    """Every rank exited 0 and printed its ``JCM-OK`` line."""
    oks = sum(line.strip().endswith("JCM-OK") for lines in run.by_rank().values()
              for line in lines)
    assert run.returncode == 0 and oks == nprocs, run.report()
