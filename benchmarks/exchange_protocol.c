// A 2-rank exchange step's protocol in raw MPI (each rank sends `bytes` to the other and
// receives as many), against MPI_Sendrecv, the benchmark's mpi4py reference. Rank 0 prints,
// per way, the median time per step over interleaved rounds and its speed against
// `sendrecv` (the median of the per-round ratios, and their range).
//
//   sendrecv   MPI_Sendrecv
//   ready      jax-cpu-mpi's deferred rendezvous for a cycle (mpi/rendezvous.cc): each rank
//              sends a 24-byte ready signal (ctrl communicator), probes for the peer's
//              (MPI_Improbe + MPI_Imrecv), then MPI_Issend's straight from its operand, then
//              posts its receive into its output (data communicator), and polls both
//   framed     the framing of a one-way kept psend (SendFramed): a 64-byte chunk header
//              and the payload, both MPI_Isend from the operand at once; the receiver probes
//              the header (MPI_Improbe + MPI_Imrecv), then posts the payload's receive into
//              its output, and polls both
//   direct     MPI_Irecv into the output and MPI_Issend from the operand, no signal
//
// Every wait polls (MPI_Test), as the extension's do.
//
//   mpicc -O2 -o /tmp/exchange_protocol benchmarks/exchange_protocol.c
//   mpirun -n 2 /tmp/exchange_protocol 65536 4000 7   # bytes, steps per round, rounds
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "median.h"

enum { kWays = 4 };
static const char* kNames[kWays] = {"sendrecv", "ready", "framed", "direct"};

static void Poll(MPI_Request* r, int n) {
  int done = 0;
  while (!done) MPI_Testall(n, r, &done, MPI_STATUSES_IGNORE);
}

typedef struct {
  MPI_Comm data, ctrl, staged;
  int rank, peer;
  size_t bytes;
  char *send, *recv;
} Ctx;

static void Step(Ctx* c, int way) {
  const int n = (int)c->bytes;
  MPI_Request r[3];
  if (way == 0) {
    MPI_Sendrecv(c->send, n, MPI_BYTE, c->peer, 1, c->recv, n, MPI_BYTE, c->peer, 1, c->data,
                 MPI_STATUS_IGNORE);
    return;
  }
  if (way == 3) {
    MPI_Irecv(c->recv, n, MPI_BYTE, c->peer, 2, c->data, &r[0]);
    MPI_Issend(c->send, n, MPI_BYTE, c->peer, 2, c->data, &r[1]);
    Poll(r, 2);
    return;
  }
  if (way == 1) {
    uint64_t mine[3] = {0, c->bytes, 0}, theirs[3];
    MPI_Isend(mine, 3, MPI_UINT64_T, c->peer, 3, c->ctrl, &r[0]);
    int flag = 0;
    MPI_Message m;
    while (!flag) MPI_Improbe(c->peer, 3, c->ctrl, &flag, &m, MPI_STATUS_IGNORE);
    MPI_Imrecv(theirs, 3, MPI_UINT64_T, &m, &r[1]);
    Poll(&r[1], 1);
    MPI_Issend(c->send, n, MPI_BYTE, c->peer, 2, c->data, &r[1]);
    MPI_Irecv(c->recv, n, MPI_BYTE, c->peer, 2, c->data, &r[2]);
    Poll(r, 3);
    return;
  }
  // framed
  uint64_t header[8] = {1, c->bytes, c->bytes, 0}, got[8];
  MPI_Isend(header, 8, MPI_UINT64_T, c->peer, 4, c->staged, &r[0]);
  MPI_Isend(c->send, n, MPI_BYTE, c->peer, 4, c->staged, &r[1]);
  int flag = 0;
  MPI_Message m;
  while (!flag) MPI_Improbe(c->peer, 4, c->staged, &flag, &m, MPI_STATUS_IGNORE);
  MPI_Imrecv(got, 8, MPI_UINT64_T, &m, &r[2]);
  Poll(&r[2], 1);
  MPI_Irecv(c->recv, n, MPI_BYTE, c->peer, 4, c->staged, &r[2]);
  Poll(r, 3);
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  Ctx c;
  MPI_Comm_rank(MPI_COMM_WORLD, &c.rank);
  c.peer = 1 - c.rank;
  c.bytes = argc > 1 ? strtoull(argv[1], NULL, 10) : 65536;
  const int steps = argc > 2 ? atoi(argv[2]) : 4000;
  const int rounds = argc > 3 ? atoi(argv[3]) : 7;
  MPI_Comm_dup(MPI_COMM_WORLD, &c.data);
  MPI_Comm_dup(MPI_COMM_WORLD, &c.ctrl);
  MPI_Comm_dup(MPI_COMM_WORLD, &c.staged);
  c.send = malloc(c.bytes);
  c.recv = malloc(c.bytes);
  memset(c.send, 1, c.bytes);
  memset(c.recv, 0, c.bytes);
  double* t = malloc(sizeof(double) * kWays * (size_t)rounds);
  for (int round = -1; round < rounds; ++round) {  // round -1 warms up
    for (int way = 0; way < kWays; ++way) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double start = MPI_Wtime();
      for (int i = 0; i < steps; ++i) Step(&c, way);
      const double per = (MPI_Wtime() - start) / steps;
      if (round >= 0) t[way * rounds + round] = per;
    }
  }
  if (c.rank == 0) {
    printf("exchange, %zu B, %d steps a round, %d rounds:\n", c.bytes, steps, rounds);
    ReportWays(t, kWays, rounds, kNames, "step", "sendrecv");
  }
  free(t);
  free(c.send);
  free(c.recv);
  MPI_Comm_free(&c.data);
  MPI_Comm_free(&c.ctrl);
  MPI_Comm_free(&c.staged);
  MPI_Finalize();
  return 0;
}
