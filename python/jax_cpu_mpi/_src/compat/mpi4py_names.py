"""The private mpi4py names jax_cpu_mpi uses (mpi4py 4's run-time choice of MPI ABI).

A leaf like the rest of the compat room; every lookup fails soft (None: "cannot tell").
"""

from __future__ import annotations


def predicted_mpi4py_abi() -> str | None:
    """The ABI mpi4py will pick when ``mpi4py.MPI`` is imported, if mpi4py 4 chooses one
    at run time (the computation ``mpi4py/_mpiabi.py`` makes, without initializing MPI);
    None where this mpi4py does not choose, or hides how."""
    try:
        from mpi4py import _mpiabi
    except ImportError:
        return None
    if "mpi4py.MPI" not in getattr(_mpiabi, "_registry", {}):
        return None
    get = getattr(_mpiabi, "_get_mpiabi", None)
    try:
        return str(get()) if get is not None else None
    except Exception:  # mpi4py raises its own errors later, with its own message
        return None
