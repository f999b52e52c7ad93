#include "ffi/kept_sends.h"

#include <utility>
#include <vector>

namespace jcm {

void KeptSends::Add(const void* operand, Finish finish) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_.emplace(operand, std::move(finish));
  pending_count_.store(pending_.size(), std::memory_order_release);
  ++kept_total_;
}

Status KeptSends::FinishAllSlow(
    const void* operand,
    const std::function<std::chrono::steady_clock::time_point()>& deadline_of) {
  std::vector<Finish> finishes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto [first, last] = pending_.equal_range(operand);
    for (auto it = first; it != last; ++it) finishes.push_back(std::move(it->second));
    pending_.erase(first, last);
    pending_count_.store(pending_.size(), std::memory_order_release);
  }
  if (finishes.empty()) return Status::Ok();
  const auto deadline = deadline_of();
  Status first_failure;
  for (Finish& finish : finishes) {  // every one, even after an error: none may be left
    Status s = finish(deadline);
    if (first_failure.ok()) first_failure = std::move(s);
  }
  return first_failure;
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
