// The one-way hop's protocol in raw MPI, against the benchmark's mpi4py reference, on 2
// ranks: a ping-pong (each hop one way, the receiver sends the next hop back) and
// osu_mbw_mr's windows (rank 0 streams a window of messages, rank 1 acknowledges with 4
// bytes). Rank 0 prints, per way, the median time per message over interleaved rounds and
// its speed against `plain` (the median of the per-round ratios, and their range).
//
//   plain       MPI_Send / MPI_Recv (ping-pong), or a window of MPI_Isend / MPI_Irecv
//               and MPI_Waitall (multi-pair): the benchmark's mpi4py reference
//   ready       jax-cpu-mpi's rendezvous for a psend whose operand is kept (mpi/transport.h):
//               the receiver posts its receive into its output (one communicator) and sends
//               a 24-byte ready signal (another); the sender waits for that signal, then
//               MPI_Issend's straight from its operand, and polls the send to completion
//               before its next op (the precv that keeps the operand finishes it); multi-pair
//               takes one message at a time, as the psends of a scan do
//   ready+zero  as ready, the sender also writing `bytes` zeros into a buffer of its own
//               while its send is in flight (the output of its precv, which is no
//               destination): a page-touched buffer, as a reused XLA buffer
//   direct      the sender MPI_Issend's at once and polls it, the receiver posts and polls
//               (MPI's own rendezvous with no signal before it: what the ready signal costs)
//
// Every wait polls (MPI_Test), as the extension's do.
//
//   mpicc -O2 -o /tmp/hop_protocol benchmarks/hop_protocol.c
//   mpirun -n 2 /tmp/hop_protocol 65536 2000 7   # bytes, messages per round and way, rounds
//   mpirun -n 2 /tmp/hop_protocol 65536 2048 7 multi-pair   # windows of 64 messages
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "median.h"

enum { kWays = 4, kWindow = 64 };
static const char* kNames[kWays] = {"plain", "ready", "ready+zero", "direct"};

static void Poll(MPI_Request* r) {
  int done = 0;
  while (!done) MPI_Test(r, &done, MPI_STATUS_IGNORE);
}

typedef struct {
  MPI_Comm data, ctrl;
  int rank, peer;
  size_t bytes;
  char *send, *recv, *zeros;
} Ctx;

// One message from `from` to the other rank, by way `way`.
static void Message(Ctx* c, int way, int from, char* src, char* dst) {
  uint64_t signal[3] = {0, c->bytes, 0};
  MPI_Request r;
  const int n = (int)c->bytes;
  if (way == 0) {
    if (c->rank == from) MPI_Send(src, n, MPI_BYTE, c->peer, 1, c->data);
    else MPI_Recv(dst, n, MPI_BYTE, c->peer, 1, c->data, MPI_STATUS_IGNORE);
    return;
  }
  if (way == 3) {
    if (c->rank == from) MPI_Issend(src, n, MPI_BYTE, c->peer, 2, c->data, &r);
    else MPI_Irecv(dst, n, MPI_BYTE, c->peer, 2, c->data, &r);
    Poll(&r);
    return;
  }
  if (c->rank == from) {  // wait for the ready signal, send, finish
    MPI_Irecv(signal, 3, MPI_UINT64_T, c->peer, 3, c->ctrl, &r);
    Poll(&r);
    MPI_Issend(src, n, MPI_BYTE, c->peer, 2, c->data, &r);
    if (way == 2) memset(c->zeros, 0, c->bytes);
    Poll(&r);
  } else {  // post the receive, signal, wait
    MPI_Request s;
    MPI_Irecv(dst, n, MPI_BYTE, c->peer, 2, c->data, &r);
    MPI_Isend(signal, 3, MPI_UINT64_T, c->peer, 3, c->ctrl, &s);
    Poll(&r);
    Poll(&s);
  }
}

static void PingPong(Ctx* c, int way, int messages) {
  for (int i = 0; i < messages / 2; ++i) {
    Message(c, way, 0, c->send, c->recv);
    Message(c, way, 1, c->recv, c->recv);  // rank 1 sends back what it received
  }
}

static void MultiPair(Ctx* c, int way, int messages) {
  char ack[4] = {0};
  for (int w = 0; w < messages / kWindow; ++w) {
    if (way == 0) {
      MPI_Request r[kWindow];
      for (int i = 0; i < kWindow; ++i) {
        if (c->rank == 0) MPI_Isend(c->send, (int)c->bytes, MPI_BYTE, 1, 1, c->data, &r[i]);
        else MPI_Irecv(c->recv, (int)c->bytes, MPI_BYTE, 0, 1, c->data, &r[i]);
      }
      MPI_Waitall(kWindow, r, MPI_STATUSES_IGNORE);
    } else {
      for (int i = 0; i < kWindow; ++i) Message(c, way, 0, c->send, c->recv);
    }
    if (c->rank == 1) MPI_Send(ack, 4, MPI_BYTE, 0, 7, c->data);
    else MPI_Recv(ack, 4, MPI_BYTE, 1, 7, c->data, MPI_STATUS_IGNORE);
  }
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  Ctx c;
  MPI_Comm_rank(MPI_COMM_WORLD, &c.rank);
  c.peer = 1 - c.rank;
  c.bytes = argc > 1 ? strtoull(argv[1], NULL, 10) : 65536;
  const int messages = argc > 2 ? atoi(argv[2]) : 2000;
  const int rounds = argc > 3 ? atoi(argv[3]) : 7;
  const int multi_pair = argc > 4 && strcmp(argv[4], "multi-pair") == 0;
  MPI_Comm_dup(MPI_COMM_WORLD, &c.data);
  MPI_Comm_dup(MPI_COMM_WORLD, &c.ctrl);
  c.send = malloc(c.bytes);
  c.recv = malloc(c.bytes);
  c.zeros = malloc(c.bytes);
  memset(c.send, 1, c.bytes);
  memset(c.recv, 0, c.bytes);
  memset(c.zeros, 1, c.bytes);
  double* t = malloc(sizeof(double) * kWays * (size_t)rounds);
  for (int round = -1; round < rounds; ++round) {  // round -1 warms up
    for (int way = 0; way < kWays; ++way) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double start = MPI_Wtime();
      if (multi_pair) MultiPair(&c, way, messages);
      else PingPong(&c, way, messages);
      const double per = (MPI_Wtime() - start) / messages;
      if (round >= 0) t[way * rounds + round] = per;
    }
  }
  if (c.rank == 0) {
    printf("%s, %zu B, %d messages a round, %d rounds:\n", multi_pair ? "multi-pair" : "hop",
           c.bytes, messages, rounds);
    ReportWays(t, kWays, rounds, kNames, "message", "plain");
  }
  free(t);
  free(c.send);
  free(c.recv);
  free(c.zeros);
  MPI_Comm_free(&c.data);
  MPI_Comm_free(&c.ctrl);
  MPI_Finalize();
  return 0;
}
