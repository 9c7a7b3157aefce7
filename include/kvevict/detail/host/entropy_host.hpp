// Host kernels of the entropy statistics: cake_layer_stats' per-head rows (budget/cake.hpp) and
// lava_layer_entropy's per-head sums (budget/lava.hpp). Nothing here is API; docs/budget.md
// ("Summation order and logarithm") states what they compute.
//
// Every value is defined by separately rounded double operations in a fixed order, so the result
// does not depend on the ISA, the compiler's vectorisation, the backend or the thread count:
//   - the logarithm is entropy_log below (double arithmetic only, no libm), not std::log;
//   - every sum over a head's entries runs in 8 lanes: the k-th entry of the sum goes to lane
//     k mod 8, each lane adds its entries in order, and the lanes are combined as
//     ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) (lane_total);
//   - CAKE: the entries of a head are visited in blocks of cake_block columns (column j's lane is
//     j mod 8), within a block window row by window row, within a row by column: so lane l adds
//     the terms of its columns in (block, row, column) order. Per column, the mean (sum over the
//     rows in order, / w) and the squared deviations (in row order) are as before.
// The loops are written so that GCC and clang vectorise them across columns; they run in three
// copies on x86-64 (SSE2, AVX2, AVX-512F, chosen at run time like the score kernels), all compiled
// without FMA contraction, so every copy computes the same operations and gives identical bits
// (tests/test_budget.cpp compares each against a scalar model of these definitions).
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/host/score_host.hpp>
#include <kvevict/numeric.hpp>

#include <cmath>
#include <cstdint>

namespace kvevict::detail {
KVEVICT_SCORE_ABI_BEGIN

/// log(m · 2^e) for m in [sqrt(1/2), sqrt(2)] and an integer e (as a double): with s = (m-1)/(m+1),
/// log m = 2 atanh(s) = 2s (1 + s²/3 + ... + s^18/19) (|s| <= 0.1716: the first omitted term is
/// < 2.3e-17 of the sum), plus e·ln2 with ln2 split into a high part whose products with |e| < 2^11
/// are exact and a low part. Error about 2 ulp (tests/test_budget.cpp measures it against long
/// double). Double arithmetic only, branch-free.
KVEVICT_ALWAYS_INLINE double entropy_log_reduced(double m, double e) noexcept {
  KVEVICT_FP_CONTRACT_OFF
  constexpr double ln2_hi = 6.93147180369123816490e-01;  // 0x3fe62e42fee00000
  constexpr double ln2_lo = 1.90821492927058770002e-10;  // ln2 - ln2_hi
  const double s = (m - 1.0) / (m + 1.0);
  const double z = s * s;
  double p = 1.0 / 19.0;
  p = p * z + 1.0 / 17.0;
  p = p * z + 1.0 / 15.0;
  p = p * z + 1.0 / 13.0;
  p = p * z + 1.0 / 11.0;
  p = p * z + 1.0 / 9.0;
  p = p * z + 1.0 / 7.0;
  p = p * z + 1.0 / 5.0;
  p = p * z + 1.0 / 3.0;
  const double s2 = s + s;
  return e * ln2_hi + (e * ln2_lo + (s2 + s2 * (z * p)));
}

/// c ? a : b on integers by masks (a ternary lets GCC move the computation of an operand into a
/// branch, which stops the vectorisation of the loop around it).
KVEVICT_ALWAYS_INLINE std::uint32_t select_bits(bool c, std::uint32_t a, std::uint32_t b) noexcept {
  return b ^ ((a ^ b) & (0u - static_cast<std::uint32_t>(c)));
}

/// log x for a float x > 0 (subnormals included; +inf and NaN give unspecified finite values).
KVEVICT_ALWAYS_INLINE double entropy_log(float x) noexcept {
  KVEVICT_FP_CONTRACT_OFF
  // (every operation unconditional, the selects on integers: the loops calling this vectorise)
  const std::uint32_t raw = float_bits(x), scaled = float_bits(x * 16777216.0f);
  const bool sub = raw < 0x00800000u;  // subnormal: scaled by 2^24 (exact)
  const std::uint32_t b = select_bits(sub, scaled, raw);
  const std::uint32_t mant = b & 0x007fffffu;
  const bool high = mant > 0x003504f3u;  // mantissa above sqrt(2): halve it
  const float m = bits_float(mant | select_bits(high, 0x3f000000u, 0x3f800000u));
  const std::int32_t e = static_cast<std::int32_t>(b >> 23) - 127 - 24 * static_cast<std::int32_t>(sub) +
                         static_cast<std::int32_t>(high);
  return entropy_log_reduced(static_cast<double>(m), static_cast<double>(e));
}

/// log x for a finite double x > 0 (the once-per-layer logarithms).
inline double entropy_log(double x) noexcept {
  KVEVICT_FP_CONTRACT_OFF
  int e = 0;
  double m = std::frexp(x, &e);  // x = m 2^e, m in [0.5, 1): exact
  if (m < 0.70710678118654752440) {
    m = m + m;
    e -= 1;
  }
  return entropy_log_reduced(m, static_cast<double>(e));
}

/// The 8 lanes of a sum combined in the fixed order ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
inline double lane_total(const double* l) noexcept { return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])); }

/// Adds t[0, n) to lanes (entry k to lane (first + k) mod 8, first a multiple of 8 for the
/// vectorised part); `sign` -1 subtracts.
template <bool Subtract>
KVEVICT_ALWAYS_INLINE void lanes_add(double* KVEVICT_RESTRICT lanes, const double* KVEVICT_RESTRICT t, index_t n) noexcept {
  index_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int l = 0; l < 8; ++l) lanes[l] = Subtract ? lanes[l] - t[k + l] : lanes[l] + t[k + l];
  for (; k < n; ++k) lanes[k & 7] = Subtract ? lanes[k & 7] - t[k] : lanes[k & 7] + t[k];
}

/// Columns per CAKE block (a multiple of 8): w rows of it stay in L1 for the variance's second pass.
constexpr index_t cake_block = 256;

/// One CAKE head: entropy lanes (-= p log p, p > 0) and variance lanes (+= m2_j / div), over
/// base[i si + j sj], i < w, j < C; `any_bad` set when a value is not in [0, 1] (then the lanes are
/// unspecified). var_div <= 0: no variance.
template <bool Unit>
KVEVICT_ALWAYS_INLINE void cake_head_body(const float* base, index_t w, index_t C, index_t si, index_t sj,
                                          double var_div, double* KVEVICT_RESTRICT ent,
                                          double* KVEVICT_RESTRICT var, bool* any_bad) noexcept {
  KVEVICT_FP_CONTRACT_OFF
  alignas(64) double mean[cake_block], m2[cake_block], term[cake_block];
  const double wd = static_cast<double>(w);
  int bad = 0;
  for (index_t j0 = 0; j0 < C; j0 += cake_block) {
    const index_t n = C - j0 < cake_block ? C - j0 : cake_block;
    for (index_t j = 0; j < n; ++j) mean[j] = 0.0;
    for (index_t i = 0; i < w; ++i) {
      const float* KVEVICT_RESTRICT row = base + i * si + j0 * sj;
      for (index_t j = 0; j < n; ++j) {
        const float p = row[Unit ? j : j * sj];
        const std::uint32_t u = float_bits(p);
        bad |= u > 0x3f800000u && u != 0x80000000u;  // not in [0, 1] (-0 is)
        mean[j] += static_cast<double>(p);
        // p log p for p > 0; p = +-0 gives a zero term (log 1 = 0) that leaves the lane unchanged (the
        // select is on the argument: a select of the product would stop the vectorisation)
        term[j] = static_cast<double>(p) * entropy_log(bits_float(select_bits(static_cast<std::int32_t>(u) > 0, u, 0x3f800000u)));
      }
      lanes_add<true>(ent, term, n);
    }
    if (var_div > 0.0) {
      for (index_t j = 0; j < n; ++j) {
        mean[j] /= wd;
        m2[j] = 0.0;
      }
      for (index_t i = 0; i < w; ++i) {
        const float* KVEVICT_RESTRICT row = base + i * si + j0 * sj;
        for (index_t j = 0; j < n; ++j) {
          const double d = static_cast<double>(row[Unit ? j : j * sj]) - mean[j];
          m2[j] += d * d;
        }
      }
      for (index_t j = 0; j < n; ++j) term[j] = m2[j] / var_div;
      lanes_add<false>(var, term, n);
    }
  }
  *any_bad = bad != 0;
}

/// One LAVa head's columns x[k sx], k < n: pass 1 (inv_s == 0: lanes += x, `any_bad` when a value is
/// NaN, negative or +inf) or pass 2 (lanes += (x inv_s)(log x - log_s) for x > 0).
template <bool Unit>
KVEVICT_ALWAYS_INLINE void lava_head_body(const float* KVEVICT_RESTRICT x, index_t n, index_t sx, double inv_s,
                                          double log_s, double* KVEVICT_RESTRICT lanes, bool* any_bad) noexcept {
  KVEVICT_FP_CONTRACT_OFF
  constexpr index_t block = 512;
  alignas(64) double term[block];
  int bad = 0;
  for (index_t k0 = 0; k0 < n; k0 += block) {
    const index_t m = n - k0 < block ? n - k0 : block;
    const float* KVEVICT_RESTRICT xs = x + k0 * sx;
    if (inv_s == 0.0) {
      for (index_t k = 0; k < m; ++k) {
        const float v = xs[Unit ? k : k * sx];
        const std::uint32_t u = float_bits(v);
        bad |= u >= 0x7f800000u && u != 0x80000000u;  // NaN, negative or +inf (-0 is fine)
        term[k] = static_cast<double>(v);
      }
    } else {
      for (index_t k = 0; k < m; ++k) {
        const float v = xs[Unit ? k : k * sx];
        const std::uint32_t u = float_bits(v);  // v = +-0 (log of 1 taken instead): a zero term
        term[k] = (static_cast<double>(v) * inv_s) *
                  (entropy_log(bits_float(select_bits(static_cast<std::int32_t>(u) > 0, u, 0x3f800000u))) - log_s);
      }
    }
    lanes_add<false>(lanes, term, m);
  }
  *any_bad = bad != 0;
}

#define KVEVICT_CAKE_HEAD_ARGS                                                                              \
  const float *base, index_t w, index_t C, index_t si, index_t sj, double var_div, double *KVEVICT_RESTRICT ent, \
      double *KVEVICT_RESTRICT var, bool *any_bad
#define KVEVICT_CAKE_HEAD_CALL base, w, C, si, sj, var_div, ent, var, any_bad
#define KVEVICT_LAVA_HEAD_ARGS                                                                                   \
  const float *KVEVICT_RESTRICT x, index_t n, index_t sx, double inv_s, double log_s, double *KVEVICT_RESTRICT lanes, \
      bool *any_bad
#define KVEVICT_LAVA_HEAD_CALL x, n, sx, inv_s, log_s, lanes, any_bad

// One CAKE and one LAVa head kernel per instruction set (`attrs`: its target attribute): the same
// bodies, compiled for each, chosen at run time.
#define KVEVICT_ENTROPY_HEAD_KERNELS(isa, attrs)                                       \
  attrs KVEVICT_NO_CONTRACT inline void cake_head_##isa(KVEVICT_CAKE_HEAD_ARGS) {      \
    if (sj == 1) cake_head_body<true>(KVEVICT_CAKE_HEAD_CALL);                         \
    else cake_head_body<false>(KVEVICT_CAKE_HEAD_CALL);                                \
  }                                                                                    \
  attrs KVEVICT_NO_CONTRACT inline void lava_head_##isa(KVEVICT_LAVA_HEAD_ARGS) {      \
    if (sx == 1) lava_head_body<true>(KVEVICT_LAVA_HEAD_CALL);                         \
    else lava_head_body<false>(KVEVICT_LAVA_HEAD_CALL);                                \
  }
KVEVICT_ENTROPY_HEAD_KERNELS(sse2, )
#if KVEVICT_SCORE_X86_DISPATCH
KVEVICT_ENTROPY_HEAD_KERNELS(avx2, __attribute__((target("avx2"))))
KVEVICT_ENTROPY_HEAD_KERNELS(avx512, __attribute__((target("avx512f,avx2"))))
#endif
#undef KVEVICT_ENTROPY_HEAD_KERNELS

/// The profile of the entropy and value-norm kernels (norm_host.hpp): score_isa_supported() unless a
/// test forces a lower one (< 0: none forced).
inline std::atomic<int>& host_kernel_isa_override() noexcept {
  static std::atomic<int> forced{-1};
  return forced;
}
inline score_isa host_kernel_isa() noexcept {
  const int f = host_kernel_isa_override().load(std::memory_order_relaxed);
  const score_isa best = score_isa_supported();
  return f >= 0 && f <= static_cast<int>(best) ? static_cast<score_isa>(f) : best;
}

inline void cake_head(KVEVICT_CAKE_HEAD_ARGS) {
#if KVEVICT_SCORE_X86_DISPATCH
  switch (host_kernel_isa()) {
    case score_isa::avx512: return cake_head_avx512(KVEVICT_CAKE_HEAD_CALL);
    case score_isa::avx2: return cake_head_avx2(KVEVICT_CAKE_HEAD_CALL);
    default: break;
  }
#endif
  cake_head_sse2(KVEVICT_CAKE_HEAD_CALL);
}
inline void lava_head_pass(KVEVICT_LAVA_HEAD_ARGS) {
#if KVEVICT_SCORE_X86_DISPATCH
  switch (host_kernel_isa()) {
    case score_isa::avx512: return lava_head_avx512(KVEVICT_LAVA_HEAD_CALL);
    case score_isa::avx2: return lava_head_avx2(KVEVICT_LAVA_HEAD_CALL);
    default: break;
  }
#endif
  lava_head_sse2(KVEVICT_LAVA_HEAD_CALL);
}
#undef KVEVICT_CAKE_HEAD_ARGS
#undef KVEVICT_CAKE_HEAD_CALL
#undef KVEVICT_LAVA_HEAD_ARGS
#undef KVEVICT_LAVA_HEAD_CALL

KVEVICT_SCORE_ABI_END
}  // namespace kvevict::detail
