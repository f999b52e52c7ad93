"""A chunk's forward that keeps its residuals, and its backward cut into parts (``remat=False``).

With ``remat=True`` (the default) a pipeline stashes each chunk's input and its backward
recomputes the forward under ``jax.vjp``. With ``remat=False`` the forward keeps what the
backward needs (``jax.vjp``'s residuals) and the backward starts from them: a forward's
work less per backward, for the memory of the residuals.

Everything is traced once, as jaxprs, from the chunk function and abstract arguments:

* ``forward(p, x, c) -> (y, kept)``: the output and the residuals that depend on the
  microbatch ``x``. Residuals that depend only on the parameters and the chunk index (a
  weight matrix sliced out of a stacked parameter, say) are not kept per microbatch: the
  backward forms them again from ``p``, which costs a slice, not a forward. Nor are those
  that elementwise operations make from other kept residuals (:func:`_recomputed`): a GELU
  leaves its input, its tanh, the tanh's square and two products, where its input alone
  gives all of them again in the backward's own loops, for less than the memory traffic
  of keeping them (each kept byte is written by the forward and read by the backward, and
  on CPU the slots of many microbatches are fresh pages every step).
* ``backward(p, kept, g) -> (dp, dx)``, and the same with only ``dp`` (the first chunk,
  whose input needs no cotangent).
* ``input_part(p, kept, g) -> (dx, mid)`` and ``weight_part(p, kept, g, mid) -> dp``:
  zero-bubble's split backward. The backward's equations that form ``dx`` run in the input
  part; the weight part runs only those left for ``dp`` and takes what it needs from the
  input part as ``mid`` (for a dense layer, the cotangent at its output), so the two cost
  what one backward does. A scan in the backward (a chunk that scans over its layers) is
  cut the same way into two scans (:func:`_split_scans`). Where this JAX lacks the names the
  cut needs (``compat.PIPELINE_SPLIT_BACKWARD``), ``mid`` is empty and the weight part runs
  the whole backward for ``dp``: the same values, more work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.extend import core as jex

from jax_cpu_mpi._src import compat

__all__ = ["ChunkVjp", "chunk_vjp"]

PyTree = Any


def _jaxpr(like: Any, invars: Sequence[Any], outvars: Sequence[Any], eqns: Sequence[Any]
           ) -> Any:
    """A jaxpr of some of ``like``'s equations (its effects; its debug info without names,
    which no longer match the inputs and outputs)."""
    debug = like.debug_info
    unnamed = getattr(debug, "with_unknown_names", None)
    return jex.Jaxpr([], list(invars), list(outvars), list(eqns), like.effects,
                     unnamed() if unnamed is not None else debug)


def _open(closed: Any) -> tuple[Any, list[Any]]:
    """A closed jaxpr as an open one whose constants come first among its inputs."""
    j = closed.jaxpr
    return _jaxpr(j, [*j.constvars, *j.invars], j.outvars, j.eqns), list(closed.consts)


def _run(jaxpr: Any, args: Sequence[Any]) -> list[Any]:
    return jex.jaxpr_as_fun(jex.ClosedJaxpr(jaxpr, []))(*args)


def _depends_on(jaxpr: Any, inputs: Sequence[bool]) -> list[bool]:
    """Per output of ``jaxpr``: whether it depends on an input marked in ``inputs``."""
    marked = _marked(jaxpr, inputs)
    return [isinstance(v, jex.Var) and id(v) in marked for v in jaxpr.outvars]


def _marked(jaxpr: Any, inputs: Sequence[bool], calls: bool = True) -> set[int]:
    """The variables of ``jaxpr`` that depend on an input marked in ``inputs`` (by
    identity). Conservatively, an equation's outputs depend on all its inputs; but a call's
    (``jit``) each on the inputs its own body makes it depend on: partial evaluation puts
    values that do not depend on the microbatch among a call's residuals (a ``where``'s
    broadcast mask next to its result), and a pass of dead code elimination then forms them
    without the rest of the call. ``calls=False``: every equation conservatively."""
    marked = {id(v) for v, m in zip(jaxpr.invars, inputs, strict=True) if m}
    for eqn in jaxpr.eqns:
        reads = [isinstance(v, jex.Var) and id(v) in marked for v in eqn.invars]
        if not any(reads):
            continue
        inner = _call_body(eqn) if calls else None
        if inner is None or len(inner.invars) != len(reads):
            marked.update(id(v) for v in eqn.outvars)
        else:
            marked.update(id(v) for v, m in zip(eqn.outvars, _depends_on(inner, reads),
                                                strict=True) if m)
    return marked


def _call_body(eqn: Any) -> Any:
    """The open body of a call equation (``jit``), or ``None``."""
    if eqn.primitive.name not in ("pjit", "jit", "closed_call", "core_call"):
        return None
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    inner = getattr(inner, "jaxpr", inner)
    return inner if hasattr(inner, "eqns") else None


def _select(jaxpr: Any, outputs: Sequence[bool]) -> tuple[Any, list[bool]]:
    """``jaxpr`` computing only the chosen outputs, and which of its inputs it still reads
    (dead code removed where this JAX allows; else the whole jaxpr, reading every input)."""
    if compat.available(compat.dce_jaxpr):
        return compat.dce_jaxpr(jaxpr, list(outputs), instantiate=True)
    outvars = [v for v, keep in zip(jaxpr.outvars, outputs, strict=True) if keep]
    return _jaxpr(jaxpr, jaxpr.invars, outvars, jaxpr.eqns), [True] * len(jaxpr.invars)


@dataclass(frozen=True)
class _Part:
    """A jaxpr over some of the named inputs, with constants."""

    jaxpr: Any
    consts: list[Any]
    reads: list[bool]  # per input of the full argument list

    def __call__(self, *args: Any) -> list[Any]:
        return _run(self.jaxpr, [*self.consts, *(a for a, r in zip(args, self.reads,
                                                                   strict=True) if r)])


def _part(jaxpr: Any, consts: list[Any], outputs: Sequence[bool]) -> _Part:
    part, reads = _select(jaxpr, outputs)
    n = len(consts)
    return _Part(part, [c for c, r in zip(consts, reads[:n], strict=True) if r], reads[n:])


@dataclass(frozen=True)
class ChunkVjp:
    """A chunk's forward with kept residuals and its backward in parts (module docstring).

    Pytrees in and out are shaped like the abstract arguments :func:`chunk_vjp` traced:
    ``p`` the chunk's parameters, ``x``/``g`` an activation, ``c`` the chunk index."""

    #: Leaves kept per microbatch from the forward to the backward.
    kept: tuple[jax.ShapeDtypeStruct, ...]
    #: Leaves the input part of a split backward hands to the weight part.
    mid: tuple[jax.ShapeDtypeStruct, ...]
    _forward: _Part
    _again: _Part  # (p, x unread, c, kept) -> the residuals not kept
    _backward: _Part  # (consts, residuals, g) -> (dp, dx)
    _input_part: _Part
    _weight_part: _Part
    _is_kept: tuple[bool, ...]
    _trees: tuple[Any, Any, Any]  # x (and dx), y (and g), dp

    def forward(self, p: PyTree, x: PyTree, c: Any) -> tuple[PyTree, list[jax.Array]]:
        """``(y, kept)``: the chunk's output and the residuals to keep for its backward."""
        out = self._forward(*jax.tree.leaves(p), *jax.tree.leaves(x), c)
        y_tree = self._trees[1]
        return jax.tree.unflatten(y_tree, out[:y_tree.num_leaves]), out[y_tree.num_leaves:]

    def _residuals(self, p: PyTree, c: Any, kept: Sequence[jax.Array]) -> list[Any]:
        """Every residual: the kept ones, and those formed again from ``p``, ``c`` and the
        kept ones (the microbatch's inputs are not read: ``None`` in their places)."""
        if all(self._is_kept):
            return list(kept)
        again = iter(self._again(*jax.tree.leaves(p), *[None] * self._trees[0].num_leaves, c,
                                 *kept))
        kept_ = iter(kept)
        return [next(kept_) if k else next(again) for k in self._is_kept]

    def _grads(self, out: Sequence[Any]) -> tuple[PyTree, PyTree]:
        x_tree, _, dp_tree = self._trees
        n = dp_tree.num_leaves
        return jax.tree.unflatten(dp_tree, out[:n]), jax.tree.unflatten(x_tree, out[n:])

    def backward(self, p: PyTree, c: Any, kept: Sequence[jax.Array], g: PyTree
                 ) -> tuple[PyTree, PyTree]:
        """``(dp, dx)`` from the kept residuals and the output cotangent ``g``."""
        return self._grads(self._backward(*self._residuals(p, c, kept), *jax.tree.leaves(g)))

    def input_part(self, p: PyTree, c: Any, kept: Sequence[jax.Array], g: PyTree
                   ) -> tuple[PyTree, list[jax.Array]]:
        """``(dx, mid)``: the input's cotangent and what the weight part needs of its work."""
        out = self._input_part(*self._residuals(p, c, kept), *jax.tree.leaves(g))
        n = self._trees[0].num_leaves
        return jax.tree.unflatten(self._trees[0], out[:n]), out[n:]

    def weight_part(self, p: PyTree, c: Any, kept: Sequence[jax.Array], g: PyTree,
                    mid: Sequence[jax.Array]) -> PyTree:
        """``dp``, from the residuals, ``g`` and the input part's ``mid``."""
        out = self._weight_part(*self._residuals(p, c, kept), *jax.tree.leaves(g), *mid)
        return jax.tree.unflatten(self._trees[2], out)


def chunk_vjp(apply: Callable[[PyTree, PyTree, Any], PyTree], p: PyTree, x: PyTree,
              c: Any) -> ChunkVjp:
    """Trace ``apply(p, x, c)`` (a chunk: parameters, activation, chunk index) into a
    :class:`ChunkVjp`; ``p``, ``x`` and ``c`` may be tracers or shapes."""
    p_tree, x_tree = jax.tree.structure(p), jax.tree.structure(x)
    trees: list[Any] = []  # of the trace below: the vjp's (residuals) and y's

    def forward(p_leaves, x_leaves, c):
        y, vjp = jax.vjp(lambda p, x: apply(p, x, c), jax.tree.unflatten(p_tree, p_leaves),
                         jax.tree.unflatten(x_tree, x_leaves))
        residuals, tree = jax.tree.flatten(vjp)
        trees[:] = [tree, jax.tree.structure(y)]
        return jax.tree.leaves(y), residuals

    closed, (y_shapes, res_shapes) = jax.make_jaxpr(forward, return_shape=True)(
        jax.tree.leaves(p), jax.tree.leaves(x), c)
    fwd, fwd_consts = _open(closed)
    n_consts, n_p, n_x = len(fwd_consts), p_tree.num_leaves, x_tree.num_leaves
    n_y = len(y_shapes)
    inputs_x = [False] * n_consts + [False] * n_p + [True] * n_x + [False]
    # Without dead-code elimination nothing can be formed again: keep it all.
    if compat.available(compat.dce_jaxpr):
        is_kept = _recomputed(fwd, inputs_x, n_y)
        again = _again(fwd, fwd_consts, n_y, is_kept)
        if not _formed_without_x(again, n_p, n_x):
            # A cut this jaxpr does not allow (a call's result needed without the rest of
            # it, say): keep what depends on the microbatch at all, as before the cuts.
            is_kept = _recomputed(fwd, inputs_x, n_y, cut=False)
            again = _again(fwd, fwd_consts, n_y, is_kept)
    else:
        is_kept = [True] * len(res_shapes)
        again = _again(fwd, fwd_consts, n_y, is_kept)
    forward_part = _part(fwd, fwd_consts, [True] * n_y + is_kept)

    vjp_tree, y_tree = trees
    closed_b, dp_dx = jax.make_jaxpr(
        lambda res, g: jax.tree.unflatten(vjp_tree, res)(jax.tree.unflatten(y_tree, g)),
        return_shape=True)(list(res_shapes), list(y_shapes))
    bwd, bwd_consts = _open(closed_b)
    dp_tree = jax.tree.structure(dp_dx[0])
    n_dp, n_dx = dp_tree.num_leaves, len(bwd.outvars) - dp_tree.num_leaves
    backward = _part(bwd, bwd_consts, [True] * (n_dp + n_dx))
    input_part, weight_part, mid = _cut(bwd, bwd_consts, n_dp, n_dx)
    return ChunkVjp(
        kept=tuple(jax.ShapeDtypeStruct(s.shape, s.dtype)
                   for s, k in zip(res_shapes, is_kept, strict=True) if k),
        mid=mid, _forward=forward_part, _again=again, _backward=backward,
        _input_part=input_part, _weight_part=weight_part, _is_kept=tuple(is_kept),
        _trees=(x_tree, y_tree, dp_tree))


# Primitives whose results cost less to form again in the backward, from values it has,
# than to keep: elementwise ones (XLA CPU fuses them into the loops that read their
# results), shape-only ones, and calls of only those. Not a matrix product, a reduction, a
# random number generator or a control-flow primitive: those cost a pass of their own.
_ELEMENTWISE = frozenset({
    "abs", "add", "and", "broadcast_in_dim", "ceil", "clamp", "convert_element_type",
    "copy", "copy_p", "cos", "div", "eq", "erf", "erf_inv", "exp", "exp2", "expand_dims",
    "expm1", "floor", "ge", "gt", "integer_pow", "is_finite", "le", "log", "log1p",
    "logistic", "lt", "max", "min", "mul", "ne", "neg", "not", "or", "pow", "reshape",
    "round", "rsqrt", "select_n", "shift_left", "shift_right_arithmetic",
    "shift_right_logical", "sign", "sin", "sqrt", "square", "squeeze", "stop_gradient",
    "sub", "tan", "tanh", "xor"})


def _elementwise(eqn: Any) -> bool:
    """Whether ``eqn`` is cheap to form again (``_ELEMENTWISE``, or a call of only such)."""
    if eqn.primitive.name in _ELEMENTWISE:
        return True
    inner = _call_body(eqn)
    return inner is not None and all(_elementwise(e) for e in inner.eqns)


def _recomputed(fwd: Any, inputs_x: Sequence[bool], n_y: int, cut: bool = True
                ) -> list[bool]:
    """Per residual of the forward ``fwd`` (outputs after the ``n_y`` of ``y``): whether to
    keep it. Not those that depend only on the parameters and the chunk index, nor, taken
    in the forward's order, those that elementwise operations (:func:`_elementwise`) form
    from residuals still kept and from values of the parameters and index alone: the
    backward forms both again (:func:`_again`). A value one of whose producer's other
    results is kept is not formed again (the producer would run twice). ``cut=False``:
    only those of the parameters and index, told apart conservatively (:func:`_marked`)."""
    residuals = fwd.outvars[n_y:]
    x_vars = _marked(fwd, inputs_x, calls=cut)
    by_x = [isinstance(v, jex.Var) and id(v) in x_vars for v in residuals]
    made_by = {id(v): e for e in fwd.eqns for v in e.outvars}
    x_inputs = {id(v) for v, m in zip(fwd.invars, inputs_x, strict=True) if m}
    kept: set[int] = set()
    is_kept = []
    for v, depends in zip(residuals, by_x, strict=True):
        keep = depends and id(v) not in kept  # a residual twice is kept once
        is_kept.append(keep)
        if keep:
            kept.add(id(v))

    def formed_again(v: Any, seen: dict[int, bool]) -> bool:
        """Whether ``v`` can be formed from the kept residuals and values of the
        parameters and index alone, by elementwise operations on what depends on x."""
        if not isinstance(v, jex.Var) or id(v) in kept or id(v) not in x_vars:
            return True
        if id(v) in x_inputs:
            return False
        if id(v) in seen:
            return seen[id(v)]
        seen[id(v)] = False  # no cycles in a jaxpr; this only stops a repeated walk
        eqn = made_by[id(v)]
        ok = _elementwise(eqn) and not any(id(o) in kept for o in eqn.outvars) and all(
            formed_again(a, seen) for a in eqn.invars)
        seen[id(v)] = ok
        return ok

    for i, v in enumerate(residuals):
        if not (cut and is_kept[i]):
            continue
        kept.discard(id(v))
        if formed_again(v, {}):
            is_kept[i] = False
        else:
            kept.add(id(v))
    return is_kept


def _again(fwd: Any, consts: list[Any], n_y: int, is_kept: Sequence[bool]) -> _Part:
    """``(p, x, c, kept) -> the residuals not kept`` (``x`` unread: every one of them is
    formed from ``p``, ``c`` and the kept residuals, :func:`_recomputed`)."""
    residuals = fwd.outvars[n_y:]
    kept_vars = [v for v, k in zip(residuals, is_kept, strict=True) if k]
    kept_ids = {id(v) for v in kept_vars}
    # The kept residuals become inputs: the equations that made them are dropped (none
    # of their other results is needed, _recomputed), but a call: its results that depend
    # on the parameters and index alone (:func:`_marked`) may be needed without the rest,
    # so its kept results get variables nothing reads, and dead code elimination leaves of
    # the call what forms the others (else no cut at all, _formed_without_x).
    eqns = []
    for e in fwd.eqns:
        if any(id(o) in kept_ids for o in e.outvars):
            if _call_body(e) is None:
                continue
            e = e.replace(outvars=[jex.Var(o.aval) if id(o) in kept_ids else o
                                   for o in e.outvars])
        eqns.append(e)
    # A kept residual that is one of the chunk's inputs (``x`` itself, the input of a
    # matrix product) is read from the kept ones: its own place among the inputs gets a
    # variable nothing reads, else ``x`` would be an input twice and what elementwise
    # operations form from it would seem to read the microbatch (no cut at all).
    invars = [jex.Var(v.aval) if id(v) in kept_ids else v for v in fwd.invars]
    jaxpr = _jaxpr(fwd, [*invars, *kept_vars],
                   [v for v, k in zip(residuals, is_kept, strict=True) if not k], eqns)
    return _part(jaxpr, consts, [True] * (len(residuals) - len(kept_vars)))


def _formed_without_x(again: _Part, n_p: int, n_x: int) -> bool:
    """Whether ``again`` reads none of the microbatch's inputs (``None`` in their places),
    and every variable it reads is made in it (none that a dropped equation made)."""
    args = again.jaxpr.invars[len(again.consts):]  # one per argument it takes (_Part)
    position = [i for i, r in enumerate(again.reads) if r]
    x_ids = {id(v) for v, i in zip(args, position, strict=True) if n_p <= i < n_p + n_x}
    used = [v for e in again.jaxpr.eqns for v in e.invars] + list(again.jaxpr.outvars)
    if any(isinstance(v, jex.Var) and id(v) in x_ids for v in used):
        return False
    made = {id(v) for v in again.jaxpr.invars}
    for eqn in again.jaxpr.eqns:
        if any(isinstance(v, jex.Var) and id(v) not in made for v in eqn.invars):
            return False
        made.update(id(v) for v in eqn.outvars)
    return all(not isinstance(v, jex.Var) or id(v) in made for v in again.jaxpr.outvars)


def _cut(bwd: Any, consts: list[Any], n_dp: int, n_dx: int
         ) -> tuple[_Part, _Part, tuple[jax.ShapeDtypeStruct, ...]]:
    """The backward's input part ``(res, g) -> (dx, mid)`` and weight part
    ``(res, g, mid) -> dp`` (module docstring)."""
    if not compat.available(compat.dce_jaxpr):  # each part is the whole backward
        return (_part(bwd, consts, [False] * n_dp + [True] * n_dx),
                _part(bwd, consts, [True] * n_dp + [False] * n_dx), ())
    bwd, consts, n_exposed = _split_scans(bwd, consts, n_dp, n_dx)
    # The input part: what dx needs, and the scans' stacked intermediates the split scans
    # expose for their weight halves. The weight part: what dp needs, less every equation
    # whose results the input part already has (dead code elimination keeps the variables of
    # the equations it keeps, so results are told apart by identity).
    for_dx, _ = _select(bwd, [False] * n_dp + [True] * (n_dx + n_exposed))
    for_dp, _ = _select(bwd, [True] * n_dp + [False] * (n_dx + n_exposed))
    rest, mid_vars = _handover(for_dx.eqns, for_dp)
    # Both parts read the full argument list (consts, residuals, g) (+ mid for the weight
    # part); a dead-code pass trims what each does not read.
    inputs = list(bwd.invars)
    input_jaxpr = _jaxpr(bwd, inputs, [*for_dx.outvars[:n_dx], *mid_vars], for_dx.eqns)
    weight_jaxpr = _jaxpr(bwd, [*inputs, *mid_vars], for_dp.outvars[:n_dp], rest)
    input_part = _part(input_jaxpr, consts, [True] * (n_dx + len(mid_vars)))
    weight_part = _part(weight_jaxpr, consts, [True] * n_dp)
    return input_part, weight_part, tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
                                          for v in mid_vars)


def _handover(first_eqns: Sequence[Any], second: Any, also_made: Sequence[Any] = ()
              ) -> tuple[list[Any], list[Any]]:
    """The equations of the jaxpr ``second`` that ``first_eqns`` did not already run (not
    all of their results made there), and the variables made there (or in ``also_made``)
    that those equations or ``second``'s outputs read: what the first part hands over."""
    made = {id(v) for e in first_eqns for v in e.outvars} | {id(v) for v in also_made}
    rest = [e for e in second.eqns if not all(id(v) in made for v in e.outvars)]
    needed: dict[int, Any] = {}
    for atom in [*(v for e in rest for v in e.invars), *second.outvars]:
        if isinstance(atom, jex.Var) and id(atom) in made:
            needed.setdefault(id(atom), atom)
    return rest, list(needed.values())


def _eval_eqn(like: Any, eqn: Any, env: dict[int, Any]) -> list[Any]:
    """One equation of the jaxpr ``like`` on the values of ``env`` (variables by
    identity)."""
    invars = list({id(v): v for v in eqn.invars if isinstance(v, jex.Var)}.values())
    return _run(_jaxpr(like, invars, eqn.outvars, [eqn]), [env[id(v)] for v in invars])


def _value(atom: Any, env: dict[int, Any]) -> Any:
    return env[id(atom)] if isinstance(atom, jex.Var) else atom.val


def _split_scans(bwd: Any, consts: list[Any], n_dp: int, n_dx: int
                 ) -> tuple[Any, list[Any], int]:
    """``bwd`` with each scan whose results both cotangents need cut in two scans: one that
    runs the carry (the chain of input cotangents through the layers) and stacks what the
    other needs, and one, without a carry, that forms the rest (the weight gradients) from
    those stacks. The intermediates the first stacks are extra outputs (their number is
    returned), so that the input part keeps them for the weight part; the constants come
    first among the inputs, as in ``bwd``, preceded by those the new scans close over.
    Without such a scan, ``bwd`` itself."""
    for_dx, _ = _select(bwd, [False] * n_dp + [True] * n_dx)
    dx_reads = {id(v) for e in for_dx.eqns for v in e.invars if isinstance(v, jex.Var)}
    dx_reads |= {id(v) for v in for_dx.outvars if isinstance(v, jex.Var)}
    plans = {}
    for eqn in bwd.eqns:
        if eqn.primitive.name == "scan":
            plan = _scan_cut(eqn, dx_reads)
            if plan is not None:
                plans[id(eqn)] = plan
    if not plans:
        return bwd, consts, 0

    def run(*args):
        env = {id(v): a for v, a in zip(bwd.invars, args, strict=True)}
        exposed = []
        for eqn in bwd.eqns:
            invals = [_value(v, env) for v in eqn.invars]
            plan = plans.get(id(eqn))
            if plan is None:
                outs = _eval_eqn(bwd, eqn, env)
            else:
                outs, stacks = plan(invals)
                exposed += stacks
            env.update((id(v), o) for v, o in zip(eqn.outvars, outs, strict=True))
        return [_value(v, env) for v in bwd.outvars], exposed

    closed = jax.make_jaxpr(run)(*[v.aval for v in bwd.invars])
    split, split_consts = _open(closed)
    return split, [*split_consts, *consts], len(split.outvars) - n_dp - n_dx


def _scan_cut(eqn: Any, dx_reads: set[int]) -> Any:
    """For a scan equation: a function of its inputs that runs it as two scans
    (:func:`_split_scans`), returning its outputs and the stacked intermediates; ``None``
    where there is nothing to cut (every output is needed for dx, or none)."""
    layout = compat.scan_layout(eqn.params, len(eqn.invars))
    if layout is None:
        return None
    n_consts, n_carry, scan_kw = layout
    ys_for_dx = [id(v) in dx_reads for v in eqn.outvars[n_carry:]]
    if all(ys_for_dx) or not any(id(v) in dx_reads for v in eqn.outvars):
        return None
    body, body_consts = _open(eqn.params["jaxpr"])
    nb = len(body_consts)
    carry_in = body.invars[nb + n_consts:nb + n_consts + n_carry]
    # The first scan: every carry and the outputs dx needs; the second: the other outputs.
    first, _ = _select(body, [True] * n_carry + ys_for_dx)
    second, _ = _select(body, [False] * n_carry + [not k for k in ys_for_dx])
    # The carry at each step is the first scan's: the second stacks what it reads of it.
    rest, stacked = _handover(first.eqns, second, also_made=carry_in)
    outs_first = [*body.outvars[:n_carry],
                  *(v for v, k in zip(body.outvars[n_carry:], ys_for_dx, strict=True) if k)]
    a = _jaxpr(body, body.invars, [*outs_first, *stacked], first.eqns)
    xs_vars = body.invars[nb + n_consts + n_carry:]
    b_invars = [*body.invars[:nb + n_consts], *xs_vars, *stacked]
    b = _jaxpr(body, b_invars, list(second.outvars), rest)

    def run(invals):
        cs, carry, xs = (invals[:n_consts], invals[n_consts:n_consts + n_carry],
                         invals[n_consts + n_carry:])

        def step_a(c, x):
            out = _run(a, [*body_consts, *cs, *c, *x])
            return out[:n_carry], out[n_carry:]

        carry_out, ys_a = jax.lax.scan(step_a, list(carry), list(xs), **scan_kw)
        n_a = len(outs_first) - n_carry
        ys_dx, stacks = ys_a[:n_a], ys_a[n_a:]

        def step_b(_, x_s):
            x, st = x_s
            return None, _run(b, [*body_consts, *cs, *x, *st])

        _, ys_b = jax.lax.scan(step_b, None, (list(xs), list(stacks)), **scan_kw)
        it_dx, it_b = iter(ys_dx), iter(ys_b)
        ys = [next(it_dx) if k else next(it_b) for k in ys_for_dx]
        return [*carry_out, *ys], list(stacks)

    return run
