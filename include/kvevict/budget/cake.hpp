// kvevict/budget/cake.hpp: CAKE's layer preferences and budgets (Qin et al., ICLR 2025; LAVa
// appendix B Eq. 23-24; CAKE's public code cake/model/modify_*.py and cake/cake_cache.py).
// docs/budget.md.
//
//   cake_layer_stats(be, attention, &stats)   H_l (entropy) and V_l (variance) of a layer's window attention
//   cake_window_preference(be, ws, q, k, opt, &p)  the same from the window's queries and the keys
//   cake_preference(stats, opt, &p)           P_l = H_l^(1/tau1) V_l^(1/tau2)
//   cake_budgets(p, L, B, N, prot, out)       one-shot per-head budgets proportional to P_l
//   layer_cascade (budget/layer_cascade.hpp)        CAKE's cascading (per_head split)
//
// CAKE's eviction indicator (mean + gamma var of the window attention, gamma = 200) is the score
// stage's score_reduce::mean_plus_variance; within a layer every head keeps the same number of tokens.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/budget/apportion.hpp>
#include <kvevict/budget/lava.hpp>
#include <kvevict/detail/base/parallel.hpp>
#include <kvevict/detail/host/entropy_host.hpp>
#include <kvevict/score.hpp>

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace kvevict {

/// A layer's attention statistics (CAKE's "spatial dispersion" and "temporal shift").
struct cake_stats {
  double entropy = 0.0;   ///< H_l = -sum p log p over every head, window row and column
  double variance = 0.0;  ///< V_l = sum over heads and columns of the variance over the window rows
};

struct cake_options {
  /// P_l = H_l^(1/tau1) V_l^(1/tau2). CAKE's code falls back to tau1 = tau2 = 1 when a model has no
  /// tuned values (its config/model2tau.json tunes them per model and cache size, e.g. 1.6 and 0.4
  /// for Llama-3.1-8B at 1024). Finite, > 0.
  double tau1 = 1.0;
  double tau2 = 1.0;
};

namespace detail {

struct cake_row {
  double entropy = 0.0, variance = 0.0;
  index_t bad_i = -1, bad_j = -1;
  float bad = 0.0f;
};

inline cake_row cake_row_stats(const kv_view<const float>& a, index_t r, variance_estimator var) {
  cake_row out;
  const index_t w = a.extent(1), C = a.extent(2);
  const float* base = a.data_handle() + r * a.stride(0);
  // divisor 0: no variance (unbiased with w <= 1, score.hpp's rule; no window rows)
  const index_t dn = var == variance_estimator::biased ? w : w - 1;
  const double div = dn > 0 ? static_cast<double>(dn) : 0.0;
  double ent[8] = {}, vl[8] = {};
  bool bad = false;
  cake_head(base, w, C, a.stride(1), a.stride(2), div, ent, vl, &bad);
  if (bad) {  // the first offending probability in (i, j) order
    for (index_t i = 0; i < w; ++i)
      for (index_t j = 0; j < C; ++j) {
        const float p = a(r, i, j);
        if (!(p >= 0.0f && p <= 1.0f)) {
          out.bad_i = i;
          out.bad_j = j;
          out.bad = p;
          return out;
        }
      }
  }
  out.entropy = lane_total(ent);
  out.variance = lane_total(vl);
  return out;
}

/// Adds rows[0, n) (global rows first ..) to `total` in row order, or the first bad probability's error.
inline status cake_merge(const char* fn, const cake_row* rows, index_t n, index_t first, cake_stats* total) {
  for (index_t k = 0; k < n; ++k) {
    if (rows[k].bad_i >= 0)
      return status::error(errc::invalid_argument, "%s: attention[%lld][%lld][%lld] = %g is not a probability in [0, 1]",
                           fn, static_cast<long long>(first + k), static_cast<long long>(rows[k].bad_i),
                           static_cast<long long>(rows[k].bad_j), static_cast<double>(rows[k].bad));
    total->entropy += rows[k].entropy;
    total->variance += rows[k].variance;
  }
  return {};
}

/// Argument checks of cake_layer_stats.
inline status check_cake_stats(const char* fn, const kv_view<const float>& attention, const cake_stats* out,
                               variance_estimator var) {
  KVEVICT_TRY(check_view(fn, "attention", attention));
  if (out == nullptr) return status::error(errc::null_pointer, "%s: out is null", fn);
  if (var != variance_estimator::unbiased && var != variance_estimator::biased)
    return status::error(errc::invalid_argument, "%s: unknown variance_estimator value %d", fn, static_cast<int>(var));
  return {};
}

}  // namespace detail

/// CAKE's layer statistics from the attention probabilities of the observation window:
/// attention [R][w][C] (logical [head][window row][column]: one row per query head, the softmax over
/// each row's whole visible context, restricted to the C prefix columns — CAKE's code slices
/// tmp_attn_weights[:, :, -w:, :-w]; any strides):
///   entropy  = -sum_{r,i,j} p log p     (0 log 0 = 0; CAKE's code: p log(p + 1e-10))
///   variance = sum_{r,j} var_i p_{r,i,j} (unbiased: / (w - 1), torch.var's default and CAKE's; 0 for
///              w = 1; biased: / w)
/// The paper (LAVa appendix B Eq. 23) writes these over every prefill step t in [j, N]; the public
/// code, followed here, uses the w window rows. Sums in double, per row in 8 lanes of columns (j mod 8)
/// in a fixed order and rows combined in order, with kvevict's own logarithm (detail/host/
/// entropy_host.hpp, docs/budget.md), so seq, par and every ISA give identical bits. O(R w C) with a
/// log per element, vectorised across columns, parallel over rows.
/// The score stage never materialises attention; an engine that does not have it (eager attention)
/// computes the window rows' probabilities itself (docs/budget.md, "Not done").
/// Errors: invalid view; a probability NaN or outside [0, 1]; unknown estimator; out null.
template <class Backend>
status cake_layer_stats(Backend be, kv_view<const float> attention, cake_stats* out,
                        variance_estimator var = variance_estimator::unbiased) {
  constexpr const char* fn = "cake_layer_stats";
  KVEVICT_TRY(detail::check_cake_stats(fn, attention, out, var));
  const index_t R = attention.extent(0);
  constexpr index_t chunk = 64;
  detail::cake_row rows[chunk];
  cake_stats total;
  for (index_t r0 = 0; r0 < R; r0 += chunk) {
    const index_t n = R - r0 < chunk ? R - r0 : chunk;
    detail::parallel_for(be, n, [&](index_t k) { rows[k] = detail::cake_row_stats(attention, r0 + k, var); });
    KVEVICT_TRY(detail::cake_merge(fn, rows, n, r0, &total));
  }
  *out = total;
  return {};
}

/// P = entropy^(1/tau1) * variance^(1/tau2) (in double; CAKE's code in float32).
/// Errors: tau1 or tau2 not finite or <= 0; statistics NaN, infinite or negative; a preference that
/// overflows; pref null.
inline status cake_preference(const cake_stats& stats, const cake_options& opt, double* pref) {
  constexpr const char* fn = "cake_preference";
  if (pref == nullptr) return status::error(errc::null_pointer, "%s: pref is null", fn);
  if (!(opt.tau1 > 0.0) || opt.tau1 - opt.tau1 != 0.0 || !(opt.tau2 > 0.0) || opt.tau2 - opt.tau2 != 0.0)
    return status::error(errc::invalid_argument, "%s: tau1 = %g, tau2 = %g (both must be finite and > 0)", fn, opt.tau1,
                         opt.tau2);
  if (!(stats.entropy >= 0.0) || stats.entropy - stats.entropy != 0.0 || !(stats.variance >= 0.0) ||
      stats.variance - stats.variance != 0.0)
    return status::error(errc::invalid_argument, "%s: entropy = %g, variance = %g (both must be finite and >= 0)", fn,
                         stats.entropy, stats.variance);
  const double p = std::pow(stats.entropy, 1.0 / opt.tau1) * std::pow(stats.variance, 1.0 / opt.tau2);
  if (p - p != 0.0)
    return status::error(errc::invalid_argument, "%s: the preference overflows (entropy %g, variance %g, tau %g, %g)", fn,
                         stats.entropy, stats.variance, opt.tau1, opt.tau2);
  *pref = p;
  return {};
}

/// CAKE's layer preference for an engine without eager attention: the attention of the w window
/// queries [H_q][w][d] (positions P - w .. P - 1) over keys [H_kv][P][d] (query head q reads KV head
/// q / (H_q / H_kv)), each row an fp32 softmax over the keys it sees (scale 1/sqrt(d), max
/// subtracted, std::exp, summed left to right) kept over the prefix columns [0, P - w), then
/// cake_layer_stats and cake_preference. Host only: the rows run one after another on every
/// backend (seq_t, par_t). Workspace: two-phase, the [H_q][w][P - w] fp32 attention.
/// Errors: invalid views; head sizes that differ, H_q not a multiple of H_kv; no prefix (w >= P);
/// pref null; workspace too small; those of cake_layer_stats and cake_preference.
namespace detail {

/// cake_window_preference's argument checks; on success *prefix = P - w.
inline status check_cake_window(const char* fn, const kv_view<const float>& window_queries,
                                const kv_view<const float>& keys, const double* pref, index_t* prefix) {
  KVEVICT_TRY(detail::check_view(fn, "window_queries", window_queries));
  KVEVICT_TRY(detail::check_view(fn, "keys", keys));
  if (pref == nullptr) return status::error(errc::null_pointer, "%s: pref is null", fn);
  const index_t hq = window_queries.extent(0), w = window_queries.extent(1), d = window_queries.extent(2);
  const index_t hkv = keys.extent(0), P = keys.extent(1);
  if (keys.extent(2) != d || hkv < 1 || hq % hkv != 0)
    return status::error(errc::shape_mismatch, "%s: queries [%lld][%lld][%lld] over keys [%lld][%lld][%lld]", fn,
                         static_cast<long long>(hq), static_cast<long long>(w), static_cast<long long>(d),
                         static_cast<long long>(hkv), static_cast<long long>(P), static_cast<long long>(keys.extent(2)));
  if (P - w < 1)
    return status::error(errc::invalid_argument, "%s: the window (%lld) leaves no prefix of the %lld keys", fn,
                         static_cast<long long>(w), static_cast<long long>(P));
  *prefix = P - w;
  return {};
}

/// The window's attention over the prefix, att [H_q][w][prefix] (checked arguments).
inline void cake_window_attention(const kv_view<const float>& window_queries, const kv_view<const float>& keys,
                                  index_t prefix, float* att) {
  const index_t hq = window_queries.extent(0), w = window_queries.extent(1), d = window_queries.extent(2);
  const index_t group = hq / keys.extent(0);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  auto logit = [&](index_t h, index_t i, index_t j) {
    float s = 0.0f;
    for (index_t x = 0; x < d; ++x) s += window_queries(h, i, x) * keys(h / group, j, x);
    return s * scale;
  };
  for (index_t h = 0; h < hq; ++h)
    for (index_t i = 0; i < w; ++i) {  // three passes over the visible keys: max, sum, the prefix's probabilities
      const index_t visible = prefix + i + 1;
      float mx = -INFINITY, sum = 0.0f;
      for (index_t j = 0; j < visible; ++j) mx = std::max(mx, logit(h, i, j));
      for (index_t j = 0; j < visible; ++j) sum += std::exp(logit(h, i, j) - mx);
      for (index_t j = 0; j < prefix; ++j) att[(h * w + i) * prefix + j] = std::exp(logit(h, i, j) - mx) / sum;
    }
}

}  // namespace detail

template <class Backend>
status cake_window_preference(Backend be, workspace& ws, kv_view<const float> window_queries, kv_view<const float> keys,
                              const cake_options& opt, double* pref) {
  constexpr const char* fn = "cake_window_preference";
  static_assert(!std::is_same_v<Backend, cuda_t>, "cake_window_preference runs on the host");
  index_t prefix = 0;
  KVEVICT_TRY(detail::check_cake_window(fn, window_queries, keys, pref, &prefix));
  const index_t hq = window_queries.extent(0), w = window_queries.extent(1);
  detail::workspace_carver c(ws);
  float* att = c.take<float>(static_cast<std::size_t>(hq * w * prefix));
  KVEVICT_TRY(c.finish(fn));
  if (ws.is_query()) return {};
  const detail::byte_range in[] = {detail::range_of(window_queries), detail::range_of(keys)};
  const char* const names[] = {"window_queries", "keys"};
  KVEVICT_TRY(c.check_disjoint(fn, in, names));
  detail::cake_window_attention(window_queries, keys, prefix, att);
  cake_stats st;
  KVEVICT_TRY(cake_layer_stats(be, *make_kv_view<const float>(att, hq, w, prefix), &st));
  return cake_preference(st, opt, pref);
}

/// One-shot CAKE budgets (every layer's preference known): per-head budgets out[l][h] ([L][H] int32,
/// equal over the heads of a layer) with W = protected_count(N, prot), P = B - W:
///   out[l][h] = W + share_l,   share = apportion(L P, preferences, caps = N - W)
/// (proportional to P_l, capped at the prompt with the excess re-shared, largest remainder with ties
/// to the lower layer; all-zero preferences share equally): the model keeps exactly B H L tokens.
/// CAKE's code (adjust_budgets) truncates the quotas with int(), clamps them to the prompt, spreads the
/// excess and the deficit evenly over the first layers, and skips compression when N <= B + w.
/// Errors (nothing written): invalid out; zero layers or heads; prompt_length outside [1, INT32_MAX];
/// negative n_sink/n_recent; budget negative, below the protected tokens or above the prompt; a
/// preference NaN, infinite or negative; preferences null.
inline status cake_budgets(const double* preferences, index_t budget, index_t prompt_length, const protection& prot,
                           matrix_view<std::int32_t> out) {
  constexpr const char* fn = "cake_budgets";
  index_t L = 0, H = 0;
  KVEVICT_TRY(detail::check_allocator_args(fn, out, prompt_length, prot, &L, &H));
  KVEVICT_TRY(detail::check_head_budget(fn, budget, prompt_length, prot));
  KVEVICT_TRY(detail::check_layer_weights(fn, "preference", preferences, L));
  const index_t W = protected_count(prompt_length, prot.n_sink, prot.n_recent);
  const index_t cap = prompt_length - W;
  struct column0 {
    matrix_view<std::int32_t> m;
    index_t get(index_t l) const { return m(l, 0); }
    void set(index_t l, index_t v) const { m(l, 0) = static_cast<std::int32_t>(v); }
  };
  detail::apportion_run(
      L * (budget - W), L, [preferences](index_t l) { return preferences[l]; }, [cap](index_t) { return cap; },
      column0{out});
  for (index_t l = 0; l < L; ++l) {
    const std::int32_t b = static_cast<std::int32_t>(W + out(l, 0));
    for (index_t h = 0; h < H; ++h) out(l, h) = b;
  }
  return {};
}

}  // namespace kvevict
