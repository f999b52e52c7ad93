#include "ffi/kept_sends.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace jcm {

void KeptSends::Add(const void* operand, int64_t run_id, int64_t partition, int64_t keepers,
                    Finish finish) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_.emplace(operand, Entry{run_id, partition, std::max<int64_t>(keepers, 1),
                                  std::move(finish)});
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

// `matches` may change the entry (count a keeper off) before it says.
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

Status KeptSends::ReleaseSlow(
    const void* const* operands, size_t count, int64_t run_id, int64_t partition,
    const std::function<std::chrono::steady_clock::time_point()>& deadline_of) {
  std::vector<Finish> finishes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < count; ++i) {
      // An address kept twice (one buffer, two values) counts this precv off once.
      if (std::find(operands, operands + i, operands[i]) != operands + i) continue;
      auto [first, last] = pending_.equal_range(operands[i]);
      std::vector<Finish> done = Take(first, last, [&](Entry& e) {
        return e.run_id == run_id && e.partition == partition && --e.keepers == 0;
      });
      for (Finish& f : done) finishes.push_back(std::move(f));
    }
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
