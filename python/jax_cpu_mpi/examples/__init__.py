"""Runnable examples of jax_cpu_mpi.

* ``python -m jax_cpu_mpi.examples.pipeline``: pipeline-parallel (GPipe) training of a small
  MLP, with activations and cotangents moving between stages by ``psend``/``precv``. The same
  file runs under ``mpirun -n P``.
"""
