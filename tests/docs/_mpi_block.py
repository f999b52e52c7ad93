"""Run one doc block under mpirun: ``_mpi_block.py BLOCK.py OUTDIR``.

Started by tests/mpi_launcher.py (each rank's stdout and stderr already go to its log); this
keeps the block's own stdout apart, in ``OUTDIR/stdout-<rank>.txt``, to compare rank 0's
with the page.
"""

import contextlib
import os
import runpy
import sys

block, outdir = sys.argv[1:3]
rank = next((os.environ[v] for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
             if v in os.environ), "0")
with open(os.path.join(outdir, f"stdout-{rank}.txt"), "w") as out:
    with contextlib.redirect_stdout(out):
        sys.argv = [block]
        runpy.run_path(block, run_name="__main__")
