// What the error of an op that timed out tells of the MPI transport (StallReport, see
// mpi/transport.h). A stall that happens once in many launches must explain itself in the
// error it ends with: which message each end was at, which ready signals went where, what
// was deferred or left in flight, and what the peer sent that nobody took. Only the timeout
// path runs this, so it may take its time. The channel and send-queue mutexes are tried for a
// while, not taken: a psend stuck in its own wait holds its channel's send_mu for the whole
// timeout, and shows as busy. The leaf mutexes (channels_mu_, deferred_mu_) and MPI's call
// lock are taken: nothing waits while holding them.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <iomanip>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "mpi/internal.h"
#include "mpi/transport.h"

namespace jcm {
namespace {

using Clock = std::chrono::steady_clock;

// "12.3 s ago" (from `now`), or "never" for a time never set.
std::string Ago(Clock::time_point when, Clock::time_point now) {
  if (when == Clock::time_point{}) return "never";
  std::ostringstream s;
  s << std::fixed << std::setprecision(3)
    << std::chrono::duration<double>(now - when).count() << " s ago";
  return s.str();
}

// `mu` locked if it comes free within `patience`. A holder passing through (a poll of the
// send queue, every 64th turn of a receive loop) lets go within microseconds, and a single
// try would report it busy exactly when sends are in flight, the case the report is for.
std::unique_lock<std::mutex> TryFor(std::mutex& mu) {
  constexpr auto kPatience = std::chrono::milliseconds(20);
  std::unique_lock<std::mutex> lock(mu, std::try_to_lock);
  const auto until = Clock::now() + kPatience;
  while (!lock.owns_lock() && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    (void)lock.try_lock();
  }
  return lock;
}

}  // namespace

std::string MpiTransport::StallReport(int peer_rank, int recv_tag, int send_tag) {
  const auto now = Clock::now();
  std::ostringstream out;
  out << "\n  Transport state at the timeout (this process is MPI rank " << rank_;
  if (peer_rank >= 0) out << "; the peer MPI rank " << peer_rank;
  out << "; message numbers count from 0 per channel and direction):";

  // The channels (never erased: the pointers stay valid without channels_mu_, a leaf
  // mutex), those of the op's own tags first.
  struct Listed {
    int tag;
    ChannelState* ch;
  };
  std::vector<Listed> channels;
  {
    std::lock_guard<std::mutex> lock(channels_mu_);
    for (const auto& [key, ch] : channels_) {
      if (peer_rank < 0 || key.first == peer_rank) channels.push_back({key.second, ch.get()});
    }
  }
  auto rank_of = [&](const Listed& c) {
    return c.tag == recv_tag ? 0 : c.tag == send_tag ? 1 : 2;
  };
  std::stable_sort(channels.begin(), channels.end(), [&](const Listed& a, const Listed& b) {
    return rank_of(a) < rank_of(b);
  });
  constexpr size_t kMaxChannels = 8;  // a job of many devices has many pairs
  size_t shown = 0, quiet = 0;
  for (const Listed& c : channels) {
    ChannelState& ch = *c.ch;
    const bool mine = c.tag == recv_tag || c.tag == send_tag;
    if (!mine && shown >= kMaxChannels) {
      ++quiet;
      continue;
    }
    std::ostringstream line;
    bool said = false;
    {
      std::unique_lock<std::mutex> recv_lock = TryFor(ch.recv_mu);
      if (!recv_lock.owns_lock()) {
        line << "\n    receives from rank " << ch.peer_rank << ", tag " << c.tag
             << ": busy (a receive is waiting on it now)";
        said = true;
      } else if (ch.next_recv_seq > 0 || c.tag == recv_tag) {
        const uint64_t seq = ch.next_recv_seq;
        line << "\n    receives from rank " << ch.peer_rank << ", tag " << c.tag << ": ";
        if (seq == 0) {
          line << "none yet";
        } else {
          using End = ChannelState::RecvEnd;
          line << "the latest, #" << seq - 1 << ", "
               << (ch.recv_end == End::kTaken    ? "taken"
                   : ch.recv_end == End::kFailed ? "failed"
                                                 : "being received")
               << "; it was a "
               << (ch.recv_rendezvous ? "rendezvous-size receive (direct receives "
                                      : "staged receive (");
          if (ch.recv_rendezvous) line << (ch.direct_posted ? "posted, " : "not posted, ");
          line << (ch.staged_matched ? "a staged message matched)"
                                     : "no staged message matched)");
        }
        line << "; ready signals sent: " << ch.ready_sent;
        if (ch.ready_sent > 0) {
          line << ", the latest for #" << ch.last_ready_sent_seq << ", "
               << Ago(ch.last_ready_sent_at, now);
        }
        said = true;
      }
    }
    {
      std::unique_lock<std::mutex> send_lock = TryFor(ch.send_mu);
      if (!send_lock.owns_lock()) {
        line << "\n    sends to rank " << ch.peer_rank << ", tag " << c.tag
             << ": busy (a psend or a deferred send's post is at it now)";
        said = true;
      } else if (ch.next_send_seq > 0 || ch.ready_seen > 0 || ch.deferred ||
                 c.tag == send_tag) {
        line << "\n    sends to rank " << ch.peer_rank << ", tag " << c.tag << ": "
             << ch.next_send_seq << " sent or under way";
        if (ch.next_send_seq > 0) line << " (the latest #" << ch.next_send_seq - 1 << ")";
        line << "; ready signals read from the receiver: " << ch.ready_seen;
        if (ch.ready_seen > 0) {
          // The receiver numbers its receives as we number our sends: its latest signal
          // says which message it was waiting for then.
          line << ", the latest for #" << ch.last_ready_seen.seq << " ("
               << ch.last_ready_seen.bytes << " bytes), " << Ago(ch.last_ready_seen_at, now);
        }
        if (ch.has_early_ready) {
          line << "; kept for a later message: the signal for #" << ch.early_ready.seq;
        }
        if (const std::shared_ptr<DirectSend> d = ch.deferred) {
          line << "; deferred, waiting for its ready signal: #" << d->seq << " of " << d->bytes
               << " bytes, " << Ago(d->deferred_at, now);
        }
        said = true;
      }
    }
    if (said) {
      out << line.str();
      if (!mine) ++shown;
    }
  }
  if (quiet > 0) out << "\n    (" << quiet << " more channels not shown)";

  // What the peer sent that is still unreceived: one probe per communicator. A broken
  // transport makes no more MPI calls (see Usable).
  if (peer_rank >= 0) {
    if (!MpiIsUsable() || broken()) {
      out << "\n    unreceived from rank " << peer_rank << ": not probed ("
          << (broken() ? "the transport is broken: it makes no more MPI calls"
                       : kMpiNotUsable)
          << ")";
    } else {
      struct Probed {
        const char* what;
        MPI_Comm comm;
      };
      const Probed probes[] = {{"a staged message or chunk", comm_},
                               {"a ready signal (for our send)", ctrl_comm_},
                               {"a direct message (no receive posted for it)", direct_comm_}};
      out << "\n    unreceived from rank " << peer_rank << " now:";
      bool any = false;
      for (const Probed& p : probes) {
        int flag = 0, count = 0;
        MPI_Status status;
        std::unique_lock<std::mutex> lock = MpiCallLock();
        // Another op may have broken the transport since the check above (a stalled peer
        // often fails several at once): no MPI call may progress its abandoned requests.
        if (!Usable().ok()) {
          out << " (not probed further: the transport broke meanwhile)";
          any = true;
          break;
        }
        if (MPI_Iprobe(peer_rank, MPI_ANY_TAG, p.comm, &flag, &status) != MPI_SUCCESS) {
          out << " (MPI_Iprobe failed)";
          break;
        }
        if (!flag) continue;
        MPI_Get_count(&status, MPI_BYTE, &count);
        out << (any ? ";" : "") << " " << p.what << " on tag " << status.MPI_TAG << " ("
            << count << " bytes)";
        any = true;
      }
      if (!any) out << " nothing";
    }
  }

  // The process's sends in flight, every peer.
  size_t deferred = 0;
  {
    std::lock_guard<std::mutex> lock(deferred_mu_);
    deferred = deferred_channels_.size();
  }
  {
    std::unique_lock<std::mutex> lock = TryFor(mu_);
    if (!lock.owns_lock()) {
      out << "\n    this process: its send queue is busy (another thread is in an MPI call)";
    } else {
      out << "\n    this process: " << pending_.size() << " staged sends in flight ("
          << inflight_bytes_ << " bytes), " << direct_in_flight_.size()
          << " direct sends in flight, " << deferred << " deferred, "
          << control_sends_.size() << " ready signals still being sent, "
          << sends_completed_ << " sends finished";
      if (!abandoned_.empty()) out << ", " << abandoned_.size() << " abandoned requests";
    }
  }
  return out.str();
}

std::vector<MpiTransport::Unreceived> MpiTransport::ProbeUnreceived() {
  std::vector<Unreceived> found;
  struct Probed {
    const char* kind;
    MPI_Comm comm;
  };
  const Probed probes[] = {{"staged", comm_}, {"ready", ctrl_comm_}, {"direct", direct_comm_}};
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    for (const Probed& p : probes) {
      std::unique_lock<std::mutex> lock = MpiCallLock();
      if (!MpiIsUsable() || broken()) return found;
      int flag = 0, count = 0;
      MPI_Status status;
      if (MPI_Iprobe(peer, MPI_ANY_TAG, p.comm, &flag, &status) != MPI_SUCCESS || !flag) continue;
      MPI_Get_count(&status, MPI_BYTE, &count);
      found.push_back({p.kind, peer, status.MPI_TAG, count});
    }
  }
  return found;
}

std::string MpiTransport::DescribeSendsInFlightLocked(size_t limit) const {
  // The description travels in the message's own envelope (the staged trailer or chunk
  // header, mpi/framing.h): nothing is kept per send for this report. A direct send
  // carries none; a deferred one keeps its description.
  std::ostringstream out;
  size_t shown = 0, total = pending_.size() + direct_in_flight_.size();
  auto line = [&](const std::string& desc, size_t bytes, int dest, int tag, const char* how) {
    if (shown++ >= limit) return;
    out << (shown > 1 ? "\n" : "") << "    " << (desc.empty() ? "a message" : desc) << " ("
        << bytes << " bytes) to MPI rank " << dest << " on tag " << tag << ", " << how;
  };
  for (const PendingSend& p : pending_) {
    std::string desc;
    if (p.header) {
      desc = p.header->Description();
    } else if (p.buffer.data() != nullptr) {
      Envelope e;
      std::memcpy(&e, p.buffer.data() + p.bytes, sizeof(e));
      if (e.magic == kPayloadMagic) desc = e.Description();
    }
    line(desc, p.bytes, p.dest_rank, p.tag, "staged");
  }
  for (const std::shared_ptr<DirectSend>& d : direct_in_flight_) {
    const std::string desc = d->header ? d->header->Description() : d->desc_text;
    line(desc, d->bytes, d->dest_rank, d->tag,
         d->header ? "framed from its operand" : "straight from its operand");
  }
  if (total > limit) out << "\n    (" << total - limit << " more)";
  return out.str();
}

}  // namespace jcm
