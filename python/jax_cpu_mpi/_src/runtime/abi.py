"""Is the MPI of our extension the MPI that mpi4py loaded? Checked before MPI is attached.

jax_cpu_mpi's extension is linked against one MPI library (the ``mpich`` wheel by default,
or the one whose ``mpicc`` was given at build time). mpi4py 4 picks its MPI at run time
(``mpi4py/_mpiabi.py``: the first ``libmpi`` it finds, or ``MPI4PY_MPIABI`` /
``MPI4PY_LIBMPI``). If the two differ, the process holds two MPI libraries: the
communicator mpi4py initializes means nothing to ours, and the job crashes or hangs far
from the cause. So before we take ``MPI_COMM_WORLD`` from mpi4py we compare:

* ``MPI_Get_library_version()`` as our extension and as mpi4py see it,
* the ABI each side was built for (``mpich``: MPICH, Intel MPI, MVAPICH... with integer
  handles; ``openmpi``; ``mpiabi``: the MPI 5 standard ABI),
* on Linux, the ``libmpi`` file each side's symbols resolve to.

:func:`check_mpi4py` raises :class:`MpiMismatchError`, naming both libraries and the two
ways to fix it. Nothing here initializes MPI.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import sys
from dataclasses import dataclass
from types import ModuleType

from jax_cpu_mpi import _jax_cpu_mpi as ext
from jax_cpu_mpi._src.compat.mpi4py_names import predicted_mpi4py_abi

#: ``MPI.<abi>.cpython-311-x86_64-linux-gnu.so``: the ABI variant mpi4py 4 loaded.
_MPI4PY_ABI_IN_FILENAME = re.compile(r"^MPI\.([A-Za-z0-9]+)\.")
_LIBMPI_FILENAME = re.compile(r"^libmpi(_abi)?\.so(\.\d+)*$")



def rebuild_hint(mpicc: str = "/path/to/that/mpi/bin/mpicc") -> str:
    """The command that rebuilds jax_cpu_mpi against the MPI of ``mpicc``."""
    return ("pip install --no-build-isolation --force-reinstall --no-deps "
            f"-Ccmake.define.JAX_CPU_MPI_MPICC={mpicc} jax-cpu-mpi")


class MpiMismatchError(RuntimeError):
    """jax_cpu_mpi and mpi4py would use two different MPI libraries in one process."""


@dataclass(frozen=True)
class MpiLibrary:
    """One side's MPI: what ``MPI_Get_library_version`` says, its ABI and its file."""

    who: str
    library_version: str
    abi: str | None
    path: str | None

    @property
    def summary(self) -> str:
        """The first line of the version string (``MPICH Version: 5.0.2``, ``Open MPI v5.0.11``)."""
        first = self.library_version.splitlines()[0] if self.library_version else "unknown MPI"
        return " ".join(first.split(",")[0].split())

    def describe(self) -> str:
        abi = self.abi or "unknown"
        where = f", {self.path}" if self.path else ""
        return f"{self.summary} (ABI {abi}{where})"


def normalize_version(text: str) -> str:
    """``MPI_Get_library_version`` text without NUL padding and trailing blanks."""
    return text.replace("\x00", "").strip()


def extension_abi(build_info: dict) -> str | None:
    """The ABI our extension was compiled for, from ``_jax_cpu_mpi.mpi_build_info()``."""
    vendor = str(build_info.get("vendor", ""))
    handle_bytes = int(build_info.get("comm_handle_bytes", 0))
    if vendor == "Open MPI":
        return "openmpi"
    if vendor == "MPICH":
        return "mpich" if handle_bytes == 4 else "mpiabi"
    return None


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _dladdr():
    for name in (None, ctypes.util.find_library("dl")):
        try:
            fn = ctypes.CDLL(name).dladdr
        except (OSError, AttributeError, TypeError):
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        fn.restype = ctypes.c_int
        return fn
    return None


def libmpi_of(shared_object: str | None) -> str | None:
    """The ``libmpi`` file that ``MPI_Get_library_version`` resolves to for an already
    loaded shared object (our extension, mpi4py's ``MPI`` module); ``None`` if unknown."""
    if not shared_object or not sys.platform.startswith("linux"):
        return None
    dladdr = _dladdr()
    if dladdr is None:
        return None
    try:
        # RTLD_NOLOAD: only look at the copy already in the process, never load another.
        lib = ctypes.CDLL(shared_object, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        address = ctypes.cast(lib.MPI_Get_library_version, ctypes.c_void_p).value
    except (OSError, AttributeError, ValueError):
        return None
    info = _DlInfo()
    if not address or not dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(info.dli_fname.decode())


def loaded_mpi_libraries() -> list[str]:
    """The ``libmpi*.so`` files mapped into this process (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps if "libmpi" in line}
    except OSError:
        return []
    found = {os.path.realpath(p) for p in paths
             if p.startswith("/") and _LIBMPI_FILENAME.match(os.path.basename(p))}
    return sorted(found)


def extension_mpi() -> MpiLibrary:
    """The MPI our extension is linked against (no MPI initialization needed)."""
    return MpiLibrary(
        who="jax_cpu_mpi",
        library_version=normalize_version(ext.mpi_library_version()),
        abi=extension_abi(dict(ext.mpi_build_info())),
        path=libmpi_of(ext.__file__),
    )


def mpi4py_abi(mpi_module: ModuleType) -> str | None:
    """The ABI variant of mpi4py's ``MPI`` module (``None`` for a single-MPI build)."""
    match = _MPI4PY_ABI_IN_FILENAME.match(os.path.basename(getattr(mpi_module, "__file__", "")))
    return match.group(1).lower() if match else None


def mpi4py_mpi(mpi_module: ModuleType) -> MpiLibrary:
    """The MPI that mpi4py loaded (``mpi_module`` is ``mpi4py.MPI``)."""
    return MpiLibrary(
        who="mpi4py",
        library_version=normalize_version(mpi_module.Get_library_version()),
        abi=mpi4py_abi(mpi_module),
        path=libmpi_of(getattr(mpi_module, "__file__", None)),
    )


def mismatch(ours: MpiLibrary, theirs: MpiLibrary) -> str | None:
    """Why ``ours`` and ``theirs`` are not the same MPI library, or ``None`` if they are."""
    if ours.library_version != theirs.library_version:
        return "they report different MPI libraries"
    if ours.abi and theirs.abi and ours.abi != theirs.abi:
        return f"they were built for different MPI ABIs ({ours.abi} vs {theirs.abi})"
    if ours.path and theirs.path and ours.path != theirs.path:
        return "they resolve MPI calls to two different library files"
    return None


def _mpicc_of(library: MpiLibrary) -> list[str]:
    """``[<prefix>/bin/mpicc]`` for a library in ``<prefix>/lib``, if that mpicc exists."""
    if library.path:
        mpicc = os.path.join(os.path.dirname(os.path.dirname(library.path)), "bin", "mpicc")
        if os.path.exists(mpicc):
            return [mpicc]
    return []


def mismatch_message(ours: MpiLibrary, theirs: MpiLibrary, reason: str,
                     theirs_label: str = "mpi4py loaded:") -> str:
    """The error text: both libraries, and how to make them one."""
    loaded = loaded_mpi_libraries()
    if ours.path:
        point_mpi4py = f"MPI4PY_LIBMPI={ours.path}"
    elif ours.abi:
        point_mpi4py = f"MPI4PY_MPIABI={ours.abi}"
    else:
        point_mpi4py = ""
    lines = [
        f"jax_cpu_mpi and mpi4py use different MPI libraries in this process ({reason}):",
        f"  {'jax_cpu_mpi was built against:':<31}{ours.describe()}",
        f"  {theirs_label:<31}{theirs.describe()}",
    ]
    if len(loaded) > 1:
        lines.append(f"  libmpi files mapped in this process: {', '.join(loaded)}")
    lines += [
        "Messages cannot pass between two MPI libraries. Use one MPI for both, and launch "
        "with that MPI's mpirun/srun:",
        (f"  * make mpi4py load jax_cpu_mpi's MPI: set {point_mpi4py} (read by mpi4py), "
         "or install an mpi4py built against it;")
        if point_mpi4py else "  * install an mpi4py built against jax_cpu_mpi's MPI;",
        f"  * or rebuild jax_cpu_mpi against mpi4py's MPI: {rebuild_hint(*_mpicc_of(theirs))}",
    ]
    return "\n".join(lines)


def check_before_mpi4py_import() -> None:
    """Refuse to let mpi4py initialize an MPI of another ABI than ours (when mpi4py says
    in advance which one it will load). Does nothing once ``mpi4py.MPI`` is imported."""
    if "mpi4py.MPI" in sys.modules:
        return
    ours = extension_mpi()
    predicted = predicted_mpi4py_abi()
    if ours.abi and predicted and predicted != ours.abi:
        theirs = MpiLibrary("mpi4py", "an MPI library", predicted, None)
        raise MpiMismatchError(mismatch_message(
            ours, theirs, "they are built for different MPI ABIs", "mpi4py would load:"))


def check_mpi4py(mpi_module: ModuleType) -> MpiLibrary:
    """Raise :class:`MpiMismatchError` unless mpi4py's MPI is our extension's MPI.

    Returns the (common) library on success.
    """
    ours = extension_mpi()
    theirs = mpi4py_mpi(mpi_module)
    reason = mismatch(ours, theirs)
    if reason is not None:
        raise MpiMismatchError(mismatch_message(ours, theirs, reason))
    return ours


__all__ = [
    "MpiLibrary",
    "MpiMismatchError",
    "check_before_mpi4py_import",
    "check_mpi4py",
    "extension_mpi",
    "loaded_mpi_libraries",
    "mismatch",
    "mpi4py_abi",
    "mpi4py_mpi",
    "predicted_mpi4py_abi",
    "rebuild_hint",
]
