#include "ffi/kept_sends.h"

#include <utility>
#include <vector>

namespace jcm {

void KeptSends::Add(const void* operand, int64_t run_id, int64_t partition, Finish finish) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_.emplace(operand, Entry{run_id, partition, std::move(finish)});
  pending_count_.store(pending_.size(), std::memory_order_release);
  ++kept_total_;
}

namespace {

Status FinishEach(std::vector<KeptSends::Finish>& finishes,
                  std::chrono::steady_clock::time_point deadline) {
  Status first_failure;
  for (KeptSends::Finish& finish : finishes) {  // every one, even after an error
    Status s = finish(deadline);
    if (first_failure.ok()) first_failure = std::move(s);
  }
  return first_failure;
}

}  // namespace

template <typename Matches>
std::vector<KeptSends::Finish> KeptSends::Take(std::multimap<const void*, Entry>::iterator first,
                                               std::multimap<const void*, Entry>::iterator last,
                                               Matches matches) {
  std::vector<Finish> finishes;
  for (auto it = first; it != last;) {
    if (!matches(it->second)) {
      ++it;
      continue;
    }
    finishes.push_back(std::move(it->second.finish));
    it = pending_.erase(it);
  }
  pending_count_.store(pending_.size(), std::memory_order_release);
  return finishes;
}

Status KeptSends::FinishAllSlow(
    const void* operand, int64_t run_id,
    const std::function<std::chrono::steady_clock::time_point()>& deadline_of) {
  std::vector<Finish> finishes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto [first, last] = pending_.equal_range(operand);
    finishes = Take(first, last, [&](const Entry& e) { return e.run_id == run_id; });
  }
  if (finishes.empty()) return Status::Ok();
  return FinishEach(finishes, deadline_of());
}

Status KeptSends::FinishRun(int64_t run_id, int64_t partition,
                            std::chrono::steady_clock::time_point deadline) {
  if (pending_count_.load(std::memory_order_acquire) == 0) return Status::Ok();
  std::vector<Finish> finishes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    finishes = Take(pending_.begin(), pending_.end(), [&](const Entry& e) {
      return e.run_id == run_id && e.partition == partition;
    });
  }
  return FinishEach(finishes, deadline);
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
