"""GPU parity: programs XLA GPU rejects fail at lowering, with XLA's message; the rest run.

Scenarios live in tests/mpi_programs/parity_cases.py and run here in one process (8 CPU
devices) and, all 2-device scenarios in one job, under ``mpirun -n 2``.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import parity_cases as cases
import pytest

import jax_cpu_mpi
from conftest import make_mesh
from jax_cpu_mpi import _deadlock_check as dc
from jax_cpu_mpi import config, validation
from mpi_launcher import assert_mpi_ok, run_mpi


def gather(x: jax.Array) -> np.ndarray:
    return np.asarray(x)


@pytest.fixture
def mesh2():
    return make_mesh((2, "x"))


@pytest.mark.parametrize("name", sorted(cases.REJECTED))
def test_rejected_when_lowered_before_anything_runs(mesh2, name):
    case = cases.REJECTED[name]
    f = cases.program(mesh2, case.fn)
    x = cases.put(mesh2, cases.ROWS, cases.rows(2))
    before = jax_cpu_mpi.stats()
    with pytest.raises(case.error, match=case.message) as lowered:
        f.lower(x)
    # The first call fails the same way (it lowers first) and sends nothing.
    with pytest.raises(case.error, match=case.message) as called:
        f(x)
    assert str(called.value) == str(lowered.value)
    assert jax_cpu_mpi.stats() == before
    if case.error is not ValueError:
        error = lowered.value
        assert isinstance(error, validation.GpuParityError)
        assert str(error).startswith(error.xla_message)
        assert re.match(case.message, error.xla_message)


def test_message_names_the_op_its_pairs_its_line_and_the_switch(mesh2):
    f = cases.program(mesh2, cases.REJECTED["cycle"].fn)
    with pytest.raises(validation.GpuParityError) as info:
        f.lower(cases.put(mesh2, cases.ROWS, cases.rows(2)))
    text = str(info.value)
    assert text.startswith(
        f"{cases.CYCLE}, but found %psend = token[] psend(f32[1,2]), "
        "source_target_pairs={{0,1},{1,0}}")
    assert "the cycle 0 -> 1 -> 0" in text
    assert "psend(axis_name=('x',), perm=[(0, 1), (1, 0)]) at " in text
    assert "parity_cases.py:" in text
    assert "JAX_CPU_MPI_GPU_PARITY=0" in text and "gpu_parity=False" in text
    assert [op.name for op in info.value.ops] == ["psend"]


def test_mismatch_lists_unmatched_send_then_recv(mesh2):
    f = cases.program(mesh2, cases.REJECTED["mismatched"].fn)
    with pytest.raises(validation.GpuParityError) as info:
        f.lower(cases.put(mesh2, cases.ROWS, cases.rows(2)))
    assert info.value.xla_message == (
        "Deadlock detected. Last checked instructions: "
        "%psend = token[] psend(f32[1,2]), source_target_pairs={{0,1}},"
        "%precv = f32[1,2] precv(token[]), source_target_pairs={{1,0}},")


def test_switch_off_runs_a_cycle_in_one_op_like_ppermute(mesh2):
    perm = [(0, 1), (1, 0)]
    x = cases.put(mesh2, cases.ROWS, cases.rows(2))
    with config.overrides(gpu_parity=False):
        got = gather(cases.program(mesh2, cases.REJECTED["cycle"].fn)(x))
    want = gather(cases.program(mesh2, lambda a: cases.ppermute(a, perm))(x))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, cases.rows(2)[::-1])
    # Back on: the same program is rejected again.
    with pytest.raises(validation.GpuParityError, match=re.escape(cases.CYCLE)):
        cases.program(mesh2, cases.REJECTED["cycle"].fn).lower(x)


def test_switch_from_the_environment(monkeypatch):
    monkeypatch.setenv("JAX_CPU_MPI_GPU_PARITY", "0")
    assert config.from_environment().gpu_parity is False
    monkeypatch.setenv("JAX_CPU_MPI_GPU_PARITY", "1")
    assert config.from_environment().gpu_parity is True
    monkeypatch.delenv("JAX_CPU_MPI_GPU_PARITY")
    assert config.from_environment().gpu_parity is True


def test_two_device_send_compute_send_back(mesh2):
    got, want, expected = cases.accepted_chain_then_back_edge(mesh2, gather)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_eight_device_chain_then_back_edge():
    got, want, expected = cases.accepted_chain_then_back_edge(make_mesh((8, "x")), gather,
                                                              width=8)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_precv_before_psend_returns_zeros(mesh2):
    got, want = cases.accepted_precv_before_psend(mesh2, gather)
    np.testing.assert_array_equal(got, want)


def test_pipeline_of_the_gpu_performance_tips():
    (out, fwd), (want_out, want_fwd) = cases.accepted_pipeline(make_mesh((4, "x")), gather)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fwd, want_fwd, rtol=1e-5, atol=1e-6)
    assert np.abs(want_out[1:]).min(axis=(1, 2, 3)).max() > 0  # stages 1.. got real data


def test_programs_without_psend_precv_are_not_walked(mesh2, monkeypatch):
    walked = []  # (an exception raised in the check would be caught: it never breaks jit)
    monkeypatch.setattr(validation, "collect_events", lambda *a, **k: walked.append(a) or [])
    f = cases.program(mesh2, lambda a: cases.ppermute(a, [(0, 1), (1, 0)]))
    f.lower(cases.put(mesh2, cases.ROWS, cases.rows(2)))
    assert walked == [], "walked a program without psend/precv"
    g = cases.program(mesh2, lambda a: cases.p2p(a, [(0, 1)]))
    g.lower(cases.put(mesh2, cases.ROWS, cases.rows(2)))
    assert len(walked) == 1  # the spy does see a program with psend/precv


def test_install_is_idempotent():
    wrapped = validation.mlir.lower_jaxpr_to_module
    validation.install()
    assert validation.mlir.lower_jaxpr_to_module is wrapped
    assert wrapped._jax_cpu_mpi_checked


# ------------------------------------------------ the XLA rules, on abstract programs


def _op(kind: str, name: str, *pairs: tuple[int, int]) -> dc.P2POp:
    return dc.P2POp(kind=kind, name=name, pairs=tuple(pairs), shape="f32[2]", source=kind)


def test_cycle_detection_follows_xla():
    assert dc.find_cycle(((0, 1), (1, 0))) == [0, 1, 0]
    assert dc.find_cycle(((3, 3),)) == [3, 3]
    assert dc.find_cycle(tuple((i, i + 1) for i in range(7))) is None
    assert dc.find_cycle(((7, 0),)) is None
    assert dc.find_cycle(((0, 2), (2, 1), (1, 0))) == [0, 2, 1, 0]
    assert dc.find_duplicate(((0, 1), (0, 2))) == "source 0"
    assert dc.find_duplicate(((0, 1), (2, 1))) == "target 1"


def test_state_machine_follows_xla():
    chain = ((0, 1), (1, 2))
    # matched pairs, in either order, and a collective between two matched pairs
    assert dc.check([_op("psend", "s", *chain), _op("precv", "r", *chain)]) is None
    assert dc.check([_op("precv", "r", *chain), _op("psend", "s", *chain)]) is None
    between = dc.Collective("collective-permute", "%collective-permute = f32[2] x")
    assert dc.check([_op("psend", "s", (0, 1)), _op("precv", "r", (0, 1)), between,
                     _op("psend", "s.1", (1, 0)), _op("precv", "r.1", (1, 0))]) is None
    # pairs match only as identical sequences: same pairs in another order do not
    v = dc.check([_op("psend", "s", (0, 1), (1, 2)), _op("precv", "r", (1, 2), (0, 1))])
    assert v is not None and v.xla_message.startswith("Deadlock detected.")
    # two recvs in a row are fine without a cycle, and fail with one
    assert dc.check([_op("precv", "r", (0, 1)), _op("precv", "r.1", (1, 2)),
                     _op("psend", "s", (1, 2)), _op("psend", "s.1", (0, 1))]) is None
    v = dc.check([_op("precv", "r", (0, 1)), _op("precv", "r.1", (1, 0))])
    assert v is not None and v.xla_message.startswith("Expected send, but found %r.1 = ")
    # a repeated target across two sends in a row
    v = dc.check([_op("psend", "s", (0, 1)), _op("psend", "s.1", (2, 1))])
    assert v is not None and v.xla_message.startswith("Expected recv, but found %s.1 = ")
    assert "target 1 appearing twice" in v.explanation
    # the end check pairs leftover sends and recvs by identical pairs
    v = dc.check([_op("psend", "s", (0, 1)), _op("precv", "r", (2, 3)),
                  _op("psend", "s.1", (2, 3))])
    assert v is not None and v.xla_message == (
        "Deadlock detected. Last checked instructions: "
        "%s = token[] psend(f32[2]), source_target_pairs={{0,1}},")


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_every_two_device_scenario_under_mpirun():
    run = run_mpi("gpu_parity.py", nprocs=2, devices_per_process=1, timeout=200)
    assert_mpi_ok(run, 2)
    for rank, lines in run.by_rank().items():
        if rank >= 0:
            rejected = [line for line in lines if "rejected at lowering:" in line]
            assert len(rejected) == len(cases.REJECTED), run.report()


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int8, np.uint16, np.bool_,
                                   np.complex64])
def test_barrier_over_a_token_orders_and_keeps_the_bits_of_every_array(mesh2, dtype):
    if np.dtype(dtype).kind in "fcV":
        values = np.array([[-0.0, np.nan], [np.inf, -3.5]])
    else:
        values = np.array([[1, 0], [0, 1]]) if dtype == np.bool_ else np.array([[-1, 2], [3, 7]])
    values = np.asarray(values.astype(dtype))
    x = cases.put(mesh2, cases.ROWS, values)

    def f(a):
        token = jax.lax.psend(a, "x", [(0, 1)])
        a2, _ = jax.lax.optimization_barrier((a, token))  # a2 after the psend
        _, token2 = jax.lax.optimization_barrier((a2, jax.lax.create_token()))  # after a2
        got = jax.lax.precv(token2, cases.like(a), "x", [(0, 1)])
        return jnp.concatenate([a2, got], axis=1)

    out = np.asarray(cases.program(mesh2, f, check_vma=False)(x))
    assert out[:, :2].tobytes() == values.tobytes()
    assert out[1, 2:].tobytes() == values[0].tobytes()  # device 1 received row 0
    assert out[0, 2:].tobytes() == np.zeros(2, dtype).tobytes()
