"""``python -m jax_cpu_mpi.bench``: see :mod:`jax_cpu_mpi.bench`."""

import sys

from .cli import main

sys.exit(main())
