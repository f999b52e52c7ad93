"""``python -m jax_cpu_mpi info``: see :mod:`jax_cpu_mpi.cli`."""

import sys

from .cli import main

sys.exit(main())
