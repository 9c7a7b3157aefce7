// kvevict/budget/duo.hpp: DuoAttention / PruLong head types (Xiao et al. 2025; "Cache me if you
// can" §4; LAVa appendix B Eq. 28-29). docs/budget.md.
//
// A [layers][KV heads] mask says which heads are retrieval heads (1: full KV cache, or a budget)
// and which are streaming heads (0: only the first n_sink and the last n_recent tokens). Masks come
// from prulong_topk_mask (PruLong's final top-k), binarize_head_mask (a DuoAttention / PruLong TSV
// file read with read_head_mask_tsv), or any calibration.
#pragma once

#include <kvevict/budget/apportion.hpp>

#include <type_traits>

namespace kvevict {

struct duo_options {
  /// Sinks and recent window of the streaming heads (PruLong's and DuoAttention's evaluations: 128
  /// sinks, 1024 recent tokens). Retrieval heads with a budget protect the same tokens.
  protection streaming;
  /// -1 (default): retrieval heads keep the whole prompt (DuoAttention, PruLong). Otherwise the
  /// budget of every retrieval head, protected tokens included (they then select by score, e.g.
  /// SnapKV-style), in [protected tokens, prompt_length].
  index_t retrieval_budget = -1;
};

namespace detail {
/// Checks prompt_length and opt, then gives the two head budgets of a DuoAttention split:
/// *streaming = the protected tokens, *retrieval = the prompt or opt.retrieval_budget.
inline status duo_head_budgets(const char* fn, index_t prompt_length, const duo_options& opt, index_t* streaming,
                               index_t* retrieval) {
  KVEVICT_TRY(check_prompt_length(fn, prompt_length));
  KVEVICT_TRY(check_protection(fn, opt.streaming));
  *streaming = protected_count(prompt_length, opt.streaming.n_sink, opt.streaming.n_recent);
  *retrieval = prompt_length;
  if (opt.retrieval_budget != -1) {
    KVEVICT_TRY(check_head_budget(fn, opt.retrieval_budget, prompt_length, opt.streaming));
    *retrieval = opt.retrieval_budget;
  }
  return {};
}
}  // namespace detail

/// Per-head budgets of a head-type mask: out[l][h] = prompt_length or opt.retrieval_budget for a
/// retrieval head (mask 1), protected_count(prompt_length, opt.streaming) for a streaming head
/// (mask 0). *total (if not null) receives their sum, the tokens the model keeps. The mask decides
/// everything: the total is exactly what the mask implies (to aim at a total, choose the number of
/// retrieval heads with duo_retrieval_heads and make the mask with prulong_topk_mask).
/// Errors (nothing written): invalid views; mask shape != out shape (shape_mismatch); zero layers or
/// heads; a mask value NaN or outside [0, 1], or strictly between 0 and 1 (binarize it first with
/// binarize_head_mask); prompt_length outside [1, INT32_MAX]; negative n_sink/n_recent; a
/// retrieval budget other than -1 below the protected tokens or above the prompt.
template <class M>
status duo_budgets(matrix_view<M> mask_in, index_t prompt_length, const duo_options& opt, matrix_view<std::int32_t> out,
                   index_t* total = nullptr) {
  static_assert(std::is_arithmetic_v<std::remove_const_t<M>>, "duo_budgets: the mask must be arithmetic");
  constexpr const char* fn = "duo_budgets";
  const matrix_view<const std::remove_const_t<M>> mask = mask_in;
  KVEVICT_TRY(detail::check_view(fn, "mask", mask));
  index_t L = 0, H = 0;
  KVEVICT_TRY(detail::check_budget_out(fn, out, &L, &H));
  if (mask.extent(0) != L || mask.extent(1) != H)
    return status::error(errc::shape_mismatch, "%s: mask is [%lld][%lld] but the budgets are [%lld layers][%lld heads]",
                         fn, static_cast<long long>(mask.extent(0)), static_cast<long long>(mask.extent(1)),
                         static_cast<long long>(L), static_cast<long long>(H));
  if (detail::range_of(mask).intersects(detail::range_of(out)))
    return status::error(errc::overlap, "%s: mask and budgets overlap in memory", fn);
  index_t stream = 0, full = 0;
  KVEVICT_TRY(detail::duo_head_budgets(fn, prompt_length, opt, &stream, &full));
  for (index_t l = 0; l < L; ++l)
    for (index_t h = 0; h < H; ++h) {
      const double v = static_cast<double>(mask(l, h));
      if (!(v >= 0.0 && v <= 1.0))
        return status::error(errc::invalid_argument, "%s: mask[%lld][%lld] = %g is outside [0, 1]", fn,
                             static_cast<long long>(l), static_cast<long long>(h), v);
      if (v != 0.0 && v != 1.0)
        return status::error(errc::invalid_argument,
                             "%s: mask[%lld][%lld] = %g is neither 0 (streaming) nor 1 (retrieval): binarize the mask "
                             "first (binarize_head_mask, prulong_topk_mask)",
                             fn, static_cast<long long>(l), static_cast<long long>(h), v);
    }
  index_t sum = 0;
  for (index_t l = 0; l < L; ++l)
    for (index_t h = 0; h < H; ++h) {
      const index_t b = static_cast<double>(mask(l, h)) == 1.0 ? full : stream;
      out(l, h) = static_cast<std::int32_t>(b);
      sum += b;
    }
  if (total != nullptr) *total = sum;
  return {};
}

/// The kept positions of a streaming head of a prompt of prompt_length tokens: [0, min(n_sink, N))
/// then [max(n_sink, N - n_recent), N), ascending, written to out (room for protected_count(N, s)
/// positions). Returns that count. Errors: prompt_length outside [1, INT32_MAX]; negative
/// n_sink/n_recent; out null.
inline result<index_t> streaming_positions(index_t prompt_length, const protection& streaming, pos_t* out) {
  constexpr const char* fn = "streaming_positions";
  KVEVICT_TRY(detail::check_prompt_length(fn, prompt_length));
  KVEVICT_TRY(detail::check_protection(fn, streaming));
  if (out == nullptr) return status::error(errc::null_pointer, "%s: out is null", fn);
  const index_t N = prompt_length;
  const index_t sink_end = streaming.n_sink < N ? streaming.n_sink : N;
  const index_t recent_begin = streaming.n_recent < N - sink_end ? N - streaming.n_recent : sink_end;
  index_t n = 0;
  for (index_t t = 0; t < sink_end; ++t) out[n++] = static_cast<pos_t>(t);
  for (index_t t = recent_begin; t < N; ++t) out[n++] = static_cast<pos_t>(t);
  return n;
}

/// How many retrieval heads a total budget affords: the largest k in [0, L H] with
///   k R + (L H - k) S <= total,   R = retrieval budget (opt; the prompt by default), S = streaming
/// budget. The head sparsity is then 1 - k / (L H) (PruLong's target t); make the mask with
/// prulong_topk_mask(log_alpha, k, mask). The model then keeps total - (total - L H S) mod (R - S)
/// tokens (less than R - S below the request): head types are all-or-nothing.
/// Errors: zero layers or heads; prompt_length, protection or retrieval budget invalid (as
/// duo_budgets); total negative or below L H S (not even all-streaming fits).
inline result<index_t> duo_retrieval_heads(index_t total, index_t layers, index_t heads, index_t prompt_length,
                                           const duo_options& opt) {
  constexpr const char* fn = "duo_retrieval_heads";
  KVEVICT_TRY(detail::check_layers_heads(fn, layers, heads));
  index_t S = 0, R = 0;
  KVEVICT_TRY(detail::duo_head_budgets(fn, prompt_length, opt, &S, &R));
  index_t all = 0, floor_total = 0;
  if (!detail::checked_mul(layers, heads, all) || !detail::checked_mul(all, S, floor_total))
    return status::error(errc::size_overflow, "%s: %lld layers x %lld heads overflow", fn, static_cast<long long>(layers),
                         static_cast<long long>(heads));
  if (total < 0)
    return status::error(errc::invalid_argument, "%s: total budget %lld is negative", fn, static_cast<long long>(total));
  if (total < floor_total)
    return status::error(errc::invalid_argument,
                         "%s: total budget %lld is below the %lld tokens of %lld streaming heads (%lld each)", fn,
                         static_cast<long long>(total), static_cast<long long>(floor_total), static_cast<long long>(all),
                         static_cast<long long>(S));
  if (R == S) return all;
  const index_t k = (total - floor_total) / (R - S);
  return k < all ? k : all;
}

}  // namespace kvevict
