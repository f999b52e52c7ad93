"""Simulate a JAX that has dropped ``psend``/``precv`` (as JAX will after the 0.12 deprecation).

:func:`simulate` deletes JAX's functions and primitives: ``jax._src.lax.parallel.psend``,
``precv``, ``psend_p``, ``precv_p``, and ``jax.lax.psend``/``precv`` (exports on 0.10-0.11,
deprecation entries on 0.12). It must run after ``import jax`` and before jax_cpu_mpi is
imported (by hand, or by JAX's plugin discovery at the first ``jax.devices()``), so that
jax_cpu_mpi finds no JAX primitive and defines its own.

With :data:`ENV` set to ``effect``, JAX's ``single_side_collective_effect`` (the effect
psend/precv carry, which a JAX without them may drop as well) is deleted too.

With :data:`ENV` set to ``1`` (or ``effect``), the test suite simulates the removal:
``tests/conftest.py`` and ``_rank_output.py`` (every mpirun rank) call
:func:`simulate_if_requested`, and Python subprocesses of the tests start through this
file::

    python jax_p2p_removal.py (-m MODULE | -f FILE) [ARGS...]
"""

from __future__ import annotations

import os
import runpy
import sys

ENV = "JCM_TEST_JAX_WITHOUT_P2P"
NAMES = ("psend", "precv", "psend_p", "precv_p")


def requested() -> bool:
    return os.environ.get(ENV, "") in ("1", "effect")


def simulate() -> None:
    """Delete JAX's psend/precv functions and primitives; jax_cpu_mpi must not be imported."""
    if "jax_cpu_mpi" in sys.modules:
        raise RuntimeError("simulate JAX's psend/precv removal before importing jax_cpu_mpi")
    import jax.lax
    from jax._src.lax import parallel

    for name in NAMES:
        if hasattr(parallel, name):
            delattr(parallel, name)
    for name in ("psend", "precv"):
        jax.lax.__dict__.pop(name, None)  # jax 0.10 / 0.11: plain exports
        getattr(jax.lax, "_deprecations", {}).pop(name, None)  # jax 0.12: deprecated
    getattr(getattr(jax.lax, "__getattr__", None), "cache_clear", lambda: None)()
    if os.environ.get(ENV, "") == "effect":
        delattr(parallel, "single_side_collective_effect")
    assert not any(hasattr(parallel, n) for n in NAMES)
    assert not hasattr(jax.lax, "psend") and not hasattr(jax.lax, "precv")


def simulate_if_requested() -> None:
    if requested():
        simulate()


def python_prefix() -> list[str]:
    """The command that starts a Python subprocess of the tests (through this file if
    :data:`ENV` is set, so that the subprocess simulates the removal too)."""
    if requested():
        return [sys.executable, os.path.abspath(__file__)]
    return [sys.executable]


if __name__ == "__main__":
    kind, target, *args = sys.argv[1:]
    simulate_if_requested()
    sys.argv = [target, *args]
    if kind == "-m":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")
