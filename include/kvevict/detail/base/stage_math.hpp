// The per-element functions of the score stages (GQA reduction, pooling's operators, value norms,
// protection, fp16/bf16 widening and the score columns' finalisation), host-device, shared by every backend: the host kernels, the block algorithms of
// detail/block/ and the CUDA kernels call exactly these, which is why their bits agree. The stages'
// public headers (gqa.hpp, pool.hpp, weight.hpp, protect.hpp) build on them. Not API.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/base/score_order.hpp>
#include <kvevict/detail/base/softmax.hpp>
#include <kvevict/gqa_types.hpp>
#include <kvevict/numeric.hpp>
#include <kvevict/score_types.hpp>
#include <kvevict/status.hpp>

#include <cmath>
#include <cstdint>

namespace kvevict::detail {

// ---- GQA reduction (gqa.hpp) ------------------------------------------------------------------

/// acc <- acc (op) x, for the j-th member of a group (j >= 1); acc starts as the member j = 0.
KVEVICT_HOST_DEVICE inline float gqa_combine(gqa_op op, float acc, float x) noexcept {
  return op == gqa_op::max ? total_order_max(acc, x) : acc + x;
}
/// The reduced score of a group of g members from its accumulator.
KVEVICT_HOST_DEVICE inline float gqa_finish(gqa_op op, float acc, index_t g) noexcept {
  return op == gqa_op::mean ? acc / static_cast<float>(g) : acc;
}
/// op is one of the gqa_op values (host check of every GQA entry point, host and CUDA).
inline status check_gqa_op(const char* fn, gqa_op op) {
  if (op != gqa_op::mean && op != gqa_op::max && op != gqa_op::sum)
    return status::error(errc::invalid_argument, "%s: op = %d is not a gqa_op (mean, max or sum)", fn,
                         static_cast<int>(op));
  return {};
}

// ---- pooling operators (pool.hpp) -------------------------------------------------------------

/// Max pooling works on score keys (detail/base/score_order.hpp): an unsigned max, branch-free, that
/// returns one of the inputs bit for bit. Between the passes the keys live in the output row.
struct pool_max_traits {
  using value = std::uint32_t;
  static constexpr bool is_max = true;
  KVEVICT_HOST_DEVICE static value load(float x) noexcept { return total_order_key(x); }
  KVEVICT_HOST_DEVICE static value op(value a, value b) noexcept { return a > b ? a : b; }
  KVEVICT_HOST_DEVICE static void stash(float* y, value v) noexcept { *y = bits_float(v); }
  KVEVICT_HOST_DEVICE static value unstash(const float* y) noexcept { return float_bits(*y); }
  KVEVICT_HOST_DEVICE static float finish(value v) noexcept { return total_order_from_key(v); }
};
/// Average pooling sums floats.
struct pool_sum_traits {
  using value = float;
  static constexpr bool is_max = false;
  KVEVICT_HOST_DEVICE static value load(float x) noexcept { return x; }
  KVEVICT_HOST_DEVICE static value op(value a, value b) noexcept { return a + b; }
  KVEVICT_HOST_DEVICE static void stash(float* y, value v) noexcept { *y = v; }
  KVEVICT_HOST_DEVICE static value unstash(const float* y) noexcept { return *y; }
  KVEVICT_HOST_DEVICE static float finish(value v) noexcept { return v; }
};

// ---- value norms (weight.hpp) -----------------------------------------------------------------

/// ||v||_1 of one value row: sequential fp32 sum of |v_t| over t = 0..d-1 (identical on every
/// backend). NaN in v gives NaN.
/// s + |v_0| + |v_1| + ... + |v_{n-1}|, added left to right: value_l1_norm continued over a further
/// piece of the row (the CUDA kernels stage rows through shared memory in pieces).
template <class V>
KVEVICT_HOST_DEVICE inline float value_l1_accumulate(float s, const V* v, index_t n, index_t stride) {
  for (index_t t = 0; t < n; ++t) s += bits_float(float_bits(to_float(v[t * stride])) & 0x7fffffffu);
  return s;
}
template <class V>
KVEVICT_HOST_DEVICE inline float value_l1_norm(const V* v, index_t d, index_t stride) {
  return value_l1_accumulate(0.0f, v, d, stride);
}

// ---- key norms (score.hpp's key_norm_scores) ----------------------------------------------------

/// key_sq_accumulate: s + k_0^2 + ... + k_{n-1}^2 left to right (key_norm_score continued over a
/// further piece of the row, for kernels that stage rows in pieces).
/// -||k||_2 of one key row: sequential fp32 sum of squares over d, then sqrt (correctly rounded
/// everywhere, so identical on every backend; mul_rn/add_rn keep nvcc from fusing the terms).
/// Overflows to -inf only for |k| beyond ~1.8e19.
template <class K>
KVEVICT_HOST_DEVICE inline float key_sq_accumulate(float s, const K* k, index_t n, index_t stride) {
  for (index_t t = 0; t < n; ++t) {
    const float x = to_float(k[t * stride]);
    s = add_rn(s, mul_rn(x, x));
  }
  return s;
}
template <class K>
KVEVICT_HOST_DEVICE inline float key_norm_score(const K* k, index_t d, index_t stride) {
  return -sqrtf(key_sq_accumulate(0.0f, k, d, stride));
}

// ---- protection (protect.hpp) -----------------------------------------------------------------

/// The protected score of position t of a row whose protected positions are [0, sink_end) and
/// [recent_begin, n): +inf there, FLT_MAX for any other +inf, v unchanged otherwise.
KVEVICT_HOST_DEVICE inline float protect_value(float v, index_t t, index_t sink_end, index_t recent_begin) {
  const float inf = bits_float(0x7f800000u);  // +inf
  const float top = bits_float(0x7f7fffffu);  // FLT_MAX
  if (t < sink_end || t >= recent_begin) return inf;
  return v == inf ? top : v;
}

/// First position after the sinks of a row of n: min(n_sink, n).
KVEVICT_HOST_DEVICE inline index_t protect_sink_end(index_t n, index_t n_sink) { return n_sink < n ? n_sink : n; }
/// First position of the recent window of a row of n: max(0, n - n_recent).
KVEVICT_HOST_DEVICE inline index_t protect_recent_begin(index_t n, index_t n_recent) {
  return n_recent < n ? n - n_recent : 0;
}

/// One row of protect(): n scores with stride s.
KVEVICT_HOST_DEVICE inline void protect_row(float* row, index_t s, index_t n, index_t n_sink, index_t n_recent) {
  const index_t sink_end = protect_sink_end(n, n_sink);
  const index_t recent_begin = protect_recent_begin(n, n_recent);
  for (index_t t = 0; t < n; ++t) {
    float& v = row[t * s];
    v = protect_value(v, t, sink_end, recent_begin);
  }
}

// ---- attention scores (score.hpp) -------------------------------------------------------------

/// Exact widening to fp32 written without branches, so packing loops vectorise (SSE2 is enough);
/// same values as to_float (tests/test_score.cpp checks all 65536 fp16 patterns; NaN payloads may
/// come out quieted). fp16 zero/subnormal m becomes (2^-14 + m 2^-24) - 2^-14, exact and free of
/// denormal operands (immune to DAZ/FTZ).
KVEVICT_HOST_DEVICE inline float widen_f16_bits(std::uint32_t h) noexcept {
  const std::uint32_t em = h & 0x7fffu;
  const std::uint32_t e = em & 0x7c00u;
  const std::uint32_t infnan = 0u - static_cast<std::uint32_t>(e == 0x7c00u);
  const std::uint32_t zsub = 0u - static_cast<std::uint32_t>(e == 0u);
  std::uint32_t u = (em << 13) + 0x38000000u;  // rebias the exponent, 15 -> 127
  u += infnan & 0x38000000u;                   // exponent 31 -> 255
  u += zsub & 0x00800000u;                     // zero/subnormal: 2^-14 + m 2^-24
  const float f = bits_float(u) - bits_float(zsub & 0x38800000u);  // minus 2^-14 (or 0)
  return bits_float(float_bits(f) | ((h & 0x8000u) << 16));
}
KVEVICT_HOST_DEVICE inline float widen_bf16_bits(std::uint32_t h) noexcept { return bits_float(h << 16); }

/// out[h][j] from the column's accumulators over the w rows: acc = sum of p (or the Welford mean for
/// mean_plus_variance, with m2 its sum of squared deviations); seen = rows that see the column. Shared
/// by every backend.
KVEVICT_HOST_DEVICE inline float score_finalize(score_reduce reduce, float acc, float m2, index_t w, index_t seen,
                                                float gamma, variance_estimator var) {
  switch (reduce) {
    case score_reduce::sum: return acc;
    case score_reduce::mean: return acc / static_cast<float>(w);
    case score_reduce::mean_visible: return acc / static_cast<float>(seen);
    case score_reduce::mean_plus_variance: {
      float v = 0.0f;
      if (var == variance_estimator::biased) v = m2 / static_cast<float>(w);
      else if (w > 1) v = m2 / static_cast<float>(w - 1);
      return add_rn(acc, mul_rn(gamma, v));
    }
  }
  return acc;
}

}  // namespace kvevict::detail
