// Sends that finish in a later precv: the psend returned while its bytes were still being
// read from its operand.
//
// When a precv takes a psend's token in the same computation, the CPU lowering also gives
// that precv the psend's operand (python/jax_cpu_mpi/lowering.py). XLA then keeps the
// operand's buffer alive, and unchanged, until that precv has run, so the psend may hand
// the operand itself to a receiver that is already waiting and return at once: the device
// goes on with its own work (say, the zero-fill of its precv output) while the peer copies.
// The precv that keeps the operand finishes every send made from it before it returns,
// after it has done its own receive: it only waits for a receiver that is already taking
// the bytes, never for one that has not come.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <string>

namespace jcm {

class KeptSends {
 public:
  // Waits for the send to finish by `deadline`; returns "" on success, else the error.
  using Finish = std::function<std::string(std::chrono::steady_clock::time_point)>;

  // A send still reading from `operand` (a buffer XLA keeps alive until a precv finishes it).
  void Add(const void* operand, Finish finish);

  // Finishes every send still reading from `operand`; returns the first error, or "".
  std::string FinishAll(const void* operand, std::chrono::steady_clock::time_point deadline);

  // Sends not finished yet, and sends that were kept at all (since the start).
  size_t pending() const;
  uint64_t kept_total() const;

 private:
  mutable std::mutex mu_;
  std::multimap<const void*, Finish> pending_;
  uint64_t kept_total_ = 0;
};

}  // namespace jcm
