"""GPU-parity scenarios shared by tests/parity/test_gpu_parity.py and the mpirun program.

``REJECTED`` holds the programs XLA GPU refuses to compile (JAX's GPU-only tests in
``tests/shard_map_test.py`` and the rules of XLA's send/recv deadlock verifier), each with
the exception and message it must raise when lowered. The ``accepted_*`` functions run the
programs XLA GPU accepts and return ``(got, want)``, ``want`` computed without psend/precv
(``lax.ppermute`` or numpy).

Programs map over a 1-D mesh ``("x",)`` of ``n`` devices; every device holds one row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cpu_mpi

Gather = Callable[[jax.Array], np.ndarray]
ROWS = P("x", None)

CYCLE = "Expected send and recv instructions to have non-cyclical source-target pairs"
NO_SEND = "Expected send to match recv"
NO_RECV = "Expected recv to match send"
MISMATCH = "Deadlock detected. Last checked instructions: %psend"
BETWEEN = ("Expected send and recv instructions to have the same source-target pairs, but "
           "could not match some instructions. Introducing the following instruction will "
           "cause a deadlock:\n%collective-permute")
TWO_SENDS = "Expected recv, but found %psend.1 = "


def put(mesh: jax.sharding.Mesh, spec: P, value: np.ndarray) -> jax.Array:
    return jax.make_array_from_callback(
        value.shape, NamedSharding(mesh, spec), lambda index: value[index])


def like(a: jax.Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(a.shape, a.dtype)


def program(mesh: jax.sharding.Mesh, fn: Callable, spec: P = ROWS, check_vma: bool = True):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec,
                                 check_vma=check_vma))


def rows(n: int, width: int = 2) -> np.ndarray:
    """``arange`` rows, as in JAX's tests (distinct values per device)."""
    return np.arange(n * width, dtype=np.float32).reshape(n, width) + 1


# ---------------------------------------------------------------- rejected programs


def _cycle(a):  # JAX: test_psend_precv_basic_with_deadlock_cycle
    token = jax_cpu_mpi.psend(a, "x", [(0, 1), (1, 0)])
    return jax_cpu_mpi.precv(token, like(a), "x", [(0, 1), (1, 0)])


def _self_pair(a):  # XLA: a pair (i, i) is a cycle
    token = jax_cpu_mpi.psend(a, "x", [(0, 0)])
    return jax_cpu_mpi.precv(token, like(a), "x", [(0, 0)])


def _dangling_precv(a):  # JAX: test_psend_precv_basic_with_dangling_recv
    return jax_cpu_mpi.precv(jax.lax.create_token(), like(a), "x", [(0, 1)])


def _dangling_psend(a):
    jax_cpu_mpi.psend(a, "x", [(0, 1)])
    return a


def _mismatched(a):  # JAX: test_psend_precv_basic_with_non_matching_source_target_pairs
    token = jax_cpu_mpi.psend(a, "x", [(0, 1)])
    return jax_cpu_mpi.precv(token, like(a), "x", [(1, 0)])


def _collective_between(a):
    # The barrier puts the ppermute between the psend and the precv in XLA's order too
    # (the precv's token is the barrier's): psend, ppermute, precv.
    token = jax_cpu_mpi.psend(a, "x", [(0, 1)])
    b = jax.lax.ppermute(a, "x", [(1, 0)])
    token, b = jax.lax.optimization_barrier((token, b))
    return jax_cpu_mpi.precv(token, like(a), "x", [(0, 1)]) + b


def _two_sends_joined_by_a_barrier(a):
    # Both tokens pass through one barrier before the precvs: XLA visits the barrier's
    # operands (both psends) before either precv, so it sees send, send, recv, recv.
    t1 = jax_cpu_mpi.psend(a, "x", [(0, 1)])
    t2 = jax_cpu_mpi.psend(a + 1, "x", [(1, 0)])
    t1, t2 = jax.lax.optimization_barrier((t1, t2))
    return (jax_cpu_mpi.precv(t1, like(a), "x", [(0, 1)])
            + jax_cpu_mpi.precv(t2, like(a), "x", [(1, 0)]))


def _dropped_token_psend_is_visited_first(a):
    # A psend whose token nothing uses is an "unreachable root" of the computation: XLA
    # visits it before everything the result depends on, so the verifier sees
    # psend([(1, 0)]), psend([(0, 1)]), precv, precv: two psends in a row that form a
    # cycle. In program order (psend, precv, psend, precv) it would pass.
    t1 = jax_cpu_mpi.psend(a, "x", [(0, 1)])
    r1 = jax_cpu_mpi.precv(t1, like(a), "x", [(0, 1)])
    jax_cpu_mpi.psend(a + 1, "x", [(1, 0)])
    r2 = jax_cpu_mpi.precv(jax.lax.create_token(), like(a), "x", [(1, 0)])
    return r1 + r2


def _cycle_in_scan(a):
    def step(carry, _):
        token = jax_cpu_mpi.psend(carry, "x", [(0, 1), (1, 0)])
        out = jax_cpu_mpi.precv(token, like(carry), "x", [(0, 1), (1, 0)])
        return jax.lax.pcast(out, "x", to="varying"), None

    return jax.lax.scan(step, a, None, length=3)[0]


def _psend_in_loop_precv_nowhere(a):  # the loop body is checked once, psend stays pending
    def step(carry, _):
        jax_cpu_mpi.psend(carry, "x", [(0, 1)])
        return carry * 2, None

    return jax.lax.scan(step, a, None, length=3)[0]


def _mismatch_in_nested_jit_and_cond(a):
    @jax.jit
    def inner(v):
        token = jax_cpu_mpi.psend(v, "x", [(0, 1)])
        return jax.lax.pcast(jax_cpu_mpi.precv(token, like(v), "x", [(1, 0)]), "x", to="varying")

    return jax.lax.cond(a.sum() > 0, inner, lambda v: v, a)


def _duplicate_pairs(a):  # JAX: test_psend_precv_basic_with_duplicate_source_target_pairs
    token = jax_cpu_mpi.psend(a, "x", [(0, 1), (0, 1)])
    return jax_cpu_mpi.precv(token, like(a), "x", [(1, 0)])


@dataclass(frozen=True)
class Rejected:
    fn: Callable
    error: type[Exception]
    message: str  # a regular expression, searched in str(error)


def _exact(text: str) -> str:
    import re

    return re.escape(text)


REJECTED: dict[str, Rejected] = {
    "cycle": Rejected(_cycle, jax.errors.JaxRuntimeError, _exact(CYCLE)),
    "self_pair": Rejected(_self_pair, jax.errors.JaxRuntimeError, _exact(CYCLE)),
    "dangling_precv": Rejected(_dangling_precv, jax.errors.JaxRuntimeError, _exact(NO_SEND)),
    "dangling_psend": Rejected(_dangling_psend, jax.errors.JaxRuntimeError, _exact(NO_RECV)),
    "mismatched": Rejected(_mismatched, jax.errors.JaxRuntimeError, _exact(MISMATCH)),
    "collective_between": Rejected(_collective_between, jax.errors.JaxRuntimeError,
                                   _exact(BETWEEN)),
    "two_sends_joined_by_a_barrier": Rejected(_two_sends_joined_by_a_barrier,
                                              jax.errors.JaxRuntimeError,
                                              _exact(TWO_SENDS)),
    "dropped_token_psend_is_visited_first": Rejected(
        _dropped_token_psend_is_visited_first, jax.errors.JaxRuntimeError,
        _exact(TWO_SENDS)),
    "cycle_in_scan": Rejected(_cycle_in_scan, jax.errors.JaxRuntimeError, _exact(CYCLE)),
    "psend_in_loop_precv_nowhere": Rejected(_psend_in_loop_precv_nowhere,
                                            jax.errors.JaxRuntimeError, _exact(NO_RECV)),
    "mismatch_in_nested_jit_and_cond": Rejected(_mismatch_in_nested_jit_and_cond,
                                                jax.errors.JaxRuntimeError, _exact(MISMATCH)),
    # JAX's own error (JAX 0.10 prints the perm as a tuple, older JAX as a list).
    "duplicate_pairs": Rejected(_duplicate_pairs, ValueError, _exact(
        "psend sources and destinations must be unique, got ")
        + r"[\[(]\(0, 1\), \(0, 1\)[\])]\."),
}


# ---------------------------------------------------------------- accepted programs

Shift = Callable[[jax.Array, list[tuple[int, int]]], jax.Array]


def p2p(x: jax.Array, perm: list[tuple[int, int]]) -> jax.Array:
    token = jax_cpu_mpi.psend(x, "x", perm)
    return jax_cpu_mpi.precv(token, like(x), "x", perm)


def ppermute(x: jax.Array, perm: list[tuple[int, int]]) -> jax.Array:
    return jax.lax.ppermute(x, "x", perm)


def _chain_then_back_edge(shift: Shift, n: int, weights: np.ndarray) -> Callable:
    """JAX's send/compute/send-back tests (two devices: n=2; the 8-device chain: n=8).

    JAX's tests send a (n, width) matmul result back into a (1, width) precv; ours sums
    it to (1, width), since our runtime rejects a psend/precv size mismatch.
    """

    def fwd(a):
        data = shift(a, [(i, i + 1) for i in range(n - 1)])
        weights_, _ = jax.lax.optimization_barrier((weights, data))
        res = jnp.dot(weights_, data).sum(axis=0, keepdims=True)
        return shift(res, [(n - 1, 0)])

    return fwd


def accepted_chain_then_back_edge(mesh, gather: Gather, width: int = 2):
    n = mesh.shape["x"]
    weights = np.random.default_rng(0).uniform(size=(n, 1)).astype(np.float32)
    x = put(mesh, ROWS, rows(n, width))
    got = gather(program(mesh, _chain_then_back_edge(p2p, n, weights))(x))
    want = gather(program(mesh, _chain_then_back_edge(ppermute, n, weights))(x))
    expected = np.zeros((n, width), np.float32)  # device 0 gets sum(w) * row n-2
    expected[0] = weights.sum() * rows(n, width)[n - 2]
    return got, want, expected


def _precv_before_psend(a):  # JAX: test_psend_precv_reverse_two_gpus
    dummy = jax_cpu_mpi.precv(jax.lax.create_token(), like(a), "x", [(0, 1)])
    jax_cpu_mpi.psend(dummy, "x", [(0, 1)])
    return dummy


def accepted_precv_before_psend(mesh, gather: Gather):
    n = mesh.shape["x"]
    got = gather(program(mesh, _precv_before_psend)(put(mesh, ROWS, rows(n))))
    return got, np.zeros((n, 2), np.float32)


def _two_sends_then_two_precvs(a):
    # issue 12: JAX emits psend, psend, precv, precv; XLA's verifier sees each precv
    # right after the psend whose token it takes (psend, precv, psend, precv).
    t1 = jax_cpu_mpi.psend(a, "x", [(0, 1)])
    t2 = jax_cpu_mpi.psend(a + 1, "x", [(1, 0)])
    r1 = jax_cpu_mpi.precv(t1, like(a), "x", [(0, 1)])
    r2 = jax_cpu_mpi.precv(t2, like(a), "x", [(1, 0)])
    return jnp.concatenate([r1, r2], axis=1)


def accepted_two_sends_then_two_precvs(mesh, gather: Gather, width: int = 2):
    """Both directions of the issue's program, and what they must be (numpy)."""
    x = put(mesh, ROWS, rows(2, width))
    got = gather(program(mesh, _two_sends_then_two_precvs)(x))
    sent = rows(2, width)
    expected = np.zeros((2, 2 * width), np.float32)
    expected[1, :width] = sent[0]  # pair (0, 1) carries row 0 to device 1
    expected[0, width:] = sent[1] + np.float32(1)  # pair (1, 0) carries row 1 + 1 back
    return got, expected


def _opposite_order(a):
    # psend A, psend B, precv B, precv A: in program order two psends in a row whose
    # pairs form the cycle 0 -> 1 -> 0, but XLA rebuilds the computation depth-first
    # from its root, so each precv directly follows its own psend: B, B, A, A
    # (the result uses rB first). XLA accepts it, and so do we.
    t_a = jax_cpu_mpi.psend(a, "x", [(0, 1)])
    t_b = jax_cpu_mpi.psend(a * 10, "x", [(1, 0)])
    r_b = jax_cpu_mpi.precv(t_b, like(a), "x", [(1, 0)])
    r_a = jax_cpu_mpi.precv(t_a, like(a), "x", [(0, 1)])
    return jnp.concatenate([r_b, r_a], axis=1)


def accepted_opposite_order(mesh, gather: Gather):
    x = put(mesh, ROWS, rows(2))
    got = gather(program(mesh, _opposite_order)(x))
    want = gather(program(mesh, lambda a: jnp.concatenate(
        [ppermute(a * 10, [(1, 0)]), ppermute(a, [(0, 1)])], axis=1))(x))
    return got, want


def _ppermute_between_in_program_order(a):
    # A ppermute between a psend and its precv in program order only: the precv's
    # token comes straight from the psend, so XLA visits precv right after psend and
    # the ppermute after both. XLA accepts it (the psend never waits).
    token = jax_cpu_mpi.psend(a, "x", [(0, 1)])
    b = jax.lax.ppermute(a, "x", [(1, 0)])
    return jax_cpu_mpi.precv(token, like(a), "x", [(0, 1)]) + b


def accepted_ppermute_between_in_program_order(mesh, gather: Gather):
    x = put(mesh, ROWS, rows(2))
    got = gather(program(mesh, _ppermute_between_in_program_order)(x))
    want = gather(program(mesh, lambda a: ppermute(a, [(0, 1)]) + ppermute(a, [(1, 0)]))(x))
    return got, want


#: Accepted programs whose order XLA's verifier sees differs from JAX's program order,
#: for the order tests and scripts/gpu_parity_check.py: name -> (fn, the kinds in XLA's
#: order).
REORDERED: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "two_sends_then_two_precvs": (_two_sends_then_two_precvs,
                                  ("psend", "precv", "psend", "precv")),
    "opposite_order": (_opposite_order, ("psend", "precv", "psend", "precv")),
    "ppermute_between_in_program_order": (
        _ppermute_between_in_program_order, ("psend", "precv", "collective-permute")),
}


# ------------------------------------------- JAX GPU performance tips: manual pipelining


@dataclass(frozen=True)
class PipelineSizes:
    microbatches: int = 5
    circ_repeats: int = 2
    contracting: int = 4
    non_contracting: int = 8
    compute_intensity: int = 2


def _pipeline(n: int, s: PipelineSizes, manual: bool) -> Callable:
    """``entry_computation`` of "Using psend and precv" (manual=True), with small sizes.

    manual=False is the reference: the same schedule, the forward edge moved by
    ``lax.ppermute`` at the bottom of each step instead of psend (top of the next step)
    / precv (bottom of this one). ``select_on_first_device`` uses ``axis_index``: the
    docs' helper comes from their global-view example, where dimension 0 is the device.
    """
    fwd_perm = [(i, i + 1) for i in range(n - 1)]
    back_perm = [(n - 1, 0)]
    block = (1, 1, s.contracting, s.non_contracting)

    def on_first_device(then_value, else_value):
        return jnp.where(jax.lax.axis_index("x") == 0, then_value, else_value)

    def on_first_cycle(i, then_value, else_value):
        return jnp.where(i < s.microbatches, then_value, else_value)

    def body(carry, i):
        weights, input_buffer, output_buffer, prev_res, prev_fwd, prev_bwd = carry
        input_slice = jax.lax.dynamic_slice(
            input_buffer, (0, (i + 0) % s.microbatches, 0, 0), block)
        if manual:  # send_fwd: matches the precv of the previous step (or the prologue)
            fwd_send_token = jax_cpu_mpi.psend(prev_res, "x", fwd_perm)
        compute_argument = on_first_device(
            on_first_cycle(i, input_slice, prev_bwd), prev_fwd
        ).reshape((1, s.contracting, s.non_contracting))
        tmp = compute_argument
        for _ in range(s.compute_intensity):
            tmp = jax.lax.dot_general(weights, tmp, (((2,), (1,)), ((0,), (0,))))
        compute_result = tmp.reshape(block)
        bwd_slice = jax.lax.dynamic_slice(
            output_buffer, (0, (i + 1) % s.microbatches, 0, 0), block)
        if manual:  # the ppermute comes after send_fwd
            bwd_slice, _ = jax.lax.optimization_barrier((bwd_slice, fwd_send_token))
        bwd_data = jax.lax.ppermute(bwd_slice, "x", back_perm)
        if manual:  # recv_fwd after the ppermute; the next step's psend matches it
            precv_token, _ = jax.lax.optimization_barrier(
                (jax.lax.create_token(), bwd_data))
            fwd_data = jax_cpu_mpi.precv(precv_token, jax.ShapeDtypeStruct(block, jnp.float32),
                                         "x", fwd_perm)
        else:
            fwd_data = jax.lax.ppermute(compute_result, "x", fwd_perm)
        output_buffer = jax.lax.dynamic_update_slice(
            output_buffer, compute_result, (0, (i + 2) % s.microbatches, 0, 0))
        return (weights, input_buffer, output_buffer, compute_result, fwd_data, bwd_data), i

    def entry(weights, input_buffer, dummy_data):
        output_buffer = jnp.zeros_like(input_buffer)
        if manual:  # start the pipeline: a priming precv
            first = jax_cpu_mpi.precv(jax.lax.create_token(), like(dummy_data), "x", fwd_perm)
        else:
            first = dummy_data
        carry = (weights, input_buffer, output_buffer, first, dummy_data, dummy_data)
        steps = s.circ_repeats * s.microbatches + n - 1
        carry, _ = jax.lax.scan(body, carry, xs=jnp.arange(steps))
        if manual:  # the final psend matches the last step's precv
            jax_cpu_mpi.psend(carry[3], "x", fwd_perm)
        return carry[2], carry[4]

    return entry


def pipeline_program(mesh, manual: bool, sizes: PipelineSizes = PipelineSizes()):
    n = mesh.shape["x"]
    return jax.jit(jax.shard_map(_pipeline(n, sizes, manual), mesh=mesh, in_specs=P("x"),
                                 out_specs=P("x"), check_vma=False))


def pipeline_inputs(mesh, sizes: PipelineSizes = PipelineSizes()):
    n, s = mesh.shape["x"], sizes
    rng = np.random.default_rng(1)
    weights = (rng.standard_normal((n, s.contracting, s.contracting))
               / np.sqrt(s.contracting)).astype(np.float32)
    inputs = rng.uniform(size=(s.microbatches, s.contracting, s.non_contracting))
    input_buffer = np.broadcast_to(inputs, (n, *inputs.shape)).astype(np.float32)
    dummy = np.zeros((n, 1, s.contracting, s.non_contracting), np.float32)
    return tuple(put(mesh, P("x"), v) for v in (weights, input_buffer, dummy))


def accepted_pipeline(mesh, gather: Gather):
    """(output buffer, last forward data) of the psend/precv pipeline and the reference."""
    args = pipeline_inputs(mesh)
    got = [gather(v) for v in pipeline_program(mesh, manual=True)(*args)]
    want = [gather(v) for v in pipeline_program(mesh, manual=False)(*args)]
    return got, want


# ---------------------------------------------------------------- the whole corpus


@dataclass(frozen=True)
class Program:
    """One program of the corpus, ready to lower: ``jitted.lower(*args)``."""

    name: str
    jitted: Callable
    args: tuple
    #: None if XLA GPU compiles it; else the start of the error message (a regex).
    rejected: str | None


def corpus(mesh) -> list[Program]:
    """Every 2-device program of this file (for scripts/gpu_parity_check.py)."""
    n = mesh.shape["x"]
    x = put(mesh, ROWS, rows(n))
    weights = np.random.default_rng(0).uniform(size=(n, 1)).astype(np.float32)
    out = [Program(name, program(mesh, case.fn), (x,), case.message)
           for name, case in sorted(REJECTED.items())]
    out += [Program(name, program(mesh, fn), (x,), None)
            for name, (fn, _) in sorted(REORDERED.items())]
    out.append(Program("chain_then_back_edge",
                       program(mesh, _chain_then_back_edge(p2p, n, weights)), (x,), None))
    out.append(Program("precv_before_psend", program(mesh, _precv_before_psend), (x,), None))
    out.append(Program("pipeline_of_the_gpu_performance_tips",
                       pipeline_program(mesh, manual=True), pipeline_inputs(mesh), None))
    return out
