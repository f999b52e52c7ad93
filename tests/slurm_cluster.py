"""A Slurm cluster started by the tests: ``munged``, ``slurmctld`` and ``slurmd``.

The test bed that ``tests/runtime/test_slurm.py`` runs ``srun`` and ``sbatch`` jobs on, with
Debian's ``slurm-wlm`` and ``munge`` (``.ci/run`` installs them in CI). Each
:class:`SlurmCluster`

* lives in a temporary directory of its own (``jcm-slurm-<pytest pid>-*``): a fresh munge key
  and socket, a ``slurm.conf`` naming this host as controller and only node (all its CPUs,
  ``select/cons_tres``, no cgroups, no accounting, job ids of its own), state, spool, pid
  and log files;
* listens on free ports of its own and has a cluster name of its own, so it never meets a
  system Slurm or the daemons of another run; clients find it through ``SLURM_CONF``
  (:meth:`SlurmCluster.env`);
* waits until the node is idle before a test uses it, and on :meth:`SlurmCluster.close`
  (also after a failure) stops its daemons, by their pids, and deletes its directory;
* first stops the daemons a killed earlier run left behind (directories whose pytest process
  is gone; a daemon is only stopped if its command line names that directory).

Given :class:`netns_hosts.TwoHosts`, the cluster has two nodes, one ``slurmd`` in each
network namespace under that host's name (``slurmctld``, ``srun`` and ``sbatch`` on host a,
one ``munged`` for both: its socket is a file), so ``srun -N 2`` crosses the veth link.

Daemons need root (the tests, like CI, run as root); :func:`unavailable_reason` says why the
cluster cannot be made here, for a clear skip.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mpi_launcher import communicate_or_kill

if TYPE_CHECKING:
    from netns_hosts import TwoHosts

#: What installs the cluster's programs (Debian); quoted in skip messages and by .ci/run.
INSTALL_COMMAND = "apt-get update && apt-get install -y --no-install-recommends slurm-wlm munge"
_PROGRAMS = {"munged": "munge", "slurmctld": "slurm-wlm", "slurmd": "slurm-wlm",
             "srun": "slurm-wlm", "sbatch": "slurm-wlm", "scancel": "slurm-wlm",
             "sinfo": "slurm-wlm"}
_PREFIX = "jcm-slurm-"
#: cgroup v1 as slurmd looks for it (a tmpfs root with the ``systemd`` named hierarchy and
#: the freezer), mounted in a network namespace's own mounts before its slurmd starts.
_MOUNT_CGROUPS = (
    "mountpoint -q /sys/fs/cgroup || { mount -t tmpfs cgroup_root /sys/fs/cgroup"
    " && mkdir /sys/fs/cgroup/systemd /sys/fs/cgroup/freezer"
    " && mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd"
    " && mount -t cgroup -o freezer cgroup /sys/fs/cgroup/freezer; }")


def _which(program: str) -> str | None:
    # The daemons live in /usr/sbin, which a non-login PATH may lack.
    return shutil.which(program) or shutil.which(program, path="/usr/sbin:/sbin")


def unavailable_reason() -> str | None:
    """Why no cluster can be started here (``None``: it can)."""
    if os.geteuid() != 0:
        return "the Slurm daemons run as root here; run the tests as root"
    missing = [p for p in _PROGRAMS if _which(p) is None]
    if missing:
        return f"{', '.join(missing)} not found; install Slurm with: {INSTALL_COMMAND}"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _cpus() -> int:
    """This node's CPUs as slurmd counts them (a larger count would make slurmd drain it)."""
    out = subprocess.run([_which("slurmd") or "slurmd", "-C"], capture_output=True, text=True,
                         timeout=30).stdout
    for field in out.split():
        if field.startswith("CPUs="):
            return int(field.split("=", 1)[1])
    return os.cpu_count() or 1


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_pid(pid: int, directory: Path, grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, a daemon whose command line names ``directory``."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return
    if str(directory) not in cmdline:
        return  # the pid was reused by something else
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _pid_alive(pid) or _is_zombie(pid):
                return
            time.sleep(0.05)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return True


def _remove_stale_clusters() -> None:
    """Stop the daemons of earlier runs whose pytest process is gone, delete their files."""
    for directory in Path(tempfile.gettempdir()).glob(f"{_PREFIX}*"):
        owner = directory.name[len(_PREFIX):].split("-")[0]
        if not owner.isdigit() or _pid_alive(int(owner)):
            continue
        for pidfile in directory.glob("*.pid"):
            try:
                _stop_pid(int(pidfile.read_text().split()[0]), directory)
            except (OSError, ValueError, IndexError):
                pass
        shutil.rmtree(directory, ignore_errors=True)


@dataclass
class Step:
    """An ``srun`` (or ``sbatch``) run: its command, exit status and output."""

    command: list[str]
    returncode: int | None  # None: killed at the timeout
    output: str
    seconds: float

    def report(self) -> str:
        status = "killed at timeout" if self.returncode is None else f"exit {self.returncode}"
        return f"$ {' '.join(self.command)}  ({status}, {self.seconds:.1f} s)\n{self.output}"


class SlurmCluster:
    """A Slurm cluster of this machine: one node, or two on network-namespace hosts."""

    def __init__(self, start_timeout: float = 60.0, hosts: TwoHosts | None = None) -> None:
        _remove_stale_clusters()
        self.dir = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-"))
        self.dir.chmod(0o755)  # munged refuses a socket directory others may write
        self.hosts = hosts
        if hosts is None:  # this machine, one node
            self.nodes = {socket.gethostname().split(".")[0]: "127.0.0.1"}
        else:  # a node in each namespace; the controller and the clients run on host a
            self.nodes = {hosts.hostnames[h]: hosts.addresses[h] for h in ("a", "b")}
        self.host = next(iter(self.nodes))
        self.conf = self.dir / "slurm.conf"
        self._procs: list[subprocess.Popen] = []
        try:
            self._write_config()
            self._start(start_timeout)
        except BaseException:
            self.close()
            raise

    # --- setup -------------------------------------------------------------------------

    def _write_config(self) -> None:
        d = self.dir
        for sub in ("state", "spool", "munge"):
            (d / sub).mkdir(mode=0o755)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        name = f"jcm{os.getpid() % 100000}x{_free_port() % 1000}"
        # Job ids of their own, not 1, 2, ... in every cluster: with srun's PMI-2, MPICH names
        # its shared-memory segments after the job (PMI_JOBID), and a job killed in an
        # earlier run leaves its segments behind in /dev/shm, which a new job of the same id
        # would open. JAX's Slurm detection also derives the coordinator's port from it.
        first_job_id = random.SystemRandom().randrange(10_000, 50_000_000)
        # slurmd initializes its cgroup plugin even when no plugin uses cgroups. In a network
        # namespace (ip netns exec remounts /sys) nothing is mounted on /sys/fs/cgroup: the
        # node's wrapper mounts a tmpfs there (cgroup v1's root), slurmd mounts the rest.
        (self.dir / "cgroup.conf").write_text("CgroupAutomount=yes\n")
        nodes = "\n".join(f"NodeName={name} NodeAddr={address} CPUs={_cpus()} State=UNKNOWN"
                          for name, address in self.nodes.items())
        self.conf.write_text(f"""\
# A one-node cluster for jax-cpu-mpi's tests (tests/slurm_cluster.py).
ClusterName={name}
FirstJobId={first_job_id}
SlurmctldHost={self.host}({self.nodes[self.host]})
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
InactiveLimit=0
KillWait=5
# sbatch --wait polls the job after 2 s, then quadruples its sleep (8, 32 s) while the sleep
# is under half of MinJobAge (300 by default), so it saw a job's end up to 32 s late. At 5
# it polls every 2 s; slurmctld keeps a finished job's record at least MinJobAge seconds,
# longer than one poll, so sbatch still reads the job's exit code.
MinJobAge=5
MessageTimeout=30
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _on(self, host: str | None, command: list[str]) -> list[str]:
        """``command`` as run on node ``host`` (its namespace and hostname, if two nodes)."""
        if self.hosts is None or host is None:
            return command
        return self.hosts.in_host("a" if host == self.host else "b", command)

    def _daemon(self, name: str, host: str | None, *command: str) -> None:
        with open(self.dir / f"{name}.out", "w") as log:
            self._procs.append(subprocess.Popen(
                self._on(host, list(command)), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, env=self.env(), start_new_session=True))

    def _start(self, timeout: float) -> None:
        d = self.dir
        # One munged serves every node: its socket is a file, which namespaces share.
        self._daemon("munged", None, _which("munged") or "munged", "--foreground", "--force",
                     f"--socket={d}/munge/munge.socket", f"--key-file={d}/munge/munge.key",
                     f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log",
                     f"--seed-file={d}/munge/munged.seed")
        self._wait(lambda: (d / "munge" / "munge.socket").exists(), timeout, "munged's socket")
        # -D: foreground (the test owns the process); -i: ignore state of earlier runs.
        self._daemon("slurmctld", self.host, _which("slurmctld") or "slurmctld", "-D", "-i",
                     "-f", str(self.conf))
        for node in self.nodes:
            (d / "spool" / node).mkdir(mode=0o755)
            command = [_which("slurmd") or "slurmd", "-D", "-N", node, "-f", str(self.conf)]
            if self.hosts is not None:  # in the namespace's own mounts (ip netns exec)
                command = ["sh", "-c", _MOUNT_CGROUPS + ' && exec "$@"', "slurmd", *command]
            self._daemon(f"slurmd-{node}", node, *command)
        self._wait(self._nodes_idle, timeout, f"nodes {', '.join(self.nodes)} idle in sinfo")

    def _nodes_idle(self) -> bool:
        for proc in self._procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}\n"
                                   + self.logs())
        out = subprocess.run(self._on(self.host, ["sinfo", "-h", "-N", "-o", "%T"]),
                             capture_output=True, text=True, env=self.env(), timeout=30)
        return out.returncode == 0 and out.stdout.split() == ["idle"] * len(self.nodes)

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm test cluster: no {what} after {timeout:.0f} s\n"
                                   + self.logs())
            time.sleep(0.2)

    # --- use ---------------------------------------------------------------------------

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """This process's environment pointed at the cluster (``SLURM_CONF``), without the
        variables of an enclosing Slurm job or MPI launch."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "PMI_", "PMIX_", "OMPI_"))}
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra or {})
        return env

    def run(self, command: list[str], timeout: float, env: dict[str, str] | None = None,
            cwd: str | Path | None = None, give_up_on: str | None = None) -> Step:
        """Run a client command (``srun ...``); never hangs past ``timeout`` seconds, nor
        much past a line showing ``give_up_on`` (killed as at the timeout)."""
        start = time.monotonic()
        output, returncode = communicate_or_kill(self._on(self.host, command), timeout,
                                                 stderr_apart=True, give_up_on=give_up_on,
                                                 env=self.env(env), cwd=cwd)
        if returncode is None:
            self._cancel_all()
        return Step(command, returncode, output, time.monotonic() - start)

    def sbatch(self, script: Path, timeout: float, env: dict[str, str] | None = None,
               cwd: str | Path | None = None) -> Step:
        """Submit a batch script with ``sbatch --wait`` and return its output files' text: the
        job's stdout, then its stderr (kept apart, like ``run``'s, so printed lines stay whole)."""
        files = {stream: self.dir / f"{script.stem}-%j.{stream}" for stream in ("out", "err")}
        step = self.run(["sbatch", "--wait", f"--output={files['out']}",
                         f"--error={files['err']}", str(script)], timeout, env, cwd)
        sections = []
        for stream, title in (("out", "job output"), ("err", "job stderr")):
            written = sorted(self.dir.glob(f"{script.stem}-*.{stream}"))
            text = "\n".join(f.read_text(errors="replace") for f in written)
            for f in written:
                f.unlink()
            sections.append(f"----- {title} -----\n{text.rstrip(chr(10))}\n")
        return Step(step.command, step.returncode, step.output + "".join(sections),
                    step.seconds)

    def _cancel_all(self) -> None:
        subprocess.run(self._on(self.host, ["scancel", "--full", "--user=root"]),
                       env=self.env(), capture_output=True, timeout=30)

    def logs(self, lines: int = 40) -> str:
        """The last lines of every daemon's log (for failure reports)."""
        parts = []
        logs = [sorted(self.dir.glob(f"*.{suffix}")) for suffix in ("log", "out", "err")]
        for log in [path for group in logs for path in group]:
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"----- {log.name} -----\n" + "\n".join(text))
        return "\n".join(parts)

    # --- teardown ----------------------------------------------------------------------

    def close(self) -> None:
        """Cancel what still runs, stop the daemons (slurmd first), delete the directory."""
        if self._procs:
            try:
                self._cancel_all()
            except (OSError, subprocess.TimeoutExpired):
                pass
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        self._procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


__all__ = ["INSTALL_COMMAND", "SlurmCluster", "Step", "unavailable_reason"]
