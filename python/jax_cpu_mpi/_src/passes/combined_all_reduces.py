"""Module pass: the small all-reduces of one group, reduction and dtype that a program runs
one after another become one call over a buffer that holds them all.

JAX binds ``psum`` leaf by leaf: a gradient pytree is as many psums as it has leaves, and
XLA's all-reduce combiner merges XLA's own all-reduces afterwards. The all-reduces this
package lowers over MPI are custom calls that XLA cannot merge, so each leaf was a meeting
of the process's devices and an MPI all-reduce of its own: the fixed cost of a collective
(the meeting's waits and wake-ups, MPI's latency) paid once per leaf, on a model's many small
leaves (biases, norms' scales) most of the whole reduction's time.

The merge, as XLA's combiner does it: each operand flattened, the flat operands
concatenated, one all-reduce call over the concatenation (its result takes that buffer), and
each result sliced back out and given its shape. The reduction is elementwise, so each
element is reduced as before. Which calls merge:

* all-reduce calls of one block (a loop body, a branch, a ``shard_map`` body: each its own)
  whose attributes agree but for their descriptions (the group, the devices' processes, the
  reduction; the lowering gives each call the same ones for the same collective) and whose
  operands have one element type;
* each operand at most ``combine_bytes`` (``JAX_CPU_MPI_COMBINE_BYTES``, 64 KiB by default:
  above it the fixed cost is a small part of the call, and the concatenation and the slices
  are two more passes over its bytes; with several devices per process, merging larger
  leaves too cost more than it saved in ``benchmarks/combined_all_reduces.py``), the merged
  buffer at most :data:`MAX_COMBINED_BYTES`;
* where no result of an earlier call of the run is read before the run's last call: the
  merged call replaces the last one, so every reader of every result comes after it (a psum
  whose operand is another psum's result, or a value computed between two psums from the
  first's result, starts a new run).

The merged call runs where the last call of its run ran, which moves the earlier ones past
whatever other collectives lay between them: the same move on every device and process (the
pass sees the same program everywhere), and the ordering pass, which runs next, chains the
calls in their new order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jax_cpu_mpi._src.compat import hlo, ir
from jax_cpu_mpi._src.ffi.custom_calls import (
    attribute_dict,
    backend_config,
    call_target,
    is_a,
    row_major_layout,
)
from jax_cpu_mpi._src.lowering import collectives
from jax_cpu_mpi._src.runtime import config

#: The largest merged operand, in bytes (the largest operand that merges is the setting
#: ``combine_bytes``, ``JAX_CPU_MPI_COMBINE_BYTES``).
MAX_COMBINED_BYTES = 4 << 20
#: The backend_config entries that only describe a call (error messages, the timeline).
_DESCRIPTIONS = ("op", "operand")
_BACKEND_CONFIG = "mhlo.backend_config"


def _tensor(value: Any) -> Any:
    return ir.RankedTensorType(value.type)


def _elements(call: Any) -> int:
    """The element count of an all-reduce call's operand."""
    return int(np.prod(_tensor(call.operands[0]).shape, dtype=np.int64))


def _bitwidth(element: Any) -> int:
    for kind in (ir.IntegerType, ir.FloatType):
        if is_a(element, kind):
            return kind(element).width
    if is_a(element, ir.ComplexType):
        return 2 * _bitwidth(ir.ComplexType(element).element_type)
    raise ValueError(f"no width for {element}")


def _candidate(op: Any, limit: int) -> tuple[tuple[str, str], int] | None:
    """What a call must share with the others of its run, and its operand's bytes (None: it
    merges with none)."""
    if call_target(op) != collectives.ALL_REDUCE_TARGET or len(op.operands) != 2:
        return None
    t = _tensor(op.operands[0])
    if not t.has_static_shape:
        return None
    # XLA keeps an element of fewer bits (a bool, i1) in a byte of its own; the all-reduce
    # reduces no packed (sub-byte) dtype.
    nbytes = _elements(op) * max(_bitwidth(t.element_type), 8) // 8
    if nbytes > limit:
        return None
    config = {name: str(attr) for name, attr in backend_config(op).items()
              if name not in _DESCRIPTIONS}
    other = {name: str(attr) for name, attr in attribute_dict(op).items()
             if name not in (_BACKEND_CONFIG, "operand_layouts", "result_layouts")}
    key = str(t.element_type), repr(sorted(config.items()) + sorted(other.items()))
    return key, nbytes


def _in_block(op: Any, block: Any) -> Any | None:
    """The op of ``block`` that holds ``op`` (itself, or an op whose region does)."""
    while op is not None:
        parent = op.parent if hasattr(op, "parent") else None
        if op.operation.block == block:
            return op.operation
        op = parent
    return None


def _first_read(op: Any, block: Any, position: dict[Any, int]) -> int:
    """The position in ``block`` of the first op that reads ``op``'s result."""
    first = len(position)
    for use in op.results[0].uses:
        holder = _in_block(use.owner, block)
        if holder is not None:
            first = min(first, position[holder])
    return first


def _describe(run: list[Any], sizes: list[int]) -> dict[str, Any]:
    def text(call: Any, name: str) -> str:
        attr = backend_config(call).get(name)
        return "all_reduce" if attr is None else ir.StringAttr(attr).value

    ops = [text(c, "op") for c in run]
    operands = [text(c, "operand") for c in run]
    shown = ", ".join(operands[:4]) + (f", ... ({len(run)} in all)" if len(run) > 4 else "")
    op = ops[0] if len(set(ops)) == 1 else " / ".join(sorted(set(ops)))
    total = sum(sizes)
    dtype = operands[0].split("[")[0]
    return {"op": ir.StringAttr.get(f"{op}, {len(run)} combined"),
            "operand": ir.StringAttr.get(f"{dtype}[{total}] ({shown})")}


def _merge(run: list[Any]) -> None:
    """Replace the calls of ``run`` by one over their concatenated operands, where the last
    of them was."""
    last = run[-1]
    element = _tensor(last.operands[0]).element_type
    sizes = [_elements(c) for c in run]
    flat_type = ir.RankedTensorType.get([sum(sizes)], element)
    with ir.InsertionPoint(last), last.location:
        flats = [hlo.reshape(ir.RankedTensorType.get([n], element), c.operands[0])
                 for c, n in zip(run, sizes, strict=True)]
        joined = hlo.concatenate(flats, 0)
        layout = row_major_layout(joined)
        attributes = attribute_dict(last)
        config = backend_config(last)
        config.update(_describe(run, sizes))
        attributes[_BACKEND_CONFIG] = ir.DictAttr.get(config)
        layouts = list(ir.ArrayAttr(last.attributes["operand_layouts"]))
        attributes["operand_layouts"] = ir.ArrayAttr.get([layout, *layouts[1:]])
        attributes["result_layouts"] = ir.ArrayAttr.get([layout])
        merged = ir.Operation.create(
            "stablehlo.custom_call", results=[flat_type],
            operands=[joined, last.operands[1]], attributes=attributes)
        start = 0
        for call, n in zip(run, sizes, strict=True):
            piece = hlo.slice(merged.results[0], ir.DenseI64ArrayAttr.get([start]),
                              ir.DenseI64ArrayAttr.get([start + n]),
                              ir.DenseI64ArrayAttr.get([1]))
            call.results[0].replace_all_uses_with(
                hlo.reshape(call.results[0].type, piece))
            start += n
    for call in run:
        call.erase()


def _combine_block(block: Any, limit: int) -> int:
    """Merge the runs of ``block`` (and of the blocks nested in it) of operands up to
    ``limit`` bytes; returns the calls merged away."""
    merged = 0
    ops = [op.operation for op in block.operations]
    for op in ops:
        for region in op.regions:
            for inner in region.blocks:
                merged += _combine_block(inner, limit)
    position = {op: i for i, op in enumerate(ops)}
    first_read = {}
    runs: dict[Any, list[Any]] = {}
    sizes: dict[Any, int] = {}
    done: list[list[Any]] = []
    for op in ops:
        candidate = _candidate(op, limit)
        if candidate is None:
            continue
        key, nbytes = candidate
        first_read[op] = _first_read(op, block, position)
        run = runs.get(key, [])
        if run and (sizes[key] + nbytes > MAX_COMBINED_BYTES
                    or any(first_read[m] <= position[op] for m in run)):
            done.append(run)
            run = []
        if not run:
            sizes[key] = 0
        runs[key] = [*run, op]
        sizes[key] += nbytes
    done.extend(runs.values())
    for run in done:
        if len(run) > 1:
            _merge(run)
            merged += len(run) - 1
    return merged


def combine_all_reduces(module: Any) -> int:
    """Runs the pass on a lowered module (its calls inlined already); returns how many
    all-reduce calls it merged away."""
    limit = config.current().combine_bytes
    merged = 0
    if limit == 0:
        return merged
    with module.context, ir.Location.unknown():
        for op in module.body.operations:
            if op.operation.name == "func.func":
                for block in op.regions[0].blocks:
                    merged += _combine_block(block, limit)
    return merged
