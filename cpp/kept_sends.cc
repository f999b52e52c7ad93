#include "kept_sends.h"

#include <utility>
#include <vector>

namespace jcm {

void KeptSends::Add(const void* operand, Finish finish) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_.emplace(operand, std::move(finish));
  ++kept_total_;
}

std::string KeptSends::FinishAll(const void* operand,
                                 std::chrono::steady_clock::time_point deadline) {
  std::vector<Finish> finishes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto [first, last] = pending_.equal_range(operand);
    for (auto it = first; it != last; ++it) finishes.push_back(std::move(it->second));
    pending_.erase(first, last);
  }
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
