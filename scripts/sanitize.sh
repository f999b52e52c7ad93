#!/usr/bin/env bash
# Build the C++ extension with AddressSanitizer + UBSan (CMake option JAX_CPU_MPI_SANITIZE)
# into a throwaway directory and run a representative part of the test suite against it:
# the single-process psend/precv tests, the reliability tests that run in this process, and
# mpirun tests (2 ranks: the MPI transport, in-flight bound, sends in flight at exit).
# Fails if the build or a test fails, or if any process (pytest, child processes, MPI ranks)
# wrote a sanitizer report.
#
#   scripts/sanitize.sh                 # uses $PYTHON, else .venv/bin/python, else python3
#   PYTHON=/path/to/venv/bin/python KEEP=1 scripts/sanitize.sh -k ring   # extra pytest args
#   QUICK=1 scripts/sanitize.sh         # only the smoke tests and one stress test
#   WORK=DIR BUILD_ONLY=1 scripts/sanitize.sh   # build into DIR (kept) and stop
#   WORK=DIR scripts/sanitize.sh        # reuse DIR's build (CMake rebuilds what changed)
#   UNITY=OFF scripts/sanitize.sh       # compile file by file, not as a unity build
#
# The installed package is left alone: a sitecustomize.py on PYTHONPATH makes Python (and
# every child process) import jax_cpu_mpi from the throwaway directory instead of the
# installed or editable one. Needs cmake, ninja (or make) and the gcc that built libasan.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-}
if [[ -z $python ]]; then
  if [[ -x $root/.venv/bin/python ]]; then python=$root/.venv/bin/python; else python=python3; fi
fi
python=$(command -v "$python")
prefix=$("$python" -c 'import sys; print(sys.prefix)')
export PATH="$(dirname "$python"):$PATH"   # mpirun, cmake, ninja of that environment first

if [[ -n ${WORK:-} ]]; then  # a directory of the caller's, kept: its build is reused
  work=$WORK
  mkdir -p "$work"
  rm -f "$work"/report* "$work"/selftest*
else
  work=$(mktemp -d "${TMPDIR:-/tmp}/jcm-sanitize-XXXXXX")
  if [[ -z ${KEEP:-} ]]; then trap 'rm -rf "$work"' EXIT; else echo "keeping $work"; fi
fi

echo "== building the extension with -DJAX_CPU_MPI_SANITIZE=ON in $work/build"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
# -O1 -g1 (line tables, enough for the reports' stacks): the sanitizers' usual level, and the
# build costs about two thirds of RelWithDebInfo's (-O2 -g) CPU time. CXXFLAGS overrides it.
# A unity build (CMakeLists.txt says why): the sanitizers instrument the same code, and their
# reports still name each source file and line. UNITY=OFF compiles file by file.
cmake -S "$root" -B "$work/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=None \
  -DCMAKE_CXX_FLAGS="${CXXFLAGS:--O1 -g1}" -DCMAKE_UNITY_BUILD="${UNITY:-ON}" \
  -DJAX_CPU_MPI_SANITIZE=ON -DPython_EXECUTABLE="$python" >"$work/cmake.log" 2>&1 \
  || { cat "$work/cmake.log"; exit 1; }
cmake --build "$work/build" -j "$(nproc)" >>"$work/cmake.log" 2>&1 \
  || { cat "$work/cmake.log"; exit 1; }
if [[ -n ${BUILD_ONLY:-} ]]; then echo "== built $work/build"; exit 0; fi

site=$work/site
mkdir -p "$site"
cp -r "$root/python/jax_cpu_mpi" "$site/"
find "$site" \( -name '*.so' -o -name __pycache__ \) -prune -exec rm -rf {} +
cp "$work"/build/_jax_cpu_mpi*.so "$site/jax_cpu_mpi/"
cat >"$site/sitecustomize.py" <<'PY'
# Written by scripts/sanitize.sh: import jax_cpu_mpi from this directory, not from an
# editable install (whose import hook sits in front of sys.path).
import sys

sys.meta_path[:] = [f for f in sys.meta_path if "ScikitBuild" not in type(f).__name__]
PY

asan=$(gcc -print-file-name=libasan.so)
stdcxx=$(g++ -print-file-name=libstdc++.so)
[[ -f $asan ]] || { echo "libasan.so not found (gcc -print-file-name=libasan.so)"; exit 1; }
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export LD_LIBRARY_PATH="$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"  # libmpi of the wheel
# libstdc++ too: Python does not link it, and ASan must find it at start-up to intercept
# __cxa_throw (jaxlib throws C++ exceptions).
export LD_PRELOAD="$asan $stdcxx"
# Python and jaxlib leak at exit by design: leak checking off. Every report goes to a file
# (one per process), so reports of MPI ranks and child processes cannot go unseen.
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:log_path=$work/report"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$work/report"

"$python" - "$site" <<'PY'
import sys

import jax_cpu_mpi._jax_cpu_mpi as ext

assert ext.__file__.startswith(sys.argv[1]), f"imported {ext.__file__}, not the sanitized build"
with open(ext.__file__, "rb") as f:
    assert b"__asan_report" in f.read(), "the extension is not instrumented"
print(f"sanitized extension: {ext.__file__}")
PY

# The reporting itself must work: a deliberate heap overflow has to leave a report.
ASAN_OPTIONS="detect_leaks=0:log_path=$work/selftest" "$python" -c '
import ctypes
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
ctypes.memset(libc.malloc(64), 0, 65)  # one byte past the end
' 2>/dev/null && { echo "ASan did not stop a heap overflow"; exit 1; }
compgen -G "$work/selftest*" >/dev/null || { echo "ASan wrote no report for a heap overflow"; exit 1; }
rm -f "$work"/selftest*

echo "== running the tests under ASan + UBSan"
cd "$root"
status=0
if [[ -n ${QUICK:-} ]]; then  # a few minutes less: the smoke tests and one stress test
  tests=(tests/test_smoke.py
         "tests/runtime/test_reliability.py::test_many_messages_in_flight_on_eight_devices_never_mix")
else
  tests=(tests/test_smoke.py
         tests/lowering/test_p2p_single_process.py
         tests/passes/test_kept_operands.py
         tests/trace/test_trace.py
         tests/lowering/test_p2p_errors.py
         "tests/runtime/test_reliability.py::test_rendezvous_direct_staged_and_mismatched_messages"
         "tests/runtime/test_reliability.py::test_back_to_back_programs_on_same_and_disjoint_devices_never_mix"
         "tests/runtime/test_reliability.py::test_many_messages_in_flight_on_eight_devices_never_mix"
         "tests/runtime/test_reliability.py::test_ten_thousand_steps_in_one_process_keep_memory_flat"
         "tests/runtime/test_reliability.py::test_ten_thousand_steps_and_back_to_back_programs_over_mpi"
         tests/runtime/test_p2p_mpi.py::test_inflight_bound_and_sends_in_flight_at_exit)
fi
"$python" -m pytest -q -p no:cacheprovider "${tests[@]}" \
  "$@" || status=$?


if compgen -G "$work/report*" >/dev/null; then
  echo "== sanitizer reports:"
  for f in "$work"/report*; do echo "--- $f"; cat "$f"; done
  exit 1
fi
[[ $status -eq 0 ]] || { echo "== tests failed under the sanitizers (exit $status)"; exit "$status"; }
echo "== sanitizers: clean"
