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
    std::vector<float> mem(ws.bytes / sizeof(float) + 1);
    ws.data = mem.data();
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
