// Host fast path of pooling for the small kernels the recipes use (k = 3, 5, 7, 9), contiguous
// rows: a direct sliding window, 8 outputs at a time (16 in the AVX-512 copy; GCC / clang
// vector extensions; baseline, AVX2 and AVX-512F copies chosen at run time), with the
// bits of the O(T) algorithm in pool.hpp:
//   max  the total-order max of the window's keys (associative and commutative on keys: any order
//        gives the same bits); chunks of 512 outputs whose inputs are all +0, positive or +inf (the
//        scores' case) take the unsigned max of the raw bits instead, which is that same max;
//   avg  every window sum is evaluated with the association of pool.hpp's two passes. Window
//        [i - r, i + r] of an interior output i (all positions real) has, with j = i mod k and
//        a_t = x[i - r + t]:
//          j = 0:  a_0 + (a_1 + (... + (a_{k-2} + a_{k-1})))            (one block's suffix)
//          j > 0:  (a_0 + (a_1 + ... + a_{k-j-1}))                        (suffix of i's block)
//                  + (((a_{k-j} + a_{k-j+1}) + ...) + a_{k-1})             (prefix of the next)
//        Each of the k expressions is evaluated for the 8 lanes and the lane's own phase selected,
//        so the result is that of pool.hpp's code bit for bit (tests/test_pool.cpp compares them).
//        The window sum's division `sum / div` is the IEEE division in the baseline and AVX2 copies;
//        the AVX2 + FMA and AVX-512F copies compute the same bits from a reciprocal and two FMAs
//        (quot_fma8 / quot_fma16 below, checked exhaustively by bench/pool_div_check.cpp).
// The r outputs at each end of a row (windows reaching outside it) use pool.hpp's row code.
// Only for GCC / clang host code (not nvcc's front end); elsewhere pool.hpp's code runs alone.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/base/score_order.hpp>
#include <kvevict/detail/base/stage_math.hpp>
#include <kvevict/detail/host/cpu_x86.hpp>
#include <kvevict/pool_types.hpp>

#include <cstdint>
#include <cstring>

#if !defined(KVEVICT_NO_POOL_FAST_PATH) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__) && \
    !defined(__NVCOMPILER)
#  define KVEVICT_POOL_FAST_PATH 1
#endif

#if defined(KVEVICT_POOL_FAST_PATH) && KVEVICT_HOST_X86_DISPATCH
#  include <immintrin.h>
#endif

#if defined(KVEVICT_POOL_FAST_PATH)
// The 8-lane helpers are always inlined, into a baseline (SSE2: two halves) and an AVX2 copy of each
// kernel: their 32-byte vector arguments never cross a call, so GCC's ABI note does not apply.
#  pragma GCC diagnostic push
#  pragma GCC diagnostic ignored "-Wpsabi"
#  define KVEVICT_POOL_INLINE __attribute__((always_inline)) inline
namespace kvevict::detail::pool_fast {

typedef float vf8 __attribute__((vector_size(32)));
typedef std::uint32_t vu8 __attribute__((vector_size(32)));
typedef std::int32_t vi8 __attribute__((vector_size(32)));
typedef float vf8u __attribute__((vector_size(32), aligned(4), may_alias));  // unaligned loads / stores
typedef std::uint32_t vu16 __attribute__((vector_size(64)));  // the AVX-512 copy's max pooling
typedef float vf16 __attribute__((vector_size(64)));          // and its avg pooling
typedef std::int32_t vi16 __attribute__((vector_size(64)));

// (one unaligned vector access each: a memcpy is split into halves in the baseline copy, which
// defeats store forwarding)
KVEVICT_POOL_INLINE void load8(const float* p, vf8& v) noexcept { v = *reinterpret_cast<const vf8u*>(p); }
KVEVICT_POOL_INLINE void store8(float* p, const vf8& v) noexcept { *reinterpret_cast<vf8u*>(p) = v; }

/// k = total_order_key(f) on 8 lanes.
KVEVICT_POOL_INLINE void keys8(const vf8& f, vu8& k) noexcept {
  vu8 u;
  std::memcpy(&u, &f, sizeof u);
  const vu8 mask = reinterpret_cast<vu8>(reinterpret_cast<vi8>(u) >> 31);
  k = (u ^ (mask | 0x80000000u)) + 0x007fffffu;
}
/// f = total_order_from_key(k) on 8 lanes.
KVEVICT_POOL_INLINE void from_keys8(const vu8& k, vf8& f) noexcept {
  const vu8 t = k - 0x007fffffu;
  const vu8 neg = reinterpret_cast<vu8>(reinterpret_cast<vi8>(t) >> 31);  // ones where the top bit is set
  const vu8 b = (neg & (t ^ 0x80000000u)) | (~neg & ~t);
  std::memcpy(&f, &b, sizeof f);
}

// Every kernel below computes outputs [lo, hi) of a row (all windows inside it) into y, output i at
// y[i - lo].

/// Max pooling of the nc outputs from c0 (all windows inside the row, nc <= max_chunk) by keys: the
/// inputs turned into total-order keys once, then window maxima by doubling (pairs, quads, then the
/// window as two overlapping quads or an octet plus one). The max of keys is associative and
/// commutative, so any grouping gives the same bits.
constexpr index_t max_chunk = 512;
template <int K>
KVEVICT_POOL_INLINE void max_chunk_keys(const float* x, float* y, index_t c0, index_t nc) noexcept {
  constexpr int r = K / 2;
  constexpr index_t chunk = max_chunk;
  alignas(32) std::uint32_t kb[chunk + 16 + 8], m2[chunk + 16 + 8], m4[chunk + 16 + 8];
  {
    const index_t nv = (nc + 7) / 8 * 8;  // outputs computed (the last vector partly past nc: not stored)
    const float* xs = x + c0 - r;          // input of window position 0 of output c0
    // keys of the inputs [c0 - r, c0 + nc + r): nc + K - 1 of them; padded to what the vectors read
    const index_t nk = nc + K - 1;
    index_t t = 0;
    for (; t + 8 <= nk; t += 8) {
      vf8 v;
      vu8 k;
      load8(xs + t, v);
      keys8(v, k);
      std::memcpy(kb + t, &k, sizeof k);
    }
    for (; t < nk; ++t) kb[t] = total_order_key(xs[t]);
    for (; t < nv + K + 8; ++t) kb[t] = 0;
    // m2[i] = max(kb[i], kb[i + 1]), m4[i] = max(m2[i], m2[i + 2]) for i < nv + K
    for (index_t i = 0; i < nv + K; ++i) m2[i] = kb[i] > kb[i + 1] ? kb[i] : kb[i + 1];
    if constexpr (K >= 5)
      for (index_t i = 0; i < nv + K - 2; ++i) m4[i] = m2[i] > m2[i + 2] ? m2[i] : m2[i + 2];
    index_t i = 0;
    for (; i < nc; ++i) {
      std::uint32_t m;
      if constexpr (K == 3) m = m2[i] > kb[i + 2] ? m2[i] : kb[i + 2];
      else if constexpr (K == 5) m = m4[i] > kb[i + 4] ? m4[i] : kb[i + 4];
      else if constexpr (K == 7) m = m4[i] > m4[i + 3] ? m4[i] : m4[i + 3];
      else {
        const std::uint32_t a = m4[i] > m4[i + 4] ? m4[i] : m4[i + 4];
        m = a > kb[i + 8] ? a : kb[i + 8];
      }
      y[i] = total_order_from_key(m);
    }
  }
}

/// The largest bit pattern of a float that is neither negative nor a NaN (+inf): on the patterns
/// 0 .. plus_inf_bits (+0, positive subnormals and normals, +inf) the unsigned order of the raw bits
/// is the total score order, so their unsigned maximum is the total-order maximum, bit for bit.
constexpr std::uint32_t plus_inf_bits = 0x7f800000u;

/// Max pooling of the nc outputs from c0 on the raw bits, VU lanes at a time (VU: a vector of
/// uint32, loaded and stored with memcpy: GCC keeps a 64-byte vector's alignment through an
/// aligned(4) typedef and would emit aligned AVX-512 loads): each output the unsigned maximum of its K inputs'
/// bits. Returns false if some input of the chunk is negative or a NaN (its bits above
/// plus_inf_bits: then the maximum of some window is, and the fold of every window's maximum
/// shows it); the outputs written are then wrong and the caller recomputes the chunk by keys.
/// Scores (softmax probabilities) are never negative, so this is the path they take.
template <int K, class VU>
KVEVICT_POOL_INLINE bool max_chunk_bits(const float* x, float* y, index_t c0, index_t nc) noexcept {
  constexpr int r = K / 2;
  constexpr index_t W = static_cast<index_t>(sizeof(VU) / sizeof(std::uint32_t));
  VU seen{};
  index_t i = c0;
  const index_t hi = c0 + nc;
  for (; i + W <= hi; i += W) {
    const float* p = x + i - r;
    VU m;
    std::memcpy(&m, p, sizeof m);
    for (int t = 1; t < K; ++t) {
      VU v;
      std::memcpy(&v, p + t, sizeof v);
      m = m > v ? m : v;
    }
    seen = seen > m ? seen : m;
    std::memcpy(y + (i - c0), &m, sizeof m);
  }
  std::uint32_t top = 0;
  for (index_t l = 0; l < W; ++l) top = seen[l] > top ? seen[l] : top;
  for (; i < hi; ++i) {
    std::uint32_t m = 0;
    for (int t = 0; t < K; ++t) {
      std::uint32_t u;
      std::memcpy(&u, x + i - r + t, sizeof u);
      m = u > m ? u : m;
    }
    top = m > top ? m : top;
    std::memcpy(y + (i - c0), &m, sizeof m);
  }
  return top <= plus_inf_bits;
}

/// Max pooling of outputs [lo, hi) (all windows inside the row), in chunks of max_chunk outputs:
/// each chunk on the raw bits (max_chunk_bits) when no input is negative or NaN, else by keys.
template <int K, class VU>
KVEVICT_POOL_INLINE void max_interior(const float* x, float* y, index_t lo, index_t hi) noexcept {
  for (index_t c0 = lo; c0 < hi; c0 += max_chunk) {
    const index_t nc = hi - c0 < max_chunk ? hi - c0 : max_chunk;
    if (!max_chunk_bits<K, VU>(x, y + (c0 - lo), c0, nc)) max_chunk_keys<K>(x, y + (c0 - lo), c0, nc);
  }
}

/// out = the window sum of phase j (see the file comment) from the k terms a[0..K) (an out
/// parameter: no vector crosses a function boundary, see the pragma above).
template <int K, class V>
KVEVICT_POOL_INLINE void phase_sum(const V* a, int j, V& out) noexcept {
  const int split = j == 0 ? K : K - j;  // terms [0, split): suffix, right to left
  V s = a[split - 1];
  for (int t = split - 2; t >= 0; --t) s = a[t] + s;
  if (j == 0) {
    out = s;
    return;
  }
  V p = a[split];  // terms [split, K): prefix, left to right
  for (int t = split + 1; t < K; ++t) p = p + a[t];
  out = s + p;
}

/// Average pooling's quotient `out = s / d` on the lanes of s (d: div in every lane, y: reciprocal(div)
/// in every lane). quot_div is the IEEE division (the baseline and AVX2 copies, and any divisor the
/// reciprocal is not checked for).
struct quot_div {
  template <class VF>
  static KVEVICT_POOL_INLINE void apply(const VF& s, const VF& d, const VF&, VF& out) noexcept {
    out = s / d;
  }
};

/// The divisors the reciprocal quotient is checked for: every integer 1 .. recip_max_divisor (the
/// fast path uses div = K <= 9; pool_div_check covers every kernel and valid count up to 64).
constexpr int recip_max_divisor = 64;
/// Whether div is one of those divisors (the FMA copies divide for any other).
inline bool recip_checked(float div) noexcept {
  return div >= 1.f && div <= static_cast<float>(recip_max_divisor) && div == static_cast<float>(static_cast<int>(div));
}
/// The bits of 2^-120: sums below it in magnitude (zero excepted) take the division (quot_fma8 / 16).
constexpr std::uint32_t recip_tiny_bits = 0x03800000u;
/// y = RN(1 / div), computed once per row part.
inline float reciprocal(float div) noexcept { return 1.f / div; }

#  if KVEVICT_HOST_X86_DISPATCH
/// The quotient from the reciprocal, with y = RN(1/d):
///   q  = RN(s * y)
///   r  = fma(-q, d, s)       the remainder s - q*d, exact (one rounding of an exact value)
///   q' = fma(r, y, q)        Markstein's correction
/// and q itself in the lanes where r == 0 (q*d == s: q is the exact quotient; q' would turn a -0
/// quotient into +0, as -0 + +0 = +0) or s is not finite (an infinite s: q = +-inf, the quotient,
/// while r and q' are NaN; a NaN s: q is s quieted, as the division gives it). A vector with a lane
/// 0 < |s| < 2^-120 (recip_tiny_bits) is divided instead: a quotient in the subnormal range can be an
/// exact midpoint of its coarser grid (s = 9 * 2^-149, d = 6: 1.5 * 2^-149, rounded to even 2^-148),
/// which the correction misses (it gives 2^-149); 2^-120 = 64 * 2^-126 keeps every quotient of the
/// checked divisors that the correction computes normal. bench/pool_div_check.cpp
/// runs every one of the 2^32 float bit patterns as s through both copies below, for every divisor
/// 1 .. recip_max_divisor, against the IEEE division: no pattern differs (docs/PERFORMANCE.md, "Issue
/// 18, round nine: average pooling"), so the result is the bits of `s / d`, in the default
/// floating-point environment (round to nearest, no flush-to-zero / denormals-are-zero, as for every
/// kernel here). The fused operations are explicit intrinsics (never a contraction the compiler may
/// or may not make).
struct quot_fma8 {
  /// The per-lane quotient (q' or q), without the tiny-sum test.
  __attribute__((target("avx2,fma"))) static KVEVICT_POOL_INLINE void lanes(const vf8& s, const vf8& d, const vf8& y,
                                                                          vf8& out) noexcept {
    const vf8 q = s * y;
    const vf8 rem = _mm256_fnmadd_ps(q, d, s);
    const vf8 c = _mm256_fmadd_ps(rem, y, q);
    vu8 sb;
    std::memcpy(&sb, &s, sizeof sb);
    const vi8 keep_q = (rem == 0.f) | ((sb & 0x7fffffffu) >= 0x7f800000u);
    out = keep_q ? q : c;
  }
  /// Whether some lane has 0 < |s| < 2^-120.
  __attribute__((target("avx2,fma"))) static KVEVICT_POOL_INLINE bool has_tiny(const vf8& s) noexcept {
    vu8 sb;
    std::memcpy(&sb, &s, sizeof sb);
    const vi8 tiny = ((sb & 0x7fffffffu) - 1u) < (recip_tiny_bits - 1u);
    return _mm256_movemask_ps(reinterpret_cast<__m256>(tiny)) != 0;
  }
  /// (not always_inline: avg_interior has no target of its own; once it is inlined into the AVX2 + FMA
  /// copy, the compiler inlines this there)
  __attribute__((target("avx2,fma"))) static inline void apply(const vf8& s, const vf8& d, const vf8& y,
                                                             vf8& out) noexcept {
    lanes(s, d, y, out);
    if (has_tiny(s)) out = s / d;
  }
};
/// The same operations on 16 lanes (AVX-512F).
struct quot_fma16 {
  __attribute__((target("avx512f,avx2,fma"))) static KVEVICT_POOL_INLINE void lanes(const vf16& s, const vf16& d,
                                                                                  const vf16& y, vf16& out) noexcept {
    const vf16 q = s * y;
    const vf16 rem = _mm512_fnmadd_ps(q, d, s);
    const vf16 c = _mm512_fmadd_ps(rem, y, q);
    vu16 sb;
    std::memcpy(&sb, &s, sizeof sb);
    const vi16 keep_q = (rem == 0.f) | ((sb & 0x7fffffffu) >= 0x7f800000u);
    out = keep_q ? q : c;
  }
  __attribute__((target("avx512f,avx2,fma"))) static KVEVICT_POOL_INLINE bool has_tiny(const vf16& s) noexcept {
    vu16 sb;
    std::memcpy(&sb, &s, sizeof sb);
    const vu16 t = (sb & 0x7fffffffu) - 1u;
    return _mm512_cmplt_epu32_mask(reinterpret_cast<__m512i>(t),
                                   _mm512_set1_epi32(static_cast<int>(recip_tiny_bits - 1u))) != 0;
  }
  __attribute__((target("avx512f,avx2,fma"))) static inline void apply(const vf16& s, const vf16& d, const vf16& y,
                                                                     vf16& out) noexcept {
    lanes(s, d, y, out);
    if (has_tiny(s)) out = s / d;
  }
};
#  endif

/// Average pooling (divided by `div`, the kernel or the valid count, which is K inside the row) of
/// outputs [lo, hi), all windows inside the row; VF lanes at a time (VI: the lanes' phases), each
/// vector's quotient by Quot.
template <int K, class VF = vf8, class VI = vi8, class Quot = quot_div>
KVEVICT_POOL_INLINE void avg_interior(const float* x, float* y, index_t lo, index_t hi, float div) noexcept {
  constexpr int r = K / 2;
  constexpr index_t W = static_cast<index_t>(sizeof(VF) / sizeof(float));
  index_t i = lo;
  if (i + W <= hi) {
    VI phase;
    for (int l = 0; l < W; ++l) phase[l] = static_cast<std::int32_t>((i + l) % K);
    const VF dv = VF{} + div, yv = VF{} + reciprocal(div);
    for (; i + W <= hi; i += W) {
      VF a[K];
      for (int t = 0; t < K; ++t) {
        if constexpr (W == 8) load8(x + i - r + t, a[t]);
        else std::memcpy(&a[t], x + i - r + t, sizeof(VF));
      }
      VF s, e;
      phase_sum<K>(a, 0, s);
      for (int j = 1; j < K; ++j) {
        phase_sum<K>(a, j, e);
        s = phase == j ? e : s;
      }
      Quot::apply(s, dv, yv, e);
      if constexpr (W == 8) store8(y + (i - lo), e);
      else std::memcpy(y + (i - lo), &e, sizeof e);
      phase += W % K;
      phase = phase >= K ? phase - K : phase;
    }
  }
  for (; i < hi; ++i) {
    float a[K] = {};
    for (int t = 0; t < K; ++t) a[t] = x[i - r + t];
    float s = 0.f;
    phase_sum<K>(a, static_cast<int>(static_cast<std::uint64_t>(i) % K), s);
    y[i - lo] = s / div;
  }
}

template <int K>
void interior_base(bool is_max, const float* x, float* y, index_t lo, index_t hi, float div) noexcept {
  if (is_max) max_interior<K, vu8>(x, y, lo, hi);
  else avg_interior<K>(x, y, lo, hi, div);
}
#  if KVEVICT_HOST_X86_DISPATCH
template <int K>
__attribute__((target("avx2"))) void interior_avx2(bool is_max, const float* x, float* y, index_t lo, index_t hi,
                                                    float div) noexcept {
  if (is_max) max_interior<K, vu8>(x, y, lo, hi);
  else avg_interior<K>(x, y, lo, hi, div);
}
/// The AVX2 copy with the reciprocal quotient (quot_fma8) for the divisors it is checked for.
template <int K>
__attribute__((target("avx2,fma"))) void interior_avx2_fma(bool is_max, const float* x, float* y, index_t lo,
                                                            index_t hi, float div) noexcept {
  if (is_max) max_interior<K, vu8>(x, y, lo, hi);
  else if (recip_checked(div)) avg_interior<K, vf8, vi8, quot_fma8>(x, y, lo, hi, div);
  else avg_interior<K>(x, y, lo, hi, div);
}
/// 16 lanes for max pooling (the raw-bits path) and for avg (16 outputs per quotient and per
/// evaluation of the K phase expressions: the same operations per lane as the 8-lane copies; the
/// reciprocal quotient quot_fma16, AVX-512F having FMA).
template <int K>
__attribute__((target("avx512f,avx2,fma"))) void interior_avx512(bool is_max, const float* x, float* y, index_t lo,
                                                                  index_t hi, float div) noexcept {
  if (is_max) max_interior<K, vu16>(x, y, lo, hi);
  else if (recip_checked(div)) avg_interior<K, vf16, vi16, quot_fma16>(x, y, lo, hi, div);
  else avg_interior<K, vf16, vi16>(x, y, lo, hi, div);
}
#  endif
/// The same bits on every copy: the ISA changes the speed, never the result.
template <int K>
void interior(bool is_max, const float* x, float* y, index_t lo, index_t hi, float div) noexcept {
#  if KVEVICT_HOST_X86_DISPATCH
  if (host_has_avx512f()) return interior_avx512<K>(is_max, x, y, lo, hi, div);
  if (host_has_avx2() && host_has_fma()) return interior_avx2_fma<K>(is_max, x, y, lo, hi, div);
  if (host_has_avx2()) return interior_avx2<K>(is_max, x, y, lo, hi, div);
#  endif
  interior_base<K>(is_max, x, y, lo, hi, div);
}

}  // namespace kvevict::detail::pool_fast
#  undef KVEVICT_POOL_INLINE
#  pragma GCC diagnostic pop
#endif

namespace kvevict::detail {

/// True when the fast path handles a row: contiguous input and output, kernel 3, 5, 7 or 9 and a
/// row at least a few windows long (shorter rows are all border).
inline bool pool_fast_applies(index_t sx, index_t sy, index_t n, index_t kernel) noexcept {
#if defined(KVEVICT_POOL_FAST_PATH)
  return sx == 1 && sy == 1 && kernel >= 3 && kernel <= 9 && n >= 4 * kernel;
#else
  (void)sx, (void)sy, (void)n, (void)kernel;
  return false;
#endif
}

/// Outputs [lo, hi) of a row of n positions the fast path applies to, all in its interior
/// (r <= lo, hi <= n - r; max or avg; div is the kernel size as a float: the divisor of every
/// interior window for both avg_divisor values), output i into y[i - lo].
inline void pool_fast_interior(bool is_max, const float* x, float* y, index_t kernel, index_t lo, index_t hi) noexcept {
#if defined(KVEVICT_POOL_FAST_PATH)
  if (lo >= hi) return;
  const float div = static_cast<float>(kernel);
  switch (kernel) {
    case 3: return pool_fast::interior<3>(is_max, x, y, lo, hi, div);
    case 5: return pool_fast::interior<5>(is_max, x, y, lo, hi, div);
    case 7: return pool_fast::interior<7>(is_max, x, y, lo, hi, div);
    default: return pool_fast::interior<9>(is_max, x, y, lo, hi, div);
  }
#else
  (void)is_max, (void)x, (void)y, (void)kernel, (void)lo, (void)hi;
#endif
}

}  // namespace kvevict::detail
