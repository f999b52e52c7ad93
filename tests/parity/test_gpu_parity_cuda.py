"""``jax_cpu_mpi.check`` on programs lowered or exported for CUDA (no GPU needed).

On CUDA, JAX lowers psend/precv to ``stablehlo.send``/``recv``: the module XLA GPU
compiles and verifies. Every program of the parity corpus (tests/mpi_programs/
parity_cases.py) must get, from its CUDA export, the verdict and XLA message that the CPU
check gives its CPU lowering, the ops visited in the same order.
"""

from __future__ import annotations

import re
from unittest import mock

import jax
import parity_cases as cases
import pytest

import jax_cpu_mpi
from conftest import make_mesh
from jax_cpu_mpi import config
from jax_cpu_mpi._src import compat as _compat
from jax_cpu_mpi._src.parity import check as validation

#: Corpus programs that hold an optimization_barrier over psend tokens.
BARRIERS_OVER_TOKENS = frozenset({"collective_between", "two_sends_joined_by_a_barrier",
                                  "pipeline_of_the_gpu_performance_tips"})


@pytest.fixture(scope="module")
def corpus():
    return {p.name: p for p in cases.corpus(make_mesh((2, "x")))}


def export_for_cuda(program: cases.Program) -> jax.export.Exported:
    return jax.export.export(program.jitted, platforms=["cuda"])(*program.args)


def cpu_verdict(program: cases.Program) -> tuple[list, validation.GpuParityError | None]:
    """The events and error of the CPU check, on the program lowered for CPU: the events as
    the check visits them in the program JAX lowered (the kept-operands pass, which runs
    after the check on CPU, gives a step's precvs the results of all its psends, which
    changes the visiting order of the post-pass module); the verdict the same either way."""
    errors = []
    for kept_operands in (False, True):
        with config.overrides(gpu_parity=False), \
                mock.patch.object(_compat.KEPT_OPERANDS, "installed", kept_operands):
            lowered = program.jitted.lower(*program.args)
        if not kept_operands:
            events = validation.collect_events(lowered.compiler_ir("stablehlo"))
        try:
            jax_cpu_mpi.check(lowered)
            errors.append(None)
        except jax_cpu_mpi.GpuParityError as error:
            errors.append(error)
    assert [str(e) for e in errors[1:]] == [str(errors[0])], program.name
    return events, errors[0]


def gpu_events(exported: jax.export.Exported) -> list:
    return validation.collect_events(validation.module_of(exported),
                                     lowering=validation.GPU_LOWERING)


def visited(events: list) -> list[tuple]:
    return [(e.name, getattr(e, "pairs", None)) for e in events]


def test_every_corpus_program_exported_for_cuda_gets_the_cpu_verdict(corpus):
    names = sorted(corpus)
    assert len(names) > 10 and any(corpus[n].rejected is None for n in names)
    compared = []
    for name in names:
        program = corpus[name]
        if name == "duplicate_pairs":  # JAX's own ValueError, on either platform
            with pytest.raises(ValueError, match=program.rejected):
                export_for_cuda(program)
            continue
        try:
            exported = export_for_cuda(program)
        except AttributeError as error:
            # JAX's own optimization_barrier lowering fails over tokens (JAX 0.10; ours
            # fixes it on CPU only): no CUDA module to check, XLA GPU never sees one.
            assert name in BARRIERS_OVER_TOKENS and "AbstractToken" in str(error), name
            continue
        compared.append(name)
        text = exported.mlir_module()
        assert "stablehlo.send" in text or "stablehlo.recv" in text, name
        # none of our CPU calls: JAX's GPU lowering
        assert validation.PSEND_TARGET not in text, name
        assert validation.PRECV_TARGET not in text, name
        events, cpu_error = cpu_verdict(program)
        cuda_events = gpu_events(exported)
        assert visited(cuda_events) == visited(events), name
        if program.rejected is None:
            assert cpu_error is None, name
            jax_cpu_mpi.check(exported)  # accepted, as on CPU
            continue
        assert cpu_error is not None, name
        with pytest.raises(jax_cpu_mpi.GpuParityError) as info:
            jax_cpu_mpi.check(exported)
        assert info.value.xla_message == cpu_error.xla_message, name
        assert re.match(program.rejected, info.value.xla_message), name
        assert [op.name for op in info.value.ops] == [op.name for op in cpu_error.ops], name
    assert len(compared) >= len(names) - 1 - len(BARRIERS_OVER_TOKENS), compared


def test_a_program_lowered_for_cuda_is_checked_like_its_export(corpus):
    program = corpus["cycle"]
    traced = program.jitted.trace(*program.args)
    lowered = traced.lower(lowering_platforms=("cuda",))
    assert '"stablehlo.send"' in lowered.as_text()
    with pytest.raises(jax_cpu_mpi.GpuParityError) as from_lowered:
        jax_cpu_mpi.check(lowered)
    with pytest.raises(jax_cpu_mpi.GpuParityError) as from_export:
        jax_cpu_mpi.check(export_for_cuda(program))
    assert str(from_lowered.value) == str(from_export.value)
    text = str(from_lowered.value)
    assert text.startswith(
        f"{cases.CYCLE}, but found %psend = token[] psend(f32[1,2]), "
        "source_target_pairs={{0,1},{1,0}}")
    # The op is named as the CUDA module holds it, with its pairs and line.
    assert "stablehlo.send(source_target_pairs=[(0, 1), (1, 0)], channel_id=" in text
    assert "parity_cases.py:" in text


def test_a_valid_cuda_export_passes_and_its_module_is_walked(corpus):
    program = corpus["chain_then_back_edge"]
    exported = export_for_cuda(program)
    assert isinstance(exported, jax.export.Exported)
    jax_cpu_mpi.check(exported)
    kinds = [e.name for e in gpu_events(exported)]
    assert kinds == ["psend", "precv", "psend.1", "precv.1"]


def test_a_module_for_cpu_and_cuda_is_checked_once_per_platform(corpus):
    # Both lowerings sit in one module (a stablehlo.case on the platform): each is checked
    # on its own, by the lowering hook (CPU) and by jax_cpu_mpi.check (CPU, then CUDA).
    def lower_for_both(program: cases.Program):
        traced = program.jitted.trace(*program.args)
        return traced.lower(lowering_platforms=("cpu", "cuda"))

    both = lower_for_both(corpus["opposite_order"])  # the hook accepts it
    assert validation.PSEND_TARGET in both.as_text()
    assert '"stablehlo.send"' in both.as_text()
    jax_cpu_mpi.check(both)
    with config.overrides(gpu_parity=False):
        both = lower_for_both(corpus["cycle"])
    with pytest.raises(jax_cpu_mpi.GpuParityError, match=re.escape(cases.CYCLE)) as info:
        jax_cpu_mpi.check(both)
    assert "psend(axis_name=('x',)" in str(info.value)  # the CPU lowering's, checked first
    module = both.compiler_ir("stablehlo")
    with pytest.raises(jax_cpu_mpi.GpuParityError, match=r"stablehlo\.send\(source_target"):
        validation.raise_on_violation(module, validation.GPU_LOWERING)


def test_check_names_what_it_takes():
    with pytest.raises(TypeError, match=r"jax\.stages\.Lowered.*jax\.export\.Exported.*str"):
        jax_cpu_mpi.check("module text")
