// Immortal<T>: a T constructed in place and never destroyed. For process-wide state that
// XLA device threads may still touch while the interpreter runs static destructors.
#pragma once

#include <new>
#include <utility>

namespace jcm {

template <typename T>
class Immortal {
 public:
  template <typename... Args>
  explicit Immortal(Args&&... args) {
    new (storage_) T(std::forward<Args>(args)...);
  }
  Immortal(const Immortal&) = delete;
  Immortal& operator=(const Immortal&) = delete;
  T& get() { return *std::launder(reinterpret_cast<T*>(storage_)); }

 private:
  alignas(T) unsigned char storage_[sizeof(T)];
};

}  // namespace jcm
