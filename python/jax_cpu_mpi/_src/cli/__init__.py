"""``python -m jax_cpu_mpi``: ``info`` and ``bench``."""
