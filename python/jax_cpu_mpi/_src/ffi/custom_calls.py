"""Our custom calls as they appear in a lowered module: their names, the attributes the
lowering gives them (XLA passes them to the handlers as the FFI attributes, and keeps them
in ``mhlo.backend_config``), and how the module passes find and read them.

The handlers (``cpp/ffi/``) decode exactly these attributes: a name or type changed here must
change there too.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from jax_cpu_mpi._src.compat import ir, mlir

#: ``psend(x, partition_id) -> token``: sends ``x`` if this device is a source.
PSEND_TARGET = "jax_cpu_mpi_psend"
#: ``precv(token, partition_id[, kept operand]) -> out``: receives, or zeros.
PRECV_TARGET = "jax_cpu_mpi_precv"
#: Consumes the flops of the device-thread hint and does nothing (cpp/ffi/).
HINT_TARGET = "jax_cpu_mpi_device_thread_hint"
#: psend: how many precvs keep its operand alive (the last of them to run finishes its
#: send), 0 for none; precv: how many operands it keeps (its operands after the token and
#: the partition id).
OPERAND_KEPT = "operand_kept"
#: The pairs of every precv that finishes the sends of a psend (the psend's group:
#: passes/kept_operands.py), on the psend and on those precvs; empty until that pass runs.
#: A psend may defer a send while its device receives in the group; a precv takes the
#: deferred send's path when its sender receives in the group.
GROUP_PAIRS = "group_pairs"
#: The pairs of the program's precvs, as flat (source, destination) values, each as often as
#: its precvs run at most in a call (a branch counts its largest branch), and ``(source, -1
#: - destination)`` for one that may run any number of times (in a loop): an op of the
#: program that
#: fails on a device learns from them which channels into that device may still hold a
#: message that a skipped precv of that call was to take (cpp/ffi/failed_runs.h). A last
#: pair ``(-1, -1)`` says the program runs collectives of ours (JAX_CPU_MPI_COLLECTIVES=mpi):
#: a skipped one may leave its peers' part of it waiting, which a later call's would meet.
#: Set by passes/kept_operands.py.
PROGRAM_RECEIVES = "program_receives"
#: PROGRAM_RECEIVES' pair of a program that runs collectives of ours.
RUNS_COLLECTIVES = (-1, -1)
#: The pairs of the program's psends, as PROGRAM_RECEIVES lists its precvs (``(source, -1 -
#: destination)`` for one in a loop): an op of the program that fails on a device learns
#: from them which channels out of that device a skipped psend of that call leaves a precv
#: waiting on, which the next call's message would reach (cpp/ffi/failed_runs.h). Set by
#: passes/kept_operands.py.
PROGRAM_SENDS = "program_sends"
#: precv: 1 (the lowering's) where a device that is no destination writes zeros into its
#: output, 0 where it leaves the output unwritten because every user of the result reads it
#: through ``select(is_destination, result, 0)``, or because the caller never reads it there
#: (``ops.p2p.precv_unread_off_destinations``) (passes/selected_zeros.py).
ZERO_FILL = "zero_fill"
#: ``order_token(last collective's result) -> s32[]``: the ordering pass's loop token
#: (passes/ordered_collectives.py); reads no bytes, writes 0.
ORDER_TOKEN_TARGET = "jax_cpu_mpi_order_token"
#: The ``op`` attribute of the psend/precv calls that only order an optimization barrier's
#: values: no pairs, no data moved, and not a psend/precv to the GPU-parity check.
ORDERING_OP = "optimization_barrier ordering (no pairs, moves no data)"

#: A psend/precv call's integers, packed into one int64 array attribute: XLA's FFI decodes
#: every attribute of a call, by name, on each call, and a psend and a precv run for every
#: message. Its fields are read and written by name, as if they were attributes of their
#: own, through the functions below: ``num_devices`` (devices in the whole job, for MPI
#: tags), OPERAND_KEPT and ZERO_FILL (integers); ``pairs`` (flat source-target pairs),
#: ``device_index`` (partition -> dense global device index), ``device_process``
#: (partition -> ``jax.process_index()``), GROUP_PAIRS, PROGRAM_RECEIVES and PROGRAM_SENDS
#: (arrays). Layout (unpacked by cpp/ffi/p2p_handlers.cc): [num_devices, operand_kept,
#: partitions, pair values, group pair values, zero_fill, program receive values, program
#: send values], then pairs, device_index, device_process, group_pairs, program_receives,
#: program_sends.
ROUTING = "routing"
_ROUTING_INTS = ("num_devices", OPERAND_KEPT, ZERO_FILL)
_ROUTING_ARRAYS = ("pairs", "device_index", "device_process", GROUP_PAIRS, PROGRAM_RECEIVES,
                   PROGRAM_SENDS)
_ROUTING_HEADER = 8

_BACKEND_CONFIG = "mhlo.backend_config"


def attributes(*, pairs: np.ndarray, device_index: np.ndarray, device_process: np.ndarray,
               num_devices: int, op: str, operand: str) -> dict[str, Any]:
    """The FFI attributes of a psend/precv call (``operand_kept`` starts at 0: the
    kept-operands pass raises it; ``zero_fill`` at 1: that pass may clear it)."""
    return {
        "op": op,
        "operand": operand,
        ROUTING: pack_routing({
            "num_devices": num_devices, OPERAND_KEPT: 0, ZERO_FILL: 1, "pairs": pairs,
            "device_index": device_index, "device_process": device_process,
            GROUP_PAIRS: np.zeros(0, dtype=np.int64),
            PROGRAM_RECEIVES: np.zeros(0, dtype=np.int64),
            PROGRAM_SENDS: np.zeros(0, dtype=np.int64)}),
    }


def pack_routing(fields: dict[str, Any]) -> np.ndarray:
    """The ROUTING array of ``fields`` (every name of _ROUTING_INTS and _ROUTING_ARRAYS)."""
    arrays = [np.asarray(fields[name], dtype=np.int64).reshape(-1) for name in _ROUTING_ARRAYS]
    pair_values, index, process, group, receives, sends = arrays
    if index.size != process.size:
        raise ValueError(f"psend/precv routing: device_index has {index.size} partitions, "
                         f"device_process {process.size}")
    header = np.array([int(fields["num_devices"]), int(fields[OPERAND_KEPT]), index.size,
                       pair_values.size, group.size, int(fields.get(ZERO_FILL, 1)),
                       receives.size, sends.size], dtype=np.int64)
    return np.concatenate([header, *arrays])


def unpack_routing(routing: np.ndarray) -> dict[str, Any]:
    """The fields of a ROUTING array (ints, and int64 arrays of their own)."""
    num_devices, kept, partitions, pair_values, group, zero_fill, receives, sends = (
        int(v) for v in routing[:_ROUTING_HEADER])
    fields: dict[str, Any] = {"num_devices": num_devices, OPERAND_KEPT: kept,
                              ZERO_FILL: zero_fill}
    at = _ROUTING_HEADER
    for name, size in zip(_ROUTING_ARRAYS,
                          (pair_values, partitions, partitions, group, receives, sends),
                          strict=True):
        fields[name] = np.array(routing[at:at + size], dtype=np.int64)
        at += size
    return fields


def _routing_fields(entries: dict[str, Any]) -> dict[str, Any] | None:
    """The unpacked ROUTING attribute among a call's attributes, None where it has none."""
    attr = entries.get(ROUTING)
    return None if attr is None else unpack_routing(
        np.array(ir.DenseIntElementsAttr(attr), dtype=np.int64))


def operations(op: Any) -> Iterator[Any]:
    """Every operation nested in ``op``, in program order, depth first."""
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield inner.operation
                yield from operations(inner.operation)


def functions(module: Any) -> dict[str, Any]:
    """The module's functions (``func.func`` operations) by name."""
    return {ir.StringAttr(op.operation.attributes["sym_name"]).value: op.operation
            for op in module.body.operations if op.operation.name == "func.func"}


def is_private(func: Any) -> bool:
    """Whether a function is private (called from the module only, never its entry)."""
    return "sym_visibility" in func.attributes and ir.StringAttr(
        func.attributes["sym_visibility"]).value == "private"


def module_count(module: Any, name: str) -> int:
    """A count the lowering puts on the module (``mhlo.num_partitions``,
    ``mhlo.num_replicas``); 1 where it is absent."""
    attrs = module.operation.attributes
    return ir.IntegerAttr(attrs[name]).value if name in attrs else 1


def partitioned(module: Any) -> bool:
    """Whether XLA's SPMD partitioner runs on the module (more than one partition)."""
    return module_count(module, "mhlo.num_partitions") > 1


def mesh_axes(module: Any) -> dict[str, dict[str, int]]:
    """Each Shardy mesh (``sdy.mesh``) of the module: its axes and their sizes, by mesh
    name (read from the attribute's text, which this JAX's bindings print alike)."""
    meshes = {}
    for op in module.body.operations:
        if op.operation.name == "sdy.mesh":
            name = ir.StringAttr(op.operation.attributes["sym_name"]).value
            text = str(op.operation.attributes["mesh"])
            meshes[name] = {a: int(n) for a, n in re.findall(r'"([^"]+)"\s*=\s*(\d+)', text)}
    return meshes


def call_target(op: Any) -> str | None:
    """The target of a custom call, None for any other op."""
    if op.name != "stablehlo.custom_call":
        return None
    return ir.StringAttr(op.attributes["call_target_name"]).value


def is_p2p(op: Any) -> bool:
    """Whether ``op`` is one of our psend/precv calls (ordering ones included)."""
    return call_target(op) in (PSEND_TARGET, PRECV_TARGET)


def backend_config(op: Any) -> dict[str, Any]:
    """A custom call's attributes, ``{name: MLIR attribute}``."""
    attr = ir.DictAttr(op.attributes[_BACKEND_CONFIG])
    return {attr[i].name: attr[i].attr for i in range(len(attr))}


def string_attribute(op: Any, name: str) -> str:
    return ir.StringAttr(ir.DictAttr(op.attributes[_BACKEND_CONFIG])[name]).value


def int_attribute(op: Any, name: str) -> int | None:
    """An integer attribute (or ROUTING field), None where the call has none of that name."""
    entries = backend_config(op)
    if name in _ROUTING_INTS and (fields := _routing_fields(entries)) is not None:
        return int(fields[name])
    value = entries.get(name)
    return None if value is None else ir.IntegerAttr(value).value


def array_attribute(op: Any, name: str) -> np.ndarray:
    """An integer array attribute (or ROUTING field: ``pairs``, ``device_process``...) as
    int64, a copy of its own: a splat attribute (every element equal, as the pairs
    ``[(0, 0)]``) reads as an array of zero strides, which MLIR refuses when it is written
    back as an attribute."""
    entries = backend_config(op)
    if name in _ROUTING_ARRAYS and (fields := _routing_fields(entries)) is not None:
        return fields[name]
    return np.array(ir.DenseIntElementsAttr(entries[name]), dtype=np.int64)


def pairs(op: Any) -> tuple[tuple[int, int], ...]:
    """The source-target pairs of a psend/precv call."""
    return tuple(map(tuple, array_attribute(op, "pairs").reshape(-1, 2).tolist()))


def is_ordering(op: Any) -> bool:
    """One of our calls that only orders a barrier's values (absent on GPU)."""
    return is_p2p(op) and string_attribute(op, "op") == ORDERING_OP


def set_int_attribute(op: Any, name: str, value: int) -> None:
    """Set (or add) an int64 attribute of a custom call."""
    op.attributes[_BACKEND_CONFIG] = with_int_attribute(op, name, value)


def set_array_attribute(op: Any, name: str, values: np.ndarray) -> None:
    """Set (or add) an int64 array attribute (or ROUTING field) of a custom call (as
    GROUP_PAIRS)."""
    set_array_attributes(op, {name: values})


def set_array_attributes(op: Any, arrays: dict[str, np.ndarray]) -> None:
    """set_array_attribute for each name of ``arrays``, with ROUTING packed once."""
    entries = backend_config(op)
    fields = _routing_fields(entries)
    for name, values in arrays.items():
        values = np.asarray(values, dtype=np.int64).reshape(-1)
        if name in _ROUTING_ARRAYS and fields is not None:
            fields[name] = values
        else:
            entries[name] = mlir.ir_attribute(values)
    if fields is not None and any(name in _ROUTING_ARRAYS for name in arrays):
        entries[ROUTING] = mlir.ir_attribute(pack_routing(fields))
    op.attributes[_BACKEND_CONFIG] = ir.DictAttr.get(entries)


def with_int_attribute(op: Any, name: str, value: int) -> Any:
    """The call's backend_config with ``name`` (an attribute or ROUTING field) set to the
    int64 ``value``."""
    entries = backend_config(op)
    if name in _ROUTING_INTS and (fields := _routing_fields(entries)) is not None:
        fields[name] = value
        entries[ROUTING] = mlir.ir_attribute(pack_routing(fields))
    else:
        entries[name] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), value)
    return ir.DictAttr.get(entries)


def attribute_dict(op: Any) -> dict[str, Any]:
    """An op's attributes, ``{name: MLIR attribute}`` (to recreate it with some changed)."""
    return {a.name: a.attr for a in (op.attributes[i] for i in range(len(op.attributes)))}


def with_extra_operands(op: Any, extra: Sequence[tuple[Any, Any]], config: Any) -> Any:
    """Replaces the custom call ``op`` by the same call with ``extra`` more last operands,
    ``(value, layout)`` each, and ``config`` as its backend_config; the uses of its results
    go to the new call's. Returns the new call.

    The module passes add operands that only order a call at run time (XLA CPU orders
    custom calls by their buffers alone) or keep a buffer alive: an MLIR op's operand list
    cannot grow in place, and ``operand_layouts`` must list one layout per operand.
    """
    attributes = attribute_dict(op)
    attributes[_BACKEND_CONFIG] = config
    if extra:
        layouts = list(ir.ArrayAttr(op.attributes["operand_layouts"]))
        attributes["operand_layouts"] = ir.ArrayAttr.get([*layouts, *(lay for _, lay in extra)])
    new = ir.Operation.create(
        "stablehlo.custom_call", results=[r.type for r in op.results],
        operands=[*op.operands, *(value for value, _ in extra)], attributes=attributes,
        loc=op.location, ip=ir.InsertionPoint(op))
    for old, replacement in zip(op.results, new.results, strict=True):
        old.replace_all_uses_with(replacement)
    op.erase()
    return new


def is_a(attr: Any, kind: Any) -> bool:
    """Whether an MLIR attribute or type is a ``kind`` (``ir.ArrayAttr``, ``ir.FloatType``...)."""
    # Newer MLIR bindings give attributes and types their concrete class; older ones have
    # isinstance().
    test = getattr(kind, "isinstance", None)
    return isinstance(attr, kind) or (test is not None and test(attr))


def row_major_layout(value: Any) -> Any:
    """The default (row-major) layout of a tensor value, as operand_layouts spells it."""
    rank = ir.RankedTensorType(value.type).rank
    return ir.DenseIntElementsAttr.get(
        np.arange(rank - 1, -1, -1, dtype=np.int64),
        type=ir.RankedTensorType.get([rank], ir.IndexType.get()))
