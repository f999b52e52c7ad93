"""Runnable examples of jax_cpu_mpi.

* ``python -m jax_cpu_mpi.examples.pipeline``: pipeline-parallel training of a small MLP with
  :mod:`jax_cpu_mpi.pipeline` (``--schedule gpipe``, ``1f1b``, ``interleaved-1f1b`` or
  ``zero-bubble``), activations and cotangents moving between stages by ``psend``/``precv``.
  The same file runs under ``mpirun -n P``.
"""
