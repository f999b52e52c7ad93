#include "mpi/clock_sync.h"

#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "common/immortal.h"
#include "common/trace.h"
#include "mpi/internal.h"

namespace jcm {
namespace {

constexpr int kRounds = 8;

// The buffers of one exchange. A request that missed its deadline may still complete into
// them, so they are then parked for good instead of freed.
struct Exchange {
  int64_t out[2] = {0, 0};
  int64_t in[2] = {0, 0};
};

void Park(std::shared_ptr<Exchange> exchange) {
  static Immortal<std::pair<std::mutex, std::vector<std::shared_ptr<Exchange>>>> parked;
  std::lock_guard<std::mutex> lock(parked.get().first);
  parked.get().second.push_back(std::move(exchange));
}

// Sends `count` int64 from ex->out to `peer` and/or receives as many into ex->in (either
// may be skipped with count 0), by `deadline`.
Status Exchange2(MPI_Comm comm, int peer, int tag, int send_count, int recv_count,
                 const std::shared_ptr<Exchange>& ex,
                 std::chrono::steady_clock::time_point deadline) {
  MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  if (recv_count > 0) {
    if (int rc = MPI_Irecv(ex->in, recv_count, MPI_INT64_T, peer, tag, comm, &requests[0]);
        rc != MPI_SUCCESS) {
      return Status::MpiError("MPI_Irecv", rc);
    }
  }
  if (send_count > 0) {
    if (int rc = MPI_Isend(ex->out, send_count, MPI_INT64_T, peer, tag, comm, &requests[1]);
        rc != MPI_SUCCESS) {
      Park(ex);
      return Status::MpiError("MPI_Isend", rc);
    }
  }
  Backoff backoff;
  while (true) {
    int done = 0;
    if (int rc = MPI_Testall(2, requests, &done, MPI_STATUSES_IGNORE); rc != MPI_SUCCESS) {
      Park(ex);
      return Status::MpiError("MPI_Testall", rc);
    }
    if (done) return Status::Ok();
    if (std::chrono::steady_clock::now() > deadline) {
      Park(ex);
      return Status::Timeout("the clock synchronisation with rank " + std::to_string(peer) +
                             " did not complete in time");
    }
    backoff.Pause();
  }
}

}  // namespace

Status MeasureClockOffset(MPI_Comm comm, std::chrono::steady_clock::time_point deadline,
                          ClockOffset* out) {
  *out = {};
  int rank = 0, size = 0;
  if (int rc = MPI_Comm_rank(comm, &rank); rc != MPI_SUCCESS) {
    return Status::MpiError("MPI_Comm_rank", rc);
  }
  if (int rc = MPI_Comm_size(comm, &size); rc != MPI_SUCCESS) {
    return Status::MpiError("MPI_Comm_size", rc);
  }
  auto ex = std::make_shared<Exchange>();
  if (rank != 0) {
    for (int round = 0; round < kRounds; ++round) {
      // Ping from rank 0, answered at once with this clock.
      if (Status s = Exchange2(comm, 0, round, 0, 1, ex, deadline); !s.ok()) return s;
      ex->out[0] = trace::NowNs();
      if (Status s = Exchange2(comm, 0, round, 1, 0, ex, deadline); !s.ok()) return s;
    }
    if (Status s = Exchange2(comm, 0, kRounds, 0, 2, ex, deadline); !s.ok()) return s;
    *out = {true, ex->in[0], ex->in[1]};
    return Status::Ok();
  }
  for (int peer = 1; peer < size; ++peer) {
    int64_t best_rtt = std::numeric_limits<int64_t>::max(), best_offset = 0;
    for (int round = 0; round < kRounds; ++round) {
      const int64_t t0 = trace::NowNs();
      if (Status s = Exchange2(comm, peer, round, 1, 1, ex, deadline); !s.ok()) return s;
      const int64_t t1 = trace::NowNs();
      if (t1 - t0 < best_rtt) {
        best_rtt = t1 - t0;
        best_offset = ex->in[0] - (t0 + (t1 - t0) / 2);
      }
    }
    ex->out[0] = best_offset;
    ex->out[1] = best_rtt;
    if (Status s = Exchange2(comm, peer, kRounds, 2, 0, ex, deadline); !s.ok()) return s;
  }
  *out = {true, 0, 0};
  return Status::Ok();
}

}  // namespace jcm
