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
// (tests/test_budget.cpp compares each against a scalar model of these definitions). The AVX2 and
// AVX-512F copies run the unit-stride loops of entropy_vec below (the logarithms of 8 vectors side
// by side; AVX-512F splits m and e by getmant / getexp), the SSE2 copy and strided views the scalar
// loops.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/host/score_host.hpp>
#include <kvevict/numeric.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>

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

/// entropy_log of the float with bits u when it is positive, else of 1.0f (0: a zero term for +-0;
/// the select is on the argument, so the loops calling this vectorise).
KVEVICT_ALWAYS_INLINE double entropy_log_bits(std::uint32_t u) noexcept {
  return entropy_log(bits_float(select_bits(static_cast<std::int32_t>(u) > 0, u, 0x3f800000u)));
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

#if KVEVICT_HOST_X86_DISPATCH
// The AVX2 / AVX-512F copies' unit-stride loops, written with GCC / clang vector extensions: 8
// columns per vector (a double vector of 8 lanes: one zmm, two ymm), and the logarithms of `chains`
// such vectors evaluated step by step side by side (log_reduced_chains), so that the division and the
// Horner chain of one vector overlap those of the others (the scalar loops vectorised by the
// compiler evaluate one vector's chain after the other, and the core waited on its latency: round
// eight's profile in docs/PERFORMANCE.md). Every element still goes through the operations of
// entropy_log(float) above in their order (integer selects, exact conversions, the same double
// operations, no contraction), and every lane receives its terms in the documented order, so the
// results are the scalar loops' bits (tests/test_budget.cpp).
// (the 64-byte vectors never cross a call by value: only by reference or inlined into the kernels,
// so GCC's ABI note does not apply; the note is off until after those kernels)
#  pragma GCC diagnostic push
#  pragma GCC diagnostic ignored "-Wpsabi"
namespace entropy_vec {
typedef double vd8 __attribute__((vector_size(64)));
typedef float vf8 __attribute__((vector_size(32)));
typedef std::uint32_t vu8 __attribute__((vector_size(32)));
typedef std::int32_t vi8 __attribute__((vector_size(32)));
constexpr int chains = 8;  ///< vectors whose logarithms are evaluated side by side

// (vectors only through references: a vector returned by value is what GCC's ABI note is about)
KVEVICT_ALWAYS_INLINE void load_bits8(const float* p, vu8& v) noexcept { std::memcpy(&v, p, sizeof v); }
KVEVICT_ALWAYS_INLINE void load8(const double* p, vd8& v) noexcept { std::memcpy(&v, p, sizeof v); }
KVEVICT_ALWAYS_INLINE void store8(double* p, const vd8& v) noexcept { std::memcpy(p, &v, sizeof v); }
/// select_bits on 8 lanes (c: all ones or zero per lane).
KVEVICT_ALWAYS_INLINE void select8(const vi8& c, const vu8& a, const vu8& b, vu8& out) noexcept {
  out = b ^ ((a ^ b) & reinterpret_cast<const vu8&>(c));
}
/// The float x's of entropy_log(float) on 8 lanes (raw bits; + 0 and non-positive lanes replaced by
/// 1.0f as the callers do), as (m, e) for entropy_log_reduced.
KVEVICT_ALWAYS_INLINE void log_split8(const vu8& u, vd8& m, vd8& e) noexcept {
  KVEVICT_FP_CONTRACT_OFF
  const vu8 one = vu8{} + 0x3f800000u, half = vu8{} + 0x3f000000u;
  const vi8 pos = reinterpret_cast<const vi8&>(u) > 0;
  vu8 raw, b, mb;
  select8(pos, u, one, raw);
  vf8 x;
  std::memcpy(&x, &raw, sizeof x);
  const vf8 xs = x * 16777216.0f;
  vu8 scaled;
  std::memcpy(&scaled, &xs, sizeof scaled);
  const vi8 sub = raw < 0x00800000u;  // -1 where subnormal
  select8(sub, scaled, raw, b);
  const vu8 mant = b & 0x007fffffu;
  const vi8 high = mant > 0x003504f3u;  // -1 where the mantissa is halved
  select8(high, half, one, mb);
  mb |= mant;
  vf8 mf;
  std::memcpy(&mf, &mb, sizeof mf);
  // (b >> 23) - 127 - 24 sub + high, with sub and high as 0 / 1 (the masks are 0 / -1)
  const vi8 ex = __builtin_convertvector(b >> 23, vi8) - 127 + 24 * sub - high;
  m = __builtin_convertvector(mf, vd8);
  e = __builtin_convertvector(ex, vd8);
}
/// entropy_log_reduced on `chains` vectors, each step for all of them before the next.
KVEVICT_ALWAYS_INLINE void log_reduced_chains(const vd8* m, const vd8* e, vd8* out) noexcept {
  KVEVICT_FP_CONTRACT_OFF
  constexpr double ln2_hi = 6.93147180369123816490e-01, ln2_lo = 1.90821492927058770002e-10;
  vd8 s[chains], z[chains], p[chains];
  for (int c = 0; c < chains; ++c) s[c] = (m[c] - 1.0) / (m[c] + 1.0);
  for (int c = 0; c < chains; ++c) z[c] = s[c] * s[c];
  for (int c = 0; c < chains; ++c) p[c] = (vd8{} + 1.0 / 19.0) * z[c] + 1.0 / 17.0;
  for (int c = 0; c < chains; ++c) p[c] = p[c] * z[c] + 1.0 / 15.0;
  for (int c = 0; c < chains; ++c) p[c] = p[c] * z[c] + 1.0 / 13.0;
  for (int c = 0; c < chains; ++c) p[c] = p[c] * z[c] + 1.0 / 11.0;
  for (int c = 0; c < chains; ++c) p[c] = p[c] * z[c] + 1.0 / 9.0;
  for (int c = 0; c < chains; ++c) p[c] = p[c] * z[c] + 1.0 / 7.0;
  for (int c = 0; c < chains; ++c) p[c] = p[c] * z[c] + 1.0 / 5.0;
  for (int c = 0; c < chains; ++c) p[c] = p[c] * z[c] + 1.0 / 3.0;
  for (int c = 0; c < chains; ++c) {
    const vd8 s2 = s[c] + s[c];
    out[c] = e[c] * ln2_hi + (e[c] * ln2_lo + (s2 + s2 * (z[c] * p[c])));
  }
}

/// Chains of 8 entries x[0, 8 chains): as doubles (v), and the (m, e) of entropy_log for the lanes
/// with a positive value (of 1.0f for the others, as the callers select); `bad` lanes set where a
/// value is not in [0, 1] (Check: CAKE's probabilities). The generic copy runs log_split8.
template <bool Check>
KVEVICT_ALWAYS_INLINE void split_chains(const float* KVEVICT_RESTRICT x, vd8* v, vd8* m, vd8* e, vi8& bad) noexcept {
  for (int c = 0; c < chains; ++c) {
    vu8 u;
    load_bits8(x + 8 * c, u);
    if constexpr (Check) bad |= (u > 0x3f800000u) & (u != 0x80000000u);
    vf8 f;
    std::memcpy(&f, &u, sizeof f);
    v[c] = __builtin_convertvector(f, vd8);
    log_split8(u, m[c], e[c]);
  }
}
/// The AVX-512F copy of split_chains: 16 floats per load, widened (exact: a subnormal float is a
/// normal double), m and e by getmant / getexp of the double. For every value the callers use (+0,
/// -0, positive finite floats; CAKE's or LAVa's bad values make the result unspecified and are
/// reported) these are the m and e of entropy_log(float): m the float's significand in [1, 2)
/// (subnormals normalised, as its 2^24 scaling does), halved above sqrt(2)'s float with e + 1, e
/// the unbiased exponent; both exact, so the same doubles enter entropy_log_reduced. 6 operations
/// per 8 lanes instead of log_split8's ~20 integer ones and the widening of two halves.
template <bool Check>
__attribute__((target("avx512f,avx2"))) KVEVICT_ALWAYS_INLINE void split_chains_avx512(const float* KVEVICT_RESTRICT x,
                                                                                      vd8* v, vd8* m, vd8* e,
                                                                                      __mmask16& bad) noexcept {
  const __m512d one = _mm512_set1_pd(1.0), half = _mm512_set1_pd(0.5), zero = _mm512_setzero_pd();
  const __m512d thr = _mm512_set1_pd(static_cast<double>(bits_float(0x3fb504f3u)));  // largest kept significand
  constexpr __mmask8 all = 0xFF;
  for (int h = 0; h < chains / 2; ++h) {
    const __m512i u = _mm512_loadu_si512(x + 16 * h);
    if constexpr (Check)
      bad = static_cast<__mmask16>(bad | (_mm512_cmpgt_epu32_mask(u, _mm512_set1_epi32(0x3f800000)) &
                                          _mm512_cmpneq_epi32_mask(u, _mm512_set1_epi32(INT32_MIN))));
    // (the masked forms with a full mask: GCC 12 warns falsely inside the plain intrinsics, as in
    // score_host.hpp)
    const __m512d d[2] = {_mm512_maskz_cvtps_pd(all, _mm256_castsi256_ps(_mm512_maskz_extracti64x4_epi64(all, u, 0))),
                          _mm512_maskz_cvtps_pd(all, _mm256_castsi256_ps(_mm512_maskz_extracti64x4_epi64(all, u, 1)))};
    for (int k = 0; k < 2; ++k) {
      const __m512d a = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(d[k], zero, _CMP_GT_OQ), one, d[k]);
      __m512d mm = _mm512_maskz_getmant_pd(all, a, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_zero);
      __m512d ee = _mm512_maskz_getexp_pd(all, a);
      const __mmask8 hi = _mm512_cmp_pd_mask(mm, thr, _CMP_GT_OQ);
      mm = _mm512_mask_mul_pd(mm, hi, mm, half);
      ee = _mm512_mask_add_pd(ee, hi, ee, one);
      v[2 * h + k] = reinterpret_cast<const vd8&>(d[k]);
      m[2 * h + k] = reinterpret_cast<const vd8&>(mm);
      e[2 * h + k] = reinterpret_cast<const vd8&>(ee);
    }
  }
}

/// The tails of cake_row and lava_pass2 (entries [j, n), fewer than a step's), as lanes_add's.
KVEVICT_ALWAYS_INLINE void cake_row_tail(const float* KVEVICT_RESTRICT row, index_t j, index_t n,
                                         double* KVEVICT_RESTRICT mean, vd8& ent, vi8& bad) noexcept {
  KVEVICT_FP_CONTRACT_OFF
  for (; j < n; ++j) {
    const float p = row[j];
    const std::uint32_t u = float_bits(p);
    bad[0] |= -static_cast<std::int32_t>(u > 0x3f800000u && u != 0x80000000u);
    mean[j] += static_cast<double>(p);
    ent[j & 7] = ent[j & 7] - static_cast<double>(p) * entropy_log_bits(u);
  }
}
KVEVICT_ALWAYS_INLINE void lava_pass2_tail(const float* KVEVICT_RESTRICT x, index_t k, index_t n, double inv_s,
                                           double log_s, vd8& lanes) noexcept {
  KVEVICT_FP_CONTRACT_OFF
  for (; k < n; ++k) {
    const std::uint32_t u = float_bits(x[k]);
    lanes[k & 7] = lanes[k & 7] + (static_cast<double>(x[k]) * inv_s) * (entropy_log_bits(u) - log_s);
  }
}
/// One step of cake_row: mean += p, then ent -= p log p chain by chain.
KVEVICT_ALWAYS_INLINE void cake_step(double* KVEVICT_RESTRICT mean, const vd8* p, const vd8* m, const vd8* e,
                                     vd8& ent) noexcept {
  KVEVICT_FP_CONTRACT_OFF
  vd8 lg[chains];
  for (int c = 0; c < chains; ++c) {
    vd8 mc;
    load8(mean + 8 * c, mc);
    store8(mean + 8 * c, mc + p[c]);
  }
  log_reduced_chains(m, e, lg);
  for (int c = 0; c < chains; ++c) ent = ent - p[c] * lg[c];
}
/// One step of lava_pass2: lanes += (v inv_s)(log v - log_s) chain by chain.
KVEVICT_ALWAYS_INLINE void lava_step(const vd8* v, const vd8* m, const vd8* e, double inv_s, double log_s,
                                     vd8& lanes) noexcept {
  KVEVICT_FP_CONTRACT_OFF
  vd8 lg[chains];
  log_reduced_chains(m, e, lg);
  for (int c = 0; c < chains; ++c) lanes = lanes + (v[c] * inv_s) * (lg[c] - log_s);
}

/// CAKE, one window row's columns row[0, n) of a block (the block starting at a multiple of 8):
/// mean[j] += p, ent lane (j mod 8) -= p log p (the lanes' vector), `bad` lanes set when a value
/// is not in [0, 1]; the same operations as cake_head_body's row loop and lanes_add.
KVEVICT_ALWAYS_INLINE void cake_row(const float* KVEVICT_RESTRICT row, index_t n, double* KVEVICT_RESTRICT mean,
                                    vd8& ent, vi8& bad) noexcept {
  index_t j = 0;
  for (; j + 8 * chains <= n; j += 8 * chains) {
    vd8 p[chains], m[chains], e[chains];
    split_chains<true>(row + j, p, m, e, bad);
    cake_step(mean + j, p, m, e, ent);
  }
  cake_row_tail(row, j, n, mean, ent, bad);
}
/// LAVa pass 2 over x[0, n): lane (k mod 8) += (x inv_s)(log x - log_s) (a zero term for +-0).
KVEVICT_ALWAYS_INLINE void lava_pass2(const float* KVEVICT_RESTRICT x, index_t n, double inv_s, double log_s,
                                      vd8& lanes) noexcept {
  index_t k = 0;
  vi8 none{};
  for (; k + 8 * chains <= n; k += 8 * chains) {
    vd8 v[chains], m[chains], e[chains];
    split_chains<false>(x + k, v, m, e, none);
    lava_step(v, m, e, inv_s, log_s, lanes);
  }
  lava_pass2_tail(x, k, n, inv_s, log_s, lanes);
}
// The AVX-512F copies (called, not inlined, from the generic bodies: GCC inlines a function with
// AVX-512 intrinsics only into one compiled for AVX-512).
__attribute__((target("avx512f,avx2"))) KVEVICT_NO_CONTRACT inline void cake_row_avx512(
    const float* KVEVICT_RESTRICT row, index_t n, double* KVEVICT_RESTRICT mean, vd8& ent, vi8& bad) noexcept {
  index_t j = 0;
  __mmask16 bad16 = 0;
  for (; j + 8 * chains <= n; j += 8 * chains) {
    vd8 p[chains], m[chains], e[chains];
    split_chains_avx512<true>(row + j, p, m, e, bad16);
    cake_step(mean + j, p, m, e, ent);
  }
  bad[0] |= -static_cast<std::int32_t>(bad16 != 0);
  cake_row_tail(row, j, n, mean, ent, bad);
}
__attribute__((target("avx512f,avx2"))) KVEVICT_NO_CONTRACT inline void lava_pass2_avx512(
    const float* KVEVICT_RESTRICT x, index_t n, double inv_s, double log_s, vd8& lanes) noexcept {
  index_t k = 0;
  __mmask16 none = 0;
  for (; k + 8 * chains <= n; k += 8 * chains) {
    vd8 v[chains], m[chains], e[chains];
    split_chains_avx512<false>(x + k, v, m, e, none);
    lava_step(v, m, e, inv_s, log_s, lanes);
  }
  lava_pass2_tail(x, k, n, inv_s, log_s, lanes);
}
}  // namespace entropy_vec
#endif

/// Columns per CAKE block (a multiple of 8): w rows of it stay in L1 for the variance's second pass.
constexpr index_t cake_block = 256;

/// One CAKE head: entropy lanes (-= p log p, p > 0) and variance lanes (+= m2_j / div), over
/// base[i si + j sj], i < w, j < C; `any_bad` set when a value is not in [0, 1] (then the lanes are
/// unspecified). var_div <= 0: no variance.
template <bool Unit, int Vec = 0>
KVEVICT_ALWAYS_INLINE void cake_head_body(const float* base, index_t w, index_t C, index_t si, index_t sj,
                                          double var_div, double* KVEVICT_RESTRICT ent,
                                          double* KVEVICT_RESTRICT var, bool* any_bad) noexcept {
  KVEVICT_FP_CONTRACT_OFF
  alignas(64) double mean[cake_block], m2[cake_block], term[cake_block];
  const double wd = static_cast<double>(w);
  int bad = 0;
#if KVEVICT_HOST_X86_DISPATCH
  entropy_vec::vd8 ent_v;
  entropy_vec::load8(ent, ent_v);
  entropy_vec::vi8 bad_v{};
#endif
  for (index_t j0 = 0; j0 < C; j0 += cake_block) {
    const index_t n = C - j0 < cake_block ? C - j0 : cake_block;
    for (index_t j = 0; j < n; ++j) mean[j] = 0.0;
    for (index_t i = 0; i < w; ++i) {
      const float* KVEVICT_RESTRICT row = base + i * si + j0 * sj;
#if KVEVICT_HOST_X86_DISPATCH
      if constexpr (Vec != 0) {
        if constexpr (Vec == 2) entropy_vec::cake_row_avx512(row, n, mean, ent_v, bad_v);
        else entropy_vec::cake_row(row, n, mean, ent_v, bad_v);
        continue;
      }
#endif
      for (index_t j = 0; j < n; ++j) {
        const float p = row[Unit ? j : j * sj];
        const std::uint32_t u = float_bits(p);
        bad |= u > 0x3f800000u && u != 0x80000000u;  // not in [0, 1] (-0 is)
        mean[j] += static_cast<double>(p);
        // p log p for p > 0; p = +-0 gives a zero term (log 1 = 0) that leaves the lane unchanged (the
        // select is on the argument: a select of the product would stop the vectorisation)
        term[j] = static_cast<double>(p) * entropy_log_bits(u);
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
#if KVEVICT_HOST_X86_DISPATCH
  if constexpr (Vec != 0) {
    entropy_vec::store8(ent, ent_v);
    for (int l = 0; l < 8; ++l) bad |= bad_v[l];
  }
#endif
  *any_bad = bad != 0;
}

/// One LAVa head's columns x[k sx], k < n: pass 1 (inv_s == 0: lanes += x, `any_bad` when a value is
/// NaN, negative or +inf) or pass 2 (lanes += (x inv_s)(log x - log_s) for x > 0).
template <bool Unit, int Vec = 0>
KVEVICT_ALWAYS_INLINE void lava_head_body(const float* KVEVICT_RESTRICT x, index_t n, index_t sx, double inv_s,
                                          double log_s, double* KVEVICT_RESTRICT lanes, bool* any_bad) noexcept {
  KVEVICT_FP_CONTRACT_OFF
#if KVEVICT_HOST_X86_DISPATCH
  if constexpr (Vec != 0) {
    if (inv_s != 0.0) {
      entropy_vec::vd8 l;
      entropy_vec::load8(lanes, l);
      if constexpr (Vec == 2) entropy_vec::lava_pass2_avx512(x, n, inv_s, log_s, l);
      else entropy_vec::lava_pass2(x, n, inv_s, log_s, l);
      entropy_vec::store8(lanes, l);
      *any_bad = false;
      return;
    }
  }
#endif
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
        term[k] = (static_cast<double>(v) * inv_s) * (entropy_log_bits(u) - log_s);
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
// (vec: the unit-stride loops of entropy_vec above, the same bits as the scalar loops)
#define KVEVICT_ENTROPY_HEAD_KERNELS(isa, attrs, vec)                                  \
  attrs KVEVICT_NO_CONTRACT inline void cake_head_##isa(KVEVICT_CAKE_HEAD_ARGS) {      \
    if (sj == 1) cake_head_body<true, vec>(KVEVICT_CAKE_HEAD_CALL);                    \
    else cake_head_body<false>(KVEVICT_CAKE_HEAD_CALL);                                \
  }                                                                                    \
  attrs KVEVICT_NO_CONTRACT inline void lava_head_##isa(KVEVICT_LAVA_HEAD_ARGS) {      \
    if (sx == 1) lava_head_body<true, vec>(KVEVICT_LAVA_HEAD_CALL);                    \
    else lava_head_body<false>(KVEVICT_LAVA_HEAD_CALL);                                \
  }
KVEVICT_ENTROPY_HEAD_KERNELS(sse2, , 0)
#if KVEVICT_HOST_X86_DISPATCH
KVEVICT_ENTROPY_HEAD_KERNELS(avx2, __attribute__((target("avx2"))), 1)
KVEVICT_ENTROPY_HEAD_KERNELS(avx512, __attribute__((target("avx512f,avx2"))), 2)
#  pragma GCC diagnostic pop
#endif
#undef KVEVICT_ENTROPY_HEAD_KERNELS

inline void cake_head(KVEVICT_CAKE_HEAD_ARGS) {
#if KVEVICT_HOST_X86_DISPATCH
  switch (host_isa_now()) {
    case host_isa::avx512: return cake_head_avx512(KVEVICT_CAKE_HEAD_CALL);
    case host_isa::avx2: return cake_head_avx2(KVEVICT_CAKE_HEAD_CALL);
    default: break;
  }
#endif
  cake_head_sse2(KVEVICT_CAKE_HEAD_CALL);
}
inline void lava_head_pass(KVEVICT_LAVA_HEAD_ARGS) {
#if KVEVICT_HOST_X86_DISPATCH
  switch (host_isa_now()) {
    case host_isa::avx512: return lava_head_avx512(KVEVICT_LAVA_HEAD_CALL);
    case host_isa::avx2: return lava_head_avx2(KVEVICT_LAVA_HEAD_CALL);
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
