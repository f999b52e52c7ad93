#!/bin/bash
# The A/B of docs/timeline.md's cost: the 8 B hop (hop.py) with the main build ("base"),
# this branch with tracing off ("off") and on ("on", JAX_CPU_MPI_TRACE set), interleaved
# round by round in a rotating order, each run a fresh process (or mpirun -n 2).
#
# usage: ab.sh BASE_PYTHON_DIR NEW_PYTHON_DIR VENV OUT_DIR local|mpi ROUNDS
#   *_PYTHON_DIR: a python/ tree (git archive <commit> python) with that build's
#   _jax_cpu_mpi*.so copied into python/jax_cpu_mpi/; both run with `python -S` and the
#   venv's site-packages on PYTHONPATH, so the editable install of the venv is bypassed.
base=$1; new=$2; venv=$3; out=$4; mode=$5; rounds=$6
here=$(cd "$(dirname "$0")" && pwd)
run() {  # variant file
  local src=$new tracing=()
  [ "$1" = base ] && src=$base
  local tracedir; tracedir=$(mktemp -d)
  [ "$1" = on ] && tracing=(JAX_CPU_MPI_TRACE="$tracedir" JAX_CPU_MPI_TRACE_EVENTS=1000000)
  local launch=()
  [ "$mode" = mpi ] && launch=("$venv/bin/mpirun" -n 2)
  env -u JAX_CPU_MPI_TRACE -u JAX_CPU_MPI_DEBUG LD_LIBRARY_PATH="$venv/lib" \
    PYTHONPATH="$src:$venv/lib/python3.11/site-packages" "${tracing[@]}" \
    "${launch[@]}" "$venv/bin/python" -S "$here/hop.py" 150 > "$2"
  rm -rf "$tracedir"
}
mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
  case $((r % 3)) in 0) order="base off on";; 1) order="off on base";; 2) order="on base off";; esac
  for v in $order; do run "$v" "$out/$mode-$v-$r.json"; done
done
