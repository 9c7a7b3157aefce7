#include "support.hpp"

#include <kvevict/pool.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

using namespace kvevict;
using kvtest::require_error;
using kvtest::value_of;
using namespace kvtest::floats;

namespace {

const float sentinel = -12345.f;

// Naive reference for position i of a row of n values: every in-range position of the window.
float ref_max(const std::vector<float>& x, index_t n, index_t i, index_t kernel) {
  const index_t r = kernel / 2;
  float best = x[i];
  for (index_t j = std::max<index_t>(0, i - r); j <= std::min(n - 1, i + r); ++j)
    if (ranks_above(x[j], best)) best = x[j];
  return best;
}

// avg in double: {value, sum of |terms|, divisor}
struct avg_ref {
  double value, abs_sum, divisor, sum;
  bool nan, pos_inf, neg_inf;
};
avg_ref ref_avg(const std::vector<float>& x, index_t n, index_t i, index_t kernel, avg_divisor div) {
  const index_t r = kernel / 2;
  double s = 0, a = 0;
  index_t count = 0;
  bool nan = false, pinf = false, ninf = false;
  for (index_t j = std::max<index_t>(0, i - r); j <= std::min(n - 1, i + r); ++j, ++count) {
    const float v = x[j];
    if (std::isnan(v)) nan = true;
    else if (v == inf) pinf = true;
    else if (v == -inf) ninf = true;
    else {
      s += v;
      a += std::fabs(v);
    }
  }
  const double d = div == avg_divisor::kernel ? static_cast<double>(kernel) : static_cast<double>(count);
  return {s / d, a / d, d, s, nan || (pinf && ninf), pinf && !ninf && !nan, ninf && !pinf && !nan};
}

float random_score(std::mt19937_64& g, bool specials, bool integers) {
  if (specials) {
    switch (kvtest::uniform_int(g, 0, 24)) {
      case 0: return qnan;
      case 1: return inf;
      case 2: return -inf;
      case 3: return -0.f;
      case 4: return -qnan;
      case 5: {
        const std::uint32_t payloads[] = {0x7fa00001u, 0xffc00010u, 0x7f800001u, 0xffffffffu};
        float f;
        std::memcpy(&f, &payloads[kvtest::uniform_int(g, 0, 3)], sizeof f);
        return f;
      }
      default: break;
    }
  }
  if (integers) return static_cast<float>(kvtest::uniform_int(g, -50, 50));
  return kvtest::random_floats(g, 1, -1e3f, 1e3f)[0];
}

struct matrix {
  std::vector<float> buf;
  matrix_view<float> view;
  matrix(index_t rows, index_t cols, bool column_major, index_t pad, float fill) {
    buf.assign(static_cast<std::size_t>(std::max<index_t>(1, rows * cols + (rows + cols) * pad + pad)), fill);
    const index_t ext[2] = {rows, cols};
    const index_t str_rm[2] = {std::max<index_t>(1, cols + pad), 1};
    const index_t str_cm[2] = {1, std::max<index_t>(1, rows + pad)};
    view = value_of(detail::make_strided<float, 2>("test", buf.data(), ext, column_major ? str_cm : str_rm));
  }
};

index_t random_kernel(std::mt19937_64& g, index_t T) {
  switch (kvtest::uniform_int(g, 0, 5)) {
    case 0: return 1;
    case 1: return 7;
    case 2: return 2 * kvtest::uniform_int(g, 0, T + 2) + 1;  // up to wider than the row
    case 3: return 1000000000001;                             // far wider than any row
    default: return 2 * kvtest::uniform_int(g, 0, 6) + 1;
  }
}

template <class Backend>
void matches_reference(Backend be, std::uint64_t seed) {
  auto g = kvtest::rng(seed);
  for (int trial = 0; trial < 150; ++trial) {
    const index_t R = kvtest::uniform_int(g, 1, 4), T = trial % 25 == 0 ? 0 : kvtest::uniform_int(g, 1, 90);
    const index_t kernel = random_kernel(g, T);
    const bool specials = trial % 3 == 0, integers = trial % 2 == 0, ragged = trial % 5 < 2;
    CAPTURE(seed);
    CAPTURE(trial);
    CAPTURE(kernel);
    matrix in(R, T, trial % 4 == 1, trial % 3, 0.f);
    std::vector<std::vector<float>> rows(static_cast<std::size_t>(R), std::vector<float>(static_cast<std::size_t>(T)));
    std::vector<std::int32_t> lens(static_cast<std::size_t>(R), static_cast<std::int32_t>(T));
    for (index_t r = 0; r < R; ++r) {
      if (ragged) lens[r] = static_cast<std::int32_t>(kvtest::uniform_int(g, 0, T));
      for (index_t t = 0; t < T; ++t) in.view(r, t) = rows[r][t] = random_score(g, specials, integers);
    }
    for (pool_kind kind : {pool_kind::none, pool_kind::max, pool_kind::avg})
      for (avg_divisor div : {avg_divisor::kernel, avg_divisor::valid}) {
        const std::string kind_name = pool_kind_name(kind);
        CAPTURE(kind_name);
        CAPTURE(static_cast<int>(div));
        matrix out(R, T, trial % 4 == 2, trial % 2, sentinel);
        REQUIRE(pool1d(be, in.view, out.view, kind, kernel, ragged ? lens.data() : nullptr, pool_options{div}).ok());
        for (index_t r = 0; r < R; ++r) {
          const index_t n = lens[r];
          for (index_t i = n; i < T; ++i) REQUIRE(out.view(r, i) == sentinel);  // padding is not written
          for (index_t i = 0; i < n; ++i) {
            CAPTURE(i);
            const float got = out.view(r, i);
            if (kind == pool_kind::none) {
              REQUIRE(bits(got) == bits(rows[r][i]));
            } else if (kind == pool_kind::max) {
              REQUIRE(bits(got) == bits(ref_max(rows[r], n, i, kernel)));
            } else {
              const avg_ref want = ref_avg(rows[r], n, i, kernel, div);
              if (want.nan) REQUIRE(std::isnan(got));
              else if (want.pos_inf) REQUIRE(got == inf);
              else if (want.neg_inf) REQUIRE(got == -inf);
              else if (integers)  // small integer sums are exact: one rounding, by the float divisor
                REQUIRE(got == static_cast<float>(want.sum) / static_cast<float>(want.divisor));
              else REQUIRE(std::fabs(static_cast<double>(got) - want.value) <= 1e-6 * want.abs_sum + 1e-30);
            }
          }
        }
      }
  }
}

}  // namespace

TEST_CASE("pool1d: random rows, kernels, lengths, layouts and special values match the naive reference") {
  matches_reference(seq, 1);
  matches_reference(par, 2);
  matches_reference(par_t{3}, 3);
}

TEST_CASE("pool1d: worked examples (PyTorch padding semantics)") {
  const std::vector<float> x = {1, 2, 3, 4, 5};
  std::vector<float> y(5);
  auto xv = value_of(make_matrix_view<const float>(x.data(), 1, 5));
  auto yv = value_of(make_matrix_view(y.data(), 1, 5));
  // F.avg_pool1d(x, 3, stride=1, padding=1): zero padding, divisor 3 (count_include_pad=True)
  REQUIRE(pool1d(seq, xv, yv, pool_kind::avg, 3).ok());
  CHECK(y == std::vector<float>{1, 2, 3, 4, 3});
  // count_include_pad=False: divide by the in-range count at the borders
  REQUIRE(pool1d(seq, xv, yv, pool_kind::avg, 3, nullptr, {avg_divisor::valid}).ok());
  CHECK(y == std::vector<float>{1.5f, 2, 3, 4, 4.5f});
  // F.max_pool1d(x, 3, stride=1, padding=1)
  REQUIRE(pool1d(seq, xv, yv, pool_kind::max, 3).ok());
  CHECK(y == std::vector<float>{2, 3, 4, 5, 5});
  // max pads with -inf, not with zeros: negative rows stay negative at the borders
  const std::vector<float> neg = {-5, -3, -9};
  std::vector<float> z(3);
  REQUIRE(pool1d(seq, value_of(make_matrix_view<const float>(neg.data(), 1, 3)), value_of(make_matrix_view(z.data(), 1, 3)),
                 pool_kind::max, 3)
              .ok());
  CHECK(z == std::vector<float>{-3, -3, -3});
  // kernel 5 on 5 values: avg of the whole row, / 5 in the middle
  REQUIRE(pool1d(seq, xv, yv, pool_kind::avg, 5).ok());
  CHECK(y == std::vector<float>{6.f / 5, 10.f / 5, 15.f / 5, 14.f / 5, 12.f / 5});
  // kernel 1 is the identity for every kind
  for (pool_kind k : {pool_kind::none, pool_kind::max, pool_kind::avg}) {
    REQUIRE(pool1d(seq, xv, yv, k, 1).ok());
    CHECK(y == x);
  }
}

TEST_CASE("pool1d: NaN and infinities in windows") {
  const std::vector<float> x = {1, qnan, 3, qnan, qnan, qnan, -inf, 2, inf, -inf};
  std::vector<float> y(x.size());
  auto xv = value_of(make_matrix_view<const float>(x.data(), 1, 10));
  auto yv = value_of(make_matrix_view(y.data(), 1, 10));
  REQUIRE(pool1d(seq, xv, yv, pool_kind::max, 3).ok());
  CHECK(y[0] == 1.f);          // {1, NaN}: NaN ranks below every number
  CHECK(y[1] == 3.f);
  CHECK(y[3] == 3.f);
  CHECK(std::isnan(y[4]));     // {NaN, NaN, NaN}: NaN only when the whole window is NaN
  CHECK(y[5] == -inf);         // -inf beats NaN
  CHECK(y[6] == 2.f);
  CHECK(y[9] == inf);
  REQUIRE(pool1d(seq, xv, yv, pool_kind::avg, 3).ok());
  CHECK(y[0] != y[0]);         // NaN propagates through the sum
  CHECK(std::isnan(y[6]));     // NaN at position 5
  CHECK(std::isnan(y[8]));     // +inf + -inf
  CHECK(std::isnan(y[7]));     // {-inf, 2, +inf}
}

TEST_CASE("pool1d: an inf does not poison windows that do not contain it (no running-sum drift)") {
  std::vector<float> x(200, 0.25f), y(200);
  x[50] = inf;
  x[120] = 1e30f;  // a huge finite value: a running sum would lose every later small value
  REQUIRE(pool1d(seq, value_of(make_matrix_view<const float>(x.data(), 1, 200)), value_of(make_matrix_view(y.data(), 1, 200)),
                 pool_kind::avg, 5)
              .ok());
  for (index_t i = 0; i < 200; ++i) {
    CAPTURE(i);
    if (i >= 48 && i <= 52) CHECK(y[i] == inf);
    else if (i >= 118 && i <= 122) CHECK(y[i] == 1e30f / 5.f);
    else if (i >= 2 && i <= 197) CHECK(y[i] == 0.25f);
  }
}

TEST_CASE("pool1d: seq and par are bit-identical on random rows") {
  auto g = kvtest::rng(11);
  const index_t R = 8, T = 5000;
  const auto x = kvtest::random_floats(g, static_cast<std::size_t>(R * T));
  for (pool_kind kind : {pool_kind::max, pool_kind::avg})
    for (index_t kernel : {3, 7, 31, 12001}) {
      std::vector<float> a(x.size()), b(x.size());
      auto xv = value_of(make_matrix_view<const float>(x.data(), R, T));
      REQUIRE(pool1d(seq, xv, value_of(make_matrix_view(a.data(), R, T)), kind, kernel).ok());
      REQUIRE(pool1d(par, xv, value_of(make_matrix_view(b.data(), R, T)), kind, kernel).ok());
      CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
    }
}

TEST_CASE("pool1d: bad input gives specific errors and writes nothing") {
  std::vector<float> in(2 * 6, 1.f), out(2 * 6, 0.f);
  auto iv = value_of(make_matrix_view<const float>(in.data(), 2, 6));
  auto ov = value_of(make_matrix_view(out.data(), 2, 6));
  require_error(pool1d(seq, iv, ov, pool_kind::max, 4), errc::invalid_argument, "pool1d: kernel = 4 is even");
  require_error(pool1d(seq, iv, ov, pool_kind::none, 0), errc::invalid_argument, "kernel = 0 must be odd and >= 1");
  require_error(pool1d(seq, iv, ov, pool_kind::avg, -3), errc::invalid_argument, "kernel = -3 must be odd");
  require_error(pool1d(seq, iv, ov, static_cast<pool_kind>(9), 3), errc::invalid_argument,
                "kind = 9 is not a pool_kind");
  require_error(pool1d(seq, iv, ov, pool_kind::avg, 3, nullptr, {static_cast<avg_divisor>(5)}),
                errc::invalid_argument, "options.divisor = 5 is not an avg_divisor");
  require_error(pool1d(seq, iv, value_of(make_matrix_view(out.data(), 2, 5)), pool_kind::max, 3),
                errc::shape_mismatch, "in is [2][6] but out is [2][5]");
  require_error(pool1d(seq, iv, value_of(make_matrix_view(out.data(), 1, 6)), pool_kind::max, 3),
                errc::shape_mismatch, "but out is [1][6]");
  const std::int32_t too_long[] = {6, 7}, negative[] = {-1, 2};
  require_error(pool1d(seq, iv, ov, pool_kind::max, 3, too_long), errc::out_of_range,
                "row_lengths[1] = 7 is outside [0, 6]");
  require_error(pool1d(par, iv, ov, pool_kind::max, 3, negative), errc::out_of_range, "row_lengths[0] = -1");
  CHECK(std::all_of(out.begin(), out.end(), [](float x) { return x == 0.f; }));

  // in place and partial overlap are refused; so are lengths stored inside out
  require_error(pool1d(seq, iv, value_of(make_matrix_view(in.data(), 2, 6)), pool_kind::max, 3), errc::overlap,
                "cannot run in place");
  require_error(pool1d(seq, value_of(make_matrix_view<const float>(in.data(), 1, 6)),
                       value_of(make_matrix_view(in.data() + 5, 1, 6)), pool_kind::none, 1),
                errc::overlap, "in and out overlap");
  std::vector<float> with_lengths(2 * 6 + 2, 0.f);
  const std::int32_t three[2] = {3, 3};
  std::memcpy(with_lengths.data() + 12, three, sizeof three);
  const auto* lens_inside = reinterpret_cast<const std::int32_t*>(with_lengths.data() + 12);
  require_error(pool1d(seq, iv, value_of(make_matrix_view(with_lengths.data(), 2, 6, 7)), pool_kind::max, 3, lens_inside),
                errc::overlap, "row_lengths lie inside out");

  using exts = cuda::std::dextents<index_t, 2>;
  matrix_view<float> null_out(nullptr, cuda::std::layout_stride::mapping<exts>(exts(2, 6), cuda::std::array<index_t, 2>{6, 1}));
  require_error(pool1d(seq, iv, null_out, pool_kind::max, 3), errc::null_pointer, "pool1d: out: data is null");
}

TEST_CASE("score order: total_order_key is an order-preserving bijection (the order of every max)") {
  auto g = kvtest::rng(99);
  std::vector<float> samples = {inf, -inf, 0.f, -0.f, qnan, -qnan, std::numeric_limits<float>::max(),
                                std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::denorm_min()};
  for (std::uint32_t u : {0x7f800001u, 0x7fffffffu, 0xff800001u, 0xffffffffu, 0x7fc00000u, 0xffc00000u}) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    samples.push_back(f);
  }
  for (int i = 0; i < 200000; ++i) {
    const std::uint32_t u = static_cast<std::uint32_t>(kvtest::uniform_int(g, 0, 0xffffffffLL));
    float f;
    std::memcpy(&f, &u, sizeof f);
    samples.push_back(f);
  }
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const float a = samples[i], b = samples[(i * 7919 + 13) % samples.size()];
    REQUIRE(bits(detail::total_order_from_key(detail::total_order_key(a))) == bits(a));
    REQUIRE(detail::total_order_greater(a, b) == ranks_above(a, b));
    REQUIRE(bits(detail::total_order_max(a, b)) == bits(ranks_above(b, a) ? b : a));
  }
  CHECK(detail::total_order_key(-inf) == 0x00fffffeu);  // exactly the 2^24 - 2 NaN patterns rank below -inf
  CHECK(detail::total_order_key(inf) == 0xffffffffu);
}

TEST_CASE("pool1d: the small-kernel direct path gives the two-pass algorithm's bits (max and avg)") {
  // pool_row takes the direct sliding window (detail/host/pool_host.hpp) for contiguous rows and
  // kernels 3..9; pool_row_impl is the O(T) two-pass algorithm whose summation order avg documents.
  auto g = kvtest::rng(77);
  for (int trial = 0; trial < 400; ++trial) {
    const index_t n = kvtest::uniform_int(g, 1, 140), kernel = 2 * kvtest::uniform_int(g, 0, 5) + 1;
    const bool specials = trial % 3 == 0, integers = trial % 4 == 1;
    CAPTURE(trial);
    CAPTURE(n);
    CAPTURE(kernel);
    std::vector<float> x(static_cast<std::size_t>(n));
    for (auto& v : x) v = random_score(g, specials, integers);
    if (trial % 7 == 0)  // huge terms: the association decides the rounding (and the overflow)
      for (auto& v : x) v = (kvtest::uniform_int(g, 0, 1) ? 1.f : -1.f) * std::ldexp(1.f + static_cast<float>(kvtest::uniform_int(g, 0, 1000)) / 1000.f, static_cast<int>(kvtest::uniform_int(g, 100, 127)));
    for (pool_kind kind : {pool_kind::max, pool_kind::avg})
      for (avg_divisor div : {avg_divisor::kernel, avg_divisor::valid}) {
        std::vector<float> fast(x.size(), sentinel), two_pass(x.size(), sentinel);
        detail::pool_row(kind, div, x.data(), 1, fast.data(), 1, n, kernel);
        if (kind == pool_kind::max) detail::pool_row_impl<detail::pool_max_traits>(div, x.data(), 1, two_pass.data(), 1, n, kernel);
        else detail::pool_row_impl<detail::pool_sum_traits>(div, x.data(), 1, two_pass.data(), 1, n, kernel);
        for (index_t i = 0; i < n; ++i) {
          CAPTURE(i);
          // a NaN sum's sign and payload follow the operand order of the additions, which the
          // compiler may swap (+ commutes): avg promises a NaN there, not which NaN
          const bool nan_avg = kind == pool_kind::avg && std::isnan(two_pass[i]);
          if (nan_avg) REQUIRE(std::isnan(fast[i]));
          else REQUIRE(bits(fast[i]) == bits(two_pass[i]));
          const float one = kind == pool_kind::max ? detail::pool_one<detail::pool_max_traits>(div, x.data(), n, kernel, i)
                                                   : detail::pool_one<detail::pool_sum_traits>(div, x.data(), n, kernel, i);
          if (nan_avg) REQUIRE(std::isnan(one));
          else REQUIRE(bits(one) == bits(two_pass[i]));
        }
      }
  }
}

#if defined(KVEVICT_POOL_FAST_PATH)
TEST_CASE("pool1d: every ISA copy of the small-kernel path equals the two-pass algorithm bit for bit") {
  // Each copy (baseline, AVX2, AVX-512F: those this CPU runs) called directly on the interior of
  // rows long enough for several 512-output chunks. Max takes the raw-bits path on chunks whose
  // inputs are all >= +0 (or +inf) and the key path on the others, so the rows are non-negative
  // scores with ties, +0, subnormals, FLT_MAX and +inf, some with one negative / -0 / NaN / -inf
  // put into one chunk, and some random with specials everywhere.
  using copy_fn = void (*)(bool, const float*, float*, index_t, index_t, float);
  struct copy {
    const char* name;
    copy_fn fn[4];  // kernels 3, 5, 7, 9
  };
  std::vector<copy> copies = {{"baseline",
                               {detail::pool_fast::interior_base<3>, detail::pool_fast::interior_base<5>,
                                detail::pool_fast::interior_base<7>, detail::pool_fast::interior_base<9>}}};
#  if KVEVICT_HOST_X86_DISPATCH
  if (host_isa_supported() >= host_isa::avx2)
    copies.push_back({"avx2",
                      {detail::pool_fast::interior_avx2<3>, detail::pool_fast::interior_avx2<5>,
                       detail::pool_fast::interior_avx2<7>, detail::pool_fast::interior_avx2<9>}});
  if (host_isa_supported() >= host_isa::avx512)
    copies.push_back({"avx512",
                      {detail::pool_fast::interior_avx512<3>, detail::pool_fast::interior_avx512<5>,
                       detail::pool_fast::interior_avx512<7>, detail::pool_fast::interior_avx512<9>}});
#  endif
  const float bad[] = {-1.5f, -0.f, qnan, -qnan, -inf, -std::numeric_limits<float>::denorm_min()};
  auto g = kvtest::rng(1818);
  for (int trial = 0; trial < 120; ++trial) {
    const index_t lens[] = {36, 37, 100, 511, 530, 1031, 1600};
    const index_t n = lens[trial % 7];
    const int ki = static_cast<int>(kvtest::uniform_int(g, 0, 3));
    const index_t kernel = 3 + 2 * ki, r = kernel / 2;
    const int kind = trial % 4;  // 0, 1: non-negative; 2: one bad value; 3: specials everywhere
    CAPTURE(trial);
    CAPTURE(n);
    CAPTURE(kernel);
    CAPTURE(kind);
    std::vector<float> x(static_cast<std::size_t>(n));
    for (auto& v : x) {
      if (kind == 3) {
        v = random_score(g, true, trial % 8 == 3);
        continue;
      }
      switch (kvtest::uniform_int(g, 0, 11)) {
        case 0: v = 0.f; break;
        case 1: v = std::numeric_limits<float>::denorm_min() * static_cast<float>(kvtest::uniform_int(g, 1, 3)); break;
        case 2: v = kind == 1 ? inf : std::numeric_limits<float>::max(); break;
        case 3: case 4: v = static_cast<float>(kvtest::uniform_int(g, 0, 3)); break;  // ties
        default: v = kvtest::random_floats(g, 1, 0.f, 1.f)[0];
      }
    }
    if (kind == 2) x[static_cast<std::size_t>(kvtest::uniform_int(g, 0, n - 1))] = bad[trial / 4 % 6];
    for (pool_kind pk : {pool_kind::max, pool_kind::avg}) {
      std::vector<float> ref(x.size(), sentinel);
      if (pk == pool_kind::max) detail::pool_row_impl<detail::pool_max_traits>(avg_divisor::kernel, x.data(), 1, ref.data(), 1, n, kernel);
      else detail::pool_row_impl<detail::pool_sum_traits>(avg_divisor::kernel, x.data(), 1, ref.data(), 1, n, kernel);
      for (const copy& c : copies) {
        CAPTURE(c.name);
        CAPTURE(pk == pool_kind::max);
        std::vector<float> y(x.size(), sentinel);
        c.fn[ki](pk == pool_kind::max, x.data(), y.data() + r, r, n - r, static_cast<float>(kernel));
        for (index_t i = 0; i < n; ++i) {
          CAPTURE(i);
          if (i < r || i >= n - r) REQUIRE(bits(y[i]) == bits(sentinel));  // outside the interior: untouched
          else if (pk == pool_kind::avg && std::isnan(ref[i])) REQUIRE(std::isnan(y[i]));
          else REQUIRE(bits(y[i]) == bits(ref[i]));
        }
      }
    }
  }
}

TEST_CASE("pool1d: the max pooling of a group's rows summed in registers equals pooling each row and summing") {
  // detail::pool_fast_group_sum with max (the AVX-512F copy; elsewhere it declines) against the two-pass max
  // pooling of each row and the fp32 sum in row order (gqa_reduce's), on interior ranges of every
  // length (the 64- and 16-output loops and the one-by-one end); scores with zeros, ties, subnormals
  // and +inf, and on every third trial one negative, -0, NaN or -inf: then it must decline.
  const float bad[] = {-1.5f, -0.f, qnan, -inf};
  auto g = kvtest::rng(1824);
  for (int trial = 0; trial < 150; ++trial) {
    const index_t rows = kvtest::uniform_int(g, 1, 6), n = kvtest::uniform_int(g, 40, 700);
    const index_t kernel = 2 * kvtest::uniform_int(g, 1, 4) + 1, r = kernel / 2, stride = n + kvtest::uniform_int(g, 0, 5);
    CAPTURE(trial);
    CAPTURE(rows);
    CAPTURE(n);
    CAPTURE(kernel);
    std::vector<float> x(static_cast<std::size_t>(rows * stride));
    for (auto& v : x) {
      switch (kvtest::uniform_int(g, 0, 9)) {
        case 0: v = 0.f; break;
        case 1: v = std::numeric_limits<float>::denorm_min() * static_cast<float>(kvtest::uniform_int(g, 1, 3)); break;
        case 2: v = trial % 2 ? inf : std::numeric_limits<float>::max() / 8.f; break;
        case 3: v = static_cast<float>(kvtest::uniform_int(g, 0, 3)); break;
        default: v = kvtest::random_floats(g, 1, 0.f, 1.f)[0];
      }
    }
    const index_t lo = kvtest::uniform_int(g, r, n - r - 1), hi = kvtest::uniform_int(g, lo + 1, n - r);
    const bool spoiled = trial % 3 == 2;
    if (spoiled) {  // inside some window of the range
      const index_t j = kvtest::uniform_int(g, 0, rows - 1), p = kvtest::uniform_int(g, lo - r, hi - 1 + r);
      x[static_cast<std::size_t>(j * stride + p)] = bad[trial % 4];
    }
    std::vector<float> pooled(static_cast<std::size_t>(n)), ref(static_cast<std::size_t>(hi - lo));
    for (index_t j = 0; j < rows; ++j) {
      detail::pool_row_impl<detail::pool_max_traits>(avg_divisor::kernel, x.data() + j * stride, 1, pooled.data(), 1, n, kernel);
      for (index_t i = lo; i < hi; ++i) {
        float& o = ref[static_cast<std::size_t>(i - lo)];
        o = j == 0 ? pooled[static_cast<std::size_t>(i)] : o + pooled[static_cast<std::size_t>(i)];
      }
    }
    std::vector<float> y(static_cast<std::size_t>(hi - lo), sentinel);
    const bool done = detail::pool_fast_group_sum(true, x.data(), stride, rows, y.data(), kernel, lo, hi);
#  if KVEVICT_HOST_X86_DISPATCH
    const bool runs = detail::isa_x86::host_isa_runs(host_isa::avx512);
#  else
    const bool runs = false;
#  endif
    REQUIRE(done == (runs && !spoiled));
    if (done)
      for (index_t i = lo; i < hi; ++i) {
        CAPTURE(i);
        REQUIRE(bits(y[static_cast<std::size_t>(i - lo)]) == bits(ref[static_cast<std::size_t>(i - lo)]));
      }
  }
}

TEST_CASE("pool1d: the average pooling (k = 5) of a group's rows summed in registers equals pooling each row and "
          "summing") {
  // detail::pool_fast_group_sum with avg (the AVX-512F copy, k = 5, ranges of whole 80-output groups from
  // a block start; elsewhere it declines) against the two-pass average pooling of each row and the fp32
  // sum in row order (gqa_reduce's); scores of any sign with zeros, -0, subnormals, huge values, +-inf
  // and NaN (no input makes it decline); every fourth trial a range it must decline (not a block start,
  // not whole groups, or another kernel).
  auto g = kvtest::rng(1825);
  for (int trial = 0; trial < 120; ++trial) {
    const index_t rows = kvtest::uniform_int(g, 1, 6), n = kvtest::uniform_int(g, 100, 1400);
    const index_t stride = n + kvtest::uniform_int(g, 0, 5);
    const bool aligned = trial % 4 != 3;
    const index_t kernel = aligned || trial % 8 == 3 ? 5 : 2 * kvtest::uniform_int(g, 1, 4) + 1, r = kernel / 2;
    std::vector<float> x(static_cast<std::size_t>(rows * stride));
    for (auto& v : x) {
      switch (kvtest::uniform_int(g, 0, 19)) {
        case 0: v = 0.f; break;
        case 1: v = -0.f; break;
        case 2: v = std::numeric_limits<float>::denorm_min() * static_cast<float>(kvtest::uniform_int(g, -3, 3)); break;
        case 3: v = std::numeric_limits<float>::max() / static_cast<float>(kvtest::uniform_int(g, 1, 3)); break;
        case 4: v = trial % 5 == 0 ? -inf : trial % 5 == 1 ? inf : trial % 5 == 2 ? qnan : 1.f; break;
        default: v = kvtest::random_floats(g, 1, -2.f, 2.f)[0];
      }
    }
    // a block start in the interior and whole groups of 80 (or, to decline, a range that is not)
    index_t lo = (kvtest::uniform_int(g, r, n / 2) + 4) / 5 * 5;
    const index_t groups = (n - r - lo) / 80;
    if (groups < 1) continue;
    index_t hi = lo + 80 * kvtest::uniform_int(g, 1, groups);
    if (!aligned && kernel == 5) {
      if (trial % 16 == 3) ++lo;
      else hi -= kvtest::uniform_int(g, 1, 79);
    }
    CAPTURE(trial);
    CAPTURE(rows);
    CAPTURE(n);
    CAPTURE(kernel);
    CAPTURE(lo);
    CAPTURE(hi);
    std::vector<float> pooled(static_cast<std::size_t>(n)), ref(static_cast<std::size_t>(hi - lo));
    for (index_t j = 0; j < rows; ++j) {
      detail::pool_row_impl<detail::pool_sum_traits>(avg_divisor::kernel, x.data() + j * stride, 1, pooled.data(), 1, n,
                                                     kernel);
      for (index_t i = lo; i < hi; ++i) {
        float& o = ref[static_cast<std::size_t>(i - lo)];
        o = j == 0 ? pooled[static_cast<std::size_t>(i)] : o + pooled[static_cast<std::size_t>(i)];
      }
    }
    std::vector<float> y(static_cast<std::size_t>(hi - lo), sentinel);
    const bool done = detail::pool_fast_group_sum(false, x.data(), stride, rows, y.data(), kernel, lo, hi);
#  if KVEVICT_HOST_X86_DISPATCH
    const bool runs = detail::isa_x86::host_isa_runs(host_isa::avx512);
#  else
    const bool runs = false;
#  endif
    REQUIRE(done == (runs && aligned));
    if (done)
      for (index_t i = lo; i < hi; ++i) {
        CAPTURE(i);
        const float a = y[static_cast<std::size_t>(i - lo)], b = ref[static_cast<std::size_t>(i - lo)];
        REQUIRE(((std::isnan(a) && std::isnan(b)) || bits(a) == bits(b)));
      }
  }
}
#endif
