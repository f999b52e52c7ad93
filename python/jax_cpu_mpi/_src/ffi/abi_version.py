"""Can this jaxlib register our FFI handlers? (XLA FFI API versions, checked before we try.)

The extension is compiled against one jaxlib's XLA FFI headers, which fix the FFI API
version its handlers report (``XLA_FFI_API_MAJOR.MINOR``: 0.3 in jaxlib 0.10, 0.4 in 0.11,
0.5 in 0.12). When a handler is registered, XLA accepts it if its version is not newer than
its own and not older than its minimum (0.1 in jaxlib 0.11 and 0.12). A handler that is
too new does not fail at registration: it makes XLA's CPU backend fail to start, so every
``jax.devices()`` of the environment would fail. This happens when the extension was built
against a newer jaxlib than the installed one (``pip install .`` with build isolation
builds against the newest jaxlib in range, unless the target environment already has one).

So :func:`mismatch` compares the extension's version with the installed jaxlib's (read from
the headers it ships, which match its runtime) before the lowerings register anything.
"""

from __future__ import annotations

import re
from pathlib import Path

from jax_cpu_mpi import _jax_cpu_mpi as ext
from jax_cpu_mpi._src.compat import jaxlib_version

_DEFINE = re.compile(r"^#define XLA_FFI_API_(MAJOR|MINOR)\s+(\d+)", re.M)


def built_api() -> tuple[int, int, str]:
    """(major, minor, which jaxlib's headers) of the extension."""
    info = dict(ext.ffi_build_info())
    return int(info["api_major"]), int(info["api_minor"]), str(info.get("headers_from", ""))


def runtime_api() -> tuple[int, int] | None:
    """(major, minor) of the installed jaxlib, from its own headers (None if unknown)."""
    try:
        import jax.ffi

        text = (Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h").read_text()
    except Exception:
        return None
    found = dict(_DEFINE.findall(text))
    if set(found) != {"MAJOR", "MINOR"}:
        return None
    return int(found["MAJOR"]), int(found["MINOR"])


def mismatch_message(built: tuple[int, int, str], runtime: tuple[int, int] | None,
                     jaxlib: str) -> str | None:
    """Why jaxlib ``jaxlib`` (FFI API ``runtime``) cannot take our handlers, or None."""
    major, minor, headers = built
    if runtime is None or (major == runtime[0] and minor <= runtime[1]):
        return None
    source = f" (the headers of {headers})" if headers else ""
    return (
        f"the extension was built against XLA FFI API {major}.{minor}{source}, newer than "
        f"the installed jaxlib {jaxlib} supports ({runtime[0]}.{runtime[1]}); registering "
        "its handlers would stop XLA's CPU backend from starting. Rebuild jax_cpu_mpi "
        "against the installed jaxlib: pip install --no-build-isolation --force-reinstall "
        "--no-deps . (with scikit-build-core, nanobind, cmake and ninja installed), or "
        "install the jaxlib you want before installing jax_cpu_mpi")


def mismatch() -> str | None:
    """Why the installed jaxlib cannot take our handlers, or None if it can (or if unknown)."""
    jaxlib = jaxlib_version() or "?"
    return mismatch_message(built_api(), runtime_api(), jaxlib)
