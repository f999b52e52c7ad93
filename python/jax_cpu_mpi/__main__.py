"""``python -m jax_cpu_mpi info``: see :mod:`jax_cpu_mpi.cli`."""

import sys

from jax_cpu_mpi._src.cli.main import main

sys.exit(main())
