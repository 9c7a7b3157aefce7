// Helpers shared by kvevict's tests: seeded random data and small owning buffers.
#pragma once

#include <kvevict/status.hpp>
#include <kvevict/view.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace kvtest {

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

}  // namespace kvtest
