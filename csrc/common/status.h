// Status: the result of an operation, passed between threads as a value.
//
// Three kinds of failure reach Python as three exception types:
//   kInvalidArgument -> ValueError      (bad input found on this rank, at the call site)
//   kMismatch        -> RuntimeError    (ranks disagree about a collective; engine stays usable)
//   kAborted         -> HorovodInternalError (peer lost, I/O error, shut down; recoverable by
//   reset)
#pragma once

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

namespace hvd {

// "what: <strerror(errno)>", for the message of a failed system call (read errno
// before anything else can change it).
inline std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,
  kMismatch = 2,
  kAborted = 3,
};

class Status {
 public:
  Status() = default;
  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string msg) {
    return Status(StatusCode::kInvalidArgument, std::move(msg));
  }
  static Status Mismatch(std::string msg) { return Status(StatusCode::kMismatch, std::move(msg)); }
  static Status Aborted(std::string msg) { return Status(StatusCode::kAborted, std::move(msg)); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  Status(StatusCode code, std::string msg) : code_(code), message_(std::move(msg)) {}
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// Returns early from the enclosing function when `expr` is not ok.
#define HVD_RETURN_IF_ERROR(expr) \
  do {                            \
    ::hvd::Status _st = (expr);   \
    if (!_st.ok()) return _st;    \
  } while (0)

}  // namespace hvd
