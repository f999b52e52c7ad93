"""Build jax_cpu_mpi against the previous jaxlib series' XLA FFI headers, under ROOT.

``python older_jaxlib_build.py ROOT REPO``, run for tests/compat/test_jaxlib_versions.py's
``older_build`` fixture (in the background from the start of the session, see
background_builds.py):

* ROOT/wheels: the newest jaxlib wheel of the previous series (from the package index);
* ROOT/headers: its ``jaxlib/include`` directory, and ROOT/build.json the jaxlib version
  and the headers' FFI API minor version;
* ROOT/dist: the wheel of REPO built against those headers, unpacked into ROOT/site.

Exit 0 when built; :data:`NO_OLDER` when the installed jaxlib has no older supported
series, :data:`NO_INDEX` when the package index cannot give that jaxlib (the tests skip
with the last line printed); anything else when the build failed (the tests fail with
this output).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

NO_INDEX = 3
NO_OLDER = 4

#: For the installed jaxlib series, the older supported series whose headers we build with.
OLDER_SERIES = {"0.12": ("0.11", "0.12"), "0.11": ("0.10.2", "0.11")}


def _series(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _api_minor(include: Path) -> int:
    for line in (include / "xla" / "ffi" / "api" / "c_api.h").read_text().splitlines():
        if line.startswith("#define XLA_FFI_API_MINOR"):
            return int(line.split()[-1])
    raise SystemExit("no XLA_FFI_API_MINOR in the headers")


def main(root: Path, repo: Path) -> int:
    installed = metadata.version("jaxlib")
    if _series(installed) not in OLDER_SERIES:
        print(f"jaxlib {installed}: no older jaxlib series that jax_cpu_mpi supports")
        return NO_OLDER
    low, high = OLDER_SERIES[_series(installed)]
    # No timeouts of their own: niced in the background, these steps take what CPU the tests
    # leave; the fixture's wait is the limit (it kills the whole build).
    download = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         "-d", str(root / "wheels"), f"jaxlib>={low},<{high}"],
        capture_output=True, text=True)
    if download.returncode != 0:
        print("cannot download an older jaxlib from the package index (no network?): "
              f"{(download.stdout + download.stderr).strip().splitlines()[-3:]}")
        return NO_INDEX
    (wheel,) = (root / "wheels").glob("jaxlib-*.whl")
    version = wheel.name.split("-")[1]
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.startswith("jaxlib/include/xla/ffi/"):
                archive.extract(name, root / "headers")
    include = root / "headers" / "jaxlib" / "include"
    if not (include / "xla" / "ffi" / "api" / "ffi.h").exists():
        print(f"jaxlib {version}'s wheel has no XLA FFI headers")
        return 1
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "-w", str(root / "dist"), f"-Cbuild-dir={root / 'build'}",
         f"-Ccmake.define.JAX_CPU_MPI_FFI_INCLUDE_DIR={include}",
         f"-Ccmake.define.JAX_CPU_MPI_FFI_HEADERS_FROM=jaxlib {version}",
         # Unoptimized, like the Open MPI wheel's build: this build checks that the older
         # headers compile and run with this jaxlib, not speed, and -O3 costs about 60 %
         # more compile time, on a 2-core CI machine that the tests share.
         "-Ccmake.build-type=None",
         # A unity build (CMakeLists.txt says why): the headers are the subject, and every
         # file still compiles against them, in batches.
         "-Ccmake.define.CMAKE_UNITY_BUILD=ON", str(repo)],
        capture_output=True, text=True, env={**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": "2"})
    if build.returncode != 0:
        print(build.stdout[-5000:] + build.stderr[-5000:])
        return 1
    (built,) = (root / "dist").glob("jax_cpu_mpi-*.whl")
    with zipfile.ZipFile(built) as archive:
        archive.extractall(root / "site")
    (root / "build.json").write_text(json.dumps(
        {"version": version, "api_minor": _api_minor(include)}))
    print(f"built {built} against jaxlib {version}'s headers")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
