// Framing of staged MPI messages.
//
// Every staged message carries an Envelope (64 bytes): the payload's byte count and the
// sender's description of its operand ("float32[4]": a 64-bit hash of the whole text, and
// the text itself, cut short if long), so that a receiver rejects a message of another
// byte count, dtype or shape instead of reinterpreting its bytes.
//   - A message of kChunkedThreshold bytes or more travels as its Envelope alone (the chunk
//     header: magic kChunkMagic, chunk size) followed by chunks of kChunkBytes: the copy of
//     chunk k+1 overlaps the transfer of chunk k, every MPI count fits an int (messages over
//     2 GiB work on any MPI), and the receiver learns the sender's size before it touches
//     its output buffer.
//   - A smaller one travels as one MPI message: the payload, then its Envelope (magic
//     kPayloadMagic) as a trailer.
// So the last 64 bytes of every staged MPI message are an Envelope, and its magic tells a
// chunk header from the trailer of an empty payload. Direct messages (mpi/rendezvous.cc)
// carry none: the receiver's ready signal names its byte count and description hash, and
// the sender goes direct only when both are its own.
// A framed message (a kept psend's, sent from its operand: SendFramed, mpi/rendezvous.cc)
// is a chunk header and its payload in one chunk. Each end of a channel keeps the last
// chunk header that went by on it (the channel's messages are taken in the order they were
// sent), so a framed message whose header is that one again (a loop's next step: the same
// byte count and description) goes *bare*, its payload alone: a message fewer a step.
// While the last header is one of one chunk (AllowsBare), nothing else goes on the channel
// but chunk headers and bare payloads (a staged message goes as a header and its chunks,
// however small), so a receiver that waits for the last header's byte count posts its
// receive into its output before the message comes, as MPI_Sendrecv does: a bare payload
// fills it, a header (64 bytes) says what comes next. A bare payload's checks are its
// header's: the receiver reports the last header's byte count and description when they
// are not its own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace jcm {

struct Envelope {
  uint64_t magic = 0;        // kChunkMagic or kPayloadMagic
  uint64_t total_bytes = 0;  // the payload's byte count
  uint64_t chunk_bytes = 0;  // chunk headers only
  uint64_t desc_hash = 0;    // DescriptionHash() of the sender's operand description
  char desc[32] = {};        // that description, NUL-padded ("..." at the end if cut short)

  std::string Description() const { return std::string(desc, strnlen(desc, sizeof(desc))); }
};
static_assert(sizeof(Envelope) == 64);

inline constexpr uint64_t kChunkMagic = 0x6a636d2d6368756bULL;    // "jcm-chuk"
inline constexpr uint64_t kPayloadMagic = 0x6a636d2d7061796cULL;  // "jcm-payl"
inline constexpr size_t kChunkedThreshold = size_t{4} << 20;
inline constexpr size_t kChunkBytes = size_t{1} << 20;

// FNV-1a, 64 bits: equal descriptions, equal hashes; a collision of two different ones that
// also have the same byte count is not a concern.
inline uint64_t DescriptionHash(std::string_view desc) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (char c : desc) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ULL;
  }
  return h;
}

inline Envelope MakeEnvelope(uint64_t magic, size_t total_bytes, uint64_t desc_hash,
                             std::string_view desc) {
  Envelope e;
  e.magic = magic;
  e.total_bytes = total_bytes;
  e.chunk_bytes = magic == kChunkMagic ? kChunkBytes : 0;
  e.desc_hash = desc_hash;
  if (desc.size() <= sizeof(e.desc)) {
    std::memcpy(e.desc, desc.data(), desc.size());
  } else {
    std::memcpy(e.desc, desc.data(), sizeof(e.desc) - 3);
    std::memcpy(e.desc + sizeof(e.desc) - 3, "...", 3);
  }
  return e;
}

// Whether a channel whose last chunk header is `last` may carry framed payloads bare
// (without their header, which is `last`): `last` is the header of one chunk. Both ends
// decide by it: the sender whether it may leave a header out (and must frame a staged
// message), the receiver whether a message that is not a header is a bare payload.
inline bool AllowsBare(const Envelope& last) {
  return last.magic == kChunkMagic && last.chunk_bytes == last.total_bytes &&
         last.total_bytes != sizeof(Envelope);
}

// The bytes of the staged copy of a `bytes`-byte message: one-message payloads carry their
// Envelope behind them in the same buffer.
inline size_t StagedBufferBytes(size_t bytes) {
  return bytes < kChunkedThreshold ? bytes + sizeof(Envelope) : bytes;
}

}  // namespace jcm
