// Host kernel of the value rows' L1 norms (weight.hpp's weight_by_value_norm, the fused
// post-processing's value weighting): value_l1_norm of many rows at once, vectorised across rows.
// Nothing here is API.
//
// Each norm keeps value_l1_norm's definition bit for bit (one sequential fp32 sum 0 + |v_0| + |v_1| +
// ... + |v_{d-1}| per row, stage_math.hpp): 16 rows are one vector of 16 lanes, each lane adding its
// own row's elements in order, so only the work is spread across lanes, never a row's sum. The
// elements are widened (|to_float|, exact and branch-free, so the loop vectorises) into a block
// [64 elements][16 rows] on the stack and the lanes add the block column by column. Three copies
// on x86-64 (SSE2, AVX2, AVX-512F, chosen at run time), all the same operations; contiguous fp16 and
// bf16 rows take value_l1_norms16_avx2 at both wider levels (8 rows a vector, two vectors at a time,
// transposed as 16-bit words), the rows it leaves (n mod 8) the level's own copy.
#pragma once

#include <kvevict/detail/base/softmax.hpp>
#include <kvevict/detail/host/entropy_host.hpp>
#include <kvevict/numeric.hpp>

#include <cstdint>
#include <type_traits>

namespace kvevict::detail {
KVEVICT_SCORE_ABI_BEGIN

/// The bits of |to_float(v)|, branch-free (NaN payloads kept, the sign cleared).
KVEVICT_ALWAYS_INLINE std::uint32_t abs_float_bits(float v) noexcept { return float_bits(v) & 0x7fffffffu; }
KVEVICT_ALWAYS_INLINE std::uint32_t abs_float_bits(bfloat16 v) noexcept {
  return (static_cast<std::uint32_t>(v.bits) << 16) & 0x7fffffffu;
}
KVEVICT_ALWAYS_INLINE std::uint32_t abs_float_bits(float16 v) noexcept {
  const std::uint32_t h = v.bits & 0x7fffu, e = h >> 10, m = h & 0x3ffu;
  const std::uint32_t normal = (h << 13) + (112u << 23);               // exponent rebiased by 127 - 15
  const std::uint32_t special = 0x7f800000u | (m << 13);                // inf, NaN (payload kept)
  const std::uint32_t sub = float_bits(static_cast<float>(static_cast<std::int32_t>(m)) * 5.9604644775390625e-8f);  // m 2^-24, exact
  return select_bits(e == 0x1fu, special, select_bits(e == 0u, sub, normal));
}

/// Rows per block (one lane each) and elements per stage; callers ask for up to norm_block rows at
/// a time (a stack array of norms).
constexpr index_t norm_rows = 16, norm_cols = 64, norm_block = 64;
/// How far ahead value_l1_norms16_avx2 prefetches (rows: two of its 16-row blocks).
constexpr index_t norm_prefetch_rows = 32;

/// norms[r] = value_l1_norm(base + r rs, d, es) for r < n.
template <class VE>
KVEVICT_ALWAYS_INLINE void value_l1_norms_body(const VE* base, index_t rs, index_t es, index_t n, index_t d,
                                               float* KVEVICT_RESTRICT norms) noexcept {
  KVEVICT_FP_CONTRACT_OFF
  alignas(64) float tmp[norm_cols][norm_rows];
  for (index_t r0 = 0; r0 < n; r0 += norm_rows) {
    const index_t nr = n - r0 < norm_rows ? n - r0 : norm_rows;
    alignas(64) float acc[norm_rows] = {};
    for (index_t t0 = 0; t0 < d; t0 += norm_cols) {
      const index_t m = d - t0 < norm_cols ? d - t0 : norm_cols;
      for (index_t l = 0; l < norm_rows; ++l) {
        if (l < nr) {
          const VE* KVEVICT_RESTRICT row = base + (r0 + l) * rs + t0 * es;
          if (es == 1)
            for (index_t t = 0; t < m; ++t) tmp[t][l] = bits_float(abs_float_bits(row[t]));
          else
            for (index_t t = 0; t < m; ++t) tmp[t][l] = bits_float(abs_float_bits(row[t * es]));
        } else {
          for (index_t t = 0; t < m; ++t) tmp[t][l] = 0.0f;
        }
      }
      for (index_t t = 0; t < m; ++t)
        for (index_t l = 0; l < norm_rows; ++l) acc[l] += tmp[t][l];
    }
    for (index_t l = 0; l < nr; ++l) norms[r0 + l] = acc[l];
  }
}

template <class VE>
KVEVICT_NO_CONTRACT inline void value_l1_norms_sse2(const VE* base, index_t rs, index_t es, index_t n, index_t d,
                                                    float* norms) {
  value_l1_norms_body(base, rs, es, n, d, norms);
}
#if KVEVICT_HOST_X86_DISPATCH
template <class VE>
__attribute__((target("avx2"))) KVEVICT_NO_CONTRACT inline void value_l1_norms_avx2(const VE* base, index_t rs,
                                                                                    index_t es, index_t n, index_t d,
                                                                                    float* norms) {
  value_l1_norms_body(base, rs, es, n, d, norms);
}

/// widen(h_k) of 8 packed 16-bit values (fp16 by F16C, bf16 by a shift), exact (F16C quiets a
/// signalling NaN; sums keep only NaN-ness anyway).
template <class VE>
__attribute__((target("avx2,f16c"))) KVEVICT_ALWAYS_INLINE __m256 widen8(__m128i h) noexcept {
  if constexpr (std::is_same_v<VE, float16>) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/// acc += |v_k| of 8 contiguous 16-bit rows p + i rs (lane i = row i) for the 16 elements k at p, in
/// order. The 8 loads of 32 bytes are masked to their magnitudes (the sign bit cleared: the widened
/// value is then |to_float|) and transposed as 16-bit words before any widening (three unpack
/// stages, 24 shuffles for 128 elements: half the bytes of widening first and transposing fp32),
/// which leaves c_k = [the rows' element k | their element k + 8].
template <class VE>
__attribute__((target("avx2,f16c"))) KVEVICT_ALWAYS_INLINE __m256 l1_add16x8(__m256 acc, const VE* p,
                                                                             index_t rs) noexcept {
  constexpr index_t rows = 8;
  const __m256i mag = _mm256_set1_epi16(0x7fff);
  __m256i x[rows], a[rows], b[rows], c[rows];
  for (index_t i = 0; i < rows; ++i)
    x[i] = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i * rs)), mag);
  // a[2i], a[2i + 1]: rows 2i and 2i + 1 interleaved, elements 0-3 | 8-11 and 4-7 | 12-15
  for (index_t i = 0; i < rows / 2; ++i) {
    a[2 * i] = _mm256_unpacklo_epi16(x[2 * i], x[2 * i + 1]);
    a[2 * i + 1] = _mm256_unpackhi_epi16(x[2 * i], x[2 * i + 1]);
  }
  // b[j] (rows 0-3) and b[4 + j] (rows 4-7): elements 2j, 2j + 1 | 2j + 8, 2j + 9
  for (index_t h = 0; h < 2; ++h) {
    const __m256i* in = a + 4 * h;
    b[4 * h] = _mm256_unpacklo_epi32(in[0], in[2]);
    b[4 * h + 1] = _mm256_unpackhi_epi32(in[0], in[2]);
    b[4 * h + 2] = _mm256_unpacklo_epi32(in[1], in[3]);
    b[4 * h + 3] = _mm256_unpackhi_epi32(in[1], in[3]);
  }
  for (index_t j = 0; j < 4; ++j) {
    c[2 * j] = _mm256_unpacklo_epi64(b[j], b[4 + j]);
    c[2 * j + 1] = _mm256_unpackhi_epi64(b[j], b[4 + j]);
  }
  for (index_t k = 0; k < rows; ++k) acc = _mm256_add_ps(acc, widen8<VE>(_mm256_castsi256_si128(c[k])));
  for (index_t k = 0; k < rows; ++k) acc = _mm256_add_ps(acc, widen8<VE>(_mm256_extracti128_si256(c[k], 1)));
  return acc;
}

/// The copy for contiguous 16-bit rows (fp16, bf16) on AVX2 and AVX-512F CPUs: 8 rows a vector (lane
/// l = row l, each lane adding |v_k| for k = 0, 1, ... in order: each row is still one sequential sum,
/// value_l1_norm's bits), two vectors (16 contiguous rows, two independent chains of adds) at a time,
/// then one of 8; the last d % 16 elements are added row by row after. Why (docs/PERFORMANCE.md,
/// "Issue 18, round seventeen"): one chain waits on the adds' latency when the values are in L3 (4K
/// tokens); reading 16 rows at a time streams badly from DRAM (32K tokens) unless the rows two blocks
/// ahead are prefetched, in address order; four chains (32 rows at a time) streamed 2.6x slower still.
/// Returns the rows done (a multiple of 8).
template <class VE>
__attribute__((target("avx2,f16c"))) KVEVICT_NO_CONTRACT inline index_t value_l1_norms16_avx2(
    const VE* base, index_t rs, index_t n, index_t d, float* norms) noexcept {
  static_assert(sizeof(VE) == 2, "16-bit values only");
  constexpr index_t rows = 8;
  const index_t d16 = d - d % 16;
  index_t r0 = 0;
  // software prefetch of the 16 rows two blocks ahead, 512 bytes a step in address order: the whole
  // block when rs = d (with longer strides, the first 512 bytes x steps of it); also past n (the next
  // call's rows; a prefetch never faults, integer addresses)
  for (; r0 + 2 * rows <= n; r0 += 2 * rows) {
    const auto ahead = reinterpret_cast<std::uintptr_t>(base) +
                       static_cast<std::uintptr_t>((r0 + norm_prefetch_rows) * rs) * sizeof(VE);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (index_t t0 = 0; t0 < d16; t0 += 16) {
      for (index_t q = 0; q < 8; ++q)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + static_cast<std::uintptr_t>(t0 * 32 + q * 64)), _MM_HINT_T0);
      for (index_t g = 0; g < 2; ++g) acc[g] = l1_add16x8(acc[g], base + (r0 + g * rows) * rs + t0, rs);
    }
    for (index_t g = 0; g < 2; ++g) _mm256_storeu_ps(norms + r0 + g * rows, acc[g]);
  }
  if (r0 + rows <= n) {
    __m256 acc = _mm256_setzero_ps();
    for (index_t t0 = 0; t0 < d16; t0 += 16) acc = l1_add16x8(acc, base + r0 * rs + t0, rs);
    _mm256_storeu_ps(norms + r0, acc);
    r0 += rows;
  }
  if (d16 < d)
    for (index_t l = 0; l < r0; ++l) norms[l] = value_l1_accumulate(norms[l], base + l * rs + d16, d - d16, 1);
  return r0;
}

/// The AVX-512 copy: 16 contiguous rows at a time widened and transposed in registers by the score
/// stage's packing (score_pack16_avx512: [64 elements][16 rows] per stage, exact), then |x| added
/// lane by lane (lane l = row l, its elements in order); rows of a partial block as in
/// value_l1_norms_body. Same operations, same bits.
template <class VE>
__attribute__((target("avx512f,avx2,f16c"))) KVEVICT_NO_CONTRACT inline void value_l1_norms_avx512(
    const VE* base, index_t rs, index_t es, index_t n, index_t d, float* norms) {
  index_t r0 = 0;
  if (es == 1) {
    constexpr __mmask16 all = 0xFFFF;
    const __m512i mag = _mm512_set1_epi32(0x7fffffff);
    alignas(64) float tmp[norm_cols * norm_rows];
    // norm_block rows (four blocks of 16) at a time: four independent chains of adds (each lane still
    // adds its own row in order), the next norm_block rows prefetched
    constexpr index_t nb = norm_block / norm_rows;
    alignas(64) float tmps[nb][norm_cols * norm_rows];
    const index_t row_bytes = d * static_cast<index_t>(sizeof(VE));
    for (; r0 + norm_block <= n; r0 += norm_block) {
      // callers ask for norm_block rows at a time: the prefetch covers the rows the next call reads
      // (past n too: a prefetch never faults; integer addresses, no pointer past the array)
      const auto at = reinterpret_cast<std::uintptr_t>(base);
      for (index_t l = r0 + norm_block; l < r0 + 2 * norm_block; ++l) {
        const std::uintptr_t row = at + static_cast<std::uintptr_t>(l * rs) * sizeof(VE);
        for (index_t b = 0; b < row_bytes; b += 64)
          _mm_prefetch(reinterpret_cast<const char*>(row + static_cast<std::uintptr_t>(b)), _MM_HINT_T0);
      }
      __m512 acc[nb];
      for (index_t k = 0; k < nb; ++k) acc[k] = _mm512_setzero_ps();
      for (index_t t0 = 0; t0 < d; t0 += norm_cols) {
        const index_t m = d - t0 < norm_cols ? d - t0 : norm_cols;
        const VE* rows[norm_block];
        for (index_t l = 0; l < norm_block; ++l) rows[l] = base + (r0 + l) * rs + t0;
        for (index_t k = 0; k < nb; ++k) score_pack16_avx512(tmps[k], norm_rows, rows + k * norm_rows, m);
        for (index_t t = 0; t < m; ++t)
          for (index_t k = 0; k < nb; ++k)
            acc[k] = _mm512_maskz_add_ps(
                all, acc[k],
                _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_load_ps(tmps[k] + t * norm_rows)), mag)));
      }
      for (index_t k = 0; k < nb; ++k) _mm512_storeu_ps(norms + r0 + k * norm_rows, acc[k]);
    }
    for (; r0 + norm_rows <= n; r0 += norm_rows) {
      __m512 acc = _mm512_setzero_ps();
      for (index_t t0 = 0; t0 < d; t0 += norm_cols) {
        const index_t m = d - t0 < norm_cols ? d - t0 : norm_cols;
        const VE* rows[norm_rows];
        for (index_t l = 0; l < norm_rows; ++l) rows[l] = base + (r0 + l) * rs + t0;
        score_pack16_avx512(tmp, norm_rows, rows, m);
        for (index_t t = 0; t < m; ++t)
          acc = _mm512_maskz_add_ps(
              all, acc, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_load_ps(tmp + t * norm_rows)), mag)));
      }
      _mm512_storeu_ps(norms + r0, acc);
    }
  }
  value_l1_norms_body(base + r0 * rs, rs, es, n - r0, d, norms + r0);
}
#endif

/// norms[r] = value_l1_norm(base + r rs, d, es) for r < n (the bits of value_l1_norm), on the host.
template <class VE>
inline void value_l1_norms(const VE* base, index_t rs, index_t es, index_t n, index_t d, float* norms) {
#if KVEVICT_HOST_X86_DISPATCH
  const host_isa isa = host_isa_now();
  if constexpr (sizeof(VE) == 2) {
    if (isa != host_isa::baseline && es == 1) {  // (the transposing copy above; the rest below)
      const index_t done = value_l1_norms16_avx2(base, rs, n, d, norms);
      base += done * rs;
      n -= done;
      norms += done;
    }
  }
  switch (isa) {
    case host_isa::avx512: return value_l1_norms_avx512(base, rs, es, n, d, norms);
    case host_isa::avx2: return value_l1_norms_avx2(base, rs, es, n, d, norms);
    default: break;
  }
#endif
  value_l1_norms_sse2(base, rs, es, n, d, norms);
}

/// The fold m = max_nan(m, x[k]) for k < n (the head-max weight's maximum of norms, in order: the
/// last NaN wins, else the maximum). When m and every x[k] are non-negative and not NaN (norms
/// always are, unless a value is NaN), the maximum of their bits is that fold's result (the bits
/// of +0 ... +inf are in the order of the floats, equal floats equal bits): integer loops that
/// vectorise instead of a branch per element; otherwise the fold itself.
inline float max_nan_fold(float m, const float* x, index_t n) noexcept {
  std::uint32_t sign_or_nan = float_bits(m) >> 31 | (m != m ? 1u : 0u), top = float_bits(m);
  for (index_t k = 0; k < n; ++k) {
    const std::uint32_t b = float_bits(x[k]);
    sign_or_nan |= (b >> 31) | ((b & 0x7fffffffu) > 0x7f800000u ? 1u : 0u);
    top = b > top ? b : top;
  }
  if (sign_or_nan == 0) return bits_float(top);
  for (index_t k = 0; k < n; ++k) m = max_nan(m, x[k]);
  return m;
}

KVEVICT_SCORE_ABI_END
}  // namespace kvevict::detail
