#!/usr/bin/env bash
# Record the point-to-point benchmark of this machine:
#   benchmarks/run.sh [OUT_DIR] [extra options of python -m jax_cpu_mpi.bench]
# Writes OUT_DIR/{results.jsonl,osu.txt,nccl.txt,targets.txt,plot.png,stdout.txt} (2 ranks)
# and the same in OUT_DIR/one-process/ (one process: the in-process methods with ppermute).
#
# Environment: PYTHON (default: python), MPIRUN (default: the mpirun next to PYTHON, else
# mpirun on PATH), NP (ranks, default 2), QUIET_IDLE (wait until the CPUs are this % idle
# before starting, default 90; 0 disables), QUIET_WAIT (give up waiting after this many
# seconds, default 600).
set -euo pipefail

PYTHON=${PYTHON:-python}
PYDIR=$(dirname "$(command -v "$PYTHON")")
MPIRUN=${MPIRUN:-$( [ -x "$PYDIR/mpirun" ] && echo "$PYDIR/mpirun" || echo mpirun )}
NP=${NP:-2}
# A lost message fails the run after 2 minutes instead of the default 5.
export JAX_CPU_MPI_RECV_TIMEOUT=${JAX_CPU_MPI_RECV_TIMEOUT:-120}
OUT=${1:-benchmarks/results/$(hostname)}
shift || true
mkdir -p "$OUT/one-process"

# Other work on the machine shows up in the numbers: wait for a quiet moment.
idle_percent() {  # CPU idle % over one second, from /proc/stat
  read -r _ u1 n1 s1 i1 w1 q1 sq1 st1 _ < /proc/stat
  sleep 1
  read -r _ u2 n2 s2 i2 w2 q2 sq2 st2 _ < /proc/stat
  local busy=$(( (u2-u1)+(n2-n1)+(s2-s1)+(q2-q1)+(sq2-sq1)+(st2-st1) ))
  local idle=$(( (i2-i1)+(w2-w1) ))
  echo $(( 100 * idle / (busy + idle + 1) ))
}
if [ -r /proc/stat ] && [ "${QUIET_IDLE:-90}" -gt 0 ]; then
  waited=0
  while [ "$(idle_percent)" -lt "${QUIET_IDLE:-90}" ] && [ "$waited" -lt "${QUIET_WAIT:-600}" ]; do
    waited=$((waited + 1))
  done
  echo "# started after waiting ${waited}s for the CPUs to be ${QUIET_IDLE:-90}% idle" >&2
fi

"$MPIRUN" -n "$NP" "$PYTHON" -m jax_cpu_mpi.bench --repeat 3 --format osu,nccl \
  --out "$OUT" "$@" | tee "$OUT/stdout.txt"

# One process without mpirun: the in-process methods again, with XLA's in-process ppermute
# (which a multi-process JAX job routes through gloo, where it hangs at large sizes).
env -u PMI_RANK -u PMI_SIZE "$PYTHON" -m jax_cpu_mpi.bench --repeat 3 --format osu,nccl \
  --methods memcpy,psend-local,ppermute-local,jit-floor-local --out "$OUT/one-process" "$@" \
  | tee "$OUT/one-process/stdout.txt"
