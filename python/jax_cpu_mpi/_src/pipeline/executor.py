"""Run a schedule inside ``shard_map``: one ``lax.scan`` over its ticks.

Each tick, every stage reads its action from the plan (:mod:`.plan`) by its index on the
stage axis, computes it in a ``lax.switch`` (a forward, a backward recomputing the forward
under ``jax.vjp``, or idling) and writes its buffer into its stash; then the stages that have
a message in this tick send it from their stash with ``jax_cpu_mpi.psend``/``precv`` (a
second ``lax.switch``, over the plan's distinct sets of a tick's messages) and store what
they receive in their stash slots. The plan picks the tick of each message between the one
that makes it and the one that needs it. By default only the stage inputs (and
cotangents) are stashed: the backward recomputes the stage's forward. With ``remat=False``
the forward keeps its residuals (:mod:`.residuals`) in slots of their own until the
backward, which starts from them. Each tick starts with a mark (:mod:`..ops.marks`), and
the step ends with one: while tracing, the timeline gets every tick's span and action.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_cpu_mpi._src.ops import marks
from jax_cpu_mpi._src.ops.p2p import precv, precv_unread_off_destinations, psend
from jax_cpu_mpi._src.ops.packed import pmean_packed, psum_packed
from jax_cpu_mpi._src.ops.uninitialized import uninitialized
from jax_cpu_mpi._src.ops.vma import vary, vma_of
from jax_cpu_mpi._src.pipeline import plan as plan_mod
from jax_cpu_mpi._src.pipeline import residuals
from jax_cpu_mpi._src.pipeline.per_chunk import PerChunkStages
from jax_cpu_mpi._src.pipeline.schedules import Schedule

__all__ = ["PipelineError", "microbatch_key", "value_and_grad"]

PyTree = Any


class PipelineError(ValueError):
    """A pipeline that cannot run as called: shapes, sizes or axes that do not fit."""


def _leaves_shapes(tree: PyTree) -> str:
    return str(jax.tree.map(lambda a: f"{jnp.dtype(a.dtype).name}{list(a.shape)}", tree))


def _axis_size(name: Hashable, what: str) -> int:
    try:
        return int(jax.lax.axis_size(name))
    except NameError:
        raise PipelineError(
            f"jax_cpu_mpi.pipeline.value_and_grad: {what} {name!r} is not bound; call it inside "
            f"jax.shard_map over a mesh with that axis (or use "
            f"jax_cpu_mpi.pipeline.shard_value_and_grad, which builds the shard_map)") from None


def _leading(tree: PyTree, what: str) -> int:
    sizes = {a.shape[0] if a.ndim else None for a in jax.tree.leaves(tree)}
    if len(sizes) != 1 or None in sizes:
        raise PipelineError(f"jax_cpu_mpi.pipeline.value_and_grad: every leaf of {what} needs "
                            f"the same leading (microbatch) axis; got {_leaves_shapes(tree)}")
    return sizes.pop()


def _chunk_params(params: PyTree, V: int, P: int) -> PyTree:
    """This stage's parameters as ``[V, ...]`` leaves, from the shard_map block."""
    def one(a: Any) -> Any:
        want = (1,) if V == 1 else (1, V)
        if a.shape[:len(want)] != want:
            layout = "[P, ...] sharded over the stage axis" if V == 1 else \
                "[P, V, ...] (stage s, virtual stage v: model chunk v * P + s)"
            raise PipelineError(
                f"jax_cpu_mpi.pipeline.value_and_grad: a parameter block of shape "
                f"{list(a.shape)} does not fit {P} stages x {V} virtual stage(s): inside "
                f"shard_map each leaf must start with {list(want)} (stacked {layout}); "
                f"P x V = {P * V} chunks")
        return a.reshape(a.shape[1:]) if V > 1 else a
    return jax.tree.map(one, params)


def value_and_grad(
    stage_fn: Callable[[PyTree, PyTree], PyTree],
    params: PyTree,
    loss_fn: Callable[[PyTree, PyTree], jax.Array],
    microbatches: PyTree,
    targets: PyTree,
    schedule: Schedule,
    *,
    axis_name: Hashable = "stage",
    data_axis_name: Hashable | None = None,
    return_outputs: bool = False,
    return_input_grads: bool = False,
    remat: bool = True,
    key: jax.Array | None = None,
    loss_params: PyTree | None = None,
) -> tuple[Any, ...]:
    """Mean loss and parameter gradients of a pipelined model; call inside ``jax.shard_map``.

    The model is ``C = P * V`` chunks applied in order, chunk ``c = v * P + s`` being
    ``stage_fn(params[s, v], .)`` on stage ``s`` of the mesh axis ``axis_name`` (size
    ``P``); ``loss_fn`` scores the last chunk's output of each microbatch. The result equals
    ``jax.value_and_grad`` of ``mean_m loss_fn(model(microbatches[m]), targets[m])``
    (:func:`reference_value_and_grad`), computed by ``schedule`` with ``jax_cpu_mpi.psend``
    / ``precv`` between neighbouring stages.

    Args:
      stage_fn: ``stage_fn(chunk_params, x) -> y``, traceable; ``x`` one microbatch's
        activations (a pytree). Where there are several chunks, ``y`` must be shaped like
        ``x`` (it is the next chunk's input).
      params: this device's block of the stacked stage parameters: leaves ``[1, ...]``
        (``P(axis_name)`` of leaves ``[P, ...]``), or ``[1, V, ...]`` for ``V`` virtual stages.
      loss_fn: ``loss_fn(y, target) -> scalar`` for one microbatch.
      microbatches: a pytree of ``[M, ...]`` leaves, the same on every stage (stage 0 reads it).
      targets: a pytree of ``[M, ...]`` leaves (the last stage reads it).
      schedule: a :class:`Schedule`; its stages and microbatches, where ``None``, are set here.
      axis_name: the stage axis.
      data_axis_name: a data-parallel mesh axis (or ``None``): each data shard runs the
        pipeline on its part of every microbatch; loss and gradients are averaged over it.
      return_outputs: also return the last chunk's outputs, ``[M, ...]`` leaves, on every stage.
      return_input_grads: also return the gradient of the loss with respect to
        ``microbatches`` (shaped like them, on every stage): for layers that run before the
        pipeline, an embedding say. The first chunk's backward then forms its input's
        cotangent too, as every other chunk's does. With ``data_axis_name`` it is this data
        shard's part, of the loss averaged over the data axis.
      remat: recompute each chunk's forward in its backward (the default: only the
        chunk's input is stashed per microbatch). ``False`` keeps the forward's residuals
        (what ``jax.vjp`` saves, less what the parameters alone give) until the backward
        instead: a forward's work less per backward, for their memory. With a split
        backward (``ZeroBubble``) the weight part then reuses the input part's work.
      key: a PRNG key (``jax.random.key`` or ``PRNGKey``, the same on every device) for a
        stage function that draws random numbers (dropout): it is then called as
        ``stage_fn(chunk_params, x, chunk_key)`` with
        ``chunk_key = microbatch_key(key, m, c, d)`` for microbatch ``m``, chunk ``c`` and,
        with ``data_axis_name``, data shard ``d`` (else ``None``): the keys
        :func:`reference_value_and_grad` gives the same model on one device. A backward
        that recomputes a forward draws the same numbers again.
      loss_params: parameters of the loss (a language model's head, say: the same on every
        device), or ``None``. ``loss_fn`` is then ``loss_fn(loss_params, y, target)``, run on
        the last chunk's stage, and their gradient comes back after ``grads``.

    Returns:
      ``(loss, grads)``, then ``loss_param_grads`` if ``loss_params`` are given (shaped like
      them, on every stage), ``outputs`` if asked for, then ``input_grads`` if asked for:
      the mean loss (float32 scalar, the same on every stage), and gradients shaped like
      ``params`` (this stage's block).

    Raises:
      PipelineError: the axis is not bound, or its size does not fit the parameters or the
        schedule, or a stage's output does not fit the next stage's input.
      ScheduleError: the schedule cannot run these sizes.
    """
    P = _axis_size(axis_name, "the stage axis")
    if data_axis_name is not None:
        _axis_size(data_axis_name, "the data axis")
    M = _leading(microbatches, "microbatches")
    if _leading(targets, "targets") != M:
        raise PipelineError(f"jax_cpu_mpi.pipeline.value_and_grad: {M} microbatches but "
                            f"targets of shapes {_leaves_shapes(targets)}: their leading axes "
                            f"must be the microbatches")
    if not isinstance(schedule, Schedule):
        raise TypeError(f"jax_cpu_mpi.pipeline.value_and_grad: schedule must be a "
                        f"jax_cpu_mpi.pipeline.Schedule (GPipe(), OneFOneB(), ...), got "
                        f"{schedule!r}")
    if schedule.stages is not None and schedule.stages != P:
        raise PipelineError(
            f"jax_cpu_mpi.pipeline.value_and_grad: {schedule._title()} was built for "
            f"stages={schedule.stages}, but the stage axis {axis_name!r} has size {P}; "
            f"P = the axis size (the parameters are stacked over it)")
    schedule = schedule.bind(P, M)
    V = schedule.virtual_stages
    chunk_params = _chunk_params(params, V, P)
    if return_input_grads:
        _check_differentiable(microbatches)
    plan = plan_mod.make_plan(schedule, return_input_grads, remat)  # builds, validates the table
    return _run(stage_fn, chunk_params, loss_fn, microbatches, targets, plan, axis_name,
                data_axis_name, return_outputs, params, key, loss_params)


def microbatch_key(key: jax.Array, microbatch: Any, chunk: Any,
                   data_shard: Any | None = None) -> jax.Array:
    """The key a keyed stage function gets for one microbatch, chunk and data shard.

    ``fold_in(fold_in(key, microbatch), chunk)``, folded with ``data_shard`` too where it is
    not ``None``: a different stream for every (microbatch, chunk, shard), the same wherever
    it is computed (a pipeline stage, :func:`reference_value_and_grad`)."""
    k = jax.random.fold_in(jax.random.fold_in(key, microbatch), chunk)
    return k if data_shard is None else jax.random.fold_in(k, data_shard)


def _check_differentiable(microbatches: PyTree) -> None:
    if not all(jnp.issubdtype(a.dtype, jnp.inexact) for a in jax.tree.leaves(microbatches)):
        raise PipelineError(
            f"jax_cpu_mpi.pipeline.value_and_grad: return_input_grads=True needs floating "
            f"microbatches (their gradient), but they are {_leaves_shapes(microbatches)}; "
            f"integer inputs (token ids, say) have none: look them up in an embedding "
            f"before the pipeline and pass the embedded microbatches")


def _check_stage_shapes(stage_fn: Callable, chunk: PyTree, x: PyTree, C: int,
                        key: jax.Array | None = None) -> PyTree:
    if isinstance(stage_fn, PerChunkStages):  # every chunk's own function must fit
        y = x
        for c, f in enumerate(stage_fn.functions):
            y = _check_stage_shapes(f, stage_fn.chunk(c, chunk), x, C, key)
        return y
    try:
        y = jax.eval_shape(stage_fn, chunk, x) if key is None else \
            jax.eval_shape(stage_fn, chunk, x, key)
    except Exception as e:  # a shape error inside the user's stage: say where it happened
        raise PipelineError(
            f"jax_cpu_mpi.pipeline.value_and_grad: stage_fn(params of one chunk, one "
            f"microbatch) fails for parameters {_leaves_shapes(chunk)} and a microbatch "
            f"{_leaves_shapes(x)}: {type(e).__name__}: {e}") from e
    if C > 1:
        same = jax.tree.structure(y) == jax.tree.structure(x) and all(
            a.shape == b.shape and a.dtype == b.dtype
            for a, b in zip(jax.tree.leaves(y), jax.tree.leaves(x), strict=True))
        if not same:
            raise PipelineError(
                f"jax_cpu_mpi.pipeline.value_and_grad: a stage's output does not fit the next "
                f"stage's input: stage_fn maps a microbatch {_leaves_shapes(x)} to "
                f"{_leaves_shapes(y)}, and with {C} chunks every output is the next chunk's "
                f"input (same pytree, shapes and dtypes)")
    return y


def _to_bytes(tree: PyTree) -> jax.Array:
    """Every leaf's bytes, concatenated: one ``uint8`` vector (lossless for any dtype)."""
    def one(a: Any) -> jax.Array:
        if a.dtype == jnp.bool_:
            a = a.astype(jnp.uint8)
        return jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(-1)
    return jnp.concatenate([one(a) for a in jax.tree.leaves(tree)])


def _from_bytes(data: jax.Array, like: PyTree) -> PyTree:
    """The inverse of :func:`_to_bytes`: leaves shaped like those of ``like``."""
    leaves, start = [], 0
    for a in jax.tree.leaves(like):
        dtype = jnp.uint8 if a.dtype == jnp.bool_ else a.dtype
        size = int(np.prod(a.shape, dtype=np.int64)) * jnp.dtype(dtype).itemsize
        part = data[start:start + size]
        start += size
        item = jnp.dtype(dtype).itemsize
        shape = tuple(a.shape) + ((item,) if item > 1 else ())
        leaf = jax.lax.bitcast_convert_type(part.reshape(shape), dtype)
        leaves.append(leaf.astype(a.dtype) if a.dtype == jnp.bool_ else leaf)
    return jax.tree.unflatten(jax.tree.structure(like), leaves)


def _exchange(buffer: PyTree, axis: Hashable, pairs: Any, unread: bool = False) -> PyTree:
    """One op's messages: ``buffer`` along ``pairs`` as a single message per device pair;
    with ``unread``, what a device that is no destination gets is left unwritten (it goes
    where nothing reads it: :func:`.ops.p2p.precv_unread_off_destinations`).

    A pytree sent leaf by leaf would be several psends on the same (source, destination)
    channel, matched in the order they run; nothing orders independent psends (or precvs)
    of one tick against each other, so leaves of the same shape and dtype (``{"h", "skip"}``)
    can arrive swapped, silently. One vector per op leaves nothing to match up.

    The vector is the leaves themselves where they share a dtype (a single leaf is sent as
    it is), and their bytes otherwise: XLA CPU turns bytes back into wider types with
    shifts, a pass over the buffer per op and tick."""
    leaves = jax.tree.leaves(buffer)
    if len({a.dtype for a in leaves}) == 1 and leaves[0].dtype != jnp.bool_:
        data = jnp.concatenate([a.reshape(-1) for a in leaves])
        unpack = _split
    else:
        data, unpack = _to_bytes(buffer), _from_bytes
    token = psend(data, axis, pairs)
    receive = precv_unread_off_destinations if unread else precv
    return unpack(receive(token, jax.ShapeDtypeStruct(data.shape, data.dtype), axis, pairs),
                  buffer)


def _split(data: jax.Array, like: PyTree) -> PyTree:
    """The inverse of concatenating ``like``'s raveled leaves (all of one dtype)."""
    leaves, start = [], 0
    for a in jax.tree.leaves(like):
        size = int(np.prod(a.shape, dtype=np.int64))
        leaves.append(data[start:start + size].reshape(a.shape))
        start += size
    return jax.tree.unflatten(jax.tree.structure(like), leaves)


# Columns of the tick table that ``_run`` builds from the plan: the plan's action columns,
# then per entry of the tick's messages the slot each stage sends from, then the slot what
# the entry brings goes into.
(_BRANCH, _MICROBATCH, _VIRTUAL, _FIRST, _X_SLOT, _G_SLOT, _OUT_SLOT, _KEPT_SLOT) = (
    plan_mod.COLUMNS.index(name)
    for name in ("branch", "microbatch", "virtual", "first", "x_slot", "g_slot", "out_slot",
                 "kept_slot"))
_SENDS_AT = len(plan_mod.COLUMNS)


def tick_labels(plan: plan_mod.Plan) -> np.ndarray:
    """``[ticks, P, 4]`` int32: what each tick's mark says of each stage (.ops.marks): the
    tick, the action (idle where the executor computes nothing), its microbatch and virtual
    stage (-1 where idle)."""
    kinds = {"F": marks.FORWARD, "B": marks.BACKWARD, "W": marks.WEIGHT}
    T, P = plan.actions.shape[:2]
    labels = np.full((T, P, 4), -1, np.int32)
    labels[..., 0] = np.arange(T)[:, None]
    labels[..., 1] = marks.IDLE
    for t, row in enumerate(plan.schedule.table):
        for s, a in enumerate(row):
            if a is not None and plan.actions[t, s, _BRANCH] != plan_mod.IDLE:
                labels[t, s, 1:] = (kinds[a.kind], a.microbatch, a.virtual_stage)
    return labels


def _accumulator_dtype(dtype: Any) -> Any:
    return jnp.promote_types(dtype, jnp.float32) if jnp.issubdtype(dtype, jnp.inexact) \
        else dtype


def _run(stage_fn: Callable[[PyTree, PyTree], PyTree], chunk_params: PyTree,
         loss_fn: Callable[[PyTree, PyTree], jax.Array], xs: PyTree, ys: PyTree,
         plan: plan_mod.Plan, axis: Hashable, data_axis: Hashable | None,
         return_outputs: bool, params: PyTree, key: jax.Array | None,
         loss_params: PyTree | None) -> Any:
    """The scan over the plan's ticks (module docstring); ``chunk_params`` are this stage's
    ``[V, ...]`` leaves, ``params`` the caller's block (the gradients take its shapes)."""
    schedule = plan.schedule
    P, M, V = schedule.stages, schedule.microbatches, schedule.virtual_stages
    C = P * V
    s = jax.lax.axis_index(axis)
    if isinstance(stage_fn, PerChunkStages):
        chunk_apply = stage_fn.apply
    else:
        def chunk_apply(p: PyTree, x: PyTree, c: Any, *k: jax.Array) -> PyTree:
            return stage_fn(p, x, *k)
    if key is None:
        apply = chunk_apply
    else:
        # A keyed chunk's index argument carries the microbatch too (m * C + c): the
        # backward and the residuals' recomputation (.residuals, which forms again what
        # depends on the parameters and the index only) then draw the forward's numbers.
        shard = None if data_axis is None else jax.lax.axis_index(data_axis)

        def apply(p: PyTree, x: PyTree, mc: Any) -> PyTree:
            c = mc % C
            return chunk_apply(p, x, c, microbatch_key(key, mc // C, c, shard))
    varying = vma_of(s) | frozenset().union(*map(vma_of, jax.tree.leaves((xs, chunk_params))))
    # Parameters typed as the data shards' own copies: otherwise the vjp of each tick would
    # sum their cotangents over the data axis (the transpose of the implicit broadcast), a
    # collective per tick; the data mean is taken once, after the scan. The microbatches
    # typed alike: a stage that scans over its layers with the activation as the carry
    # needs the carry's type to stay what the layers (varying parameters) make of it.
    chunk_params = vary(chunk_params, varying)
    xs = vary(xs, varying)
    chunk0 = jax.tree.map(lambda a: a[0], chunk_params)
    x0 = jax.tree.map(lambda a: a[0], xs)
    y_shape = _check_stage_shapes(stage_fn, chunk0, x0, C, key)
    buffer_shape = y_shape  # what a tick sends: an activation or a cotangent (same shape)

    def zeros(shape_tree: PyTree, lead: tuple[int, ...] = ()) -> PyTree:
        return vary(jax.tree.map(lambda a: jnp.zeros(lead + a.shape, a.dtype), shape_tree),
                    varying)

    def pick(tree: PyTree, i: Any) -> PyTree:
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)

    def put(tree: PyTree, i: Any, value: PyTree) -> PyTree:
        return jax.tree.map(
            lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, i, 0), tree, value)

    acc_dtypes = jax.tree.map(lambda a: _accumulator_dtype(a.dtype), chunk_params)
    if loss_params is not None:
        loss_params = vary(loss_params, varying)
        loss_acc = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, _accumulator_dtype(a.dtype)), loss_params)
        cast_loss = lambda tree: jax.tree.map(  # noqa: E731
            lambda a, d: a.astype(d.dtype), tree, loss_acc)
    cast = lambda tree: jax.tree.map(lambda a, d: a.astype(d), tree, acc_dtypes)  # noqa: E731
    no_buffer = lambda: zeros(buffer_shape)  # noqa: E731

    def params_of(v: Any) -> PyTree:
        # One chunk per stage: its parameters are the block itself, no dynamic slice (which
        # XLA would copy every tick).
        if V == 1:
            return jax.tree.map(lambda a: a.reshape(a.shape[1:]), chunk_params)
        return pick(chunk_params, v)

    def add_grads(grads: PyTree, v: Any, dp: PyTree) -> PyTree:
        if V == 1:
            return jax.tree.map(lambda a, d: a + d.reshape(a.shape), grads, dp)
        return jax.tree.map(
            lambda a, d: jax.lax.dynamic_update_index_in_dim(
                a, jax.lax.dynamic_index_in_dim(a, v, keepdims=False) + d, v, 0), grads, dp)

    # The tick's action, in two levels: a lax.cond on whether it forms a parameter
    # cotangent, then a lax.switch among the branches of that kind. The gradient
    # accumulators go through the first level only: XLA copies a buffer that a conditional
    # branch passes through unchanged once it has two or more such branches (a parameter-sized
    # copy every idle and forward tick), not when one branch passes it and the other adds.
    # The branches: (stash, loss, cell) -> (buffer, loss, kept), and those forming a
    # parameter cotangent return it too. ``kept`` is what goes into the per-microbatch results
    # (outputs, input cotangents), written after the switch: passed through every branch,
    # those [M, ...] arrays would be copied whole every tick.
    def kept_rows(m=None, y=None, dx=None, dl=None):
        """``(row, value)`` per result asked for; row M, a scratch row, where the action
        leaves nothing."""
        out = ()
        if return_outputs:
            out += ((jnp.int32(M), zeros(y_shape)) if y is None else (m, y),)
        if plan.input_grads:
            out += ((jnp.int32(M), zeros(x0)) if dx is None else (m, dx),)
        if loss_params is not None:  # each microbatch's gradient of the loss's parameters
            out += ((jnp.int32(M), zeros(loss_acc)) if dl is None else (m, cast_loss(dl)),)
        return out

    def inputs(stash, cell):
        m, v, first, x_slot = cell[_MICROBATCH], cell[_VIRTUAL], cell[_FIRST], cell[_X_SLOT]
        x_in = pick(xs, m)
        x = x_in if C == 1 else jax.tree.map(
            lambda a, b: jnp.where(first == 1, a, b), x_in, pick(stash, x_slot))
        return params_of(v), x, v * P + s + (0 if key is None else m * C)

    # With remat=False the forward's residuals (and, for a split backward, what its input
    # part hands to its weight part, ``mid``) are kept per (microbatch, chunk) in ``kept``:
    # one stack of slots per leaf.
    vjp = None if plan.remat else residuals.chunk_vjp(
        apply, params_of(jnp.int32(0)), vary(x0, varying), s)
    n_res = 0 if vjp is None else len(vjp.kept)

    def kept_at(kept, cell):
        """The cell's slot: (residuals, mid)."""
        leaves = pick(list(kept), cell[_KEPT_SLOT])
        return leaves[:n_res], leaves[n_res:]

    def keep(kept, cell, values, start):
        """``kept`` with ``values`` in leaves ``start, start + 1, ...`` of the cell's slot."""
        end = start + len(values)
        return (*kept[:start], *put(kept[start:end], cell[_KEPT_SLOT], tuple(values)),
                *kept[end:])

    # The branches: (stash, kept, loss, cell) -> (buffer, loss, rows, extra): ``extra`` is
    # what the action writes into the state: the parameter cotangent for those that form
    # one; with remat=False, the residuals to keep for forwards, the ``mid`` leaves for a
    # split backward's input part; else nothing.
    def idle(stash, kept, loss, cell):
        return no_buffer(), loss, kept_rows(), []

    def run_forward(stash, cell):
        p, x, c = inputs(stash, cell)
        return (apply(p, x, c), []) if vjp is None else vjp.forward(p, x, c)

    def forward(stash, kept, loss, cell):
        y, res = run_forward(stash, cell)
        return y, loss, kept_rows(), res

    def forward_last(stash, kept, loss, cell):
        y, res = run_forward(stash, cell)
        target = pick(ys, cell[_MICROBATCH])
        if loss_params is None:
            step_loss, dy = jax.value_and_grad(lambda y: loss_fn(y, target))(y)
            rows = kept_rows(cell[_MICROBATCH], y=y)
        else:
            step_loss, (dy, dl) = jax.value_and_grad(
                lambda y, lp: loss_fn(lp, y, target), argnums=(0, 1))(y, loss_params)
            rows = kept_rows(cell[_MICROBATCH], y=y, dl=dl)
        return dy, loss + step_loss.astype(jnp.float32), rows, res

    def cotangent(stash, cell):
        return pick(stash, cell[_G_SLOT])

    def backward_input(stash, kept, loss, cell):
        p, x, c = inputs(stash, cell)
        if vjp is None:
            _, f_vjp = jax.vjp(lambda x: apply(p, x, c), x)
            (dx,) = f_vjp(cotangent(stash, cell))
            return dx, loss, kept_rows(), []
        dx, mid = vjp.input_part(p, c, kept_at(kept, cell)[0], cotangent(stash, cell))
        return dx, loss, kept_rows(), mid

    # The first chunk's input cotangent, where asked for, stays on stage 0 (a result).
    def backward_input_first(stash, kept, loss, cell):
        dx, loss, _, mid = backward_input(stash, kept, loss, cell)
        return no_buffer(), loss, kept_rows(cell[_MICROBATCH], dx=dx), mid

    def backward(stash, kept, loss, cell):
        p, x, c = inputs(stash, cell)
        if vjp is None:
            _, f_vjp = jax.vjp(lambda p, x: apply(p, x, c), p, x)
            dp, dx = f_vjp(cotangent(stash, cell))
        else:
            dp, dx = vjp.backward(p, c, kept_at(kept, cell)[0], cotangent(stash, cell))
        return dx, loss, kept_rows(), cast(dp)

    def weight(stash, kept, loss, cell):
        p, x, c = inputs(stash, cell)
        if vjp is None:
            _, f_vjp = jax.vjp(lambda p: apply(p, x, c), p)
            (dp,) = f_vjp(cotangent(stash, cell))
        else:
            res, mid = kept_at(kept, cell)
            dp = vjp.weight_part(p, c, res, cotangent(stash, cell), mid)
        return no_buffer(), loss, kept_rows(), cast(dp)

    def backward_first(stash, kept, loss, cell):
        if vjp is None:
            return weight(stash, kept, loss, cell)
        _, loss, rows, dp = backward(stash, kept, loss, cell)
        return no_buffer(), loss, rows, dp

    def backward_first_with_input(stash, kept, loss, cell):
        dx, loss, _, dp = backward(stash, kept, loss, cell)
        return no_buffer(), loss, kept_rows(cell[_MICROBATCH], dx=dx), dp

    functions = {plan_mod.BACKWARD: backward,
                 plan_mod.BACKWARD_FIRST: backward_first,  # its input needs no cotangent
                 plan_mod.WEIGHT: weight,
                 plan_mod.BACKWARD_FIRST_WITH_INPUT: backward_first_with_input,
                 plan_mod.IDLE: idle, plan_mod.FORWARD: forward,
                 plan_mod.FORWARD_LAST: forward_last,
                 plan_mod.BACKWARD_INPUT: backward_input,
                 plan_mod.BACKWARD_INPUT_FIRST: backward_input_first}

    # The branches in groups by what they write, each group one lax.switch whose write is
    # done after it: those forming a parameter cotangent (into the gradient accumulators);
    # with remat=False, the forwards (their residuals into ``kept``) and a split backward's
    # input parts (their ``mid`` into ``kept``); the rest write nothing. XLA copies a buffer
    # that a conditional passes through unchanged in two or more branches, nested
    # conditionals included (all the gradients, or all of ``kept``, every tick); not one
    # that one branch updates and the other passes through. So each written buffer goes
    # through exactly one two-way lax.cond: with remat, one cond (forming, or the others'
    # switch); without, one cond per written group, run one after the other, each passing
    # its buffer through where the tick's action is not of its group. The conds that write
    # ``kept`` come first: a cond that reads ``kept`` (the backward's) before another updates
    # it in place made XLA copy it (checked in the compiled HLO; a test asserts no copy).
    used = {int(b) for b in np.unique(plan.actions[..., _BRANCH])} | {plan_mod.IDLE}
    forming = sorted(used & {plan_mod.BACKWARD, plan_mod.BACKWARD_FIRST, plan_mod.WEIGHT,
                             plan_mod.BACKWARD_FIRST_WITH_INPUT})
    if vjp is None:
        groups = [(forming, "grads"), (sorted(used - set(forming)), None)]
    else:
        forwards = sorted(used & {plan_mod.FORWARD, plan_mod.FORWARD_LAST})
        input_parts = sorted(used & {plan_mod.BACKWARD_INPUT, plan_mod.BACKWARD_INPUT_FIRST})
        groups = [(forwards, 0), (input_parts, n_res), (forming, "grads"),
                  ([plan_mod.IDLE], None)]
        groups = [g for g in groups if g[0]]
    offsets = np.cumsum([0, *(len(kinds) for kinds, _ in groups)])
    index_of = np.zeros(plan_mod.BRANCHES, np.int32)
    for (kinds, _), offset in zip(groups, offsets, strict=False):
        index_of[kinds] = offset + np.arange(len(kinds))
    # Every branch must return the same types (vma included): mark them varying alike.
    live = [[lambda *a, f=functions[b]: vary(f(*a), varying) for b in kinds]
            for kinds, _ in groups]

    def run_group(g: int, stash, kept, grads, loss, cell):
        """Group ``g``'s action: (buffer, what it writes (grads or kept), loss, rows)."""
        buffer, loss, rows, extra = jax.lax.switch(cell[_BRANCH] - int(offsets[g]), live[g],
                                                   stash, kept, loss, cell)
        target = groups[g][1]
        written = add_grads(grads, cell[_VIRTUAL], extra) if target == "grads" \
            else keep(kept, cell, extra, target)
        return buffer, written, loss, rows

    def in_group(g: int, cell) -> jax.Array:
        return (cell[_BRANCH] >= int(offsets[g])) & (cell[_BRANCH] < int(offsets[g + 1]))

    def act(stash, kept, grads, loss, cell):
        """The tick's action: (buffer, kept, grads, loss, rows)."""
        if vjp is None:  # every table has a backward (validate_table): no group is empty
            def not_forming(stash, kept, grads, loss, cell):
                buffer, loss, rows, _ = jax.lax.switch(cell[_BRANCH] - int(offsets[1]),
                                                       live[1], stash, kept, loss, cell)
                return buffer, grads, loss, rows

            buffer, grads, loss, rows = jax.lax.cond(
                in_group(0, cell), lambda *a: run_group(0, *a), not_forming,
                stash, kept, grads, loss, cell)
            return buffer, kept, grads, loss, rows
        # Each cond returns only the state its group writes, and the tick's buffer and rows
        # (passed through where the action is not of its group); the rest it only reads.
        buffer, rows = no_buffer(), kept_rows()
        for g, (_, target) in enumerate(groups):
            if target is None:
                continue  # idle: no group ran

            def ran(buffer, rows, stash, kept, grads, loss, cell, g=g):
                return vary(run_group(g, stash, kept, grads, loss, cell), varying)

            def passing(buffer, rows, stash, kept, grads, loss, cell, target=target):
                return vary((buffer, grads if target == "grads" else kept, loss, rows),
                            varying)

            buffer, written, loss, rows = jax.lax.cond(
                in_group(g, cell), ran, passing, buffer, rows, stash, kept, grads, loss, cell)
            if target == "grads":
                grads = written
            else:
                kept = written
        return buffer, kept, grads, loss, rows

    # One stash holds every slot of the plan and a scratch slot (the last) for what goes
    # nowhere, never read: each buffer of a tick is stored with one unconditional write.
    # Where things are is the tick table (one row per tick and stage, read once per tick):
    # the plan's action columns, then per message entry and packed buffer the slot sent
    # from, then the slot written with what arrives.
    T, _, width, depth = plan.sends.shape
    columns = width * depth  # entry e, packed buffer j: column e * depth + j
    receives = plan.receives.reshape(T, P, columns)
    table = np.concatenate([plan.actions, plan.sends.reshape(T, P, columns), receives], -1)
    table[..., _BRANCH] = index_of[table[..., _BRANCH]]
    receives_at = _SENDS_AT + columns
    # Columns no tick receives into are not written at all.
    receiving = [c for c in range(columns) if (receives[..., c] != plan.slots).any()]

    # The tick's messages are one of the few distinct sets the plan's ticks have
    # (plan.messages, with plan.packed): the same on every device in a tick, picked by a
    # second lax.switch. Each set's ops carry only the pairs with a message, so a stage waits
    # only for what it receives, not for its neighbours' ticks; a tick without messages runs
    # no op.
    tick_messages = list(zip(plan.messages, plan.packed, strict=True))
    kinds = list(dict.fromkeys(tick_messages))
    message_kind = np.asarray([kinds.index(m) for m in tick_messages], np.int32)

    # A stage that is no destination of an entry's pairs stores what the entry brings in
    # the scratch slot (or nowhere): no tick reads it, so its precv need not write the
    # zeros that ppermute's semantics give there, a pass over the buffer per tick on the
    # critical path. Checked per set and entry on the table, every tick of the set.
    def unread_off_destinations(k: int, e: int, pairs: Any) -> bool:
        others = sorted(set(range(P)) - {int(d) % P for _, d in pairs})
        ticks = receives[message_kind == k][:, others]
        return all((ticks[..., c] == plan.slots).all()
                   for c in range(e * depth, (e + 1) * depth) if c in receiving)

    # Each set's branch returns what every entry brings (zeros for entries it does not
    # have), not the stash: a conditional's output cannot alias its operand, so passing the
    # stash through would copy all of it every tick. An entry that packs several buffers
    # (two messages of one pair in one tick) sends them as one message.
    def exchange(k: int):
        entries, packed = kinds[k]

        def run(stash, cell):
            got = [no_buffer() for _ in range(columns)]
            for e, ((_, pairs), n) in enumerate(zip(entries, packed, strict=True)):
                values = [pick(stash, cell[_SENDS_AT + e * depth + j]) for j in range(n)]
                received = _exchange(values, axis, pairs,
                                     unread_off_destinations(k, e, pairs))
                for j in range(n):
                    got[e * depth + j] = vary(received[j], varying)
            return got
        return run

    def tick(carry, xs):
        stash, kept, state, results = carry
        row, kind, label = xs
        # The tick's start, in the timeline while tracing: everything of the tick reads the
        # row through the mark, so runs after it (.ops.marks).
        _, row = marks.mark(jax.lax.dynamic_index_in_dim(label, s, keepdims=False), row)
        cell = jax.lax.dynamic_index_in_dim(row, s, keepdims=False)
        buffer, kept, grads, loss, rows = act(stash, kept, *state, cell)
        state = (grads, loss)
        results = tuple(put(r, i, value) for r, (i, value) in zip(results, rows, strict=True))
        # Into the slot its reader on this stage takes it from, or its outbox slot.
        stash = put(stash, cell[_OUT_SLOT], buffer)
        # In the same order on every device (see .plan); each precv's result goes into the
        # stash (the scratch slot where nothing arrives), which later ticks' actions and
        # sends read, so the ticks' messages stay in order.
        got = jax.lax.switch(kind, [exchange(k) for k in range(len(kinds))], stash, cell)
        for c in receiving:
            stash = put(stash, cell[receives_at + c], got[c])
        return (stash, kept, state, results), None

    stash = zeros(buffer_shape, (plan.slots + 1,))
    grads = vary(jax.tree.map(lambda a, d: jnp.zeros(a.shape, d), chunk_params, acc_dtypes),
                  varying)
    # The per-microbatch results asked for, each with a scratch row M (see kept_rows()).
    results = ((zeros(y_shape, (M + 1,)),) if return_outputs else ()) + \
        ((zeros(x0, (M + 1,)),) if plan.input_grads else ()) + \
        ((zeros(loss_acc, (M + 1,)),) if loss_params is not None else ())
    # Every slot is written (a forward's residuals, an input part's mid) before a backward
    # reads it, and a stage uses only some of them: no zeros first (.ops.uninitialized).
    kept = () if vjp is None else tuple(
        vary(uninitialized((plan.kept_slots, *leaf.shape), leaf.dtype, i), varying)
        for i, leaf in enumerate((*vjp.kept, *vjp.mid)))
    carry = (stash, kept, (grads, vary(jnp.zeros((), jnp.float32), varying)), results)
    (_, _, (grads, loss), results), _ = jax.lax.scan(
        tick, carry, (jnp.asarray(table, np.int32), jnp.asarray(message_kind),
                      jnp.asarray(tick_labels(plan))))
    # The last tick's end: the loss, made by the scan, goes through the mark.
    _, loss = marks.mark(jnp.asarray([T, marks.END, -1, -1], jnp.int32), loss)
    results = [jax.tree.map(lambda a: a[:M], r) for r in results]

    # After the scan, so after every message: what only one stage holds (the loss and the
    # outputs on the last chunk's stage, the input cotangents on 0) goes to every stage,
    # then the data shards' mean. Each in as few collectives as the values' types allow
    # (ops.packed): over MPI every leaf's psum would be a meeting of its own.
    last = (C - 1) % P

    def held(stage: int, tree: PyTree) -> PyTree:
        return jax.tree.map(lambda a: jnp.where(s == stage, a, 0), tree)

    dls = jax.tree.map(lambda d: d.sum(0), results.pop(-1)) if loss_params is not None else None
    outputs = results.pop(0) if return_outputs else None
    dins = results.pop(0) if plan.input_grads else None
    loss, dls, outputs, dins = psum_packed(
        (held(last, loss), held(last, dls), held(last, outputs), held(0, dins)), axis)
    loss = loss / M
    grads = jax.tree.map(lambda g, a: (g / M).astype(a.dtype), grads, chunk_params)
    if loss_params is not None:
        dls = jax.tree.map(lambda d, a: (d / M).astype(a.dtype), dls, loss_params)
    if data_axis is not None:
        loss, grads, dls = pmean_packed((loss, grads, dls), data_axis)
    grads = jax.tree.map(lambda g, a: g.reshape(a.shape), grads, params)
    result = [loss, grads]
    if loss_params is not None:
        result.append(dls)
    if return_outputs:
        result.append(outputs)
    if plan.input_grads:
        # Of the mean over microbatches (and data shards): each microbatch's share is 1 / M.
        shards = 1 if data_axis is None else _axis_size(data_axis, "the data axis")
        result.append(jax.tree.map(
            lambda d: (d.astype(_accumulator_dtype(d.dtype)) / (M * shards)).astype(d.dtype),
            dins))
    return tuple(result)
