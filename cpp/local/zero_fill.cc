#include "local/zero_fill.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <fstream>
#include <sstream>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define JCM_STREAMING_STORES 1
#endif

namespace jcm {
namespace {

#ifdef JCM_STREAMING_STORES
size_t CpusIn(const std::string& list) {  // "0-1,4" -> 3
  size_t count = 0;
  std::istringstream in(list);
  std::string range;
  while (std::getline(in, range, ',')) {
    const size_t dash = range.find('-');
    try {
      const long lo = std::stol(range.substr(0, dash));
      const long hi = dash == std::string::npos ? lo : std::stol(range.substr(dash + 1));
      if (hi >= lo) count += static_cast<size_t>(hi - lo + 1);
    } catch (const std::exception&) {
      return 0;
    }
  }
  return count;
}
#endif

// glibc's rule for streaming copies (__x86_shared_non_temporal_threshold): three quarters
// of one CPU's share of the last-level cache. The cache comes from the kernel (sysfs), not
// from sysconf: glibc reads CPUID, which in VMs on AMD EPYC reports the L3 of the whole
// package (256 MiB on the benchmark VM, whose CPUs share 32 MiB). 8 MiB where unknown.
size_t ComputeMinBytes() {
#ifdef JCM_STREAMING_STORES
  constexpr size_t kUnknown = size_t{8} << 20;
  const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index3/";
  std::ifstream size_file(dir + "size"), cpus_file(dir + "shared_cpu_list");
  std::string size_text, cpus_text;
  if (!std::getline(size_file, size_text) || !std::getline(cpus_file, cpus_text)) {
    return kUnknown;
  }
  size_t cache = 0;
  try {
    cache = std::stoul(size_text);
  } catch (const std::exception&) {
    return kUnknown;
  }
  if (size_text.find('K') != std::string::npos) cache <<= 10;
  if (size_text.find('M') != std::string::npos) cache <<= 20;
  const size_t cpus = CpusIn(cpus_text);
  if (cache == 0 || cpus == 0) return kUnknown;
  return std::max<size_t>(size_t{1} << 20, cache / cpus / 4 * 3);
#else
  return 0;
#endif
}

}  // namespace

size_t StreamingZeroFillMinBytes() {
  static const size_t min_bytes = ComputeMinBytes();
  return min_bytes;
}

void ZeroFill(void* data, size_t bytes) {
  if (bytes == 0) return;
#ifdef JCM_STREAMING_STORES
  const size_t min_bytes = StreamingZeroFillMinBytes();
  if (min_bytes != 0 && bytes >= min_bytes) {
    auto* p = static_cast<std::byte*>(data);
    // memset up to a 64-byte boundary and past the last whole line; stream the lines.
    const auto addr = reinterpret_cast<uintptr_t>(p);
    const size_t head = static_cast<size_t>((64 - addr % 64) % 64);
    const size_t lines = (bytes - head) / 64;
    std::memset(p, 0, head);
    const __m128i zero = _mm_setzero_si128();
    std::byte* line = p + head;
    for (size_t i = 0; i < lines; ++i, line += 64) {
      auto* v = reinterpret_cast<__m128i*>(line);
      _mm_stream_si128(v, zero);
      _mm_stream_si128(v + 1, zero);
      _mm_stream_si128(v + 2, zero);
      _mm_stream_si128(v + 3, zero);
    }
    std::memset(line, 0, bytes - head - lines * 64);
    // Streaming stores are weakly ordered: make them visible before XLA (another thread,
    // or the next op) reads the output.
    _mm_sfence();
    return;
  }
#endif
  std::memset(data, 0, bytes);
}

}  // namespace jcm
