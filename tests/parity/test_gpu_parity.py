"""GPU parity: programs XLA GPU rejects fail at lowering, with XLA's message; the rest run.

Scenarios live in tests/mpi_programs/parity_cases.py and run here in one process (8 CPU
devices) and, all 2-device scenarios in one job, under ``mpirun -n 2``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import parity_cases as cases
import pytest

import jax_cpu_mpi
from conftest import make_mesh
from jax_cpu_mpi import config
from jax_cpu_mpi._src import compat as _compat
from jax_cpu_mpi._src.parity import check as validation
from jax_cpu_mpi._src.parity import rule as dc
from mpi_launcher import assert_mpi_ok, llvm_unoptimized, run_mpi


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


# ------------------------------------------- the order XLA's verifier walks (issue 12)

#: 32 MiB of float32 per device and direction.
BIG_WIDTH = 8 * 1024 * 1024


def xla_order(mesh, fn, *args) -> list[str]:
    """Names of the psends/precvs/collectives in the order the check visits them: in the
    program as JAX lowered it, which the check sees (the kept-operands pass, which runs after
    it on CPU, gives each precv of a step the u32 results of the step's psends)."""
    with config.overrides(gpu_parity=False), \
            mock.patch.object(_compat.KEPT_OPERANDS, "installed", False):
        module = cases.program(mesh, fn).lower(*args).compiler_ir("stablehlo")
    return [event.name for event in validation.collect_events(module)]


def test_two_psends_then_two_precvs_lower_with_the_check_on_and_move_32_mib_each_way(mesh2):
    # The program: psend, psend, precv, precv in JAX's order. XLA GPU's verifier
    # sees psend, precv, psend, precv (each precv right after the psend of its token)
    # and compiles it, so the check must accept it too.
    assert config.current().gpu_parity
    got, expected = cases.accepted_two_sends_then_two_precvs(mesh2, gather, BIG_WIDTH)
    assert got.shape == (2, 2 * BIG_WIDTH) and got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)
    assert expected[1, :BIG_WIDTH].min() > 0 and expected[0, BIG_WIDTH:].min() > 0


def test_the_same_sends_joined_by_one_barrier_are_rejected_when_lowered(mesh2):
    # optimization_barrier((t1, t2)) makes both precvs depend on both psends: XLA visits
    # the barrier's operands first and sees send, send, recv, recv.
    x = cases.put(mesh2, cases.ROWS, cases.rows(2))
    f = cases.program(mesh2, cases.REJECTED["two_sends_joined_by_a_barrier"].fn)
    with pytest.raises(validation.GpuParityError) as info:
        f.lower(x)
    assert info.value.xla_message == (
        "Expected recv, but found %psend.1 = token[] psend(f32[1,2]), "
        "source_target_pairs={{1,0}}")
    assert "the cycle" in str(info.value)
    assert [op.name for op in info.value.ops] == ["psend", "psend.1"]


def test_psend_a_psend_b_precv_b_precv_a_is_accepted_as_xla_orders_it(mesh2):
    # In program order this is two psends in a row whose pairs form the cycle 0 -> 1 -> 0
    # ("Expected recv, but found ..."). XLA's SPMD partitioner rebuilds the computation
    # depth-first from its root, so each precv directly follows the psend whose token it
    # takes: B, B, A, A (the result concatenates rB first). Nothing can come between a
    # psend and a precv that takes its token directly, so XLA GPU compiles it.
    x = cases.put(mesh2, cases.ROWS, cases.rows(2))
    fn, _ = cases.REORDERED["opposite_order"]
    assert xla_order(mesh2, fn, x) == ["psend", "precv", "psend.1", "precv.1"]
    got, want = cases.accepted_opposite_order(mesh2, gather)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[0, :2], cases.rows(2)[1] * 10)  # B: 1 -> 0
    np.testing.assert_array_equal(got[1, 2:], cases.rows(2)[0])  # A: 0 -> 1


def test_ppermute_between_psend_and_precv_in_program_order_only_is_accepted(mesh2):
    got, want = cases.accepted_ppermute_between_in_program_order(mesh2, gather)
    np.testing.assert_array_equal(got, want)
    fn, _ = cases.REORDERED["ppermute_between_in_program_order"]
    x = cases.put(mesh2, cases.ROWS, cases.rows(2))
    assert xla_order(mesh2, fn, x) == ["psend", "precv", "collective-permute"]


@pytest.mark.parametrize("name", sorted(cases.REORDERED))
def test_reordered_programs_are_visited_in_xla_order(mesh2, name):
    fn, kinds = cases.REORDERED[name]
    x = cases.put(mesh2, cases.ROWS, cases.rows(2))
    names = xla_order(mesh2, fn, x)
    assert [n.split(".")[0] for n in names] == list(kinds)
    cases.program(mesh2, fn).lower(x)  # accepted with the check on


def test_a_psend_whose_token_is_dropped_is_visited_before_the_rest(mesh2):
    # XLA's Accept visits unreachable roots (instructions nothing uses) before the root.
    x = cases.put(mesh2, cases.ROWS, cases.rows(2))
    fn = cases.REJECTED["dropped_token_psend_is_visited_first"].fn
    with config.overrides(gpu_parity=False):
        module = cases.program(mesh2, fn).lower(x).compiler_ir("stablehlo")
    events = validation.collect_events(module)
    assert [(e.name, e.pairs) for e in events] == [
        ("psend", ((1, 0),)), ("psend.1", ((0, 1),)), ("precv", ((0, 1),)),
        ("precv.1", ((1, 0),))]


def test_loop_body_then_condition_and_calls_inlined_at_their_use(mesh2):
    def fn(a):
        def body(carry):
            i, v = carry
            # a jitted callee: XLA inlines it where its result is used
            got = jax.jit(lambda u: cases.p2p(u, [(0, 1)]))(v)
            return i + 1, jax.lax.pcast(got, "x", to="varying")

        def cond(carry):
            return carry[0] < 1

        _, v = jax.lax.while_loop(cond, body, (0, a))
        return cases.p2p(v, [(1, 0)])

    x = cases.put(mesh2, cases.ROWS, cases.rows(2))
    assert xla_order(mesh2, fn, x) == ["psend", "precv", "psend.1", "precv.1"]
    got = gather(cases.program(mesh2, fn)(x))
    want = np.zeros((2, 2), np.float32)
    want[0] = cases.rows(2)[0]  # row 0 went 0 -> 1 in the loop, then 1 -> 0 after it
    np.testing.assert_array_equal(got, want)


def test_docs_pipeline_is_visited_in_program_order(mesh2):
    # The docs' manually pipelined loop is visited as before: priming precv, the scan
    # body (psend at the top, the ppermute the barrier puts after it, precv at the
    # bottom), the final psend; its verdict (accepted) is unchanged.
    with config.overrides(gpu_parity=False):
        lowered = cases.pipeline_program(mesh2, manual=True).lower(
            *cases.pipeline_inputs(mesh2))
    names = [e.name for e in validation.collect_events(lowered.compiler_ir("stablehlo"))]
    assert names == ["precv", "psend", "collective-permute", "precv.1", "psend.1"]


def test_programs_without_psend_precv_are_not_walked(mesh2, monkeypatch):
    walked = []  # (an exception raised in the check would be caught: it never breaks jit)
    monkeypatch.setattr(validation, "collect_events", lambda *a, **k: walked.append(a) or [])
    f = cases.program(mesh2, lambda a: cases.ppermute(a, [(0, 1), (1, 0)]))
    f.lower(cases.put(mesh2, cases.ROWS, cases.rows(2)))
    assert walked == [], "walked a program without psend/precv"
    g = cases.program(mesh2, lambda a: cases.p2p(a, [(0, 1)]))
    g.lower(cases.put(mesh2, cases.ROWS, cases.rows(2)))
    assert len(walked) == 1  # the spy does see a program with psend/precv


def test_lowering_hook_is_installed_once_and_runs_the_check_first():
    from jax_cpu_mpi._src import compat
    from jax_cpu_mpi._src.passes import hook

    wrapped = compat.mlir.lower_jaxpr_to_module
    hook.install()
    assert compat.mlir.lower_jaxpr_to_module is wrapped
    assert wrapped._jax_cpu_mpi_passes
    assert [p.feature.name for p in hook.PASSES] == [
        "gpu_parity", "kept_operands", "collectives", "fast_dispatch"]


def test_public_check_runs_on_a_lowered_program(mesh2):
    import jax_cpu_mpi

    ok = cases.program(mesh2, lambda a: cases.p2p(a, [(0, 1)]))
    jax_cpu_mpi.check(ok.lower(cases.put(mesh2, cases.ROWS, cases.rows(2))))  # no error
    cyclic = cases.program(mesh2, lambda a: cases.p2p(a, [(0, 1), (1, 0)]))
    with jax_cpu_mpi.config.overrides(gpu_parity=False):  # lowers unchecked...
        lowered = cyclic.lower(cases.put(mesh2, cases.ROWS, cases.rows(2)))
    with pytest.raises(jax_cpu_mpi.GpuParityError, match=re.escape(cases.CYCLE)):
        jax_cpu_mpi.check(lowered)  # ...and the explicit check still finds the cycle


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
    # Compiling is most of the launch; what it checks (which programs the check rejects at
    # lowering, and values equal to those sent) does not depend on LLVM's optimizations.
    run = run_mpi("gpu_parity.py", nprocs=2, devices_per_process=1, timeout=200,
                  env=llvm_unoptimized())
    assert_mpi_ok(run, 2)
    for rank, lines in run.by_rank().items():
        if rank >= 0:
            rejected = [line for line in lines if "rejected at lowering:" in line]
            assert len(rejected) == len(cases.REJECTED), run.report()
            assert any("32 MiB each way, values right" in line for line in lines), (
                run.report())


def test_gpu_check_script_lists_every_program_with_our_verdict():
    # scripts/gpu_parity_check.py needs 2 GPUs for XLA's verdicts; here it must still
    # build the whole corpus, give our verdict for each program (the one the corpus
    # expects) and say why XLA's are missing.
    script = Path(__file__).parents[2] / "scripts" / "gpu_parity_check.py"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "needs at least 2 GPUs, found 0" in done.stderr
    rows = [line.split(" | ") for line in done.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| program")]
    accepted = {p.name: p.rejected is None for p in cases.corpus(make_mesh((2, "x")))}
    assert [row[0][2:] for row in rows] == list(accepted)
    for name, xla, ours, agree in rows:
        assert xla.startswith("not run") and agree == "- |", (name, xla, agree)
        assert ours.startswith("accepted" if accepted[name[2:]] else "rejected: "), name


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
        token = jax_cpu_mpi.psend(a, "x", [(0, 1)])
        a2, _ = jax.lax.optimization_barrier((a, token))  # a2 after the psend
        _, token2 = jax.lax.optimization_barrier((a2, jax.lax.create_token()))  # after a2
        got = jax_cpu_mpi.precv(token2, cases.like(a), "x", [(0, 1)])
        return jnp.concatenate([a2, got], axis=1)

    out = np.asarray(cases.program(mesh2, f, check_vma=False)(x))
    assert out[:, :2].tobytes() == values.tobytes()
    assert out[1, 2:].tobytes() == values[0].tobytes()  # device 1 received row 0
    assert out[0, 2:].tobytes() == np.zeros(2, dtype).tobytes()
