#!/usr/bin/env bash
# Record the point-to-point benchmark of this machine (a few minutes on 2 cores):
#   benchmarks/run.sh [OUT_DIR] [extra options of python -m jax_cpu_mpi.bench]
# Writes OUT_DIR/{results.jsonl,osu.txt,nccl.txt,targets.txt,plot.png,stdout.txt} (2 ranks)
# and the same in OUT_DIR/one-process/ (one process: the in-process methods with ppermute).
# It measures what the targets compare, in interleaved rounds (raw, ours, raw, ours, ...):
# over MPI mpi4py, psend/scan and the floor of a hop; in one process memcpy, the floor,
# psend-local/scan and ppermute-local/scan. FULL=1 measures every method (much longer).
#
# Environment: PYTHON (default: python), MPIRUN (default: the mpirun next to PYTHON, else
# mpirun on PATH), NP (ranks, default 2), ROUNDS (default 3), SIZES (default
# 8,4K,64K,1M,4M,16M,64M), QUIET_IDLE (wait until the CPUs are this % idle before
# starting, default 90; 0 disables), QUIET_WAIT (give up waiting after this many seconds,
# default 60), HUGEPAGES (default 1: every process of the run, raw MPI's included, runs with
# GLIBC_TUNABLES=glibc.malloc.hugetlb=1, so that XLA's buffers get transparent huge pages
# as numpy's large arrays already do; 0: the machine's defaults).
set -euo pipefail

PYTHON=${PYTHON:-python}
PYDIR=$(dirname "$(command -v "$PYTHON")")
MPIRUN=${MPIRUN:-$( [ -x "$PYDIR/mpirun" ] && echo "$PYDIR/mpirun" || echo mpirun )}
NP=${NP:-2}
# numpy asks for transparent huge pages for arrays of 4 MiB and more, XLA's allocator does
# not: without this, MPI's single-copy transfer (CMA) of a psend operand pins 512 times more
# pages than that of a numpy buffer, which halves its bandwidth at 16 MiB on a 2-core VM.
if [ "${HUGEPAGES:-1}" != 0 ]; then
  export GLIBC_TUNABLES=${GLIBC_TUNABLES:+$GLIBC_TUNABLES:}glibc.malloc.hugetlb=1
fi
# A lost message fails the run after 2 minutes instead of the default 5.
export JAX_CPU_MPI_RECV_TIMEOUT=${JAX_CPU_MPI_RECV_TIMEOUT:-120}
ROUNDS=${ROUNDS:-3}
SIZES=${SIZES:-8,4K,64K,1M,4M,16M,64M}
if [ -n "${FULL:-}" ]; then
  MPI_METHODS=all
  LOCAL_METHODS=memcpy,hop-floor-local,psend-local,ppermute-local,jit-floor-local
else
  MPI_METHODS=mpi4py,psend/scan,hop-floor
  LOCAL_METHODS=memcpy,hop-floor-local,psend-local/scan,ppermute-local/scan
fi
OUT=${1:-benchmarks/results/p2p/$(hostname)}
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
  while [ "$(idle_percent)" -lt "${QUIET_IDLE:-90}" ] && [ "$waited" -lt "${QUIET_WAIT:-60}" ]; do
    waited=$((waited + 1))
  done
  echo "# started after waiting ${waited}s for the CPUs to be ${QUIET_IDLE:-90}% idle" >&2
fi

echo "# load before: $(cat /proc/loadavg 2>/dev/null); GLIBC_TUNABLES=${GLIBC_TUNABLES:-}" >&2
"$MPIRUN" -n "$NP" "$PYTHON" -m jax_cpu_mpi.bench --rounds "$ROUNDS" --sizes "$SIZES" \
  --methods "$MPI_METHODS" --format osu,nccl --out "$OUT" "$@" | tee "$OUT/stdout.txt"

# One process without mpirun: the in-process methods again, with XLA's in-process ppermute
# (which a multi-process JAX job routes through gloo, where it hangs at large sizes).
env -u PMI_RANK -u PMI_SIZE "$PYTHON" -m jax_cpu_mpi.bench --rounds "$ROUNDS" \
  --sizes "$SIZES" --methods "$LOCAL_METHODS" --format osu,nccl --out "$OUT/one-process" \
  "$@" | tee "$OUT/one-process/stdout.txt"
echo "# load after: $(cat /proc/loadavg 2>/dev/null)" >&2
