// What the page size of an MPI collective's buffers costs MPI's own call: MPI_Allgather
// between ranks whose operand and output are on 4 KiB pages or on transparent huge pages
// (madvise MADV_HUGEPAGE before the first touch, as numpy does for arrays of 4 MiB and more
// and glibc's malloc does with GLIBC_TUNABLES=glibc.malloc.hugetlb=1; XLA's allocator does
// neither). Each combination of the operand's and the output's pages, blocking and
// nonblocking (MPI_Iallgather + MPI_Wait, the call jax-cpu-mpi makes), interleaved in
// rounds. Rank 0 prints, per variant, the median and minimum time per op and the median
// CPU time per op (user + system: the copies, process_vm_readv's included).
//
//   mpicc -O2 -o /tmp/huge_pages benchmarks/huge_pages.c
//   mpirun -n 2 /tmp/huge_pages 16777216 30 9   # bytes gathered, ops, rounds
//
// (mpicc and mpirun from the venv's mpich wheel.)
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include "collective_args.h"

enum { kHuge = 2 << 20 };

static double CpuSeconds(void) {
  struct rusage r;
  getrusage(RUSAGE_SELF, &r);
  return (double)(r.ru_utime.tv_sec + r.ru_stime.tv_sec) +
         1e-6 * (double)(r.ru_utime.tv_usec + r.ru_stime.tv_usec);
}

// `bytes` at a huge page boundary, advised to be huge pages or not to be, then touched.
static char* Buffer(size_t bytes, int huge) {
  char* map = mmap(NULL, bytes + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
  if (map == MAP_FAILED) {
    perror("mmap");
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  char* p = (char*)(((unsigned long)map + kHuge - 1) & ~((unsigned long)kHuge - 1));
  madvise(p, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  memset(p, 1, bytes);
  return p;
}

int main(int argc, char** argv) {
  const struct CollectiveArgs args = CollectiveStart(argc, argv, "huge_pages");
  const int rank = args.rank, size = args.size, ops = args.ops, rounds = args.rounds;
  const size_t bytes = args.bytes;
  const int block = (int)(bytes / (size_t)size);
  char* in[2] = {Buffer(bytes, 0), Buffer(bytes, 1)};   // [huge]
  char* out[2] = {Buffer(bytes, 0), Buffer(bytes, 1)};  // [huge]
  enum { kVariants = 8 };
  double* times = calloc((size_t)kVariants * (size_t)rounds, sizeof(double));
  double* cpu = calloc((size_t)kVariants * (size_t)rounds, sizeof(double));
  for (int round = -1; round < rounds; ++round) {  // round -1 warms up
    for (int v = 0; v < kVariants; ++v) {
      const int in_huge = v & 1, out_huge = (v >> 1) & 1, nonblocking = v >> 2;
      MPI_Barrier(MPI_COMM_WORLD);
      const double c0 = CpuSeconds(), t0 = MPI_Wtime();
      for (int i = 0; i < ops; ++i) {
        if (!nonblocking) {
          MPI_Allgather(in[in_huge], block, MPI_BYTE, out[out_huge], block, MPI_BYTE,
                        MPI_COMM_WORLD);
          continue;
        }
        MPI_Request r;
        MPI_Iallgather(in[in_huge], block, MPI_BYTE, out[out_huge], block, MPI_BYTE,
                       MPI_COMM_WORLD, &r);
        MPI_Wait(&r, MPI_STATUS_IGNORE);
      }
      if (round >= 0) {
        times[v * rounds + round] = (MPI_Wtime() - t0) / ops * 1e6;
        cpu[v * rounds + round] = (CpuSeconds() - c0) / ops * 1e6;
      }
    }
  }
  if (rank == 0) {
    printf("%zu B gathered, %d ranks\n", bytes, size);
    for (int v = 0; v < kVariants; ++v) {
      double* t = times + v * rounds;
      double* c = cpu + v * rounds;
      qsort(t, (size_t)rounds, sizeof(double), CompareTimes);
      qsort(c, (size_t)rounds, sizeof(double), CompareTimes);
      printf("  %-15s operand %-4s output %-4s  median %9.1f us  min %9.1f us  cpu %9.1f us\n",
             v >> 2 ? "MPI_Iallgather" : "MPI_Allgather", v & 1 ? "huge" : "4K",
             (v >> 1) & 1 ? "huge" : "4K", t[rounds / 2], t[0], c[rounds / 2]);
    }
  }
  free(cpu);
  free(times);
  MPI_Finalize();
  return 0;
}
