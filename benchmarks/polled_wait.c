// How the way a rank waits for a nonblocking MPI collective costs where both ranks share a
// core: MPI_Allgather, MPI_Iallgather + MPI_Wait, and MPI_Iallgather polled with MPI_Test
// that yields at once or only after a 10 us spin (jax-cpu-mpi's collective wait before it
// adapted that spin above 8 KiB). Rank 0 prints, per variant, the median and minimum time
// per op over the rounds, and the polls and yields per op.
//
//   mpicc -O2 -o /tmp/polled_wait benchmarks/polled_wait.c
//   taskset -c 1 mpirun -n 2 /tmp/polled_wait 32768 100 7   # bytes gathered, ops, rounds
//
// (mpicc and mpirun from the venv's mpich wheel; drop taskset for ranks on cores of their
// own.)
#include <mpi.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "collective_args.h"

static long polls, yields;

static double Now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void TestThenYield(MPI_Request* r, double spin_s) {
  int done = 0;
  double start = 0;
  for (;;) {
    MPI_Test(r, &done, MPI_STATUS_IGNORE);
    ++polls;
    if (done) return;
    if (spin_s > 0) {
      if (start == 0) start = Now();
      if (Now() - start < spin_s) continue;
    }
    sched_yield();
    ++yields;
  }
}

int main(int argc, char** argv) {
  const struct CollectiveArgs args = CollectiveStart(argc, argv, "polled_wait");
  const int rank = args.rank, size = args.size, ops = args.ops, rounds = args.rounds;
  const size_t bytes = args.bytes;
  const size_t block = bytes / (size_t)size;
  char* in = malloc(block);
  char* out = malloc(bytes);
  memset(in, 1, block);
  memset(out, 0, bytes);
  enum { kVariants = 4 };
  const char* names[kVariants] = {"MPI_Allgather", "MPI_Iallgather + MPI_Wait",
                                  "polled, yields at once", "polled, 10 us spin first"};
  double* times = calloc((size_t)kVariants * (size_t)rounds, sizeof(double));
  long poll_count[kVariants] = {0}, yield_count[kVariants] = {0};
  for (int round = -1; round < rounds; ++round) {  // round -1 warms up
    for (int v = 0; v < kVariants; ++v) {
      MPI_Barrier(MPI_COMM_WORLD);
      const long polls0 = polls, yields0 = yields;
      const double t0 = MPI_Wtime();
      for (int i = 0; i < ops; ++i) {
        MPI_Request r;
        if (v == 0) {
          MPI_Allgather(in, (int)block, MPI_BYTE, out, (int)block, MPI_BYTE, MPI_COMM_WORLD);
          continue;
        }
        MPI_Iallgather(in, (int)block, MPI_BYTE, out, (int)block, MPI_BYTE, MPI_COMM_WORLD, &r);
        if (v == 1) {
          MPI_Wait(&r, MPI_STATUS_IGNORE);
        } else {
          TestThenYield(&r, v == 3 ? 10e-6 : 0);
        }
      }
      if (round >= 0) {
        times[v * rounds + round] = (MPI_Wtime() - t0) / ops * 1e6;
        poll_count[v] += polls - polls0;
        yield_count[v] += yields - yields0;
      }
    }
  }
  if (rank == 0) {
    printf("%zu B gathered, %d ranks\n", bytes, size);
    for (int v = 0; v < kVariants; ++v) {
      double* t = times + v * rounds;
      qsort(t, (size_t)rounds, sizeof(double), CompareTimes);
      printf("  %-28s median %8.1f us  min %8.1f us  polls/op %6.1f  yields/op %6.1f\n",
             names[v], t[rounds / 2], t[0], (double)poll_count[v] / rounds / ops,
             (double)yield_count[v] / rounds / ops);
    }
  }
  free(times);
  free(out);
  free(in);
  MPI_Finalize();
  return 0;
}
