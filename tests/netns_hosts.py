"""Two "hosts" on one machine: network namespaces joined by a veth pair, MPI forced onto TCP.

The test bed that ``tests/runtime/test_across_hosts.py`` runs MPI jobs on. Each :class:`TwoHosts`

* creates two uniquely named network namespaces (``jcmh-<id>-a``, ``jcmh-<id>-b``) joined by
  a veth pair with addresses on a private /24, both ends and ``lo`` up, no other interface
  and no route: traffic can only go between the two namespaces;
* gives each namespace an ``/etc/hosts`` naming both hosts (``/etc/netns/NS/hosts``, which
  ``ip netns exec`` bind-mounts over ``/etc/hosts``), and each process started there its own
  hostname (``unshare --uts``): JAX's and our launch detection, MPI's locality and
  ``jax-cpu-mpi info`` all read the hostname;
* starts MPICH's ``mpiexec`` inside host A with ``-bootstrap ssh -bootstrap-exec WRAPPER``:
  hydra calls ``WRAPPER [-x] HOST CMD...`` to start its proxy on host B, and the wrapper runs
  ``CMD`` inside B's namespace under B's hostname, as ``ssh`` would on a real cluster;
* forces UCX onto TCP (``UCX_TLS=tcp,self``): without it UCX takes the two namespaces for one
  machine and uses shared memory, and nothing would cross the link;
* can take the link down and up (:meth:`TwoHosts.set_link`), and deletes everything it made
  on :meth:`TwoHosts.close` (also after a failure), killing what still runs in its
  namespaces first.

Namespaces need root (CI runs as root); :func:`unavailable_reason` says why they cannot be
made here, for a clear skip.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from mpi_launcher import _RANK_OUTPUT, PROGRAMS, MpiRun, mpirun_executable

#: The private /24 of the link between the hosts (only inside our own namespaces).
SUBNET = "10.213.77"
_PREFIX = "jcmh-"
_NETNS_ETC = Path("/etc/netns")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30,
                          check=check)


def _is_mpich(mpiexec: str) -> bool:
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "HYDRA" in (out.stdout + out.stderr).upper()


def _remove_stale_namespaces() -> None:
    """Delete the namespaces of earlier test runs whose process is gone (a killed pytest)."""
    listing = _ip("netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(_PREFIX):
            continue
        owner = name[len(_PREFIX):].split("-")[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            _delete_namespace(name)


def _kill_namespace_processes(name: str) -> None:
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError, PermissionError):
            pass


def _delete_namespace(name: str) -> None:
    _kill_namespace_processes(name)
    _ip("netns", "delete", name, check=False)
    shutil.rmtree(_NETNS_ETC / name, ignore_errors=True)


def unavailable_reason() -> str | None:
    """Why two namespace hosts cannot be made here (None if they can)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); CI runs the tests as root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2 / util-linux)"
    try:
        mpiexec = mpirun_executable()
    except RuntimeError as e:
        return str(e)
    if not _is_mpich(mpiexec):
        return f"{mpiexec} is not MPICH's hydra (the test bed uses -bootstrap-exec)"
    probe = f"{_PREFIX}{os.getpid()}-probe{uuid.uuid4().hex[:4]}"
    made = _ip("netns", "add", probe, check=False)
    try:
        if made.returncode != 0:
            return f"cannot create a network namespace: {made.stderr.strip()}"
        test = subprocess.run(["ip", "netns", "exec", probe, "unshare", "--uts", "sh", "-c",
                               "hostname jcm-probe && hostname"], capture_output=True,
                              text=True, timeout=30)
        if test.returncode != 0 or test.stdout.strip() != "jcm-probe":
            return f"cannot run a process in a namespace under its own hostname: {test.stderr}"
    finally:
        _delete_namespace(probe)
    return None


class TwoHosts:
    """Hosts ``a`` and ``b``: two network namespaces and a veth link (see module doc)."""

    def __init__(self) -> None:
        _remove_stale_namespaces()
        ident = f"{os.getpid()}-{uuid.uuid4().hex[:4]}"
        short = uuid.uuid4().hex[:6]
        self.namespaces = {"a": f"{_PREFIX}{ident}-a", "b": f"{_PREFIX}{ident}-b"}
        self.hostnames = {"a": f"jcm{short}-a", "b": f"jcm{short}-b"}
        self.veths = {"a": f"jcm{short}a", "b": f"jcm{short}b"}
        self.addresses = {"a": f"{SUBNET}.1", "b": f"{SUBNET}.2"}
        self._dir = Path(tempfile.mkdtemp(prefix="jcm-hosts-"))
        self._closed = False
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    # -- setup and teardown ----------------------------------------------------------------

    def _create(self) -> None:
        a, b = self.namespaces["a"], self.namespaces["b"]
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        # Created inside A, its peer end moved to B: no interface ever sits in our own
        # (root) namespace, so no address of ours is reachable from or routed to anywhere.
        _ip("-n", a, "link", "add", self.veths["a"], "type", "veth", "peer", "name",
            self.veths["b"], "netns", b)
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{self.addresses[h]} {self.hostnames[h]}\n" for h in ("a", "b"))
        for h in ("a", "b"):
            ns = self.namespaces[h]
            _ip("-n", ns, "addr", "add", f"{self.addresses[h]}/24", "dev", self.veths[h])
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", self.veths[h], "up")
            (_NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (_NETNS_ETC / ns / "hosts").write_text(hosts)
        self._wait_for_carrier()
        self.wrapper = self._dir / "bootstrap-exec"
        cases = "".join(f"  {self.hostnames[h]}) ns={self.namespaces[h]} ;;\n"
                        for h in ("a", "b"))
        # Called by hydra as ssh would be: WRAPPER [-x] HOST CMD... (CMD joined by a shell).
        self.wrapper.write_text(
            "#!/bin/sh\n"
            '[ "$1" = "-x" ] && shift\n'
            'host="$1"; shift\n'
            'case "$host" in\n'
            f"{cases}"
            '  *) echo "bootstrap-exec: unknown host $host" >&2; exit 255 ;;\n'
            "esac\n"
            'exec ip netns exec "$ns" unshare --uts sh -c "hostname $host; $*"\n')
        self.wrapper.chmod(0o755)

    def close(self) -> None:
        """Kill what runs in the namespaces, delete them and their files (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for ns in self.namespaces.values():
            _delete_namespace(ns)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> TwoHosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- faults ----------------------------------------------------------------------------

    def set_link(self, up: bool) -> None:
        """Take the link between the hosts down (both ends) or bring it up again."""
        for h in ("a", "b"):
            _ip("-n", self.namespaces[h], "link", "set", self.veths[h], "up" if up else "down")
        if up:  # addresses stay; wait until both ends carry again
            self._wait_for_carrier()

    def _wait_for_carrier(self, timeout: float = 20.0) -> None:
        # UCX lists the interfaces once, at MPI_Init: an end that is not up yet is missed.
        deadline = time.monotonic() + timeout
        while True:
            states = [_ip("-n", self.namespaces[h], "-o", "link", "show",
                          self.veths[h]).stdout for h in ("a", "b")]
            if all("LOWER_UP" in s and ",UP" in s for s in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the veth link did not come up: {states}")
            time.sleep(0.05)

    # -- running MPI jobs ------------------------------------------------------------------

    def in_host(self, host: str, command: list[str]) -> list[str]:
        """``command`` run inside ``host``'s namespace under its hostname."""
        return ["ip", "netns", "exec", self.namespaces[host], "unshare", "--uts", "sh", "-c",
                f"hostname {self.hostnames[host]}; exec {shlex.join(command)}"]

    def mpiexec(self, nprocs: int, ppn: int, command: list[str],
                genv: dict[str, str] | None = None) -> list[str]:
        """MPICH ``mpiexec`` inside host A over both hosts, ``ppn`` ranks per host, on TCP."""
        genv = {"UCX_TLS": "tcp,self", **(genv or {})}
        flags = [f for k, v in genv.items() for f in ("-genv", k, v)]
        inner = [mpirun_executable(), "-bootstrap", "ssh", "-bootstrap-exec", str(self.wrapper),
                 "-hosts", f"{self.hostnames['a']},{self.hostnames['b']}", "-ppn", str(ppn),
                 "-n", str(nprocs), *flags, *command]
        return self.in_host("a", inner)

    def run(self, program: str, *args: str, nprocs: int = 2, ppn: int = 1,
            devices_per_process: int = 1, timeout: float = 120.0,
            env: dict[str, str] | None = None, module: bool = False,
            during: Callable[[Job], None] | None = None) -> MpiRun:
        """Run ``tests/mpi_programs/<program>`` (or ``-m <program>``) across the two hosts.

        ``during(job)`` runs in a thread while the job runs (to inject faults); the job is
        killed at ``timeout`` (``returncode`` None) and every rank's output is collected.
        """
        outdir = tempfile.mkdtemp(prefix="jcm-hosts-run-", dir=self._dir)
        target = program if module else str(PROGRAMS / program)
        # Each rank's exit status and time (epoch seconds) go to OUTDIR/exit-RANK: the
        # launcher cannot always report them (after a network fault it may never learn).
        # A rank killed by a signal kills its shell with the same signal, so that the
        # launcher sees what it would see without the shell.
        rank_command = ["sh", "-c", 'r=${PMI_RANK:-0}; "$@"; s=$?; '
                        'echo "$s $(date +%s.%N)" > "$0/exit-$r"; '
                        '[ $s -gt 128 ] && kill -$((s - 128)) $$; exit $s', outdir,
                        sys.executable, "-u", str(_RANK_OUTPUT), outdir,
                        "-m" if module else "-f", target, *args]
        genv = {
            "JCM_TEST_DEVICES_PER_PROCESS": str(devices_per_process),
            "JAX_CPU_MPI_RECV_TIMEOUT": os.environ.get("JAX_CPU_MPI_RECV_TIMEOUT", "60"),
            "PYTHONPATH": os.pathsep.join(
                p for p in [str(PROGRAMS), os.environ.get("PYTHONPATH", "")] if p),
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        command = self.mpiexec(nprocs, ppn, rank_command, genv)
        full_env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        full_env.update(genv)
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", env=full_env,
                                start_new_session=True)
        job = Job(proc, Path(outdir), self)
        errors: list[BaseException] = []
        injector = None
        if during is not None:
            def inject() -> None:
                try:
                    during(job)
                except BaseException as e:  # reported by the test, after the job ends
                    errors.append(e)
            injector = threading.Thread(target=inject, daemon=True)
            injector.start()
        try:
            output, _ = proc.communicate(timeout=timeout)
            returncode: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            for ns in self.namespaces.values():  # the ranks on host B too
                _kill_namespace_processes(ns)
            output, _ = proc.communicate()
            returncode = None
        job.ended_at = time.time()
        # mpiexec may end before a rank on the other host does (it cannot reach it after a
        # network fault): give those ranks a moment to finish and write their output.
        settle = time.monotonic() + 15
        while self._ranks_running(outdir) and time.monotonic() < settle:
            time.sleep(0.05)
        job.ranks_ended_at = time.time()
        for ns in self.namespaces.values():
            _kill_namespace_processes(ns)
        if injector is not None:
            injector.join(timeout=30)
        ranks = {int(p.stem.split("-")[1]): p.read_text(errors="replace")
                 for p in sorted(Path(outdir).glob("rank-*.log"))}
        job.exits = job.read_exits()
        shutil.rmtree(outdir, ignore_errors=True)
        result = MpiRun(command, returncode, output, ranks)
        result.job = job  # type: ignore[attr-defined]
        if errors:
            raise AssertionError(f"fault injection failed: {errors[0]!r}\n{result.report()}")
        return result


    def _ranks_running(self, outdir: str) -> bool:
        """Whether a rank of the job writing to ``outdir`` still runs on either host."""
        for ns in self.namespaces.values():
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if outdir.encode() in cmdline and b"_rank_output.py" in cmdline:
                    return True
        return False


class Job:
    """A running job, as the ``during`` callback of :meth:`TwoHosts.run` sees it."""

    def __init__(self, proc: subprocess.Popen, outdir: Path, hosts: TwoHosts) -> None:
        self.proc = proc
        self.outdir = outdir
        self.hosts = hosts
        self.started_at = time.time()
        self.ended_at: float | None = None  # when mpiexec ended
        self.ranks_ended_at: float | None = None  # when no rank ran any more on either host
        self.marks: dict[str, float] = {}
        #: rank -> (exit status, epoch time of the exit), once the job has ended.
        self.exits: dict[int, tuple[int, float]] = {}

    def read_exits(self) -> dict[int, tuple[int, float]]:
        """rank -> (exit status, epoch seconds) of the ranks that have exited so far."""
        exits = {}
        for path in self.outdir.glob("exit-*"):
            fields = path.read_text().split()
            if len(fields) == 2:
                exits[int(path.name.split("-")[1])] = (int(fields[0]), float(fields[1]))
        return exits

    def wait_for_exits(self, ranks: int, timeout: float) -> dict[int, tuple[int, float]]:
        """Wait until ``ranks`` ranks have exited (or ``timeout``); returns what exited."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            exits = self.read_exits()
            if len(exits) >= ranks or self.proc.poll() is not None:
                return exits
            time.sleep(0.05)
        return self.read_exits()

    def output(self, rank: int) -> str:
        try:
            return (self.outdir / f"rank-{rank}.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for(self, rank: int, text: str, timeout: float = 120.0) -> str:
        """Wait until ``rank`` printed a line containing ``text``; returns that line."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.output(rank).splitlines():
                if text in line:
                    return line
            if self.proc.poll() is not None:
                raise AssertionError(f"job ended before rank {rank} printed {text!r}")
            time.sleep(0.05)
        raise AssertionError(f"rank {rank} did not print {text!r} within {timeout} s")

    def mark(self, name: str) -> None:
        """Record when something was done (epoch seconds, as the ranks print them)."""
        self.marks[name] = time.time()
