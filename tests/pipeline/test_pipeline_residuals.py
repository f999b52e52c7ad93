"""remat=False: a chunk's forward keeps its residuals, its backward starts from them, and a
split backward's weight part does not redo its input part's work; the compiled pipeline
keeps them in place (no copy of the kept residuals or of the gradients per tick)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cpu_mpi import pipeline as pl
from jax_cpu_mpi._src.pipeline.plan import make_plan
from jax_cpu_mpi._src.pipeline.residuals import chunk_vjp

LAYERS, WIDTH, BATCH = 3, 16, 4


def three_layers(p, x, c):
    for i in range(LAYERS):
        x = jnp.tanh(x @ p["w"][i] + p["b"][i])
    return x


def problem():
    rng = np.random.default_rng(0)
    p = {"w": jnp.asarray(rng.normal(0, 0.4, (LAYERS, WIDTH, WIDTH)), jnp.float32),
         "b": jnp.asarray(rng.normal(0, 0.1, (LAYERS, WIDTH)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(BATCH, WIDTH)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(BATCH, WIDTH)), jnp.float32)
    return p, x, g


def dots(f, *args) -> int:
    """Matrix products in ``f``'s jaxpr, those in the bodies of its scans included (once
    per body: once per layer of a scanned chunk)."""
    def count(jaxpr) -> int:
        n = 0
        for e in jaxpr.eqns:
            n += e.primitive.name == "dot_general"
            for value in e.params.values():
                inner = getattr(value, "jaxpr", value)
                if hasattr(inner, "eqns"):
                    n += count(inner)
        return n
    return count(jax.make_jaxpr(f)(*args).jaxpr)


def test_the_parts_equal_jax_vjp_and_share_their_work():
    p, x, g = problem()
    c = jnp.int32(0)
    vjp = chunk_vjp(three_layers, p, x, c)
    # Kept per microbatch: activations only. The weight matrices the forward slices out of
    # the stacked parameters are residuals too; they are formed again from p, not stashed
    # once per microbatch.
    assert vjp.kept and all(k.shape == (BATCH, WIDTH) for k in vjp.kept), vjp.kept
    y, kept = vjp.forward(p, x, c)
    want_y, f_vjp = jax.vjp(lambda p, x: three_layers(p, x, 0), p, x)
    want_dp, want_dx = f_vjp(g)
    np.testing.assert_array_equal(y, want_y)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)  # noqa: E731
    dp, dx = vjp.backward(p, c, kept, g)
    jax.tree.map(close, (dp, dx), (want_dp, want_dx))
    dx, mid = vjp.input_part(p, c, kept, g)
    dp = vjp.weight_part(p, c, kept, g, mid)
    jax.tree.map(close, (dp, dx), (want_dp, want_dx))
    # One matmul per layer each: the forward, the input part (dx through every layer), the
    # weight part (dW of every layer from what the input part handed over); the whole
    # backward is both parts' matmuls, no forward.
    assert dots(lambda p, x: vjp.forward(p, x, c), p, x) == LAYERS
    assert dots(lambda p, k, g: vjp.input_part(p, c, k, g), p, kept, g) == LAYERS
    assert dots(lambda p, k, g, m: vjp.weight_part(p, c, k, g, m), p, kept, g, mid) == LAYERS
    assert dots(lambda p, k, g: vjp.backward(p, c, k, g), p, kept, g) == 2 * LAYERS


def scanned(p, x, c):
    return jax.lax.scan(lambda h, wb: (jnp.tanh(h @ wb[0] + wb[1]), None), x,
                        (p["w"], p["b"]))[0]


def test_a_scan_over_layers_is_cut_in_two_scans():
    """A chunk that scans over its layers: the input part runs the backward scan for the
    input's cotangent and stacks what the weight part needs; the weight part runs a scan of
    its own, without the chain (one matrix product per layer each)."""
    p, x, g = problem()
    c = jnp.int32(0)
    vjp = chunk_vjp(scanned, p, x, c)
    assert vjp.mid and all(m.shape[0] == LAYERS for m in vjp.mid), vjp.mid
    _, kept = vjp.forward(p, x, c)
    want_dp, want_dx = jax.vjp(lambda p, x: scanned(p, x, 0), p, x)[1](g)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)  # noqa: E731
    dx, mid = vjp.input_part(p, c, kept, g)
    jax.tree.map(close, (vjp.weight_part(p, c, kept, g, mid), dx), (want_dp, want_dx))
    assert dots(lambda p, k, g: vjp.input_part(p, c, k, g), p, kept, g) == 1
    assert dots(lambda p, k, g, m: vjp.weight_part(p, c, k, g, m), p, kept, g, mid) == 1
    assert dots(lambda p, k, g: vjp.backward(p, c, k, g), p, kept, g) == 2


def gelu_mlp(p, x, c):
    """A product, a tanh-form GELU under a constant causal mask, a product, a tanh."""
    u = x @ p["w1"]
    mask = jnp.tril(jnp.ones(u.shape, bool))
    h = jnp.where(mask, jax.nn.gelu(u, approximate=True), -1e30)
    return jnp.tanh(h @ p["w2"])


def _assert_equals_jax_vjp(vjp, f, p, x, c, g) -> None:
    """``vjp``'s forward, whole backward and split backward give ``jax.vjp``'s values of
    ``f(p, x, c)`` for the cotangent ``g``."""
    y, kept = vjp.forward(p, x, c)
    want_y, f_vjp = jax.vjp(lambda p, x: f(p, x, c), p, x)
    want_dp, want_dx = f_vjp(g)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # noqa: E731
    close(y, want_y)
    jax.tree.map(close, vjp.backward(p, c, kept, g), (want_dp, want_dx))
    dx, mid = vjp.input_part(p, c, kept, g)
    jax.tree.map(close, (vjp.weight_part(p, c, kept, g, mid), dx), (want_dp, want_dx))


def test_what_elementwise_operations_form_again_is_not_kept():
    """jax.vjp saves the GELU's input, its tanh, the tanh's square and products, the mask
    broadcast to the activation's shape and the where's zeros (15 residuals, 9 of them
    per microbatch of the hidden width); kept are the chunk's input, the first product
    and the last tanh: the backward forms the rest again from them, to the same values."""
    rng = np.random.default_rng(1)
    hidden = 4 * WIDTH
    p = {"w1": jnp.asarray(rng.normal(0, 0.3, (WIDTH, hidden)), jnp.float32),
         "w2": jnp.asarray(rng.normal(0, 0.3, (hidden, WIDTH)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(BATCH, WIDTH)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(BATCH, WIDTH)), jnp.float32)
    c = jnp.int32(0)
    vjp = chunk_vjp(gelu_mlp, p, x, c)
    kept = sorted(k.shape for k in vjp.kept)
    if jax.__version_info__ < (0, 12):
        assert kept == [(BATCH, WIDTH), (BATCH, WIDTH), (BATCH, hidden)], vjp.kept
    else:
        # JAX 0.12 traces jnp.where as a jit call; the cut keeps one more array of the
        # hidden width there (the values still equal jax.vjp's, checked below).
        assert kept == [(BATCH, WIDTH), (BATCH, WIDTH), (BATCH, hidden), (BATCH, hidden)], \
            vjp.kept
    _assert_equals_jax_vjp(vjp, gelu_mlp, p, x, c, g)


def _layer_norm(h, scale):
    mu = h.mean(-1, keepdims=True)
    return (h - mu) * jax.lax.rsqrt(((h - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * scale


@jax.custom_vjp
def _clip_gradient(h):
    return h


_clip_gradient.defvjp(lambda h: (h, jnp.abs(h) < 1.0), lambda m, g: (jnp.where(m, g, 0.0),))


def _blocks(p, x, c):
    """A jit of the user's with a causal where, a product and a parameter-only result."""
    @jax.jit
    def block(h, w, s):
        u = h @ w
        mask = jnp.tril(jnp.ones(u.shape, bool))
        return jnp.where(mask, jax.nn.gelu(u), -1e9), jnp.cos(s) * w.sum(), u
    a, k, u = block(x, p["w"][0], p["b"][0])
    return jnp.tanh(a * k) @ p["w"][1] + u


# Stage functions a user writes, each against jax.vjp: data-dependent masks and branches,
# a branch per chunk, a scan over layers, JAX's custom_jvp/custom_vjp activations and our
# own, integer and boolean intermediates, dropout keyed by the chunk index, remat inside
# the stage, a parameter the output does not depend on, jit calls, and the microbatch read
# by a product and by elementwise operations.
USER_STAGES = {
    "where-data-mask": lambda p, x, c: jnp.where(
        (u := x @ p["w"][0]) > 0.1, jnp.tanh(u), 0.3 * u) @ p["w"][1],
    "cond-on-data": lambda p, x, c: jax.lax.cond(
        jnp.sum(x) > 0, lambda h: jnp.tanh(h @ p["w"][0]), lambda h: jnp.sin(h) * p["b"][0], x),
    "switch-on-chunk": lambda p, x, c: jax.lax.switch(
        c, [lambda h: jax.nn.gelu(h @ p["w"][0]), lambda h: jax.nn.relu(h @ p["w"][1]),
            lambda h: h * p["b"][2]], x),
    "scan-norm-relu": lambda p, x, c: jax.lax.scan(
        lambda h, wb: (_layer_norm(h + jax.nn.relu(h @ wb[0]), wb[1]), None), x,
        (p["w"], p["b"]))[0],
    "softmax-norm-gelu": lambda p, x, c: _layer_norm(
        x + jax.nn.gelu(jax.nn.softmax(_layer_norm(x, p["b"][0]) @ p["w"][0]) @ p["w"][1]),
        p["b"][1]),
    "custom-vjp-silu": lambda p, x, c: _clip_gradient(jax.nn.silu(x @ p["w"][0])) @ p["w"][1],
    "ints-and-bools": lambda p, x, c: (
        jax.nn.one_hot(jnp.argmax(u := x @ p["w"][0], -1), WIDTH) * u
        + jnp.where(jnp.round(u * 4).astype(jnp.int32) % 2 == 0, u, -u)),
    "dropout-by-chunk": lambda p, x, c: jnp.where(
        jax.random.bernoulli(jax.random.fold_in(jax.random.key(3), c), 0.5, x.shape),
        jnp.tanh(x @ p["w"][0]) * 2.0, 0.0),
    "checkpoint-inside": lambda p, x, c: jax.checkpoint(
        lambda h: jax.nn.gelu(jnp.tanh(h @ p["w"][0]) @ p["w"][1]))(x),
    "unused-parameter": lambda p, x, c: jnp.tanh(x @ p["w"][0]),
    "jit-blocks": _blocks,
    "x-by-product-and-elementwise": lambda p, x, c: x @ p["w"][0] + jnp.sin(x) * jnp.exp(x),
}


@pytest.mark.parametrize("name", USER_STAGES)
def test_user_stage_functions_equal_jax_vjp(name):
    """The forward, the whole backward and the split one give jax.vjp's values (chunk
    index 1: the switch takes its second branch, the dropout mask its second key)."""
    f = USER_STAGES[name]
    p, x, g = problem()
    c = jnp.int32(1)
    vjp = chunk_vjp(f, p, x, c)
    _assert_equals_jax_vjp(vjp, f, p, x, c, g)
    if name == "jit-blocks":
        # A jit's results that depend on the parameters alone (its where's mask, cos(s) *
        # w.sum()) are formed again from them, not kept per microbatch (they were, with
        # every other residual of the chunk, as no cut at all).
        assert all(k.shape[:1] == (BATCH,) for k in vjp.kept), vjp.kept
    if name == "x-by-product-and-elementwise":
        # The input is kept for the product's dW, and its sine, cosine and exponential are
        # formed again from it (once, it was kept twice over and the cut given up).
        assert [k.shape for k in vjp.kept] == [x.shape], vjp.kept


def test_plan_keeps_each_forward_until_its_last_backward():
    """The kept slots: one per (microbatch, chunk) from its F to its last B or W, reused
    after; as many as the schedule's peak stash."""
    for schedule in (pl.GPipe(), pl.OneFOneB(), pl.Interleaved1F1B(2), pl.ZeroBubble()):
        plan = make_plan(schedule.bind(4, 8), remat=False)
        assert plan.kept_slots == max(schedule.bind(4, 8).peak_stash)
        kept_col = plan.actions[..., -1]
        # No scratch slot: every cell, idle ones too, names one of the kept_slots slots (the
        # executor allocates exactly that many).
        assert ((kept_col >= 0) & (kept_col < plan.kept_slots)).all(), schedule
        table = schedule.bind(4, 8).table
        holder: dict[tuple[int, int], tuple[int, int, int]] = {}
        for t, row in enumerate(table):
            for s, a in enumerate(row):
                if a is None:
                    continue
                key = (s, int(kept_col[t, s]))
                owner = (a.microbatch, a.virtual_stage)
                if a.kind == "F":
                    assert key not in holder, f"{schedule}: slot {key} reused while held"
                    holder[key] = (*owner, 0)
                else:
                    assert holder.get(key, (None, None))[:2] == owner, (schedule, t, s, a)
                    last = "W" if schedule.splits_weight_gradient else "B"
                    if a.kind == last:
                        del holder[key]
        assert not holder


def abstract_args(P: int, V: int, M: int):
    lead = (P, V) if V > 1 else (P,)
    params = {"w": jax.ShapeDtypeStruct((*lead, 2, 32, 32), jnp.float32),
              "b": jax.ShapeDtypeStruct((*lead, 2, 32), jnp.float32)}
    xs = jax.ShapeDtypeStruct((M, 8, 32), jnp.float32)
    return params, xs, xs


def stage(p, x):
    return three_layers({"w": p["w"][:2], "b": p["b"][:2]}, x, 0)


@pytest.mark.parametrize("remat", [True, False], ids=["remat", "kept"])
@pytest.mark.parametrize("schedule", [pl.OneFOneB(), pl.ZeroBubble(), pl.Interleaved1F1B(2)],
                         ids=lambda s: type(s).__name__)
def test_no_tick_copies_a_stash_or_the_gradients(schedule, remat):
    """XLA copies a buffer that a conditional passes through in two or more branches: the
    executor's branches are grouped so that the gradient accumulators and the kept
    residuals never are. Inside the compiled loop, no copy is larger than one activation."""
    P, M = 4, 8
    mesh = jax.make_mesh((P,), ("stage",), devices=jax.devices()[:P])
    f = jax.jit(pl.shard_value_and_grad(stage, lambda y, t: jnp.mean((y - t) ** 2), mesh,
                                        schedule, remat=remat))
    hlo = f.lower(*abstract_args(P, schedule.virtual_stages, M)).compile().as_text()
    activation = 8 * 32
    big, computation = [], ""
    for line in hlo.splitlines():
        if line and not line.startswith(" "):
            computation = line.split(" ")[0]
        m = re.search(r"= [a-z0-9]+\[([0-9,]*)\]\S* copy\(", line)
        if m and computation != "ENTRY" and m.group(1):
            if np.prod([int(d) for d in m.group(1).split(",")]) > activation:
                big.append(f"{computation}: {line.strip()[:120]}")
    assert not big, "\n".join(big)
    if not remat:  # the kept slots start as they are, not as zeros (.ops.uninitialized)
        assert 'custom_call_target="jax_cpu_mpi_uninitialized"' in hlo


def scanned_layers(p, x):
    """The layers of a chunk under lax.scan (stacked weights), the middle one rematerialized
    by jax.checkpoint, and a custom_vjp activation: residuals of every kind JAX makes."""
    @jax.custom_vjp
    def softsign(h):
        return h / (1 + jnp.abs(h))

    def softsign_fwd(h):
        return softsign(h), h

    def softsign_bwd(h, g):
        return (g / (1 + jnp.abs(h)) ** 2,)

    softsign.defvjp(softsign_fwd, softsign_bwd)

    def layer(h, wb):
        w, b = wb
        return jnp.tanh(h @ w + b), None

    x, _ = jax.lax.scan(layer, x, (p["w"], p["b"]))
    x = jax.checkpoint(lambda h: jnp.sin(h @ p["w"][0]))(x)
    return softsign(x)


def _mse(y, t):
    return jnp.mean((y - t) ** 2)


@functools.cache
def _scanned_problem(P: int = 2, M: int = 3):
    """Parameters, microbatches, targets and the reference's loss, gradients and input
    gradients: the same for every schedule and remat, so computed (op by op) once."""
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.normal(0, 0.4, (P, 2, WIDTH, WIDTH)), jnp.float32),
              "b": jnp.asarray(rng.normal(0, 0.1, (P, 2, WIDTH)), jnp.float32)}
    xs = jnp.asarray(rng.normal(size=(M, BATCH, WIDTH)), jnp.float32)
    ys = jnp.asarray(rng.normal(size=(M, BATCH, WIDTH)), jnp.float32)
    want = pl.reference_value_and_grad(scanned_layers, _mse, params, xs, ys,
                                       return_input_grads=True)
    return params, xs, ys, want


@pytest.mark.parametrize("remat", [True, False], ids=["remat", "kept"])
@pytest.mark.parametrize("schedule", [pl.OneFOneB(), pl.ZeroBubble()],
                         ids=lambda s: type(s).__name__)
def test_stages_with_scan_checkpoint_and_custom_vjp(schedule, remat):
    """Such a stage runs (its scan's carry, the activation, typed as varying over the stage
    axis like the layers' parameters make it) and, with remat=False, keeps its residuals."""
    P = 2
    params, xs, ys, (want_loss, want_grads, want_dx) = _scanned_problem(P)
    mesh = jax.make_mesh((P,), ("stage",), devices=jax.devices()[:P])
    got = jax.jit(pl.shard_value_and_grad(scanned_layers, _mse, mesh, schedule,
                                          return_input_grads=True, remat=remat))(params, xs, ys)
    np.testing.assert_allclose(got[0], want_loss, rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(got[2], want_dx, rtol=2e-5, atol=1e-7)


def test_one_chunk_may_change_the_activation_and_its_pytree():
    """With one chunk (P = 1) the output need not be shaped like the input: the kept
    backward takes a cotangent shaped like the output and gives one shaped like the input."""
    rng = np.random.default_rng(2)
    params = {"w": jnp.asarray(rng.normal(0, 0.4, (1, WIDTH, 3)), jnp.float32)}
    xs = {"h": jnp.asarray(rng.normal(size=(4, BATCH, WIDTH)), jnp.float32)}
    ys = jnp.asarray(rng.normal(size=(4, BATCH, 3)), jnp.float32)

    def narrow(p, x):
        return {"out": jnp.tanh(x["h"] @ p["w"]), "aux": jnp.sum(x["h"], -1)}

    def score(y, t):
        return jnp.mean((y["out"] - t) ** 2) + 0.1 * jnp.mean(y["aux"] ** 2)

    mesh = jax.make_mesh((1,), ("stage",), devices=jax.devices()[:1])
    got = jax.jit(pl.shard_value_and_grad(narrow, score, mesh, pl.OneFOneB(),
                                          return_input_grads=True, remat=False))(params, xs, ys)
    want = pl.reference_value_and_grad(narrow, score, params, xs, ys, return_input_grads=True)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-7)


def test_without_dead_code_elimination_the_parts_still_agree(monkeypatch):
    """On a JAX without the name the cut needs (compat), everything is kept and the weight
    part runs the whole backward: the same values, more work."""
    from jax_cpu_mpi._src import compat
    from jax_cpu_mpi._src.compat.registry import Missing

    monkeypatch.setattr(compat, "dce_jaxpr", Missing("dce_jaxpr", "absent for this test"))
    p, x, g = problem()
    c = jnp.int32(0)
    vjp = chunk_vjp(three_layers, p, x, c)
    assert vjp.mid == ()
    _, kept = vjp.forward(p, x, c)
    want_dp, want_dx = jax.vjp(lambda p, x: three_layers(p, x, 0), p, x)[1](g)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)  # noqa: E731
    dx, mid = vjp.input_part(p, c, kept, g)
    jax.tree.map(close, (vjp.weight_part(p, c, kept, g, mid), dx), (want_dp, want_dx))
    jax.tree.map(close, vjp.backward(p, c, kept, g), (want_dp, want_dx))
