"""A fork server for compat_probe.py: ``import jax`` once, then one forked child per probe.

``python compat_zygote.py`` (tests/compat/test_compat.py starts it once per test module, with
the environment a probe gets) imports jax, as compat_probe.py does before it removes its
name, and nothing else of JAX's or jax_cpu_mpi's: JAX's backends are not started and its
plugins not discovered, so jax_cpu_mpi is not imported (the probe's own assertion) and JAX
has not installed its at-fork warning (it does so when it starts its backends). The only
threads besides Python's are OpenBLAS's pool, started by ``import numpy`` (imported first to
tell them apart), which OpenBLAS itself shuts down around ``fork()`` (pthread_atfork). It
prints ``READY <json>`` with those facts.

Then, for each request line ``{"argv": [SCRIPT, ARGS...], "stdout": FILE, "stderr": FILE,
"timeout": SECONDS}`` on stdin, it forks a child that sends its stdout/stderr (file
descriptors 1 and 2, so output of C code too) to those files, runs SCRIPT as ``__main__``
with those arguments (runpy, as ``python SCRIPT ARGS`` would) and exits as that interpreter
would: an uncaught exception prints its traceback and exits 1, ``sys.exit`` keeps its code,
atexit handlers run. The server waits for the child, kills it (its whole process group)
once ``timeout`` seconds have passed, and answers ``PID <pid>`` at once, then
``DONE <returncode>`` (negative: the
signal that ended it, as subprocess reports it) or ``TIMEOUT``. Each child starts from the
server's state, never from another child's: nothing one probe removes reaches the next.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import threading
import time

import numpy  # noqa: F401  (first: JAX imports it, and the threads it starts are OpenBLAS's)

THREADS_AFTER_NUMPY = len(os.listdir("/proc/self/task"))

import jax  # noqa: E402, F401  (what compat_probe.py imports before it removes a name)
from jax._src import xla_bridge  # noqa: E402


def _facts() -> dict:
    return {
        "jax_cpu_mpi_imported": any(m.split(".")[0] == "jax_cpu_mpi" for m in sys.modules),
        "backends_started": bool(xla_bridge._backends),
        "plugins_discovered": bool(getattr(xla_bridge, "_plugins_registered", False)),
        "jax_at_fork_handler": bool(getattr(xla_bridge, "_at_fork_handler_installed", False)),
        "python_threads": threading.active_count(),
        "native_threads": len(os.listdir("/proc/self/task")),
        "native_threads_after_numpy": THREADS_AFTER_NUMPY,
        "pid": os.getpid(),
    }


def _child(request: dict) -> None:
    """In the forked child: become ``python SCRIPT ARGS`` with output to the given files."""
    os.setsid()  # its own process group: a timeout kills whatever it started too
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, name in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.close(null)
    sys.stdin = open(0, closefd=False)
    import faulthandler

    faulthandler.enable()  # a crash leaves its Python traceback in the stderr file
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
    # An exception propagates out of the server's loop to the top: Python prints it and
    # exits 1, as the script run by itself would.
    runpy.run_path(sys.argv[0], run_name="__main__")
    sys.exit(0)


def _wait(pid: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return f"DONE {os.waitstatus_to_exitcode(status)}"
        if time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return "TIMEOUT"
        time.sleep(0.01)


def serve() -> None:
    print("READY " + json.dumps(_facts()), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)  # does not return
        print(f"PID {pid}", flush=True)
        print(_wait(pid, float(request["timeout"])), flush=True)


if __name__ == "__main__":
    serve()
