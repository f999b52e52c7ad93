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

and install it with ``compat.enable("my_feature", install_function)``. A name may list
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

from .versions import jaxlib_version


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
    return f"jax {jax.__version__} (jaxlib {jaxlib_version() or 'unknown'})"


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


