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
#include <kvevict/detail/checks.hpp>
#include <kvevict/detail/parallel.hpp>
#include <kvevict/numeric.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>

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

/// One row of protect(): n scores with stride s.
KVEVICT_HOST_DEVICE inline void protect_row(float* row, index_t s, index_t n, index_t n_sink, index_t n_recent) {
  const float inf = bits_float(0x7f800000u);  // +inf
  const float top = bits_float(0x7f7fffffu);  // FLT_MAX
  const index_t sink_end = n_sink < n ? n_sink : n;
  const index_t recent_begin = n_recent < n ? n - n_recent : 0;
  for (index_t t = 0; t < n; ++t) {
    float& v = row[t * s];
    if (t < sink_end || t >= recent_begin) v = inf;
    else if (v == inf) v = top;
  }
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
  if (n_sink < 0)
    return status::error(errc::invalid_argument, "%s: n_sink = %lld is negative", fn, static_cast<long long>(n_sink));
  if (n_recent < 0)
    return status::error(errc::invalid_argument, "%s: n_recent = %lld is negative", fn,
                         static_cast<long long>(n_recent));
  const index_t R = scores.extent(0), T = scores.extent(1);
  if (row_lengths != nullptr)
    for (index_t r = 0; r < R; ++r)
      if (row_lengths[r] < 0 || row_lengths[r] > T)
        return status::error(errc::out_of_range, "%s: row_lengths[%lld] = %d is outside [0, %lld]", fn,
                             static_cast<long long>(r), row_lengths[r], static_cast<long long>(T));
  if (row_lengths != nullptr && R > 0) {
    const auto b = reinterpret_cast<std::uintptr_t>(row_lengths);
    if (detail::range_of(scores).intersects({b, b + static_cast<std::uintptr_t>(R) * sizeof(std::int32_t)}))
      return status::error(errc::overlap, "%s: row_lengths lie inside the scores they describe", fn);
  }
  float* p = scores.data_handle();
  const index_t s0 = scores.stride(0), s1 = scores.stride(1);
  detail::parallel_for(be, R, [&](index_t r) {
    detail::protect_row(p + r * s0, s1, row_lengths != nullptr ? row_lengths[r] : T, n_sink, n_recent);
  });
  return {};
}

}  // namespace kvevict
