// What the C collective benchmarks here (polled_wait.c, huge_pages.c) share: MPI started
// as jax-cpu-mpi starts it (MPI_THREAD_MULTIPLE), their three arguments (bytes gathered,
// ops per round, rounds), and the order of their per-round times for a median.
#pragma once

#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

struct CollectiveArgs {
  int rank, size;
  size_t bytes;  // gathered: each rank's block is bytes / size
  int ops, rounds;
};

// MPI_Init_thread and the arguments; aborts the job with `name`'s usage where one is missing.
static struct CollectiveArgs CollectiveStart(int argc, char** argv, const char* name) {
  struct CollectiveArgs a;
  int provided;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &a.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &a.size);
  if (argc < 4) {
    if (a.rank == 0) fprintf(stderr, "usage: %s BYTES OPS ROUNDS\n", name);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  a.bytes = strtoull(argv[1], NULL, 10);
  a.ops = atoi(argv[2]);
  a.rounds = atoi(argv[3]);
  return a;
}

// qsort's comparison of doubles, ascending.
static int CompareTimes(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}
