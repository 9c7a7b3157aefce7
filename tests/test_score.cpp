// attention_scores and friends against a naive double-precision reference that materialises the
// whole attention matrix; the softmax statistics helpers; special values; every documented error.
#include "support.hpp"

#include <kvevict/numeric.hpp>
#include <kvevict/score.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

using namespace kvevict;
using kvtest::require_error;
using kvtest::value_of;

namespace {

constexpr double u32 = 5.9604644775390625e-08;  // 2^-24, fp32 unit roundoff

template <class T>
T from_f(float f) {
  if constexpr (std::is_same_v<T, float16>) return to_float16(f);
  else if constexpr (std::is_same_v<T, bfloat16>) return to_bfloat16(f);
  else return f;
}

// An owning [H][T][D] cache in one of four memory layouts: head-major, token-major, and both with
// padding after every row (so strides differ from the extents).
template <class T>
struct cache {
  std::vector<T> buf;
  kv_view<T> view;
  cache() = default;
  cache(index_t H, index_t Tn, index_t D, int layout, std::mt19937_64& g, float lo, float hi) {
    const index_t pad = layout >= 2 ? 3 : 0, row = D + pad;
    buf.assign(static_cast<std::size_t>(std::max<index_t>(1, H * Tn * row)), from_f<T>(0.f));
    const auto vals = kvtest::random_floats(g, buf.size(), lo, hi);
    for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = from_f<T>(vals[i]);
    view = layout % 2 == 0 ? value_of(make_kv_view(buf.data(), H, Tn, D, std::max<index_t>(1, Tn * row), row))
                           : value_of(make_kv_view(buf.data(), H, Tn, D, row, std::max<index_t>(1, H * row)));
  }
  void set(index_t h, index_t t, index_t d, float x) { view(h, t, d) = from_f<T>(x); }
};

struct reference {
  std::vector<double> val, mag;  // [H_q][oc]; mag: the column's magnitude for the tolerance
  double rel = 0;                // relative error bound of one probability (see tolerance())
};

// The reference: full attention matrix per query head in double, then the column reduction.
// `block` may be empty (0 tokens).
template <class QE, class KE>
reference naive_scores(const kv_view<const QE>& q, const kv_view<const KE>& prefix, const kv_view<const KE>& block,
                       index_t oc, const score_options& opt) {
  const index_t hq = q.extent(0), w = q.extent(1), d = q.extent(2), hkv = prefix.extent(0), p = prefix.extent(1);
  const bool has_block = block.extent(1) > 0;
  const index_t cols = p + (has_block ? w : 0);
  const double scale =
      opt.scale == 0.f ? static_cast<double>(static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)))) : opt.scale;
  reference ref;
  ref.val.assign(static_cast<std::size_t>(hq * oc), 0.0);
  ref.mag.assign(ref.val.size(), 0.0);
  double dot_bound = 0;  // max_ij d * scale * sum_k |q_ik k_jk|: bounds the fp32 logit error / u
  for (index_t h = 0; h < hq; ++h) {
    const index_t g = h / (hq / hkv);
    std::vector<double> a(static_cast<std::size_t>(w * cols), 0.0);  // materialised [w][cols]
    for (index_t i = 0; i < w; ++i) {
      const index_t vis = p + (has_block ? i + 1 : 0);
      double m = -std::numeric_limits<double>::infinity();
      for (index_t j = 0; j < vis; ++j) {
        double s = 0, sa = 0;
        for (index_t k = 0; k < d; ++k) {
          const double x = to_float(q(h, i, k));
          const double y = j < p ? to_float(prefix(g, j, k)) : to_float(block(g, j - p, k));
          s += x * y;
          sa += std::fabs(x * y);
        }
        dot_bound = std::max(dot_bound, (static_cast<double>(d) + 2) * scale * sa);
        a[i * cols + j] = s * scale;
        m = std::max(m, s * scale);
      }
      double sum = 0;
      for (index_t j = 0; j < vis; ++j) sum += (a[i * cols + j] = std::exp(a[i * cols + j] - m));
      for (index_t j = 0; j < vis; ++j) a[i * cols + j] /= sum;
    }
    for (index_t j = 0; j < oc; ++j) {
      double s = 0, s2 = 0;
      for (index_t i = 0; i < w; ++i) {
        s += a[i * cols + j];
        s2 += a[i * cols + j] * a[i * cols + j];
      }
      const double mean = s / static_cast<double>(w);
      double m2 = 0;
      for (index_t i = 0; i < w; ++i) m2 += (a[i * cols + j] - mean) * (a[i * cols + j] - mean);
      const index_t seen = j < p ? w : w - (j - p);
      double v = 0, mg = 0;
      switch (opt.reduce) {
        case score_reduce::sum: v = mg = s; break;
        case score_reduce::mean: v = mg = mean; break;
        case score_reduce::mean_visible: v = mg = s / static_cast<double>(seen); break;
        case score_reduce::mean_plus_variance: {
          const double var = opt.variance == variance_estimator::biased ? m2 / static_cast<double>(w)
                             : w > 1                                    ? m2 / static_cast<double>(w - 1)
                                                                        : 0.0;
          v = mean + opt.gamma * var;
          mg = mean + 2.0 * opt.gamma * s2 / static_cast<double>(std::max<index_t>(1, w - 1));
          break;
        }
      }
      ref.val[static_cast<std::size_t>(h * oc + j)] = v;
      ref.mag[static_cast<std::size_t>(h * oc + j)] = mg;
    }
  }
  // Relative error bound of a computed probability: two logits' errors (each <= dot_bound * u), the
  // fp32 exp (<= 2u, measured below) and the row sum (<= (1024/8 + 8 + chunks) additions), plus the
  // reduction over w rows (w additions) and the final division: all first-order in u.
  const double chunks = static_cast<double>((cols + 1023) / 1024);
  ref.rel = u32 * (2 * dot_bound + 4 + (128 + 8 + chunks) + static_cast<double>(w) + 4);
  return ref;
}

double worst_seen = 0;  // largest |error| / tolerance over the run, printed at the end

// |got - ref| <= 2 * rel * magnitude (+ a few denormal-sized units): the factor 2 covers the
// second-order terms of the first-order bound.
void check_close(const std::vector<float>& got, index_t oc, index_t row_stride, const reference& ref, index_t hq) {
  double worst = 0;
  for (index_t h = 0; h < hq; ++h)
    for (index_t j = 0; j < oc; ++j) {
      const double g = got[static_cast<std::size_t>(h * row_stride + j)];
      const double r = ref.val[static_cast<std::size_t>(h * oc + j)];
      const double tol = 2 * ref.rel * ref.mag[static_cast<std::size_t>(h * oc + j)] + 1e-37;
      worst = std::max(worst, std::fabs(g - r) / (tol));
      if (!(std::fabs(g - r) <= tol)) {
        INFO("head ", h, " column ", j, ": got ", g, " reference ", r, " tolerance ", tol);
        REQUIRE(std::fabs(g - r) <= tol);
      }
    }
  CHECK(worst <= 1.0);
  worst_seen = std::max(worst_seen, worst);
}

struct arena {
  std::unique_ptr<unsigned char[]> mem;
  workspace ws;
};

// Runs a score call twice (size query, then work) with a workspace of exactly the queried size.
template <class F>
status run_with_workspace(F&& call) {
  workspace ws;
  status st = call(ws);
  if (st.ok()) {
    std::vector<unsigned char> mem;
    ws = kvtest::shifted_workspace(mem, ws.bytes);
    st = call(ws);
  }
  INFO("status: ", st.message());
  CHECK(st.ok());
  return st;
}

template <class QE, class KE>
void random_trials(std::uint64_t seed, int trials) {
  auto g = kvtest::rng(seed);
  const index_t ratios[] = {1, 2, 4, 8};
  for (int trial = 0; trial < trials; ++trial) {
    CAPTURE(seed);
    CAPTURE(trial);
    const index_t hkv = kvtest::uniform_int(g, 1, 3), ratio = ratios[kvtest::uniform_int(g, 0, 3)], hq = hkv * ratio;
    const index_t w = kvtest::uniform_int(g, 0, 4) == 0 ? 1 : kvtest::uniform_int(g, 1, 64);
    const index_t d = kvtest::uniform_int(g, 0, 3) == 0 ? kvtest::uniform_int(g, 1, 9) : kvtest::uniform_int(g, 10, 160);
    // keep the O(H_q w P d) reference affordable while covering P up to ~2000
    const index_t pmax = std::max<index_t>(8, 40'000'000 / (hq * w * d + 1));
    const index_t p = kvtest::uniform_int(g, 0, 5) == 0 ? 0 : kvtest::uniform_int(g, 1, std::min<index_t>(2100, pmax));
    const bool has_block = kvtest::uniform_int(g, 0, 3) != 0 || p == 0;
    const bool all_cols = has_block && kvtest::uniform_int(g, 0, 1) == 1;
    score_options opt;
    opt.reduce = static_cast<score_reduce>(kvtest::uniform_int(g, 0, 3));
    opt.variance = static_cast<variance_estimator>(kvtest::uniform_int(g, 0, 1));
    if (kvtest::uniform_int(g, 0, 2) == 0) opt.gamma = static_cast<float>(kvtest::uniform_int(g, 0, 50));
    if (kvtest::uniform_int(g, 0, 3) == 0) opt.scale = 0.05f * static_cast<float>(kvtest::uniform_int(g, 1, 20));
    opt.fused_multiply_add = kvtest::uniform_int(g, 0, 3) == 0;
    const float amp = kvtest::uniform_int(g, 0, 2) == 0 ? 3.0f : 1.0f;  // sometimes peaky attention
    CAPTURE(hq);
    CAPTURE(hkv);
    CAPTURE(w);
    CAPTURE(p);
    CAPTURE(d);
    CAPTURE(has_block);
    CAPTURE(all_cols);
    CAPTURE(static_cast<int>(opt.reduce));
    cache<QE> q(hq, w, d, static_cast<int>(kvtest::uniform_int(g, 0, 3)), g, -amp, amp);
    // prefix and block keys are the two halves of one cache, as in a SnapKV window
    cache<KE> keys(hkv, p + w, d, static_cast<int>(kvtest::uniform_int(g, 0, 3)), g, -amp, amp);
    const auto split = value_of(split_window(keys.view, w));
    kv_view<KE> block = has_block ? split.window : kv_view<KE>{};
    const index_t oc = all_cols ? p + w : p;
    const index_t ostride = oc + kvtest::uniform_int(g, 0, 2);
    std::vector<float> out_seq(static_cast<std::size_t>(std::max<index_t>(1, hq * ostride)), -7.f);
    auto out_par = out_seq, out_par3 = out_seq;
    auto ov = [&](std::vector<float>& o) { return value_of(make_matrix_view(o.data(), hq, oc, std::max<index_t>(1, ostride))); };
    REQUIRE(run_with_workspace([&](workspace& ws) {
              return attention_scores(seq, ws, q.view, split.prefix, block, ov(out_seq), opt);
            }).ok());
    REQUIRE(run_with_workspace([&](workspace& ws) {
              return attention_scores(par, ws, q.view, split.prefix, block, ov(out_par), opt);
            }).ok());
    REQUIRE(run_with_workspace([&](workspace& ws) {
              return attention_scores(par_t{3}, ws, q.view, split.prefix, block, ov(out_par3), opt);
            }).ok());
    // identical bits on every backend and thread count
    REQUIRE(std::memcmp(out_seq.data(), out_par.data(), out_seq.size() * sizeof(float)) == 0);
    REQUIRE(std::memcmp(out_seq.data(), out_par3.data(), out_seq.size() * sizeof(float)) == 0);
    const auto ref = naive_scores(kv_view<const QE>(q.view), kv_view<const KE>(split.prefix),
                                  kv_view<const KE>(block), oc, opt);
    check_close(out_seq, oc, ostride, ref, hq);
    // padding between rows is never written
    for (index_t h = 0; h < hq; ++h)
      for (index_t j = oc; j < ostride; ++j) REQUIRE(out_seq[static_cast<std::size_t>(h * ostride + j)] == -7.f);
  }
}

}  // namespace

TEST_CASE("softmax_exp: within 2 ulp of exp over the whole float range, exact special values") {
  double worst_ulp = 0;
  // every 997th float bit pattern in [-104, 89] (about 2 million values, both signs)
  for (std::uint32_t b = 0; b < 0xff800000u; b += 997) {
    const float x = detail::bits_float(b);
    if (!(std::fabs(x) <= 104.f)) continue;
    const float got = detail::softmax_exp(x);
    const double want = std::exp(static_cast<double>(x));
    if (want < 1.1754943508222875e-38 || want > 3.4028234663852886e38) continue;  // subnormal / overflow checked below
    const double ulp = std::ldexp(1.0, std::ilogb(want) - 23);
    worst_ulp = std::max(worst_ulp, std::fabs(got - want) / ulp);
  }
  INFO("worst error ", worst_ulp, " ulp");
  CHECK(worst_ulp <= 2.0);
  CHECK(detail::softmax_exp(0.f) == 1.f);
  CHECK(detail::softmax_exp(-std::numeric_limits<float>::infinity()) == 0.f);
  CHECK(detail::softmax_exp(-200.f) == 0.f);
  CHECK(detail::softmax_exp(std::numeric_limits<float>::infinity()) == std::numeric_limits<float>::infinity());
  CHECK(detail::softmax_exp(89.f) == std::numeric_limits<float>::infinity());
  CHECK(std::isfinite(detail::softmax_exp(88.72f)));
  CHECK(std::isnan(detail::softmax_exp(std::numeric_limits<float>::quiet_NaN())));
  CHECK(std::isnan(detail::softmax_exp(-std::numeric_limits<float>::quiet_NaN())));
  // subnormal results: close to the true value in absolute terms
  for (float x = -103.9f; x < -87.4f; x += 0.37f)
    CHECK(std::fabs(detail::softmax_exp(x) - std::exp(static_cast<double>(x))) <= 1.5e-45);
}

TEST_CASE("softmax_merge: associative within rounding, identity, -inf, +inf and NaN") {
  using detail::softmax_merge;
  using detail::softmax_stats;
  auto g = kvtest::rng(42);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (int trial = 0; trial < 500; ++trial) {
    const std::size_t n = static_cast<std::size_t>(kvtest::uniform_int(g, 1, 300));
    const auto x = kvtest::random_floats(g, n, -30.f, 30.f);
    double m = -1e300, s = 0;
    for (float v : x) m = std::max(m, static_cast<double>(v));
    for (float v : x) s += std::exp(v - m);
    // fold one by one, and merge random splits in a tree: both equal the double result
    softmax_stats a = detail::softmax_empty();
    for (float v : x) a = detail::softmax_push(a, v);
    const std::size_t cut1 = static_cast<std::size_t>(kvtest::uniform_int(g, 0, static_cast<std::int64_t>(n)));
    const std::size_t cut2 = static_cast<std::size_t>(kvtest::uniform_int(g, static_cast<std::int64_t>(cut1), static_cast<std::int64_t>(n)));
    softmax_stats p1 = detail::softmax_empty(), p2 = p1, p3 = p1;
    for (std::size_t i = 0; i < n; ++i) {
      softmax_stats& dst = i < cut1 ? p1 : i < cut2 ? p2 : p3;
      dst = detail::softmax_push(dst, x[i]);
    }
    const softmax_stats left = softmax_merge(softmax_merge(p1, p2), p3);
    const softmax_stats right = softmax_merge(p1, softmax_merge(p2, p3));
    const softmax_stats swapped = softmax_merge(p3, softmax_merge(p2, p1));
    for (const softmax_stats& r : {a, left, right, swapped}) {
      CHECK(r.max == static_cast<float>(m));
      CHECK(std::fabs(r.sum - s) <= 1e-5 * s);
    }
  }
  const softmax_stats e = detail::softmax_empty(), one{2.5f, 3.f};
  CHECK(softmax_merge(e, one).max == 2.5f);
  CHECK(softmax_merge(e, one).sum == 3.f);  // exact: the empty side adds 0 * e^-inf
  CHECK(softmax_merge(one, e).sum == 3.f);
  CHECK(softmax_merge(e, e).max == -inf);
  CHECK(softmax_merge(e, e).sum == 0.f);
  CHECK(detail::softmax_push(e, -inf).sum == 0.f);  // a -inf logit is masked
  CHECK(std::isnan(softmax_merge(softmax_stats{nan, 1.f}, one).max));
  CHECK(std::isnan(softmax_merge(one, softmax_stats{nan, nan}).sum));
  CHECK(std::isnan(softmax_merge(softmax_stats{inf, 1.f}, softmax_stats{inf, 1.f}).sum));  // inf - inf
  CHECK(softmax_merge(softmax_stats{inf, 1.f}, one).max == inf);
  // probabilities
  CHECK(detail::softmax_prob(softmax_stats{1.f, 2.f}, 1.f) == 0.5f);
  CHECK_FALSE(std::isfinite(detail::softmax_prob(e, 0.f)));  // empty row: not a probability
  // the NaN-propagating max keeps a NaN once seen
  CHECK(std::isnan(detail::max_nan(detail::max_nan(1.f, nan), 5.f)));
}

TEST_CASE("attention_scores: random shapes, layouts, reductions and backends match the double reference (fp32)") {
  random_trials<float, float>(100, 60);
}

TEST_CASE("attention_scores: fp16 and bf16 inputs (exactly widened) match the double reference") {
  random_trials<float16, float16>(200, 25);
  random_trials<bfloat16, bfloat16>(300, 25);
  random_trials<float, bfloat16>(400, 15);
  MESSAGE("largest error / tolerance over the randomized trials: ", worst_seen);
}

namespace {
// Runs f(ws) with an exactly-sized workspace and returns out.
template <class F>
void run_ok(F&& f) {
  REQUIRE(run_with_workspace(f).ok());
}
}  // namespace

TEST_CASE("widening: the branch-free fp16/bf16 conversions equal to_float on every bit pattern") {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const float16 h{static_cast<std::uint16_t>(b)};
    const float a = to_float(h), w = detail::widen_f16_bits(b);
    if (std::isnan(a)) REQUIRE(std::isnan(w));
    else REQUIRE(std::memcmp(&a, &w, sizeof a) == 0);
    const bfloat16 bb{static_cast<std::uint16_t>(b)};
    const float c = to_float(bb), x = detail::widen_bf16_bits(b);
    REQUIRE(std::memcmp(&c, &x, sizeof c) == 0);
  }
}

TEST_CASE("split_window: prefix and window are sub-views of the same memory, any layout") {
  auto g = kvtest::rng(7);
  for (int layout = 0; layout < 4; ++layout) {
    cache<float> k(3, 10, 5, layout, g, -1.f, 1.f);
    for (index_t w : {0, 1, 4, 10}) {
      const auto s = value_of(split_window(k.view, w));
      REQUIRE(s.prefix.extent(1) == 10 - w);
      REQUIRE(s.window.extent(1) == w);
      for (index_t h = 0; h < 3; ++h)
        for (index_t t = 0; t < 10; ++t)
          for (index_t d = 0; d < 5; ++d) {
            const float* want = &k.view(h, t, d);
            const float* got = t < 10 - w ? &s.prefix(h, t, d) : &s.window(h, t - (10 - w), d);
            REQUIRE(got == want);
          }
    }
    require_error(split_window(k.view, 11).error(), errc::invalid_argument, "window w = 11 is outside [0, 10]");
    require_error(split_window(k.view, -1).error(), errc::invalid_argument, "window w = -1");
  }
}

TEST_CASE("window_scores, tova_scores, h2o_scores: the documented compositions of attention_scores") {
  auto g = kvtest::rng(9);
  for (int trial = 0; trial < 12; ++trial) {
    CAPTURE(trial);
    const index_t hkv = kvtest::uniform_int(g, 1, 2), hq = hkv * kvtest::uniform_int(g, 1, 4);
    const index_t tn = kvtest::uniform_int(g, 1, 300), d = kvtest::uniform_int(g, 1, 70);
    const index_t w = kvtest::uniform_int(g, 1, std::min<index_t>(tn, 40));
    cache<float16> q(hq, tn, d, trial % 4, g, -2.f, 2.f);
    cache<float16> k(hkv, tn, d, (trial + 1) % 4, g, -2.f, 2.f);
    const auto qs = value_of(split_window(q.view, w));
    const auto ks = value_of(split_window(k.view, w));
    // window_scores == attention_scores(window queries, prefix keys, window keys); both column counts
    for (const bool all : {false, true}) {
      const index_t oc = all ? tn : tn - w;
      std::vector<float> a(static_cast<std::size_t>(std::max<index_t>(1, hq * oc))), b = a;
      run_ok([&](workspace& ws) {
        return window_scores(seq, ws, qs.window, k.view, value_of(make_matrix_view(a.data(), hq, oc)));
      });
      run_ok([&](workspace& ws) {
        return attention_scores(par, ws, qs.window, ks.prefix, ks.window, value_of(make_matrix_view(b.data(), hq, oc)));
      });
      REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
      score_options mean;
      check_close(a, oc, oc, naive_scores(kv_view<const float16>(qs.window), kv_view<const float16>(ks.prefix),
                                          kv_view<const float16>(ks.window), oc, mean),
                  hq);
    }
    // TOVA: the last token's query, w = 1
    const auto last = value_of(split_window(q.view, 1));
    for (const index_t oc : {tn - 1, tn}) {
      std::vector<float> t(static_cast<std::size_t>(std::max<index_t>(1, hq * oc)));
      run_ok([&](workspace& ws) { return tova_scores(seq, ws, last.window, k.view, value_of(make_matrix_view(t.data(), hq, oc))); });
      const auto k1 = value_of(split_window(k.view, 1));
      score_options sum;
      sum.reduce = score_reduce::sum;
      check_close(t, oc, oc, naive_scores(kv_view<const float16>(last.window), kv_view<const float16>(k1.prefix),
                                          kv_view<const float16>(k1.window), oc, sum),
                  hq);
    }
    // H2O: the whole prompt as the block (P = 0), sum and normalised
    if (tn <= 120) {
      std::vector<float> hs(static_cast<std::size_t>(hq * tn)), hn = hs;
      for (const bool normalised : {false, true}) {
        std::vector<float>& h = normalised ? hn : hs;
        run_ok([&](workspace& ws) {
          return h2o_scores(par, ws, q.view, k.view, value_of(make_matrix_view(h.data(), hq, tn)), normalised);
        });
        const auto none = value_of(split_window(k.view, tn));
        score_options o;
        o.reduce = normalised ? score_reduce::mean_visible : score_reduce::sum;
        check_close(h, tn, tn,
                    naive_scores(kv_view<const float16>(q.view), kv_view<const float16>(none.prefix),
                                 kv_view<const float16>(k.view), tn, o),
                    hq);
      }
      // normalised H2O divides key j's sum by the T - j queries that see it
      for (index_t x = 0; x < hq; ++x)
        for (index_t j = 0; j < tn; ++j) {
          const std::size_t i = static_cast<std::size_t>(x * tn + j);
          REQUIRE(hn[i] == hs[i] / static_cast<float>(tn - j));
        }
    }
  }
}

TEST_CASE("attention_scores: special inputs") {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  auto g = kvtest::rng(5);
  SUBCASE("identical keys: every visible column gets exactly 1/visible per row") {
    const index_t p = 37, w = 5, d = 8;
    std::vector<float> q(2 * w * d), k((p + w) * d, 0.3f), out(2 * (p + w));
    for (auto& x : q) x = kvtest::random_floats(g, 1, -1.f, 1.f)[0];
    auto kv = value_of(make_kv_view(k.data(), 1, p + w, d));
    const auto s = value_of(split_window(kv, w));
    score_options sum;
    sum.reduce = score_reduce::sum;
    run_ok([&](workspace& ws) {
      return attention_scores(seq, ws, value_of(make_kv_view(q.data(), 2, w, d)), s.prefix, s.window,
                              value_of(make_matrix_view(out.data(), 2, p + w)), sum);
    });
    for (index_t h = 0; h < 2; ++h)
      for (index_t j = 0; j < p + w; ++j) {
        double want = 0;
        for (index_t i = 0; i < w; ++i)
          if (j < p + i + 1) want += 1.0 / static_cast<double>(p + i + 1);
        CHECK(out[static_cast<std::size_t>(h * (p + w) + j)] == doctest::Approx(want).epsilon(1e-6));
      }
  }
  SUBCASE("huge logits: max subtraction keeps everything finite and exact") {
    const index_t p = 300, w = 4, d = 16;
    cache<float> q(2, w, d, 0, g, -1.f, 1.f), k(1, p + w, d, 1, g, -1.f, 1.f);
    for (auto& x : q.buf) x *= 3000.f;  // logits ~ 1e6: e^logit overflows without max subtraction
    const auto s = value_of(split_window(k.view, w));
    std::vector<float> out(2 * p);
    run_ok([&](workspace& ws) {
      return attention_scores(par, ws, q.view, s.prefix, s.window, value_of(make_matrix_view(out.data(), 2, p)));
    });
    for (float x : out) REQUIRE(std::isfinite(x));
    check_close(out, p, p, naive_scores(kv_view<const float>(q.view), kv_view<const float>(s.prefix),
                                        kv_view<const float>(s.window), p, score_options{}),
                2);
  }
  SUBCASE("NaN in a query row poisons that head's columns only; NaN in a key poisons its GQA group") {
    const index_t p = 50, w = 3, d = 6;
    cache<float> q(4, w, d, 0, g, -1.f, 1.f), k(2, p + w, d, 0, g, -1.f, 1.f);
    const auto s = value_of(split_window(k.view, w));
    std::vector<float> out(4 * (p + w));
    auto run = [&] {
      run_ok([&](workspace& ws) {
        return attention_scores(seq, ws, q.view, s.prefix, s.window, value_of(make_matrix_view(out.data(), 4, p + w)));
      });
    };
    q.view(1, 2, 3) = nan;  // head 1, last row: sees every column
    run();
    for (index_t h = 0; h < 4; ++h)
      for (index_t j = 0; j < p + w; ++j) CHECK(std::isnan(out[static_cast<std::size_t>(h * (p + w) + j)]) == (h == 1));
    q.view(1, 2, 3) = 0.5f;
    q.view(2, 0, 0) = nan;  // head 2, first row: sees the prefix and block key 0 only
    run();
    for (index_t h = 0; h < 4; ++h)
      for (index_t j = 0; j < p + w; ++j)
        CHECK(std::isnan(out[static_cast<std::size_t>(h * (p + w) + j)]) == (h == 2 && j <= p));
    q.view(2, 0, 0) = 0.5f;
    k.view(1, 7, 2) = nan;  // prefix key 7 of KV head 1 (query heads 2, 3): every row sees it
    run();
    for (index_t h = 0; h < 4; ++h)
      for (index_t j = 0; j < p + w; ++j) CHECK(std::isnan(out[static_cast<std::size_t>(h * (p + w) + j)]) == (h >= 2));
  }
  SUBCASE("-inf logits are masked; +inf logits make the row NaN; a row of only -inf is NaN") {
    const index_t p = 5, w = 1, d = 2;
    std::vector<float> q = {1.f, 0.5f}, k(p * d, 0.25f), out(p);
    auto qv = value_of(make_kv_view(q.data(), 1, w, d));
    auto kv = value_of(make_kv_view(k.data(), 1, p, d));
    auto ov = value_of(make_matrix_view(out.data(), 1, p));
    k[2 * d] = -inf;  // key 2: logit -inf (1 * -inf + 0.5 * 0.25)
    run_ok([&](workspace& ws) { return attention_scores(seq, ws, qv, kv, kv_view<float>{}, ov); });
    CHECK(out[2] == 0.f);
    for (int j : {0, 1, 3, 4}) CHECK(out[static_cast<std::size_t>(j)] == doctest::Approx(0.25));
    k[2 * d] = inf;  // logit +inf: inf - inf = NaN
    run_ok([&](workspace& ws) { return attention_scores(seq, ws, qv, kv, kv_view<float>{}, ov); });
    for (float x : out) CHECK(std::isnan(x));
    std::fill(k.begin(), k.end(), 0.f);
    for (index_t j = 0; j < p; ++j) k[static_cast<std::size_t>(j * d)] = -inf;  // every logit -inf
    run_ok([&](workspace& ws) { return attention_scores(seq, ws, qv, kv, kv_view<float>{}, ov); });
    for (float x : out) CHECK(std::isnan(x));
  }
  SUBCASE("CAKE: w = 1 has zero variance (unbiased); biased divides by w") {
    const index_t p = 9, d = 4;
    cache<float> q(1, 2, d, 0, g, -1.f, 1.f), k(1, p + 2, d, 0, g, -1.f, 1.f);
    const auto s = value_of(split_window(k.view, 2));
    const auto one = value_of(split_window(q.view, 1));
    score_options cake;
    cake.reduce = score_reduce::mean_plus_variance;
    std::vector<float> a(p + 1), b(p + 1);
    const auto k1 = value_of(split_window(k.view, 1));
    run_ok([&](workspace& ws) {
      return attention_scores(seq, ws, one.window, k1.prefix, k1.window, value_of(make_matrix_view(a.data(), 1, p + 1)), cake);
    });
    score_options mean;
    run_ok([&](workspace& ws) {
      return attention_scores(seq, ws, one.window, k1.prefix, k1.window, value_of(make_matrix_view(b.data(), 1, p + 1)), mean);
    });
    for (index_t j = 0; j <= p; ++j) CHECK(a[static_cast<std::size_t>(j)] == doctest::Approx(b[static_cast<std::size_t>(j)]).epsilon(1e-6));
    cake.variance = variance_estimator::biased;
    std::vector<float> c(p);
    run_ok([&](workspace& ws) {
      return attention_scores(seq, ws, q.view, s.prefix, s.window, value_of(make_matrix_view(c.data(), 1, p)), cake);
    });
    check_close(c, p, p, naive_scores(kv_view<const float>(q.view), kv_view<const float>(s.prefix),
                                      kv_view<const float>(s.window), p, cake),
                1);
  }
}

TEST_CASE("attention_scores: panel and tile boundaries (P around multiples of 1024 and 48)") {
  auto g = kvtest::rng(77);
  for (const index_t p : {1023, 1024, 1025, 2047, 2048, 2049, 47, 48, 49, 3071}) {
    CAPTURE(p);
    const index_t w = 3 + p % 5, d = 5 + p % 7, hq = 2;
    cache<float> q(hq, w, d, static_cast<int>(p % 4), g, -2.f, 2.f), k(1, p + w, d, static_cast<int>((p + 1) % 4), g, -2.f, 2.f);
    const auto s = value_of(split_window(k.view, w));
    score_options opt;
    opt.reduce = static_cast<score_reduce>(p % 4);
    std::vector<float> out(static_cast<std::size_t>(hq * (p + w)));
    run_ok([&](workspace& ws) {
      return attention_scores(seq, ws, q.view, s.prefix, s.window, value_of(make_matrix_view(out.data(), hq, p + w)), opt);
    });
    check_close(out, p + w, p + w,
                naive_scores(kv_view<const float>(q.view), kv_view<const float>(s.prefix), kv_view<const float>(s.window),
                             p + w, opt),
                hq);
  }
}

TEST_CASE("key_norm_scores: -||k||_2 per token, any layout and element type; NaN stays NaN") {
  auto g = kvtest::rng(3);
  for (int trial = 0; trial < 20; ++trial) {
    const index_t h = kvtest::uniform_int(g, 1, 4), tn = kvtest::uniform_int(g, 0, 90), d = kvtest::uniform_int(g, 1, 130);
    cache<bfloat16> k(h, tn, d, trial % 4, g, -3.f, 3.f);
    std::vector<float> a(static_cast<std::size_t>(std::max<index_t>(1, h * tn))), b = a;
    REQUIRE(key_norm_scores(seq, k.view, value_of(make_matrix_view(a.data(), h, tn))).ok());
    REQUIRE(key_norm_scores(par, k.view, value_of(make_matrix_view(b.data(), h, tn))).ok());
    REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
    for (index_t x = 0; x < h; ++x)
      for (index_t t = 0; t < tn; ++t) {
        double s = 0;
        for (index_t e = 0; e < d; ++e) s += std::pow(static_cast<double>(to_float(k.view(x, t, e))), 2);
        REQUIRE(a[static_cast<std::size_t>(x * tn + t)] == doctest::Approx(-std::sqrt(s)).epsilon((static_cast<double>(d) + 2) * 6e-8));
      }
  }
  std::vector<float> k = {3.f, 4.f, std::numeric_limits<float>::quiet_NaN(), 1.f}, out(2);
  REQUIRE(key_norm_scores(seq, value_of(make_kv_view(k.data(), 1, 2, 2)), value_of(make_matrix_view(out.data(), 1, 2))).ok());
  CHECK(out[0] == -5.f);
  CHECK(std::isnan(out[1]));
  require_error(key_norm_scores(seq, value_of(make_kv_view(k.data(), 1, 2, 2)), value_of(make_matrix_view(out.data(), 2, 1))),
                errc::shape_mismatch, "out is [2][1] but keys are [1][2][*]");
  require_error(key_norm_scores(seq, value_of(make_kv_view(k.data(), 1, 2, 2)), value_of(make_matrix_view(k.data() + 1, 1, 2))),
                errc::overlap, "out overlaps keys");
}

TEST_CASE("attention_scores: errors are specific and nothing is written") {
  std::vector<float> q(6 * 2 * 4, 0.5f), k(4 * 10 * 4, 0.25f), out(6 * 10, -1.f);
  auto qv = value_of(make_kv_view(q.data(), 6, 2, 4));  // H_q = 6, w = 2, d = 4
  auto kv = value_of(make_kv_view(k.data(), 4, 10, 4));
  const auto s = value_of(split_window(kv, 2));  // P = 8
  auto out_p = value_of(make_matrix_view(out.data(), 6, 8));
  workspace ws;
  // GQA: 6 query heads over 4 KV heads
  require_error(attention_scores(seq, ws, qv, s.prefix, s.window, out_p), errc::shape_mismatch,
                "6 query heads are not a multiple of 4 KV heads");
  auto k2 = value_of(make_kv_view(k.data(), 2, 10, 4));
  const auto s2 = value_of(split_window(k2, 2));
  // now valid shapes: H_q 6, H_kv 2
  REQUIRE(attention_scores(seq, ws, qv, s2.prefix, s2.window, out_p).ok());
  const std::size_t need = ws.bytes;
  // dims differ
  auto k_d3 = value_of(make_kv_view(k.data(), 2, 10, 3));
  require_error(attention_scores(seq, ws, qv, value_of(split_window(k_d3, 2)).prefix, s2.window, out_p),
                errc::shape_mismatch, "head dims differ (queries 4, prefix_keys 3)");
  require_error(attention_scores(seq, ws, qv, s2.prefix, value_of(split_window(k_d3, 2)).window, out_p),
                errc::shape_mismatch, "head dims differ (queries 4, block_keys 3)");
  // block keys: wrong count, wrong heads
  require_error(attention_scores(seq, ws, qv, s2.prefix, value_of(split_window(k2, 3)).window, out_p),
                errc::shape_mismatch, "block_keys holds 3 tokens but the query block has w = 2 rows");
  require_error(attention_scores(seq, ws, qv, s2.prefix, value_of(split_window(kv, 2)).window, out_p),
                errc::shape_mismatch, "block_keys has 4 heads, prefix_keys 2");
  // out shape: neither P nor P + w
  require_error(attention_scores(seq, ws, qv, s2.prefix, s2.window, value_of(make_matrix_view(out.data(), 6, 9))),
                errc::shape_mismatch, "out has 9 columns; expected P = 8 (prefix columns) or P + w = 10");
  require_error(attention_scores(seq, ws, qv, s2.prefix, kv_view<float>{}, value_of(make_matrix_view(out.data(), 6, 10))),
                errc::shape_mismatch, "expected P = 8 (no block keys were given");
  require_error(attention_scores(seq, ws, qv, s2.prefix, s2.window, value_of(make_matrix_view(out.data(), 5, 8))),
                errc::shape_mismatch, "out has 5 rows but there are 6 query heads");
  // empty block, no KV heads, d = 0
  require_error(attention_scores(seq, ws, value_of(make_kv_view(q.data(), 6, 0, 4)), s2.prefix, kv_view<float>{}, out_p),
                errc::invalid_argument, "the query block is empty (w = 0)");
  require_error(attention_scores(seq, ws, qv, value_of(make_kv_view(k.data(), 0, 8, 4)), kv_view<float>{}, out_p),
                errc::invalid_argument, "prefix_keys has no heads");
  require_error(attention_scores(seq, ws, value_of(make_kv_view(q.data(), 6, 2, 0)), value_of(make_kv_view(k.data(), 2, 8, 0)),
                                 kv_view<float>{}, out_p),
                errc::invalid_argument, "head dim is 0");
  // options
  score_options bad;
  bad.reduce = static_cast<score_reduce>(9);
  require_error(attention_scores(seq, ws, qv, s2.prefix, s2.window, out_p, bad), errc::invalid_argument,
                "unknown score_reduce value 9");
  bad = {};
  bad.variance = static_cast<variance_estimator>(-1);
  require_error(attention_scores(seq, ws, qv, s2.prefix, s2.window, out_p, bad), errc::invalid_argument,
                "unknown variance_estimator value -1");
  bad = {};
  bad.scale = -1.f;
  require_error(attention_scores(seq, ws, qv, s2.prefix, s2.window, out_p, bad), errc::invalid_argument,
                "scale must be finite and >= 0");
  bad.scale = std::numeric_limits<float>::infinity();
  require_error(attention_scores(seq, ws, qv, s2.prefix, s2.window, out_p, bad), errc::invalid_argument, "scale");
  bad = {};
  bad.gamma = std::numeric_limits<float>::quiet_NaN();
  require_error(attention_scores(seq, ws, qv, s2.prefix, s2.window, out_p, bad), errc::invalid_argument,
                "gamma must be finite and >= 0");
  // overlap: out inside the queries or keys
  require_error(attention_scores(seq, ws, qv, s2.prefix, s2.window, value_of(make_matrix_view(q.data(), 6, 8))),
                errc::overlap, "out overlaps queries");
  require_error(attention_scores(seq, ws, qv, s2.prefix, s2.window, value_of(make_matrix_view(k.data() + 8, 6, 8))),
                errc::overlap, "out overlaps prefix_keys");
  // bad hand-built views
  using exts3 = cuda::std::dextents<index_t, 3>;
  kv_view<float> null_q(nullptr, cuda::std::layout_stride::mapping<exts3>(exts3(6, 2, 4), cuda::std::array<index_t, 3>{8, 4, 1}));
  require_error(attention_scores(seq, ws, null_q, s2.prefix, s2.window, out_p), errc::null_pointer,
                "attention_scores: queries: data is null");
  kv_view<float> alias_k(k.data(), cuda::std::layout_stride::mapping<exts3>(exts3(2, 8, 4), cuda::std::array<index_t, 3>{40, 2, 1}));
  require_error(attention_scores(seq, ws, qv, alias_k, s2.window, out_p), errc::overlap,
                "attention_scores: prefix_keys: strides make distinct elements alias");
  // workspace: too small; a misaligned one is fine (the carver aligns its sub-buffers, issue 21)
  std::vector<unsigned char> small(need / 2 + 1);
  workspace tiny{small.data(), small.size()};
  require_error(attention_scores(seq, tiny, qv, s2.prefix, s2.window, out_p), errc::workspace_too_small,
                "attention_scores: workspace has");
  std::vector<float> big(need / sizeof(float) + 4), odd_out(48, -2.f), even_out(48, -3.f);
  workspace odd{reinterpret_cast<unsigned char*>(big.data()) + 1, need};
  REQUIRE(attention_scores(seq, odd, qv, s2.prefix, s2.window, value_of(make_matrix_view(odd_out.data(), 6, 8))).ok());
  std::vector<unsigned char> even_mem(need + 64);
  workspace even{even_mem.data() + (64 - reinterpret_cast<std::uintptr_t>(even_mem.data()) % 64) % 64, need};
  REQUIRE(attention_scores(seq, even, qv, s2.prefix, s2.window, value_of(make_matrix_view(even_out.data(), 6, 8))).ok());
  CHECK(kvtest::bytes_of(odd_out) == kvtest::bytes_of(even_out));
  // the wrappers name themselves
  workspace ws2;
  require_error(window_scores(seq, ws2, value_of(make_kv_view(q.data(), 6, 11, 4)), k2, out_p), errc::invalid_argument,
                "window_scores: window w = 11 is outside [0, 10]");
  require_error(h2o_scores(seq, ws2, qv, k2, out_p), errc::shape_mismatch,
                "h2o_scores: out has 8 columns, expected T = 10");
  require_error(tova_scores(seq, ws2, qv, k2, out_p), errc::shape_mismatch, "tova_scores: last_query holds 2 tokens, expected 1");
  CHECK(std::all_of(out.begin(), out.end(), [](float x) { return x == -1.f; }));
}

TEST_CASE("attention_scores: fp16 x fp16 logits are the same plain or fused, on every kernel") {
  // fp16 products are exact in fp32, so the plain path may (and on FMA CPUs does) run the fused
  // kernel: every profile and both modes must give the SSE2 plain bits
  const int supported = static_cast<int>(host_isa_supported());
  auto g = kvtest::rng(77);
  for (int trial = 0; trial < 12; ++trial) {
    CAPTURE(trial);
    const index_t hkv = kvtest::uniform_int(g, 1, 3), hq = hkv * kvtest::uniform_int(g, 1, 4);
    const index_t w = kvtest::uniform_int(g, 1, 20), p = kvtest::uniform_int(g, 0, 500);
    const index_t d = kvtest::uniform_int(g, 1, 40);
    // wide magnitudes (fp16 subnormals to ~250) so products span fp16's whole exponent range
    const float amp = trial % 3 == 0 ? 250.f : trial % 3 == 1 ? 1e-3f : 2.f;
    cache<float16> q(hq, w, d, trial % 4, g, -amp, amp);
    cache<float16> k(hkv, p + w, d, (trial + 1) % 4, g, -amp, amp);
    const auto s = value_of(split_window(k.view, w));
    score_options opt;
    opt.reduce = static_cast<score_reduce>(trial % 4);
    opt.scale = 1.0f / (amp * amp * static_cast<float>(d));  // keep the softmax away from one-hot
    std::vector<std::vector<float>> outs;
    for (int cap = 0; cap <= supported; ++cap)
      for (bool fused : {false, true}) {
        const host_isa_limit_guard limit(kvtest::isa_level(cap));
        opt.fused_multiply_add = fused;
        outs.emplace_back(static_cast<std::size_t>(hq * (p + w)));
        run_ok([&](workspace& ws) {
          return attention_scores(par, ws, q.view, s.prefix, s.window,
                                  value_of(make_matrix_view(outs.back().data(), hq, p + w)), opt);
        });
      }
    for (std::size_t i = 1; i < outs.size(); ++i)
      REQUIRE(std::memcmp(outs[0].data(), outs[i].data(), outs[0].size() * sizeof(float)) == 0);
  }
}

TEST_CASE("attention_scores: the SSE2, AVX2 and AVX-512 kernels give identical bits (plain and fused)") {
  const int supported = static_cast<int>(host_isa_supported());
  const std::string best = supported == 2 ? "AVX-512" : supported == 1 ? "AVX2" : "SSE2";
  MESSAGE("kernel profiles available on this machine: up to ", best);
  auto g = kvtest::rng(2024);
  for (int trial = 0; trial < 30; ++trial) {
    CAPTURE(trial);
    const index_t hkv = kvtest::uniform_int(g, 1, 3), hq = hkv * kvtest::uniform_int(g, 1, 4);
    const bool fused = trial % 3 == 2;  // the SSE2 fused kernel uses software fmaf: keep those small
    const index_t w = kvtest::uniform_int(g, 1, fused ? 20 : 70), p = kvtest::uniform_int(g, 0, fused ? 400 : 1500);
    const index_t d = kvtest::uniform_int(g, 1, fused ? 40 : 140);
    cache<float16> q(hq, w, d, trial % 4, g, -2.f, 2.f);
    cache<bfloat16> k(hkv, p + w, d, (trial + 2) % 4, g, -2.f, 2.f);
    const auto s = value_of(split_window(k.view, w));
    score_options opt;
    opt.reduce = static_cast<score_reduce>(trial % 4);
    opt.fused_multiply_add = fused;
    std::vector<std::vector<float>> outs;
    const bool prefers = detail::score_plain_prefers_avx2();
    const index_t stream_min = detail::score_stream_min_bytes();
    for (int cap = 0; cap <= supported; ++cap)
      for (bool prefer : {false, true})  // (the AVX-512F plain copy also where the AVX2 one is preferred)
        for (bool stream : {false, true}) {  // the logits buffer in place, or through the panel buffer
          const host_isa_limit_guard limit(kvtest::isa_level(cap));
          detail::score_plain_prefers_avx2() = prefer;
          detail::score_stream_min_bytes() = stream ? 0 : stream_min;
          outs.emplace_back(static_cast<std::size_t>(hq * (p + w)));
          run_ok([&](workspace& ws) {
            return attention_scores(trial % 2 ? par : par_t{1}, ws, q.view, s.prefix, s.window,
                                    value_of(make_matrix_view(outs.back().data(), hq, p + w)), opt);
          });
        }
    detail::score_plain_prefers_avx2() = prefers;
    detail::score_stream_min_bytes() = stream_min;
    for (std::size_t i = 1; i < outs.size(); ++i)
      REQUIRE(std::memcmp(outs[0].data(), outs[i].data(), outs[0].size() * sizeof(float)) == 0);
  }
}

TEST_CASE("attention_scores: a workspace at any base alignment gives bit-identical results (seq, par)") {
  auto g = kvtest::rng(2128);
  cache<float> q(6, 5, 16, 0, g, -2.f, 2.f);
  cache<float> keys(2, 70 + 5, 16, 1, g, -2.f, 2.f);
  const auto split = value_of(split_window(keys.view, 5));
  const auto run = [&](auto be) {
    std::vector<float> out(6 * 75, -7.f);
    kvtest::check_workspace_shifts(
        [&](workspace& ws) {
          return attention_scores(be, ws, q.view, split.prefix, split.window, value_of(make_matrix_view(out.data(), 6, 75)));
        },
        [&] { return kvtest::bytes_of(out); });
    return kvtest::bytes_of(out);
  };
  CHECK(run(seq) == run(par_t{3}));
  // the logits buffer filled through the panel buffer (non-temporal stores after a scalar prologue
  // up to 64-byte alignment): the same bits at every base alignment
  const index_t stream_min = detail::score_stream_min_bytes();
  const auto in_place = run(seq);
  detail::score_stream_min_bytes() = 0;
  const auto streamed = run(seq), streamed_par = run(par_t{3});
  detail::score_stream_min_bytes() = stream_min;
  CHECK(streamed == in_place);
  CHECK(streamed_par == in_place);
}
