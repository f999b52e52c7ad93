"""The ``jax-cpu-mpi`` command (also ``python -m jax_cpu_mpi``).

``jax-cpu-mpi info [--json]`` prints what jax_cpu_mpi is doing: versions, the MPI library
and its ABI, which lowerings and batching rules are active, processes, devices and the
transport of each device pair. Run it alone or as ``mpirun -n 2 jax-cpu-mpi info``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jax-cpu-mpi",
        description="psend/precv on CPU for JAX: diagnostics.")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser(
        "info",
        help="versions, MPI library and ABI, active lowerings and batching rules, devices "
             "and transports (under mpirun: one report per rank, printed by rank 0)")
    info.add_argument("--json", action="store_true", help="print one line of JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jax-cpu-mpi`` console script."""
    args = _parser().parse_args(argv)
    if args.command == "info":
        from jax_cpu_mpi._src.cli import info

        return info.run(as_json=args.json)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
