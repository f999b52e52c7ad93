// Reusable host buffers for message copies.
//
// A psend that cannot hand its bytes to the receiver at once copies them into a buffer the
// transport owns. Fresh allocations of large buffers come straight from mmap and page-fault
// on first touch (about 1 us per 4 KiB page: milliseconds for a 16 MiB message), so buffers
// are recycled by size instead. Pipelines send the same few sizes over and over.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace jcm {

class BufferPool;

// A buffer on loan from a pool: returns itself to the pool when destroyed.
class PooledBuffer {
 public:
  PooledBuffer() = default;
  // Leaves `other` empty (size 0), as the move assignment does: a moved-from buffer that
  // still said its size would pass for one of that size with no memory behind it.
  PooledBuffer(PooledBuffer&& other) noexcept
      : pool_(std::exchange(other.pool_, nullptr)),
        data_(std::move(other.data_)),
        size_(std::exchange(other.size_, 0)) {}
  PooledBuffer& operator=(PooledBuffer&&) noexcept;
  PooledBuffer(const PooledBuffer&) = delete;
  PooledBuffer& operator=(const PooledBuffer&) = delete;
  ~PooledBuffer();

  std::byte* data() const { return data_.get(); }
  size_t size() const { return size_; }

 private:
  friend class BufferPool;
  PooledBuffer(BufferPool* pool, std::unique_ptr<std::byte[]> data, size_t size)
      : pool_(pool), data_(std::move(data)), size_(size) {}
  void Release();

  BufferPool* pool_ = nullptr;
  std::unique_ptr<std::byte[]> data_;
  size_t size_ = 0;
};

class BufferPool {
 public:
  explicit BufferPool(size_t max_cached_bytes) : max_cached_bytes_(max_cached_bytes) {}

  // A buffer of exactly `size` bytes (contents unspecified).
  PooledBuffer Acquire(size_t size);

  size_t cached_bytes() const;

 private:
  friend class PooledBuffer;
  void Return(std::unique_ptr<std::byte[]> data, size_t size);

  static constexpr size_t kMinPooledSize = 64 * 1024;  // malloc is cheap below this
  const size_t max_cached_bytes_;
  mutable std::mutex mu_;
  std::multimap<size_t, std::unique_ptr<std::byte[]>> free_;
  size_t cached_bytes_ = 0;
};

// The process-wide pool (never destroyed: buffers may be returned during shutdown).
BufferPool& GlobalBufferPool();

}  // namespace jcm
