"""The compat room: every private JAX / XLA / mpi4py name jax_cpu_mpi uses, and the features
they serve (:mod:`.registry` says how a missing name switches one feature off).

A leaf: it imports nothing else of jax_cpu_mpi. Every other module takes private names from
here, never from ``jax._src`` itself.
"""

# The registry's machinery, then every name of every feature, as one namespace
# (``compat.enable(...)``, ``compat.GPU_PARITY``, ``compat.hlo``).
from .jax_names import *  # noqa: F403
from .mpi4py_names import predicted_mpi4py_abi  # noqa: F401
from .registry import *  # noqa: F403
from .versions import (  # noqa: F401
    TESTED_JAX_VERSIONS,
    UntestedJaxWarning,
    has_gloo_cache_hang,
    jaxlib_version,
    warn_if_untested,
)
