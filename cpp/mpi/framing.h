// Framing of staged MPI messages.
//
// A staged message of kChunkedThreshold bytes or more travels as a 32-byte header (magic,
// total size, chunk size) followed by chunks of kChunkBytes: the copy of chunk k+1 overlaps
// the transfer of chunk k, every MPI count fits an int (messages over 2 GiB work on any
// MPI), and the receiver learns the sender's size before it touches its output buffer.
// Smaller messages travel as one MPI message with no header; a receiver tells the two apart
// by the magic (a plain message of exactly sizeof(ChunkHeader) bytes has another one, or is
// rejected as a header only if it happens to carry the magic).
#pragma once

#include <cstddef>
#include <cstdint>

namespace jcm {

struct ChunkHeader {
  uint64_t magic = 0;
  uint64_t total_bytes = 0;
  uint64_t chunk_bytes = 0;
  uint64_t reserved = 0;
};

inline constexpr uint64_t kChunkMagic = 0x6a636d2d6368756bULL;  // "jcm-chuk"
inline constexpr size_t kChunkedThreshold = size_t{4} << 20;
inline constexpr size_t kChunkBytes = size_t{1} << 20;

inline ChunkHeader MakeChunkHeader(size_t total_bytes) {
  ChunkHeader header;
  header.magic = kChunkMagic;
  header.total_bytes = total_bytes;
  header.chunk_bytes = kChunkBytes;
  return header;
}

}  // namespace jcm
