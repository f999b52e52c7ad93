// The uninitialized buffer (uninitialized.h). Its one result is whatever XLA allocated for
// it, left as it is. The `index` attribute only tells the calls of one program apart: XLA
// merges identical instructions, and two buffers merged into one would each get a copy of
// it where the program needs them apart (a loop's state), which is the write this avoids.
#include "ffi/uninitialized.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

std::atomic<bool> poison{false};

template <typename T>
void FillWith(const ffi::AnyBuffer& out, T value) {
  std::fill_n(static_cast<T*>(out.untyped_data()), out.element_count(), value);
}

void FillBytes(const ffi::AnyBuffer& out, unsigned char byte, size_t bits_per_element) {
  // Sub-byte types may be packed (two int4 in a byte): only the packed size is certainly
  // the buffer's.
  const size_t bytes = (out.element_count() * bits_per_element + 7) / 8;
  std::memset(out.untyped_data(), byte, bytes);
}

}  // namespace

namespace jcm {

// The poison of each element type: a NaN in every float type that has one (all bits set,
// or the sign bit alone in the FNUZ types, whose only NaN it is), the most negative value
// in signed integers (an index far out of range, not the plausible -1 of all bits set),
// the largest in unsigned ones, true in booleans (any other byte is no valid PRED).
void Poison(const ffi::AnyBuffer& out) {
  switch (out.element_type()) {
    case ffi::DataType::PRED: return FillBytes(out, 0x01, 8);
    case ffi::DataType::S8: return FillWith(out, std::numeric_limits<int8_t>::min());
    case ffi::DataType::S16: return FillWith(out, std::numeric_limits<int16_t>::min());
    case ffi::DataType::S32: return FillWith(out, std::numeric_limits<int32_t>::min());
    case ffi::DataType::S64: return FillWith(out, std::numeric_limits<int64_t>::min());
    case ffi::DataType::S1:
    case ffi::DataType::U1: return FillBytes(out, 0xFF, 1);
    case ffi::DataType::S2:
    case ffi::DataType::U2: return FillBytes(out, 0xFF, 2);
    case ffi::DataType::S4:
    case ffi::DataType::U4:
    case ffi::DataType::F4E2M1FN: return FillBytes(out, 0xFF, 4);  // no NaN: -6, its largest
    case ffi::DataType::F8E4M3B11FNUZ:
    case ffi::DataType::F8E5M2FNUZ:
    case ffi::DataType::F8E4M3FNUZ: return FillBytes(out, 0x80, 8);
    default: return FillBytes(out, 0xFF, 8 * ffi::ByteWidth(out.element_type()));
  }
}

}  // namespace jcm

namespace {

ffi::Error UninitializedImpl(ffi::Result<ffi::AnyBuffer> out, int64_t /*index*/) {
  if (poison.load(std::memory_order_relaxed)) jcm::Poison(*out);
  return ffi::Error::Success();
}

}  // namespace

namespace jcm {

void SetPoisonUninitialized(bool on) { poison.store(on, std::memory_order_relaxed); }

bool PoisonUninitialized() { return poison.load(std::memory_order_relaxed); }

}  // namespace jcm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcmUninitialized, UninitializedImpl,
                              ffi::Ffi::Bind().Ret<ffi::AnyBuffer>().Attr<int64_t>("index"));
