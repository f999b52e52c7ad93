"""Run a program with this rank's stdout/stderr redirected to ``<outdir>/rank-<rank>.log``.

Usage (by tests/mpi_launcher.py): ``python _rank_output.py OUTDIR (-f FILE | -m MODULE) ARGS``.
"""

import faulthandler
import os
import runpy
import sys

outdir, kind, target, *args = sys.argv[1:]
rank = next((os.environ[v] for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK",
                                     "SLURM_PROCID") if v in os.environ), "0")
fd = os.open(os.path.join(outdir, f"rank-{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
             0o644)
os.dup2(fd, 1)
os.dup2(fd, 2)
os.close(fd)
# A rank that crashes (a segfault in a library, an abort) leaves every thread's Python stack in
# its log, which the failing test prints: without it the log ends at the last line printed.
faulthandler.enable()
import jax_p2p_removal  # noqa: E402  (on PYTHONPATH: the mpi_programs folder)

jax_p2p_removal.simulate_if_requested()  # JCM_TEST_JAX_WITHOUT_P2P=1: JAX without psend/precv
if kind == "-m":
    sys.argv = [target, *args]
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    sys.argv = [target, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    runpy.run_path(target, run_name="__main__")
