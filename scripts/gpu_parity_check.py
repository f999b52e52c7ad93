#!/usr/bin/env python3
"""XLA GPU's verdict on every program of the GPU-parity corpus, next to jax-cpu-mpi's.

Compiles each 2-device program of ``tests/mpi_programs/parity_cases.py`` (``corpus()``)
with XLA GPU (``jit(...).lower(...).compile()``: XLA runs its send/recv deadlock
verifier while compiling) and lowers the same program on 2 CPU devices with the
GPU-parity check on, then prints one markdown table row per program:

    | program | XLA GPU | jax-cpu-mpi | agree |

Two verdicts agree when both accept, or both reject with the same XLA message kind (the
text of ours up to the first instruction name, e.g. "Expected recv, but found"; JAX's
own ValueError for duplicate pairs counts the same way). A program that JAX itself
cannot lower for GPU (JAX 0.10 fails on an ``optimization_barrier`` that holds a token)
gets no XLA verdict and is not counted. ``--run`` also executes the programs both sides
accept and compares the GPU results with the CPU results.

Needs a machine with at least 2 GPUs (CUDA jaxlib plugin installed) and jax-cpu-mpi
installed; not part of CI. Without 2 GPUs it prints our verdicts, says why XLA's were
not computed and exits with status 2. Exit status 0: every XLA verdict agrees with ours
and our verdicts are the ones the corpus expects; 1 otherwise.

    python scripts/gpu_parity_check.py            # the table
    python scripts/gpu_parity_check.py --run      # and compare the values of accepted ones
    python scripts/gpu_parity_check.py -k cycle   # only programs whose name contains "cycle"
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "mpi_programs"))
# Two CPU devices for our side of the comparison (set before JAX starts).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jax_cpu_mpi  # noqa: E402, F401  (registers the CPU lowerings and the check)


@dataclass(frozen=True)
class Verdict:
    #: "compiles", "rejected" (by XLA's verifier or JAX's pair check) or "JAX error".
    status: str
    message: str = ""

    def cell(self, accepted: str = "compiles") -> str:
        if self.status == "compiles":
            return accepted
        first = self.message.splitlines()[0] if self.message else ""
        first = first if len(first) <= 110 else first[:107] + "..."
        return f"{self.status}: `{first}`".replace("|", "\\|")


def kind(message: str) -> str:
    """The XLA message kind: the text up to the first instruction name (``%...``)."""
    return message.split("%")[0].splitlines()[0].strip()


def judge(action: Callable[[], Any], *, ours: bool) -> Verdict:
    try:
        action()
    except ValueError as error:  # JAX's check of duplicate pairs, on both sides
        return Verdict("rejected", str(error))
    except jax.errors.JaxRuntimeError as error:
        return Verdict("rejected", str(error))
    except Exception as error:  # shown in the table, not hidden
        if ours:
            raise
        return Verdict("JAX error", f"{type(error).__name__}: {error}")
    return Verdict("compiles")


def agree(xla: Verdict, ours: Verdict) -> bool | None:
    if xla.status == "JAX error":
        return None
    if xla.status != ours.status:
        return False
    return xla.status == "compiles" or kind(ours.message) in xla.message


def expected(program: Any, ours: Verdict) -> bool:
    """Our verdict is the one the corpus records for the program."""
    if program.rejected is None:
        return ours.status == "compiles"
    return ours.status == "rejected" and re.search(program.rejected, ours.message) is not None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="store_true",
                        help="also run the programs both sides accept and compare values")
    parser.add_argument("-k", dest="only", default="",
                        help="only the programs whose name contains this text")
    args = parser.parse_args(argv)

    import parity_cases as cases

    cpu_mesh = jax.make_mesh((2,), ("x",), devices=jax.devices("cpu")[:2])
    cpu_programs = [p for p in cases.corpus(cpu_mesh) if args.only in p.name]
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    gpu_programs = {}
    if len(gpus) >= 2:
        gpu_mesh = jax.make_mesh((2,), ("x",), devices=gpus[:2])
        gpu_programs = {p.name: p for p in cases.corpus(gpu_mesh)}

    print(f"jax {jax.__version__}, jaxlib {jax.lib.__version__}; "
          f"GPUs: {', '.join(str(d) for d in gpus) or 'none'}\n")
    print("| program | XLA GPU | jax-cpu-mpi | agree |")
    print("|---|---|---|---|")
    ok = True
    for program in cpu_programs:
        ours = judge(lambda p=program: p.jitted.lower(*p.args), ours=True)
        ok &= expected(program, ours)
        gpu = gpu_programs.get(program.name)
        if gpu is None:
            xla, same = Verdict("not run", "needs 2 GPUs"), None
        else:
            xla = judge(lambda g=gpu: g.jitted.lower(*g.args).compile(), ours=False)
            same = agree(xla, ours)
            ok &= same is not False
        cell = {True: "yes", False: "**NO**", None: "-"}[same]
        if args.run and gpu is not None and same and xla.status == "compiles":
            got = [np.asarray(v) for v in jax.tree.leaves(gpu.jitted(*gpu.args))]
            want = [np.asarray(v) for v in jax.tree.leaves(program.jitted(*program.args))]
            values = all(np.allclose(g, w, rtol=1e-5, atol=1e-6)
                         for g, w in zip(got, want, strict=True))
            ok &= values
            cell += ", same values" if values else ", **values differ**"
        print(f"| {program.name} | {xla.cell()} | {ours.cell('accepted')} | {cell} |", flush=True)
    if not gpu_programs:
        print(f"\nXLA GPU verdicts not computed: this check needs at least 2 GPUs, found "
              f"{len(gpus)}.", file=sys.stderr)
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
