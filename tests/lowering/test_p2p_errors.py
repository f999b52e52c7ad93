"""Bad input gets a clear Python error, never a hang or a silent wrong answer."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cpu_mpi
from conftest import make_mesh, needs_jax_p2p
from jax_cpu_mpi import config
from jax_cpu_mpi._src.runtime.launchers import reserve_port


def _shmap(mesh, body):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))


def test_byte_count_mismatch_names_op_pair_and_shapes():
    mesh = make_mesh((2, "x"))

    def body(v):  # sends float32[4], receives float32[2]
        tok = jax_cpu_mpi.psend(v, "x", [(0, 1)])
        r = jax_cpu_mpi.precv(tok, jax.ShapeDtypeStruct((2,), jnp.float32), "x", [(0, 1)])
        return jnp.concatenate([r, r])

    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
    with pytest.raises(jax.errors.JaxRuntimeError) as err:
        np.asarray(_shmap(mesh, body)(x))
    msg = str(err.value)
    for part in ("precv", "partition 1", "partition 0", "float32[2]", "float32[4]",
                 "8 bytes", "16 bytes", "same shape and dtype"):
        assert part in msg, (part, msg)


# Same byte count, another type: float32[n] into int32[n] (dtype) or float32[2, n/2] (shape).
# 4 elements are queued or copied into a waiting receiver; 16 Ki elements (64 KiB) are
# offered from the sender's operand (the mailbox's path from 16 KiB).
@pytest.mark.parametrize("n", [4, 1 << 14])
@pytest.mark.parametrize("kind", ["dtype", "shape"])
def test_same_bytes_other_dtype_or_shape_names_both_sides(kind, n):
    mesh = make_mesh((2, "x"))
    want = (jax.ShapeDtypeStruct((n,), jnp.int32) if kind == "dtype"
            else jax.ShapeDtypeStruct((2, n // 2), jnp.float32))
    recv_desc = "int32" if kind == "dtype" else "float32"
    recv_desc += f"[{n}]" if kind == "dtype" else f"[2,{n // 2}]"

    def body(v):
        r = jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", [(0, 1)]), want, "x", [(0, 1)])
        return v + r.reshape(n).astype(v.dtype)

    x = jax.device_put(jnp.arange(2.0 * n, dtype=jnp.float32), NamedSharding(mesh, P("x")))
    with pytest.raises(jax.errors.JaxRuntimeError) as err:
        np.asarray(_shmap(mesh, body)(x))
    msg = str(err.value)
    for part in ("INVALID_ARGUMENT", "precv", "on partition 1", "from partition 0",
                 f"expected {recv_desc} ({4 * n} bytes)", f"sent float32[{n}] ({4 * n} bytes)",
                 f"the sender's float32[{n}] as the receiver's {recv_desc}",
                 "same shape and dtype"):
        assert part in msg, (part, msg)
    # The mismatched message was consumed: the channel delivers the next one.
    got = _shmap(mesh, _exchange(jax_cpu_mpi.psend, jax_cpu_mpi.precv, "x", [(0, 1)]))(x)
    np.testing.assert_array_equal(np.asarray(got)[n:], np.arange(n, dtype=np.float32))


def test_outside_shard_map_keeps_jax_message():
    with pytest.raises(NameError, match="unbound axis name: x"):
        jax.jit(lambda v: jax_cpu_mpi.psend(v, "x", [(0, 1)])).lower(jnp.ones(2))
    with pytest.raises(NameError, match=r"unbound axis name: x.*call precv under `jax\.shard_map`"):
        jax.jit(lambda: jax_cpu_mpi.precv(jax.lax.create_token(),
                                          jax.ShapeDtypeStruct((2,), jnp.float32), "x",
                                          [(0, 1)])).lower()


def test_duplicate_pairs_keep_jax_value_error():
    mesh = make_mesh((2, "x"))
    x = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("x")))
    f = _shmap(mesh, lambda v: jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", [(0, 1), (0, 1)]),
                                                 jax.ShapeDtypeStruct(v.shape, v.dtype), "x",
                                                 [(0, 1)]))
    with pytest.raises(ValueError, match=r"psend sources and destinations must be unique"):
        f.lower(x)


def test_unmatched_precv_times_out_with_op_and_peer(short_recv_timeout):
    mesh = make_mesh((2, "x"))

    def body(v):
        return jax_cpu_mpi.precv(jax.lax.create_token(), jax.ShapeDtypeStruct(v.shape, v.dtype),
                                 "x", [(0, 1)])

    x = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("x")))
    with config.overrides(gpu_parity=False):  # GPU rejects this at compile time already
        f = _shmap(mesh, body)
        with pytest.raises(jax.errors.JaxRuntimeError) as err:
            np.asarray(f(x))
    msg = str(err.value)
    for part in ("precv", "partition 1", "from partition 0", "waited 2",
                 "JAX_CPU_MPI_RECV_TIMEOUT", "(0, 1)"):
        assert part in msg, (part, msg)


def _run_two_jax_processes(program: Path, timeout: float) -> list[str]:
    """Each process's exit status and output. The coordinator's port stays held here until
    both have ended (``reserve_port``): a port let go could be taken by any process of the
    machine before process 0 binds it, or be another job's coordinator's too. Once one
    process fails, the other gets a short grace before it is killed, instead of the whole
    timeout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "HYDRA"))}
    with reserve_port() as held, tempfile.TemporaryDirectory() as tmp:
        port = held.getsockname()[1]
        logs = [Path(tmp) / f"process-{i}.log" for i in range(2)]
        procs = []
        for i, log in enumerate(logs):
            with log.open("w") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, str(program), str(i), str(port)], env=env,
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + 10)
            time.sleep(0.1)
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        return [f"exit {p.returncode}\n{log.read_text(errors='replace')}"
                for p, log in zip(procs, logs, strict=True)]


@pytest.mark.timeout(120)
def test_mesh_spanning_processes_without_mpirun_says_how_to_launch():
    """Two JAX processes joined by jax.distributed, but not an MPI job: a clear error."""
    program = Path(__file__).parents[1] / "mpi_programs" / "no_mpirun.py"
    outputs = _run_two_jax_processes(program, timeout=100)
    report = "\n".join(f"--- process {i} ---\n{o}" for i, o in enumerate(outputs))
    for out in outputs:
        assert "GOT MpiSetupError" in out, report
        assert "mpirun" in out and "singleton" in out, report


# ------------------------------------------------------------- pairs outside the axis


def _exchange(psend, precv, axis_name, perm):
    def body(v):
        tok = psend(v, axis_name, perm)
        return precv(tok, jax.ShapeDtypeStruct(v.shape, v.dtype), axis_name, perm)

    return body


@pytest.mark.parametrize(("perm", "bad"), [([(0, 3)], (0, 3)), ([(0, 1), (2, 0)], (2, 0)),
                                           ([(0, -3)], (0, -3))])
def test_pair_outside_the_axis_is_a_clear_error_when_traced(perm, bad):
    mesh = make_mesh((2, "x"))
    x = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("x")))
    f = _shmap(mesh, _exchange(jax_cpu_mpi.psend, jax_cpu_mpi.precv, "x", perm))
    with pytest.raises(ValueError, match=re.escape(
            f"psend: the pair {bad} of perm={perm} names a device outside axis 'x' of size 2: "
            "indices must be 0..1 (or -2..-1, counted from the end)")):
        jax.make_jaxpr(f)(x)
    # precv alone (with a token of its own) is checked too.
    g = _shmap(mesh, lambda v: jax_cpu_mpi.precv(jax.lax.create_token(),
                                                 jax.ShapeDtypeStruct(v.shape, v.dtype), "x",
                                                 perm))
    with pytest.raises(ValueError, match=re.escape(f"precv: the pair {bad} of perm={perm}")):
        jax.make_jaxpr(g)(x)


def test_negative_indices_in_the_axis_count_from_the_end():
    mesh = make_mesh((2, "x"))
    x = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("x")))
    got = _shmap(mesh, _exchange(jax_cpu_mpi.psend, jax_cpu_mpi.precv, "x", [(-1, 0)]))(x)
    np.testing.assert_array_equal(np.asarray(got), [2.0, 3.0, 0.0, 0.0])


def test_pair_outside_a_tuple_of_axes_names_their_product():
    mesh = make_mesh((2, "x"), (2, "y"))
    spec = P(("x", "y"))
    x = jax.device_put(jnp.arange(4.0) + 1, NamedSharding(mesh, spec))

    def program(perm):
        return jax.jit(jax.shard_map(
            _exchange(jax_cpu_mpi.psend, jax_cpu_mpi.precv, ("x", "y"), perm), mesh=mesh,
            in_specs=spec, out_specs=spec))

    with pytest.raises(ValueError, match=re.escape(
            "psend: the pair (0, 4) of perm=[(0, 4)] names a device outside axes ('x', 'y') "
            "of size 4 (the product of their sizes): indices must be 0..3")):
        program([(0, 4)]).lower(x)
    np.testing.assert_array_equal(np.asarray(program([(0, 3)])(x)), [0.0, 0.0, 0.0, 1.0])


@needs_jax_p2p
def test_jax_lax_pair_outside_the_axis_is_a_clear_error_when_lowered():
    import warnings

    mesh = make_mesh((2, "x"))
    x = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("x")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # jax.lax.psend on JAX 0.12
        f = _shmap(mesh, _exchange(jax.lax.psend, jax.lax.precv, "x", [(0, 3)]))
        with pytest.raises(ValueError, match=re.escape(
                "psend: the pair (0, 3) of perm=[(0, 3)] names a device outside axis 'x' of "
                "size 2: indices must be 0..1")):
            f.lower(x)
