"""Every private JAX name jax_cpu_mpi uses, resolved defensively, and the features they serve.

jax_cpu_mpi hooks into JAX where no public API exists (primitive lowerings, batching rules,
the lowering of whole programs). A JAX release may move or change any of these names. This
module makes sure such a release never takes JAX down: JAX's plugin discovery imports
jax_cpu_mpi inside the first ``jax.devices()`` and only forgives an ``ImportError``, so an
``AttributeError`` here would break every JAX program of the environment.

How it works:

* A **feature** (:func:`feature`) is one thing jax_cpu_mpi adds to JAX: the psend/precv CPU
  lowerings, the GPU-parity check, one batching rule... Each declares the private names it
  needs with :meth:`Feature.need`, in its own section below.
* :meth:`Feature.need` never raises. It returns the value, or a :class:`Missing` placeholder
  when the name is absent or fails its ``check`` (a changed signature, a different type);
  then the feature is **off**, with the reason.
* The code that installs a feature runs through :func:`enable`: an off feature is not
  installed, an installation that raises turns the feature off instead of raising, and
  either way ONE :class:`JaxCompatWarning` names the JAX version, the feature, what is
  missing and what still works.
* :func:`report` lists every feature as active, off (and why), not needed or not
  installed; ``python -m jax_cpu_mpi info`` prints it.

Adding a name (other modules never import ``jax._src`` themselves)::

    MY_FEATURE = feature("my_feature", "what it gives users",
                         when_off="what users see while it is off", requires=("lowerings",))
    thing_p = MY_FEATURE.need("jax._src.lax.parallel:thing_p", check=is_primitive)

and install it with ``_compat.enable("my_feature", install_function)``. A name may list
alternative locations (``need("jax._src.a:x", "jax._src.b:x")``, first found wins) for names
that moved between JAX versions; ``optional=True`` marks a name that older/newer JAX versions
lack on purpose (the feature is then "not needed", without a warning).
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import jax

__all__ = [
    "Feature",
    "JaxCompatWarning",
    "Missing",
    "available",
    "enable",
    "feature",
    "features",
    "get_feature",
    "has_params",
    "is_primitive",
    "mark_not_needed",
    "names",
    "report",
    "resolve",
]


class JaxCompatWarning(UserWarning):
    """A jax_cpu_mpi feature is off because this JAX lacks or changed a name it needs."""


# ------------------------------------------------------------------------------ machinery


class Missing:
    """Stands for a private name this JAX does not have (falsy; any use raises).

    Code of an off feature never runs, so a :class:`Missing` is never used; if it is, the
    error says which name is missing and why, instead of an ``AttributeError`` on ``None``.
    """

    def __init__(self, path: str, reason: str) -> None:
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_reason", reason)

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<missing JAX name {self._path}: {self._reason}>"

    def _fail(self) -> RuntimeError:
        return RuntimeError(
            f"jax_cpu_mpi: {self._path} is not usable with jax {jax.__version__} "
            f"({self._reason}); the feature that needs it is off "
            "(`python -m jax_cpu_mpi info` lists features)")

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        raise self._fail()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise self._fail()

    def __hash__(self) -> int:
        return hash(("Missing", self._path))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Missing) and other._path == self._path


def available(value: Any) -> bool:
    """Whether ``value`` (from :meth:`Feature.need`) is a real JAX object."""
    return not isinstance(value, Missing)


#: ``path -> (value, None)`` or ``(None, why it is missing)``, each path looked up once.
_LOOKED_UP: dict[str, tuple[Any, str | None]] = {}


def _lookup(path: str) -> Any:
    """``"pkg.module:attr.sub"`` -> the object; ``"pkg.module"`` -> the module. Raises."""
    module_name, _, attrs = path.partition(":")
    value: Any = importlib.import_module(module_name)
    for attr in filter(None, attrs.split(".")):
        value = getattr(value, attr)
    return value


def resolve(path: str, check: Callable[[Any], str | None] | None = None) -> tuple[Any, str | None]:
    """``(value, None)``, or ``(Missing, reason)`` if ``path`` is absent or fails ``check``.

    ``path`` is ``"package.module"`` or ``"package.module:attribute.attribute"``.
    ``check(value)`` returns None when the value is what jax_cpu_mpi expects, or a short
    description of what changed. Never raises.
    """
    if path not in _LOOKED_UP:
        try:
            _LOOKED_UP[path] = (_lookup(path), None)
        except Exception as e:  # ImportError, AttributeError, or anything a module raises
            _LOOKED_UP[path] = (None, f"{path} is missing ({type(e).__name__}: {e})")
    value, reason = _LOOKED_UP[path]
    if reason is not None:
        return Missing(path, "missing"), reason
    if check is not None:
        try:
            problem = check(value)
        except Exception as e:
            problem = f"cannot be inspected ({type(e).__name__}: {e})"
        if problem is not None:
            return Missing(path, problem), f"{path} changed: {problem}"
    return value, None


#: Feature states, as :func:`report` gives them.
ACTIVE, OFF, NOT_NEEDED, NOT_INSTALLED = "active", "off", "not needed", "not installed"


@dataclass
class Feature:
    """One thing jax_cpu_mpi adds to JAX, and the private JAX names it needs."""

    name: str
    summary: str
    when_off: str
    requires: tuple[str, ...] = ()
    #: Every path this feature asked for, in order.
    names: list[str] = field(default_factory=list)
    #: Why the feature is off: missing or changed names, an installation that failed.
    problems: list[str] = field(default_factory=list)
    #: Why it is not needed (JAX does it itself, or lacks what it serves), if it is not.
    not_needed: str | None = None
    installed: bool = False
    warned: bool = False

    def need(self, *paths: str, check: Callable[[Any], str | None] | None = None,
             optional: bool = False) -> Any:
        """The first of ``paths`` that resolves (and passes ``check``), else a Missing.

        A missing name turns the feature off; with ``optional=True`` it makes the feature
        "not needed" instead (for names that only some JAX versions have).
        """
        reasons = []
        for path in paths:
            self.names.append(path)
            value, reason = resolve(path, check)
            if reason is None:
                return value
            reasons.append(reason)
        if optional:
            self.not_needed = self.not_needed or f"this JAX has no {paths[0]}"
        else:
            self.problems.extend(reasons)
        return Missing(paths[0], "; ".join(reasons))

    def off(self, reason: str) -> None:
        """Switch the feature off (it will not be installed, or is taken back)."""
        self.problems.append(reason)
        self.installed = False

    def blocked_by(self) -> list[str]:
        """The required features that are not active."""
        return [r for r in self.requires if state(r) != ACTIVE]

    @property
    def usable(self) -> bool:
        """No problem of its own, nothing optional missing, requirements active."""
        return not self.problems and self.not_needed is None and not self.blocked_by()

    @property
    def active(self) -> bool:
        return self.installed and self.usable


_FEATURES: dict[str, Feature] = {}


def feature(name: str, summary: str, *, when_off: str, requires: Iterable[str] = ()) -> Feature:
    """Declare a feature (or return the one already declared under ``name``)."""
    if name not in _FEATURES:
        _FEATURES[name] = Feature(name, summary, when_off, tuple(requires))
    return _FEATURES[name]


def get_feature(name: str) -> Feature:
    return _FEATURES[name]


def features() -> dict[str, Feature]:
    """Every declared feature, in declaration order."""
    return dict(_FEATURES)


def state(name: str) -> str:
    """``active``, ``off``, ``not needed`` or ``not installed``."""
    f = _FEATURES[name]
    if f.not_needed is not None:  # e.g. this JAX lacks the primitive a rule is for
        return NOT_NEEDED
    if f.problems or f.blocked_by():
        return OFF
    return ACTIVE if f.installed else NOT_INSTALLED


def _why(f: Feature) -> str:
    if f.not_needed is not None:
        return f.not_needed
    if f.problems:
        return "; ".join(f.problems)
    blocked = f.blocked_by()
    if blocked:
        return "needs " + ", ".join(f"{b} ({state(b)})" for b in blocked)
    return ""


def versions_text() -> str:
    try:
        from importlib import metadata

        jaxlib = metadata.version("jaxlib")
    except Exception:
        jaxlib = "unknown"
    return f"jax {jax.__version__} (jaxlib {jaxlib})"


def _warn(f: Feature) -> None:
    if f.warned or state(f.name) != OFF or (f.blocked_by() and not f.problems):
        return  # a feature blocked by another one: that one's warning says it all
    f.warned = True
    warnings.warn(
        f"jax_cpu_mpi: {f.summary} ({f.name}) is OFF with {versions_text()}: {_why(f)}. "
        f"{f.when_off}. Everything else keeps working; `python -m jax_cpu_mpi info` lists "
        "every feature. Please report this with the versions above, or use a JAX version "
        "jax_cpu_mpi was tested with (jax_cpu_mpi.TESTED_JAX_VERSIONS).",
        JaxCompatWarning, stacklevel=3)


def enable(name: str, install: Callable[[], Any]) -> bool:
    """Install feature ``name`` with ``install()`` unless it is off or not needed.

    ``install()`` returns None/True when it installed the feature, or False or a string
    (the reason) when JAX already does what the feature would: the feature is then "not
    needed". Never raises: an ``install`` that raises turns the feature off. Warns once
    per off feature. Returns whether the feature is active. Idempotent.
    """
    f = _FEATURES[name]
    if f.installed:
        return f.active
    if f.usable:
        try:
            result = install()
        except Exception as e:
            f.off(f"installing it failed ({type(e).__name__}: {e})")
        else:
            if isinstance(result, str):  # the installer found JAX needs no help: why
                f.not_needed = result
            elif result is False:
                f.not_needed = "JAX's own implementation is in place"
            else:
                f.installed = True
    _warn(f)
    return f.active


def wrap_once(owner: Any, name: str, marker: str, wrap: Callable[[Any], Any]) -> bool:
    """Replace ``owner.<name>`` with ``wrap(original)`` unless it already carries the
    attribute ``marker`` (then a feature installed again wraps nothing twice). The wrapper
    gets the marker. Returns whether it wrapped."""
    original = getattr(owner, name)
    if getattr(original, marker, False):
        return False
    wrapper = wrap(original)
    setattr(wrapper, marker, True)
    setattr(owner, name, wrapper)
    return True


def mark_not_needed(name: str, why: str) -> None:
    """Record that JAX already does what feature ``name`` would (no warning)."""
    _FEATURES[name].not_needed = why


def failed_at_run_time(name: str, error: BaseException) -> None:
    """A feature's code hit a changed JAX internal while running: switch it off, warn."""
    f = _FEATURES[name]
    f.off(f"it failed while running ({type(error).__name__}: {error})")
    _warn(f)


def report() -> list[dict[str, Any]]:
    """Every feature with its state and the reason, for ``info``."""
    return [{"feature": f.name, "summary": f.summary, "state": state(f.name), "why": _why(f),
             "names": list(dict.fromkeys(f.names))}
            for f in _FEATURES.values()]


def names() -> dict[str, list[str]]:
    """``{private path: [features that need it]}`` over every feature (for the tests)."""
    out: dict[str, list[str]] = {}
    for f in _FEATURES.values():
        for path in dict.fromkeys(f.names):
            out.setdefault(path, []).append(f.name)
    return out


# ---------------------------------------------------------------------- checks on names


def is_primitive(value: Any) -> str | None:
    # Duck-typed: importing jax.extend.core here would depend on more private modules.
    if isinstance(getattr(value, "name", None), str) and callable(getattr(value, "bind", None)):
        return None
    return f"not a Primitive ({type(value).__name__})"


def is_callable(value: Any) -> str | None:
    return None if callable(value) else f"not callable ({type(value).__name__})"


def is_module(value: Any) -> str | None:
    return None if inspect.ismodule(value) else f"not a module ({type(value).__name__})"


def has_params(*params: str) -> Callable[[Any], str | None]:
    """A check: the value is a function whose signature has these parameter names."""

    def check(value: Any) -> str | None:
        if not callable(value):
            return f"not callable ({type(value).__name__})"
        have = inspect.signature(value).parameters
        if any(p.kind is p.VAR_KEYWORD for p in have.values()):
            return None
        lacking = [p for p in params if p not in have]
        return f"its signature lacks {', '.join(lacking)}" if lacking else None

    check.__name__ = f"has_params{params}"
    return check


def is_instance_of(cls_path: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        cls, reason = resolve(cls_path)
        if reason is not None:
            return reason
        return None if isinstance(value, cls) else f"not a {cls_path} ({type(value).__name__})"

    return check


def is_type(value: Any) -> str | None:
    return None if isinstance(value, type) else f"not a class ({type(value).__name__})"


def _need_all(features_: Iterable[Feature], *paths: str, **kwargs: Any) -> Any:
    """Resolve a name for several features at once (each records the need)."""
    value: Any = None
    for f in features_:
        value = f.need(*paths, **kwargs)
    return value


# =========================================================================================
# Sections: one per feature. Add new features in a section of their own, at the end.
# =========================================================================================

# ------------------------------------------------------------- psend/precv CPU lowerings

LOWERINGS = feature(
    "lowerings", "the CPU lowerings of psend/precv",
    when_off="psend/precv on CPU raise JAX's own NotImplementedError, as without jax_cpu_mpi")

#: JAX's modules we reach into. (MLIR's ``ir``/``hlo`` are jaxlib's MLIR bindings, which
#: JAX re-exports.)
mlir = LOWERINGS.need("jax._src.interpreters.mlir", check=is_module)
parallel = LOWERINGS.need("jax._src.lax.parallel", check=is_module)
ir = LOWERINGS.need("jax._src.lib.mlir:ir", check=is_module)
hlo = LOWERINGS.need("jax._src.lib.mlir.dialects:hlo", check=is_module)

# The primitives the lowerings attach to are those of jax_cpu_mpi.primitives: JAX's
# psend_p/precv_p while JAX has them, ours after (section "own psend/precv primitives").
#: JAX's own computation of source-target pairs (with its validation and its
#: ``ValueError`` for duplicate sources/destinations), shared by ppermute/psend/precv.
pcollectives_lowering_common = LOWERINGS.need(
    "jax._src.lax.parallel:_pcollectives_lowering_common",
    check=has_params("ctx", "axis_name", "perm", "op_name"))
SPMDAxisContext = LOWERINGS.need("jax._src.sharding_impls:SPMDAxisContext", check=is_type)
get_concrete_mesh = LOWERINGS.need("jax._src.mesh:get_concrete_mesh", check=is_callable)
register_lowering = LOWERINGS.need(
    "jax._src.interpreters.mlir:register_lowering", check=has_params("prim", "rule", "platform"))
ShapedArray = LOWERINGS.need("jax._src.core:ShapedArray", check=is_type)

# ------------------------------------------------------------------- GPU-parity check

GPU_PARITY = feature(
    "gpu_parity", "the GPU-parity check of psend/precv programs", requires=("lowerings",),
    when_off="psend/precv programs that XLA GPU refuses to compile are not rejected at "
             "lowering on CPU (they may run, or fail after recv_timeout)")

#: The module whose ``lower_jaxpr_to_module`` jit lowers every program through (we wrap it).
lower_jaxpr_to_module = GPU_PARITY.need(
    "jax._src.interpreters.mlir:lower_jaxpr_to_module",
    check=has_params("module_name", "jaxpr", "platforms"))
#: The effect psend and precv carry; jit, shard_map and control flow propagate it, so a
#: program without it has no psend/precv (validation.py skips such programs).
single_side_collective_effect = GPU_PARITY.need(
    "jax._src.lax.parallel:single_side_collective_effect")
_need_all([GPU_PARITY], "jax._src.lib.mlir:ir", check=is_module)

# ------------------------------------------- precvs that keep their psend's operand alive

KEPT_OPERANDS = feature(
    "kept_operands", "precvs that keep their psend's operand alive (a psend then returns "
    "while its receiver copies)", requires=("lowerings",),
    when_off="every psend finishes its send before it returns (correct, but a device that "
             "sends waits for its receiver's copy instead of going on with its own work)")
_need_all([KEPT_OPERANDS], "jax._src.interpreters.mlir:lower_jaxpr_to_module",
          check=has_params("module_name", "jaxpr", "platforms"))
_need_all([KEPT_OPERANDS], "jax._src.lax.parallel:single_side_collective_effect")
_need_all([KEPT_OPERANDS], "jax._src.lib.mlir:ir", check=is_module)

# --------------------------------------------------- optimization_barrier over tokens

BARRIER_TOKENS = feature(
    "barrier_tokens", "optimization_barrier over tokens on CPU", requires=("lowerings",),
    when_off="jax.lax.optimization_barrier over tokens fails to lower on CPU, as in plain JAX")

#: optimization_barrier and JAX's lowering rule for it (_barrier_tokens.py wraps it).
optimization_barrier_p = BARRIER_TOKENS.need(
    "jax._src.lax.lax:optimization_barrier_p", check=is_primitive)
optimization_barrier_lowering = BARRIER_TOKENS.need(
    "jax._src.lax.lax:_optimization_barrier_lowering_rule", check=has_params("ctx"))
abstract_token = BARRIER_TOKENS.need("jax._src.core:abstract_token")
lower_with_sharding_in_types = BARRIER_TOKENS.need(
    "jax._src.interpreters.mlir:lower_with_sharding_in_types", check=is_callable)
dense_int_array = BARRIER_TOKENS.need(
    "jax._src.interpreters.mlir:dense_int_array", check=is_callable)
_need_all([BARRIER_TOKENS], "jax._src.core:ShapedArray", check=is_type)
_need_all([BARRIER_TOKENS], "jax._src.lib.mlir.dialects:hlo", check=is_module)

# ------------------------------------------------------------------- batching rules
# One feature per rule (``batching:<primitive>``), so that a moved primitive switches off
# only its own rule. The rules live in batching.py / _batching_*.py.

_BATCHING_OFF = ("jax.vmap of {what} fails as in plain JAX (NotImplementedError or JAX's "
                 "own rule)")


def _batching_feature(prim: str, what: str, *, requires: Iterable[str] = ()) -> Feature:
    f = feature(f"batching:{prim}", f"the batching rule of {prim}", requires=requires,
                when_off=_BATCHING_OFF.format(what=what))
    f.need("jax._src.interpreters.batching:fancy_primitive_batchers",
           check=is_instance_of("builtins:dict"))
    return f


B_ALL_GATHER_REDUCED = _batching_feature(
    "all_gather_reduced", "all_gather(..., to='reduced')")
B_UNREDUCED_REDUCE_SCATTER = _batching_feature(
    "unreduced_reduce_scatter", "the transpose of all_gather(..., to='reduced')")
B_UNREDUCED_PSUM = _batching_feature("unreduced_psum", "psum of an unreduced value")
B_UNREDUCED_PMAX = _batching_feature("unreduced_pmax", "pmax of an unreduced value")
B_UNREDUCED_PMIN = _batching_feature("unreduced_pmin", "pmin of an unreduced value")
B_PREDUCED = _batching_feature("preduced", "pcast(..., to='reduced')")
B_VARY_UNREDUCED_CAST = _batching_feature(
    "vary_unreduced_cast", "pcast(..., to='unreduced') of a varying value")
B_REDUCED_VARY_CAST = _batching_feature(
    "reduced_vary_cast", "pcast(..., to='varying') of a reduced value")
B_PSEND = _batching_feature("psend", "psend (JAX lends it ppermute's rule)")
B_PRECV = _batching_feature("precv", "precv (JAX lends it ppermute's rule)")

#: The rule table: ``fancy_primitive_batchers[primitive] = rule``.
fancy_primitive_batchers = B_ALL_GATHER_REDUCED.need(
    "jax._src.interpreters.batching:fancy_primitive_batchers",
    check=is_instance_of("builtins:dict"))

all_gather_reduced_p = B_ALL_GATHER_REDUCED.need(
    "jax._src.lax.parallel:all_gather_reduced_p", check=is_primitive)
unreduced_reduce_scatter_p = _need_all(
    [B_UNREDUCED_REDUCE_SCATTER, B_ALL_GATHER_REDUCED],
    "jax._src.lax.parallel:unreduced_reduce_scatter_p", check=is_primitive)
unreduced_psum_p = B_UNREDUCED_PSUM.need(
    "jax._src.lax.parallel:unreduced_psum_p", check=is_primitive)
#: Only JAX >= 0.12 has unreduced pmax/pmin (their features are "not needed" before).
unreduced_pmax_p = B_UNREDUCED_PMAX.need(
    "jax._src.lax.parallel:unreduced_pmax_p", check=is_primitive, optional=True)
unreduced_pmin_p = B_UNREDUCED_PMIN.need(
    "jax._src.lax.parallel:unreduced_pmin_p", check=is_primitive, optional=True)
preduced_p = B_PREDUCED.need("jax._src.lax.parallel:preduced_p", check=is_primitive)
vary_unreduced_cast_p = _need_all(
    [B_VARY_UNREDUCED_CAST, B_UNREDUCED_REDUCE_SCATTER, B_UNREDUCED_PSUM, B_UNREDUCED_PMAX,
     B_UNREDUCED_PMIN], "jax._src.lax.parallel:vary_unreduced_cast_p", check=is_primitive)
reduced_vary_cast_p = B_REDUCED_VARY_CAST.need(
    "jax._src.core:reduced_vary_cast_p", check=is_primitive)
#: ppermute's batcher, which JAX lends to psend/precv (how we recognise JAX's rule).
ppermute_batcher = _need_all([B_PSEND, B_PRECV], "jax._src.lax.parallel:_ppermute_batcher",
                             check=is_callable)
_need_all([B_PRECV], "jax._src.core:ShapedArray", check=is_type)

# ------------------------------------------------------ diagnostics (info) of lowerings

LOWERING_TABLE = feature(
    "info:lowering_table", "reading JAX's table of CPU lowerings for `info`",
    when_off="`info` cannot confirm that our psend/precv lowerings are the registered ones")

_platform_specific_lowerings = LOWERING_TABLE.need(
    "jax._src.interpreters.mlir:_platform_specific_lowerings",
    check=is_instance_of("builtins:dict"))


def platform_lowering(primitive: Any, platform: str) -> Any:
    """The lowering rule registered for ``primitive`` on ``platform`` (None if none or
    unknown)."""
    if not available(_platform_specific_lowerings):
        return None
    return _platform_specific_lowerings.get(platform, {}).get(primitive)


# --------------------------------------------------------- cluster detection: issue 13
# jax_cpu_mpi.cluster (jax.distributed.initialize() under mpirun) and mpi_runtime's exit
# from a job that lost a peer.


def _is_cluster_env_base(value: Any) -> str | None:
    if not isinstance(value, type):
        return f"not a class ({type(value).__name__})"
    methods = ("is_env_present", "get_coordinator_address", "get_process_count",
               "get_process_id", "get_local_process_id", "auto_detect_unset_distributed_params")
    missing = [m for m in methods if not callable(getattr(value, m, None))]
    if missing:
        return f"has no {', '.join(missing)}"
    if not isinstance(getattr(value, "_cluster_types", None), list):
        return "its registry of subclasses (_cluster_types) is not a list"
    return None


def _is_distributed_state(value: Any) -> str | None:
    missing = [a for a in ("client", "service", "preemption_sync_manager")
               if not hasattr(value, a)]
    return f"has no {', '.join(missing)}" if missing else None


CLUSTERS = feature(
    "clusters",
    "jax.distributed.initialize() without arguments under MPICH's and Open MPI 5's mpirun",
    when_off="Under those launchers call jax.distributed.initialize("
             "cluster_detection_method='mpi4py'), or pass coordinator_address, num_processes "
             "and process_id")
#: JAX's base class of cluster environments: a subclass joins jax.distributed.initialize()'s
#: detection when it is defined (``__init_subclass__`` appends it to ``_cluster_types``).
cluster_env_base = CLUSTERS.need("jax._src.clusters:ClusterEnv", check=_is_cluster_env_base)

EXIT_FROM_BROKEN_JOB = feature(
    "exit_from_broken_job",
    "a prompt exit from an MPI job that lost a peer, without JAX's distributed shutdown",
    when_off="A process leaving a job whose peer is unreachable still waits in JAX's "
             "distributed shutdown until JAX's heartbeat timeout (100 s by default), and is "
             "then aborted by JAX")
#: JAX's distributed-runtime state (``client``, ``service``, ``preemption_sync_manager``).
distributed_state = EXIT_FROM_BROKEN_JOB.need("jax._src.distributed:global_state",
                                              check=_is_distributed_state)



# ------------------------------------------------ own psend/precv primitives: issue 15
# JAX 0.12 deprecates jax.lax.psend/precv; a later JAX drops them with psend_p/precv_p.
# jax_cpu_mpi.psend/precv (p2p.py) bind JAX's primitives while JAX has them, and primitives
# of our own (_own_primitives.py) after: JAX's primitives are looked up here WITHOUT being a
# need of any feature (their absence is what the "own_primitives" feature is for).

#: JAX's primitives, or a Missing where this JAX has dropped them.
jax_psend_p, _ = resolve("jax._src.lax.parallel:psend_p", is_primitive)
jax_precv_p, _ = resolve("jax._src.lax.parallel:precv_p", is_primitive)
#: JAX's single-side-collective effect (psend/precv carry it), or a Missing.
jax_single_side_collective_effect, _ = resolve(
    "jax._src.lax.parallel:single_side_collective_effect")

OWN_PRIMITIVES = feature(
    "own_primitives", "psend/precv primitives of jax_cpu_mpi's own, for a JAX without them",
    when_off="jax_cpu_mpi.psend/precv raise a RuntimeError naming the missing JAX name")


def _has_send_recv(module: Any) -> str | None:
    lacking = [n for n in ("SendOp", "RecvOp", "create_token") if not hasattr(module, n)]
    return f"it lacks {', '.join(lacking)}" if lacking else None


#: What our primitives are built from.
Primitive = OWN_PRIMITIVES.need("jax._src.core:Primitive", check=is_type)
apply_primitive = OWN_PRIMITIVES.need("jax._src.dispatch:apply_primitive", check=is_callable)
NamedAxisEffect = OWN_PRIMITIVES.need("jax._src.core:NamedAxisEffect", check=is_type)
check_axis_names = OWN_PRIMITIVES.need(
    "jax._src.lax.parallel:_check_axis_names", check=has_params("axes", "api_name"))
dense_int_elements = OWN_PRIMITIVES.need(
    "jax._src.interpreters.mlir:dense_int_elements", check=is_callable)
aval_to_ir_type = OWN_PRIMITIVES.need(
    "jax._src.interpreters.mlir:aval_to_ir_type", check=is_callable)
_need_all([OWN_PRIMITIVES], "jax._src.core:abstract_token")
_need_all([OWN_PRIMITIVES], "jax._src.interpreters.mlir", check=is_module)
_need_all([OWN_PRIMITIVES], "jax._src.interpreters.mlir:register_lowering",
          check=has_params("prim", "rule", "platform"))
_need_all([OWN_PRIMITIVES], "jax._src.lib.mlir.dialects:hlo", check=is_module)
_need_all([OWN_PRIMITIVES], "jax._src.lib.mlir.dialects:hlo", check=_has_send_recv)
_need_all([OWN_PRIMITIVES], "jax._src.lax.parallel:_pcollectives_lowering_common",
          check=has_params("ctx", "axis_name", "perm", "op_name"))
_need_all([OWN_PRIMITIVES], "jax._src.sharding_impls:SPMDAxisContext", check=is_type)
if not available(jax_single_side_collective_effect):
    # JAX dropped the effect too: ours (an equivalent class) must be registered where JAX
    # registered its own, so that jit, loops and lowering accept it.
    Effect = OWN_PRIMITIVES.need("jax._src.core:Effect", check=is_type)
    control_flow_allowed_effects = OWN_PRIMITIVES.need(
        "jax._src.effects:control_flow_allowed_effects")
    lowerable_effects = OWN_PRIMITIVES.need("jax._src.effects:lowerable_effects")

if (not available(jax_psend_p) and not available(jax_single_side_collective_effect)
        and OWN_PRIMITIVES.usable):
    # JAX dropped psend/precv AND their effect: our primitives carry an effect of our own
    # (_own_primitives.py), and the GPU-parity check recognises psend/precv programs by the
    # effect they carry, so it looks for ours (the missing JAX effect is then no problem of
    # gpu_parity's). While JAX has its primitives, a missing effect keeps gpu_parity off:
    # JAX's primitives would carry an effect we cannot see.
    from . import _own_effect

    single_side_collective_effect = _own_effect.single_side_collective_effect

    GPU_PARITY.problems[:] = [p for p in GPU_PARITY.problems
                              if "single_side_collective_effect" not in p]

#: What JAX's psend does to its operand (marks it varying over the axes, the vma type
#: system); jax_cpu_mpi.psend does the same, through public pcast where JAX lacks it.
insert_collective_pvary, _ = resolve("jax._src.lax.parallel:insert_collective_pvary",
                                     is_callable)


def register_source_exclusion(path: str) -> None:
    """Treat ``path`` as JAX-internal in source locations and filtered tracebacks, as JAX's
    own files are, so that a psend traced through our wrapper is located at the user's line
    (parity messages, lowered locations, errors). A no-op on a JAX without these hooks."""
    for module_path in ("jax._src.source_info_util", "jax._src.traceback_util"):
        register, _ = resolve(f"{module_path}:register_exclusion", is_callable)
        if available(register):
            register(path)


# ------------------------------------------- JAX's C++ dispatch for psend/precv programs

FAST_DISPATCH = feature(
    "fast_dispatch", "jitted CPU programs with psend/precv dispatched by JAX's C++ fast path "
    "(100 to 200 us less per call); one-device programs get the flops that make XLA run them "
    "on a device thread", requires=("lowerings",),
    when_off="every call of a jitted program with psend/precv goes through JAX's Python "
             "dispatch of effectful programs (correct, 100 to 200 us more per call)")


def _executes_replicated(value: Any) -> str | None:
    """A check: a class whose ``__init__`` takes the unordered effects 6th, after ``self``,
    the executable, its name, the backend and the in/out handlers."""
    if not isinstance(value, type):
        return f"not a class ({type(value).__name__})"
    params = list(inspect.signature(value.__init__).parameters)[:7]
    expected = ["self", "xla_executable", "name", "backend", "in_handler", "out_handler",
                "unordered_effects"]
    return None if params == expected else f"its __init__ parameters start {params}"


#: What runs a compiled program; a true ``has_unordered_effects`` keeps jit off its C++
#: fast path (_fast_dispatch.py wraps its ``__init__``).
ExecuteReplicated = FAST_DISPATCH.need("jax._src.interpreters.pxla:ExecuteReplicated",
                                       check=_executes_replicated)
# The device-thread hint (_device_thread_hint.py) rewrites lowered CPU modules.
_need_all([FAST_DISPATCH], "jax._src.interpreters.mlir:lower_jaxpr_to_module",
          check=has_params("module_name", "jaxpr", "platforms"))
_need_all([FAST_DISPATCH], "jax._src.lib.mlir.dialects:hlo", check=is_module)
