// The first collective of every sharded call: all ranks agree that every rank's arguments are
// valid and that they describe the same configuration, or all return the same error. Not API.
//
// A rank whose local checks failed must still take part (the others would wait for it forever),
// so every sharded call checks locally, then calls agree() with its status and a one-line
// description of what must be identical on every rank (budgets, options, shapes per rank). The
// success path is one sum-allreduce of a few integers: the failure count, four 16-bit pieces of
// a 64-bit hash of the description and their squares (all ranks hold the same value x exactly when
// P sum x^2 == (sum x)^2), plus the caller's own sums. Only when something is wrong do the ranks
// allgather their statuses and descriptions (allocating: an error path), and every rank returns
// the same error naming the lowest failing rank, or the first rank whose configuration differs
// from rank 0's.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/status.hpp>

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace kvevict::detail {

/// One line naming what every rank must agree on (a fixed buffer: no allocation).
struct config_line {
  char text[status::max_message] = {};
#if defined(__GNUC__)
  __attribute__((format(printf, 2, 3)))
#endif
  void
  print(const char* fmt, ...) noexcept {
    std::va_list args;
    va_start(args, fmt);
    std::vsnprintf(text, sizeof(text), fmt, args);
    va_end(args);
  }
};

inline std::uint64_t fnv1a(const char* s) noexcept {
  std::uint64_t h = 1469598103934665603ull;
  for (; *s != '\0'; ++s) h = (h ^ static_cast<unsigned char>(*s)) * 1099511628211ull;
  return h;
}

/// At most this many ranks (the equality test's sums stay below 2^63).
inline constexpr int max_agree_ranks = 32768;
inline constexpr int max_agree_sums = 4;

/// Every rank calls this with its local status, its configuration line and `nsums` (<= 4)
/// integers; on success sums[i] holds the sum over the ranks. Returns the same status on every rank.
template <class Comm>
status agree(Comm& comm, const char* fn, const status& local, const config_line& config, std::int64_t* sums,
             int nsums) {
  const int P = comm.size();
  if (P < 1 || P > max_agree_ranks || nsums < 0 || nsums > max_agree_sums)
    return status::error(errc::invalid_argument, "%s: the communicator has %d ranks (1 to %d supported)", fn, P,
                         max_agree_ranks);
  constexpr int pieces = 4;
  std::int64_t buf[1 + 2 * pieces + max_agree_sums] = {};
  const std::uint64_t h = fnv1a(config.text);
  buf[0] = local.ok() ? 0 : 1;
  for (int i = 0; i < pieces; ++i) {
    const auto x = static_cast<std::int64_t>((h >> (16 * i)) & 0xffffu);
    buf[1 + i] = x;
    buf[1 + pieces + i] = x * x;
  }
  for (int i = 0; i < nsums; ++i) buf[1 + 2 * pieces + i] = sums[i];
  KVEVICT_TRY(comm.allreduce_sum(buf, 1 + 2 * pieces + nsums));
  bool same = true;
  for (int i = 0; i < pieces; ++i) same = same && P * buf[1 + pieces + i] == buf[1 + i] * buf[1 + i];
  if (buf[0] == 0 && same) {
    for (int i = 0; i < nsums; ++i) sums[i] = buf[1 + 2 * pieces + i];
    return {};
  }
  struct record {
    status st;
    config_line config;
  };
  record mine{local, config};
  std::vector<record> all(static_cast<std::size_t>(P));
  KVEVICT_TRY(comm.allgather(&mine, sizeof(record), all.data()));
  for (int r = 0; r < P; ++r)
    if (!all[static_cast<std::size_t>(r)].st.ok())
      return status::error(all[static_cast<std::size_t>(r)].st.code(), "rank %d of %d: %s", r, P,
                           all[static_cast<std::size_t>(r)].st.message());
  for (int r = 1; r < P; ++r)
    if (std::strcmp(all[static_cast<std::size_t>(r)].config.text, all[0].config.text) != 0)
      return status::error(errc::invalid_argument,
                           "%s: the ranks disagree (every rank must pass the same configuration): rank 0 {%s}, "
                           "rank %d {%s}",
                           fn, all[0].config.text, r, all[static_cast<std::size_t>(r)].config.text);
  return status::error(errc::invalid_argument, "%s: the ranks' configuration hashes differ but their lines agree", fn);
}

}  // namespace kvevict::detail
