#include "local/reduce.h"

#include <cmath>
#include <complex>
#include <cstdint>
#include <limits>
#include <mutex>
#include <type_traits>

namespace ffi = xla::ffi;

namespace jcm {
namespace {

template <typename T>
T Combine(Reduction op, T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    if (op == Reduction::kSum) return a + b;
    if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<T>::quiet_NaN();
    return op == Reduction::kMax ? (a < b ? b : a) : (b < a ? b : a);
  } else if constexpr (std::is_integral_v<T>) {
    if (op == Reduction::kSum) {
      // Unsigned arithmetic wraps where signed overflow would be undefined.
      using U = std::make_unsigned_t<T>;
      return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
    }
    return op == Reduction::kMax ? (a < b ? b : a) : (b < a ? b : a);
  } else {  // complex: sum only (the lowering never asks for more)
    return a + b;
  }
}

template <typename T>
void Loop(Reduction op, void* acc, const void* x, size_t n) {
  T* a = static_cast<T*>(acc);
  const T* b = static_cast<const T*>(x);
  for (size_t i = 0; i < n; ++i) a[i] = Combine<T>(op, a[i], b[i]);
}

template <typename T>
void Loop(Reduction op, void* out, const void* x, const void* y, size_t n) {
  T* o = static_cast<T*>(out);
  const T* a = static_cast<const T*>(x);
  const T* b = static_cast<const T*>(y);
  for (size_t i = 0; i < n; ++i) o[i] = Combine<T>(op, a[i], b[i]);
}

template <typename T>
void Loop(Reduction op, void* out, const void* x, const void* y, const void* z, size_t n) {
  T* o = static_cast<T*>(out);
  const T* a = static_cast<const T*>(x);
  const T* b = static_cast<const T*>(y);
  const T* c = static_cast<const T*>(z);
  for (size_t i = 0; i < n; ++i) o[i] = Combine<T>(op, Combine<T>(op, a[i], b[i]), c[i]);
}

void LoopBool(Reduction op, void* out, const void* x, const void* y, const void* z,
              size_t n) {
  auto* o = static_cast<uint8_t*>(out);
  const auto* a = static_cast<const uint8_t*>(x);
  const auto* b = static_cast<const uint8_t*>(y);
  const auto* c = static_cast<const uint8_t*>(z);
  for (size_t i = 0; i < n; ++i) {
    o[i] = op == Reduction::kMin ? (a[i] && b[i] && c[i]) : (a[i] || b[i] || c[i]);
  }
}

void LoopBool(Reduction op, void* out, const void* x, const void* y, size_t n) {
  auto* o = static_cast<uint8_t*>(out);
  const auto* a = static_cast<const uint8_t*>(x);
  const auto* b = static_cast<const uint8_t*>(y);
  for (size_t i = 0; i < n; ++i) {
    o[i] = op == Reduction::kMin ? (a[i] && b[i]) : (a[i] || b[i]);
  }
}

void LoopBool(Reduction op, void* acc, const void* x, size_t n) {
  auto* a = static_cast<uint8_t*>(acc);
  const auto* b = static_cast<const uint8_t*>(x);
  for (size_t i = 0; i < n; ++i) {
    a[i] = op == Reduction::kMin ? (a[i] && b[i]) : (a[i] || b[i]);
  }
}

template <typename T>
void NanPropagatingMax(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  Loop<T>(Reduction::kMax, inout, in, static_cast<size_t>(*len));
}
template <typename T>
void NanPropagatingMin(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  Loop<T>(Reduction::kMin, inout, in, static_cast<size_t>(*len));
}

// The four MPI operations of ours, created once (after MPI_Init: at the first use) and
// never freed (MPI frees them at MPI_Finalize).
struct FloatOps {
  MPI_Op max_f32 = MPI_OP_NULL, min_f32 = MPI_OP_NULL;
  MPI_Op max_f64 = MPI_OP_NULL, min_f64 = MPI_OP_NULL;
};
const FloatOps& Ops() {
  static const FloatOps ops = [] {
    FloatOps o;
    (void)MPI_Op_create(&NanPropagatingMax<float>, /*commute=*/1, &o.max_f32);
    (void)MPI_Op_create(&NanPropagatingMin<float>, 1, &o.min_f32);
    (void)MPI_Op_create(&NanPropagatingMax<double>, 1, &o.max_f64);
    (void)MPI_Op_create(&NanPropagatingMin<double>, 1, &o.min_f64);
    return o;
  }();
  return ops;
}

}  // namespace

bool ParseReduction(std::string_view name, Reduction* out) {
  if (name == "sum") *out = Reduction::kSum;
  else if (name == "max") *out = Reduction::kMax;
  else if (name == "min") *out = Reduction::kMin;
  else return false;
  return true;
}

namespace {

// The loop for `type` and `op` over `ptrs` (acc, x or out, a, b or out, a, b, c); false
// where there is none.
template <typename... Ptrs>
bool Dispatch(ffi::DataType type, Reduction op, size_t n, Ptrs... ptrs) {
  switch (type) {
    case ffi::DataType::F32: Loop<float>(op, ptrs..., n); return true;
    case ffi::DataType::F64: Loop<double>(op, ptrs..., n); return true;
    case ffi::DataType::S8: Loop<int8_t>(op, ptrs..., n); return true;
    case ffi::DataType::S16: Loop<int16_t>(op, ptrs..., n); return true;
    case ffi::DataType::S32: Loop<int32_t>(op, ptrs..., n); return true;
    case ffi::DataType::S64: Loop<int64_t>(op, ptrs..., n); return true;
    case ffi::DataType::U8: Loop<uint8_t>(op, ptrs..., n); return true;
    case ffi::DataType::U16: Loop<uint16_t>(op, ptrs..., n); return true;
    case ffi::DataType::U32: Loop<uint32_t>(op, ptrs..., n); return true;
    case ffi::DataType::U64: Loop<uint64_t>(op, ptrs..., n); return true;
    case ffi::DataType::PRED:
      if (op == Reduction::kSum) return false;
      LoopBool(op, ptrs..., n);
      return true;
    case ffi::DataType::C64:
      if (op != Reduction::kSum) return false;
      Loop<std::complex<float>>(op, ptrs..., n);
      return true;
    case ffi::DataType::C128:
      if (op != Reduction::kSum) return false;
      Loop<std::complex<double>>(op, ptrs..., n);
      return true;
    default: return false;
  }
}

}  // namespace

bool ReduceInto(ffi::DataType type, Reduction op, void* acc, const void* x, size_t n) {
  return Dispatch(type, op, n, acc, x);
}

bool ReduceTwo(ffi::DataType type, Reduction op, void* out, const void* a, const void* b,
               size_t n) {
  return Dispatch(type, op, n, out, a, b);
}

bool ReduceThree(ffi::DataType type, Reduction op, void* out, const void* a, const void* b,
                 const void* c, size_t n) {
  return Dispatch(type, op, n, out, a, b, c);
}

bool MpiReduction(ffi::DataType type, Reduction op, MPI_Datatype* t, MPI_Op* o) {
  const MPI_Op plain = op == Reduction::kSum ? MPI_SUM : op == Reduction::kMax ? MPI_MAX : MPI_MIN;
  switch (type) {
    case ffi::DataType::F32:
      *t = MPI_FLOAT;
      *o = op == Reduction::kSum ? MPI_SUM : op == Reduction::kMax ? Ops().max_f32 : Ops().min_f32;
      return true;
    case ffi::DataType::F64:
      *t = MPI_DOUBLE;
      *o = op == Reduction::kSum ? MPI_SUM : op == Reduction::kMax ? Ops().max_f64 : Ops().min_f64;
      return true;
    case ffi::DataType::S8: *t = MPI_INT8_T; break;
    case ffi::DataType::S16: *t = MPI_INT16_T; break;
    case ffi::DataType::S32: *t = MPI_INT32_T; break;
    case ffi::DataType::S64: *t = MPI_INT64_T; break;
    case ffi::DataType::U8: *t = MPI_UINT8_T; break;
    case ffi::DataType::U16: *t = MPI_UINT16_T; break;
    case ffi::DataType::U32: *t = MPI_UINT32_T; break;
    case ffi::DataType::U64: *t = MPI_UINT64_T; break;
    case ffi::DataType::PRED:
      if (op == Reduction::kSum) return false;
      // XLA's bool is one byte, 0 or 1: MPI's logical operations on bytes do the same.
      *t = MPI_UINT8_T;
      *o = op == Reduction::kMax ? MPI_BOR : MPI_BAND;
      return true;
    case ffi::DataType::C64:
      if (op != Reduction::kSum) return false;
      *t = MPI_C_FLOAT_COMPLEX;
      *o = MPI_SUM;
      return true;
    case ffi::DataType::C128:
      if (op != Reduction::kSum) return false;
      *t = MPI_C_DOUBLE_COMPLEX;
      *o = MPI_SUM;
      return true;
    default: return false;
  }
  *o = plain;
  return true;
}

}  // namespace jcm
