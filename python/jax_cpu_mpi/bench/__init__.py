"""Point-to-point benchmarks: psend/precv against raw MPI, gloo, mpi4jax, NCCL and memcpy.

Run ``mpirun -n 2 python -m jax_cpu_mpi.bench`` (two ranks, the MPI methods and, on rank 0,
the in-process methods) or ``python -m jax_cpu_mpi.bench`` (one process: in-process methods
only). ``--help`` lists the options; ``benchmarks/README.md`` explains the methods and the
output formats.

Modules, one job each:

* :mod:`.options`: command line, sizes and iteration plan;
* :mod:`.session`: processes, MPI communicator and the two devices under test;
* :mod:`.stats`: one measurement's samples and their statistics;
* :mod:`.methods`: one function per method;
* :mod:`.runner`: runs the methods over the sizes, with a progress bar;
* :mod:`.report`: OSU-style and nccl-tests-style tables, JSON lines;
* :mod:`.targets`: the ratios the project aims at;
* :mod:`.plot`: the PNG plot (needs matplotlib).
"""

from __future__ import annotations

from .cli import main

__all__ = ["main"]
