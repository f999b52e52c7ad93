// The rendezvous path of large MPI messages (see mpi/transport.h): the receiver's ready
// signal, the sender's choice between a direct send from its operand and a staged copy,
// and the receiver's direct receives into its output.
#include <algorithm>
#include <cstring>

#include "common/keep_freed_memory.h"
#include "mpi/internal.h"
#include "mpi/stop_for_test.h"
#include "mpi/transport.h"

namespace jcm {

Status MpiTransport::PollReady(ChannelState& ch, uint64_t seq, int dest_rank, int tag,
                               bool* ready, ReadySignal* receiver,
                               std::chrono::steady_clock::time_point deadline) {
  *ready = false;
  auto take = [&](const ReadySignal& signal) {
    if (signal.seq < seq) return false;  // an older message, which went staged: forget it
    if (signal.seq == seq) {
      *ready = true;
      *receiver = signal;
    } else {
      ch.has_early_ready = true;  // a later message (the two ends lost count after an error)
      ch.early_ready = signal;
    }
    return true;
  };
  if (ch.has_early_ready) {
    ch.has_early_ready = false;
    if (take(ch.early_ready)) return Status::Ok();
  }
  while (true) {
    int flag = 0;
    MPI_Message message = MPI_MESSAGE_NULL;
    {
      std::unique_lock<std::mutex> lock = MpiCallLock();
      if (Status s = Usable(); !s.ok()) return s;
      int rc = MPI_Improbe(dest_rank, tag, ctrl_comm_, &flag, &message, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) return Status::MpiError("MPI_Improbe", rc);
      if (!flag) return Status::Ok();
    }
    // Tiny, so it has arrived whole by now on any MPI we know of; still waited for with a
    // deadline, and owned by the wait in case it has to be abandoned.
    // The channel's buffer, unless an abandoned receive still holds it (send_mu is held).
    const std::shared_ptr<ReadySignal>& signal = ReusableOrNew(ch.ready_in);
    if (Status s = ReceiveMatched(&message, signal.get(), sizeof(ReadySignal), deadline,
                                  signal);
        !s.ok()) {
      return s;
    }
    ++ch.ready_seen;  // for StallReport
    ch.last_ready_seen = *signal;
    ch.last_ready_seen_at = std::chrono::steady_clock::now();
    if (take(*signal)) return Status::Ok();
  }
}

void MpiTransport::CompleteDirectLocked(DirectSend& send) {
  send.done = true;
  ++sends_completed_;
  if (!send.header) ++direct_sends_;  // a framed send is received as a staged one
}

Status MpiTransport::PostFromOperand(const std::shared_ptr<DirectSend>& send,
                                     MpiPostFn post, const char* post_name, MPI_Comm comm,
                                     int dest_rank, int tag, const void* data, size_t bytes,
                                     std::chrono::steady_clock::time_point deadline) {
  send->requests.reserve(send->requests.size() + bytes / kDirectChunkBytes + 2);
  const auto* src = static_cast<const std::byte*>(data);
  std::unique_lock<std::mutex> lock(mu_);  // direct_in_flight_ (and MPI if needed)
  send->dest_rank = dest_rank;
  send->tag = tag;
  send->bytes = bytes;
  auto post_one = [&](const void* buf, size_t count) {
    send->requests.emplace_back();
    int rc = post(buf, static_cast<int>(count), MPI_BYTE, dest_rank, tag, comm,
                  &send->requests.back());
    if (rc != MPI_SUCCESS) send->requests.pop_back();
    return rc;
  };
  int rc = send->header && !send->bare ? post_one(&*send->header, sizeof(Envelope))
                                        : MPI_SUCCESS;
  for (size_t offset = 0; offset < bytes && rc == MPI_SUCCESS; offset += kDirectChunkBytes) {
    rc = post_one(src + offset, std::min(kDirectChunkBytes, bytes - offset));
  }
  if (rc != MPI_SUCCESS) {
    if (!send->requests.empty()) {
      // The pieces already posted read from the operand: finish them before returning.
      direct_in_flight_.push_back(send);
      lock.unlock();
      (void)FinishDirect(send, deadline);  // the failed post is the error to report
    }
    return Status::MpiError(post_name, rc);
  }
  send->posted_for_test = StopMidSendForTest::Posted(bytes);
  direct_in_flight_.push_back(send);
  return Status::Ok();
}

Status MpiTransport::SendDirect(int dest_rank, int tag, const void* data, size_t bytes,
                                std::chrono::steady_clock::time_point deadline,
                                std::shared_ptr<DirectSend>* kept,
                                std::shared_ptr<DirectSend> into) {
  // A deferred send is posted on behalf of whatever op polls: not that op's path.
  if (!into) trace::NotePath(trace::Path::kDirect);
  std::shared_ptr<DirectSend> send = into ? std::move(into) : std::make_shared<DirectSend>();
  // Synchronous mode: once it completes, the receive has matched, so the receiver can
  // never cancel it as a receive that a staged message superseded.
  if (Status s = PostFromOperand(send, &MPI_Issend, "MPI_Issend", direct_comm_, dest_rank,
                                 tag, data, bytes, deadline);
      !s.ok()) {
    return s;
  }
  if (kept) {
    *kept = std::move(send);
    return Status::Ok();
  }
  return FinishDirect(send, deadline);
}

std::shared_ptr<MpiTransport::DirectSend> MpiTransport::ReuseDirectSend(ChannelState& ch) {
  // Nothing else holds the spare once its precv finished it and the transport's list of
  // sends in flight let it go (a deferred send, an abandoned one, a kept entry not yet
  // finished all hold it).
  DirectSend& send = *ReusableOrNew(ch.spare_send);
  std::vector<MPI_Request> requests = std::move(send.requests);
  requests.clear();  // keeps its capacity
  send = DirectSend{};
  send.requests = std::move(requests);
  return ch.spare_send;
}

Status MpiTransport::SendFramed(ChannelState& ch, int dest_rank, int tag, const void* data,
                                size_t bytes, const Desc& desc,
                                std::chrono::steady_clock::time_point deadline,
                                std::shared_ptr<DirectSend>* kept) {
  // The staged framing, so the receiver takes it as a staged message: the sender notes
  // what the receiver sees (no copy is made, but no direct receive takes it either).
  trace::NotePath(trace::Path::kStaged);
  std::shared_ptr<DirectSend> send = ReuseDirectSend(ch);
  // The chunk header says how the receiver posts the chunks: one message up to
  // kDirectChunkBytes (MPI moves it in one copy, straight from the operand).
  send->header = MakeEnvelope(kChunkMagic, bytes, desc.hash, desc.text);
  send->header->chunk_bytes = std::min(bytes, kDirectChunkBytes);
  // The receiver has this header already when it is the channel's last (mpi/framing.h).
  const Envelope& last = ch.last_header_sent;
  send->bare = AllowsBare(last) && last.total_bytes == bytes && last.desc_hash == desc.hash &&
               send->header->chunk_bytes == bytes;
  Status posted = PostFromOperand(send, &MPI_Isend, "MPI_Isend", comm_, dest_rank, tag, data,
                                  bytes, deadline);
  // A header posted is the receiver's last one, even when a later piece failed to post.
  if (!send->bare && !send->requests.empty()) ch.last_header_sent = *send->header;
  if (!posted.ok()) return posted;
  if (send->bare) bare_sends_.fetch_add(1, std::memory_order_relaxed);
  *kept = std::move(send);
  return Status::Ok();
}

void MpiTransport::PrefaultOrPause(OutputPrefault& prefault, AdaptedPause& pause) {
  // A send of ours that waits for its receiver's ready signal goes first (an exchange, a
  // ring): the receive loop posts it at its next poll, and its receiver waits for it.
  if (deferred_count_.load(std::memory_order_acquire) == 0 && prefault.Step()) {
    // The step stands for this poll's pause, and the wait has begun all the same (the
    // timeline's wait would otherwise start only after the whole output was faulted in).
    pause.Waiting();
    return;
  }
  pause.Pause();
}

bool MpiTransport::PointToPointSpinAdapts(const Backoff& backoff) const {
  return !backoff.spins_long() && wait_choice_.local_devices == 1;
}

Status MpiTransport::FinishDirect(const std::shared_ptr<DirectSend>& send,
                                  std::chrono::steady_clock::time_point deadline) {
  if (send->channel) {  // a deferred send: post it, or stage it, now if not done yet
    auto& ch = *static_cast<ChannelState*>(send->channel);
    std::lock_guard<std::mutex> channel_lock(ch.send_mu);
    SendLockHeld held;
    if (send->deferred) {
      bool posted = false;
      if (Status s = PostDeferredLocked(ch, /*complete=*/true, deadline, &posted); !s.ok()) {
        FailDeferred(send, s);
      }
    }
  }
  // A framed (one-way) send is waited for here until the receiver's precv of the psend's
  // op takes it: MPI cannot cancel a send whose operand XLA is about to reuse. Why that
  // wait, which the staged copy it replaces never had, adds no deadlock:
  // - The receiver needs nothing more from this device for it: every piece was posted when
  //   the psend ran, and this loop keeps MPI progressing (over TCP the bytes move only
  //   while the sender calls MPI) and posts this process's deferred sends.
  // - This precv is the send's last keeper on this device (kept-operands pass): it runs no
  //   earlier than the precv of the psend's own op, which is the precv the receiver takes
  //   the message in. Every process runs the same compiled program (identical text, so the
  //   same thunk sequence), so whatever the receiver runs before that precv and needs this
  //   device for (a message from it, a collective it must join) this device has run
  //   before it too: the messages were posted, the collective joined.
  // - Only two devices that run that precv and an independent collective in opposite
  //   orders could wait for each other here (this one in the precv, the receiver in the
  //   collective). XLA orders our custom calls by their buffers alone, but one device's
  //   thread runs the compiled sequence, or its ready queue, in one deterministic order,
  //   the same on every device; an order differs only where XLA hands ready calls to
  //   another thread (or resumes after an asynchronous call), and a call run elsewhere
  //   runs while this one waits. The mirror divergence (the receiver's precv before the
  //   collective, the sender's psend after it) deadlocks a plain receive as much.
  //   tests/mpi_programs/rendezvous.py's `ordering` case runs a hop between two independent
  //   psums (MPI and gloo) and two one-way ops in opposite directions in one step, under
  //   a short timeout.
  // And it is bounded: at the deadline the send is abandoned and the precv fails.
  Backoff backoff;
  {
    // The wait for the receiver to take the bytes: its spin adapts as RecvLarge's does
    // (where both ranks share a core, the receiver copies only once this thread yields).
    thread_local AdaptiveSpin adaptive;
    AdaptedPause pause(adaptive, backoff, PointToPointSpinAdapts(backoff));
    uint64_t polls = 0;
    while (true) {
      if (Status s = ProgressDeferred(deadline); !s.ok()) return s;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (send->done) return send->failed;
        if (!MpiIsUsable()) return Status::Invalid(kMpiNotUsable);
        if (Status s = ProgressLocked(); !s.ok()) return s;
        if (send->done) return send->failed;
        // A broken transport (see Usable) stops the wait too: its request is then cancelled
        // or abandoned like one at its deadline, never left to a later progress call.
        if ((++polls & 63) == 0 && (Expired(deadline) || broken())) {
          // Ours alone from here: the progress of other threads no longer tests it.
          direct_in_flight_.erase(
              std::remove(direct_in_flight_.begin(), direct_in_flight_.end(), send),
              direct_in_flight_.end());
          break;
        }
      }
      pause.Pause();
    }
  }
  // The receiver matched (or will never match) a send from an operand that XLA is about to
  // reuse: cancel what can be cancelled, abandon the rest (the transport is then broken).
  // A framed send is not cancelled: MPICH's UCX netmod crashes (SIGSEGV in
  // ucp_request_cancel) cancelling its MPI_Isend that no receive matched; it is abandoned
  // after the grace period, as a send MPI cannot cancel.
  size_t cancelled = 0;
  bool abandoned = false;
  Status s = CancelWithGrace(send->requests, &cancelled, &abandoned, nullptr,
                             /*cancel=*/!send->header);
  if (!s.ok() && !abandoned) return s;
  if (cancelled == 0 && !abandoned) {  // delivered whole, just in time
    std::lock_guard<std::mutex> lock(mu_);
    CompleteDirectLocked(*send);
    return Status::Ok();
  }
  if (!Expired(deadline)) return Status::Invalid(BrokenMessage());  // stopped by the break
  if (send->header) {
    return Status::SendTimeout(
        "the receiver did not take this message before the timeout "
        "(JAX_CPU_MPI_RECV_TIMEOUT); did its process fail or exit, or not reach its precv "
        "of this op in time? (set JAX_CPU_MPI_RECV_TIMEOUT to wait longer)");
  }
  return Status::SendTimeout(
      "the receiver signalled that it was ready for this message, then did not take it "
      "before the timeout (JAX_CPU_MPI_RECV_TIMEOUT); did its process fail or exit?");
}

Status MpiTransport::SendLarge(ChannelState& ch, uint64_t seq, int dest_rank, int tag,
                               const void* data, size_t bytes, const Desc& desc,
                               uint64_t max_inflight_bytes,
                               std::chrono::steady_clock::time_point deadline,
                               std::shared_ptr<DirectSend>* kept, bool may_defer,
                               std::shared_ptr<DirectSend> into) {
  bool ready = false;
  // The receiver waits for another byte count, dtype or shape: send staged (its envelope
  // lets the receiver report the mismatch).
  bool mismatch = false;
  auto poll = [&](bool* go_direct) -> Status {
    *go_direct = false;
    if (mismatch) return Status::Ok();
    ReadySignal receiver;
    Status s = PollReady(ch, seq, dest_rank, tag, &ready, &receiver, deadline);
    if (s.ok() && ready) {
      if (receiver.bytes == bytes && receiver.desc_hash == desc.hash) *go_direct = true;
      else mismatch = true;
    }
    return s;
  };
  bool go_direct = false;
  if (Status s = poll(&go_direct); !s.ok()) return s;
  if (go_direct) return SendDirect(dest_rank, tag, data, bytes, deadline, kept, into);
  if (kept && may_defer && !mismatch) {
    // The operand stays alive until the precv that keeps it, which receives too: rather
    // than copying it for a receiver that is not ready yet, leave the send to the receive
    // loops that run until then (ProgressDeferred), which post it straight from the operand once the receiver
    // signals; that precv completes it if it is still deferred (FinishDirect).
    std::shared_ptr<DirectSend> send = ReuseDirectSend(ch);
    send->deferred = true;
    send->channel = &ch;
    send->seq = seq;
    send->dest_rank = dest_rank;
    send->tag = tag;
    send->data = data;
    send->bytes = bytes;
    send->desc_text = std::string(desc.text);
    send->desc_hash = desc.hash;
    send->max_inflight_bytes = max_inflight_bytes;
    send->deferred_at = std::chrono::steady_clock::now();
    ch.deferred = send;
    {
      std::lock_guard<std::mutex> lock(deferred_mu_);
      ch.deferred_id = ++last_deferred_id_;
      deferred_channels_.push_back(&ch);
      deferred_count_.store(deferred_channels_.size(), std::memory_order_release);
    }
    *kept = std::move(send);
    return Status::Ok();
  }
  const auto spin_until = std::chrono::steady_clock::now() + kReadySpin;
  while (!go_direct && !mismatch && std::chrono::steady_clock::now() < spin_until) {
    if (Status s = poll(&go_direct); !s.ok()) return s;
  }
  if (go_direct) return SendDirect(dest_rank, tag, data, bytes, deadline, kept, into);

  bool stopped = false;
  if (Status s = ReserveInflight(bytes, max_inflight_bytes, deadline, poll, &stopped);
      !s.ok()) {
    return s;
  }
  if (stopped) return SendDirect(dest_rank, tag, data, bytes, deadline, kept, into);

  // Stage, looking for the receiver between steps: a receiver that gets ready within about
  // one copy's time still gets the message straight from the operand.
  PendingSend send;
  send.bytes = bytes;
  send.buffer = GlobalBufferPool().Acquire(StagedBufferBytes(bytes));
  const auto* src = static_cast<const std::byte*>(data);
  for (size_t offset = 0; offset < bytes; offset += kStageStepBytes) {
    std::memcpy(send.buffer.data() + offset, src + offset, std::min(kStageStepBytes,
                                                                    bytes - offset));
    if (offset + kStageStepBytes >= bytes) break;  // copied: send the copy, return at once
    if (Status s = poll(&go_direct); !s.ok() || go_direct) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        inflight_bytes_ -= bytes;  // the reservation is not needed
      }
      if (!s.ok()) return s;
      return SendDirect(dest_rank, tag, data, bytes, deadline, kept, into);
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++staged_large_sends_;
  }
  if (!into) trace::NotePath(trace::Path::kStaged);
  Status sent = IsendStaged(ch, std::move(send), dest_rank, tag, desc);
  if (into) {
    // The staged copy carries the message from here: the operand is free.
    std::lock_guard<std::mutex> lock(mu_);
    into->done = true;
    into->failed = sent;
  }
  return sent;
}

void MpiTransport::FailDeferred(const std::shared_ptr<DirectSend>& send, Status failure) {
  std::lock_guard<std::mutex> lock(mu_);
  if (send->done || !send->requests.empty()) return;  // posted or staged: reports its own
  send->done = true;
  send->failed = std::move(failure);
}

Status MpiTransport::PostDeferredLocked(ChannelState& ch, bool complete,
                                        std::chrono::steady_clock::time_point deadline,
                                        bool* posted) {
  *posted = false;
  std::shared_ptr<DirectSend> d = ch.deferred;
  if (!d) return Status::Ok();
  auto unlink = [&] {
    ch.deferred.reset();
    d->deferred = false;
    std::lock_guard<std::mutex> lock(deferred_mu_);
    deferred_channels_.erase(
        std::remove(deferred_channels_.begin(), deferred_channels_.end(), &ch),
        deferred_channels_.end());
    deferred_count_.store(deferred_channels_.size(), std::memory_order_release);
  };
  std::shared_ptr<DirectSend> unused;  // a direct send is left in flight, for its precv
  if (!complete) {
    bool ready = false;
    ReadySignal receiver;
    if (Status s = PollReady(ch, d->seq, d->dest_rank, d->tag, &ready, &receiver, deadline);
        !s.ok()) {
      return s;
    }
    if (!ready) return Status::Ok();
    unlink();
    *posted = true;
    if (receiver.bytes == d->bytes && receiver.desc_hash == d->desc_hash) {
      return SendDirect(d->dest_rank, d->tag, d->data, d->bytes, deadline, &unused, d);
    }
    // Another byte count, dtype or shape: staged below (its signal is consumed, so
    // SendLarge finds none and stages), for the receiver to report the mismatch.
  } else {
    unlink();
    *posted = true;
  }
  const Desc desc{d->desc_text, d->desc_hash};
  return SendLarge(ch, d->seq, d->dest_rank, d->tag, d->data, d->bytes, desc,
                   d->max_inflight_bytes, deadline, &unused, /*may_defer=*/false, d);
}

Status MpiTransport::ProgressDeferred(std::chrono::steady_clock::time_point deadline,
                                      std::chrono::nanoseconds min_age) {
  if (deferred_count_.load(std::memory_order_acquire) == 0 || t_send_locks > 0) {
    return Status::Ok();
  }
  if (Status s = Usable(); !s.ok()) return s;
  // A copy of the list, as posting a send unlinks it under deferred_mu_; kept in this
  // thread's buffer, since the receive loops call this at every poll while a send is
  // deferred and a fresh vector would be a malloc each time. Moved out and back, so that a
  // nested call (none today: t_send_locks stops it) would only allocate.
  thread_local std::vector<ChannelState*> t_channels;
  std::vector<ChannelState*> channels = std::move(t_channels);
  {
    std::lock_guard<std::mutex> lock(deferred_mu_);
    channels.assign(deferred_channels_.begin(), deferred_channels_.end());
  }
  for (ChannelState* ch : channels) {
    std::unique_lock<std::mutex> channel_lock(ch->send_mu, std::try_to_lock);
    if (!channel_lock.owns_lock()) continue;  // its psend or precv is at it
    SendLockHeld held;
    const std::shared_ptr<DirectSend> d = ch->deferred;
    if (!d) continue;
    if (min_age.count() > 0 && std::chrono::steady_clock::now() - d->deferred_at < min_age) {
      continue;
    }
    bool posted = false;
    // A failure belongs to the send (its precv reports it), not to the op that polls.
    Status s = PostDeferredLocked(*ch, /*complete=*/false, deadline, &posted);
    if (s.ok() && !posted &&
        std::chrono::steady_clock::now() - d->deferred_at > DeferredPatience(d->bytes)) {
      s = PostDeferredLocked(*ch, /*complete=*/true, deadline, &posted);  // staged
    }
    if (!s.ok()) FailDeferred(d, s);
  }
  t_channels = std::move(channels);
  return Status::Ok();
}

uint64_t MpiTransport::DeferredMark() {
  if (deferred_count_.load(std::memory_order_acquire) == 0) return 0;
  std::lock_guard<std::mutex> lock(deferred_mu_);
  return deferred_channels_.empty() ? 0 : last_deferred_id_;
}

bool MpiTransport::HasDeferredUpTo(uint64_t mark) {
  if (mark == 0 || deferred_count_.load(std::memory_order_acquire) == 0) return false;
  std::lock_guard<std::mutex> lock(deferred_mu_);
  return std::any_of(deferred_channels_.begin(), deferred_channels_.end(),
                     [mark](const ChannelState* ch) { return ch->deferred_id <= mark; });
}

Status MpiTransport::RecvLarge(ChannelState& ch, uint64_t seq, int source_rank, int tag,
                               void* out, size_t bytes, uint64_t desc_hash,
                               std::chrono::steady_clock::time_point deadline) {
  // While a send of ours is still deferred (see below), the ready signal goes first: the
  // peer's send waits for it, and the loop below finds a staged message. Only the sends
  // deferred before this receive count (in an exchange or a ring, its own op's psend), so
  // that sends which other device threads keep deferring cannot hold it back for ever.
  const uint64_t deferred_mark = DeferredMark();
  const bool send_first = deferred_mark != 0;
  if (Status s = Usable(); !s.ok()) return s;
  if (!send_first) {
    // Already sent staged (the sender did not find us ready): take it the plain way.
    int flag = 0;
    std::unique_lock<std::mutex> lock = MpiCallLock();
    int rc = MPI_Iprobe(source_rank, tag, comm_, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return Status::MpiError("MPI_Iprobe", rc);
    if (flag) {
      if (lock.owns_lock()) lock.unlock();
      return RecvStaged(ch, source_rank, tag, out, bytes, desc_hash, deadline);
    }
  }
  // Post the receives into the output, then tell the sender that we are ready. In an
  // exchange or a ring, while our own send is still deferred (to this peer or, in a ring of
  // more than 2 ranks, to the next one), the receives are posted only once it is posted (or
  // staged), after the ready signal: MPI copies a message into a posted receive inside
  // whichever MPI call sees it arrive (over shared memory, the whole payload at once), so a
  // receive posted first could take the peer's message inside the probe that looks for our
  // receiver's ready signal, and post our send only after that copy: one transfer after the
  // other instead of both at once (in a ring, each rank's send waiting for its previous
  // rank's copy). MPI_Sendrecv starts its send before it waits for its receive. The peer's
  // direct send (synchronous mode) waits unmatched until our receives are posted, and the
  // ready signals do not depend on them: every rank of a ring signals before it waits.
  // The channel's list, which keeps its capacity from message to message (recv_mu is held).
  std::vector<MPI_Request>& requests = ch.recv_requests;
  requests.clear();
  auto* dst = static_cast<std::byte*>(out);
  auto post_receives = [&]() -> Status {
    requests.reserve(bytes / kDirectChunkBytes + 1);
    std::unique_lock<std::mutex> lock = MpiCallLock();
    for (size_t offset = 0; offset < bytes; offset += kDirectChunkBytes) {
      const size_t n = std::min(kDirectChunkBytes, bytes - offset);
      requests.emplace_back();
      int rc = MPI_Irecv(dst + offset, static_cast<int>(n), MPI_BYTE, source_rank, tag,
                         direct_comm_, &requests.back());
      if (rc != MPI_SUCCESS) {
        requests.pop_back();
        if (lock.owns_lock()) lock.unlock();
        size_t cancelled = 0;
        bool abandoned = false;
        // Nothing can have matched before the ready signal; the Irecv failure is the error.
        (void)CancelWithGrace(requests, &cancelled, &abandoned, nullptr);
        return Status::MpiError("MPI_Irecv", rc);
      }
    }
    ch.direct_posted = true;
    return Status::Ok();
  };
  bool posted = !send_first;
  if (posted) {
    if (Status s = post_receives(); !s.ok()) return s;
  }
  {
    std::unique_lock<std::mutex> lock(mu_);  // control_sends_ (and MPI if needed)
    // Sent from its place in the queue, which stays put until it completes (a deque's
    // elements do not move as it grows or shrinks at its ends).
    ControlSend& control = control_sends_.emplace_back();
    control.signal = ReadySignal{seq, bytes, desc_hash};
    int rc = MPI_Isend(&control.signal, sizeof(ReadySignal), MPI_BYTE, source_rank, tag,
                       ctrl_comm_, &control.request);
    if (rc != MPI_SUCCESS) {
      control_sends_.pop_back();
      lock.unlock();
      size_t cancelled = 0;
      bool abandoned = false;
      (void)CancelWithGrace(requests, &cancelled, &abandoned, nullptr);  // as above
      return Status::MpiError("MPI_Isend of the ready signal", rc);
    }
    ++ch.ready_sent;
    ch.last_ready_sent_seq = seq;
    ch.last_ready_sent_at = std::chrono::steady_clock::now();
  }
  Backoff backoff;
  OutputPrefault prefault(out, ch.recv_prefault ? bytes : 0);
  // The wait's spin adapts (AdaptiveSpin): where the scheduler put both ranks on one core,
  // the peer's send, its ready signal and MPI's handshakes each came only once this
  // thread had spun out Backoff's whole spin and yielded, at every message of an exchange.
  thread_local AdaptiveSpin adaptive;
  AdaptedPause pause(adaptive, backoff, PointToPointSpinAdapts(backoff));
  uint64_t polls = 0;
  while (true) {
    // Our own deferred sends, as their receivers get ready: both directions at once.
    if (Status s = ProgressDeferred(deadline); !s.ok()) return s;
    if (!posted && !HasDeferredUpTo(deferred_mark)) {
      if (Status s = post_receives(); !s.ok()) return s;
      posted = true;
    }
    int done = 0, staged = 0;
    {
      std::unique_lock<std::mutex> lock = MpiCallLock();
      int rc = posted ? MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done,
                                    MPI_STATUSES_IGNORE)
                      : MPI_SUCCESS;
      if (rc != MPI_SUCCESS) return Status::MpiError("MPI_Testall", rc);
      if (done) {  // straight into the output
        trace::NotePath(trace::Path::kDirect);
        return Status::Ok();
      }
      rc = MPI_Iprobe(source_rank, tag, comm_, &staged, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) return Status::MpiError("MPI_Iprobe", rc);
    }
    bool timed_out = false;
    if (!staged && (++polls & 63) == 0) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (Status s = ProgressLocked(); !s.ok()) return s;
      }
      timed_out = Expired(deadline);
    }
    if ((staged || timed_out) && !posted) {
      // Posted now all the same: this message may wait unmatched as a direct one (a staged
      // one is then the next message), and is taken below like any other.
      if (Status s = post_receives(); !s.ok()) return s;
      posted = true;
    }
    if (staged || timed_out) {
      // Either this message went staged (the sender did not see us in time; its direct
      // receives cannot have matched) or, if the direct message completed meanwhile, the
      // staged one is the next message, left for the next precv.
      // Receives that matched complete (the sender is under way) within the grace period,
      // unless that sender stopped mid-message: then they are abandoned, and this precv
      // fails with the usual timeout.
      size_t cancelled = 0;
      bool abandoned = false;
      Status s = CancelWithGrace(requests, &cancelled, &abandoned, nullptr);
      if (abandoned) {
        return Status::Timeout("a direct message started to arrive but did not complete");
      }
      if (!s.ok()) return s;
      if (cancelled == 0) {
        trace::NotePath(trace::Path::kDirect);
        return Status::Ok();
      }
      if (cancelled != requests.size()) {
        return Status::Invalid("internal error: a direct message arrived in part only");
      }
      if (staged) return RecvStaged(ch, source_rank, tag, out, bytes, desc_hash, deadline);
      return Status::Timeout();
    }
    PrefaultOrPause(prefault, pause);
  }
}

}  // namespace jcm
