#include "ffi/failed_runs.h"

namespace jcm {

void SuspectChannels::Mark(int64_t src_dev, int64_t dst_dev, const std::string& why,
                           bool timed_out) {
  std::lock_guard<std::mutex> lock(mu_);
  why_.emplace(std::make_pair(src_dev, dst_dev), Suspect{why, timed_out});
  any_.store(true, std::memory_order_release);
}

SuspectChannels::Suspect SuspectChannels::Find(int64_t src_dev, int64_t dst_dev) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = why_.find({src_dev, dst_dev});
  return it == why_.end() ? Suspect{} : it->second;
}

size_t SuspectChannels::count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return why_.size();
}

void SuspectChannels::MarkSend(int64_t src_dev, int64_t dst_dev, const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  send_why_.emplace(std::make_pair(src_dev, dst_dev), why);
  any_sends_.store(true, std::memory_order_release);
}

std::string SuspectChannels::FindSend(int64_t src_dev, int64_t dst_dev) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = send_why_.find({src_dev, dst_dev});
  return it == send_why_.end() ? std::string() : it->second;
}

size_t SuspectChannels::send_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return send_why_.size();
}

void SuspectChannels::MarkCollectives(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (collectives_why_.empty()) collectives_why_ = why;
  any_.store(true, std::memory_order_release);
}

std::string SuspectChannels::CollectivesWhy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return collectives_why_;
}

void SuspectChannels::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  why_.clear();
  send_why_.clear();
  collectives_why_.clear();
  any_.store(false, std::memory_order_release);
  any_sends_.store(false, std::memory_order_release);
}

}  // namespace jcm
