"""Record the point-to-point benchmark between two hosts over TCP, on one machine.

    python benchmarks/across_hosts.py [OUT_DIR] [options of python -m jax_cpu_mpi.bench]

Makes the two network-namespace hosts of the test suite (``tests/netns_hosts.py``: a veth
link, MPI forced onto TCP with ``UCX_TLS=tcp,self``; needs root), runs
``python -m jax_cpu_mpi.bench`` with one rank per host, and deletes the hosts. Writes what
``--out`` writes (results.jsonl, osu.txt, nccl.txt, targets.txt, plot.png) and stdout.txt
to OUT_DIR (default ``benchmarks/results/p2p/two-hosts-tcp``). Default methods: psend/precv
(one call per message and inside a scan), raw MPI (mpi4py) and JAX's ppermute over gloo;
pass ``--methods`` to change them. Every other option goes to the benchmark as given, so
``--pattern exchange,ring,bibw,multi-pair`` records the two-way and many-pair patterns
(``jax_cpu_mpi.bench.patterns``) across the hosts too. At large sizes, lower
``--window-bytes``, ``--scan-bytes`` and ``--iter-bytes``: their defaults size a sample for
shared memory, and over the TCP link one sample of 16 MiB messages then moves gigabytes.

This measures the software over a real TCP stack (the kernel's, through a veth pair), not a
network: both "hosts" share the machine's cores and memory bandwidth. Compare the methods
with each other, within one run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from netns_hosts import TwoHosts, unavailable_reason  # noqa: E402

DEFAULT_METHODS = "mpi4py,psend/call,psend/scan,gloo/call,gloo/scan"
_PROGRESS = re.compile(r"^\[[#-]+\] ")


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv and not argv[0].startswith("-") else
               ROOT / "benchmarks" / "results" / "p2p" / "two-hosts-tcp").resolve()
    options = argv[1:] if argv and not argv[0].startswith("-") else argv
    if not any(o.startswith("--methods") for o in options):
        options = ["--methods", DEFAULT_METHODS, *options]
    reason = unavailable_reason()
    if reason is not None:
        print(f"across_hosts: cannot make two hosts here: {reason}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    bench = [sys.executable, "-m", "jax_cpu_mpi.bench", "--format", "osu,nccl",
             "--out", str(out), *options]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.setdefault("JAX_CPU_MPI_RECV_TIMEOUT", "120")
    with TwoHosts() as hosts:
        command = hosts.mpiexec(2, 1, bench, {"JAX_CPU_MPI_RECV_TIMEOUT":
                                              env["JAX_CPU_MPI_RECV_TIMEOUT"]})
        start = time.monotonic()
        with open(out / "stdout.txt", "w") as log:
            header = (f"# two network-namespace hosts ({hosts.hostnames['a']}, "
                      f"{hosts.hostnames['b']}) on one machine, UCX_TLS=tcp,self over a veth "
                      f"pair; load before: {os.getloadavg()[0]:.2f}\n")
            log.write(header)
            sys.stdout.write(header)
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, env=env)
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                if not _PROGRESS.match(line):  # the progress bar stays on the terminal
                    log.write(line)
            status = proc.wait()
            footer = (f"# {time.monotonic() - start:.0f} s; load after: "
                      f"{os.getloadavg()[0]:.2f}\n")
            log.write(footer)
            sys.stdout.write(footer)
    return status


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
