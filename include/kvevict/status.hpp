// kvevict/status.hpp: the error model. Every fallible entry point returns a `status`; nothing
// throws, so engines built with -fno-exceptions can use every function. A failed status carries
// a code for programs and a specific, human-readable message for people (no allocation).
#pragma once

#include <cstdarg>
#include <cstddef>
#include <cstdio>
#include <cstring>

namespace kvevict {

enum class errc : int {
  ok = 0,
  invalid_argument,    // a parameter outside its documented domain (negative k, even kernel, ...)
  shape_mismatch,      // extents of two views that must agree do not
  null_pointer,        // null data with a non-zero extent
  size_overflow,       // extents x strides do not fit in index_t / size_t
  out_of_range,        // an index (kept position, head, offset) outside its view
  overlap,             // input and output memory overlap where the operation forbids it
  not_sorted,          // a list that must be strictly ascending is not
  workspace_too_small, // caller-provided scratch space is smaller than the queried size
  capacity_exceeded,   // an append or compaction does not fit in preallocated capacity
  io_error,            // a file could not be opened, read or written
  format_error,        // a file's contents are malformed or inconsistent
  cuda_error,          // the CUDA runtime reported an error (message names it)
  unsupported,         // the build lacks what the call needs (e.g. no CUDA)
};

/// Short, stable name of an error code ("shape_mismatch").
constexpr const char* errc_name(errc c) noexcept {
  switch (c) {
    case errc::ok: return "ok";
    case errc::invalid_argument: return "invalid_argument";
    case errc::shape_mismatch: return "shape_mismatch";
    case errc::null_pointer: return "null_pointer";
    case errc::size_overflow: return "size_overflow";
    case errc::out_of_range: return "out_of_range";
    case errc::overlap: return "overlap";
    case errc::not_sorted: return "not_sorted";
    case errc::workspace_too_small: return "workspace_too_small";
    case errc::capacity_exceeded: return "capacity_exceeded";
    case errc::io_error: return "io_error";
    case errc::format_error: return "format_error";
    case errc::cuda_error: return "cuda_error";
    case errc::unsupported: return "unsupported";
  }
  return "unknown";
}

/// Result of a fallible call: `ok()` or a code plus a message such as
/// "compact: kept[2][5] = 130 is outside [0, 128) tokens". Trivially copyable, no allocation.
class [[nodiscard]] status {
 public:
  static constexpr std::size_t max_message = 240;

  constexpr status() noexcept = default;

  /// printf-style construction of a failure.
#if defined(__GNUC__)
  __attribute__((format(printf, 2, 3)))
#endif
  static status
  error(errc code, const char* fmt, ...) noexcept {
    status s;
    s.code_ = code;
    std::va_list args;
    va_start(args, fmt);
    std::vsnprintf(s.message_, max_message, fmt, args);
    va_end(args);
    return s;
  }

  constexpr bool ok() const noexcept { return code_ == errc::ok; }
  constexpr explicit operator bool() const noexcept { return ok(); }
  constexpr errc code() const noexcept { return code_; }
  /// "ok" on success, otherwise the specific message.
  const char* message() const noexcept { return ok() ? "ok" : message_; }

 private:
  errc code_ = errc::ok;
  char message_[max_message] = {};
};

/// A value or the status explaining why there is none (for factories). `value()` of a failed
/// result is a default-constructed (empty) value, never garbage.
template <class T>
class [[nodiscard]] result {
 public:
  result(T value) noexcept : value_(value) {}  // NOLINT(google-explicit-constructor)
  result(const status& st) noexcept : status_(st) {}  // NOLINT(google-explicit-constructor)

  bool ok() const noexcept { return status_.ok(); }
  explicit operator bool() const noexcept { return ok(); }
  const status& error() const noexcept { return status_; }
  const T& value() const noexcept { return value_; }
  const T& operator*() const noexcept { return value_; }
  const T* operator->() const noexcept { return &value_; }

 private:
  T value_{};
  status status_{};
};

}  // namespace kvevict

/// Propagate a failed status from the enclosing function.
#define KVEVICT_TRY(expr)                          \
  do {                                             \
    ::kvevict::status kvevict_try_status_ = (expr); \
    if (!kvevict_try_status_.ok()) return kvevict_try_status_; \
  } while (0)

#if defined(__cpp_exceptions) || defined(__EXCEPTIONS)
#  include <stdexcept>
#  include <string>
namespace kvevict {
/// For programs that prefer exceptions: thrown by `check()` with the status's message.
class error : public std::runtime_error {
 public:
  explicit error(const status& st) : std::runtime_error(st.message()), code_(st.code()) {}
  errc code() const noexcept { return code_; }

 private:
  errc code_;
};

/// Throws kvevict::error if `st` failed (available only when exceptions are enabled).
inline void check(const status& st) {
  if (!st.ok()) throw error(st);
}
}  // namespace kvevict
#endif
