#include "support.hpp"

#include <kvevict/detail/block/simt.hpp>
#include <kvevict/detail/block/simt_bodies.hpp>
#include <kvevict/protect.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <set>
#include <vector>

using namespace kvevict;
using kvtest::require_error;
using kvtest::value_of;
using namespace kvtest::floats;

namespace {

const float flt_max = std::numeric_limits<float>::max();
const float sentinel = -4242.f;

bool is_protected(index_t t, index_t n, index_t n_sink, index_t n_recent) {
  return t < n_sink || t >= n - n_recent;
}

// Naive selection under docs/conventions.md: higher first, +inf above finite, NaN below
// everything, ties (and -0 == +0) -> lower position. Returns the k kept positions.
std::set<index_t> naive_select(const std::vector<float>& row, index_t n, index_t k) {
  std::vector<index_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](index_t a, index_t b) {
    const float x = row[a], y = row[b];
    if (std::isnan(x) || std::isnan(y)) return !std::isnan(x) && std::isnan(y);
    return x > y;
  });
  return std::set<index_t>(order.begin(), order.begin() + k);
}

float random_score(std::mt19937_64& g) {
  switch (kvtest::uniform_int(g, 0, 9)) {
    case 0: return inf;
    case 1: return -inf;
    case 2: return qnan;
    case 3: return flt_max;
    default: return kvtest::random_floats(g, 1)[0];
  }
}

template <class Backend>
void matches_reference(Backend be, std::uint64_t seed) {
  auto g = kvtest::rng(seed);
  for (int trial = 0; trial < 200; ++trial) {
    const index_t R = kvtest::uniform_int(g, 1, 5), T = trial % 20 == 0 ? 0 : kvtest::uniform_int(g, 1, 50);
    const index_t n_sink = kvtest::uniform_int(g, 0, 6), n_recent = kvtest::uniform_int(g, 0, T + 3);
    const bool ragged = trial % 2 == 0;
    CAPTURE(seed);
    CAPTURE(trial);
    const index_t row_stride = T + trial % 3;
    std::vector<float> buf(static_cast<std::size_t>(std::max<index_t>(1, R * row_stride)), sentinel);
    auto view = value_of(make_matrix_view(buf.data(), R, T, std::max<index_t>(1, row_stride)));
    std::vector<std::int32_t> lens(static_cast<std::size_t>(R), static_cast<std::int32_t>(T));
    for (index_t r = 0; r < R; ++r) {
      if (ragged) lens[r] = static_cast<std::int32_t>(kvtest::uniform_int(g, 0, T));
      for (index_t t = 0; t < lens[r]; ++t) view(r, t) = random_score(g);
    }
    const auto before = buf;
    REQUIRE(protect(be, view, n_sink, n_recent, ragged ? lens.data() : nullptr).ok());
    for (index_t r = 0; r < R; ++r) {
      const index_t n = lens[r];
      std::vector<float> row(static_cast<std::size_t>(n));
      for (index_t t = 0; t < T; ++t) {
        CAPTURE(t);
        const float old = before[static_cast<std::size_t>(r * row_stride + t)], now = view(r, t);
        if (t >= n) REQUIRE(bits(now) == bits(old));  // outside the row: untouched
        else if (is_protected(t, n, n_sink, n_recent)) REQUIRE(now == inf);
        else if (old == inf) REQUIRE(now == flt_max);
        else REQUIRE(bits(now) == bits(old));  // finite, -inf and NaN unchanged
        if (t < n) row[t] = now;
      }
      // invariant: any budget >= protected_count keeps every protected token
      const index_t m = protected_count(n, n_sink, n_recent);
      index_t brute = 0;
      for (index_t t = 0; t < n; ++t) brute += is_protected(t, n, n_sink, n_recent);
      REQUIRE(m == brute);
      for (index_t k = m; k <= n; ++k) {
        const auto kept = naive_select(row, n, k);
        for (index_t t = 0; t < n; ++t)
          if (is_protected(t, n, n_sink, n_recent)) REQUIRE(kept.count(t) == 1);
      }
    }
  }
}

}  // namespace

TEST_CASE("protect: random rows, lengths and window sizes match the naive reference; budgets keep protected tokens") {
  matches_reference(seq, 1);
  matches_reference(par, 2);
}

TEST_CASE("protect: protected tokens strictly outrank a competing +inf") {
  std::vector<float> row = {0.1f, inf, 0.3f, qnan, -inf, 0.2f};
  REQUIRE(protect(seq, value_of(make_matrix_view(row.data(), 1, 6)), 1, 2).ok());
  CHECK(row[0] == inf);       // sink
  CHECK(row[1] == flt_max);   // an unprotected +inf is lowered below the protected ones
  CHECK(row[2] == 0.3f);
  CHECK(std::isnan(row[3]));  // NaN stays NaN (ranked last by selection)
  CHECK(row[4] == inf);       // recent window, whatever it held
  CHECK(row[5] == inf);
  // budget 3 = the 3 protected tokens; budget 4 adds the best of the rest (the lowered +inf)
  CHECK(naive_select(row, 6, 3) == std::set<index_t>{0, 4, 5});
  CHECK(naive_select(row, 6, 4) == std::set<index_t>{0, 1, 4, 5});
}

TEST_CASE("protected_count and check_budget") {
  CHECK(protected_count(100, 4, 32) == 36);
  CHECK(protected_count(30, 4, 32) == 30);   // overlapping sink and window: their union
  CHECK(protected_count(10, 0, 0) == 0);
  CHECK(protected_count(0, 4, 4) == 0);
  CHECK(protected_count(10, -3, 2) == 2);    // negatives count as 0
  CHECK(protected_count(10, std::numeric_limits<index_t>::max(), std::numeric_limits<index_t>::max()) == 10);
  CHECK(protected_count(std::numeric_limits<index_t>::max(), 5, std::numeric_limits<index_t>::max() - 1) ==
        std::numeric_limits<index_t>::max());
  static_assert(protected_count(8, 2, 3) == 5, "usable in constant expressions");

  CHECK(check_budget("snapkv", 36, 100, 4, 32).ok());
  CHECK(check_budget("snapkv", 100, 100, 4, 32).ok());
  require_error(check_budget("snapkv", 35, 100, 4, 32), errc::invalid_argument,
                "snapkv: budget 35 is below the 36 protected tokens (n_sink 4 + n_recent 32 of a row of 100)");
  require_error(check_budget("snapkv", -1, 100, 0, 0), errc::invalid_argument, "snapkv: budget -1 is negative");
}

TEST_CASE("protect: bad input gives specific errors and writes nothing") {
  std::vector<float> s(2 * 5, 0.5f);
  auto v = value_of(make_matrix_view(s.data(), 2, 5));
  require_error(protect(seq, v, -1, 2), errc::invalid_argument, "protect: n_sink = -1 is negative");
  require_error(protect(par, v, 1, -2), errc::invalid_argument, "protect: n_recent = -2 is negative");
  const std::int32_t bad[] = {5, 6}, neg[] = {-1, 0};
  require_error(protect(seq, v, 1, 1, bad), errc::out_of_range, "row_lengths[1] = 6 is outside [0, 5]");
  require_error(protect(seq, v, 1, 1, neg), errc::out_of_range, "row_lengths[0] = -1");
  CHECK(std::all_of(s.begin(), s.end(), [](float x) { return x == 0.5f; }));

  std::vector<float> with_lengths(12, 0.f);
  const std::int32_t two[2] = {2, 2};
  std::memcpy(with_lengths.data() + 10, two, sizeof two);
  require_error(protect(seq, value_of(make_matrix_view(with_lengths.data(), 2, 6)), 1, 1,
                        reinterpret_cast<const std::int32_t*>(with_lengths.data() + 10)),
                errc::overlap, "row_lengths lie inside the scores");

  using exts = cuda::std::dextents<index_t, 2>;
  matrix_view<float> null_view(nullptr, cuda::std::layout_stride::mapping<exts>(exts(2, 5), cuda::std::array<index_t, 2>{5, 1}));
  require_error(protect(seq, null_view, 1, 1), errc::null_pointer, "protect: scores: data is null");
  matrix_view<float> empty(nullptr, cuda::std::layout_stride::mapping<exts>(exts(0, 5), cuda::std::array<index_t, 2>{5, 1}));
  CHECK(protect(seq, empty, 1, 1).ok());
}

// The CUDA kernel's own body (detail::protect_body, the one cuda/protect.cuh wraps) on the host SIMT
// executor, with the launcher's shape (and small grid caps: the grid-stride loop): bit-identical with
// protect(seq); rows whose device length is invalid are untouched and counted once each.
TEST_CASE("protect: the CUDA kernel body under the SIMT executor equals seq bit for bit") {
  auto g = kvtest::rng(2101);
  for (int trial = 0; trial < 12; ++trial) {
    CAPTURE(trial);
    const index_t R = 1 + static_cast<index_t>(g() % 5), T = 1 + static_cast<index_t>(g() % 700);
    const index_t n_sink = static_cast<index_t>(g() % 6), n_recent = static_cast<index_t>(g() % 40);
    std::vector<float> s = kvtest::random_floats(g, static_cast<std::size_t>(R * T), -3.f, 3.f);
    if (T > 3) s[static_cast<std::size_t>(T / 2)] = std::numeric_limits<float>::infinity();
    std::vector<std::int32_t> lens(static_cast<std::size_t>(R));
    for (auto& l : lens) l = static_cast<std::int32_t>(g() % static_cast<std::uint64_t>(T + 1));
    const bool with_lengths = trial % 3 != 0;
    std::vector<float> expect = s;
    REQUIRE(protect(seq, *make_matrix_view(expect.data(), R, T), n_sink, n_recent, with_lengths ? lens.data() : nullptr).ok());
    // device lengths may be invalid: those rows are skipped and counted (the host refuses the call)
    std::vector<std::int32_t> dlens = lens;
    int bad_rows = 0;
    if (with_lengths && trial % 2 == 1) {
      dlens[0] = static_cast<std::int32_t>(T + 1);
      expect.assign(s.begin(), s.end());
      std::vector<std::int32_t> ok = lens;
      for (index_t r = 1; r < R; ++r) {
        auto row = *make_matrix_view(expect.data() + r * T, 1, T);
        REQUIRE(protect(seq, row, n_sink, n_recent, ok.data() + r).ok());
      }
      bad_rows = 1;
    }
    const index_t cap = trial % 4 == 0 ? 2 : index_t(1) << 20;
    const detail::simt_shape sh = detail::protect_shape(R, T, cap);
    detail::simt_executor ex(static_cast<std::uint64_t>(trial));
    int bad = 0;
    std::vector<float> got = s;
    const std::int32_t* lp = with_lengths ? dlens.data() : nullptr;
    REQUIRE_MESSAGE(ex.run(sh.grid, sh.block, [&](detail::simt_thread& c) {
      detail::protect_body(c, got.data(), T, 1, R, T, n_sink, n_recent, lp, &bad);
    }), ex.error());
    CHECK(std::memcmp(got.data(), expect.data(), got.size() * sizeof(float)) == 0);
    CHECK(bad == bad_rows);
  }
}
