// kvevict/budget/lava.hpp: LAVa's layer budgets (Shen et al., §4.2, Eq. 7-8): layers whose LAVa
// scores are more uncertain (higher normalised entropy) keep more. docs/budget.md.
//
//   lava_layer_entropy(be, scores, lengths, opt, &e) e_l of one layer (Eq. 7-8)
//   lava_layer_budgets(e, L, H, N, prot, total, out) one-shot (post-fill) layer totals
//   layer_cascade (budget/layer_cascade.hpp)              the layer-by-layer version (Algorithm 2)
//
// Within a layer, heads share the layer total through the flattened selection (Algorithm 1):
// select_topk_flat(be, ws, scores, lengths, layer_total, nullptr, cu, pos).
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/budget/apportion.hpp>
#include <kvevict/detail/base/parallel.hpp>
#include <kvevict/detail/host/entropy_host.hpp>

#include <cmath>

namespace kvevict {

enum class entropy_norm : int {
  /// Default. Divide the entropy by log M, M = the number of scored entries of the layer: LAVa's
  /// public code (sparsity = entropy / log(numel)), which makes e_l a true normalised entropy in [0, 1].
  log_count = 0,
  /// Divide by M = H x N, as printed in the paper's Eq. 8.
  count = 1,
};

struct lava_entropy_options {
  /// Protected positions (+inf after protect()) are not part of the distribution: Algorithm 1
  /// scores only i outside the recent window, and LAVa's code slices the window off.
  protection prot;
  entropy_norm norm = entropy_norm::log_count;
};

/// The normalised entropy of one layer's LAVa scores (Eq. 7-8): over the unprotected entries of
/// every head (row h: columns [min(n_sink, len_h), len_h - n_recent) of its first len_h = lengths[h]
/// columns, all T when lengths is null), p = s / sum(s) and
///   e = -sum p log p / log M   (log_count, default)      e = -sum p log p / M   (count)
/// with M the number of those entries and 0 log 0 = 0. e = 0 when M <= 1 (log_count), M = 0, or
/// every score is 0. Sums in double: per head in 8 lanes (entry k of the head's range to lane k mod 8,
/// lanes combined in a fixed order), heads combined in order; p log p = (s / S)(log s - log S) with
/// 1 / S and log S once per layer and kvevict's own logarithm (detail/host/entropy_host.hpp,
/// docs/budget.md); so seq, par and every ISA give identical bits (LAVa's code adds 1e-16 inside the
/// division and the log, which changes e by ~1e-16 relative). Two passes over the scores, one log
/// per entry, vectorised along the head; parallel over heads.
/// Both normalisations give the same layer budgets whenever every layer has the same M (the same
/// heads and prompt): the budgets are proportional to e and the normaliser is a common factor.
/// Errors: invalid view; no heads; lengths outside [0, T]; negative n_sink/n_recent; unknown norm;
/// an unprotected score NaN, negative or +inf (NaN entropies are refused); entropy null.
namespace detail {

/// Argument checks of lava_layer_entropy (everything but the scores' values).
inline status check_lava_entropy(const char* fn, const matrix_view<const float>& scores, const std::int32_t* lengths,
                                 const lava_entropy_options& opt, const double* entropy) {
  KVEVICT_TRY(check_view(fn, "scores", scores));
  if (entropy == nullptr) return status::error(errc::null_pointer, "%s: entropy is null", fn);
  KVEVICT_TRY(check_protection(fn, opt.prot));
  if (opt.norm != entropy_norm::log_count && opt.norm != entropy_norm::count)
    return status::error(errc::invalid_argument, "%s: unknown entropy_norm value %d", fn, static_cast<int>(opt.norm));
  const index_t H = scores.extent(0), T = scores.extent(1);
  if (H <= 0)
    return status::error(errc::invalid_argument, "%s: scores has %lld heads (at least 1 needed)", fn,
                         static_cast<long long>(H));
  if (lengths != nullptr)
    for (index_t h = 0; h < H; ++h)
      if (lengths[h] < 0 || lengths[h] > T)
        return status::error(errc::out_of_range, "%s: lengths[%lld] = %d is outside [0, %lld]", fn,
                             static_cast<long long>(h), lengths[h], static_cast<long long>(T));
  return {};
}

/// One head's share of the entropy: pass 1 (sum of its unprotected scores, their count, the first
/// offending entry), pass 2 (sum of p log p). Trivially copyable: sharded calls allgather it.
struct lava_head {
  double sum = 0.0;
  index_t count = 0;
  index_t bad = -1;    ///< column of the first unprotected score NaN, negative or +inf
  float bad_value = 0.0f;
};

/// The unprotected columns [b, e) of a head of `len` tokens.
inline void lava_range(index_t len, const protection& p, index_t* b, index_t* e) noexcept {
  *b = p.n_sink < len ? p.n_sink : len;
  const index_t rb = p.n_recent < len ? len - p.n_recent : 0;
  *e = rb > *b ? rb : *b;
}

/// Pass 1 (S == 0: sums and checks) or pass 2 (S > 0: sum of p log p, p = s / S) over rows
/// [h0, h0 + n) of `scores`, into out[0, n); parallel over rows (the per-row sums are sequential).
template <class Backend>
void lava_heads(Backend be, const matrix_view<const float>& scores, const std::int32_t* lengths, const protection& prot,
                index_t h0, index_t n, double S, lava_head* out) {
  const double inv_s = S > 0.0 ? 1.0 / S : 0.0, log_s = S > 0.0 ? entropy_log(S) : 0.0;
  detail::parallel_for(be, n, [&](index_t k) {
    const index_t h = h0 + k;
    index_t b = 0, e = 0;
    lava_range(lengths != nullptr ? lengths[h] : scores.extent(1), prot, &b, &e);
    lava_head hs;
    hs.count = e - b;
    double lanes[8] = {};
    bool bad = false;
    const float* row = scores.data_handle() + h * scores.stride(0) + b * scores.stride(1);
    lava_head_pass(row, e - b, scores.stride(1), inv_s, log_s, lanes, &bad);
    for (index_t t = b; bad && t < e; ++t) {  // the first offending column
      const float v = scores(h, t);
      if (!(v >= 0.0f) || v == detail::bits_float(0x7f800000u)) {
        hs.bad = t;
        hs.bad_value = v;
        break;
      }
    }
    hs.sum = lane_total(lanes);
    out[k] = hs;
  });
}

/// Pass 1's merge in head order: S, M, or the error of the first offending head (`first` = the
/// global index of heads[0]).
inline status lava_merge_sums(const char* fn, const lava_head* heads, index_t n, index_t first, double* S,
                              index_t* M) {
  for (index_t h = 0; h < n; ++h) {
    if (heads[h].bad >= 0)
      return status::error(errc::invalid_argument,
                           "%s: scores[%lld][%lld] = %g (unprotected LAVa scores must be finite and >= 0; a NaN would "
                           "make the entropy NaN)",
                           fn, static_cast<long long>(first + h), static_cast<long long>(heads[h].bad),
                           static_cast<double>(heads[h].bad_value));
    *M += heads[h].count;
    *S += heads[h].sum;
  }
  return {};
}

/// True when the entropy is 0 without a second pass (no entries, all-zero scores, M <= 1).
inline bool lava_trivial(double S, index_t M, entropy_norm norm) noexcept {
  return M == 0 || !(S > 0.0) || (norm == entropy_norm::log_count && M <= 1);
}
/// The normalised entropy from sum p log p.
inline double lava_normalise(double acc, index_t M, entropy_norm norm) {
  const double ent = acc < 0.0 ? -acc : 0.0;
  return norm == entropy_norm::log_count ? ent / std::log(static_cast<double>(M)) : ent / static_cast<double>(M);
}

}  // namespace detail

/// The normalised entropy of one layer's LAVa scores (Eq. 7-8): over the unprotected entries of
/// every head (row h: columns [min(n_sink, len_h), len_h - n_recent) of its first len_h = lengths[h]
/// columns, all T when lengths is null), p = s / sum(s) and
///   e = -sum p log p / log M   (log_count, default)      e = -sum p log p / M   (count)
/// with M the number of those entries and 0 log 0 = 0. e = 0 when M <= 1 (log_count), M = 0, or
/// every score is 0. Sums in double: per head in 8 lanes (entry k of the head's range to lane k mod 8,
/// lanes combined in a fixed order), heads combined in order; p log p = (s / S)(log s - log S) with
/// 1 / S and log S once per layer and kvevict's own logarithm (detail/host/entropy_host.hpp,
/// docs/budget.md); so seq, par and every ISA give identical bits (LAVa's code adds 1e-16 inside the
/// division and the log, which changes e by ~1e-16 relative). Two passes over the scores, one log
/// per entry, vectorised along the head; parallel over heads.
/// Both normalisations give the same layer budgets whenever every layer has the same M (the same
/// heads and prompt): the budgets are proportional to e and the normaliser is a common factor.
/// Errors: invalid view; no heads; lengths outside [0, T]; negative n_sink/n_recent; unknown norm;
/// an unprotected score NaN, negative or +inf (NaN entropies are refused); entropy null.
template <class Backend>
status lava_layer_entropy(Backend be, matrix_view<const float> scores, const std::int32_t* lengths,
                          const lava_entropy_options& opt, double* entropy) {
  constexpr const char* fn = "lava_layer_entropy";
  KVEVICT_TRY(detail::check_lava_entropy(fn, scores, lengths, opt, entropy));
  const index_t H = scores.extent(0);
  // 64 heads at a time on the stack, merged in head order
  constexpr index_t chunk = 64;
  detail::lava_head part[chunk];
  double S = 0.0;
  index_t M = 0;
  for (index_t h0 = 0; h0 < H; h0 += chunk) {
    const index_t n = H - h0 < chunk ? H - h0 : chunk;
    detail::lava_heads(be, scores, lengths, opt.prot, h0, n, 0.0, part);
    KVEVICT_TRY(detail::lava_merge_sums(fn, part, n, h0, &S, &M));
  }
  if (detail::lava_trivial(S, M, opt.norm)) {
    *entropy = 0.0;
    return {};
  }
  double acc = 0.0;
  for (index_t h0 = 0; h0 < H; h0 += chunk) {
    const index_t n = H - h0 < chunk ? H - h0 : chunk;
    detail::lava_heads(be, scores, lengths, opt.prot, h0, n, S, part);
    for (index_t k = 0; k < n; ++k) acc += part[k].sum;
  }
  *entropy = detail::lava_normalise(acc, M, opt.norm);
  return {};
}

namespace detail {

/// A layer weight (entropy, preference) must be finite and >= 0.
inline status check_layer_weights(const char* fn, const char* what, const double* w, index_t n) {
  if (n > 0 && w == nullptr) return status::error(errc::null_pointer, "%s: %s is null", fn, what);
  for (index_t l = 0; l < n; ++l)
    if (!(w[l] >= 0.0) || w[l] - w[l] != 0.0)
      return status::error(errc::invalid_argument, "%s: %s of layer %lld is %g (must be finite and >= 0)", fn, what,
                           static_cast<long long>(l), w[l]);
  return {};
}

/// The model total of a request with L layers of H heads of N tokens protecting W each:
/// L H W <= total <= L H N.
inline status check_model_total(const char* fn, index_t total, index_t L, index_t H, index_t N, index_t W) {
  index_t heads = 0, top = 0;
  if (!checked_mul(L, H, heads) || !checked_mul(heads, N, top))
    return status::error(errc::size_overflow, "%s: %lld layers x %lld heads x %lld tokens overflow", fn,
                         static_cast<long long>(L), static_cast<long long>(H), static_cast<long long>(N));
  if (total < 0)
    return status::error(errc::invalid_argument, "%s: total budget %lld is negative", fn, static_cast<long long>(total));
  if (total < heads * W)
    return status::error(errc::invalid_argument,
                         "%s: total budget %lld is below the %lld protected tokens (%lld per head x %lld heads)", fn,
                         static_cast<long long>(total), static_cast<long long>(heads * W), static_cast<long long>(W),
                         static_cast<long long>(heads));
  if (total > top)
    return status::error(errc::invalid_argument, "%s: total budget %lld is above the prompt (%lld tokens in %lld heads)",
                         fn, static_cast<long long>(total), static_cast<long long>(top), static_cast<long long>(heads));
  return {};
}

}  // namespace detail

/// One-shot LAVa layer budgets (post-fill, every layer's entropy known): layer_totals[l] = the
/// tokens layer l keeps over all its H heads, protected ones included:
///   layer_totals[l] = H W + share_l,   share = apportion(total - L H W, entropies, caps = H (N - W))
/// (W = protected_count(N, prot); apportion: proportional to e_l, capped at the layer's evictable
/// tokens with the excess re-shared, largest remainder with ties to the lower layer; all-zero
/// entropies share equally). sum(layer_totals) == total exactly. Heads then share each layer total
/// through select_topk_flat.
/// Errors (nothing written): zero layers or heads; prompt_length outside [1, INT32_MAX]; negative
/// n_sink/n_recent; total negative, below the L H W protected tokens or above L H N; an entropy
/// NaN, infinite or negative; null pointers.
inline status lava_layer_budgets(const double* entropies, index_t layers, index_t heads, index_t prompt_length,
                                 const protection& prot, index_t total, index_t* layer_totals) {
  constexpr const char* fn = "lava_layer_budgets";
  KVEVICT_TRY(detail::check_layers_heads(fn, layers, heads));
  KVEVICT_TRY(detail::check_prompt_length(fn, prompt_length));
  KVEVICT_TRY(detail::check_protection(fn, prot));
  const index_t W = protected_count(prompt_length, prot.n_sink, prot.n_recent);
  KVEVICT_TRY(detail::check_model_total(fn, total, layers, heads, prompt_length, W));
  KVEVICT_TRY(detail::check_layer_weights(fn, "entropy", entropies, layers));
  if (layer_totals == nullptr) return status::error(errc::null_pointer, "%s: layer_totals is null", fn);
  const index_t cap = heads * (prompt_length - W);
  detail::apportion_run(
      total - layers * heads * W, layers, [entropies](index_t l) { return entropies[l]; },
      [cap](index_t) { return cap; }, detail::array_out<index_t>{layer_totals});
  for (index_t l = 0; l < layers; ++l) layer_totals[l] += heads * W;
  return {};
}

}  // namespace kvevict
