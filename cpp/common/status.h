// Status: the outcome of every transport operation (mailbox, MPI, kept sends).
//
// The transports never build XLA errors: they return a Status, and the FFI handlers
// (ffi/p2p_handlers.cc) turn it into an ffi::Error with the op, the pair and the peer in the
// text. The code tells the handler which message to write:
//   kTimeout       a receive's deadline passed before its message arrived (whole): the
//                  handler writes the standard precv timeout message (the Status text, if
//                  any, is detail for logs, not shown);
//   kSizeMismatch  the sender sent another byte count: sender_bytes (and sender_desc when
//                  the sender described its operand) say what it sent;
//   kTypeMismatch  the sender sent the same byte count, but described its operand otherwise
//                  (another dtype or shape): sender_bytes and sender_desc say what it sent;
//   kMpiError      an MPI call failed: the text names the call and MPI_Error_string's text;
//   kSendTimeout   a send gave up at its deadline (its receiver never took the bytes): the
//                  text explains why;
//   kInvalid       anything else the caller did not expect (MPI not initialized, a corrupt
//                  chunk header, a broken protocol invariant).
#pragma once

#include <cstddef>
#include <string>
#include <utility>

namespace jcm {

enum class StatusCode {
  kOk,
  kTimeout,
  kSizeMismatch,
  kTypeMismatch,
  kMpiError,
  kSendTimeout,
  kInvalid,
};

class Status {
 public:
  Status() = default;  // ok

  static Status Ok() { return {}; }
  static Status Timeout(std::string message = "") {
    return Status(StatusCode::kTimeout, std::move(message));
  }
  static Status SizeMismatch(size_t sender_bytes, std::string sender_desc = "") {
    Status s(StatusCode::kSizeMismatch, "");
    s.sender_bytes_ = sender_bytes;
    s.sender_desc_ = std::move(sender_desc);
    return s;
  }
  // Same byte count, another description ("float32[4]" sent into an "int32[4]" precv).
  static Status TypeMismatch(size_t sender_bytes, std::string sender_desc) {
    Status s(StatusCode::kTypeMismatch, "");
    s.sender_bytes_ = sender_bytes;
    s.sender_desc_ = std::move(sender_desc);
    return s;
  }
  // `call` failed with MPI error code `rc`: "<call> failed: <MPI_Error_string(rc)>".
  static Status MpiError(const std::string& call, int rc);
  static Status SendTimeout(std::string message) {
    return Status(StatusCode::kSendTimeout, std::move(message));
  }
  static Status Invalid(std::string message) {
    return Status(StatusCode::kInvalid, std::move(message));
  }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  size_t sender_bytes() const { return sender_bytes_; }
  const std::string& sender_desc() const { return sender_desc_; }

  // The same status with `prefix` in front of its text (a kept send names its psend).
  Status WithPrefix(const std::string& prefix) const {
    Status s = *this;
    s.message_ = prefix + message_;
    return s;
  }
  // The same status with `suffix` after its text (a timeout's transport state).
  Status WithSuffix(const std::string& suffix) const {
    Status s = *this;
    s.message_ += suffix;
    return s;
  }

 private:
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  StatusCode code_ = StatusCode::kOk;
  std::string message_;
  size_t sender_bytes_ = 0;  // kSizeMismatch, kTypeMismatch
  std::string sender_desc_;  // kSizeMismatch (when the sender described it), kTypeMismatch
};

// MPI_Error_string's text for `rc` (defined in mpi/setup.cc, the only user of mpi.h here).
std::string MpiErrorText(int rc);

inline Status Status::MpiError(const std::string& call, int rc) {
  return Status(StatusCode::kMpiError, call + " failed: " + MpiErrorText(rc));
}

}  // namespace jcm
