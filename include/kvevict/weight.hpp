// kvevict/weight.hpp: multiply attention scores by value norms (docs/weight.md).
//
//   weight_by_value_norm(be, scores, values, value_weight::per_token)  VATP: s_j *= ||v_j||_1
//   weight_by_value_norm(be, scores, values, value_weight::head_max)   LAVa: s_j *= max_k ||v_k||_1
//
// scores [R][T_s] in place, values [H_kv][T][d] (float, float16, bfloat16) with T_s <= T: score
// column j belongs to value token j (prefix-only window scores have T_s = T - w). R is H_kv
// (scores after GQA reduction, the usual place of this stage) or a multiple of it (per query head
// before the reduction: row r uses KV head r / (R / H_kv), as everywhere in kvevict).
//
// LAVa's max runs over every value token of the head, the observation window included (Eq. 6 and
// Theorem 1: k in [N], the whole cache), not only over the scored columns. Optional per-KV-head
// lengths restrict a head to its first lengths[h] tokens (padded layouts holding ragged heads):
// the max runs over those tokens and score columns j >= lengths[h] are left untouched.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/detail/base/parallel.hpp>
#include <kvevict/detail/base/softmax.hpp>
#include <kvevict/numeric.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/weight_types.hpp>
#include <kvevict/detail/base/stage_math.hpp>
#include <kvevict/detail/host/norm_host.hpp>

#include <cstdint>
#include <type_traits>

namespace kvevict {

namespace detail {
/// mode inside the value_weight enum.
inline status check_weight_mode(const char* fn, value_weight mode) {
  const int m = static_cast<int>(mode);
  if (m < 0 || m > 1) return status::error(errc::invalid_argument, "%s: unknown value_weight value %d", fn, m);
  return {};
}

/// Views, mode and shapes of weight_by_value_norm (everything but the lengths' values), shared by
/// every backend.
template <class VE>
status check_weight_by_value_norm(const char* fn, const matrix_view<float>& scores, const kv_view<const VE>& values,
                                  value_weight mode) {
  KVEVICT_TRY(check_view(fn, "scores", scores));
  KVEVICT_TRY(check_view(fn, "values", values));
  KVEVICT_TRY(check_weight_mode(fn, mode));
  const index_t rows = scores.extent(0), cols = scores.extent(1);
  const index_t hkv = values.extent(0), tokens = values.extent(1);
  if (hkv == 0 ? rows != 0 : rows % hkv != 0)
    return status::error(errc::shape_mismatch, "%s: scores have %lld rows, not a multiple of the %lld KV heads of values",
                         fn, static_cast<long long>(rows), static_cast<long long>(hkv));
  if (cols > tokens)
    return status::error(errc::shape_mismatch, "%s: scores have %lld columns but values hold only %lld tokens", fn,
                         static_cast<long long>(cols), static_cast<long long>(tokens));
  return {};
}

/// scores must not overlap values; lengths must not lie inside scores.
template <class VE>
status check_weight_overlap(const char* fn, const matrix_view<float>& scores, const kv_view<const VE>& values,
                            const std::int32_t* lengths) {
  if (range_of(scores).intersects(range_of(values)))
    return status::error(errc::overlap, "%s: scores overlap values in memory", fn);
  if (lengths_inside(lengths, values.extent(0), range_of(scores)))
    return status::error(errc::overlap, "%s: lengths lie inside scores", fn);
  return {};
}
}  // namespace detail

/// Multiplies scores by value L1 norms in place (see the file comment for shapes and semantics).
///
/// NaN/inf: NaN scores stay NaN. A NaN value element makes its token's norm NaN: with per_token
/// that token's score becomes NaN; with head_max the head's factor is NaN (the max propagates NaN)
/// and every weighted score of the head becomes NaN. An infinite norm multiplies to +-inf (NaN for
/// a zero score).
///
/// Errors (nothing written): invalid views; R not a multiple of H_kv; T_s > T; lengths[h] outside
/// [0, T]; unknown mode; scores overlapping values; lengths stored inside scores. No workspace, no
/// allocation.
template <class Backend, class V>
status weight_by_value_norm(Backend be, matrix_view<float> scores, kv_view<V> values_in, value_weight mode,
                            const std::int32_t* lengths = nullptr) {
  static_assert(is_kv_element_v<V>, "weight_by_value_norm: values must be float, float16 or bfloat16");
  using VE = std::remove_const_t<V>;
  constexpr const char* fn = "weight_by_value_norm";
  const kv_view<const VE> values = values_in;
  KVEVICT_TRY(detail::check_weight_by_value_norm(fn, scores, values, mode));
  const index_t rows = scores.extent(0), cols = scores.extent(1);
  const index_t hkv = values.extent(0), tokens = values.extent(1), d = values.extent(2);
  KVEVICT_TRY(detail::check_lengths(fn, "lengths", lengths, hkv, tokens));
  KVEVICT_TRY(detail::check_weight_overlap(fn, scores, values, lengths));
  if (rows == 0 || cols == 0) return {};
  const index_t group = rows / hkv;
  float* const sd = scores.data_handle();
  const index_t s0 = scores.stride(0), s1 = scores.stride(1);
  const index_t v0 = values.stride(0), v1 = values.stride(1), v2 = values.stride(2);
  const VE* const vd = values.data_handle();
  // one task per KV head: each norm is computed once and weights every row of the group
  detail::parallel_for(be, hkv, [&](index_t h) {
    const index_t len = lengths != nullptr ? lengths[h] : tokens;
    const index_t n = cols < len ? cols : len;
    const VE* vh = vd + h * v0;
    float norms[detail::norm_block];  // the norms of up to norm_block rows at a time (norm_host.hpp)
    if (mode == value_weight::head_max) {
      float mx = 0.0f;  // norms are >= 0; an empty head weights nothing
      for (index_t t0 = 0; t0 < len; t0 += detail::norm_block) {
        const index_t m = len - t0 < detail::norm_block ? len - t0 : detail::norm_block;
        detail::value_l1_norms(vh + t0 * v1, v1, v2, m, d, norms);
        mx = detail::max_nan_fold(mx, norms, m);
      }
      for (index_t r = h * group; r < (h + 1) * group; ++r)
        for (index_t j = 0; j < n; ++j) sd[r * s0 + j * s1] *= mx;
    } else {
      for (index_t j0 = 0; j0 < n; j0 += detail::norm_block) {
        const index_t m = n - j0 < detail::norm_block ? n - j0 : detail::norm_block;
        detail::value_l1_norms(vh + j0 * v1, v1, v2, m, d, norms);
        for (index_t r = h * group; r < (h + 1) * group; ++r)
          for (index_t j = 0; j < m; ++j) sd[r * s0 + (j0 + j) * s1] *= norms[j];
      }
    }
  });
  return {};
}

}  // namespace kvevict
