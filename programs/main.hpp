// programs/main.hpp: the one way kvevict's programs end. Every error, whatever raised it (a
// kvevict::status, an exception, std::bad_alloc under a memory limit), becomes exactly one line
// `<program>: <what went wrong>` on stderr and exit status 1 (docs/conventions.md, "Programs").
//
//   int main(int argc, char** argv) {
//     return kvevict::program::guarded_main("kvevict", [&] { return run(argc, argv); });
//   }
#pragma once

#include <kvevict/status.hpp>

#include <csignal>
#include <cstdio>
#include <exception>
#include <new>
#include <cstddef>
#include <string>

namespace kvevict::program {

/// Prints `<program>: <message>` as ONE line on stderr: line breaks and other control characters
/// in the message become spaces, trailing ones are dropped.
inline void print_error(const char* program, const char* message) noexcept {
  char line[1024];  // no allocation: this also reports running out of memory
  std::snprintf(line, sizeof line, "%s", message && *message ? message : "unknown error");
  std::size_t n = 0;
  for (; line[n] != '\0'; ++n)
    if (static_cast<unsigned char>(line[n]) < 0x20 || line[n] == 0x7f) line[n] = ' ';
  while (n > 0 && line[n - 1] == ' ') line[--n] = '\0';
  std::fprintf(stderr, "%s: %s\n", program, n > 0 ? line : "unknown error");
  std::fflush(stderr);
}

/// print_error, then the failing exit status: `return fail("kvevict", st.message());`
inline int fail(const char* program, const char* message) noexcept {
  print_error(program, message);
  return 1;
}
inline int fail(const char* program, const status& st) { return fail(program, st.message()); }
inline int fail(const char* program, const std::string& message) { return fail(program, message.c_str()); }

/// Runs body() (returning the exit status) and turns everything that escapes it into one error
/// line and exit status 1. Also: a file-size limit (RLIMIT_FSIZE) makes writes fail with EFBIG
/// instead of killing the process with SIGXFSZ, and a failed write to stdout (a full disk, a
/// closed pipe) is an error rather than a silent success.
template <class Body>
int guarded_main(const char* program, Body&& body) noexcept {
  std::signal(SIGXFSZ, SIG_IGN);
  try {
    const int rc = body();
    if (std::fflush(stdout) != 0 || std::ferror(stdout)) return fail(program, "cannot write to standard output");
    return rc;
  } catch (const std::bad_alloc&) {
    return fail(program, "out of memory");
  } catch (const std::exception& e) {
    return fail(program, e.what());
  } catch (...) {
    return fail(program, "unknown error");
  }
}

}  // namespace kvevict::program
