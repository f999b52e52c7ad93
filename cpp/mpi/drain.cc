// The exit drain of the MPI transport: complete our sends, then meet every rank.
#include <algorithm>

#include "mpi/internal.h"
#include "mpi/transport.h"

namespace jcm {

MpiTransport::DrainResult MpiTransport::Drain(std::chrono::steady_clock::time_point deadline) {
  // Phase 1: complete our own sends. Phase 2: a barrier (non-blocking, polled) with every
  // other rank, which keeps each rank's progress engine running until all have drained: a
  // receiver that already has all its bytes may owe its sender the acknowledgement that
  // completes the sender's request (MPICH's CMA rendezvous sends it on a later progress
  // call), and without this it would leave before sending it.
  // A send that is still undelivered halfway to the deadline has a receiver that will never
  // take it (a precv that timed out, a program that ended early): join the barrier anyway,
  // so that ranks that are waiting for us at their exit still meet us, and report the send.
  // An MPI call that fails does not end the drain (the other ranks may still be waiting for
  // us in the barrier): the first failure is reported with the result.
  Backoff backoff;
  Status failure;
  auto note = [&failure](Status s) {
    if (!s.ok() && failure.ok()) failure = std::move(s);
  };
  MPI_Request barrier = MPI_REQUEST_NULL;
  // Under mu_. The sends still in flight, named: the receiver of each never took it.
  auto result = [this](bool met, Status status) {
    DrainResult r{SendsInFlightLocked(), "", met, std::move(status)};
    if (r.undelivered > 0) r.undelivered_detail = DescribeSendsInFlightLocked(8);
    return r;
  };
  const auto start = std::chrono::steady_clock::now();
  // A broken transport (requests abandoned mid-message) has a peer that stopped answering:
  // its sends to it will not complete, so it joins the barrier at once. The abandoned
  // requests themselves are never waited on.
  const auto half_way =
      start + std::max(deadline - start, std::chrono::steady_clock::duration::zero()) / 2;
  const auto join_anyway = broken() || Closing() ? start : half_way;
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!MpiIsUsable()) return result(false, failure);
      note(ProgressLocked());
      const bool sends_done = SendsInFlightLocked() == 0;
      if (barrier == MPI_REQUEST_NULL &&
          (sends_done || std::chrono::steady_clock::now() > join_anyway)) {
        if (int rc = MPI_Ibarrier(comm_, &barrier); rc != MPI_SUCCESS) {
          note(Status::MpiError("MPI_Ibarrier", rc));
          return result(false, failure);
        }
      }
      if (barrier != MPI_REQUEST_NULL) {
        int done = 0;
        if (int rc = MPI_Test(&barrier, &done, MPI_STATUS_IGNORE); rc != MPI_SUCCESS) {
          note(Status::MpiError("MPI_Test", rc));
          return result(false, failure);
        }
        if (done) {
          note(ProgressLocked());
          return result(true, failure);
        }
      }
      if (std::chrono::steady_clock::now() > deadline) {
        // A peer never reached its exit (or died): report only our own undelivered sends.
        // The barrier request is left to MPI_Finalize.
        return result(false, failure);
      }
    }
    backoff.Pause();
  }
}

}  // namespace jcm
