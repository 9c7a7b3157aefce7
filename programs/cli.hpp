// programs/cli.hpp: command-line number parsing for kvevict's programs (CLI11). CLI11 saturates
// an out-of-range integer ("99999999999999999999" becomes INT64_MAX) and accepts hex and octal
// spellings; options checked with program::integer<T>() accept exactly a decimal integer that T
// represents, so an absurd number is an error instead of a silently different one
// (docs/conventions.md, "Programs"). Ranges with a meaning (>= 1, odd, ...) are checked by each
// program after parsing, with a message naming the option and the value.
//
//   app.add_option("--budget", budget, "...")->check(kvevict::program::integer<kvevict::index_t>());
//   if (const int code = kvevict::program::parse_or_exit(app, argc, argv, "kvevict-x"); code >= 0) return code;
#pragma once

#include "main.hpp"

#include <CLI/CLI.hpp>

#include <cstdio>

#include <cerrno>
#include <cstdlib>
#include <limits>
#include <string>
#include <type_traits>

namespace kvevict::program {

/// The text is an optional '-' or '+' and 1 to 19 decimal digits whose value fits in T.
template <class T>
CLI::Validator integer() {
  static_assert(std::is_integral_v<T>, "program::integer: T must be an integer type");
  return CLI::Validator(
      [](std::string& text) -> std::string {
        std::size_t i = (!text.empty() && (text[0] == '-' || text[0] == '+')) ? 1 : 0;
        if (i == text.size()) return "'" + text + "' is not a decimal integer";
        for (std::size_t j = i; j < text.size(); ++j)
          if (text[j] < '0' || text[j] > '9') return "'" + text + "' is not a decimal integer";
        errno = 0;
        char* end = nullptr;
        if (std::is_signed_v<T> || text[0] == '-') {
          const long long v = std::strtoll(text.c_str(), &end, 10);
          if (errno == ERANGE || v < static_cast<long long>(std::numeric_limits<T>::min()) ||
              (v > 0 && static_cast<unsigned long long>(v) > static_cast<unsigned long long>(std::numeric_limits<T>::max())))
            return text + " is outside [" + std::to_string(std::numeric_limits<T>::min()) + ", " +
                   std::to_string(std::numeric_limits<T>::max()) + "]";
        } else {
          const unsigned long long v = std::strtoull(text.c_str(), &end, 10);
          if (errno == ERANGE || v > static_cast<unsigned long long>(std::numeric_limits<T>::max()))
            return text + " is outside [0, " + std::to_string(std::numeric_limits<T>::max()) + "]";
        }
        return {};
      },
      "INTEGER", "decimal integer");
}

/// Parses the command line: -1 to go on; otherwise the exit status, with `message` the help text
/// (0) or the command-line syntax error, "(see --help)" appended (2).
inline int parse_command_line(CLI::App& app, int argc, const char* const* argv, std::string& message) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) {  // --help (CLI::CallForHelp) and the like
      message = app.help();
      return 0;
    }
    message = std::string(e.what()) + " (see --help)";
    return 2;
  }
  return -1;
}

/// parse_command_line, printed: -1 to go on; else the help on stdout (exit status 0) or the
/// syntax error as `<program>: <error> (see --help)` on stderr (exit status 2).
inline int parse_or_exit(CLI::App& app, int argc, const char* const* argv, const char* program) {
  std::string message;
  const int code = parse_command_line(app, argc, argv, message);
  if (code == 0) std::fputs(message.c_str(), stdout);
  if (code > 0) print_error(program, message.c_str());
  return code;
}

}  // namespace kvevict::program
