#include "kept_sends.h"

#include <utility>
#include <vector>

namespace jcm {

void KeptSends::Add(const void* operand, Finish finish) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_.emplace(operand, std::move(finish));
  pending_count_.store(pending_.size(), std::memory_order_release);
  ++kept_total_;
}

std::string KeptSends::FinishAllSlow(const void* operand, double timeout_s) {
  std::vector<Finish> finishes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto [first, last] = pending_.equal_range(operand);
    for (auto it = first; it != last; ++it) finishes.push_back(std::move(it->second));
    pending_.erase(first, last);
    pending_count_.store(pending_.size(), std::memory_order_release);
  }
  if (finishes.empty()) return std::string();
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_s));
  std::string error;
  for (Finish& finish : finishes) {  // every one, even after an error: none may be left
    std::string e = finish(deadline);
    if (error.empty()) error = std::move(e);
  }
  return error;
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
