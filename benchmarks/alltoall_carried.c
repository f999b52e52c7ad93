// An all_to_all whose result is the next one's operand (what the collectives benchmark's
// jitted scan of all_to_all does), against the call the benchmark compares it with, on 2
// ranks: rank 0 prints, per way, the median and minimum time per op over interleaved rounds.
//
//   in-place       MPI_Ialltoall(MPI_IN_PLACE), polled (jax-cpu-mpi's call before it staged
//                  the peer's block itself)
//   staged         the peer's block copied to a kept buffer, then MPI_Ialltoallv with a zero
//                  count for this rank, polled (jax-cpu-mpi's call with one device per rank)
//   clean          MPI_Alltoall from one unchanging buffer into another (the benchmark's
//                  mpi4py reference: the peer reads the same bytes at every call)
//   carried        MPI_Alltoall whose output is the next call's input (two buffers in turn)
//
// A block the peer reads must come from this rank's cache when this rank has just written
// it (a carried or staged operand), but can stay in the peer's own cache when it never
// changes (clean): in launches where the ranks' cores keep it there, the clean call is up to
// twice as fast as the others at sizes that fit the cache (a 256 KiB exchange), while the
// carried call, which moves what the scan moves, is close to the staged and in-place ones.
// In other launches all four are alike. Compare the benchmark's all_to_all with the carried
// call, not only with the clean one.
//
//   mpicc -O2 -o /tmp/alltoall_carried benchmarks/alltoall_carried.c
//   mpirun -n 2 /tmp/alltoall_carried 262144 10 51   # bytes per rank, ops, rounds
#include <mpi.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "collective_args.h"

static void Poll(MPI_Request* r) {
  int done = 0;
  for (;;) {
    MPI_Test(r, &done, MPI_STATUS_IGNORE);
    if (done) return;
    sched_yield();
  }
}

int main(int argc, char** argv) {
  const struct CollectiveArgs a = CollectiveStart(argc, argv, "alltoall_carried");
  if (a.size != 2) {
    if (a.rank == 0) fprintf(stderr, "alltoall_carried: run it on 2 ranks\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  const size_t bytes = a.bytes, block = bytes / 2;
  const int peer = a.rank ^ 1;
  char* bufs[5];
  for (int i = 0; i < 5; ++i) {
    bufs[i] = malloc(bytes);
    memset(bufs[i], i + 1, bytes);
  }
  char *carry = bufs[0], *stage = bufs[1], *in = bufs[2], *out = bufs[3], *other = bufs[4];
  int counts[2], displs[2] = {0, (int)block};
  counts[a.rank] = 0;
  counts[peer] = (int)block;
  enum { kWays = 4 };
  const char* names[kWays] = {"in-place", "staged", "clean", "carried"};
  double* t = calloc((size_t)kWays * a.rounds, sizeof(double));
  for (int r = -1; r < a.rounds; ++r) {  // round -1 warms up
    for (int w = 0; w < kWays; ++w) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = MPI_Wtime();
      for (int i = 0; i < a.ops; ++i) {
        MPI_Request q;
        if (w == 0) {
          MPI_Ialltoall(MPI_IN_PLACE, 0, MPI_BYTE, carry, (int)block, MPI_BYTE, MPI_COMM_WORLD,
                        &q);
          Poll(&q);
        } else if (w == 1) {
          memcpy(stage + peer * block, carry + peer * block, block);
          MPI_Ialltoallv(stage, counts, displs, MPI_BYTE, carry, counts, displs, MPI_BYTE,
                         MPI_COMM_WORLD, &q);
          Poll(&q);
        } else if (w == 2) {
          MPI_Alltoall(in, (int)block, MPI_BYTE, out, (int)block, MPI_BYTE, MPI_COMM_WORLD);
        } else {
          MPI_Alltoall(carry, (int)block, MPI_BYTE, other, (int)block, MPI_BYTE,
                       MPI_COMM_WORLD);
          char* swap = carry;
          carry = other;
          other = swap;
        }
      }
      if (r >= 0) t[w * a.rounds + r] = (MPI_Wtime() - t0) / a.ops * 1e6;
    }
  }
  if (a.rank == 0) {
    printf("%zu B", bytes);
    for (int w = 0; w < kWays; ++w) {
      double* mine = t + w * a.rounds;
      qsort(mine, a.rounds, sizeof(double), CompareTimes);
      printf("  %s %.1f / %.1f", names[w], mine[a.rounds / 2], mine[0]);
    }
    printf("  (us per op: median / min)\n");
  }
  for (int i = 0; i < 5; ++i) free(bufs[i]);
  free(t);
  MPI_Finalize();
  return 0;
}
