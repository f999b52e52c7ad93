"""JAX_CPU_MPI_* variables: one registry, clear errors for bad values, a warning for unknown
names, and the documentation's "Configuration" table made from the registry."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import jax_cpu_mpi
from jax_cpu_mpi._src.runtime import config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("name", "value", "message"), [
    ("JAX_CPU_MPI_RECV_TIMEOUT", "abc",
     "JAX_CPU_MPI_RECV_TIMEOUT='abc' is not a number of seconds: set a positive number of "
     "seconds, e.g. 30, or unset it for the default 300"),
    ("JAX_CPU_MPI_RECV_TIMEOUT", "0",
     "JAX_CPU_MPI_RECV_TIMEOUT='0' is not a positive number of seconds"),
    ("JAX_CPU_MPI_RECV_TIMEOUT", "-5", "is not a positive number of seconds"),
    ("JAX_CPU_MPI_RECV_TIMEOUT", "nan", "is not a positive number of seconds"),
    ("JAX_CPU_MPI_EXIT_TIMEOUT", "-1",
     "JAX_CPU_MPI_EXIT_TIMEOUT='-1' is not a number of seconds >= 0: set a number of "
     "seconds, 0 or more, e.g. 60, or unset it for the default 60"),
    ("JAX_CPU_MPI_EXIT_TIMEOUT", "1m", "is not a number of seconds"),
    ("JAX_CPU_MPI_MAX_INFLIGHT_BYTES", "lots",
     "JAX_CPU_MPI_MAX_INFLIGHT_BYTES='lots' is not a byte count: set a positive byte count, "
     "e.g. 1073741824, 512MiB or 1G, or unset it for the default 1GiB"),
    ("JAX_CPU_MPI_MAX_INFLIGHT_BYTES", "0", "is not a positive byte count"),
    ("JAX_CPU_MPI_COMBINE_BYTES", "-1",
     "JAX_CPU_MPI_COMBINE_BYTES='-1' is not a byte count: set a byte count, 0 or more, "
     "e.g. 0, 65536, 256KiB or 1M, or unset it for the default 64KiB"),
    ("JAX_CPU_MPI_ABORT_ON_ERROR", "maybe",
     "JAX_CPU_MPI_ABORT_ON_ERROR='maybe' is not a boolean: set 1 (abort the whole MPI "
     "launch) or 0 (end only this process), or unset it for the default 1"),
    ("JAX_CPU_MPI_GPU_PARITY", "2", "JAX_CPU_MPI_GPU_PARITY='2' is not a boolean"),
    ("JAX_CPU_MPI_FAST_DISPATCH", "fast", "JAX_CPU_MPI_FAST_DISPATCH='fast' is not a boolean"),
    ("JAX_CPU_MPI_DISABLE", "maybe", "JAX_CPU_MPI_DISABLE='maybe' is not a boolean"),
    ("JAX_CPU_MPI_PRIMITIVES", "jax",
     "JAX_CPU_MPI_PRIMITIVES='jax' is not one of 'auto', 'ours': set auto"),
])
def test_bad_value_names_variable_value_and_what_is_allowed(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        config.check_environment()
    monkeypatch.setattr(config, "_current", None)  # restored after the test
    with pytest.raises(ValueError, match=re.escape(message)):
        config.current()
    with pytest.raises(ValueError, match=re.escape(message)):
        jax_cpu_mpi.configure(recv_timeout=30)


@pytest.mark.parametrize(("name", "value", "field", "expected"), [
    ("JAX_CPU_MPI_RECV_TIMEOUT", "2.5", "recv_timeout", 2.5),
    ("JAX_CPU_MPI_EXIT_TIMEOUT", "0", "exit_timeout", 0.0),
    ("JAX_CPU_MPI_MAX_INFLIGHT_BYTES", "64MiB", "max_inflight_bytes", 64 << 20),
    ("JAX_CPU_MPI_ABORT_ON_ERROR", "off", "abort_on_error", False),
    ("JAX_CPU_MPI_GPU_PARITY", "No", "gpu_parity", False),
    ("JAX_CPU_MPI_FAST_DISPATCH", "TRUE", "fast_dispatch", True),
    ("JAX_CPU_MPI_POISON_UNINITIALIZED", "on", "poison_uninitialized", True),
    ("JAX_CPU_MPI_COMBINE_BYTES", "0", "combine_bytes", 0),
    ("JAX_CPU_MPI_COMBINE_BYTES", "1MiB", "combine_bytes", 1 << 20),
    ("JAX_CPU_MPI_COMBINE_BYTES", "", "combine_bytes", 64 << 10),
    ("JAX_CPU_MPI_RECV_TIMEOUT", "", "recv_timeout", 300.0),  # empty: the default
])
def test_good_values(monkeypatch, name, value, field, expected):
    monkeypatch.setenv(name, value)
    assert getattr(config.from_environment(), field) == expected


_BAD_TIMEOUT_PROGRAM = """
import warnings
warnings.simplefilter("always")
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import jax_cpu_mpi
print("JCM-LOWERINGS", [f["state"] for f in jax_cpu_mpi.features() if f["feature"] == "lowerings"])
mesh = jax.make_mesh((2,), ("x",))
x = jax.device_put(jnp.arange(2.0), NamedSharding(mesh, P("x")))
step = lambda v: jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", [(0, 1)]),
                                   jax.ShapeDtypeStruct(v.shape, v.dtype), "x", [(0, 1)])
try:
    jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x)
    print("JCM-NO-ERROR")
except Exception as e:
    print("JCM-ERROR", type(e).__name__, e)
"""


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items()
            if not k.startswith("JAX_CPU_MPI_") and k != "XLA_FLAGS"}
    full.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full, timeout=110, cwd=ROOT)


@pytest.mark.timeout(120)
def test_bad_value_keeps_the_package_on_and_fails_at_the_first_lowering():
    proc = _python(_BAD_TIMEOUT_PROGRAM, JAX_CPU_MPI_RECV_TIMEOUT="abc")
    out = proc.stdout + proc.stderr
    assert "JCM-LOWERINGS ['active']" in proc.stdout, out
    assert ("JCM-ERROR ConfigError JAX_CPU_MPI_RECV_TIMEOUT='abc' is not a number of seconds"
            in proc.stdout), out
    assert "only implemented on GPU" not in out and "could not be activated" not in out, out
    assert "Warning" not in proc.stderr, out  # nothing at import


@pytest.mark.timeout(120)
def test_misspelled_name_warns_once_naming_the_closest():
    proc = _python(_BAD_TIMEOUT_PROGRAM + "\nimport importlib; importlib.reload(jax_cpu_mpi)\n",
                   JAX_CPU_MPI_RECV_TIMOUT="5", JAX_CPU_MPI_WHATEVER="1")
    out = proc.stdout + proc.stderr
    assert "JCM-NO-ERROR" in proc.stdout, out
    assert proc.stderr.count("ConfigWarning") == 1, out
    assert ("JAX_CPU_MPI_RECV_TIMOUT is not a jax_cpu_mpi variable and is ignored (did you "
            "mean JAX_CPU_MPI_RECV_TIMEOUT?)") in proc.stderr, out
    assert "JAX_CPU_MPI_WHATEVER is not a jax_cpu_mpi variable and is ignored" in out, out


def test_unknown_names():
    env = {"JAX_CPU_MPI_RECV_TIMEOUT": "1", "JAX_CPU_MPI_EXIT_TIMOUT": "1",
           "JAX_CPU_MPI_GPUPARITY": "0", "JAX_CPU_MPI_ZZZ": "1", "OTHER": "x"}
    assert config.unknown_names(env) == {"JAX_CPU_MPI_EXIT_TIMOUT": "JAX_CPU_MPI_EXIT_TIMEOUT",
                                         "JAX_CPU_MPI_GPUPARITY": "JAX_CPU_MPI_GPU_PARITY",
                                         "JAX_CPU_MPI_ZZZ": None}
    assert issubclass(jax_cpu_mpi.ConfigWarning, UserWarning)
    assert issubclass(jax_cpu_mpi.ConfigError, ValueError)


def test_every_config_field_has_its_variable():
    from dataclasses import fields

    assert {f.name for f in fields(config.Config)} == {
        v.field for v in config.VARIABLES if v.field}
    for var in config.VARIABLES:
        assert var.name.startswith(config.PREFIX) and var.meaning and var.default, var
        assert (var.parse is not None) == (var.kind == "runtime"), var


def test_every_variable_named_in_the_repository_is_in_the_registry():
    named = set()
    for path in ROOT.rglob("*"):
        if (".git" in path.parts or ".venv" in path.parts or not path.is_file()
                or path.suffix in (".so", ".pyc", ".png", ".whl")):
            continue
        try:
            text = path.read_text(errors="ignore")
        except OSError:
            continue
        named.update(re.findall(r"JAX_CPU_MPI_[A-Z0-9_]*[A-Z0-9]", text))
    # Names that tests make up on purpose (misspellings) are not variables.
    named -= {"JAX_CPU_MPI_RECV_TIMOUT", "JAX_CPU_MPI_WHATEVER", "JAX_CPU_MPI_EXIT_TIMOUT",
              "JAX_CPU_MPI_GPUPARITY", "JAX_CPU_MPI_ZZZ"}
    assert named <= set(config.BY_NAME), sorted(named - set(config.BY_NAME))


def test_the_docs_generate_the_configuration_table_from_the_registry():
    """docs/configuration.md lists the variables with the directive that reads
    config.VARIABLES when the site is built (docs/_ext/jcm_docs.py; tests/docs builds it);
    no page or README keeps a hand-made copy that could drift."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    tables = re.findall(r"```\{jcm-config-table\}\n(?::kind: (.*)\n)?```", page)
    assert tables, "docs/configuration.md has no jcm-config-table"
    shown = {k.strip() for kinds in tables for k in (kinds or ",".join(
        v.kind for v in config.VARIABLES)).split(",")}
    assert {v.kind for v in config.VARIABLES} <= shown, "a kind of variable is on no table"
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        rows = re.findall(r"^\| `(JAX_CPU_MPI_[A-Z0-9_]+)` \|", path.read_text(), flags=re.M)
        assert not rows, f"{path.name} has a hand-made table of variables: {rows}"


_FAULTS_OF_A_SECOND_BLOCK = """
import resource
import numpy as np
import jax_cpu_mpi
np.ones(64 << 20, np.uint8)  # allocated, filled and freed
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
np.ones(64 << 20, np.uint8)
print("FAULTS", resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_keep_freed_memory_applies_in_one_process():
    """JAX_CPU_MPI_KEEP_FREED_MEMORY=1 takes effect at import, without MPI: a second 64 MiB
    block is served from what the first left (glibc's default maps it afresh: its pages are
    faulted in again, 16,384 of them, or at least 32 where numpy gets transparent huge
    pages)."""
    faults = {}
    for value in ("0", "1"):
        proc = _python(_FAULTS_OF_A_SECOND_BLOCK, JAX_CPU_MPI_KEEP_FREED_MEMORY=value)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        faults[value] = int(proc.stdout.split("FAULTS")[1].split()[0])
    assert faults["0"] >= 32, faults
    assert faults["1"] < faults["0"] // 8, faults
