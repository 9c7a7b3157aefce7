// Host kernels of attention_scores (seq and par): packing, the logit micro-kernel, the per-row
// softmax and the per-column accumulation. Nothing here is API; see <kvevict/score.hpp> and
// docs/score.md ("Algorithm, complexity, memory").
//
// Work decomposition: a task owns some query heads of one GQA group and all their w rows. Its rows
// are processed in blocks of up to `score_rows`; for each block and each panel of `score_chunk`
// columns, every visible key is widened to fp32 once into a packed tile and serves every row of the
// block (rows of several query heads of the group included) through a register-blocked
// micro-kernel that writes the logits into a per-thread buffer [rows][visible columns]; while the
// panel is in cache each row's chunk max, e^(x - chunk max) and chunk sum are computed and merged
// (softmax_merge) into the row's statistics. A last pass per row scales each chunk by
// e^(m_c - M) / L and adds it, row by row in query order, to the task's per-head accumulators.
// A logits buffer of more than score_stream_min_bytes is not written by the panels directly: each
// panel is computed in a small panel buffer and copied out with non-temporal stores.
//
// Determinism: every logit is one sequential fp32 dot product over d (vectorised across keys, never
// across d) followed by one multiplication by the scale; row statistics use explicit lanes and
// fixed chunk boundaries; each column sums its rows in order 0..w-1. Nothing depends on the
// blocking, the task partition or the thread count, so seq and par give identical bits for any
// number of threads.
//
// Kernels: the panel kernel (widening, packing, micro-kernel, chunk softmax) comes in three tile
// profiles, chosen at run time on x86-64 with GCC or clang: SSE2 (the x86-64 baseline, and the only
// one elsewhere), AVX2 + F16C and AVX-512F + F16C, at most <kvevict/host_isa.hpp>'s limit (the plain
// panel on AMD family 19h takes AVX2: score_plain_prefers_avx2). All are compiled with FMA contraction disabled,
// so every profile computes the same separately rounded operations in the same order and all give
// identical bits (tests/test_score.cpp forces each one); with score_options::fused_multiply_add the
// logit terms are explicit fmaf calls, again identical on every profile. KVEVICT_NO_X86_DISPATCH
// builds only the baseline kernel. The final accumulation follows the translation unit's flags.
//
// The definitions differ with the dispatch and with OpenMP, so they live in an inline namespace
// named after both (KVEVICT_SCORE_ABI_BEGIN): translation units built both ways (nvcc and g++, or
// with and without -fopenmp) do not share differing definitions under one name.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/config.hpp>
#include <kvevict/detail/base/parallel.hpp>
#include <kvevict/detail/base/softmax.hpp>
#include <kvevict/detail/base/stage_math.hpp>
#include <kvevict/detail/host/cpu_x86.hpp>
#include <kvevict/numeric.hpp>
#include <kvevict/view.hpp>

#include <atomic>
#include <cstdint>
#include <type_traits>

#if defined(__GNUC__) || defined(__clang__) || defined(_MSC_VER)
#  define KVEVICT_RESTRICT __restrict
#else
#  define KVEVICT_RESTRICT
#endif

#if (defined(__GNUC__) || defined(__clang__)) && !defined(_MSC_VER)
#  define KVEVICT_ALWAYS_INLINE __attribute__((always_inline)) inline
#else
#  define KVEVICT_ALWAYS_INLINE inline
#endif

// No FMA contraction in the kernels: GCC decides per compiled function (the optimize attribute on
// the dispatched functions covers everything inlined into them); clang decides per expression, so
// every function inlined into them that multiplies and adds opens with KVEVICT_FP_CONTRACT_OFF.
#if defined(__GNUC__) && !defined(__clang__)
#  define KVEVICT_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#  define KVEVICT_NO_CONTRACT
#endif

#if KVEVICT_HOST_X86_DISPATCH && defined(_OPENMP)
#  define KVEVICT_SCORE_ABI_BEGIN inline namespace score_x86_omp {
#elif KVEVICT_HOST_X86_DISPATCH
#  define KVEVICT_SCORE_ABI_BEGIN inline namespace score_x86_serial {
#elif defined(_OPENMP)
#  define KVEVICT_SCORE_ABI_BEGIN inline namespace score_generic_omp {
#else
#  define KVEVICT_SCORE_ABI_BEGIN inline namespace score_generic_serial {
#endif
#define KVEVICT_SCORE_ABI_END }

namespace kvevict::detail {
KVEVICT_SCORE_ABI_BEGIN

inline constexpr index_t score_rows = 128;      ///< rows per block (multiple of every profile's mr)
inline constexpr index_t score_chunk = 1024;    ///< columns per softmax-statistics chunk
inline constexpr int score_lanes = 8;           ///< explicit lanes of the row sums

/// Tile profiles of the logits micro-kernel: mr rows x nr keys of accumulators, each query value
/// stored qrep times in the packed queries (SSE2 has no cheap broadcast from memory; AVX does),
/// keys packed by tiles of key_tile. Chosen so that GCC 12 keeps every accumulator in a register.
/// f16c: widen fp16 keys with the F16C conversion instruction (exact, like widen_f16_bits).
struct score_profile_sse2 {
  static constexpr index_t mr = 4, nr = 12, qrep = 4, key_tile = 48;
  static constexpr bool f16c = false;
};
struct score_profile_avx2 {
  static constexpr index_t mr = 4, nr = 24, qrep = 1, key_tile = 48;
  static constexpr bool f16c = true;
};
struct score_profile_avx512 {
  static constexpr index_t mr = 8, nr = 32, qrep = 1, key_tile = 64;
  static constexpr bool f16c = true;
};
/// Scratch sizes cover every profile, so the workspace does not depend on the CPU.
inline constexpr index_t score_max_qrep = 4, score_max_nr = 32, score_max_key_tile = 64;

inline index_t round_up(index_t x, index_t m) { return (x + m - 1) / m * m; }

template <class T>
const T* kv_row(const kv_view<const T>& v, index_t h, index_t t) {
  return v.data_handle() + h * v.stride(0) + t * v.stride(1);
}

/// The element type of a key source: a kv_view<const K>, or any type with element_type, a
/// kv_row(source, head, token) overload and stride(2) (the paged keys of detail/host/paged_keys.hpp).
template <class KS>
using key_elem_t = std::remove_const_t<typename KS::element_type>;

/// Widens n elements (stride ds) into dst[0..n) fp32. Reads the 16-bit patterns as integers so the
/// loops vectorise.
template <class T>
inline void widen_row(float* KVEVICT_RESTRICT dst, const T* KVEVICT_RESTRICT src, index_t n, index_t ds) {
  if constexpr (std::is_same_v<T, float>) {
    if (ds == 1)
      for (index_t k = 0; k < n; ++k) dst[k] = src[k];
    else
      for (index_t k = 0; k < n; ++k) dst[k] = src[k * ds];
  } else if constexpr (std::is_same_v<T, float16>) {
    if (ds == 1)
      for (index_t k = 0; k < n; ++k) dst[k] = widen_f16_bits(src[k].bits);
    else
      for (index_t k = 0; k < n; ++k) dst[k] = widen_f16_bits(src[k * ds].bits);
  } else {
    if (ds == 1)
      for (index_t k = 0; k < n; ++k) dst[k] = widen_bf16_bits(src[k].bits);
    else
      for (index_t k = 0; k < n; ++k) dst[k] = widen_bf16_bits(src[k * ds].bits);
  }
}

/// Packs `nrows` query rows into [row group of P::mr][d][P::mr][P::qrep] fp32 (with qrep > 1 every
/// value is replicated so the SSE2 micro-kernel loads a ready-made vector instead of shuffling),
/// zero rows padding the last group. Row r of the task is query head head0 + (row0 + r) / w,
/// position (row0 + r) % w.
template <class P, class Q>
void score_pack_queries(float* KVEVICT_RESTRICT dst, float* KVEVICT_RESTRICT tmp, const kv_view<const Q>& q,
                        index_t head0, index_t w, index_t row0, index_t nrows) {
  const index_t d = q.extent(2), ds = q.stride(2);
  const index_t groups = (nrows + P::mr - 1) / P::mr;
  for (index_t gi = 0; gi < groups; ++gi) {
    float* g = dst + gi * d * P::mr * P::qrep;
    for (index_t rr = 0; rr < P::mr; ++rr) {
      const index_t r = gi * P::mr + rr;
      if (r < nrows) {
        const index_t flat = row0 + r;
        widen_row(tmp, kv_row(q, head0 + flat / w, flat % w), d, ds);
      } else {
        for (index_t k = 0; k < d; ++k) tmp[k] = 0.0f;
      }
      for (index_t k = 0; k < d; ++k)
        for (index_t c = 0; c < P::qrep; ++c) g[(k * P::mr + rr) * P::qrep + c] = tmp[k];
    }
  }
}

#if KVEVICT_HOST_X86_DISPATCH
/// widen_row for contiguous fp16 with F16C (8 values per instruction); only inlined into the AVX2
/// and AVX-512 kernels, which the dispatcher picks only on CPUs with F16C.
__attribute__((target("avx2,f16c"))) inline void widen_row_f16c(float* KVEVICT_RESTRICT dst,
                                                                               const float16* KVEVICT_RESTRICT src,
                                                                               index_t n) {
  index_t k = 0;
  for (; k + 8 <= n; k += 8)
    _mm256_storeu_ps(dst + k, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k))));
  for (; k < n; ++k) dst[k] = widen_f16_bits(src[k].bits);
}
#endif

/// Widens one key row, with F16C when the profile allows it.
template <class P, class K>
KVEVICT_ALWAYS_INLINE void score_widen_key(float* KVEVICT_RESTRICT dst, const K* KVEVICT_RESTRICT src, index_t d,
                                           index_t ds) {
#if KVEVICT_HOST_X86_DISPATCH
  if constexpr (P::f16c && std::is_same_v<K, float16>) {
    if (ds == 1) return widen_row_f16c(dst, src, d);
  }
#endif
  widen_row(dst, src, d, ds);
}

#if KVEVICT_HOST_X86_DISPATCH
// The masked forms with a full mask (compiled to the plain instructions) avoid GCC 12's false
// -Wmaybe-uninitialized inside the plain intrinsics (which pass an undefined merge source).
/// 16 consecutive elements of a contiguous key row, widened exactly to fp32 (the values of widen_row).
template <class K>
__attribute__((target("avx512f,avx2,f16c"))) KVEVICT_ALWAYS_INLINE __m512 score_load16_avx512(const K* src) {
  constexpr __mmask16 all = 0xFFFF;
  if constexpr (std::is_same_v<K, float>) {
    return _mm512_loadu_ps(src);
  } else if constexpr (std::is_same_v<K, float16>) {
    return _mm512_maskz_cvtph_ps(all, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  } else {
    const __m512i h = _mm512_maskz_cvtepu16_epi32(all, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(all, h, 16));
  }
}

/// Packs 16 contiguous key rows: o[k * ld + c] = rows[c][k] widened to fp32, for c < 16 and k < d.
/// 16 x 16 blocks are widened and transposed in registers (unpack, in-lane shuffles, then 128-bit
/// lane shuffles); the last d % 16 elements of each row one by one. Exact: the same values as the
/// scalar packing.
template <class K>
__attribute__((target("avx512f,avx2,f16c"))) inline void score_pack16_avx512(float* KVEVICT_RESTRICT o, index_t ld,
                                                                            const K* const* rows, index_t d) {
  constexpr __mmask16 all = 0xFFFF;
  index_t k0 = 0;
  for (; k0 + 16 <= d; k0 += 16) {
    __m512 r[16], t[16];
    for (int c = 0; c < 16; ++c) r[c] = score_load16_avx512(rows[c] + k0);
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_maskz_unpacklo_ps(all, r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_maskz_unpackhi_ps(all, r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
      r[4 * i] = _mm512_maskz_shuffle_ps(all, t[4 * i], t[4 * i + 2], 0x44);
      r[4 * i + 1] = _mm512_maskz_shuffle_ps(all, t[4 * i], t[4 * i + 2], 0xEE);
      r[4 * i + 2] = _mm512_maskz_shuffle_ps(all, t[4 * i + 1], t[4 * i + 3], 0x44);
      r[4 * i + 3] = _mm512_maskz_shuffle_ps(all, t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 4; ++j) {
        t[8 * i + j] = _mm512_maskz_shuffle_f32x4(all, r[8 * i + j], r[8 * i + 4 + j], 0x88);
        t[8 * i + 4 + j] = _mm512_maskz_shuffle_f32x4(all, r[8 * i + j], r[8 * i + 4 + j], 0xDD);
      }
    for (int j = 0; j < 8; ++j) {
      r[j] = _mm512_maskz_shuffle_f32x4(all, t[j], t[j + 8], 0x88);
      r[j + 8] = _mm512_maskz_shuffle_f32x4(all, t[j], t[j + 8], 0xDD);
    }
    for (int kk = 0; kk < 16; ++kk) _mm512_storeu_ps(o + (k0 + kk) * ld, r[kk]);
  }
  for (; k0 < d; ++k0)
    for (int c = 0; c < 16; ++c) widen_row(o + k0 * ld + c, rows[c] + k0, 1, 1);
}
#endif

/// Packs keys j0 .. j0+nb-1 of KV head g into [key group of P::nr][d][P::nr] fp32, zero padding up
/// to a multiple of P::nr. Column j < p is prefix key j, column j >= p block key j - p.
template <class P, class KS>
KVEVICT_ALWAYS_INLINE void score_pack_keys(float* KVEVICT_RESTRICT dst, float* KVEVICT_RESTRICT tmp,
                                           const KS& prefix, const KS& block, index_t g,
                                           index_t p, index_t j0, index_t nb, index_t d) {
  constexpr index_t nr = P::nr;
  const index_t groups = (nb + nr - 1) / nr;
  for (index_t gi = 0; gi < groups; ++gi) {
#if KVEVICT_HOST_X86_DISPATCH
    if constexpr (std::is_same_v<P, score_profile_avx512>) {
      // a whole group of contiguous key rows: widen and transpose 16 x 16 blocks in registers
      if (gi * nr + nr <= nb) {
        const key_elem_t<KS>* rows[nr];
        bool contiguous = true;
        for (index_t c = 0; c < nr; ++c) {
          const index_t j = j0 + gi * nr + c;
          rows[c] = j < p ? kv_row(prefix, g, j) : kv_row(block, g, j - p);
          contiguous = contiguous && (j < p ? prefix.stride(2) : block.stride(2)) == 1;
        }
        if (contiguous) {
          for (index_t c0 = 0; c0 < nr; c0 += 16) score_pack16_avx512(dst + gi * d * nr + c0, nr, rows + c0, d);
          continue;
        }
      }
    }
#endif
    // widen the group's keys into tmp[nr][d] (contiguous, vectorised), then transpose into
    // [d][nr] by 4 x 4 blocks
    for (index_t c = 0; c < nr; ++c) {
      const index_t jj = gi * nr + c;
      float* t = tmp + c * d;
      if (jj < nb) {
        const index_t j = j0 + jj;
        if (j < p)
          score_widen_key<P>(t, kv_row(prefix, g, j), d, prefix.stride(2));
        else
          score_widen_key<P>(t, kv_row(block, g, j - p), d, block.stride(2));
      } else {
        for (index_t k = 0; k < d; ++k) t[k] = 0.0f;
      }
    }
    float* o = dst + gi * d * nr;
    index_t k0 = 0;
    for (; k0 + 4 <= d; k0 += 4)
      for (index_t c0 = 0; c0 < nr; c0 += 4) {
        float b[4][4];
        for (index_t cc = 0; cc < 4; ++cc)
          for (index_t kk = 0; kk < 4; ++kk) b[cc][kk] = tmp[(c0 + cc) * d + k0 + kk];
        for (index_t kk = 0; kk < 4; ++kk)
          for (index_t cc = 0; cc < 4; ++cc) o[(k0 + kk) * nr + c0 + cc] = b[cc][kk];
      }
    for (; k0 < d; ++k0)
      for (index_t c = 0; c < nr; ++c) o[k0 * nr + c] = tmp[c * d + k0];
  }
}

/// out[r][c] = scale * sum_k q[r][k] * key[c][k] for a P::mr x P::nr tile. Each output is one
/// sequential sum over k, in order, of separately rounded products (Fused = false; the callers
/// disable FMA contraction) or of fused multiply-adds (Fused = true, one rounding per term). The
/// vector lanes run across keys, so the bits depend neither on the vector width nor on which rows
/// and keys share a tile.
template <class P, bool Fused>
KVEVICT_ALWAYS_INLINE void score_microkernel(const float* KVEVICT_RESTRICT qp, const float* KVEVICT_RESTRICT kp,
                                             index_t d, float scale, float* KVEVICT_RESTRICT out, index_t ld) {
  KVEVICT_FP_CONTRACT_OFF
  float acc[P::mr][P::nr] = {};
  for (index_t k = 0; k < d; ++k) {
    const float* qk = qp + k * P::mr * P::qrep;
    const float* kk = kp + k * P::nr;
    for (index_t r = 0; r < P::mr; ++r)
      for (index_t c = 0; c < P::nr; ++c) {
        if constexpr (Fused)
          acc[r][c] = __builtin_fmaf(qk[r * P::qrep + c % P::qrep], kk[c], acc[r][c]);  // one rounding
        else
          acc[r][c] += qk[r * P::qrep + c % P::qrep] * kk[c];  // two roundings
      }
  }
  for (index_t r = 0; r < P::mr; ++r)
    for (index_t c = 0; c < P::nr; ++c) out[r * ld + c] = acc[r][c] * scale;
}

/// Chunk statistics of s[0..n): its max m and, in place, e^(s - m) with their sum. A NaN logit
/// makes the sum NaN. A chunk whose logits are all -inf gives {-inf, 0} and zeros.
KVEVICT_ALWAYS_INLINE softmax_stats score_chunk_exp(float* KVEVICT_RESTRICT s, index_t n) {
  std::int32_t mk = float_order_key(neg_inf_f());
  for (index_t j = 0; j < n; ++j) {
    const std::int32_t k = float_order_key(s[j]);
    mk = k > mk ? k : mk;
  }
  const float m = float_from_order_key(mk);  // NaN if a NaN without sign bit was seen
  if (m == neg_inf_f()) {  // only -inf (or sign-bit NaN) logits: nothing visible
    float nan_sum = 0.0f;
    for (index_t t = 0; t < n; ++t) {
      s[t] = is_nan_f(s[t]) ? s[t] : 0.0f;
      nan_sum += s[t];
    }
    return {neg_inf_f(), nan_sum};  // sum 0, or NaN that poisons the row
  }
  for (index_t j = 0; j < n; ++j) s[j] = softmax_exp(s[j] - m);
  float sm[score_lanes] = {};
  index_t j = 0;
  for (; j + score_lanes <= n; j += score_lanes)
    for (int l = 0; l < score_lanes; ++l) sm[l] += s[j + l];
  for (; j < n; ++j) sm[0] += s[j];
  float sum = sm[0];
  for (int l = 1; l < score_lanes; ++l) sum += sm[l];
  return {m, sum};
}

/// dst[0..n) = src[0..n) with non-temporal stores after a scalar prologue up to 64-byte alignment (x86;
/// elsewhere a plain copy): a long row's logits buffer is read again only after every panel, so
/// caching its lines would read each from memory before overwriting it and evict the panel's working
/// set. One copy per profile (the vector width).
template <index_t Lanes, class Stream>
KVEVICT_ALWAYS_INLINE void score_stream_row_body(float* KVEVICT_RESTRICT dst, const float* KVEVICT_RESTRICT src,
                                                 index_t n) {
  index_t j = 0;
  for (; j < n && (reinterpret_cast<std::uintptr_t>(dst + j) & 63) != 0; ++j) dst[j] = src[j];
  for (; j + Lanes <= n; j += Lanes) Stream::copy(dst + j, src + j);
  for (; j < n; ++j) dst[j] = src[j];
}
#if KVEVICT_HOST_X86_DISPATCH
struct score_stream_sse2 {
  __attribute__((target("sse2"))) static void copy(float* d, const float* s) { _mm_stream_ps(d, _mm_loadu_ps(s)); }
};
struct score_stream_avx {
  __attribute__((target("avx"))) static void copy(float* d, const float* s) { _mm256_stream_ps(d, _mm256_loadu_ps(s)); }
};
struct score_stream_avx512 {
  __attribute__((target("avx512f"))) static void copy(float* d, const float* s) {
    _mm512_stream_ps(d, _mm512_loadu_ps(s));
  }
};
__attribute__((target("sse2"))) inline void score_stream_row_base(float* dst, const float* src, index_t n) {
  score_stream_row_body<4, score_stream_sse2>(dst, src, n);
}
__attribute__((target("avx2"))) inline void score_stream_row_avx2(float* dst, const float* src, index_t n) {
  score_stream_row_body<8, score_stream_avx>(dst, src, n);
}
__attribute__((target("avx512f"))) inline void score_stream_row_avx512(float* dst, const float* src, index_t n) {
  score_stream_row_body<16, score_stream_avx512>(dst, src, n);
}
#else
inline void score_stream_row_base(float* KVEVICT_RESTRICT dst, const float* KVEVICT_RESTRICT src, index_t n) {
  for (index_t j = 0; j < n; ++j) dst[j] = src[j];
}
#endif

/// Orders the non-temporal stores of score_stream_row_* before the reads of the final pass.
inline void score_stream_fence() {
#if KVEVICT_HOST_X86_DISPATCH
  _mm_sfence();
#endif
}

/// One panel of a block: the logits of columns [c0, c0 + n) for every row, then, while the panel is
/// in cache, each row's chunk c: max, e^(x - max) in place, sum, merged into st[r]; the result is in
/// buf[r][c0 + j] (padding rows and the columns up to the next multiple of P::nr hold finite junk
/// never read). pbuf null: computed in buf. Otherwise computed in the panel buffer pbuf[r][j] (row
/// stride pld, in cache) and each row's visible part streamed into buf (score_stream_row_*): the same
/// values. vis[r] = columns row r sees; cmax[r * nchunks + c] receives the chunk's max.
template <class P, bool Fused, class KS>
KVEVICT_ALWAYS_INLINE void score_panel_body(float* KVEVICT_RESTRICT buf, index_t ld, float* KVEVICT_RESTRICT pbuf,
                                            index_t pld, const float* KVEVICT_RESTRICT qpack,
                                            index_t nrows, float* KVEVICT_RESTRICT kpack, float* KVEVICT_RESTRICT tmp,
                                            const KS& prefix, const KS& block, index_t g,
                                            index_t p, index_t c0, index_t n, index_t d, float scale, const index_t* vis,
                                            float* KVEVICT_RESTRICT cmax, index_t nchunks, softmax_stats* st) {
  const index_t rows_pad = round_up(nrows, P::mr);
  // the logits of column c0 + j of row r are at w[r * wld + wc + j]
  float* const w = pbuf != nullptr ? pbuf : buf;
  const index_t wld = pbuf != nullptr ? pld : ld, wc = pbuf != nullptr ? 0 : c0;
  for (index_t j0 = c0; j0 < c0 + n; j0 += P::key_tile) {
    const index_t nb = c0 + n - j0 < P::key_tile ? c0 + n - j0 : P::key_tile;
    score_pack_keys<P>(kpack, tmp, prefix, block, g, p, j0, nb, d);
    const index_t nb_pad = round_up(nb, P::nr);
    for (index_t r0 = 0; r0 < rows_pad; r0 += P::mr)
      for (index_t cc = 0; cc < nb_pad; cc += P::nr)
        score_microkernel<P, Fused>(qpack + r0 * d * P::qrep, kpack + cc * d, d, scale,
                                    w + r0 * wld + wc + (j0 - c0) + cc, wld);
  }
  const index_t c = c0 / score_chunk;
  for (index_t r = 0; r < nrows; ++r) {
    if (vis[r] <= c0) continue;
    const index_t m = vis[r] - c0 < n ? vis[r] - c0 : n;
    float* const row = w + r * wld + wc;
    const softmax_stats cs = score_chunk_exp(row, m);
    cmax[r * nchunks + c] = cs.max;
    st[r] = softmax_merge(st[r], cs);
    if (pbuf == nullptr) continue;
#if KVEVICT_HOST_X86_DISPATCH
    if constexpr (std::is_same_v<P, score_profile_avx512>) score_stream_row_avx512(buf + r * ld + c0, row, m);
    else if constexpr (std::is_same_v<P, score_profile_avx2>) score_stream_row_avx2(buf + r * ld + c0, row, m);
    else score_stream_row_base(buf + r * ld + c0, row, m);
#else
    score_stream_row_base(buf + r * ld + c0, row, m);
#endif
  }
}

// One compiled function per profile (the target attribute cannot depend on a template argument).
// KVEVICT_SCORE_PANEL_CALL also serves score_block_softmax, whose variables have the same names.
#define KVEVICT_SCORE_PANEL_ARGS                                                                              \
  float *KVEVICT_RESTRICT buf, index_t ld, float *KVEVICT_RESTRICT pbuf, index_t pld,                          \
      const float *KVEVICT_RESTRICT qpack, index_t nrows,                                                       \
      float *KVEVICT_RESTRICT kpack, float *KVEVICT_RESTRICT tmp, const KS&prefix,              \
      const KS&block, index_t g, index_t p, index_t c0, index_t n, index_t d, float scale,      \
      const index_t *vis, float *KVEVICT_RESTRICT cmax, index_t nchunks, softmax_stats *st
#define KVEVICT_SCORE_PANEL_CALL buf, ld, pbuf, pld, qpack, nrows, kpack, tmp, prefix, block, g, p, c0, n, d, scale, vis, cmax, nchunks, st

template <bool Fused, class KS>
KVEVICT_NO_CONTRACT void score_panel_sse2(KVEVICT_SCORE_PANEL_ARGS) {
  score_panel_body<score_profile_sse2, Fused, KS>(KVEVICT_SCORE_PANEL_CALL);
}

#if KVEVICT_HOST_X86_DISPATCH
template <class KS>
__attribute__((target("avx2,f16c"))) KVEVICT_NO_CONTRACT void score_panel_avx2(KVEVICT_SCORE_PANEL_ARGS) {
  score_panel_body<score_profile_avx2, false, KS>(KVEVICT_SCORE_PANEL_CALL);
}
template <class KS>
__attribute__((target("avx2,fma,f16c"))) KVEVICT_NO_CONTRACT void score_panel_avx2_fma(KVEVICT_SCORE_PANEL_ARGS) {
  score_panel_body<score_profile_avx2, true, KS>(KVEVICT_SCORE_PANEL_CALL);
}
template <class KS>
__attribute__((target("avx512f,avx2,f16c"))) KVEVICT_NO_CONTRACT void score_panel_avx512(KVEVICT_SCORE_PANEL_ARGS) {
  score_panel_body<score_profile_avx512, false, KS>(KVEVICT_SCORE_PANEL_CALL);
}
template <class KS>
__attribute__((target("avx512f,avx2,fma,f16c"))) KVEVICT_NO_CONTRACT void score_panel_avx512_fma(
    KVEVICT_SCORE_PANEL_ARGS) {
  score_panel_body<score_profile_avx512, true, KS>(KVEVICT_SCORE_PANEL_CALL);
}
#endif
#undef KVEVICT_SCORE_PANEL_ARGS

/// Whether the CPU has FMA (the fused AVX2 kernel needs it; AVX-512F includes it).
inline bool score_cpu_has_fma() {
#if KVEVICT_HOST_X86_DISPATCH
  static const bool fma = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("fma") != 0;
  }();
  return fma;
#else
  return false;
#endif
}

/// Whether the plain (separately rounded) panel runs its AVX2 copy where the AVX-512F one is allowed:
/// on a CPU that halves 512-bit operations (host_cpu_halves_512) the AVX2 copy took 0.78-0.82x the
/// AVX-512F one's time (docs/PERFORMANCE.md, "Issue 18, round thirteen"). Same bits; tests turn it
/// off to run the AVX-512F copy there too. Not API.
inline std::atomic<bool>& score_plain_prefers_avx2() noexcept {
  static std::atomic<bool> yes{host_cpu_halves_512()};
  return yes;
}

/// Logits buffers (per thread: [rows][P + w + 32] floats) of more bytes than this are filled through a
/// panel buffer with non-temporal stores (score_panel_body): 8 MiB, about where a long row's buffer
/// stops living in the caches between its panels and the final pass (docs/PERFORMANCE.md, "Issue 18,
/// round sixteen"). Same bits either way; tests set it to 0 to run that path on small shapes. Not API.
inline std::atomic<index_t>& score_stream_min_bytes() noexcept {
  static std::atomic<index_t> bytes{index_t{8} << 20};
  return bytes;
}

/// The softmax of a block of rows, panel by panel (panels of score_chunk columns, see
/// score_panel_body: through the panel buffer pbuf when not null), with the block's queries packed
/// for profile P.
template <class P, bool Fused, class Q, class KS>
void score_block_softmax(float* KVEVICT_RESTRICT buf, index_t ld, float* KVEVICT_RESTRICT pbuf, index_t pld,
                         float* KVEVICT_RESTRICT qpack,
                         float* KVEVICT_RESTRICT kpack, float* KVEVICT_RESTRICT tmp, const kv_view<const Q>& q,
                         index_t head0, index_t w, index_t row0, index_t nrows, const KS& prefix,
                         const KS& block, index_t g, index_t p, index_t cols, float scale,
                         const index_t* vis, float* KVEVICT_RESTRICT cmax, index_t nchunks, softmax_stats* st) {
  const index_t d = q.extent(2);
  score_pack_queries<P>(qpack, tmp, q, head0, w, row0, nrows);
  for (index_t r = 0; r < nrows; ++r) st[r] = softmax_empty();
  for (index_t c0 = 0; c0 < cols; c0 += score_chunk) {
    const index_t n = cols - c0 < score_chunk ? cols - c0 : score_chunk;
    if constexpr (std::is_same_v<P, score_profile_sse2>) {
      score_panel_sse2<Fused, KS>(KVEVICT_SCORE_PANEL_CALL);
#if KVEVICT_HOST_X86_DISPATCH
    } else if constexpr (std::is_same_v<P, score_profile_avx2>) {
      if constexpr (Fused) score_panel_avx2_fma<KS>(KVEVICT_SCORE_PANEL_CALL);
      else score_panel_avx2<KS>(KVEVICT_SCORE_PANEL_CALL);
    } else {
      if constexpr (Fused) score_panel_avx512_fma<KS>(KVEVICT_SCORE_PANEL_CALL);
      else score_panel_avx512<KS>(KVEVICT_SCORE_PANEL_CALL);
#endif
    }
  }
#undef KVEVICT_SCORE_PANEL_CALL
  if (pbuf != nullptr) score_stream_fence();
}

/// score_block_softmax with the active profile. Fused logits on the AVX2 profile need FMA; without
/// it they run on the SSE2 profile (software fmaf: same bits, slower).
template <class Q, class KS>
void score_block_softmax_dispatch(host_isa isa, bool fused, float* buf, index_t ld, float* pbuf, index_t pld,
                                  float* qpack, float* kpack,
                                  float* tmp, const kv_view<const Q>& q, index_t head0, index_t w, index_t row0,
                                  index_t nrows, const KS& prefix, const KS& block,
                                  index_t g, index_t p, index_t cols, float scale, const index_t* vis, float* cmax,
                                  index_t nchunks, softmax_stats* st) {
#define KVEVICT_SCORE_BLOCK_CALL                                                                                 \
  (buf, ld, pbuf, pld, qpack, kpack, tmp, q, head0, w, row0, nrows, prefix, block, g, p, cols, scale, vis, cmax, nchunks, st)
#if KVEVICT_HOST_X86_DISPATCH
  // The product of two fp16 values is exact in fp32 (11 + 11 significant bits; |product| within
  // [2^-48, 2^32], far inside fp32's normal range), so rounding q*k and then the sum gives the same
  // bits as one fused multiply-add: fp16 x fp16 logits take the (faster) fused kernel whenever the
  // CPU has FMA. Not for bf16 (its products can overflow or underflow in fp32) or fp32.
  if constexpr (std::is_same_v<Q, float16> && std::is_same_v<key_elem_t<KS>, float16>) {
    if (isa == host_isa::avx512 || (isa == host_isa::avx2 && score_cpu_has_fma())) fused = true;
  }
  if (isa == host_isa::avx512 && !fused && score_plain_prefers_avx2().load(std::memory_order_relaxed))
    isa = host_isa::avx2;
  if (isa == host_isa::avx512)
    return fused ? score_block_softmax<score_profile_avx512, true> KVEVICT_SCORE_BLOCK_CALL
                 : score_block_softmax<score_profile_avx512, false> KVEVICT_SCORE_BLOCK_CALL;
  if (isa == host_isa::avx2 && (!fused || score_cpu_has_fma()))
    return fused ? score_block_softmax<score_profile_avx2, true> KVEVICT_SCORE_BLOCK_CALL
                 : score_block_softmax<score_profile_avx2, false> KVEVICT_SCORE_BLOCK_CALL;
#else
  (void)isa;
#endif
  return fused ? score_block_softmax<score_profile_sse2, true> KVEVICT_SCORE_BLOCK_CALL
               : score_block_softmax<score_profile_sse2, false> KVEVICT_SCORE_BLOCK_CALL;
#undef KVEVICT_SCORE_BLOCK_CALL
}

/// The factor turning chunk c's exponentials into probabilities: e^(m_c - M) / L.
inline float score_chunk_factor(float chunk_max, softmax_stats row) {
  return softmax_exp(chunk_max - row.max) / row.sum;
}

/// acc[j] += p_j for j < n (n = visible output columns of the row): each product e_j * f and each
/// sum separately rounded, whatever the compiler flags (compiled like the panel kernels).
KVEVICT_ALWAYS_INLINE void score_row_add_body(const float* KVEVICT_RESTRICT e, index_t n,
                                              const float* KVEVICT_RESTRICT cmax, softmax_stats row,
                                              float* KVEVICT_RESTRICT acc) {
  KVEVICT_FP_CONTRACT_OFF
  for (index_t c0 = 0, c = 0; c0 < n; c0 += score_chunk, ++c) {
    const float f = score_chunk_factor(cmax[c], row);
    const index_t end = n - c0 < score_chunk ? n : c0 + score_chunk;
    for (index_t j = c0; j < end; ++j) acc[j] += e[j] * f;
  }
}

/// Welford update of every output column with this row's probability (0 for the columns in
/// [n_visible, n_out) the row does not see). inv_count = 1 / (rows pushed so far, this one included).
KVEVICT_ALWAYS_INLINE void score_row_welford_body(const float* KVEVICT_RESTRICT e, index_t n_visible, index_t n_out,
                                                  const float* KVEVICT_RESTRICT cmax, softmax_stats row,
                                                  float inv_count, float* KVEVICT_RESTRICT mean,
                                                  float* KVEVICT_RESTRICT m2) {
  KVEVICT_FP_CONTRACT_OFF
  for (index_t c0 = 0, c = 0; c0 < n_visible; c0 += score_chunk, ++c) {
    const float f = score_chunk_factor(cmax[c], row);
    const index_t end = n_visible - c0 < score_chunk ? n_visible : c0 + score_chunk;
    for (index_t j = c0; j < end; ++j) welford_push(mean[j], m2[j], e[j] * f, inv_count);
  }
  for (index_t j = n_visible; j < n_out; ++j) welford_push(mean[j], m2[j], 0.0f, inv_count);
}

// The row accumulation is dispatched like the panel kernels (wider vectors; the same bits on every
// profile, FMA contraction off everywhere).
#define KVEVICT_SCORE_ADD_ARGS                                                                     \
  const float *KVEVICT_RESTRICT e, index_t n, const float *KVEVICT_RESTRICT cmax, softmax_stats row, \
      float *KVEVICT_RESTRICT acc
#define KVEVICT_SCORE_WELFORD_ARGS                                                                       \
  const float *KVEVICT_RESTRICT e, index_t n_visible, index_t n_out, const float *KVEVICT_RESTRICT cmax,  \
      softmax_stats row, float inv_count, float *KVEVICT_RESTRICT mean, float *KVEVICT_RESTRICT m2
KVEVICT_NO_CONTRACT inline void score_row_add_sse2(KVEVICT_SCORE_ADD_ARGS) { score_row_add_body(e, n, cmax, row, acc); }
KVEVICT_NO_CONTRACT inline void score_row_welford_sse2(KVEVICT_SCORE_WELFORD_ARGS) {
  score_row_welford_body(e, n_visible, n_out, cmax, row, inv_count, mean, m2);
}
#if KVEVICT_HOST_X86_DISPATCH
__attribute__((target("avx2"))) KVEVICT_NO_CONTRACT inline void score_row_add_avx2(KVEVICT_SCORE_ADD_ARGS) {
  score_row_add_body(e, n, cmax, row, acc);
}
__attribute__((target("avx512f,avx2"))) KVEVICT_NO_CONTRACT inline void score_row_add_avx512(KVEVICT_SCORE_ADD_ARGS) {
  score_row_add_body(e, n, cmax, row, acc);
}
__attribute__((target("avx2"))) KVEVICT_NO_CONTRACT inline void score_row_welford_avx2(KVEVICT_SCORE_WELFORD_ARGS) {
  score_row_welford_body(e, n_visible, n_out, cmax, row, inv_count, mean, m2);
}
__attribute__((target("avx512f,avx2"))) KVEVICT_NO_CONTRACT inline void score_row_welford_avx512(
    KVEVICT_SCORE_WELFORD_ARGS) {
  score_row_welford_body(e, n_visible, n_out, cmax, row, inv_count, mean, m2);
}
#endif
#undef KVEVICT_SCORE_ADD_ARGS
#undef KVEVICT_SCORE_WELFORD_ARGS

/// acc[j] += p_j for j < n, on the active profile.
inline void score_row_add(host_isa isa, const float* e, index_t n, const float* cmax, softmax_stats row, float* acc) {
#if KVEVICT_HOST_X86_DISPATCH
  if (isa == host_isa::avx512) return score_row_add_avx512(e, n, cmax, row, acc);
  if (isa == host_isa::avx2) return score_row_add_avx2(e, n, cmax, row, acc);
#else
  (void)isa;
#endif
  score_row_add_sse2(e, n, cmax, row, acc);
}

/// The Welford update of score_row_welford_body, on the active profile.
inline void score_row_welford(host_isa isa, const float* e, index_t n_visible, index_t n_out, const float* cmax,
                              softmax_stats row, float inv_count, float* mean, float* m2) {
#if KVEVICT_HOST_X86_DISPATCH
  if (isa == host_isa::avx512) return score_row_welford_avx512(e, n_visible, n_out, cmax, row, inv_count, mean, m2);
  if (isa == host_isa::avx2) return score_row_welford_avx2(e, n_visible, n_out, cmax, row, inv_count, mean, m2);
#else
  (void)isa;
#endif
  score_row_welford_sse2(e, n_visible, n_out, cmax, row, inv_count, mean, m2);
}

// ---- host threading with a per-thread scratch slot ---------------------------------------------
// Results never depend on the partition (see the file comment), so par may schedule dynamically.

/// Calls f(task, slot) for task in [0, n), slot in [0, threads) unique among concurrent calls
/// (detail::parallel_for_workers: seq in order, par OpenMP dynamic, on(ex) the executor's workers).
template <class Backend, class F>
void score_parallel(Backend be, index_t n, int threads, F&& f) {
  parallel_for_workers(be, n, threads, f);
}

KVEVICT_SCORE_ABI_END
}  // namespace kvevict::detail
