"""JAX_CPU_MPI_COLLECTIVES in one process: the setting, what `auto` means, `info`, and that
collectives inside one process keep JAX's lowering whatever the setting."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_cpu_mpi import config
from jax_cpu_mpi._src.cli import info
from jax_cpu_mpi._src.lowering import collectives
from jax_cpu_mpi._src.runtime import config as registry


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="collectives must be one of auto, mpi, gloo"):
        config.configure(collectives="nccl")
    var = registry.BY_NAME["JAX_CPU_MPI_COLLECTIVES"]
    with pytest.raises(registry.ConfigError):
        var.read({"JAX_CPU_MPI_COLLECTIVES": "nccl"})
    assert var.read({"JAX_CPU_MPI_COLLECTIVES": "MPI"}) == "mpi"


@pytest.mark.parametrize(("env", "want"), [({}, "gloo"), ({"PMI_RANK": "0"}, "mpi"),
                                           ({"OMPI_COMM_WORLD_RANK": "1"}, "mpi")])
def test_auto_means_mpi_under_an_mpi_launcher(monkeypatch, env, want):
    for name in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with config.overrides(collectives="auto"):
        assert collectives.resolved_setting() == want
    with config.overrides(collectives="gloo"):
        assert collectives.resolved_setting() == "gloo"


def test_info_shows_the_setting_and_what_keeps_gloo():
    with config.overrides(collectives="mpi"):
        section = info.collectives_section()
    assert section["setting"] == section["resolved"] == "mpi"
    assert section["active"]
    assert any("bfloat16" in f["what"] for f in section["fallbacks"])
    assert "float16" not in section["mpi_dtypes"]["sum"]


def test_info_shows_park_and_its_default_is_off(monkeypatch):
    monkeypatch.delenv("JAX_CPU_MPI_PARK", raising=False)
    assert info.collectives_section()["park"] == "off"
    monkeypatch.setenv("JAX_CPU_MPI_PARK", "on")
    assert info.collectives_section()["park"] == "on"
    text = info.format_process(info.local_report())
    assert "JAX_CPU_MPI_PARK=on" in text


def test_axes_inside_one_process_keep_jax_lowering():
    mesh = jax.make_mesh((4,), ("x",))
    f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"),
                              out_specs=P()))
    x = jax.device_put(np.arange(8, dtype=np.float32), jax.NamedSharding(mesh, P("x")))
    with config.overrides(collectives="mpi"):
        text = f.lower(x).as_text()
        out = f(x)
    assert collectives.ALL_REDUCE_TARGET not in text
    assert "all_reduce" in text
    np.testing.assert_array_equal(out, np.arange(8, dtype=np.float32).reshape(4, 2).sum(0))
    assert any(how == "gloo: inside one process"
               for (_, _, how) in collectives.decisions())


def test_gpu_lowering_is_unchanged_by_the_setting():
    """Programs exported for GPU keep JAX's collectives whatever the setting (our rules are
    CPU-only): the same module text with ``mpi`` and ``gloo``, none of our custom calls."""
    mesh = jax.make_mesh((4,), ("x",))

    def body(v):
        return (jax.lax.psum(v, "x"), jax.lax.all_gather(v, "x", tiled=True),
                jax.lax.psum_scatter(v, "x", tiled=True),
                jax.lax.all_to_all(v, "x", 0, 0, tiled=True),
                jax.lax.ppermute(v, "x", [(i, (i + 1) % 4) for i in range(4)]))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    arg = jax.ShapeDtypeStruct((32,), np.float32,
                               sharding=jax.NamedSharding(mesh, P("x")))
    texts = {}
    for setting in ("mpi", "gloo"):
        with config.overrides(collectives=setting):
            texts[setting] = jax.export.export(f, platforms=["cuda"])(arg).mlir_module()
    assert texts["mpi"] == texts["gloo"]
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
               "collective_permute"):
        assert op in texts["mpi"], op
    assert "@jax_cpu_mpi" not in texts["mpi"]  # custom_call @target
