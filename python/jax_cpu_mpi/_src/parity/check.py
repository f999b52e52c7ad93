"""GPU parity: reject at lowering the psend/precv programs that XLA GPU refuses to compile.

XLA's GPU compiler verifies every program for send/recv deadlocks (a cycle in the pairs of
one psend, a precv that no psend matches, mismatched pairs, a collective between a psend
and its precv...). The CPU transport of jax_cpu_mpi would run some of these programs and
hang on others, so a CPU CI would pass a program that fails on GPU. This module runs the
same check (:mod:`jax_cpu_mpi._src.parity.rule`) on every CPU program that contains our
psend/precv, when JAX lowers it: ``jax.jit(f).lower(...)`` (hence also the first call)
raises :class:`GpuParityError`, a :class:`jax.errors.JaxRuntimeError` like the GPU's
error, with XLA's message first. The check depends only on the program, so every process
of a multi-process job raises the same error before anything runs.

:func:`check_lowered` (``jax_cpu_mpi.check``) also runs it on demand, on a program lowered
or exported for CUDA: there JAX lowers psend/precv to ``stablehlo.send``/``recv``, which
the walk reads like our calls (same names, same order), so a program gets the same verdict
and message from its CPU lowering and from the module XLA GPU compiles.

Switch it off for CPU-only programs with ``JAX_CPU_MPI_GPU_PARITY=0`` or
``jax_cpu_mpi.configure(gpu_parity=False)`` (programs lowered afterwards are not checked).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import jax

from jax_cpu_mpi._src.compat import ir, make_ir_context, single_side_collective_effect
from jax_cpu_mpi._src.ffi.custom_calls import (
    ORDERING_OP,
    PRECV_TARGET,
    PSEND_TARGET,
    call_target,
    is_ordering,
    pairs,
    string_attribute,
)
from jax_cpu_mpi._src.parity.rule import (
    Collective,
    Event,
    P2POp,
    Violation,
    check,
    format_pairs,
)
from jax_cpu_mpi._src.parity.xla_order import ModuleOrder
from jax_cpu_mpi._src.runtime import config

__all__ = ["CPU_LOWERING", "GPU_LOWERING", "GpuParityError", "check_lowered",
           "collect_events", "module_of",
           "raise_on_violation", "wanted"]

_SUFFIX = (
    "jax_cpu_mpi raises this when the program is lowered, as XLA GPU does when it compiles "
    "it. For CPU-only programs, JAX_CPU_MPI_GPU_PARITY=0 or "
    "jax_cpu_mpi.configure(gpu_parity=False) turns the check off."
)


class GpuParityError(jax.errors.JaxRuntimeError):
    """A psend/precv program that XLA GPU would reject at compile time.

    Caught like the GPU's error (``except jax.errors.JaxRuntimeError``). ``str(error)``
    starts with XLA's message; ``xla_message`` holds it alone and ``ops`` the psends,
    precvs and collectives involved.
    """

    def __init__(self, violation: Violation) -> None:
        super().__init__(
            f"{violation.xla_message}\n\njax_cpu_mpi GPU-parity check (at lowering, before "
            f"anything runs): {violation.explanation}\n{_SUFFIX}"
        )
        self.xla_message = violation.xla_message
        self.ops = violation.ops


# Collectives that XLA's check looks at (IsOtherCollective, on instructions that call no
# computation), by StableHLO op name; all_reduce / reduce_scatter carry a reduction region
# and are descended into instead, as XLA does.
_OTHER_COLLECTIVES = {
    "stablehlo.all_gather": "all-gather",
    "stablehlo.all_to_all": "all-to-all",
    "stablehlo.collective_permute": "collective-permute",
    "stablehlo.collective_broadcast": "collective-broadcast",
}
_RAGGED_ALL_TO_ALL_TARGET = "ragged_all_to_all"
#: JAX's GPU lowering of psend/precv (a module lowered or exported for CUDA/ROCm). They are
#: named as our CPU calls are, so a program gets the same message on either platform.
_SEND_RECV = {"stablehlo.send": "psend", "stablehlo.recv": "precv"}
#: Which psend/precv a walk reads: jax_cpu_mpi's CPU custom calls, or JAX's GPU send/recv.
#: A module exported for several platforms holds both, one per branch of a
#: ``stablehlo.case`` on the platform; each platform's program is checked on its own.
CPU_LOWERING = "cpu"
GPU_LOWERING = "gpu"
_FILE_LINE = re.compile(r'"([^"]+)":(\d+):\d+')
_INTEGER = re.compile(r"^(u?)i(\d+)$")


def _hlo_type(t: Any) -> str:
    """``tensor<1x2xf32>`` -> ``f32[1,2]``; ``!stablehlo.token`` -> ``token[]``."""
    text = str(t)
    if not text.startswith("tensor<"):
        return "token[]" if "token" in text else text
    ranked = ir.RankedTensorType(t)
    element = str(ranked.element_type)
    match = _INTEGER.match(element)
    if element == "i1":
        element = "pred"
    elif match:
        element = ("u" if match.group(1) else "s") + match.group(2)
    elif element.startswith("complex<"):
        element = {"complex<f32>": "c64", "complex<f64>": "c128"}.get(element, element)
    return f"{element}[{','.join(map(str, ranked.shape))}]"


_CHANNEL_HANDLE = re.compile(r"handle\s*=\s*(\d+)")


def _channel_id(attribute: Any) -> str:
    """The handle of ``#stablehlo.channel_handle<handle = 1, type = 1>`` (the Python
    bindings of the attribute differ between jaxlib versions; its text does not)."""
    match = _CHANNEL_HANDLE.search(str(attribute))
    return match.group(1) if match else "?"


def _location(op: Any) -> str | None:
    match = _FILE_LINE.search(str(op.location))
    return f"{match.group(1)}:{match.group(2)}" if match else None


class _Walker:
    """Our custom calls (or JAX's GPU send/recv) and the other collectives, in the order
    XLA's check visits them.

    The order is XLA's instruction order (:mod:`jax_cpu_mpi._src.parity.xla_order`); the check
    descends into the computations an op calls (loop body then condition, branches in
    order, reductions) at the op's place, once per occurrence.

    Without ``details``, events carry only what the check needs (kinds, names, pairs);
    types, source lines and HLO-like texts are read only to explain an error.
    """

    def __init__(self, module: Any, details: bool, lowering: str) -> None:
        self.details = details
        self.reads_send_recv = lowering == GPU_LOWERING
        self.order = ModuleOrder(module, is_ordering)
        self.counts: dict[str, int] = {}

    def name(self, base: str) -> str:
        """XLA-style unique names: ``psend``, ``psend.1``, ``psend.2``..."""
        count = self.counts.get(base, 0)
        self.counts[base] = count + 1
        return base if count == 0 else f"{base}.{count}"

    def computation(self, block: Any) -> Iterator[Event]:
        for op in self.order.computation(block):
            name = op.operation.name
            if name == "stablehlo.custom_call" or name in _SEND_RECV:
                event = (self.custom_call(op) if name == "stablehlo.custom_call"
                         else self.send_recv(op, _SEND_RECV[name]))
                if event is not None:
                    yield event
                continue
            if name in _OTHER_COLLECTIVES:
                yield self.collective(op, _OTHER_COLLECTIVES[name])
                continue
            regions = list(op.operation.regions)
            if name == "stablehlo.while":  # XLA's while calls (body, condition)
                regions.reverse()
            for region in regions:
                yield from self.computation(region.blocks[0])

    def custom_call(self, op: Any) -> Event | None:
        target = call_target(op.operation)
        if target == _RAGGED_ALL_TO_ALL_TARGET:
            return self.collective(op, "ragged-all-to-all")
        if target not in (PSEND_TARGET, PRECV_TARGET) or self.reads_send_recv:
            return None
        kind = "psend" if target == PSEND_TARGET else "precv"
        source = string_attribute(op.operation, "op")
        if source == ORDERING_OP:  # orders a barrier's values, moves nothing
            return None
        data = op.operands[0] if kind == "psend" else op.results[0]
        return P2POp(
            kind=kind,
            name=self.name(kind),
            pairs=pairs(op.operation),
            shape=_hlo_type(data.type) if self.details else "",
            source=source,
            location=_location(op) if self.details else None,
        )

    def send_recv(self, op: Any, kind: str) -> P2POp | None:
        """A ``stablehlo.send``/``recv`` of JAX's GPU lowering, as the verifier sees it: XLA
        turns ``source_target_pairs`` into the ``_xla_send_recv_source_target_pairs`` it
        compares. One without pairs (a host transfer) is no psend/precv."""
        if not self.reads_send_recv or "source_target_pairs" not in op.attributes:
            return None
        flat = [int(v) for v in ir.DenseIntElementsAttr(op.attributes["source_target_pairs"])]
        op_pairs = tuple(zip(flat[::2], flat[1::2], strict=True))
        name = self.name(kind)
        if not self.details:
            return P2POp(kind=kind, name=name, pairs=op_pairs, shape="", source="")
        data = op.operands[0] if kind == "psend" else op.results[0]
        channel = ""
        if "channel_handle" in op.attributes:
            channel = f", channel_id={_channel_id(op.attributes['channel_handle'])}"
        source = (f"{op.operation.name}(source_target_pairs={list(op_pairs)}{channel}) "
                  f"of jax.lax.{kind} or jax_cpu_mpi.{kind}")
        return P2POp(kind=kind, name=name, pairs=op_pairs, shape=_hlo_type(data.type),
                     source=source, location=_location(op))

    def collective(self, op: Any, base: str) -> Collective:
        name = self.name(base)
        if not self.details:
            return Collective(name=name, text="")
        results = ", ".join(_hlo_type(r.type) for r in op.results)
        operands = ", ".join(_hlo_type(o.type) for o in op.operands)
        text = f"%{name} = {results} {base}({operands})"
        if "source_target_pairs" in op.attributes:
            flat = ir.DenseIntElementsAttr(op.attributes["source_target_pairs"])
            listed = [int(v) for v in flat]
            text += (", source_target_pairs="
                     + format_pairs(tuple(zip(listed[::2], listed[1::2], strict=True))))
        return Collective(name=name, text=text, location=_location(op))


def collect_events(module: Any, details: bool = True,
                   lowering: str = CPU_LOWERING) -> list[Event]:
    """The psends/precvs and other collectives of a lowered module, in checking order.

    ``lowering`` says which psends/precvs to read: ``"cpu"``, jax_cpu_mpi's custom calls;
    ``"gpu"``, the ``stablehlo.send``/``recv`` of JAX's CUDA/ROCm lowering.

    Starts at ``main``; the order is the one XLA GPU's verifier walks (see
    :mod:`jax_cpu_mpi._src.parity.xla_order`), not program order: e.g. each precv comes right after
    the psend whose token it takes.
    """
    with module.context:
        walker = _Walker(module, details, lowering)
        main = walker.order.entry_block("main")
        return [] if main is None else list(walker.computation(main))


def _violation(module: Any, lowering: str) -> Violation | None:
    if check(collect_events(module, details=False, lowering=lowering)) is None:
        return None
    # the same verdict, now with the details
    violation = check(collect_events(module, lowering=lowering))
    assert violation is not None
    return violation


def raise_on_violation(module: Any, lowering: str = CPU_LOWERING) -> None:
    """Raise :class:`GpuParityError` if XLA GPU would reject the psends/precvs of ``module``
    (read from its ``lowering``: ``"cpu"``, our calls, or ``"gpu"``, JAX's send/recv)."""
    violation = _violation(module, lowering)
    if violation is not None:
        raise GpuParityError(violation)


def wanted(platforms: Any, jaxpr: Any) -> bool:
    """The programs the check runs on when JAX lowers them: CPU programs with psend/precv
    (they carry the effect; control flow, shard_map and jit propagate it), while the check
    is configured on."""
    return ("cpu" in tuple(platforms) and single_side_collective_effect in jaxpr.effects
            and config.current().gpu_parity)


def module_of(program: Any) -> Any:
    """The StableHLO module of a ``jax.stages.Lowered`` or a ``jax.export.Exported``."""
    if isinstance(program, jax.export.Exported):
        # The exported module is serialized (portable VHLO); its text is StableHLO and
        # Shardy, which JAX's own context parses.
        return ir.Module.parse(program.mlir_module(), context=make_ir_context())
    compiler_ir = getattr(program, "compiler_ir", None)
    if compiler_ir is None:
        raise TypeError(
            "jax_cpu_mpi.check takes jax.jit(f).lower(...) (a jax.stages.Lowered) or "
            "jax.export.export(jax.jit(f), platforms=[...])(...) (a jax.export.Exported), "
            f"got {type(program).__name__}.")
    return compiler_ir("stablehlo")


def check_lowered(program: Any) -> None:
    """Run the GPU-parity check on a lowered or exported program; raise
    :class:`GpuParityError` if XLA GPU would reject it. Public as :func:`jax_cpu_mpi.check`.

    ``program`` is ``jax.jit(f).lower(...)`` or ``jax.export.export(jax.jit(f),
    platforms=[...])(...)``, lowered for any platform: on CPU the check reads jax_cpu_mpi's
    psend/precv calls, on CUDA/ROCm the ``stablehlo.send``/``recv`` of JAX's GPU lowering,
    the module XLA GPU compiles. The configuration (``gpu_parity``) does not apply: the
    check always runs. A module lowered for several platforms is checked once per
    lowering it holds (CPU first), each platform's psends/precvs on their own.
    """
    module = module_of(program)
    for lowering in (CPU_LOWERING, GPU_LOWERING):
        raise_on_violation(module, lowering)
