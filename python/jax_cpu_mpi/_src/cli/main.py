"""The ``jax-cpu-mpi`` command (also ``python -m jax_cpu_mpi``).

``jax-cpu-mpi info [--json]`` prints what jax_cpu_mpi is doing: versions, the MPI library
and its ABI, which lowerings and batching rules are active, processes, devices and the
transport of each device pair. Run it alone or as ``mpirun -n 2 jax-cpu-mpi info``.

``jax-cpu-mpi trace DIR`` merges the per-process files that ``JAX_CPU_MPI_TRACE=DIR`` (or
``jax_cpu_mpi.trace(DIR)``) wrote into ``DIR/timeline.json`` and ``DIR/timeline.png`` and
prints where each device's time went.
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
    trace = commands.add_parser(
        "trace",
        help="merge the per-process files of JAX_CPU_MPI_TRACE=DIR into DIR/timeline.json "
             "(Perfetto / chrome://tracing) and DIR/timeline.png, and print a per-device "
             "summary")
    trace.add_argument("directory", help="the directory the processes wrote their files into")
    trace.add_argument("--no-png", action="store_true", help="do not draw timeline.png")
    trace.add_argument("--json", action="store_true",
                       help="print the summary as one line of JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jax-cpu-mpi`` console script."""
    args = _parser().parse_args(argv)
    if args.command == "info":
        from jax_cpu_mpi._src.cli import info

        return info.run(as_json=args.json)
    if args.command == "trace":
        from jax_cpu_mpi._src.cli import trace

        return trace.run(args.directory, picture=not args.no_png, as_json=args.json)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
