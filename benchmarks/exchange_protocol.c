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
//   one        the framing in one message: the payload and a 64-byte trailer, MPI_Isend
//              from the operand with a two-block datatype; the receiver probes it
//              (MPI_Improbe), then MPI_Imrecv's it with a two-block datatype (the payload
//              into its output, the trailer apart), and polls both
//   posted     as `one`, but the receiver posts its two-block receive (MPI_Irecv) before
//              its send, as MPI_Sendrecv does: no probe
//   posted2    the framing (a 64-byte header, then the payload, both MPI_Isend from the
//              operand), the receiver's two receives (header, payload into its output)
//              posted before its sends: no probe, contiguous buffers
//   cached     as `one` with the datatypes made once (what the types' making costs)
//   staged     the staged one-message path: the payload and its trailer sent contiguous (from
//              a staging buffer), the receiver probes it and MPI_Imrecv's it with the
//              two-block datatype (payload into its output, the trailer apart)
//   probed     the payload alone (MPI_Isend from the operand, no header), the receiver probes
//              it and MPI_Imrecv's it into its output: `framed` without its header
//   posted1    MPI_Irecv into the output, then MPI_Isend from the operand: MPI_Sendrecv's
//              own calls, polled
//
// Every wait polls (MPI_Test), as the extension's do.
//
//   mpicc -O2 -o /tmp/exchange_protocol benchmarks/exchange_protocol.c
//   mpirun -n 2 /tmp/exchange_protocol 65536 4000 7   # bytes, steps per round, rounds
//   mpirun -n 2 /tmp/exchange_protocol 65536 4000 1 framed   # one way only (for counting:
//       perf stat -e syscalls:sys_enter_process_vm_readv tells MPICH's single copy apart)
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "median.h"

enum { kWays = 11 };
static const char* kNames[kWays] = {"sendrecv", "ready",  "framed", "direct",
                                    "one",      "posted", "posted2", "cached",
                                    "staged",   "probed", "posted1"};

static void Poll(MPI_Request* r, int n) {
  int done = 0;
  while (!done) MPI_Testall(n, r, &done, MPI_STATUSES_IGNORE);
}

typedef struct {
  MPI_Comm data, ctrl, staged;
  int rank, peer;
  size_t bytes;
  char *send, *recv, *staging;
  uint64_t trailer[8], got[8];
  MPI_Datatype send_type, recv_type;  // payload and trailer, two blocks
} Ctx;

static MPI_Datatype TwoBlocks(void* payload, size_t bytes, void* trailer) {
  MPI_Aint at[2];
  MPI_Get_address(payload, &at[0]);
  MPI_Get_address(trailer, &at[1]);
  const int lengths[2] = {(int)bytes, 64};
  MPI_Datatype t;
  MPI_Type_create_hindexed(2, lengths, at, MPI_BYTE, &t);
  MPI_Type_commit(&t);
  return t;
}

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
  if (way == 6) {
    uint64_t header[8] = {1, c->bytes, c->bytes, 0};
    MPI_Request q[4];
    MPI_Irecv(c->got, 8, MPI_UINT64_T, c->peer, 6, c->staged, &q[0]);
    MPI_Irecv(c->recv, n, MPI_BYTE, c->peer, 6, c->staged, &q[1]);
    MPI_Isend(header, 8, MPI_UINT64_T, c->peer, 6, c->staged, &q[2]);
    MPI_Isend(c->send, n, MPI_BYTE, c->peer, 6, c->staged, &q[3]);
    Poll(q, 4);
    return;
  }
  if (way == 9) {
    MPI_Isend(c->send, n, MPI_BYTE, c->peer, 9, c->staged, &r[0]);
    int flag = 0;
    MPI_Message m;
    while (!flag) MPI_Improbe(c->peer, 9, c->staged, &flag, &m, MPI_STATUS_IGNORE);
    MPI_Imrecv(c->recv, n, MPI_BYTE, &m, &r[1]);
    Poll(r, 2);
    return;
  }
  if (way == 10) {
    MPI_Irecv(c->recv, n, MPI_BYTE, c->peer, 10, c->staged, &r[0]);
    MPI_Isend(c->send, n, MPI_BYTE, c->peer, 10, c->staged, &r[1]);
    Poll(r, 2);
    return;
  }
  if (way == 8) {
    MPI_Isend(c->staging, n + 64, MPI_BYTE, c->peer, 8, c->staged, &r[0]);
    int flag = 0;
    MPI_Message m;
    while (!flag) MPI_Improbe(c->peer, 8, c->staged, &flag, &m, MPI_STATUS_IGNORE);
    MPI_Imrecv(MPI_BOTTOM, 1, c->recv_type, &m, &r[1]);
    Poll(r, 2);
    return;
  }
  if (way == 7) {
    MPI_Isend(MPI_BOTTOM, 1, c->send_type, c->peer, 7, c->staged, &r[0]);
    int flag = 0;
    MPI_Message m;
    while (!flag) MPI_Improbe(c->peer, 7, c->staged, &flag, &m, MPI_STATUS_IGNORE);
    MPI_Imrecv(MPI_BOTTOM, 1, c->recv_type, &m, &r[1]);
    Poll(r, 2);
    return;
  }
  if (way == 4 || way == 5) {
    // The types are made per step, as the extension would per call.
    MPI_Datatype st = TwoBlocks(c->send, c->bytes, c->trailer);
    MPI_Datatype rt = TwoBlocks(c->recv, c->bytes, c->got);
    if (way == 5) MPI_Irecv(MPI_BOTTOM, 1, rt, c->peer, 5, c->staged, &r[1]);
    MPI_Isend(MPI_BOTTOM, 1, st, c->peer, 5, c->staged, &r[0]);
    if (way == 4) {
      int flag = 0;
      MPI_Message m;
      while (!flag) MPI_Improbe(c->peer, 5, c->staged, &flag, &m, MPI_STATUS_IGNORE);
      MPI_Imrecv(MPI_BOTTOM, 1, rt, &m, &r[1]);
    }
    MPI_Type_free(&st);
    MPI_Type_free(&rt);
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
  int only = -1, picked[kWays] = {0}, npicked = 0;
  for (int way = 0; argc > 4 && way < kWays; ++way) {
    char list[256];
    snprintf(list, sizeof(list), ",%s,", argv[4]);
    char name[32];
    snprintf(name, sizeof(name), ",%s,", kNames[way]);
    if (strstr(list, name)) picked[way] = 1, ++npicked, only = way;
  }
  if (npicked != 1) only = -1;
  MPI_Comm_dup(MPI_COMM_WORLD, &c.data);
  MPI_Comm_dup(MPI_COMM_WORLD, &c.ctrl);
  MPI_Comm_dup(MPI_COMM_WORLD, &c.staged);
  c.send = malloc(c.bytes);
  c.recv = malloc(c.bytes);
  memset(c.send, 1, c.bytes);
  memset(c.recv, 0, c.bytes);
  c.staging = calloc(c.bytes + 64, 1);
  c.send_type = TwoBlocks(c.send, c.bytes, c.trailer);
  c.recv_type = TwoBlocks(c.recv, c.bytes, c.got);
  double* t = malloc(sizeof(double) * kWays * (size_t)rounds);
  for (int round = -1; round < rounds; ++round) {  // round -1 warms up
    for (int way = 0; way < kWays; ++way) {
      if (npicked > 0 && !picked[way]) continue;
      MPI_Barrier(MPI_COMM_WORLD);
      const double start = MPI_Wtime();
      for (int i = 0; i < steps; ++i) Step(&c, way);
      const double per = (MPI_Wtime() - start) / steps;
      if (round >= 0) t[way * rounds + round] = per;
    }
  }
  if (c.rank == 0 && only < 0) {
    printf("exchange, %zu B, %d steps a round, %d rounds:\n", c.bytes, steps, rounds);
    // The ways not run have no times: report those run (sendrecv first: the reference).
    const char* names[kWays];
    int k = 0;
    for (int way = 0; way < kWays; ++way) {
      if (npicked > 0 && !picked[way]) continue;
      names[k] = kNames[way];
      for (int round = 0; round < rounds; ++round) t[k * rounds + round] = t[way * rounds + round];
      ++k;
    }
    ReportWays(t, k, rounds, names, "step", "sendrecv");
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
