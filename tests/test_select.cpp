#include "support.hpp"

#include <kvevict/select.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

using namespace kvevict;
using kvtest::require_error;
using kvtest::value_of;
using namespace kvtest::floats;

namespace {

// ---- the naive reference, written for clarity -------------------------------------------------

// The selection order of docs/conventions.md, spelled out: is (a at position pa) kept before
// (b at position pb)? NaN is below everything; otherwise IEEE comparison (so -0 == +0 and the
// infinities order naturally); equal scores go to the lower position.
bool ranks_before(float a, index_t pa, float b, index_t pb) {
  const bool a_nan = std::isnan(a), b_nan = std::isnan(b);
  if (a_nan != b_nan) return b_nan;
  if (!a_nan && a != b) return a > b;
  return pa < pb;
}

// Best k of row[0, n): sort every position by the order, take k, sort the positions.
std::vector<pos_t> naive_topk(const std::vector<float>& row, index_t n, index_t k) {
  std::vector<pos_t> idx(static_cast<std::size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](pos_t i, pos_t j) { return ranks_before(row[i], i, row[j], j); });
  idx.resize(static_cast<std::size_t>(k));
  std::sort(idx.begin(), idx.end());
  return idx;
}

// Layer-wise reference: each row's best floor[r] first, then the best of everything else over all
// rows ordered by (score, row, position). Returns per-row ascending kept lists.
std::vector<std::vector<pos_t>> naive_flat(const std::vector<std::vector<float>>& rows, const std::vector<index_t>& len,
                                           index_t total, const std::vector<std::int32_t>& floors) {
  const std::size_t R = rows.size();
  std::vector<std::vector<pos_t>> kept(R);
  std::vector<std::vector<bool>> taken(R);
  index_t left = total;
  for (std::size_t r = 0; r < R; ++r) {
    taken[r].assign(static_cast<std::size_t>(len[r]), false);
    const index_t f = floors.empty() ? 0 : floors[r];
    for (pos_t p : naive_topk(rows[r], len[r], f)) taken[r][p] = true;
    left -= f;
  }
  struct entry {
    float s;
    std::size_t r;
    pos_t p;
  };
  std::vector<entry> rest;
  for (std::size_t r = 0; r < R; ++r)
    for (pos_t p = 0; p < len[r]; ++p)
      if (!taken[r][p]) rest.push_back({rows[r][p], r, p});
  std::stable_sort(rest.begin(), rest.end(), [](const entry& a, const entry& b) {
    const bool a_nan = std::isnan(a.s), b_nan = std::isnan(b.s);
    if (a_nan != b_nan) return b_nan;
    if (!a_nan && a.s != b.s) return a.s > b.s;
    if (a.r != b.r) return a.r < b.r;
    return a.p < b.p;
  });
  for (index_t i = 0; i < left; ++i) taken[rest[i].r][rest[i].p] = true;
  for (std::size_t r = 0; r < R; ++r)
    for (pos_t p = 0; p < len[r]; ++p)
      if (taken[r][p]) kept[r].push_back(p);
  return kept;
}

// ---- random score rows ------------------------------------------------------------------------

enum class dist { uniform, ties3, all_equal, specials, subnormal, wide };

float draw(std::mt19937_64& g, dist d) {
  switch (d) {
    case dist::uniform: return std::uniform_real_distribution<float>(0.f, 1.f)(g);
    case dist::ties3: return static_cast<float>(kvtest::uniform_int(g, 0, 2));
    case dist::all_equal: return 0.25f;
    case dist::specials: {
      static const float pool[] = {qnan, -qnan, from_bits(0x7f800001u), from_bits(0xffc12345u), inf, -inf,
                                   0.f, -0.f, 1.f, -1.f, 2.5f, std::numeric_limits<float>::denorm_min(),
                                   -std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::max(),
                                   std::numeric_limits<float>::lowest()};
      const auto i = kvtest::uniform_int(g, 0, 2 * static_cast<std::int64_t>(std::size(pool)));
      return i < static_cast<std::int64_t>(std::size(pool)) ? pool[i]
                                                            : std::uniform_real_distribution<float>(-3.f, 3.f)(g);
    }
    case dist::subnormal: {
      // subnormals of both signs, zeros of both signs and the smallest normals
      const auto m = static_cast<std::uint32_t>(kvtest::uniform_int(g, 0, 0x800004));
      return from_bits(m | (kvtest::uniform_int(g, 0, 1) ? 0x80000000u : 0u));
    }
    case dist::wide: return from_bits(static_cast<std::uint32_t>(kvtest::uniform_int(g, 0, 0xffffffffLL)));
  }
  return 0.f;
}

// A score matrix [R][T] stored with a padded row stride (and, optionally, transposed: column
// stride R_pad, i.e. a token-major score buffer).
struct score_matrix {
  index_t R, T, row_stride, col_stride;
  std::vector<float> buf;
  std::vector<std::vector<float>> rows;  // the same values, for the reference
  matrix_view<const float> view;

  score_matrix(std::mt19937_64& g, index_t r, index_t t, dist d, index_t pad, bool transposed)
      : R(r), T(t), rows(static_cast<std::size_t>(r)) {
    if (!transposed) {
      row_stride = std::max<index_t>(1, T + pad);
      col_stride = 1;
    } else {
      row_stride = 1;
      col_stride = std::max<index_t>(1, R + pad);
    }
    buf.assign(static_cast<std::size_t>(std::max<index_t>(1, (R + pad) * (T + pad))), -7.f);
    for (index_t i = 0; i < R; ++i) {
      rows[i].resize(static_cast<std::size_t>(T));
      for (index_t j = 0; j < T; ++j) {
        const float x = draw(g, d);
        rows[i][j] = x;
        buf[static_cast<std::size_t>(i * row_stride + j * col_stride)] = x;
      }
    }
    using exts = cuda::std::dextents<index_t, 2>;
    view = matrix_view<const float>(buf.data(), cuda::std::layout_stride::mapping<exts>(
                                                    exts(R, T), cuda::std::array<index_t, 2>{row_stride, col_stride}));
  }
};

// Runs a two-phase call: query, allocate exactly the queried size, run.
template <class F>
status with_workspace(F&& f, std::vector<unsigned char>& mem) {
  workspace ws;
  const status q = f(ws);
  if (!q.ok()) MESSAGE(std::string("query failed: ").append(q.message()));
  KVEVICT_TRY(q);
  REQUIRE(ws.data == nullptr);
  ws = kvtest::shifted_workspace(mem, ws.bytes, 0xab);
  const status st = f(ws);
  if (!st.ok()) MESSAGE(std::string("call failed: ").append(st.message()));
  return st;
}

// The order as a key comparison used by the invariant checks below: a strictly better than b?
bool better_score(float a, float b) {
  if (std::isnan(a)) return false;
  if (std::isnan(b)) return true;
  return a > b;
}

// Every kept score is at least as good as every dropped one; kept is strictly ascending and in range.
void check_invariants(const std::vector<float>& row, index_t n, const pos_t* kept, index_t k) {
  std::vector<bool> is_kept(static_cast<std::size_t>(n), false);
  for (index_t j = 0; j < k; ++j) {
    REQUIRE(kept[j] >= 0);
    REQUIRE(kept[j] < n);
    if (j > 0) REQUIRE(kept[j] > kept[j - 1]);
    is_kept[kept[j]] = true;
  }
  // worst kept vs best dropped
  const float* worst = nullptr;
  const float* best = nullptr;
  for (index_t i = 0; i < n; ++i) {
    const float* x = &row[i];
    if (is_kept[i]) {
      if (!worst || better_score(*worst, *x)) worst = x;
    } else if (!best || better_score(*x, *best)) {
      best = x;
    }
  }
  if (worst && best) REQUIRE_FALSE(better_score(*best, *worst));
}

// par runs small shapes on one thread; the randomized tests force the threaded code instead.
struct force_threads {
  kvevict::index_t saved = detail::par_min_elements();
  force_threads() { detail::par_min_elements() = 0; }
  ~force_threads() { detail::par_min_elements() = saved; }
};

const dist all_dists[] = {dist::uniform, dist::ties3, dist::all_equal, dist::specials, dist::subnormal, dist::wide};

template <class Backend>
void dense_matches_reference(Backend be, std::uint64_t seed, int trials, index_t max_t) {
  auto g = kvtest::rng(seed);
  for (int trial = 0; trial < trials; ++trial) {
    const dist d = all_dists[trial % std::size(all_dists)];
    const index_t R = kvtest::uniform_int(g, 0, 6);
    const index_t T = kvtest::uniform_int(g, 0, max_t);
    const bool transposed = trial % 5 == 3;
    const index_t pad = trial % 3 == 1 ? kvtest::uniform_int(g, 1, 9) : 0;
    score_matrix s(g, R, T, d, pad, transposed);
    std::vector<std::int32_t> lens(static_cast<std::size_t>(R));
    const bool use_lens = trial % 2 == 0;
    index_t min_len = T;
    for (auto& l : lens) {
      l = static_cast<std::int32_t>(use_lens ? kvtest::uniform_int(g, 0, T) : T);
      min_len = std::min<index_t>(min_len, l);
    }
    const int kind = trial % 4;  // 0: random k, 1: k = 0, 2: k = min length, 3: small k
    const index_t k = kind == 1 ? 0 : kind == 2 ? min_len : kvtest::uniform_int(g, 0, std::min<index_t>(min_len, kind == 3 ? 3 : min_len));
    CAPTURE(seed);
    CAPTURE(trial);
    CAPTURE(R);
    CAPTURE(T);
    CAPTURE(k);
    CAPTURE(static_cast<int>(d));
    // kept stored transposed every other trial: [R][k] with strides (1, R)
    const bool kept_t = trial % 2 == 1;
    std::vector<pos_t> out(static_cast<std::size_t>(std::max<index_t>(1, R * k)), -1);
    using exts = cuda::std::dextents<index_t, 2>;
    const cuda::std::array<index_t, 2> kst = kept_t ? cuda::std::array<index_t, 2>{1, std::max<index_t>(1, R)}
                                                    : cuda::std::array<index_t, 2>{std::max<index_t>(1, k), 1};
    matrix_view<pos_t> kept(out.data(), cuda::std::layout_stride::mapping<exts>(exts(R, k), kst));
    std::vector<unsigned char> mem;
    const std::int32_t* lp = use_lens ? lens.data() : nullptr;
    REQUIRE(with_workspace([&](workspace& ws) { return select_topk(be, ws, s.view, lp, kept); }, mem).ok());
    for (index_t r = 0; r < R; ++r) {
      CAPTURE(r);
      const auto ref = naive_topk(s.rows[r], lens[r], k);
      std::vector<pos_t> got(static_cast<std::size_t>(k));
      for (index_t j = 0; j < k; ++j) got[j] = kept(r, j);
      REQUIRE(got == ref);
      check_invariants(s.rows[r], lens[r], got.data(), k);
    }
  }
}

template <class Backend>
std::vector<pos_t> ragged_run(Backend be, const score_matrix& s, const std::vector<std::int32_t>& lens,
                              const std::vector<std::int32_t>& cu) {
  std::vector<pos_t> pos(static_cast<std::size_t>(std::max(1, cu.back())), -1);
  std::vector<unsigned char> mem;
  ragged_positions_out kept{pos.data(), cu.data(), s.R};
  REQUIRE(with_workspace([&](workspace& ws) { return select_topk(be, ws, s.view, lens.data(), kept); }, mem).ok());
  pos.resize(static_cast<std::size_t>(cu.back()));
  return pos;
}

}  // namespace

// ---- radix.hpp ---------------------------------------------------------------------------------

TEST_CASE("radix: score_key follows the selection order over a sweep of special values") {
  using lim = std::numeric_limits<float>;
  // groups in ascending order; values inside a group are equal under the order
  const std::vector<std::vector<float>> groups = {
      {qnan, -qnan, from_bits(0x7f800001u), from_bits(0x7fffffffu), from_bits(0xffffffffu), from_bits(0xff800001u)},
      {-inf},
      {lim::lowest()},
      {-1e30f},
      {-1.f},
      {-lim::min()},
      {-from_bits(0x007fffffu)},
      {-lim::denorm_min()},
      {0.f, -0.f},
      {lim::denorm_min()},
      {from_bits(2)},
      {from_bits(0x007fffffu)},
      {lim::min()},
      {1.f},
      {std::nextafter(1.f, 2.f)},
      {lim::max()},
      {inf},
  };
  for (std::size_t a = 0; a < groups.size(); ++a)
    for (std::size_t b = 0; b < groups.size(); ++b)
      for (float x : groups[a])
        for (float y : groups[b]) {
          CAPTURE(a);
          CAPTURE(b);
          const auto kx = detail::score_key(x), ky = detail::score_key(y);
          if (a < b) CHECK(kx < ky);
          else if (a == b) CHECK(kx == ky);
          else CHECK(kx > ky);
        }
  CHECK(detail::score_key(qnan) == detail::nan_key);
  CHECK(detail::score_key(-inf) > detail::nan_key);

  // random bit patterns: the key order is the reference order
  auto g = kvtest::rng(99);
  for (int i = 0; i < 200000; ++i) {
    const float x = draw(g, i % 2 ? dist::wide : dist::specials), y = draw(g, i % 3 ? dist::wide : dist::subnormal);
    const bool x_first = better_score(x, y), y_first = better_score(y, x);
    const auto kx = detail::score_key(x), ky = detail::score_key(y);
    REQUIRE((kx > ky) == x_first);
    REQUIRE((ky > kx) == y_first);
  }
}

TEST_CASE("radix: digits cover the key exactly once, top bits first") {
  std::uint32_t all = 0;
  int bits = 0;
  for (int p = 0; p < detail::radix_passes; ++p) {
    CHECK((all & detail::radix_digit_mask(p)) == 0u);
    all |= detail::radix_digit_mask(p);
    bits += detail::radix_width(p);
    CHECK(detail::radix_width(p) <= detail::radix_bits);
    CHECK(detail::radix_width(p) >= 8);
    if (p > 0) CHECK(detail::radix_shift(p) < detail::radix_shift(p - 1));
  }
  CHECK(all == 0xffffffffu);
  CHECK(bits == 32);
  CHECK(detail::radix_shift(0) == 21);
  CHECK(detail::radix_shift(detail::radix_passes - 1) == 0);
  auto g = kvtest::rng(5);
  for (int i = 0; i < 1000; ++i) {
    const auto key = static_cast<std::uint32_t>(kvtest::uniform_int(g, 0, 0xffffffffLL));
    std::uint32_t back = 0;
    for (int p = 0; p < detail::radix_passes; ++p) back |= detail::radix_digit(key, p) << detail::radix_shift(p);
    REQUIRE(back == key);
  }
}

TEST_CASE("radix: bucket choice, narrowing and the keep rule") {
  // 4 buckets: counts 3, 0, 5, 2 (bucket 3 is the best)
  const std::uint32_t hist[4] = {3, 0, 5, 2};
  auto b = detail::radix_choose_bucket(hist, 4, 1);
  CHECK(b.bucket == 3u);
  CHECK(b.above == 0);
  CHECK(b.count == 2);
  b = detail::radix_choose_bucket(hist, 4, 2);
  CHECK(b.bucket == 3u);
  b = detail::radix_choose_bucket(hist, 4, 3);
  CHECK(b.bucket == 2u);
  CHECK(b.above == 2);
  CHECK(b.count == 5);
  b = detail::radix_choose_bucket(hist, 4, 7);
  CHECK(b.bucket == 2u);
  b = detail::radix_choose_bucket(hist, 4, 8);
  CHECK(b.bucket == 0u);  // skips the empty bucket 1
  CHECK(b.above == 7);
  CHECK(b.count == 3);

  // narrowing: the whole bucket is kept -> decided early unless the full key is asked for
  detail::radix_threshold t;
  CHECK(detail::radix_narrow(t, 0, detail::radix_bucket{5u, 2, 3}, 5, false));
  CHECK(t.mask == detail::radix_digit_mask(0));
  CHECK(t.prefix == 5u << 21);
  CHECK(t.ties == 3);
  detail::radix_threshold full;
  CHECK_FALSE(detail::radix_narrow(full, 0, detail::radix_bucket{5u, 2, 3}, 5, true));
  detail::radix_threshold part;
  CHECK_FALSE(detail::radix_narrow(part, 0, detail::radix_bucket{5u, 2, 4}, 5, false));
  CHECK(detail::radix_narrow(part, 2, detail::radix_bucket{1u, 0, 9}, 3, false));  // last pass always decides

  // keep rule over keys in position order: above always, tied while ties last, below never
  const auto th = detail::radix_full_threshold(100u, 2);
  index_t ties = th.ties;
  const std::uint32_t keys[] = {100, 99, 101, 100, 100, 0, 0xffffffffu};
  const bool expect[] = {true, false, true, true, false, false, true};
  for (int i = 0; i < 7; ++i) CHECK(detail::radix_keep(keys[i], th, ties) == expect[i]);
  CHECK(ties == 0);
  CHECK(detail::radix_compare(101u, th) == 1);
  CHECK(detail::radix_compare(100u, th) == 0);
  CHECK(detail::radix_compare(7u, th) == -1);
}

// ---- select_topk ---------------------------------------------------------------------------------

TEST_CASE("select_topk dense: random shapes, lengths, k, ties and special values match the naive reference") {
  const force_threads threaded;
  dense_matches_reference(seq, 1, 300, 300);
  dense_matches_reference(par, 2, 300, 300);
  dense_matches_reference(par_t{2}, 5, 100, 300);
  dense_matches_reference(par_t{3}, 3, 120, 5000);
  dense_matches_reference(seq, 4, 60, 5000);
}

TEST_CASE("select_topk: hand-checked ties, NaN, infinities and signed zeros") {
  const std::vector<float> row = {1.f, qnan, -inf, 2.f, -0.f, 2.f, inf, 0.f, qnan, 1.f};
  auto view = value_of(make_matrix_view(row.data(), 1, 10));
  std::vector<unsigned char> mem;
  auto run = [&](index_t k) {
    std::vector<pos_t> out(static_cast<std::size_t>(std::max<index_t>(k, 1)), -1);
    auto kv = value_of(make_matrix_view(out.data(), 1, k));
    REQUIRE(with_workspace([&](workspace& ws) { return select_topk(seq, ws, view, nullptr, kv); }, mem).ok());
    out.resize(static_cast<std::size_t>(k));
    return out;
  };
  CHECK(run(1) == std::vector<pos_t>{6});                  // +inf
  CHECK(run(2) == std::vector<pos_t>{3, 6});               // then the first 2.0
  CHECK(run(3) == std::vector<pos_t>{3, 5, 6});            // both 2.0
  CHECK(run(4) == std::vector<pos_t>{0, 3, 5, 6});         // the first 1.0
  CHECK(run(6) == std::vector<pos_t>{0, 3, 4, 5, 6, 9});   // then -0.0 (position 4) before +0.0 (7)
  CHECK(run(7) == std::vector<pos_t>{0, 3, 4, 5, 6, 7, 9});
  CHECK(run(8) == std::vector<pos_t>{0, 2, 3, 4, 5, 6, 7, 9});        // -inf beats NaN
  CHECK(run(9) == std::vector<pos_t>{0, 1, 2, 3, 4, 5, 6, 7, 9});     // first NaN by position
  CHECK(run(10) == std::vector<pos_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
  CHECK(run(0).empty());
}

TEST_CASE("select_topk ragged: per-row k and lengths, seq and par identical to the reference") {
  const force_threads threaded;
  for (std::uint64_t seed = 20; seed < 60; ++seed) {
    CAPTURE(seed);
    auto g = kvtest::rng(seed);
    const index_t R = kvtest::uniform_int(g, 0, 9), T = kvtest::uniform_int(g, 0, seed % 4 == 0 ? 4000 : 200);
    score_matrix s(g, R, T, all_dists[seed % std::size(all_dists)], seed % 2 ? 3 : 0, seed % 5 == 0);
    std::vector<std::int32_t> lens(static_cast<std::size_t>(R)), cu(static_cast<std::size_t>(R + 1), 0);
    for (index_t r = 0; r < R; ++r) {
      lens[r] = static_cast<std::int32_t>(kvtest::uniform_int(g, 0, T));
      const int kind = static_cast<int>(kvtest::uniform_int(g, 0, 3));
      const index_t k = kind == 0 ? 0 : kind == 1 ? lens[r] : kvtest::uniform_int(g, 0, lens[r]);
      cu[r + 1] = cu[r] + static_cast<std::int32_t>(k);
    }
    const auto a = ragged_run(seq, s, lens, cu);
    CHECK(ragged_run(par, s, lens, cu) == a);
    CHECK(ragged_run(par_t{4}, s, lens, cu) == a);
    for (index_t r = 0; r < R; ++r) {
      const std::vector<pos_t> got(a.begin() + cu[r], a.begin() + cu[r + 1]);
      REQUIRE(got == naive_topk(s.rows[r], lens[r], cu[r + 1] - cu[r]));
    }
  }
}

TEST_CASE("select_topk: long rows (~100K) on every thread count, cooperative rows included") {
  // par splits leftover long rows among the threads: R = 1, 3 with 2-4 threads exercises it
  for (std::uint64_t seed = 70; seed < 76; ++seed) {
    CAPTURE(seed);
    auto g = kvtest::rng(seed);
    const index_t R = seed % 3 == 0 ? 1 : 3, T = kvtest::uniform_int(g, 90000, 110000);
    const dist d = seed % 3 == 0 ? dist::uniform : seed % 3 == 1 ? dist::ties3 : dist::specials;
    score_matrix s(g, R, T, d, seed % 2 ? 5 : 0, false);
    std::vector<std::int32_t> lens(static_cast<std::size_t>(R)), cu(static_cast<std::size_t>(R + 1), 0);
    for (index_t r = 0; r < R; ++r) {
      // row 2 is short: the team hands it to one thread
      lens[r] = static_cast<std::int32_t>(r == 0 ? T : r == 1 ? kvtest::uniform_int(g, T / 2, T) : kvtest::uniform_int(g, 1000, 20000));
      const index_t k = r == 1 ? lens[r] / 2 : kvtest::uniform_int(g, 1, 5000);
      cu[r + 1] = cu[r] + static_cast<std::int32_t>(k);
    }
    const auto a = ragged_run(seq, s, lens, cu);
    for (int threads : {1, 2, 3, 4}) {
      CAPTURE(threads);
      CHECK(ragged_run(par_t{threads}, s, lens, cu) == a);
    }
    for (index_t r = 0; r < R; ++r) {
      const std::vector<pos_t> got(a.begin() + cu[r], a.begin() + cu[r + 1]);
      REQUIRE(got == naive_topk(s.rows[r], lens[r], cu[r + 1] - cu[r]));
    }
  }
}

TEST_CASE("select_topk: all-equal rows keep the lowest positions, heavy ties split exactly") {
  const index_t R = 3, T = 50000;
  std::vector<float> sc(static_cast<std::size_t>(R * T), 1.5f);
  for (index_t i = 0; i < T; ++i) sc[static_cast<std::size_t>(T + i)] = static_cast<float>(i % 2);  // row 1: 0,1,0,1..
  auto view = value_of(make_matrix_view(sc.data(), R, T));
  for (int threads : {1, 2, 3}) {
    std::vector<pos_t> out(static_cast<std::size_t>(R * 30001));
    auto kv = value_of(make_matrix_view(out.data(), R, 30001));
    std::vector<unsigned char> mem;
    REQUIRE(with_workspace([&](workspace& ws) { return select_topk(par_t{threads}, ws, view, nullptr, kv); }, mem).ok());
    // row 1 keeps every 1 (odd positions) and the first 5001 zeros (even positions 0..10000)
    std::vector<pos_t> row1;
    for (pos_t p = 0; p < T; ++p)
      if (p % 2 == 1 || p <= 10000) row1.push_back(p);
    REQUIRE(row1.size() == 30001u);
    for (index_t j = 0; j < 30001; ++j) {
      REQUIRE(kv(0, j) == j);  // all equal: positions 0..k-1
      REQUIRE(kv(1, j) == row1[j]);
      REQUIRE(kv(2, j) == j);
    }
    // the same into a transposed kept view ([R][k] with strides (1, R)): identical positions
    std::vector<pos_t> out_t(out.size(), -1);
    using exts = cuda::std::dextents<index_t, 2>;
    matrix_view<pos_t> kt(out_t.data(),
                          cuda::std::layout_stride::mapping<exts>(exts(R, 30001), cuda::std::array<index_t, 2>{1, R}));
    REQUIRE(with_workspace([&](workspace& ws) { return select_topk(par_t{threads}, ws, view, nullptr, kt); }, mem).ok());
    for (index_t r = 0; r < R; ++r)
      for (index_t j = 0; j < 30001; ++j) REQUIRE(kt(r, j) == kv(r, j));
  }
}

// ---- select_topk_flat --------------------------------------------------------------------------

TEST_CASE("select_topk_flat: layer-wise top-k with floors matches the naive reference") {
  const force_threads threaded;
  for (std::uint64_t seed = 100; seed < 220; ++seed) {
    CAPTURE(seed);
    auto g = kvtest::rng(seed);
    const index_t R = kvtest::uniform_int(g, 0, 8), T = kvtest::uniform_int(g, 0, seed % 10 == 0 ? 3000 : 120);
    score_matrix s(g, R, T, all_dists[seed % std::size(all_dists)], seed % 3 == 0 ? 2 : 0, seed % 7 == 0);
    std::vector<std::int32_t> lens(static_cast<std::size_t>(R)), floors(static_cast<std::size_t>(R));
    std::vector<index_t> len64(static_cast<std::size_t>(R));
    index_t sum_len = 0, sum_floor = 0;
    for (index_t r = 0; r < R; ++r) {
      lens[r] = static_cast<std::int32_t>(seed % 4 == 0 ? T : kvtest::uniform_int(g, 0, T));
      len64[r] = lens[r];
      const int kind = static_cast<int>(kvtest::uniform_int(g, 0, 4));
      floors[r] = static_cast<std::int32_t>(kind == 0 ? 0 : kind == 1 ? lens[r] : kvtest::uniform_int(g, 0, lens[r] / 2));
      sum_len += lens[r];
      sum_floor += floors[r];
    }
    const bool use_floors = seed % 2 == 0;
    const index_t lo = use_floors ? sum_floor : 0;
    const index_t total = seed % 5 == 1 ? lo : seed % 5 == 2 ? sum_len : kvtest::uniform_int(g, lo, sum_len);
    CAPTURE(R);
    CAPTURE(T);
    CAPTURE(total);
    const auto ref = naive_flat(s.rows, len64, total, use_floors ? floors : std::vector<std::int32_t>{});
    const std::int32_t* fp = use_floors ? floors.data() : nullptr;
    std::vector<pos_t> first;
    for (int threads : {0, 1, 2, 3}) {
      CAPTURE(threads);
      std::vector<std::int32_t> cu(static_cast<std::size_t>(R + 1), -1), cu_only(cu);
      std::vector<pos_t> pos(static_cast<std::size_t>(std::max<index_t>(1, total)), -1);
      std::vector<unsigned char> mem;
      auto run = [&](auto be) {
        REQUIRE(with_workspace([&](workspace& ws) {
                  return select_topk_flat(be, ws, s.view, lens.data(), total, fp, cu.data(), pos.data());
                }, mem).ok());
        // counts only (no positions) gives the same counts
        REQUIRE(with_workspace([&](workspace& ws) {
                  return select_topk_flat(be, ws, s.view, lens.data(), total, fp, cu_only.data(), nullptr);
                }, mem).ok());
      };
      if (threads == 0) run(seq);
      else run(par_t{threads});
      CHECK(cu == cu_only);
      REQUIRE(cu[0] == 0);
      REQUIRE(cu[R] == total);
      for (index_t r = 0; r < R; ++r) {
        CAPTURE(r);
        const std::vector<pos_t> got(pos.begin() + cu[r], pos.begin() + cu[r + 1]);
        REQUIRE(got == ref[r]);
        if (use_floors) REQUIRE(cu[r + 1] - cu[r] >= floors[r]);
      }
      pos.resize(static_cast<std::size_t>(total));
      // the counts as a ragged budget for select_topk give the same positions
      if (threads == 0 && total > 0) {
        std::vector<pos_t> again(pos.size(), -1);
        REQUIRE(with_workspace([&](workspace& ws) {
                  return select_topk(seq, ws, s.view, lens.data(), ragged_positions_out{again.data(), cu.data(), R});
                }, mem).ok());
        CHECK(again == pos);
      }
      if (threads == 0) first = pos;
      else CHECK(pos == first);
    }
  }
}

TEST_CASE("select_topk_flat: ties across rows go to the lower row, then the lower position") {
  const force_threads threaded;
  // 3 rows of 4 equal scores: total 6 without floors keeps row 0 whole and row 1's first two
  std::vector<float> sc(12, 1.f);
  auto view = value_of(make_matrix_view(sc.data(), 3, 4));
  std::vector<std::int32_t> cu(4);
  std::vector<pos_t> pos(6);
  std::vector<unsigned char> mem;
  REQUIRE(with_workspace([&](workspace& ws) {
            return select_topk_flat(seq, ws, view, nullptr, 6, nullptr, cu.data(), pos.data());
          }, mem).ok());
  CHECK(cu == std::vector<std::int32_t>{0, 4, 6, 6});
  CHECK(pos == std::vector<pos_t>{0, 1, 2, 3, 0, 1});
  // floors {0, 0, 2}: row 2 first keeps positions 0, 1; the other 4 go to row 0
  const std::int32_t floors[] = {0, 0, 2};
  REQUIRE(with_workspace([&](workspace& ws) {
            return select_topk_flat(par, ws, view, nullptr, 6, floors, cu.data(), pos.data());
          }, mem).ok());
  CHECK(cu == std::vector<std::int32_t>{0, 4, 4, 6});
  CHECK(pos == std::vector<pos_t>{0, 1, 2, 3, 0, 1});
  // a better score in row 2 beats the ties; NaN rows come last
  sc[11] = 2.f;
  sc[0] = qnan;
  REQUIRE(with_workspace([&](workspace& ws) {
            return select_topk_flat(seq, ws, view, nullptr, 6, nullptr, cu.data(), pos.data());
          }, mem).ok());
  CHECK(cu == std::vector<std::int32_t>{0, 3, 5, 6});
  CHECK(pos == std::vector<pos_t>{1, 2, 3, 0, 1, 3});
}

// ---- workspace and errors ----------------------------------------------------------------------

TEST_CASE("select_topk: workspace query, reuse and size errors") {
  auto g = kvtest::rng(7);
  score_matrix s(g, 4, 100, dist::uniform, 0, false);
  std::vector<pos_t> out(40, -1);
  auto kept = value_of(make_matrix_view(out.data(), 4, 10));
  workspace q;
  REQUIRE(select_topk(seq, q, s.view, nullptr, kept).ok());
  CHECK(q.data == nullptr);
  CHECK(q.bytes >= 4 * 100 + 4 * detail::radix_bins);
  CHECK(std::all_of(out.begin(), out.end(), [](pos_t p) { return p == -1; }));  // a query does no work
  workspace qp;
  REQUIRE(select_topk(par_t{2}, qp, s.view, nullptr, kept).ok());
  CHECK(qp.bytes > q.bytes);  // one slot per thread

  std::vector<unsigned char> mem(q.bytes - 1);
  workspace small{mem.data(), mem.size()};
  require_error(select_topk(seq, small, s.view, nullptr, kept), errc::workspace_too_small, "select_topk: workspace has");
  CHECK(std::all_of(out.begin(), out.end(), [](pos_t p) { return p == -1; }));
  mem.resize(q.bytes);
  workspace ok{mem.data(), mem.size()};
  REQUIRE(select_topk(seq, ok, s.view, nullptr, kept).ok());
  const auto first = out;
  REQUIRE(select_topk(seq, ok, s.view, nullptr, kept).ok());  // reused buffer, same result
  CHECK(out == first);

  // flat: its own size, also checked
  std::vector<std::int32_t> cu(5);
  workspace fq;
  REQUIRE(select_topk_flat(seq, fq, s.view, nullptr, 10, nullptr, cu.data(), nullptr).ok());
  CHECK(fq.bytes > q.bytes);
  require_error(select_topk_flat(seq, ok, s.view, nullptr, 10, nullptr, cu.data(), nullptr), errc::workspace_too_small,
                "select_topk_flat: workspace has");
}

TEST_CASE("select_topk: workspace sizes follow the documented formula") {
  // docs/select.md: seq 8192 + 4T; par with P threads 8192P + 4PT + 8192 + 16P; flat adds
  // 8192R + 48R; each piece starts 64-byte aligned (at most 64 B of padding per piece)
  for (index_t T : {0, 1, 100, 4097}) {
    for (index_t R : {0, 1, 5}) {
      std::vector<float> sc(static_cast<std::size_t>(std::max<index_t>(1, R * T)));
      auto scores = value_of(make_matrix_view(sc.data(), R, T));
      std::vector<pos_t> out(1);
      auto kept = value_of(make_matrix_view(out.data(), R, 0));
      std::vector<std::int32_t> cu(static_cast<std::size_t>(R + 1));
      for (int P : {1, 2, 3}) {
        CAPTURE(T);
        CAPTURE(R);
        CAPTURE(P);
        workspace a, f;
        if (P == 1) {
          REQUIRE(select_topk(seq, a, scores, nullptr, kept).ok());
          REQUIRE(select_topk_flat(seq, f, scores, nullptr, 0, nullptr, cu.data(), nullptr).ok());
        } else {
          REQUIRE(select_topk(par_t{P}, a, scores, nullptr, kept).ok());
          REQUIRE(select_topk_flat(par_t{P}, f, scores, nullptr, 0, nullptr, cu.data(), nullptr).ok());
        }
        const bool threaded = P > 1 && par_is_parallel();
        const std::size_t Pw = threaded ? static_cast<std::size_t>(P) : 1u, Tu = static_cast<std::size_t>(T);
        const std::size_t sel = threaded ? 8192 * Pw + 4 * Pw * Tu + 8192 + 16 * Pw : 8192 + 4 * Tu;
        const std::size_t pieces = threaded ? 5 : 2;
        CHECK(a.bytes >= sel);
        CHECK(a.bytes <= sel + 64 * pieces);
        const std::size_t flat = sel + (8192 + 48) * static_cast<std::size_t>(R);
        CHECK(f.bytes >= flat);
        CHECK(f.bytes <= flat + 64 * (pieces + 2));
      }
    }
  }
  // a par workspace queried for 2 threads is too small for 4
  std::vector<float> sc(2 * 1000, 1.f);
  auto scores = value_of(make_matrix_view(sc.data(), 2, 1000));
  std::vector<pos_t> out(20);
  auto kept = value_of(make_matrix_view(out.data(), 2, 10));
  workspace q;
  REQUIRE(select_topk(par_t{2}, q, scores, nullptr, kept).ok());
  std::vector<unsigned char> mem(q.bytes);
  workspace ws{mem.data(), mem.size()};
  REQUIRE(select_topk(par_t{2}, ws, scores, nullptr, kept).ok());
  if (par_is_parallel())
    require_error(select_topk(par_t{4}, ws, scores, nullptr, kept), errc::workspace_too_small, "query the size first");
}

TEST_CASE("select_topk: bad input gives specific errors and writes nothing") {
  std::vector<float> sc(3 * 8, 1.f);
  auto scores = value_of(make_matrix_view(sc.data(), 3, 8));
  std::vector<pos_t> out(3 * 4, -1);
  auto kept = value_of(make_matrix_view(out.data(), 3, 4));
  std::vector<unsigned char> mem(1 << 20);
  workspace ws{mem.data(), mem.size()};
  auto untouched = [&] { return std::all_of(out.begin(), out.end(), [](pos_t p) { return p == -1; }); };

  // k larger than a row
  const std::int32_t short_row[] = {8, 3, 8};
  require_error(select_topk(seq, ws, scores, short_row, kept), errc::invalid_argument,
                "select_topk: k = 4 is larger than row 1's length 3");
  CHECK(untouched());
  // lengths outside [0, T]
  const std::int32_t too_long[] = {8, 9, 8};
  require_error(select_topk(par, ws, scores, too_long, kept), errc::out_of_range,
                "row_lengths[1] = 9 is outside [0, 8]");
  const std::int32_t negative[] = {-1, 8, 8};
  require_error(select_topk(seq, ws, scores, negative, kept), errc::out_of_range, "row_lengths[0] = -1");
  CHECK(untouched());
  // kept shape
  auto two_rows = value_of(make_matrix_view(out.data(), 2, 4));
  require_error(select_topk(seq, ws, scores, nullptr, two_rows), errc::shape_mismatch,
                "kept has 2 rows but scores has 3");
  // bad hand-built views
  using exts = cuda::std::dextents<index_t, 2>;
  matrix_view<const float> null_scores(nullptr, cuda::std::layout_stride::mapping<exts>(exts(3, 8), cuda::std::array<index_t, 2>{8, 1}));
  require_error(select_topk(seq, ws, null_scores, nullptr, kept), errc::null_pointer, "select_topk: scores: data is null");
  matrix_view<const float> aliasing(sc.data(), cuda::std::layout_stride::mapping<exts>(exts(3, 8), cuda::std::array<index_t, 2>{4, 1}));
  require_error(select_topk(seq, ws, aliasing, nullptr, kept), errc::overlap, "select_topk: scores: strides make");
  matrix_view<pos_t> aliasing_kept(out.data(), cuda::std::layout_stride::mapping<exts>(exts(3, 4), cuda::std::array<index_t, 2>{1, 1}));
  require_error(select_topk(seq, ws, scores, nullptr, aliasing_kept), errc::overlap, "select_topk: kept: strides make");
  // output overlapping the scores, the lengths or the workspace
  auto kept_in_scores = value_of(make_matrix_view(reinterpret_cast<pos_t*>(sc.data()) + 4, 3, 4));
  require_error(select_topk(seq, ws, scores, nullptr, kept_in_scores), errc::overlap, "kept and scores overlap");
  std::vector<std::int32_t> lens_and_out(3 + 12, 8);
  auto kept_on_lens = value_of(make_matrix_view(reinterpret_cast<pos_t*>(lens_and_out.data()) + 2, 3, 4));
  require_error(select_topk(seq, ws, scores, lens_and_out.data(), kept_on_lens), errc::overlap,
                "kept and row_lengths overlap");
  // kept inside a real 64 KiB buffer that is also handed over as the workspace (and nothing else)
  std::vector<pos_t> arena((1 << 16) / sizeof(pos_t), -1);
  workspace ws_on_kept{arena.data(), arena.size() * sizeof(pos_t)};
  auto kept_in_ws = value_of(make_matrix_view(arena.data() + 16, 3, 4));
  require_error(select_topk(seq, ws_on_kept, scores, nullptr, kept_in_ws), errc::overlap,
                "the workspace and kept overlap");
  CHECK(untouched());
  // too many columns for int32 positions
  matrix_view<const float> huge(sc.data(), cuda::std::layout_stride::mapping<exts>(exts(1, index_t(1) << 31), cuda::std::array<index_t, 2>{1, 1}));
  require_error(select_topk(seq, ws, huge, nullptr, kept), errc::invalid_argument, "positions are int32");
}

TEST_CASE("select_topk ragged and flat: bad offsets, floors and totals") {
  std::vector<float> sc(2 * 6, 1.f);
  auto scores = value_of(make_matrix_view(sc.data(), 2, 6));
  std::vector<pos_t> pos(16, -1);
  std::vector<unsigned char> mem(1 << 20);
  workspace ws{mem.data(), mem.size()};
  auto untouched = [&] { return std::all_of(pos.begin(), pos.end(), [](pos_t p) { return p == -1; }); };

  const std::int32_t cu_ok[] = {0, 3, 5};
  const std::int32_t cu_start[] = {1, 3, 5};
  const std::int32_t cu_down[] = {0, 3, 2};
  const std::int32_t cu_big[] = {0, 7, 9};
  require_error(select_topk(seq, ws, scores, nullptr, ragged_positions_out{pos.data(), cu_start, 2}),
                errc::invalid_argument, "kept.cu[0] must be 0");
  require_error(select_topk(seq, ws, scores, nullptr, ragged_positions_out{pos.data(), cu_down, 2}),
                errc::invalid_argument, "kept.cu decreases at head 1");
  require_error(select_topk(seq, ws, scores, nullptr, ragged_positions_out{pos.data(), cu_big, 2}),
                errc::invalid_argument, "row 0 keeps 7 tokens but its length is 6");
  require_error(select_topk(seq, ws, scores, nullptr, ragged_positions_out{pos.data(), nullptr, 2}), errc::null_pointer,
                "kept.cu offsets are null");
  require_error(select_topk(seq, ws, scores, nullptr, ragged_positions_out{nullptr, cu_ok, 2}), errc::null_pointer,
                "kept.pos is null but kept.cu lists 5 positions");
  require_error(select_topk(seq, ws, scores, nullptr, ragged_positions_out{pos.data(), cu_ok, 3}),
                errc::shape_mismatch, "kept has 3 heads but scores has 2 rows");
  require_error(select_topk(seq, ws, scores, nullptr, ragged_positions_out{reinterpret_cast<pos_t*>(sc.data()) + 1, cu_ok, 2}),
                errc::overlap, "kept.pos and scores overlap");
  std::vector<std::int32_t> shared(8, 0);
  shared[1] = 3;
  shared[2] = 5;
  require_error(select_topk(seq, ws, scores, nullptr, ragged_positions_out{shared.data() + 2, shared.data(), 2}),
                errc::overlap, "kept.pos and kept.cu overlap");
  CHECK(untouched());

  // flat
  std::vector<std::int32_t> cu(3, -1);
  const std::int32_t lens[] = {6, 2};
  require_error(select_topk_flat(seq, ws, scores, lens, 9, nullptr, cu.data(), pos.data()), errc::invalid_argument,
                "total = 9 is larger than the 8 entries of the rows");
  require_error(select_topk_flat(seq, ws, scores, lens, -1, nullptr, cu.data(), pos.data()), errc::invalid_argument,
                "total = -1 is outside");
  const std::int32_t floors_big[] = {1, 3};
  require_error(select_topk_flat(seq, ws, scores, lens, 5, floors_big, cu.data(), pos.data()), errc::out_of_range,
                "floors[1] = 3 is outside [0, 2]");
  const std::int32_t floors_neg[] = {-1, 0};
  require_error(select_topk_flat(seq, ws, scores, lens, 5, floors_neg, cu.data(), pos.data()), errc::out_of_range,
                "floors[0] = -1");
  const std::int32_t floors_sum[] = {4, 2};
  require_error(select_topk_flat(par, ws, scores, lens, 5, floors_sum, cu.data(), pos.data()), errc::invalid_argument,
                "the floors add up to 6, more than total = 5");
  require_error(select_topk_flat(seq, ws, scores, lens, 5, nullptr, nullptr, pos.data()), errc::null_pointer,
                "kept_cu is null");
  const std::int32_t bad_lens[] = {6, 7};
  require_error(select_topk_flat(seq, ws, scores, bad_lens, 5, nullptr, cu.data(), pos.data()), errc::out_of_range,
                "row_lengths[1] = 7");
  require_error(select_topk_flat(seq, ws, scores, lens, 5, nullptr, cu.data(), reinterpret_cast<pos_t*>(sc.data())),
                errc::overlap, "kept_pos and scores overlap");
  require_error(select_topk_flat(seq, ws, scores, lens, 5, nullptr, reinterpret_cast<std::int32_t*>(pos.data()), pos.data() + 1),
                errc::overlap, "kept_pos and kept_cu overlap");
  std::vector<std::int32_t> lens_cu = {6, 2, 0, 0, 0};
  require_error(select_topk_flat(seq, ws, scores, lens_cu.data(), 5, nullptr, lens_cu.data() + 1, nullptr),
                errc::overlap, "kept_cu and row_lengths overlap");
  workspace ws_on_pos{pos.data(), 1 << 16};
  require_error(select_topk_flat(seq, ws_on_pos, scores, lens, 5, nullptr, cu.data(), pos.data()), errc::overlap,
                "the workspace and");
  CHECK(untouched());
  CHECK(std::all_of(cu.begin(), cu.end(), [](std::int32_t c) { return c == -1; }));
}

TEST_CASE("select_topk: empty shapes are valid") {
  std::vector<unsigned char> mem;
  float dummy = 0.f;
  pos_t out = -1;
  auto none = value_of(make_matrix_view(&dummy, 0, 0));
  auto kept0 = value_of(make_matrix_view(&out, 0, 3));
  CHECK(with_workspace([&](workspace& ws) { return select_topk(par, ws, none, nullptr, kept0); }, mem).ok());
  auto empty_rows = value_of(make_matrix_view(&dummy, 4, 0));
  auto kept_k0 = value_of(make_matrix_view(&out, 4, 0));
  CHECK(with_workspace([&](workspace& ws) { return select_topk(seq, ws, empty_rows, nullptr, kept_k0); }, mem).ok());
  std::int32_t cu[5] = {-1, -1, -1, -1, -1};
  CHECK(with_workspace([&](workspace& ws) { return select_topk_flat(par, ws, empty_rows, nullptr, 0, nullptr, cu, nullptr); }, mem).ok());
  CHECK(cu[4] == 0);
  CHECK(out == -1);
}

// ---- misaligned workspaces ----------------------------------------------------------------------

TEST_CASE("select: a workspace at any base alignment gives bit-identical results (seq, par)") {
  auto g = kvtest::rng(2126);
  const index_t R = 5, T = 700, k = 37;
  const auto sc = kvtest::random_floats(g, static_cast<std::size_t>(R * T));
  const auto scores = value_of(make_matrix_view(sc.data(), R, T));
  std::vector<std::int32_t> lens = {700, 0, 37, 512, 699}, floors = {3, 0, 5, 10, 0};
  std::vector<std::int32_t> cu(R + 1);
  for (index_t r = 0; r < R; ++r) cu[r + 1] = cu[r] + std::min<std::int32_t>(lens[r], 20);
  const auto run_all = [&](auto be) {
    std::vector<pos_t> dense(static_cast<std::size_t>(R * k));
    kvtest::check_workspace_shifts(
        [&](workspace& ws) { return select_topk(be, ws, scores, nullptr, value_of(make_matrix_view(dense.data(), R, k))); },
        [&] { return dense; });
    std::vector<pos_t> ragged(static_cast<std::size_t>(cu.back()));
    kvtest::check_workspace_shifts(
        [&](workspace& ws) {
          return select_topk(be, ws, scores, lens.data(), ragged_positions_out{ragged.data(), cu.data(), R});
        },
        [&] { return ragged; });
    const index_t total = 300;
    std::vector<std::int32_t> kcu(R + 1);
    std::vector<pos_t> kpos(total);
    kvtest::check_workspace_shifts(
        [&](workspace& ws) {
          return select_topk_flat(be, ws, scores, lens.data(), total, floors.data(), kcu.data(), kpos.data());
        },
        [&] { return kvtest::bytes_of(kcu, kpos); });
    return kvtest::bytes_of(dense, ragged, kcu, kpos);
  };
  CHECK(run_all(seq) == run_all(par_t{3}));
}
