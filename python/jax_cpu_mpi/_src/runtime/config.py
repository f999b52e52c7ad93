"""Runtime configuration, from environment variables or :func:`configure`.

Every ``JAX_CPU_MPI_*`` variable is listed once, in :data:`VARIABLES`: its default, its
meaning and how its value is read. The documentation's "Configuration" page
(``docs/configuration.md``) is generated from it when the site is built.

A bad value never breaks ``import jax_cpu_mpi`` (JAX's plugin discovery imports the package):
:func:`current`, :func:`configure` and the first psend/precv lowering raise a
:class:`ConfigError` naming the variable, its value and what is allowed. A name that is not
in :data:`VARIABLES` (a misspelling) gets one :class:`ConfigWarning` at import, naming the
closest known one (:func:`warn_about_unknown_names`).
"""

from __future__ import annotations

import contextlib
import difflib
import math
import os
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """Parse ``"1073741824"``, ``"512MiB"``, ``"1G"``, ``"64k"`` into a byte count."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if not match:
        raise ValueError(f"cannot parse a byte count from {text!r} (examples: 1048576, 64MiB, 1G)")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]


#: The values of ``collectives`` (``JAX_CPU_MPI_COLLECTIVES``).
COLLECTIVES_CHOICES = ("auto", "mpi", "gloo")


@dataclass(frozen=True)
class Config:
    """The runtime settings of jax_cpu_mpi."""

    #: Seconds a precv waits for a matching psend before raising.
    recv_timeout: float = 300.0
    #: Bound on the bytes of undelivered MPI sends held by this process.
    max_inflight_bytes: int = 1 << 30
    #: Seconds to wait at interpreter exit for undelivered MPI sends.
    exit_timeout: float = 60.0
    #: Seconds, once every rank is at exit, that psend/precv still running get to finish
    #: before they end with an error.
    exit_grace: float = 1.0
    #: Reject, when a program is lowered, the psend/precv patterns XLA GPU rejects.
    gpu_parity: bool = True
    #: In an MPI job, abort the job on an uncaught Python exception.
    abort_on_error: bool = True
    #: Dispatch jitted CPU programs with psend/precv that XLA never runs inline (2+ devices of
    #: this process, or 1000+ flops) through JAX's C++ fast path (see dispatch/fast_path.py).
    fast_dispatch: bool = True
    #: How collectives (psum, pmax, pmin...) between processes run: ``"mpi"``, ``"gloo"``
    #: (JAX's own path) or ``"auto"`` (MPI in a job an MPI launcher started); chosen when a
    #: program is lowered.
    collectives: str = "auto"
    #: All-reduces over MPI of at most this many bytes each, of one group, reduction and
    #: dtype, that a program runs one after another merge into one call (0: none merge);
    #: chosen when a program is lowered.
    combine_bytes: int = 64 << 10
    #: Fill the buffers that start uninitialized (a pipeline's kept residuals) with NaN
    #: (floats), the most negative (signed), the largest (unsigned) value or true, so that
    #: a read before a write shows in results (a check: it costs a write of every byte).
    poison_uninitialized: bool = False

    def __post_init__(self) -> None:
        if not self.recv_timeout > 0:
            raise ValueError(f"recv_timeout must be > 0 seconds, got {self.recv_timeout}")
        if not self.max_inflight_bytes > 0:
            raise ValueError(f"max_inflight_bytes must be > 0, got {self.max_inflight_bytes}")
        if not self.exit_timeout >= 0:
            raise ValueError(f"exit_timeout must be >= 0 seconds, got {self.exit_timeout}")
        if not self.exit_grace >= 0:
            raise ValueError(f"exit_grace must be >= 0 seconds, got {self.exit_grace}")
        if not self.combine_bytes >= 0:
            raise ValueError(f"combine_bytes must be >= 0, got {self.combine_bytes}")
        if self.collectives not in COLLECTIVES_CHOICES:
            raise ValueError(f"collectives must be one of {', '.join(COLLECTIVES_CHOICES)}, "
                             f"got {self.collectives!r}")


class ConfigError(ValueError):
    """A ``JAX_CPU_MPI_*`` variable has a value jax_cpu_mpi cannot use."""


class ConfigWarning(UserWarning):
    """A ``JAX_CPU_MPI_*`` variable that jax_cpu_mpi does not know (a misspelling?)."""


@dataclass(frozen=True)
class Variable:
    """One ``JAX_CPU_MPI_*`` environment variable."""

    name: str
    #: ``"runtime"`` (read by the package), ``"build"`` (a CMake option of the extension's
    #: build), ``"ci"`` (read by ``.ci/run``) or ``"bench"`` (read by the benchmarks).
    kind: str
    #: The default, as a user would write it.
    default: str
    #: One line: what it does.
    meaning: str
    #: The :class:`Config` field that :func:`configure` changes, if any.
    field: str | None = None
    #: ``parse(variable, text) -> value``, raising :class:`ConfigError`; None for the
    #: variables jax_cpu_mpi does not read at run time.
    parse: Callable[[Variable, str], Any] | None = None

    def error(self, value: str, problem: str, fix: str) -> ConfigError:
        return ConfigError(f"{self.name}={value!r} {problem}: {fix}, or unset it for the "
                           f"default {self.default}")

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        """The parsed value of the variable, or None when it is unset or empty."""
        text = (os.environ if environ is None else environ).get(self.name)
        if text is None or text.strip() == "" or self.parse is None:
            return None
        return self.parse(self, text)

    def read_or_default(self, environ: Mapping[str, str] | None = None) -> Any:
        """The parsed value of the variable, or of its :attr:`default` when it is unset or
        empty (so that the registry's default is the one the package applies)."""
        value = self.read(environ)
        if value is None and self.parse is not None:
            return self.parse(self, self.default)
        return value


def _seconds(*, positive: bool, example: str) -> Callable[[Variable, str], float]:
    bound = "a positive number of seconds" if positive else "a number of seconds >= 0"
    fix = (f"set a positive number of seconds, e.g. {example}" if positive
           else f"set a number of seconds, 0 or more, e.g. {example}")

    def parse(var: Variable, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise var.error(text, "is not a number of seconds", fix) from None
        if not math.isfinite(value) or (value <= 0 if positive else value < 0):
            raise var.error(text, f"is not {bound}", fix)
        return value

    return parse


def _byte_count(var: Variable, text: str) -> int:
    fix = "set a positive byte count, e.g. 1073741824, 512MiB or 1G"
    try:
        value = parse_bytes(text)
    except ValueError:
        raise var.error(text, "is not a byte count", fix) from None
    if value <= 0:
        raise var.error(text, "is not a positive byte count", fix)
    return value


def _byte_count_or_zero(var: Variable, text: str) -> int:
    fix = "set a byte count, 0 or more, e.g. 0, 65536, 256KiB or 1M"
    try:
        return parse_bytes(text)
    except ValueError:
        raise var.error(text, "is not a byte count", fix) from None


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _boolean(on: str, off: str) -> Callable[[Variable, str], bool]:
    """1/true/yes/on or 0/false/no/off, any case; ``on``/``off`` say what each does."""

    def parse(var: Variable, text: str) -> bool:
        value = text.strip().lower()
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise var.error(text, "is not a boolean", f"set 1 ({on}) or 0 ({off})")

    return parse


def _choice(**choices: str) -> Callable[[Variable, str], str]:
    """One of ``choices`` (name: what it does), any case."""

    def parse(var: Variable, text: str) -> str:
        value = text.strip().lower()
        if value in choices:
            return value
        listed = " or ".join(f"{name} ({what})" for name, what in choices.items())
        raise var.error(text, f"is not one of {', '.join(map(repr, choices))}", f"set {listed}")

    return parse


def _directory(var: Variable, text: str) -> str:
    if "\0" in text:
        raise var.error(text, "is not a directory name", "set a directory, e.g. /tmp/trace")
    return text


def _positive_count(var: Variable, text: str) -> int:
    fix = "set a positive whole number, e.g. 65536"
    try:
        value = int(text.strip())
    except ValueError:
        raise var.error(text, "is not a whole number", fix) from None
    if value <= 0:
        raise var.error(text, "is not a positive number", fix)
    return value


#: Every ``JAX_CPU_MPI_*`` environment variable: those jax_cpu_mpi reads at run time, then
#: the build's, CI's and the benchmarks'. The docs' "Configuration" table is made from it.
VARIABLES: tuple[Variable, ...] = (
    Variable("JAX_CPU_MPI_RECV_TIMEOUT", "runtime", "300",
             "seconds a precv waits for its message before it fails with an error naming the "
             "op, the pair and the peer, instead of hanging",
             "recv_timeout", _seconds(positive=True, example="30")),
    Variable("JAX_CPU_MPI_MAX_INFLIGHT_BYTES", "runtime", "1GiB",
             "bytes of MPI sends copied and not yet received; a psend beyond it first waits "
             "for older sends", "max_inflight_bytes", _byte_count),
    Variable("JAX_CPU_MPI_EXIT_TIMEOUT", "runtime", "60",
             "seconds the process waits at exit for undelivered MPI sends and the other "
             "ranks, before MPI finalizes (at most 2 s once a peer failed to answer)",
             "exit_timeout", _seconds(positive=False, example="60")),
    Variable("JAX_CPU_MPI_EXIT_GRACE", "runtime", "1",
             "seconds, at exit, once the outputs of every rank's live arrays are ready, that "
             "a psend/precv still running (of a program whose outputs were dropped) gets "
             "to finish; then it ends with an error, reported on stderr, and the process "
             "exits with the status its program asked for",
             "exit_grace", _seconds(positive=False, example="1")),
    Variable("JAX_CPU_MPI_ABORT_ON_ERROR", "runtime", "1",
             "in an MPI job (once MPI is attached), an uncaught exception, or an exit after a "
             "peer stopped answering, aborts the whole launch (`MPI_Abort`) instead of "
             "leaving the other ranks, or the launcher, waiting for this one; `0`: only this "
             "process ends", "abort_on_error",
             _boolean("abort the whole MPI launch", "end only this process")),
    Variable("JAX_CPU_MPI_GPU_PARITY", "runtime", "1",
             "reject when lowering what XLA GPU rejects when compiling (cyclic pairs in one "
             "op, unmatched psend/precv: see \"GPU parity\"); `0` runs every pattern the CPU "
             "transport can run", "gpu_parity",
             _boolean("reject what XLA GPU rejects", "run every pattern the CPU can")),
    Variable("JAX_CPU_MPI_FAST_DISPATCH", "runtime", "1",
             "a jitted CPU program with psend/precv that XLA never runs inline (2+ devices of "
             "this process, or 1000+ flops) runs on `jax.jit`'s C++ fast path "
             "(`jax.effects_barrier()` then does not wait for it: block on its outputs); `0`: "
             "JAX's Python dispatch of effectful programs, 100 to 200 us more per call, and no "
             "device-thread hint; chosen when a program is lowered and compiled",
             "fast_dispatch", _boolean("C++ dispatch", "JAX's Python dispatch")),
    Variable("JAX_CPU_MPI_COLLECTIVES", "runtime", "auto",
             "how `psum`/`pmean`/`pmax`/`pmin`/`ppermute` between processes run: `mpi` (one MPI "
             "collective per process, its devices reduced in process: docs \"Collectives "
             "over MPI\"), `gloo` (JAX's own path, untouched), `auto`: `mpi` in a job an MPI "
             "launcher started, `gloo` elsewhere; chosen when a program is lowered",
             "collectives", _choice(auto="mpi under an MPI launcher, else gloo",
                                    mpi="MPI collectives", gloo="JAX's gloo path")),
    Variable("JAX_CPU_MPI_COMBINE_BYTES", "runtime", "64KiB",
             "all-reduces over MPI (`psum`, `pmean`, `pmax`, `pmin`) of at most this many "
             "bytes each, of one group, reduction and dtype, that a program runs one after "
             "another (JAX binds `psum` of a pytree leaf by leaf) go as one call over their "
             "concatenated operands, as XLA's all-reduce combiner merges its own: one meeting "
             "and one MPI all-reduce instead of one per leaf (at most 4 MiB merged); `0`: "
             "each its own call; chosen when a program is lowered", "combine_bytes",
             _byte_count_or_zero),
    Variable("JAX_CPU_MPI_POISON_UNINITIALIZED", "runtime", "0",
             "`1`: the buffers that start uninitialized instead of zeroed (the slots of a "
             "pipeline's kept residuals, `remat=False`; the output of a precv on a device "
             "that is no destination, where the program selects the zeros after it) are "
             "filled, at every run, with NaN "
             "in floats (all bits set; the sign bit in the FNUZ float8 types), the most "
             "negative value in signed integers, the largest in unsigned ones and true in "
             "booleans, so that a read before a write shows in the results instead of "
             "reading whatever memory held (often zeros); a check for tests and debugging, "
             "it costs the write that leaving them uninitialized saves. Read at each run "
             "(`configure(poison_uninitialized=True)` applies to compiled programs too)",
             "poison_uninitialized",
             _boolean("fill with NaN / extreme values", "leave as they are")),
    Variable("JAX_CPU_MPI_DISABLE", "runtime", "0",
             "`1`: `import jax_cpu_mpi` and JAX's plugin discovery register nothing (JAX "
             "behaves as without jax_cpu_mpi); `jax_cpu_mpi.install()` still registers "
             "everything", None,
             _boolean("register nothing automatically", "register on import")),
    Variable("JAX_CPU_MPI_PRIMITIVES", "runtime", "auto",
             "`auto`: bind JAX's psend/precv primitives while JAX has them, jax_cpu_mpi's "
             "after; `ours`: jax_cpu_mpi's always, as once JAX drops them (to check a "
             "migration; read once, at import)", None,
             _choice(auto="JAX's primitives while JAX has them",
                     ours="jax_cpu_mpi's always")),
    Variable("JAX_CPU_MPI_WAIT", "runtime", "auto",
             "how a thread waiting for an MPI peer waits: `auto` spins 10 us, yields its "
             "core up to 1 ms, then sleeps, unless this node's ranks x devices outnumber its "
             "cores (then it sleeps soon, so that the waiter leaves the core to the thread it "
             "waits for); `spin`: spin (2000 polls) and yield long (hundreds of ms) before "
             "sleeping, for ranks bound each to its own core; `sleep`: always sleep soon "
             "(`jax_cpu_mpi.stats()` counts the waits' yields and sleeps). A sleep lasts up "
             "to 50 us; when sleeping soon, in a wait that has slept longer, up to 1/16 of "
             "the time slept (at most 500 us: a peer computing, whose threads the waiter "
             "wakes that much less often). A collective's "
             "wait spins at most 10 us, less where its waits end only once it yields (ranks "
             "sharing a core), as MPICH's own blocking wait yields at once; with several "
             "devices per process only a small one's (up to 8 KiB), the others as "
             "above. So do a precv's waits for its message (and, on the rendezvous "
             "path, for the kept sends it finishes), with one device per process. "
             "Unless `sleep`, a device that waits at a "
             "collective for the other devices of its process yields its core a while (at "
             "most 200 us, adapted to how its waits end) before it sleeps; on a node with "
             "more busy threads than cores only while another of those devices last ran on "
             "its core (read when MPI is attached)", None,
             _choice(auto="spin briefly, yield, then sleep; sleep soon when the node is "
                          "oversubscribed",
                     spin="spin and yield long", sleep="sleep soon")),
    Variable("JAX_CPU_MPI_PARK", "runtime", "off",
             "with several devices per process, whether a device that does not lead its "
             "process's meeting in a collective over MPI parks (its call returns at once and "
             "its program resumes on the thread of another device of the meeting, saving a "
             "context switch per collective) instead of waiting there: `auto` where this "
             "node's ranks x devices outnumber its cores and `JAX_CPU_MPI_WAIT` is `auto`; "
             "`on` always; `off` never. In every case only in programs whose other steps "
             "cannot wait for another device (no psend/precv, no collective of XLA's own, "
             "no host callback: docs \"Collectives over MPI\"); others wait in their "
             "meetings. Off by default: it cuts the context switches but no quiet run has "
             "shown it faster yet (read when MPI is attached)", None,
             _choice(auto="park on an oversubscribed node", on="park always",
                     off="wait in the meeting")),
    Variable("JAX_CPU_MPI_KEEP_FREED_MEMORY", "runtime", "0",
             "`1`: the process keeps the memory malloc frees (glibc: "
             "`mallopt` `M_MMAP_MAX` 0 and `M_TRIM_THRESHOLD` 2 GiB), so that XLA's large "
             "per-call buffers are not page-faulted in, and zeroed by the kernel, again at "
             "every call (docs \"Benchmarks\": the one-way large hop; \"Train a "
             "transformer\": the kept residuals). Read at `import jax_cpu_mpi`, in one "
             "process too, and again once MPI is attached. Blocks of 64 MiB or "
             "more that XLA's threads allocate still get fresh pages (a thread's malloc arena "
             "holds less), and what a block finds free depends on what ran before (docs "
             "\"Benchmarks\": the faults per hop, with and without). Cost: the process "
             "holds on to the peak of its heap until it exits, and that peak may be higher "
             "(20-30 % in the benchmark); the zeros of a precv that is no destination are then "
             "written, not given back to the kernel (docs \"Concepts\"); no effect where "
             "the C library is not glibc", None,
             _boolean("keep freed memory", "glibc's defaults")),
    Variable("JAX_CPU_MPI_TRACE", "runtime", "(off)",
             "a directory: every process records each psend/precv it executes (device, peer, "
             "bytes, path, time waiting) and writes one Chrome-trace JSON file there at exit "
             "and on `jax_cpu_mpi.trace_flush()`; `python -m jax_cpu_mpi trace DIR` merges "
             "them into one timeline and a picture (docs: \"Timeline\")", None, _directory),
    Variable("JAX_CPU_MPI_TRACE_EVENTS", "runtime", "65536",
             "events each device thread keeps between two trace flushes; further ones are "
             "counted as dropped (the file and a warning say how many)", None,
             _positive_count),
    Variable("JAX_CPU_MPI_DEBUG", "runtime", "0",
             "`1`: one line per psend/precv on stderr (process, device, op, peer, bytes, "
             "path, duration, time waiting)", None,
             _boolean("log every message", "no log")),
    Variable("JAX_CPU_MPI_MPICC", "build", "(the mpich wheel)",
             "CMake option (`-Ccmake.define.JAX_CPU_MPI_MPICC=...`): the `mpicc` of the MPI "
             "to build the extension against"),
    Variable("JAX_CPU_MPI_SANITIZE", "build", "OFF",
             "CMake option: build the extension with AddressSanitizer and UBSan "
             "(`scripts/sanitize.sh`)"),
    Variable("JAX_CPU_MPI_PCH", "build", "ON",
             "CMake option: precompile the outside headers (XLA FFI, MPI, the standard "
             "library's) for a faster build; `OFF` checks that each file includes what it "
             "uses (docs \"Development\")"),
    Variable("JAX_CPU_MPI_FFI_INCLUDE_DIR", "build", "(jaxlib's)",
             "CMake option: the folder of the XLA FFI headers to build against "
             "(default: those of the installed jaxlib)"),
    Variable("JAX_CPU_MPI_FFI_HEADERS_FROM", "build", "(empty)",
             "CMake option: where `JAX_CPU_MPI_FFI_INCLUDE_DIR` comes from, for the record "
             "(e.g. `jaxlib 0.11.2`; `jax-cpu-mpi info` shows it)"),
    Variable("JAX_CPU_MPI_MPI_FROM_WHEEL", "build", "(set by CMake)",
             "compile definition that `CMakeLists.txt` sets when the extension is built "
             "against the `mpich` wheel; not for users to set"),
    Variable("JAX_CPU_MPI_CI_NEW_PYTHON", "ci", "python3.12",
             "`.ci/run`: the Python (3.12 or newer) of the second, current-JAX run"),
    Variable("JAX_CPU_MPI_BENCH_LOCAL_INFLIGHT", "bench", "8",
             "`python -m jax_cpu_mpi.bench`: psend/precv calls kept in flight at once in the "
             "in-process per-call bandwidth test (more than 32 deadlock: XLA's per-device "
             "limit)"),
)

BY_NAME: dict[str, Variable] = {v.name: v for v in VARIABLES}
PREFIX = "JAX_CPU_MPI_"


def _env_bool(name: str, default: bool) -> bool:
    value = BY_NAME[name].read()
    return default if value is None else value


#: Environment variable that turns automatic registration off (``import jax_cpu_mpi`` and
#: JAX's plugin discovery alike); ``jax_cpu_mpi.install()`` still registers everything.
DISABLE_ENV = "JAX_CPU_MPI_DISABLE"


def disabled() -> bool:
    """Whether :data:`DISABLE_ENV` asks for no automatic registration (ConfigError if its
    value is no boolean)."""
    return _env_bool(DISABLE_ENV, False)


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Parse every variable jax_cpu_mpi reads; ConfigError naming each bad one."""
    problems = []
    for var in VARIABLES:
        try:
            var.read(environ)
        except ConfigError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError("\n".join(problems))


def from_environment() -> Config:
    """The configuration described by the ``JAX_CPU_MPI_*`` environment variables
    (ConfigError if any variable jax_cpu_mpi reads has a bad value)."""
    check_environment()
    values = {}
    for var in VARIABLES:
        if var.field is not None:
            value = var.read()
            if value is not None:
                values[var.field] = value
    return Config(**values)


def unknown_names(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """``{unknown JAX_CPU_MPI_* name in the environment: the closest known name or None}``."""
    env = os.environ if environ is None else environ
    known = {name[len(PREFIX):]: name for name in BY_NAME}  # compared without the prefix

    def closest(name: str) -> str | None:
        found = difflib.get_close_matches(name[len(PREFIX):], list(known), n=1, cutoff=0.6)
        return known[found[0]] if found else None

    return {name: closest(name) for name in sorted(env)
            if name.startswith(PREFIX) and name not in BY_NAME}


_warned_unknown = False


def warn_about_unknown_names(stacklevel: int = 2) -> None:
    """One :class:`ConfigWarning` (once per process) naming every unknown ``JAX_CPU_MPI_*``
    variable of the environment and the known one it most resembles."""
    global _warned_unknown
    unknown = unknown_names()
    if _warned_unknown or not unknown:
        return
    _warned_unknown = True
    described = "; ".join(
        f"{name} is not a jax_cpu_mpi variable and is ignored"
        + (f" (did you mean {close}?)" if close else "")
        for name, close in unknown.items())
    warnings.warn(f"jax_cpu_mpi: {described}. The variables jax_cpu_mpi reads: "
                  f"{', '.join(v.name for v in VARIABLES if v.kind == 'runtime')} (docs: "
                  "Configuration).", ConfigWarning, stacklevel=stacklevel + 1)


def markdown_table() -> str:
    """A Markdown table of :data:`VARIABLES` (the docs' "Configuration" page is built from
    the same registry)."""
    kinds = {"runtime": "", "build": "build: ", "ci": "CI: ", "bench": "benchmarks: "}
    lines = ["| variable | `configure` field | default | meaning |", "|---|---|---|---|"]
    for var in VARIABLES:
        field_text = f"`{var.field}`" if var.field else ""
        lines.append(f"| `{var.name}` | {field_text} | `{var.default}` | "
                     f"{kinds[var.kind]}{var.meaning} |")
    return "\n".join(lines)


_current: Config | None = None


def current() -> Config:
    """The configuration in force: on first use, read from the environment (ConfigError if
    a variable has a bad value) and pushed into the extension."""
    global _current
    if _current is None:
        cfg = from_environment()
        _push(cfg)
        _current = cfg
    return _current


def _push(cfg: Config) -> None:
    from jax_cpu_mpi import _jax_cpu_mpi as ext

    ext.configure(cfg.recv_timeout, cfg.max_inflight_bytes)
    ext.set_poison_uninitialized(cfg.poison_uninitialized)


def configure(**changes: float | int | bool) -> Config:
    """Change settings for this process, e.g. ``configure(recv_timeout=30)``.

    Takes effect for every psend/precv executed afterwards (compiled programs included).
    """
    global _current
    new = replace(current(), **changes)  # type: ignore[arg-type]
    _push(new)
    _current = new
    return new


@contextlib.contextmanager
def overrides(**changes: float | int | bool) -> Iterator[Config]:
    """Temporarily change settings: ``with overrides(gpu_parity=False): ...``."""
    before = current()
    try:
        yield configure(**changes)
    finally:
        configure(**{f.name: getattr(before, f.name) for f in fields(before)})


def apply() -> None:
    """Push the current configuration into the extension (ConfigError for a bad value)."""
    _push(current())
