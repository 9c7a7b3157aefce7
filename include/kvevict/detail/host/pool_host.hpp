// Host fast path of pooling for the small kernels the recipes use (k = 3, 5, 7, 9), contiguous
// rows: a direct sliding window, 8 outputs at a time (16 in the AVX-512 copy; GCC / clang
// vector extensions, and intrinsics for the AVX-512 max on raw bits, which builds the windows in
// registers by doubling; baseline, AVX2 and AVX-512F copies chosen at run time), with the
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
//        The AVX-512F copy runs k = 5 by whole blocks instead (avg5_sum_blocks_avx512): the same sums.
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
typedef float vf16 __attribute__((vector_size(64)));  // the AVX-512 copy's avg pooling
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

/// The unsigned maximum of the raw bits of the K inputs from p (one window, one at a time).
template <int K>
KVEVICT_POOL_INLINE std::uint32_t window_max_bits(const float* p) noexcept {
  std::uint32_t m = 0;
  for (int t = 0; t < K; ++t) {
    std::uint32_t u;
    std::memcpy(&u, p + t, sizeof u);
    m = u > m ? u : m;
  }
  return m;
}

/// The scalar end of max_chunk_bits: outputs [i, hi) of the chunk from c0, one at a time; returns
/// whether every window maximum, and `top` (the vector part's largest), is at most plus_inf_bits.
template <int K>
KVEVICT_POOL_INLINE bool max_bits_tail(const float* x, float* y, index_t c0, index_t i, index_t hi,
                                       std::uint32_t top) noexcept {
  for (; i < hi; ++i) {
    const std::uint32_t m = window_max_bits<K>(x + i - K / 2);
    top = m > top ? m : top;
    std::memcpy(y + (i - c0), &m, sizeof m);
  }
  return top <= plus_inf_bits;
}

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
  return max_bits_tail<K>(x, y, c0, i, hi, top);
}

#  if KVEVICT_HOST_X86_DISPATCH
/// One doubling level of max_chunk_bits_avx512 on w[0..N]: vectors of the maxima of windows of
/// width S become those of width 2S (each vector's max with itself shifted by S lanes, the next
/// vector's first lanes shifted in; the last vector's upper lanes get zeros and are never read).
template <int S, int N>
__attribute__((target("avx512f,avx2"))) KVEVICT_POOL_INLINE void max_bits_double(__m512i* w) noexcept {
  constexpr __mmask16 all = 0xFFFF;
  for (int j = 0; j < N; ++j)
    w[j] = _mm512_maskz_max_epu32(all, w[j], _mm512_maskz_alignr_epi32(all, w[j + 1], w[j], S));
  w[N] = _mm512_maskz_max_epu32(all, w[N], _mm512_maskz_alignr_epi32(all, _mm512_setzero_si512(), w[N], S));
}

/// The window maxima on the raw bits of the 16 N outputs whose windows start at p (inputs
/// p[0, 16 N + K - 1)): N vectors and a masked load of the next K - 1 inputs (nothing past them is
/// touched), the windows of width a (the largest power of two <= K) built by doubling in registers
/// (valignd), each output the max of two overlapping ones: for K = 7 and N = 4, 3.5 shifts and maxima
/// per 16 outputs instead of K - 1 = 6.
template <int K, int N>
__attribute__((target("avx512f,avx2"))) KVEVICT_POOL_INLINE void max_bits_windows(const float* p, __m512i* m) noexcept {
  constexpr int a = K >= 8 ? 8 : K >= 4 ? 4 : 2;
  constexpr __mmask16 rest = static_cast<__mmask16>((1u << (K - 1)) - 1u), all = 0xFFFF;
  __m512i w[N + 1];
  for (int j = 0; j < N; ++j) w[j] = _mm512_loadu_si512(p + 16 * j);
  w[N] = _mm512_maskz_loadu_epi32(rest, p + 16 * N);
  max_bits_double<1, N>(w);
  if constexpr (a >= 4) max_bits_double<2, N>(w);
  if constexpr (a >= 8) max_bits_double<4, N>(w);
  for (int j = 0; j < N; ++j) {
    m[j] = w[j];
    if constexpr (K > a) m[j] = _mm512_maskz_max_epu32(all, w[j], _mm512_maskz_alignr_epi32(all, w[j + 1], w[j], K - a));
  }
}

/// Outputs [i, i + 16 N) of max_sum_bits_avx512 (see there), N vectors at a time.
template <int K, int N>
__attribute__((target("avx512f,avx2"))) KVEVICT_POOL_INLINE void max_sum_bits_step(const float* x, index_t stride,
                                                                                    index_t g, float* y, index_t i,
                                                                                    __m512i& seen) noexcept {
  constexpr __mmask16 all = 0xFFFF;
  __m512i m[N];
  __m512 acc[N];
  max_bits_windows<K, N>(x + i - K / 2, m);
  for (int v = 0; v < N; ++v) {
    seen = _mm512_maskz_max_epu32(all, seen, m[v]);
    acc[v] = _mm512_castsi512_ps(m[v]);
  }
  for (index_t j = 1; j < g; ++j) {
    max_bits_windows<K, N>(x + j * stride + i - K / 2, m);
    for (int v = 0; v < N; ++v) {
      seen = _mm512_maskz_max_epu32(all, seen, m[v]);
      acc[v] = _mm512_add_ps(acc[v], _mm512_castsi512_ps(m[v]));
    }
  }
  for (int v = 0; v < N; ++v) _mm512_storeu_ps(y + 16 * v, acc[v]);
}

/// Max pooling on the raw bits of g rows (row j at x + j * stride) summed over the rows, outputs
/// [c0, c0 + nc) (all windows inside the rows): y[i - c0] = ((m_0(i) + m_1(i)) + ...) + m_{g-1}(i)
/// in fp32, each m_j(i) max_chunk_bits' value and the sum gqa_reduce's (rows in order), so the bits
/// of pooling each row and summing the pooled rows; the pooled rows never leave the registers. With
/// g = 1 it is max_chunk_bits (the window maxima, stored as they are). 64 outputs at a time, then 16,
/// then one by one. Returns false if some input is negative or a NaN: the values written are then
/// wrong and the caller recomputes them another way.
/// (The masked forms with a full mask avoid GCC 12's false -Wmaybe-uninitialized in the plain ones.)
template <int K>
__attribute__((target("avx512f,avx2"))) inline bool max_sum_bits_avx512(const float* x, index_t stride, index_t g,
                                                                         float* y, index_t c0, index_t nc) noexcept {
  static_assert(K >= 3 && K <= 9, "the small kernels only");
  __m512i seen = _mm512_setzero_si512();
  index_t i = c0;
  const index_t hi = c0 + nc;
  for (; i + 64 <= hi; i += 64) max_sum_bits_step<K, 4>(x, stride, g, y + (i - c0), i, seen);
  for (; i + 16 <= hi; i += 16) max_sum_bits_step<K, 1>(x, stride, g, y + (i - c0), i, seen);
  alignas(64) std::uint32_t lanes[16];
  _mm512_store_si512(lanes, seen);
  std::uint32_t top = 0;
  for (std::uint32_t u : lanes) top = u > top ? u : top;
  for (; i < hi; ++i) {
    float sum = 0.f;
    for (index_t j = 0; j < g; ++j) {
      const std::uint32_t m = window_max_bits<K>(x + j * stride + i - K / 2);
      top = m > top ? m : top;
      float f;
      std::memcpy(&f, &m, sizeof f);
      sum = j == 0 ? f : sum + f;
    }
    y[i - c0] = sum;
  }
  return top <= plus_inf_bits;
}

/// max_chunk_bits for AVX-512F: max_sum_bits_avx512 of one row.
template <int K>
__attribute__((target("avx512f,avx2"))) inline bool max_chunk_bits_avx512(const float* x, float* y, index_t c0,
                                                                           index_t nc) noexcept {
  return max_sum_bits_avx512<K>(x, 0, 1, y, c0, nc);
}
#  endif

/// Max pooling of outputs [lo, hi) (all windows inside the row), in chunks of max_chunk outputs:
/// each chunk on the raw bits (Bits: max_chunk_bits or its AVX-512F copy) when no input is negative
/// or NaN, else by keys.
template <int K, bool (*Bits)(const float*, float*, index_t, index_t) noexcept>
KVEVICT_POOL_INLINE void max_interior(const float* x, float* y, index_t lo, index_t hi) noexcept {
  for (index_t c0 = lo; c0 < hi; c0 += max_chunk) {
    const index_t nc = hi - c0 < max_chunk ? hi - c0 : max_chunk;
    if (!Bits(x, y + (c0 - lo), c0, nc)) max_chunk_keys<K>(x, y + (c0 - lo), c0, nc);
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

/// Average pooling (divided by `div`, the kernel or the valid count, which is K inside the row) of
/// outputs [lo, hi), all windows inside the row; VF lanes at a time (VI: the lanes' phases).
template <int K, class VF = vf8, class VI = vi8>
KVEVICT_POOL_INLINE void avg_interior(const float* x, float* y, index_t lo, index_t hi, float div) noexcept {
  constexpr int r = K / 2;
  constexpr index_t W = static_cast<index_t>(sizeof(VF) / sizeof(float));
  index_t i = lo;
  if (i + W <= hi) {
    VI phase;
    for (int l = 0; l < W; ++l) phase[l] = static_cast<std::int32_t>((i + l) % K);
    const VF dv = VF{} + div;
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
      s = s / dv;
      if constexpr (W == 8) store8(y + (i - lo), s);
      else std::memcpy(y + (i - lo), &s, sizeof s);
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
  if (is_max) max_interior<K, max_chunk_bits<K, vu8>>(x, y, lo, hi);
  else avg_interior<K>(x, y, lo, hi, div);
}
#  if KVEVICT_HOST_X86_DISPATCH
template <int K>
__attribute__((target("avx2"))) void interior_avx2(bool is_max, const float* x, float* y, index_t lo, index_t hi,
                                                    float div) noexcept {
  if (is_max) max_interior<K, max_chunk_bits<K, vu8>>(x, y, lo, hi);
  else avg_interior<K>(x, y, lo, hi, div);
}
/// The permutations of avg5_phases and avg5_store: element t of the 16 blocks of 5 in 80 consecutive floats
/// (in_idx[t], source s = 5 l + t of lane l: from the pair 0-1 of the five vectors, the pair 2-3 where
/// in_b, vector 4 where in_c; the index's low bits serve all three), and back: output vector m lane q
/// (o = 16 m + q) is lane o / 5 of phase o % 5's vector (out_idx[m], the pair 0-1 or 2-3 picked by
/// the odd phases' bit 4; pair 2-3 where out_23, phase 4 where out_4).
struct avg5_permutations {
  alignas(64) std::int32_t in_idx[5][16] = {};
  alignas(64) std::int32_t out_idx[5][16] = {};
  std::uint16_t in_b[5] = {}, in_c[5] = {}, out_23[5] = {}, out_4[5] = {};
};
constexpr avg5_permutations make_avg5_permutations() {
  avg5_permutations t;
  for (int v = 0; v < 5; ++v)
    for (int l = 0; l < 16; ++l) {
      const int s = 5 * l + v, o = 16 * v + l, j = o % 5;
      t.in_idx[v][l] = s;
      if (s >= 32 && s < 64) t.in_b[v] = static_cast<std::uint16_t>(t.in_b[v] | 1u << l);
      if (s >= 64) t.in_c[v] = static_cast<std::uint16_t>(t.in_c[v] | 1u << l);
      t.out_idx[v][l] = o / 5 + (j % 2 == 1 ? 16 : 0);
      if (j == 2 || j == 3) t.out_23[v] = static_cast<std::uint16_t>(t.out_23[v] | 1u << l);
      if (j == 4) t.out_4[v] = static_cast<std::uint16_t>(t.out_4[v] | 1u << l);
    }
  return t;
}
inline constexpr avg5_permutations avg5_perm = make_avg5_permutations();

/// Picks lanes of the five vectors v by an avg5_permutations index and masks.
__attribute__((target("avx512f,avx2"))) KVEVICT_POOL_INLINE __m512 avg5_pick(const __m512* v, const std::int32_t* idx,
                                                                             std::uint16_t m23, std::uint16_t m4) noexcept {
  constexpr __mmask16 all = 0xFFFF;
  const __m512i i = _mm512_load_si512(idx);
  const __m512 a = _mm512_maskz_permutex2var_ps(all, v[0], i, v[1]), b = _mm512_maskz_permutex2var_ps(all, v[2], i, v[3]);
  return _mm512_mask_blend_ps(m4, _mm512_mask_blend_ps(m23, a, b), _mm512_maskz_permutexvar_ps(all, i, v[4]));
}

/// Lanes 1..15 of p, then next.
__attribute__((target("avx512f,avx2"))) KVEVICT_POOL_INLINE __m512 avg5_shift_in(__m512 p, float next) noexcept {
  constexpr __mmask16 all = 0xFFFF;
  return _mm512_castsi512_ps(
      _mm512_maskz_alignr_epi32(all, _mm512_castps_si512(_mm512_set1_ps(next)), _mm512_castps_si512(p), 1));
}

/// The outputs [i, i + 80) of average pooling with k = 5 (AVX-512F) for i a multiple of 5 (a block
/// start of pool.hpp's two passes), p = x + i - 2, in block layout: o[j] lane l = output i + 5 l + j.
/// The five elements of the 16 blocks gathered into five vectors, each block's suffix sums (right to
/// left) and prefix sums (left to right) computed lane by lane, output 5 l + j = suffix j of block l
/// + prefix j - 1 of block l + 1 (the next group's first block's prefixes by scalar adds), divided by
/// dv: the two-pass algorithm's operations, so its bits.
__attribute__((target("avx512f,avx2"))) KVEVICT_POOL_INLINE void avg5_phases(const float* p, __m512 dv,
                                                                             __m512* o) noexcept {
  __m512 v[5], e[5];
  for (int m = 0; m < 5; ++m) v[m] = _mm512_loadu_ps(p + 16 * m);
  for (int t = 0; t < 5; ++t) e[t] = avg5_pick(v, avg5_perm.in_idx[t], avg5_perm.in_b[t], avg5_perm.in_c[t]);
  // suffixes s_j = e_j + (e_{j+1} + ...), prefixes p_j = ((e_0 + e_1) + ...) + e_j, as pool.hpp adds
  const __m512 s3 = _mm512_add_ps(e[3], e[4]), s2 = _mm512_add_ps(e[2], s3), s1 = _mm512_add_ps(e[1], s2);
  const __m512 s0 = _mm512_add_ps(e[0], s1);
  const __m512 p1 = _mm512_add_ps(e[0], e[1]), p2 = _mm512_add_ps(p1, e[2]), p3 = _mm512_add_ps(p2, e[3]);
  const float q0 = p[80], q1 = q0 + p[81], q2 = q1 + p[82], q3 = q2 + p[83];  // the next block's prefixes
  o[0] = _mm512_div_ps(s0, dv);
  o[1] = _mm512_div_ps(_mm512_add_ps(s1, avg5_shift_in(e[0], q0)), dv);
  o[2] = _mm512_div_ps(_mm512_add_ps(s2, avg5_shift_in(p1, q1)), dv);
  o[3] = _mm512_div_ps(_mm512_add_ps(s3, avg5_shift_in(p2, q2)), dv);
  o[4] = _mm512_div_ps(_mm512_add_ps(e[4], avg5_shift_in(p3, q3)), dv);
}

/// Stores 80 outputs in block layout (avg5_phases) to y in output order.
__attribute__((target("avx512f,avx2"))) KVEVICT_POOL_INLINE void avg5_store(float* y, const __m512* o) noexcept {
  for (int m = 0; m < 5; ++m)
    _mm512_storeu_ps(y + 16 * m, avg5_pick(o, avg5_perm.out_idx[m], avg5_perm.out_23[m], avg5_perm.out_4[m]));
}

/// Average pooling with k = 5 (AVX-512F) of g rows (row j at x + j * stride) summed over the rows in
/// row order, the outputs from i (a multiple of 5) by 80 (16 blocks: avg5_phases, about 14 vector
/// operations per 16 outputs of a row instead of the phase kernel's 37): y[o - i] = ((a_0(o) +
/// a_1(o)) + ...) + a_{g-1}(o), each a_j(o) the row's pooled value and the sum gqa_reduce's, kept in
/// block layout until the group's sum is stored (one permutation back per group, not per row). With
/// g = 1 it is the pooling of one row. Returns the first output not written (hi - i < 80 left).
/// Windows must lie inside the rows up to output hi - 1 (they read x[i - 2, hi + 2)).
__attribute__((target("avx512f,avx2"))) inline index_t avg5_sum_blocks_avx512(const float* x, index_t stride,
                                                                              index_t g, float* y, index_t i,
                                                                              index_t hi, float div) noexcept {
  const __m512 dv = _mm512_set1_ps(div);
  const index_t first = i;
  for (; i + 80 <= hi; i += 80) {
    __m512 acc[5], o[5];
    avg5_phases(x + i - 2, dv, acc);
    for (index_t j = 1; j < g; ++j) {
      avg5_phases(x + j * stride + i - 2, dv, o);
      for (int m = 0; m < 5; ++m) acc[m] = _mm512_add_ps(acc[m], o[m]);
    }
    avg5_store(y + (i - first), acc);
  }
  return i;
}

/// 16 lanes for max pooling (the raw-bits path) and for avg (16 outputs per division and per
/// evaluation of the K phase expressions: the same operations per lane as the 8-lane copies; k = 5
/// by blocks, avg5_sum_blocks_avx512 of one row).
template <int K>
__attribute__((target("avx512f,avx2"))) void interior_avx512(bool is_max, const float* x, float* y, index_t lo,
                                                              index_t hi, float div) noexcept {
  if (is_max) return max_interior<K, max_chunk_bits_avx512<K>>(x, y, lo, hi);
  if constexpr (K == 5) {
    const index_t b = (lo + 4) / 5 * 5;  // the first block start
    if (b + 80 <= hi) {
      avg_interior<K, vf16, vi16>(x, y, lo, b, div);
      const index_t e = avg5_sum_blocks_avx512(x, 0, 1, y + (b - lo), b, hi, div);
      return avg_interior<K, vf16, vi16>(x, y + (e - lo), e, hi, div);
    }
  }
  avg_interior<K, vf16, vi16>(x, y, lo, hi, div);
}
#  endif
/// The same operations on every copy: the ISA changes the speed, never the bits.
template <int K>
void interior(bool is_max, const float* x, float* y, index_t lo, index_t hi, float div) noexcept {
#  if KVEVICT_HOST_X86_DISPATCH
  if (host_isa_runs(host_isa::avx512)) return interior_avx512<K>(is_max, x, y, lo, hi, div);
  if (host_isa_runs(host_isa::avx2)) return interior_avx2<K>(is_max, x, y, lo, hi, div);
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

/// The pooling of g contiguous rows (row j at x + j * stride) summed over the rows in row order,
/// outputs [lo, hi) all in the rows' interior, output i into y[i - lo]: the bits of pooling each row
/// (pool_row) and summing the pooled rows as gqa_reduce does, the pooled rows never leaving the
/// registers. Only where the AVX-512F copy runs, and
///   max (kernel 3..9): when no input is negative or a NaN (max_sum_bits_avx512);
///   avg (kernel 5): when lo is a multiple of 5 (a block start) and hi - lo of 80 (avg5_sum_blocks_avx512);
/// returns whether it wrote the outputs (if not, y holds junk and the caller pools and sums the
/// usual way).
inline bool pool_fast_group_sum(bool is_max, const float* x, index_t stride, index_t g, float* y, index_t kernel,
                                index_t lo, index_t hi) noexcept {
#if defined(KVEVICT_POOL_FAST_PATH) && KVEVICT_HOST_X86_DISPATCH
  if (lo >= hi || !host_isa_runs(host_isa::avx512)) return false;
  if (!is_max)
    return kernel == 5 && lo % 5 == 0 && (hi - lo) % 80 == 0 &&
           pool_fast::avg5_sum_blocks_avx512(x, stride, g, y, lo, hi, 5.0f) == hi;
  switch (kernel) {
    case 3: return pool_fast::max_sum_bits_avx512<3>(x, stride, g, y, lo, hi - lo);
    case 5: return pool_fast::max_sum_bits_avx512<5>(x, stride, g, y, lo, hi - lo);
    case 7: return pool_fast::max_sum_bits_avx512<7>(x, stride, g, y, lo, hi - lo);
    case 9: return pool_fast::max_sum_bits_avx512<9>(x, stride, g, y, lo, hi - lo);
    default: return false;
  }
#else
  (void)is_max, (void)x, (void)stride, (void)g, (void)y, (void)kernel, (void)lo, (void)hi;
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
