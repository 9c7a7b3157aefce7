// Per-row softmax statistics and the per-column reductions of attention scores, shared by every
// backend (host seq/par and the CUDA kernels): plain float arithmetic, no std:: calls, so host tests
// exercise exactly the code the GPU runs.
//
//   softmax_exp(x)          e^x in fp32, ~1 ulp, bit-identical wherever it runs (no libm involved)
//   softmax_stats {max,sum} the (running max m, sum of e^(x-m)) pair of a set of logits
//   softmax_merge(a, b)     (m, s) ⊕ (m', s') = (M, s·e^(m-M) + s'·e^(m'-M)),  M = max(m, m')
//   welford_push            running mean / sum of squared deviations (CAKE's variance)
//
// Special values. Empty stats are {-inf, 0} (the identity of ⊕). A NaN anywhere makes the merged
// stats NaN (max and sum). Two +inf maxima give a NaN sum (inf - inf), as a softmax over a row
// holding +inf does in PyTorch. Stats whose max is -inf (no visible logit, or every logit -inf)
// have sum 0; probabilities derived from them are NaN (0/0), again like PyTorch's softmax of an
// all -inf row.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/numeric.hpp>

#include <cstdint>

// clang attaches FP-contraction rules to expressions when it parses them, so the functions whose
// bits must not depend on where they are inlined (the dispatched host kernels, see score_host.hpp)
// disable contraction in their own bodies. GCC's rule is per compiled function and is set there.
#if defined(__clang__)
#  define KVEVICT_FP_CONTRACT_OFF _Pragma("clang fp contract(off)")
#else
#  define KVEVICT_FP_CONTRACT_OFF
#endif

namespace kvevict::detail {

KVEVICT_HOST_DEVICE inline float neg_inf_f() noexcept { return bits_float(0xff800000u); }
KVEVICT_HOST_DEVICE inline float pos_inf_f() noexcept { return bits_float(0x7f800000u); }
KVEVICT_HOST_DEVICE inline float quiet_nan_f() noexcept { return bits_float(0x7fc00000u); }
KVEVICT_HOST_DEVICE inline bool is_nan_f(float x) noexcept { return x != x; }

/// Separately rounded fp32 product, sum and difference that no compiler fuses into a multiply-add.
/// nvcc contracts a*b+c into FMA by default (-fmad=true); in device code these are the __f*_rn
/// intrinsics, which it never contracts, so the functions below compute the same bits on the GPU as
/// on the host. On the host they are the plain operators (GCC decides contraction per compiled
/// function, clang per expression; see KVEVICT_FP_CONTRACT_OFF).
KVEVICT_HOST_DEVICE inline float mul_rn(float a, float b) noexcept {
#if KVEVICT_DEVICE_COMPILATION
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
KVEVICT_HOST_DEVICE inline float add_rn(float a, float b) noexcept {
#if KVEVICT_DEVICE_COMPILATION
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
KVEVICT_HOST_DEVICE inline float sub_rn(float a, float b) noexcept {
#if KVEVICT_DEVICE_COMPILATION
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

/// e^x for every float x, computed with float arithmetic only (so the result does not depend on
/// the platform's libm): x = n·ln2 + r with |r| <= ln2/2 (Cody-Waite split of ln2), e^r by its
/// degree-7 Taylor polynomial (truncation error < 6e-9 relative), times 2^n built from exponent
/// bits as 2^(n>>1)·2^(n-(n>>1)) so both factors stay normal. Measured error over the whole
/// range: <= 2 ulp against a double-precision exp (tests/test_score.cpp).
/// e^-inf = 0, e^+inf = +inf, e^NaN = NaN; results below 2^-149 round to 0, above FLT_MAX to inf.
/// Written branch-free so the host loops that call it vectorise (SSE2 is enough). Its products and
/// sums are mul_rn/add_rn, which nvcc never fuses, so device code gets the host's bits; on the host
/// a compiler allowed to contract a*b+c into FMA (g++ with FMA instructions enabled and the GNU
/// dialect's -ffp-contract=fast) may still change the last bit.
KVEVICT_HOST_DEVICE inline float softmax_exp(float x) noexcept {
  KVEVICT_FP_CONTRACT_OFF
  // clamp to [-104, 88.75] on the bit pattern (integer selects vectorise where float ones do not),
  // leaving NaN untouched: below covers (-inf, -104) and -inf, above (88.75, +inf] (NaN bit
  // patterns lie outside both ranges)
  std::uint32_t xb = float_bits(x);
  constexpr std::uint32_t lo_bits = 0xC2D00000u;  // -104.0f: e^-104 < 2^-150 rounds to 0 below
  constexpr std::uint32_t hi_bits = 0x42B18000u;  // 88.75f: e^88.75 > FLT_MAX rounds to inf below
  const std::uint32_t below = static_cast<std::uint32_t>((xb > lo_bits) & (xb <= 0xFF800000u));
  const std::uint32_t above = static_cast<std::uint32_t>((xb > hi_bits) & (xb <= 0x7F800000u));
  xb ^= (xb ^ lo_bits) & (0u - below);
  xb ^= (xb ^ hi_bits) & (0u - above);
  x = bits_float(xb);
  constexpr float log2e = 1.44269504088896341f;
  constexpr float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer (nearest even)
  const float t = add_rn(mul_rn(x, log2e), magic);
  const float n = sub_rn(t, magic);  // round(x / ln2), exact
  std::int32_t ni = static_cast<std::int32_t>(float_bits(t) - float_bits(magic));  // the same n as an integer
  constexpr float ln2_hi = 0.693359375f;     // 355/512: n * ln2_hi is exact for |n| < 2^15
  constexpr float ln2_lo = -2.12194440e-4f;  // ln2 - ln2_hi
  const float r = sub_rn(sub_rn(x, mul_rn(n, ln2_hi)), mul_rn(n, ln2_lo));
  // e^r, Horner form of sum r^k/k!, k = 0..7
  float p = 1.0f / 5040.0f;
  p = add_rn(mul_rn(p, r), 1.0f / 720.0f);
  p = add_rn(mul_rn(p, r), 1.0f / 120.0f);
  p = add_rn(mul_rn(p, r), 1.0f / 24.0f);
  p = add_rn(mul_rn(p, r), 1.0f / 6.0f);
  p = add_rn(mul_rn(p, r), 0.5f);
  p = add_rn(mul_rn(p, r), 1.0f);
  p = add_rn(mul_rn(p, r), 1.0f);
  const std::int32_t n1 = ni >> 1;  // arithmetic shift: floor(n/2), both factors in [-75, 64]
  const std::int32_t n2 = ni - n1;
  const float s1 = bits_float(static_cast<std::uint32_t>(n1 + 127) << 23);
  const float s2 = bits_float(static_cast<std::uint32_t>(n2 + 127) << 23);
  return mul_rn(mul_rn(p, s1), s2);
}

/// Softmax statistics of a set of logits: max m and sum of e^(x - m).
struct softmax_stats {
  float max;
  float sum;
};

/// Statistics of the empty set: the identity of softmax_merge.
KVEVICT_HOST_DEVICE inline softmax_stats softmax_empty() noexcept { return {neg_inf_f(), 0.0f}; }

/// (m, s) ⊕ (m', s') = (M, s·e^(m-M) + s'·e^(m'-M)) with M = max(m, m'). Associative and
/// commutative up to rounding; exact when one side is empty. NaN in either side gives NaN.
KVEVICT_HOST_DEVICE inline softmax_stats softmax_merge(softmax_stats a, softmax_stats b) noexcept {
  KVEVICT_FP_CONTRACT_OFF
  if (is_nan_f(a.max) || is_nan_f(b.max)) return {quiet_nan_f(), quiet_nan_f()};
  const float m = a.max > b.max ? a.max : b.max;
  if (m == neg_inf_f()) return {m, a.sum + b.sum};  // both empty (or all -inf): no rescaling
  // e^(-inf - m) = 0 for the empty side; e^(inf - inf) = NaN when both maxima are +inf
  return {m, add_rn(mul_rn(a.sum, softmax_exp(sub_rn(a.max, m))), mul_rn(b.sum, softmax_exp(sub_rn(b.max, m))))};
}

/// Adds one logit to running statistics (online softmax): stats ⊕ {x, 1}.
KVEVICT_HOST_DEVICE inline softmax_stats softmax_push(softmax_stats s, float x) noexcept {
  if (x == neg_inf_f() && !is_nan_f(s.max)) return s;  // e^-inf = 0 adds nothing
  return softmax_merge(s, softmax_stats{x, 1.0f});
}

/// The probability of logit x in the row described by s: e^(x - m) / sum. Not finite for empty
/// stats (no visible logit) and NaN for NaN stats.
KVEVICT_HOST_DEVICE inline float softmax_prob(softmax_stats s, float x) noexcept {
  return softmax_exp(sub_rn(x, s.max)) / s.sum;
}

/// NaN-propagating maximum (once a NaN is seen it stays).
KVEVICT_HOST_DEVICE inline float max_nan(float m, float x) noexcept { return (x > m || is_nan_f(x)) ? x : m; }

/// A signed integer whose order is the order of the floats (-0 < +0, NaN with the sign bit set
/// below -inf, other NaN above +inf). Integer maxima vectorise where float ones (with their NaN
/// rules) do not, and are exact.
KVEVICT_HOST_DEVICE inline std::int32_t float_order_key(float x) noexcept {
  const std::int32_t i = static_cast<std::int32_t>(float_bits(x));
  return i ^ ((i >> 31) & 0x7fffffff);
}
KVEVICT_HOST_DEVICE inline float float_from_order_key(std::int32_t k) noexcept {
  return bits_float(static_cast<std::uint32_t>(k ^ ((k >> 31) & 0x7fffffff)));
}

/// Welford's update of a running mean and sum of squared deviations with the n-th value x
/// (inv_n = 1/n, n counted from 1). Numerically stable for the small, similar probabilities of a
/// window; used for CAKE's mean + gamma * variance.
KVEVICT_HOST_DEVICE inline void welford_push(float& mean, float& m2, float x, float inv_n) noexcept {
  KVEVICT_FP_CONTRACT_OFF
  const float delta = sub_rn(x, mean);
  mean = add_rn(mean, mul_rn(delta, inv_n));
  m2 = add_rn(m2, mul_rn(delta, sub_rn(x, mean)));
}

}  // namespace kvevict::detail
