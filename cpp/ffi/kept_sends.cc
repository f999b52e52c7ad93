#include "ffi/kept_sends.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace jcm {

void KeptSends::Add(const void* operand, int64_t run_id, int64_t partition, int64_t keepers,
                    Finish finish) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_.push_back(Entry{operand, run_id, partition, std::max<int64_t>(keepers, 1),
                           std::move(finish)});
  pending_count_.store(pending_.size(), std::memory_order_release);
  ++kept_total_;
}

namespace {

// The finishes a Release or FinishRun takes, in a list of its thread's that keeps its
// capacity (no allocation per message); a call made while the thread's list is in use
// (none is expected: a finish does not release) gets a list of its own.
class TakenFinishes {
 public:
  TakenFinishes() : list_(busy_ ? own_ : shared_) { busy_ = busy_ || &list_ == &shared_; }
  ~TakenFinishes() {
    list_.clear();  // drops the sends' records now, so their channel can reuse them
    if (&list_ == &shared_) busy_ = false;
  }
  TakenFinishes(const TakenFinishes&) = delete;
  TakenFinishes& operator=(const TakenFinishes&) = delete;
  std::vector<KeptSends::Finish>& list() { return list_; }

 private:
  static thread_local std::vector<KeptSends::Finish> shared_;
  static thread_local bool busy_;
  std::vector<KeptSends::Finish> own_;
  std::vector<KeptSends::Finish>& list_;
};
thread_local std::vector<KeptSends::Finish> TakenFinishes::shared_;
thread_local bool TakenFinishes::busy_ = false;

Status FinishEach(const std::vector<KeptSends::Finish>& finishes,
                  std::chrono::steady_clock::time_point deadline) {
  Status first_failure;
  for (const KeptSends::Finish& finish : finishes) {  // every one, even after an error
    Status s = finish(deadline);
    if (first_failure.ok()) first_failure = std::move(s);
  }
  return first_failure;
}

}  // namespace

template <typename Matches>
void KeptSends::Take(std::vector<Finish>& out, Matches matches) {
  size_t kept = 0;
  for (size_t i = 0; i < pending_.size(); ++i) {
    if (matches(pending_[i])) {
      out.push_back(std::move(pending_[i].finish));
    } else {
      if (kept != i) pending_[kept] = std::move(pending_[i]);
      ++kept;
    }
  }
  pending_.resize(kept);  // shrinks only: no allocation, the capacity stays
  pending_count_.store(pending_.size(), std::memory_order_release);
}

Status KeptSends::ReleaseSlow(
    const void* const* operands, size_t count, int64_t run_id, int64_t partition,
    const std::function<std::chrono::steady_clock::time_point()>& deadline_of) {
  // One pass over the pending entries, each looked up among the operands (sorted, when
  // there are more than a few), not a pass per operand. An entry reads from one operand, so
  // an address kept twice (one buffer, two values) still counts this precv off once.
  constexpr size_t kFewOperands = 8;
  thread_local std::vector<const void*> sorted;  // keeps its capacity
  const bool few = count <= kFewOperands;
  if (!few) {
    sorted.assign(operands, operands + count);
    std::sort(sorted.begin(), sorted.end());
  }
  auto kept = [&](const void* operand) {
    return few ? std::find(operands, operands + count, operand) != operands + count
               : std::binary_search(sorted.begin(), sorted.end(), operand);
  };
  TakenFinishes taken;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Take(taken.list(), [&](Entry& e) {
      return e.run_id == run_id && e.partition == partition && kept(e.operand) &&
             --e.keepers == 0;
    });
  }
  if (taken.list().empty()) return Status::Ok();
  return FinishEach(taken.list(), deadline_of());
}

Status KeptSends::FinishRun(int64_t run_id, int64_t partition,
                            std::chrono::steady_clock::time_point deadline) {
  if (pending_count_.load(std::memory_order_acquire) == 0) return Status::Ok();
  TakenFinishes taken;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Take(taken.list(), [&](const Entry& e) {
      return e.run_id == run_id && e.partition == partition;
    });
  }
  return FinishEach(taken.list(), deadline);
}

size_t KeptSends::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_.size();
}

uint64_t KeptSends::kept_total() const {
  std::lock_guard<std::mutex> lock(mu_);
  return kept_total_;
}

}  // namespace jcm
