#include "common/buffer_pool.h"

#include "common/immortal.h"

namespace jcm {

PooledBuffer& PooledBuffer::operator=(PooledBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    pool_ = other.pool_;
    data_ = std::move(other.data_);
    size_ = other.size_;
    other.pool_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

PooledBuffer::~PooledBuffer() { Release(); }

void PooledBuffer::Release() {
  if (pool_ && data_) pool_->Return(std::move(data_), size_);
  data_.reset();
  pool_ = nullptr;
  size_ = 0;
}

PooledBuffer BufferPool::Acquire(size_t size) {
  if (size >= kMinPooledSize) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(size);
    if (it != free_.end()) {
      std::unique_ptr<std::byte[]> data = std::move(it->second);
      free_.erase(it);
      cached_bytes_ -= size;
      return PooledBuffer(this, std::move(data), size);
    }
  }
  return PooledBuffer(this, std::make_unique_for_overwrite<std::byte[]>(size > 0 ? size : 1),
                      size);
}

void BufferPool::Return(std::unique_ptr<std::byte[]> data, size_t size) {
  if (size < kMinPooledSize) return;  // freed by the unique_ptr
  std::lock_guard<std::mutex> lock(mu_);
  if (cached_bytes_ + size > max_cached_bytes_) return;  // full: free this one
  cached_bytes_ += size;
  free_.emplace(size, std::move(data));
}

size_t BufferPool::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cached_bytes_;
}


BufferPool& GlobalBufferPool() {
  static Immortal<BufferPool> pool(size_t{512} << 20);
  return pool.get();
}

}  // namespace jcm
