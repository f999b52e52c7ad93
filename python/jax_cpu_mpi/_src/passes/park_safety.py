"""Whether a program's devices may park in its collectives' meetings (``park`` attribute).

With several devices per process, a device that does not lead its process's meeting in one
of our collectives may park there: its call returns a pending future, and its program
resumes later, often on the thread of another device of the same meeting, nested inside
that device's own call (``cpp/ffi/collective_handlers.cc``, Resumer). Once resumed, XLA runs
every ready step of the parked program on that thread, not only the path to its next
collective. If any of those steps waits for another device, it may wait for the very device
suspended under it on that thread, which cannot move until it returns: a deadlock, in a
correct program (2 ranks x 2 devices, a psum, then a ppermute within each process, then a
psum: the ppermute's precv waited for the psend of the device under it).

So a program parks only where every step that can wait for another device is one of our
collectives, which park in turn instead of waiting when resumed that way. Decided here, at
lowering, for the whole program (the pass sees all of it); every other program's devices
wait in their meetings as before. Not parkable:

* our psend/precv (and the device-thread hint that comes with them), XLA's own collectives
  and point-to-point ops (``all_reduce``, ``collective_permute``, ``send``/``recv``...),
  ``infeed``/``outfeed``;
* any custom call that is not one of ours or a known local computation (LAPACK, DUCC FFT):
  host callbacks (``pure_callback``, ``io_callback``, ``jax.debug.print``) run Python code
  that may wait on another device's callback, or on a lock the suspended thread holds;
* in a program that XLA partitions (``shard_map`` inside ``jit``), anything outside the
  manual computations but constants and what they pass through unchanged: there XLA's
  partitioner inserts collectives of its own wherever shardings change (a ``sum`` of a
  sharded ``shard_map`` result, an operand sharded otherwise than the ``shard_map`` wants,
  a ``shard_map`` manual over only some of the mesh's axes).

The rule errs toward waiting: a program it refuses only loses the parked path's speed.
"""

from __future__ import annotations

import re
from typing import Any

from jax_cpu_mpi._src.compat import ir, sdy
from jax_cpu_mpi._src.ffi.custom_calls import (
    ORDER_TOKEN_TARGET,
    call_target,
    functions,
    is_private,
    mesh_axes,
    operations,
    partitioned,
)
from jax_cpu_mpi._src.lowering import collectives
from jax_cpu_mpi._src.ops.marks import MARK_TARGET
from jax_cpu_mpi._src.ops.uninitialized import UNINITIALIZED_TARGET

#: Custom calls that never wait for another device: our collectives (which park instead
#: when resumed inside another device's call), their chain's end and the order tokens of
#: its loops and conditionals, the timeline's marks, the uninitialized buffers.
_LOCAL_TARGETS = frozenset({*collectives.TARGETS, collectives.END_TARGET, ORDER_TOKEN_TARGET,
                            MARK_TARGET, UNINITIALIZED_TARGET})
#: Local computations JAX lowers to custom calls on CPU (linear algebra, FFT).
_LOCAL_PREFIXES = ("lapack_", "ducc_")
#: Ops of XLA's (stablehlo, mhlo) that wait for other devices or for the host.
_WAITING_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                "ragged_all_to_all", "collective_permute", "collective_broadcast", "send",
                "recv", "infeed", "outfeed")
#: Outside a manual computation of a partitioned program, the ops that XLA's partitioner
#: turns into no communication of their own (a sharding constraint: where it keeps the
#: sharding its operand has already; jax 0.12 puts one on each shard_map result).
_TOP_LEVEL_OPS = ("sdy.manual_computation", "sdy.sharding_constraint", "stablehlo.constant",
                  "func.return")


def _waits(op: Any) -> bool:
    """Whether ``op`` itself (not what it nests) may wait for another device or the host."""
    target = call_target(op)
    if target is not None:
        return target not in _LOCAL_TARGETS and not target.startswith(_LOCAL_PREFIXES)
    dialect, _, name = op.name.partition(".")
    if dialect in ("stablehlo", "mhlo"):
        return name in _WAITING_OPS
    # Shardy's own ops other than these are reshardings (collectives once partitioned); a
    # sharding constraint is one only where it changes a sharding (_top_level_is_local).
    return dialect == "sdy" and name not in ("manual_computation", "return", "mesh",
                                             "sharding_constraint")


def _shardings(op: Any, name: str) -> list[str]:
    # As text: only compared for equality (a sharding that differs in any way, even only in
    # how it is spelled, counts as a resharding: the rule errs toward waiting).
    return [str(sdy.TensorShardingAttr(s))
            for s in sdy.TensorShardingPerValueAttr(op.attributes[name]).shardings]


def _value_sharding(attrs: Any, i: int) -> str | None:
    """The ``sdy.sharding`` of a function's ``i``-th argument or result, None without one."""
    if attrs is None:
        return None
    entry = ir.DictAttr(ir.ArrayAttr(attrs)[i])
    return str(entry["sdy.sharding"]) if "sdy.sharding" in entry else None


def _manual_over_whole_mesh(op: Any, meshes: dict[str, dict[str, int]]) -> bool:
    """Whether a manual computation is manual over every axis of its mesh larger than 1
    (otherwise XLA partitions its body over the others, with collectives of its own)."""
    manual = set(re.findall(r'"([^"]+)"', str(op.attributes["manual_axes"])))
    refs = re.findall(r"@([\w.$-]+)", str(op.attributes["in_shardings"]) +
                      str(op.attributes["out_shardings"]))
    if not refs or any(r not in meshes for r in refs):
        return False  # an inline mesh, or none: not worth reading
    return all(a in manual or s == 1 for r in refs for a, s in meshes[r].items())


def _top_level_is_local(func: Any, meshes: dict[str, dict[str, int]]) -> bool:
    """In a partitioned program, whether XLA's partitioner adds no collective of its own to
    ``func``: outside its manual computations only constants, and each value keeps one
    sharding from where it is made to every place it goes."""
    block = func.regions[0].blocks[0]
    attrs = func.attributes
    arg_attrs = attrs["arg_attrs"] if "arg_attrs" in attrs else None
    res_attrs = attrs["res_attrs"] if "res_attrs" in attrs else None
    # Every sharding each top-level value is given or wanted in (as text).
    wanted: dict[Any, set[str]] = {}

    def want(value: Any, sharding: str | None) -> None:
        if sharding is not None:
            wanted.setdefault(value, set()).add(sharding)

    for i, argument in enumerate(block.arguments):
        want(argument, _value_sharding(arg_attrs, i))
    for inner in block.operations:
        op = inner.operation
        if op.name not in _TOP_LEVEL_OPS:
            return False
        if op.name == "sdy.manual_computation":
            if not _manual_over_whole_mesh(op, meshes):
                return False
            ins, outs = _shardings(op, "in_shardings"), _shardings(op, "out_shardings")
            if len(ins) != len(op.operands) or len(outs) != len(op.results):
                return False
            for value, sharding in zip(op.operands, ins, strict=True):
                want(value, sharding)
            for value, sharding in zip(op.results, outs, strict=True):
                want(value, sharding)
        elif op.name == "sdy.sharding_constraint":
            sharding = str(sdy.TensorShardingAttr(op.attributes["sharding"]))
            want(op.operands[0], sharding)
            want(op.results[0], sharding)
        elif op.name == "func.return":
            for i, value in enumerate(op.operands):
                want(value, _value_sharding(res_attrs, i))
    return all(len(s) == 1 for s in wanted.values())


def may_park(module: Any) -> bool:
    """Whether the devices of ``module``'s program may park in its collectives' meetings
    (the module docstring says when)."""
    funcs = functions(module).values()
    if any(_waits(op) for func in funcs for op in operations(func)):
        return False
    if partitioned(module):
        meshes = mesh_axes(module)
        # Private functions run where they are called from: inside a manual computation
        # (the walk above checked their ops), or from the top level, which a call refuses.
        return all(_top_level_is_local(func, meshes)
                   for func in funcs if not is_private(func))
    return True


__all__ = ["may_park"]
