// Helpers shared by kvevict's tests: seeded random data and small owning buffers.
#pragma once

#include <kvevict/host_isa.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/workspace.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace kvtest {

/// Special floats and bit patterns for the stages' tests (`using namespace kvtest::floats;`).
namespace floats {
inline constexpr float inf = std::numeric_limits<float>::infinity();
inline constexpr float qnan = std::numeric_limits<float>::quiet_NaN();
inline std::uint32_t bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
/// The selection order, written independently of detail/base/score_order.hpp: is a above b?
inline bool ranks_above(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) {
    if (!std::isnan(a) || !std::isnan(b)) return std::isnan(b);
    // two NaNs (documented in detail/base/score_order.hpp): sign clear below sign set; then by payload,
    // larger higher with the sign clear, smaller higher with the sign set
    if (std::signbit(a) != std::signbit(b)) return std::signbit(a);
    return std::signbit(a) ? bits(a) < bits(b) : bits(a) > bits(b);
  }
  if (a == 0.f && b == 0.f) return !std::signbit(a) && std::signbit(b);  // +0 above -0
  return a > b;
}
}  // namespace floats

/// kvevict::host_isa_limit_guard for a level 0 (baseline), 1 (avx2), 2 (avx512): the tests loop over levels.
inline kvevict::host_isa isa_level(int level) { return static_cast<kvevict::host_isa>(level); }

/// Seeded generator; every randomized test prints its seed through doctest's CAPTURE on failure.
inline std::mt19937_64 rng(std::uint64_t seed) { return std::mt19937_64(seed); }

inline std::vector<float> random_floats(std::mt19937_64& g, std::size_t n, float lo = -1.f, float hi = 1.f) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(g);
  return v;
}

inline std::int64_t uniform_int(std::mt19937_64& g, std::int64_t lo, std::int64_t hi) {
  return std::uniform_int_distribution<std::int64_t>(lo, hi)(g);
}

/// Unwraps a result in a test, failing with its message if it is an error.
template <class T>
T value_of(const kvevict::result<T>& r) {
  REQUIRE_MESSAGE(r.ok(), r.error().message());
  return *r;
}

/// Requires `st` to fail with `code` and a message containing `needle`.
inline void require_error(const kvevict::status& st, kvevict::errc code, const std::string& needle) {
  INFO("message: ", std::string(st.message()));
  REQUIRE_FALSE(st.ok());
  CHECK(st.code() == code);
  CHECK(std::string(st.message()).find(needle) != std::string::npos);
}


/// Offsets of a workspace pointer from a 64-byte aligned base the tests use: any base must work.
inline constexpr std::size_t workspace_shifts[] = {0, 1, 4, 8};

/// A workspace of exactly `bytes` inside `mem` (resized, filled with `fill`), at the next of
/// workspace_shifts from a 64-byte aligned base (cycling call by call): the tests' two-phase
/// helpers use it, so every stage they run also runs on misaligned workspace pointers.
/// `misaligned_only`: skip the aligned shift 0.
inline kvevict::workspace shifted_workspace(std::vector<unsigned char>& mem, std::size_t bytes,
                                            unsigned char fill = 0, bool misaligned_only = false) {
  static std::atomic<unsigned> calls{0};
  constexpr unsigned n = sizeof(workspace_shifts) / sizeof(workspace_shifts[0]);
  const std::size_t shift = misaligned_only ? workspace_shifts[1 + calls++ % (n - 1)] : workspace_shifts[calls++ % n];
  mem.assign(bytes + 64 + shift, fill);
  unsigned char* base = mem.data() + (64 - reinterpret_cast<std::uintptr_t>(mem.data()) % 64) % 64;
  return kvevict::workspace{base + shift, bytes};
}

/// While alive, counts every pointer a workspace carver hands out and those not aligned to their
/// type or to the requested alignment (atomic: `par` stages carve on worker threads too).
class carver_alignment_probe {
 public:
  carver_alignment_probe() {
    taken() = 0;
    misaligned() = 0;
    kvevict::detail::workspace_take_hook = &observe;
  }
  ~carver_alignment_probe() { kvevict::detail::workspace_take_hook = nullptr; }
  carver_alignment_probe(const carver_alignment_probe&) = delete;
  carver_alignment_probe& operator=(const carver_alignment_probe&) = delete;
  static std::atomic<long>& taken() {
    static std::atomic<long> n{0};
    return n;
  }
  static std::atomic<long>& misaligned() {
    static std::atomic<long> n{0};
    return n;
  }

 private:
  static void observe(const void* p, std::size_t type_align, std::size_t align) {
    const auto u = reinterpret_cast<std::uintptr_t>(p);
    ++taken();
    if (u % type_align != 0 || u % align != 0) ++misaligned();
  }
};

/// The raw bytes of some vectors, concatenated (bit-identity of results, NaNs included).
template <class... V>
std::vector<unsigned char> bytes_of(const V&... v) {
  std::vector<unsigned char> out;
  const auto add = [&out](const auto& x) {
    const auto* b = reinterpret_cast<const unsigned char*>(x.data());
    out.insert(out.end(), b, b + x.size() * sizeof(x[0]));
  };
  (add(v), ...);
  return out;
}

/// Runs a two-phase call (status(workspace&)): a query, then the call with exactly the queried
/// bytes at each of workspace_shifts from a 64-byte aligned base (the buffer filled with garbage
/// first). Every run must succeed, outputs() (a snapshot of the results) must be the same for
/// every shift, and every pointer the carvers hand out must be aligned.
template <class F, class G>
void check_workspace_shifts(F&& call, G&& outputs) {
  kvevict::workspace q;
  const kvevict::status qs = call(q);
  REQUIRE_MESSAGE(qs.ok(), qs.message());
  std::vector<unsigned char> arena(q.bytes + 128);
  unsigned char* base = arena.data() + (64 - reinterpret_cast<std::uintptr_t>(arena.data()) % 64) % 64;
  carver_alignment_probe probe;
  decltype(outputs()) reference{};
  for (const std::size_t shift : workspace_shifts) {
    CAPTURE(shift);
    std::fill(arena.begin(), arena.end(), static_cast<unsigned char>(0xa5));
    kvevict::workspace ws{base + shift, q.bytes};
    const kvevict::status st = call(ws);
    REQUIRE_MESSAGE(st.ok(), st.message());
    if (shift == 0)
      reference = outputs();
    else
      CHECK(outputs() == reference);
  }
  if (q.bytes > 0) CHECK(carver_alignment_probe::taken() > 0);
  CHECK(carver_alignment_probe::misaligned() == 0);
}
}  // namespace kvtest
