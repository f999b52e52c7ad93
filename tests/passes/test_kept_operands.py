"""Kept operands: a precv keeps its psend's operand alive, and the psend returns early.

The module pass (python/jax_cpu_mpi/_kept_operands.py) gives a precv the operand of the
psend whose token it takes in the same block, and marks that psend; at run time such a
psend hands its operand to a waiting receiver and returns, and the precv finishes the send
(cpp/ffi/kept_sends.h). These tests pin where the pass applies (and where it must not), and
that values, errors and the transports' state are what they are without it (the results
are compared with lax.ppermute and with the pass switched off). Over MPI the same path is
taken by every precv(psend(x)) of 16 KiB and more whose receiver is ready: see
tests/mpi_programs/rendezvous.py and test_p2p_mpi.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cpu_mpi
from conftest import make_mesh
from jax_cpu_mpi import config
from jax_cpu_mpi._src import compat as _compat
from jax_cpu_mpi._src.ffi import custom_calls as _custom_calls
from jax_cpu_mpi._src.passes import kept_operands as _kept_operands

FORWARD = [(0, 1)]
BACKWARD = [(1, 0)]


@pytest.fixture(autouse=True)
def no_parity_check():
    with config.overrides(gpu_parity=False):
        yield


def hop(x, perm):
    token = jax_cpu_mpi.psend(x, "x", perm)
    y = jax_cpu_mpi.precv(token, jax.ShapeDtypeStruct(x.shape, x.dtype), "x", perm)
    return jax.lax.pcast(y, "x", to="varying")


def spmd(body, mesh, outputs=1):
    out_specs = P("x") if outputs == 1 else tuple(P("x") for _ in range(outputs))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=out_specs))


def sharded(mesh, n, dtype=np.float32):
    x = np.arange(2 * n, dtype=dtype) + 1
    return jax.device_put(x, NamedSharding(mesh, P("x")))


def custom_calls(f, x) -> list[str]:
    text = f.lower(x).as_text()
    return [line for line in text.splitlines() if "stablehlo.custom_call @jax_cpu_mpi_p" in line]


def routing(line: str) -> dict:
    """The fields of a call's packed integer attribute (custom_calls.ROUTING)."""
    values = re.search(r"routing = dense<\[([-\d, ]+)\]>", line).group(1)
    return _custom_calls.unpack_routing(np.array([int(v) for v in values.split(",")]))


def kept(line: str) -> int:
    return routing(line)[_custom_calls.OPERAND_KEPT]


def group_pairs(line: str) -> list[int]:
    return routing(line)[_custom_calls.GROUP_PAIRS].tolist()


@pytest.fixture
def pass_off(monkeypatch):
    monkeypatch.setattr(_compat.KEPT_OPERANDS, "installed", False)


def test_feature_is_active():
    assert _compat.KEPT_OPERANDS.active


def test_precv_keeps_the_operand_of_its_psend():
    mesh = make_mesh((2, "x"))
    calls = custom_calls(spmd(lambda v: hop(v, FORWARD), mesh), sharded(mesh, 8))
    psend, precv = calls
    assert "@jax_cpu_mpi_psend" in psend and kept(psend) == 1
    assert "@jax_cpu_mpi_precv" in precv and kept(precv) == 2
    # precv(token, partition id, the psend's operand, the psend's u32 result)
    operands = re.search(r"@jax_cpu_mpi_precv\(([^)]*)\)", precv).group(1).split(", ")
    sent = re.search(r"@jax_cpu_mpi_psend\(([^)]*)\)", psend).group(1).split(", ")[0]
    result = re.search(r"(%\w+):2 = stablehlo.custom_call @jax_cpu_mpi_psend", psend).group(1)
    assert operands[2:] == [sent, f"{result}#1"], (psend, precv)


def test_a_device_sending_to_itself_keeps_and_the_pass_stays_on():
    # pairs [(0, 0)] are a splat attribute (every element equal): the pass read it as an
    # array of zero strides and failed writing it back, which switched the pass off for the
    # rest of the process.
    mesh = make_mesh((1, "x"))
    f = spmd(lambda v: hop(v, [(0, 0)]), mesh)
    x = sharded(mesh, 2)
    psend, precv = custom_calls(f, x)
    assert kept(psend) == 1 and kept(precv) == 2
    assert _compat.KEPT_OPERANDS.active
    np.testing.assert_array_equal(f(x), x)


def test_not_kept_across_blocks_or_when_off(pass_off):
    mesh = make_mesh((2, "x"))
    calls = custom_calls(spmd(lambda v: hop(v, FORWARD), mesh), sharded(mesh, 8))
    assert [kept(c) for c in calls] == [0, 0]


def test_ppermute_lowered_as_psend_precv_keeps_its_operand(monkeypatch):
    # Between processes JAX_CPU_MPI_COLLECTIVES=mpi lowers ppermute as psend then precv; its
    # program carries no psend/precv effect, yet the pass must see it (else every send of
    # such an exchange is a copy: half psend/precv's speed). Lowered here as if across.
    from jax_cpu_mpi._src.lowering import collectives, rules

    monkeypatch.setattr(collectives, "_ppermute_plan", lambda *args: None)
    mesh = make_mesh((2, "x"))
    f = spmd(lambda v: jax.lax.ppermute(v, "x", [(0, 1), (1, 0)]), mesh)
    x = sharded(mesh, 1 << 16)
    calls = custom_calls(f, x)
    assert len(calls) == 2 and [kept(c) for c in calls] == [1, 2], calls
    assert rules.emitted_for_pass == 0
    got = np.asarray(f(x))
    np.testing.assert_array_equal(got, np.roll(np.asarray(x), 1 << 16))


def test_precv_in_a_branch_does_not_keep():
    """A precv in a cond branch might not run: the psend outside it finishes its own send."""
    mesh = make_mesh((2, "x"))

    def body(v):
        token = jax_cpu_mpi.psend(v, "x", FORWARD)
        out = jax.ShapeDtypeStruct(v.shape, v.dtype)
        return jax.lax.cond(v[0] > -1, lambda: jax_cpu_mpi.precv(token, out, "x", FORWARD),
                            lambda: jax_cpu_mpi.precv(token, out, "x", FORWARD))

    x = sharded(mesh, 1 << 18)
    f = spmd(body, mesh)
    assert all(kept(c) == 0 for c in custom_calls(f, x))
    got = np.asarray(f(x))
    want = np.asarray(spmd(lambda v: jax.lax.ppermute(v, "x", FORWARD), mesh)(x))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n", [4 << 10, 1 << 18, 4 << 20])
def test_pingpong_scan_matches_ppermute(n):
    mesh = make_mesh((2, "x"))

    def body(transport):
        def round_trip(carry, _):
            z, _ = carry
            y = transport(z, FORWARD)
            return (transport(y, BACKWARD) * 2, y), None

        def run(v):
            return jax.lax.scan(round_trip, (v, v), None, length=6)[0]
        return run

    x = sharded(mesh, n)
    before = jax_cpu_mpi.stats()["kept_sends"]
    got = spmd(body(hop), mesh, 2)(x)
    want = spmd(body(lambda v, p: jax.lax.ppermute(v, "x", p)), mesh, 2)(x)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    stats = jax_cpu_mpi.stats()
    assert stats["kept_sends_unfinished"] == 0 and stats["mailbox_queued_messages"] == 0
    if n * 4 >= 16 << 10:  # offered from the operand (the mailbox copies smaller ones)
        assert stats["kept_sends"] > before


def test_operand_used_after_the_psend_is_unchanged():
    """XLA may not reuse or update the operand in place before the keeping precv ran."""
    mesh = make_mesh((2, "x"))

    def body(v):
        y = hop(v, [(0, 1), (1, 0)])
        w = v.at[0].set(-1.0)  # a write to a copy of the operand, never to the operand
        return y + w, v

    x = sharded(mesh, 1 << 18)
    (got, v_out), (want, _) = spmd(body, mesh, 2)(x), spmd(
        lambda v: (jax.lax.ppermute(v, "x", [(0, 1), (1, 0)]) + v.at[0].set(-1.0), v),
        mesh, 2)(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(v_out), np.asarray(x))


def test_one_token_two_precvs():
    """One group (neither psend depends on a precv): each data precv keeps the operands of
    the group's psends before it; the last keeper to run finishes a send."""
    mesh = make_mesh((2, "x"))

    def body(v):
        token = jax_cpu_mpi.psend(v, "x", FORWARD)
        out = jax.ShapeDtypeStruct(v.shape, v.dtype)
        a = jax_cpu_mpi.precv(token, out, "x", FORWARD)
        token2 = jax_cpu_mpi.psend(v * 3, "x", FORWARD)
        b = jax_cpu_mpi.precv(token2, out, "x", FORWARD)
        c = jax_cpu_mpi.precv(token, jax.ShapeDtypeStruct((1,), v.dtype), "x", [])
        return a + b + c

    x = sharded(mesh, 1 << 18)
    f = spmd(body, mesh)
    # psend (kept by a and b), a (its operand and u32 result), psend (kept by b), b (both
    # psends' operands and u32 results), c without pairs (after the first psend's u32 only)
    assert [kept(c) for c in custom_calls(f, x)] == [2, 2, 1, 4, 1]
    want = spmd(lambda v: jax.lax.ppermute(v, "x", FORWARD) * 4, mesh)(x)
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(want))
    assert jax_cpu_mpi.stats()["kept_sends_unfinished"] == 0


@pytest.mark.parametrize("n", [4 << 10, 1 << 20])
def test_same_results_with_the_pass_off(n, monkeypatch):
    mesh = make_mesh((4, "x"))
    ring = [(i, (i + 1) % 4) for i in range(4)]

    def body(v):
        return hop(hop(v, ring) + 1, list(reversed(ring)))

    x = sharded(mesh, n)
    on = np.asarray(spmd(body, mesh)(x))
    monkeypatch.setattr(_compat.KEPT_OPERANDS, "installed", False)
    off = np.asarray(spmd(lambda v: body(v) + 0, mesh)(x))  # a new program: lowered anew
    np.testing.assert_array_equal(on, off)


def test_size_mismatch_on_kept_send_is_reported_and_leaves_nothing():
    mesh = make_mesh((2, "x"))

    def body(v):
        token = jax_cpu_mpi.psend(v, "x", FORWARD)
        return jax_cpu_mpi.precv(token, jax.ShapeDtypeStruct((v.shape[0] // 2,), v.dtype),
                                 "x", FORWARD)

    x = sharded(mesh, 1 << 18)
    with pytest.raises(Exception, match=r"precv.*expected float32\[131072\].*float32\[262144\]"):
        jax.block_until_ready(spmd(body, mesh)(x))
    stats = jax_cpu_mpi.stats()
    assert stats["kept_sends_unfinished"] == 0 and stats["mailbox_queued_messages"] == 0
    # The channel still works afterwards.
    y = spmd(lambda v: hop(v, FORWARD), mesh)(x)
    np.testing.assert_array_equal(np.asarray(y)[1 << 18:], np.asarray(x)[: 1 << 18])


def test_op_failing_before_the_keeping_precv_finishes_the_kept_send():
    """XLA runs no thunk after a failed one, so the precv that keeps a psend's operand may be
    skipped: the failed op must finish the kept send while the operand is still alive."""
    mesh = make_mesh((2, "x"))
    n = 1 << 18

    def body(v):
        small = v[:4]
        # Device 0 sends only once device 1 has sent (and gone on to wait for it): its psend
        # then hands its operand to a waiting receiver and keeps it.
        got = jax_cpu_mpi.precv(jax_cpu_mpi.psend(small, "x", BACKWARD),
                                jax.ShapeDtypeStruct((4,), v.dtype), "x", BACKWARD)
        token = jax_cpu_mpi.psend(jax.lax.optimization_barrier((got, v))[1], "x", FORWARD)
        after_send = jax.lax.optimization_barrier((token, small))[1]  # fails after the psend
        bad = jax_cpu_mpi.precv(jax_cpu_mpi.psend(after_send, "x", BACKWARD),
                                jax.ShapeDtypeStruct((4,), jnp.int32), "x", BACKWARD)
        token = jax.lax.optimization_barrier((token, bad))[0]  # the keeping precv runs last
        y = jax_cpu_mpi.precv(token, jax.ShapeDtypeStruct(v.shape, v.dtype), "x", FORWARD)
        return jax.lax.pcast(y, "x", to="varying") + (got.sum() + bad.sum()).astype(v.dtype)

    x = sharded(mesh, n)
    f = spmd(body, mesh)
    before = jax_cpu_mpi.stats()["kept_sends"]
    for _ in range(3):
        with pytest.raises(Exception, match=r"expected int32\[4\].*sent float32\[4\]"):
            jax.block_until_ready(f(x))
    stats = jax_cpu_mpi.stats()
    assert stats["kept_sends"] > before  # the case under test happened
    assert stats["kept_sends_unfinished"] == 0 and stats["mailbox_queued_messages"] == 0
    y = spmd(lambda v: hop(v, FORWARD), mesh)(x)
    np.testing.assert_array_equal(np.asarray(y)[n:], np.asarray(x)[:n])


def test_many_pairs_at_once():
    """Four devices, every pair both ways in one step, offered operands everywhere."""
    mesh = make_mesh((4, "x"))
    shifts = [[(i, (i + s) % 4) for i in range(4)] for s in (1, 2, 3)]

    def body(v):
        out = v
        for perm in shifts:
            out = out + hop(v * (len(perm) + 1), perm)
        return out

    def want_body(v):
        out = v
        for perm in shifts:
            out = out + jax.lax.ppermute(v * (len(perm) + 1), "x", perm)
        return out

    x = sharded(mesh, 1 << 16)
    got = np.asarray(spmd(body, mesh)(x))
    np.testing.assert_array_equal(got, np.asarray(spmd(want_body, mesh)(x)))
    assert jnp.isfinite(got).all()


def test_a_step_of_two_ops_is_one_group_and_the_next_step_another():
    """psends both ways, then their precvs (a GPU-parity exchange, a pipeline tick): each
    precv keeps both operands, so each device's sends are finished by its last precv of the
    step, both directions in flight; the next step sends what this one received: a group
    of its own."""
    mesh = make_mesh((2, "x"))
    out = jax.ShapeDtypeStruct((1 << 16,), np.float32)

    def body(v):
        t1, t2 = jax_cpu_mpi.psend(v, "x", FORWARD), jax_cpu_mpi.psend(v * 2, "x", BACKWARD)
        a, b = jax_cpu_mpi.precv(t1, out, "x", FORWARD), jax_cpu_mpi.precv(t2, out, "x", BACKWARD)
        return jax_cpu_mpi.precv(jax_cpu_mpi.psend(a + b, "x", FORWARD), out, "x", FORWARD)

    def want_body(v):
        a, b = jax.lax.ppermute(v, "x", FORWARD), jax.lax.ppermute(v * 2, "x", BACKWARD)
        return jax.lax.ppermute(a + b, "x", FORWARD)

    x = sharded(mesh, 1 << 16)
    f = spmd(body, mesh)
    calls = custom_calls(f, x)
    assert [kept(c) for c in calls] == [2, 2, 4, 4, 1, 2], calls
    assert all(group_pairs(c) == [0, 1, 1, 0] for c in calls[:4]), calls
    assert all(group_pairs(c) == [0, 1] for c in calls[4:]), calls
    before = jax_cpu_mpi.stats()["kept_sends"]
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(spmd(want_body, mesh)(x)))
    stats = jax_cpu_mpi.stats()
    assert stats["kept_sends"] > before and stats["kept_sends_unfinished"] == 0


def program_receives(line: str) -> list[int]:
    return routing(line)[_custom_calls.PROGRAM_RECEIVES].tolist()


def program_sends(line: str) -> list[int]:
    return routing(line)[_custom_calls.PROGRAM_SENDS].tolist()


def test_every_call_lists_the_programs_receives(monkeypatch):
    """Every psend/precv carries the pairs of all the program's precvs and psends (an op
    that fails marks the channels whose precvs did not all take their message, and those
    whose psends did not all run: cpp/ffi/failed_runs.h); a precv or psend in a loop's body,
    which may run any number of times, has its destination as -1 - destination, the others
    (the shard_map body runs once) as they are."""
    mesh = make_mesh((2, "x"))
    x = sharded(mesh, 4)

    def body(v):
        def step(c, _):
            return hop(c, BACKWARD), None
        return jax.lax.scan(step, hop(v, FORWARD), None, length=3)[0]

    calls = custom_calls(spmd(body, mesh), x)
    assert len(calls) == 4
    for line in calls:
        assert program_receives(line) == [0, 1, 1, -1], line
        assert program_sends(line) == [0, 1, 1, -1], line
    # A program without precvs: no receive listed, its send is.
    walks = []
    hops_of = _kept_operands._hops_of
    monkeypatch.setattr(_kept_operands, "_hops_of",
                        lambda *args: walks.append(args) or hops_of(*args))
    send_only = spmd(lambda v: (jax_cpu_mpi.psend(v, "x", FORWARD), v)[1], mesh)
    assert [(program_receives(line), program_sends(line))
            for line in custom_calls(send_only, x)] == [([], [0, 1])]
    # A program that moves no data (only a barrier's ordering calls): nothing listed, and
    # its functions are not walked.
    walks.clear()
    barrier_only = spmd(lambda v: jax.lax.optimization_barrier(
        (jax.lax.create_token(), v))[1] + 1, mesh)
    assert [(program_receives(line), program_sends(line))
            for line in custom_calls(barrier_only, x)] == [([], [])] * 2
    assert walks == []


def test_a_failed_call_leaves_a_loops_channel_refused():
    """Device 0 fails in the first step of a loop, after its first receive; device 1, which
    only sends, runs every step: the later steps' messages stay in the channel 1 -> 0, as
    many as the precvs that took one. The loop's precv may run any number of times, so the
    channel is refused all the same (counting it once, the next call took the failed call's
    second step's bytes as its own)."""
    # Devices of their own: the refused channel stays refused in this process.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[6:8]), ("x",))
    n = 4

    def body(v):
        def step(c, _):
            got = hop(c, BACKWARD)
            bad = jax_cpu_mpi.precv(jax_cpu_mpi.psend(c.astype(jnp.int32), "x", BACKWARD),
                                    jax.ShapeDtypeStruct(c.shape, jnp.float32), "x", BACKWARD)
            return c + 1 + 0 * (got + bad), None
        return jax.lax.scan(step, v, None, length=3)[0]

    x = sharded(mesh, n)
    refused = jax_cpu_mpi.stats()["refused_channels"]
    with pytest.raises(Exception, match=r"expected float32\[4\].*sent int32\[4\]"):
        jax.block_until_ready(spmd(body, mesh)(x))
    with pytest.raises(Exception, match=r"FAILED_PRECONDITION: .* refused: an earlier call"):
        jax.block_until_ready(spmd(lambda v: hop(v, BACKWARD), mesh)(x * 100))
    # The one channel into device 0 (stats() counts it).
    assert jax_cpu_mpi.stats()["refused_channels"] == refused + 1


def test_a_call_that_failed_before_its_psend_refuses_the_next_psend(short_recv_timeout):
    """Device 0 fails (a mismatch) before its psend to device 1 runs. Over MPI the receiver's
    precv of that call may still wait in its process when the caller calls again, and would
    take the next call's message as the failed call's own
    (tests/mpi_programs/stale_after_failure.py): so the failed op marks the channel 0 -> 1
    for psends, and the next call's psend there is refused, naming the failure. (Here the
    receiver's precv times out within the failed call; the fixture then forgets the marks:
    no message was left behind.)"""
    mesh = make_mesh((2, "x"))

    def failing(v):
        bad = jax_cpu_mpi.precv(jax_cpu_mpi.psend(v.astype(jnp.int32), "x", BACKWARD),
                                jax.ShapeDtypeStruct(v.shape, jnp.float32), "x", BACKWARD)
        never = bad[0] == bad[0] + 1  # false, but XLA cannot know it: the psend comes after
        return hop(jnp.where(never, v + 1, v), FORWARD)

    x = sharded(mesh, 4)
    marked = jax_cpu_mpi.stats()["refused_send_channels"]
    with pytest.raises(jax.errors.JaxRuntimeError):
        jax.block_until_ready(spmd(failing, mesh)(x))
    assert jax_cpu_mpi.stats()["refused_send_channels"] == marked + 1
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"FAILED_PRECONDITION: psend\(axis_name=\('x',\), perm=\[\(0, 1\)\]\) "
                       r"of float32\[4\] from partition 0 .* refused: an earlier call of a "
                       r"program that sends on this channel \(device \d+ -> device \d+\) failed "
                       r"on this device \(precv.*expected float32\[4\].*restart the job"):
        jax.block_until_ready(spmd(lambda v: hop(v, FORWARD), mesh)(x * 100))
