#!/usr/bin/env bash
# MPI calls, MPICH's single copies (process_vm_readv) and page faults per step of
# benchmarks/alloc_counts.py's program, both ranks together: perf stat with uprobes on the
# venv's libmpi.so.12, the difference of two run lengths (what a call costs whatever its
# length cancels). Needs perf and root (uprobes).
#
#   benchmarks/mpi_call_counts.sh REPO_WITH_VENV KIND SIZE    # e.g. . exchange 1M
set -u
repo=$(cd "$1" && pwd); kind=$2; size=$3
here=$(cd "$(dirname "$0")" && pwd)
lib=$repo/.venv/lib/libmpi.so.12
out=$(mktemp -d)
group=jcmcount$$
evs=""
for f in MPI_Isend MPI_Issend MPI_Irecv MPI_Improbe MPI_Imrecv MPI_Iprobe MPI_Test MPI_Testall; do
  perf probe -x "$lib" -a "$group:$f=$f" >/dev/null 2>&1 && evs="$evs -e $group:$f"
done
evs="$evs -e syscalls:sys_enter_process_vm_readv -e page-faults"
for long in 40 200; do
  (cd "$repo" && PATH=$repo/.venv/bin:$PATH perf stat -x, $evs -o "$out/$long.txt" -- \
    mpirun -n 2 .venv/bin/python "$here/alloc_counts.py" --sizes "$size" --kinds "$kind" \
    --short 8 --long $long --calls 3 --rounds 2 > /dev/null 2>&1)
done
perf probe -d "$group:*" >/dev/null 2>&1
python3 - "$out" "$kind" "$size" <<'PY'
import sys
out, kind, size = sys.argv[1:]
def read(long):
    d = {}
    for line in open(f"{out}/{long}.txt"):
        p = line.strip().split(",")
        if len(p) > 2 and p[0].replace(".", "").isdigit():
            d[p[2].split(":")[-1]] = float(p[0])
    return d
a, b = read(40), read(200)
steps = (3 + 2 * 3) * (200 - 40)  # the long program's calls (3 warm-up, 2 rounds of 3) x extra steps
print(f"{kind} {size} per step (both ranks):",
      ", ".join(f"{k} {(b[k] - a.get(k, 0)) / steps:.2f}" for k in b))
PY
rm -rf "$out"
