"""Module pass: a CPU program with psend/precv on one device of this process runs on a
device thread, so that JAX's C++ dispatch can take it (:mod:`.fast_path`).

XLA CPU runs a single-device program in the calling thread when its HLO cost analysis
counts fewer than 1000 flops, and JAX's C++ dispatch turns an error of such a run (a precv
that timed out, an MPI failure) into a plain ``ValueError``. A program of little more than
psend/precv counts almost nothing (XLA counts a custom call as -1 flop), so it kept JAX's
Python dispatch, many times the cost of the hop itself (benchmarks/results/): the step of
a pipeline stage, one device per MPI rank, paid that on every call.

This pass gives such a program, when JAX lowers it for CPU alone, a few thousand flops that
XLA's cost model counts and that cost about a microsecond: an add of a ``float32`` vector of
zeros with itself behind an ``optimization_barrier`` (so that nothing folds it), consumed by
a side-effecting custom call of ours that does nothing (so that nothing drops it). XLA then
runs the program on a device thread, it reports errors through its outputs as
``JaxRuntimeError`` on either dispatch path, and :mod:`jax_cpu_mpi._src.dispatch.fast_path` lets
jit's C++ path take it. The program's results are unchanged.

It runs only where it can pay: the program is lowered for CPU alone, holds our psend/precv
custom calls, runs on exactly one device of each process, makes no array over 256 KiB
(see ``SMALL_ARRAY_BYTES``), JAX's asynchronous CPU dispatch is on and fast dispatch is
configured on. It is the last pass of :mod:`jax_cpu_mpi._src.passes.hook`: the GPU-parity
check and the kept-operands pass see the program before it adds anything.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np

from jax_cpu_mpi._src.compat import (
    XLA_CPU_INLINE_FLOPS,
    hlo,
    ir,
    mlir,
    single_side_collective_effect,
)
from jax_cpu_mpi._src.ffi.custom_calls import (
    HINT_TARGET,
    array_attribute,
    call_target,
    functions,
    is_p2p,
    mesh_axes,
    module_count,
    operations,
)
from jax_cpu_mpi._src.runtime import config as _config

#: The hint goes only into programs whose arrays are all this small (the size where a
#: psend switches from a staged copy to a direct send, in the MPI transport). On a device
#: thread, XLA allocates a program's buffers from that thread's malloc arena, where large
#: ones are mapped and faulted in again on every call (a large hop over MPI measured
#: slower with the hint: benchmarks/README.md), while a large message's call cost is
#: small beside its transfer anyway.
SMALL_ARRAY_BYTES = 256 * 1024

def async_cpu_dispatch() -> bool:
    """Whether JAX's asynchronous CPU dispatch is on (without it XLA runs every program
    inline, and neither the hint nor fast dispatch applies)."""
    return bool(jax.config.values.get("jax_cpu_enable_async_dispatch", False))


def _custom_calls(module: Any) -> list[Any]:
    return [op for op in operations(module.operation) if call_target(op) is not None]


def _most_devices_of_a_process(p2p_op: Any) -> int:
    """The most devices any one process has among the partitions of a psend/precv (its
    lowering's table of the process of each partition).

    Every process's, not this one's: the hint goes into every process's program or into
    none, since a program must be the same on every process (XLA's collectives between
    processes never meet otherwise: jax 0.12.1), and a process can have more devices than
    another."""
    processes = array_attribute(p2p_op, "device_process")
    return int(np.unique(processes, return_counts=True)[1].max())


def hint_elements(custom_calls: int) -> int:
    """Elements of the hint's add: XLA's threshold twice over, plus 2 for each custom call
    (XLA counts each as -1 flop; the compiled program may hold a few more than ours)."""
    return -(-(2 * XLA_CPU_INLINE_FLOPS + 2 * custom_calls) // 256) * 256


def _array_bytes(value_type: Any) -> int | None:
    """Bytes of a statically shaped tensor type; None for a dynamic one; 0 for a non-tensor."""
    if not isinstance(value_type, ir.RankedTensorType):
        return 0
    if not value_type.has_static_shape:
        return None
    element, factor = value_type.element_type, 1
    if isinstance(element, ir.ComplexType):
        element, factor = element.element_type, 2
    bits = element.width if isinstance(element, (ir.IntegerType, ir.FloatType)) else 64
    return int(np.prod(value_type.shape, dtype=np.int64)) * max(bits, 8) * factor // 8


def _largest_array_bytes(module: Any) -> float:
    """The largest array any op of the module makes or the program takes (inf if one is
    dynamic)."""
    largest = 0.0
    types = [arg.type for op in module.body.operations if op.operation.name == "func.func"
             for arg in op.regions[0].blocks[0].arguments]
    types += [result.type for op in operations(module.operation) for result in op.results]
    for value_type in types:
        size = _array_bytes(value_type)
        largest = max(largest, float("inf") if size is None else float(size))
    return largest


def _reaches(operation: Any, targets: set[Any], funcs: dict[str, Any],
             seen: set[str]) -> bool:
    """Whether ``operation`` holds one of ``targets``, in its regions or in the functions
    they call."""
    for inner in operations(operation):
        if inner in targets:
            return True
        if inner.name == "func.call":
            callee = ir.FlatSymbolRefAttr(inner.attributes["callee"]).value
            if callee not in seen and callee in funcs:
                seen.add(callee)
                if _reaches(funcs[callee], targets, funcs, seen):
                    return True
    return False


def _attribute_text(operation: Any, name: str) -> str:
    return str(operation.attributes[name]) if name in operation.attributes else ""


def _manual_over_every_axis(module: Any, manual: Any) -> bool:
    """Whether a Shardy manual computation is manual over every axis of its mesh (read
    from the attributes' text; False when they do not read as expected)."""
    shardings = _attribute_text(manual, "in_shardings") + _attribute_text(manual, "out_shardings")
    mesh_name = re.search(r"<@([\w.$-]+)", shardings)
    if mesh_name is None:
        return False
    axes = set(mesh_axes(module).get(mesh_name.group(1), {}))
    manual_axes = set(re.findall(r'"([^"]+)"', _attribute_text(manual, "manual_axes")))
    return bool(axes) and axes <= manual_axes


def _hint_block(module: Any, p2p: set[Any]) -> Any | None:
    """Where the hint goes: the body of the ``shard_map`` (Shardy's manual computation) in
    ``main`` that holds the psend/precv calls, manual over every axis, where XLA's SPMD
    partitioner asks no sharding of a side-effecting op; ``main`` itself when the program
    has one partition; else None (no hint: a partly automatic ``shard_map``, a
    GSPMD-partitioned program)."""
    funcs = functions(module)
    main = funcs.get("main")
    if main is None:
        return None
    body = main.regions[0].blocks[0]
    for op in body.operations:
        if op.operation.name == "sdy.manual_computation" and _reaches(
                op.operation, p2p, funcs, set()):
            if not _manual_over_every_axis(module, op.operation):
                return None  # auto axes left: a side-effecting op would need a sharding
            return op.operation.regions[0].blocks[0]
    single = (module_count(module, "mhlo.num_partitions") == 1
              and module_count(module, "mhlo.num_replicas") == 1)
    return body if single else None


def add_device_thread_hint(module: Any) -> bool:
    """Adds the hint (where :func:`_hint_block` says) to a lowered module whose psend/precv
    calls run on one device of each process and whose arrays are small, unless it has one;
    returns whether it did."""
    with module.context, ir.Location.unknown():
        calls = _custom_calls(module)
        p2p = [op for op in calls if is_p2p(op)]
        if not p2p or any(call_target(op) == HINT_TARGET for op in calls):
            return False
        if _most_devices_of_a_process(p2p[0]) != 1:
            return False  # two or more: XLA runs the program on device threads already
        if _largest_array_bytes(module) > SMALL_ARRAY_BYTES:
            return False  # large buffers: better allocated and filled by the calling thread
        block = _hint_block(module, set(p2p))
        if block is None:
            return False
        terminator = block.operations[len(block.operations) - 1]
        with ir.InsertionPoint(terminator):
            f32 = ir.F32Type.get()
            vector = ir.RankedTensorType.get([hint_elements(len(calls))], f32)
            zeros = hlo.constant(ir.DenseElementsAttr.get_splat(vector, ir.FloatAttr.get(f32, 0.0)))
            (opaque,) = hlo.OptimizationBarrierOp([zeros]).results
            flops = hlo.add(opaque, opaque)
            mlir.custom_call(HINT_TARGET, result_types=[], operands=[flops],
                             backend_config={}, has_side_effect=True, api_version=4)
        return True


def wanted(platforms: Any, jaxpr: Any) -> bool:
    """Programs lowered for CPU alone with psend/precv, while fast dispatch can take them."""
    return (tuple(platforms) == ("cpu",)
            and single_side_collective_effect in jaxpr.effects
            and _config.current().fast_dispatch
            and async_cpu_dispatch())
