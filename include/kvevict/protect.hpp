// kvevict/protect.hpp: tokens that are always kept (attention sinks and the recent window).
//
//   protect(be, scores /*[R][T], in place*/, n_sink, n_recent, row_lengths = nullptr)
//   protected_count(length, n_sink, n_recent)          how many tokens of a row that protects
//   check_budget(fn, budget, length, n_sink, n_recent) the error a recipe returns for a budget
//                                                       below it
//
// For each row of length L (row_lengths[row], or T), the positions [0, min(n_sink, L)) (sinks,
// StreamingLLM) and [max(0, L - n_recent), L) (the recent window: SnapKV's observation window,
// LAVa/LookaheadKV's last w prompt tokens) are set to +inf; every other +inf in [0, L) is lowered
// to the largest finite float. Under the selection order (+inf above every finite score, NaN
// below everything, ties -> lower position) protected tokens then strictly outrank every other
// token, so selecting k >= protected_count(L, ...) tokens keeps all of them, and the remaining
// k - protected_count slots go to the best of the rest (a budget counts protected tokens, as in
// KVCache-Factory; see docs/conventions.md). Positions >= L are not touched; unprotected finite,
// -inf and NaN scores are not changed. Scores of protected positions are overwritten whatever
// they were (NaN included).
//
// KVCache-Factory and kvpress do the same thing differently: they score only the prefix before
// the window and concatenate the window afterwards (KVCache-Factory), or pad the window's scores
// with the row's maximum (kvpress, which ties with the best prefix token). +inf makes the
// protection exact and composable with any selection.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/detail/base/parallel.hpp>
#include <kvevict/numeric.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/detail/base/stage_math.hpp>
#include <kvevict/detail/host/post_host.hpp>

#include <cstdint>

namespace kvevict {

/// Number of protected tokens in a row of `length` tokens: the size of the union of the first
/// n_sink and the last n_recent positions, min(length, n_sink + n_recent). Negative arguments
/// count as 0 (protect() rejects them; this helper never fails).
KVEVICT_HOST_DEVICE constexpr index_t protected_count(index_t length, index_t n_sink, index_t n_recent) noexcept {
  if (length <= 0) return 0;
  const index_t s = n_sink < 0 ? 0 : n_sink, w = n_recent < 0 ? 0 : n_recent;
  return s >= length || w >= length - s ? length : s + w;  // no overflow: w < length - s
}

/// The check a recipe makes before selecting `budget` tokens of a row of `length` tokens with
/// n_sink sinks and n_recent recent tokens protected: ok if budget >= protected_count, else
/// errc::invalid_argument "<fn>: budget N is below the M protected tokens (n_sink S + n_recent W
/// of a row of L)". Budgets count protected tokens (docs/conventions.md). A negative budget is
/// also invalid_argument.
inline status check_budget(const char* fn, index_t budget, index_t length, index_t n_sink, index_t n_recent) {
  if (budget < 0)
    return status::error(errc::invalid_argument, "%s: budget %lld is negative", fn, static_cast<long long>(budget));
  const index_t m = protected_count(length, n_sink, n_recent);
  if (budget < m)
    return status::error(errc::invalid_argument,
                         "%s: budget %lld is below the %lld protected tokens (n_sink %lld + n_recent %lld of a row "
                         "of %lld)",
                         fn, static_cast<long long>(budget), static_cast<long long>(m),
                         static_cast<long long>(n_sink), static_cast<long long>(n_recent),
                         static_cast<long long>(length));
  return {};
}

namespace detail {

/// n_sink and n_recent non-negative. Shared by every backend.
inline status check_protect_params(const char* fn, index_t n_sink, index_t n_recent) {
  if (n_sink < 0)
    return status::error(errc::invalid_argument, "%s: n_sink = %lld is negative", fn, static_cast<long long>(n_sink));
  if (n_recent < 0)
    return status::error(errc::invalid_argument, "%s: n_recent = %lld is negative", fn,
                         static_cast<long long>(n_recent));
  return {};
}

/// row_lengths must not lie inside the scores they describe.
inline status check_protect_overlap(const char* fn, const matrix_view<float>& scores, const std::int32_t* row_lengths) {
  if (lengths_inside(row_lengths, scores.extent(0), range_of(scores)))
    return status::error(errc::overlap, "%s: row_lengths lie inside the scores they describe", fn);
  return {};
}

}  // namespace detail

/// In place: protects the first n_sink and the last n_recent positions of every row of `scores`
/// ([R][T], any strides) by setting them to +inf; other +inf scores of the row become FLT_MAX.
/// row_lengths: null (every row has T positions) or R int32 lengths in [0, T].
/// Errors: invalid view; n_sink or n_recent negative (invalid_argument); a length outside [0, T]
/// (out_of_range); row_lengths stored inside scores (overlap). Work: one pass over each row's first L scores; parallel over rows.
template <class Backend>
status protect(Backend be, matrix_view<float> scores, index_t n_sink, index_t n_recent,
               const std::int32_t* row_lengths = nullptr) {
  constexpr const char* fn = "protect";
  KVEVICT_TRY(detail::check_view(fn, "scores", scores));
  KVEVICT_TRY(detail::check_protect_params(fn, n_sink, n_recent));
  const index_t R = scores.extent(0), T = scores.extent(1);
  KVEVICT_TRY(detail::check_lengths(fn, "row_lengths", row_lengths, R, T));
  KVEVICT_TRY(detail::check_protect_overlap(fn, scores, row_lengths));
  float* p = scores.data_handle();
  const index_t s0 = scores.stride(0), s1 = scores.stride(1);
  detail::parallel_for(be, R, [&](index_t r) {
    const index_t L = row_lengths != nullptr ? row_lengths[r] : T;
    if (s1 != 1) return detail::protect_row(p + r * s0, s1, L, n_sink, n_recent);
    // contiguous rows: by ranges in loops that vectorise (post_host.hpp, AVX2 when the CPU has it),
    // protect_value's bits
    const index_t sink_end = detail::protect_sink_end(L, n_sink), recent_begin = detail::protect_recent_begin(L, n_recent);
    detail::post_finish(p + r * s0, L, sink_end, sink_end, recent_begin > sink_end ? recent_begin : sink_end, 0, nullptr,
                        0.0f);
  });
  return {};
}

}  // namespace kvevict
